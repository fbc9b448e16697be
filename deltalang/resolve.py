"""Check a parsed program against a model's shape and make it concrete: `resolve()`.

The resolver answers every question that needs the model but not its weights
(a `deltalang.spec.ModelSpec`): which blocks a selector covers, whether a value
exists on each of them, which token a position means in each run's prompt,
which run a `from` takes its value from, which token id `prob(" Paris")`
measures. It reports ALL the errors of a file at once (a `DeltaErrors`, or a
single `DeltaResolveError`), each pointing at its source.

It never guesses silently. What cannot mean what was written is an error: a
program with nothing to run; statements outside any run (the implicit trace
`main`) with several prompts to choose from and neither --prompt nor a prompt
named `main`; a measured answer that is several tokens, or that the tokenizer
only knows as its unknown token (prob of `<unk>` is not prob of " Zürich").
What runs but not exactly as written is a `DeltaWarning` on
`Resolved.warnings`, naming the tokens chosen: a quoted position that cuts a
token or lands on the unknown token, a prompt with words the tokenizer does not
know (how many of how many), a `model "ID"` line other than the model it is
checked against (the caller's --model or model= wins).

Its output, `Resolved`, is the compiler's input: runs in source order, each with
one `ResolvedOp` per block and every position a plain non-negative token index.
Sweeps stay templates (ops whose block or position is a sweep variable) with
their axes resolved; `ResolvedRun.points()` and `ResolvedRun.instantiate()`
expand them.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Iterator, NoReturn, Sequence

import attrs

from . import ast, values
from .errors import DeltaError, DeltaErrors, DeltaResolveError, DeltaWarning, Span
from .spec import ModelSpec
from .ir import (FromRun, Mean, Named, Resolved, ResolvedMeasure, ResolvedOp, ResolvedRun, Scale, SweepAxis,
                 Zeros, measure_result_name, op_result_name, site_text, _measure_call_text)
from .tokens import PromptTokens, token_id, tokenize


# ---- the resolver ----------------------------------------------------------------


def resolve(program: ast.Program, spec: ModelSpec, *, prompt_override: str | None = None,
            source: str = "", filename: str = "<program>") -> Resolved:
    """Check `program` against `spec` and make it concrete. Raises DeltaErrors / DeltaResolveError.

    `prompt_override` is the prompt of the implicit run `main` (the CLI's --prompt);
    `source` and `filename`, when given, locate the errors for rendering.
    """
    try:
        return _Resolver(program, spec, prompt_override, source, filename).run()
    except DeltaError as e:
        raise (e.located(source, filename) if source else e) from None


def _values_of_block_var(body: Sequence[ast.Statement], var: str) -> set[str]:
    """The catalogue values a sweep body reads or writes on the block variable `var`."""
    return {node.value for node in ast.walk(tuple(body))
            if isinstance(node, ast.Site) and isinstance(node.block, ast.BlockVar) and node.block.name == var
            and node.value in values.CATALOGUE}


class _Fail(Exception):
    """Internal: abandon the node being resolved (its error is already recorded)."""


@attrs.define
class _Alias:
    """What `read ... as NAME` (or `measure ... as NAME`) defines."""

    run: str
    kind: str  # "read" | "measure"
    span: Span
    entries: dict[int | None, str] = attrs.Factory(dict)  # layer -> result name
    value: str | None = None
    in_sweep: bool = False


@attrs.define
class _Ctx:
    """Where a statement is being resolved: its run, its prompt, its step."""

    name: str
    kind: str
    prompt: str
    toks: PromptTokens
    max_new_tokens: int | None
    axes: dict[str, SweepAxis]
    step: int | None = None
    route: str | None = None
    used: set[str] = attrs.Factory(set)
    broken: set[str] = attrs.Factory(set)  # sweep variables whose axis did not resolve


@attrs.define
class _Target:
    """One block (or model-level value) a site stands for, before it becomes an op."""

    layer: int | None
    value: str
    position: int | None
    layer_var: str | None
    position_var: str | None
    written: str
    multi: bool
    step: int | None
    raw: ast.Position | None = None  # the position as written


_STATE_SHAPED = {"state_input", "state_output", "state_after"}
_HIDDEN_SHAPED = {"output", "attention_output"}


def _shape_class(value: str) -> str:
    if value in _STATE_SHAPED:
        return "state"
    if value in _HIDDEN_SHAPED:
        return "hidden"
    return value


def _shape(value: str) -> str:
    v = values.get(value)
    return v.shape if v is not None else values.MODEL_VALUES.get(value, "?")


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def _same_model(declared: str, used: str) -> bool:
    """Whether a program's `model "ID"` names the model it is checked against (an id, or the same directory)."""
    if declared == used:
        return True
    a, b = Path(declared), Path(used)
    return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()


def _did_you_mean(word: str, options: Sequence[str]) -> str:
    guess = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean '{guess[0]}'?" if guess else ""


class _Resolver:
    """One resolution: walks the program once, records every error, builds `Resolved`."""

    def __init__(self, program: ast.Program, spec: ModelSpec, prompt_override: str | None,
                 source: str, filename: str) -> None:
        self.program = program
        self.spec = spec
        self.override = prompt_override
        self.source = source
        self.filename = filename
        self.errors: list[DeltaError] = []
        self.warnings: list[DeltaWarning] = []
        self.unk: int | None = getattr(spec.tokenizer, "unk_token_id", None)  # None: the tokenizer has none
        self.prompts: dict[str, ast.PromptDecl | ast.PromptListDecl] = {}
        self.prompt_texts: dict[str, str | tuple[str, ...]] = {}
        self.runs: dict[str, ast.Trace | ast.Generate | ast.Sweep] = {}
        self.defined: dict[str, tuple[str, Span]] = {}
        self.aliases: dict[str, _Alias] = {}
        self.main_items: list[ast.Statement] = []
        self.main_prompt: str | None = None
        self.model: str | None = None
        self.model_span: Span | None = None
        self.global_route: str | None = None
        self.implicit: dict[str, Span] = {}  # prompts that need a clean run of their own
        self.tok_cache: dict[str, PromptTokens] = {}
        self.deferred: list[tuple[list[Any], int, Any]] = []

    # -- errors --

    def error(self, message: str, span: Span | None, notes: Sequence[str] = ()) -> None:
        self.errors.append(DeltaResolveError(message, span, notes=notes))

    def fail(self, message: str, span: Span | None, notes: Sequence[str] = ()) -> NoReturn:
        self.error(message, span, notes)
        raise _Fail

    def warn(self, message: str, span: Span | None, notes: Sequence[str] = ()) -> None:
        w = DeltaWarning(message, span, notes=notes)
        self.warnings.append(w.located(self.source, self.filename) if self.source else w)

    def sorted_warnings(self) -> tuple[DeltaWarning, ...]:
        """The warnings in source order, each once (a site over several blocks resolves its position once each)."""
        seen: dict[tuple[str, Span | None], DeltaWarning] = {}
        for w in self.warnings:
            seen.setdefault((w.message, w.span), w)
        return tuple(sorted(seen.values(), key=lambda w: (w.span.line, w.span.column) if w.span else (0, 0)))

    # -- the whole program --

    def run(self) -> Resolved:
        self.declare()
        drafts: dict[int, list[_Draft]] = {}
        main_index = None
        for i, item in enumerate(self.program.items):
            if isinstance(item, ast.RUN_TYPES):
                d = self.resolve_run(item)
                if d is not None:
                    drafts[i] = [d]
            elif isinstance(item, ast.STATEMENT_TYPES) and not isinstance(item, ast.Route) and main_index is None:
                main_index = i
        if main_index is not None:
            d = self.resolve_main()
            if d is not None:
                drafts.setdefault(main_index, []).append(d)
        self.finish_deferred()
        runs: list[ResolvedRun] = []
        for i, item in enumerate(self.program.items):
            if isinstance(item, ast.PromptDecl) and item.name in self.implicit:
                decl = self.prompts[item.name]  # --prompt may have replaced `main`
                if isinstance(decl, ast.PromptDecl):
                    runs.append(self.implicit_run(decl))
            runs.extend(d.build() for d in drafts.get(i, []))
        if self.errors:
            errs = sorted(self.errors, key=lambda e: (e.span.line, e.span.column) if e.span else (0, 0))
            raise errs[0] if len(errs) == 1 else DeltaErrors(list(errs))
        return Resolved(self.model, dict(self.prompt_texts), tuple(runs), self.spec, self.source, self.filename,
                        self.sorted_warnings())

    def define(self, name: str, kind: str, span: Span) -> bool:
        """Enter a name; a second definition is an error pointing at the first."""
        if name in self.defined:
            other_kind, other = self.defined[name]
            self.error(f"'{name}' is already defined: {other_kind} '{name}' at line {other.line}", span)
            return False
        self.defined[name] = (kind, span)
        return True

    def declare(self) -> None:
        """First pass: the model, prompts, runs, and the names reads define."""
        for item in self.program.items:
            if isinstance(item, ast.ModelDecl):
                if self.model is not None:
                    self.error("a program names its model once", item.span)
                else:
                    self.model_span = item.span
                self.model = item.name
            elif isinstance(item, ast.PromptDecl):
                if self.define(item.name, "prompt", item.span):
                    self.prompts[item.name] = item
                    self.prompt_texts[item.name] = item.text
            elif isinstance(item, ast.PromptListDecl):
                if self.define(item.name, "prompt list", item.span):
                    self.prompts[item.name] = item
                    self.prompt_texts[item.name] = item.texts
            elif isinstance(item, ast.RUN_TYPES):
                if self.define(item.name, item.__class__.__name__.lower(), item.span):
                    self.runs[item.name] = item
            elif isinstance(item, ast.Route):
                if self.global_route is not None and self.global_route != item.kernel:
                    self.error(f"the program already routes '{self.global_route}'", item.span)
                self.global_route = item.kernel
            else:
                self.main_items.append(item)
        if not self.main_items and not any(isinstance(item, ast.RUN_TYPES) for item in self.program.items):
            self.error("nothing to run: the program has no trace, generate or sweep, and no statement outside "
                       "them", Span(1, 1, 1, 1))
        if self.model is not None and self.model_span is not None and not _same_model(self.model,
                                                                                       self.spec.model_id):
            self.warn(f"the program names model {ast.quote(self.model)}, but the caller's model is used: "
                      f"{self.spec.model_id} (--model or model=); this line is ignored", self.model_span)
        for name, p in self.prompts.items():
            if isinstance(p, ast.PromptDecl):
                self.unknown_words(p.text, f"prompt '{name}'", p.span)
            else:
                for text in p.texts:
                    self.unknown_words(text, f"prompt {ast.quote(text)} of '{name}'", p.span)
        if self.main_items:
            self.choose_main_prompt()
        for item in self.program.items:
            if isinstance(item, ast.RUN_TYPES):
                self.declare_aliases(item.name, item.body, isinstance(item, ast.Sweep))
        self.declare_aliases("main", self.main_items, False)

    def choose_main_prompt(self) -> None:
        """The implicit run `main`: on --prompt, else the prompt `main`, else the first prompt."""
        first = self.main_items[0]
        if "main" in self.runs:
            self.error("a run is named 'main', and the statements outside any block form the run 'main' too",
                       self.runs["main"].span)
        elif "main" not in self.defined:
            self.defined["main"] = ("run", first.span)
        if self.override is not None:  # --prompt: the prompt `main`, replacing a declared one
            span = self.prompts["main"].span if "main" in self.prompts else first.span
            self.prompts["main"] = ast.PromptDecl("main", self.override, span=span)
            self.prompt_texts["main"] = self.override
            self.main_prompt = "main"
            self.unknown_words(self.override, f"the prompt of 'main' (--prompt or prompt=) {ast.quote(self.override)}",
                               None)
            return
        if isinstance(self.prompts.get("main"), ast.PromptDecl):
            self.main_prompt = "main"
            return
        single = [p.name for p in self.prompts.values() if isinstance(p, ast.PromptDecl)]
        if len(single) == 1:
            self.main_prompt = single[0]
            return
        if single:
            self.error(f"statements outside a run form the implicit trace 'main', which needs one prompt; this "
                       f"program declares {len(single)}: {', '.join(single)}; put them in "
                       f"'trace NAME on PROMPT {{ ... }}', name one prompt 'main', or pass --prompt TEXT", first.span)
            return
        self.error("statements outside a block run on a prompt, and there is none: pass --prompt TEXT "
                   "or declare one (prompt main = \"...\")", first.span)

    def declare_aliases(self, run: str, body: Sequence[ast.Statement], in_sweep: bool) -> None:
        """Enter the names `read ... as NAME` and `measure ... as NAME` define (forward uses are fine)."""
        for st in body:
            inner = st.body if isinstance(st, ast.Step) else st
            if isinstance(inner, (ast.Read, ast.Measure)) and inner.alias is not None:
                kind = "read" if isinstance(inner, ast.Read) else "measure"
                if inner.alias == "zeros":
                    self.error("'zeros' is reserved ('= zeros'); name the result something else", inner.span)
                elif self.define(inner.alias, kind, inner.span):
                    self.aliases[inner.alias] = _Alias(run, kind, inner.span, in_sweep=in_sweep)

    # -- prompts and runs --

    def tokens(self, text: str) -> PromptTokens:
        if text not in self.tok_cache:
            self.tok_cache[text] = tokenize(self.spec, text)
        return self.tok_cache[text]

    def prompt_for_run(self, name: str, span: Span) -> str:
        """The text of the prompt a run is on; errors for lists, runs, unknown names."""
        p = self.prompts.get(name)
        if isinstance(p, ast.PromptDecl):
            return p.text
        if isinstance(p, ast.PromptListDecl):
            self.fail(f"'{name}' is a prompt list; a run is on one prompt (lists feed '= mean({name})')", span)
        if name in self.runs:
            self.fail(f"'{name}' is a run, not a prompt", span)
        known = self.prompt_names()
        self.fail(f"unknown prompt '{name}'" + _did_you_mean(name, known), span,
                  notes=[f"the prompts: {', '.join(known)}" if known else f"declare it: prompt {name} = \"...\""])

    def unknown_words(self, text: str, what: str, span: Span | None) -> None:
        """An error for a prompt of no tokens; a warning when the tokenizer can read words of it only as
        its unknown token: how many, which."""
        toks = self.tokens(text)
        if len(toks) == 0:
            self.error(f"{what} is empty: a run needs at least one token", span or Span(1, 1, 1, 1))
            return
        if self.unk is None:
            return
        unknown = toks.unknown(self.unk)
        if not unknown:
            return
        words = list(dict.fromkeys(toks.text[slice(*toks.offsets[i])].strip() or toks.display[i] for i in unknown))
        shown = ", ".join(ast.quote(w) for w in words[:8]) + (", ..." if len(words) > 8 else "")
        self.warn(f"{what}: {len(unknown)} of {_tokens(len(toks))} are unknown to this model's tokenizer, "
                  f"so the model reads {self.spec.tokenizer.unk_token!r} in their place: {shown}", span)

    def prompt_names(self) -> list[str]:
        return [n for n, p in self.prompts.items() if isinstance(p, ast.PromptDecl)]

    def header_span(self, run: ast.Trace | ast.Generate | ast.Sweep) -> Span:
        """The span of `on PROMPT` in a run's header when the source is known, else the header's."""
        s = run.span
        lines = self.source.split("\n")
        if 1 <= s.line <= len(lines):
            m = re.compile(rf"\bon\s+({re.escape(run.prompt)})\b").search(lines[s.line - 1], s.column - 1)
            if m is not None:
                return Span(s.line, m.start(1) + 1, s.line, m.end(1) + 1)
        return Span(s.line, s.column, s.line, s.column + len(ast.format_run_header(run)))

    def resolve_run(self, run: ast.Trace | ast.Generate | ast.Sweep) -> "_Draft | None":
        if self.runs.get(run.name) is not run:
            return None
        hs = self.header_span(run)
        try:
            text = self.prompt_for_run(run.prompt, hs)
        except _Fail:
            return None
        toks = self.tokens(text)
        kind = {ast.Trace: "trace", ast.Generate: "generate", ast.Sweep: "sweep"}[type(run)]
        max_new = run.max_new_tokens if isinstance(run, ast.Generate) else None
        if max_new is not None and max_new < 1:
            self.error(f"generate makes at least one new token: max_new_tokens {max_new}", hs)
            return None
        ctx = _Ctx(run.name, kind, run.prompt, toks, max_new, {})
        axes: tuple[SweepAxis, ...] = ()
        if isinstance(run, ast.Sweep):
            axes = self.resolve_axes(run, ctx)
            ctx.axes = {a.var: a for a in axes}
            ctx.broken = {a.var for a in run.axes} - set(ctx.axes)
        ops, measures = self.resolve_body(run.body, ctx)
        for a in axes:
            if a.var not in ctx.used:
                self.error(f"sweep variable '{a.var}' is never used in the body of '{run.name}'", a.span)
        head = ResolvedRun(run.name, kind, run.prompt, text, toks.ids, toks.display, max_new, False,
                           route=ctx.route or self.global_route, axes=axes, span=run.span)
        return _Draft(head, ops, measures)

    def resolve_main(self) -> "_Draft | None":
        if self.main_prompt is None:
            return None
        text = self.prompt_texts[self.main_prompt]
        assert isinstance(text, str)
        toks = self.tokens(text)
        ctx = _Ctx("main", "trace", self.main_prompt, toks, None, {})
        ops, measures = self.resolve_body(self.main_items, ctx)
        head = ResolvedRun("main", "trace", self.main_prompt, text, toks.ids, toks.display, None, True,
                           route=ctx.route or self.global_route, span=self.main_items[0].span)
        return _Draft(head, ops, measures)

    def implicit_run(self, decl: ast.PromptDecl) -> ResolvedRun:
        toks = self.tokens(decl.text)
        return ResolvedRun(decl.name, "trace", decl.name, decl.text, toks.ids, toks.display, None, True,
                           (), (), self.global_route, (), span=decl.span)

    def resolve_axes(self, run: ast.Sweep, ctx: _Ctx) -> tuple[SweepAxis, ...]:
        out: list[SweepAxis] = []
        seen: set[str] = set()
        for axis in run.axes:
            if axis.var in seen:
                self.error(f"sweep variable '{axis.var}' is bound twice", axis.span)
                continue
            seen.add(axis.var)
            try:
                out.append(self.resolve_axis(axis, ctx, run.body))
            except _Fail:
                pass
        return tuple(out)

    def resolve_axis(self, axis: ast.Axis, ctx: _Ctx, body: Sequence[ast.Statement]) -> SweepAxis:
        d = axis.domain
        if isinstance(d, ast.Range):
            if d.start >= d.stop:
                self.fail(f"the range {d.start}..{d.stop} is empty: ranges are half-open, {d.start}..{d.start + 1} "
                          f"is just {d.start}", d.span)
            labels = tuple(range(d.start, d.stop))
            positions = []
            for t in labels:
                p = self.index(t, ctx.toks, ctx.prompt, d.span, f"{axis.var} in {d.start}..{d.stop} reaches {t}: ")
                positions.append(p)
            return SweepAxis(axis.var, "position", tuple(positions), labels, span=axis.span)
        if isinstance(d, ast.AllBlocks):  # L*: the blocks that have every value the body takes from it
            wanted = _values_of_block_var(body, axis.var)
            blocks = [i for i in range(self.spec.num_layers)
                      if all(self.spec.unavailable(i, v) is None for v in wanted)]
            if not blocks:
                self.fail(f"no block has all of {', '.join(sorted(wanted))}", axis.span)
        else:
            blocks = self.expand(d, None, axis.span)
        return SweepAxis(axis.var, "block", tuple(blocks), tuple(blocks), span=axis.span)

    # -- bodies --

    def resolve_body(self, body: Sequence[ast.Statement], ctx: _Ctx) -> tuple[list[Any], list[ResolvedMeasure]]:
        """The ops and measures of a run's statements, in source order (`= NAME` sources pending)."""
        ops: list[Any] = []
        measures: list[ResolvedMeasure] = []
        for st in body:
            ctx.step = None
            try:
                self.statement(st, ctx, ops, measures)
            except _Fail:
                pass
        return ops, measures

    def statement(self, st: ast.Statement, ctx: _Ctx, ops: list[Any], measures: list[ResolvedMeasure]) -> None:
        """Resolve one statement of a run into `ops` and `measures`."""
        if isinstance(st, ast.Step):
            if ctx.kind != "generate":
                self.fail("'step' only works inside a generate block", st.span)
            assert ctx.max_new_tokens is not None
            if st.index < 0:
                self.fail(f"steps count from 0 (the prompt): step {st.index}", st.span)
            if st.index >= ctx.max_new_tokens:
                self.fail(f"step {st.index} is past the run: '{ctx.name}' makes {ctx.max_new_tokens} new tokens, "
                          f"so its steps are 0 (the prompt) to {ctx.max_new_tokens - 1}", st.span)
            ctx.step = st.index
            self.statement(st.body, ctx, ops, measures)
            return
        if isinstance(st, ast.Route):
            if ctx.route is not None and ctx.route != st.kernel:
                self.fail(f"'{ctx.name}' already routes '{ctx.route}'", st.span)
            ctx.route = st.kernel
            return
        if isinstance(st, ast.Read):
            for site in st.sites:
                try:
                    for t in self.targets(site, ctx, writing=False):
                        ops.append(self.read_op(t, st.alias, ctx, site.span))
                except _Fail:
                    pass
            return
        if isinstance(st, ast.Write):
            for t, n, count in self.enumerate_targets(self.targets(st.site, ctx, writing=True)):
                src = self.write_source(st.source, t, n, count, ctx)
                op = ResolvedOp("write", t.layer, t.value, t.position, t.step, None, None, t.written,
                                None, t.layer_var, t.position_var, span=st.span)
                if isinstance(src, _NamedPending):
                    ops.append(op)
                    self.deferred.append((ops, len(ops) - 1, src))
                else:
                    ops.append(attrs.evolve(op, source=src))
            return
        if isinstance(st, ast.Measure):
            for call in st.calls:
                try:
                    measures.extend(self.measure(call, st.alias, ctx))
                except _Fail:
                    pass
            return
        raise TypeError(f"not a statement: {st!r}")

    @staticmethod
    def enumerate_targets(ts: list[_Target]) -> Iterator[tuple[_Target, int, int]]:
        for n, t in enumerate(ts):
            yield t, n, len(ts)

    def read_op(self, t: _Target, alias: str | None, ctx: _Ctx, span: Span) -> ResolvedOp:
        """A read of one target, named by DESIGN's rules; `as NAME` records what the name holds."""
        name = op_result_name(ctx.name, t.step, t.layer, t.value,
                              t.position if t.position_var is None else f"{{{t.position_var}}}",
                              alias, t.multi, t.layer_var)
        if alias is not None and alias in self.aliases and self.aliases[alias].run == ctx.name:
            entry = self.aliases[alias]
            entry.entries[t.layer] = name
            entry.value = t.value
        return ResolvedOp("read", t.layer, t.value, t.position, t.step, name, None, t.written, alias,
                          t.layer_var, t.position_var, span=span)

    # -- sites --

    def targets(self, site: ast.Site, ctx: _Ctx, *, writing: bool) -> list[_Target]:
        """The blocks a site stands for, each with its position resolved in the run's prompt."""
        v = site.value
        verb = "write" if writing else "read"
        if site.block is None:
            if v in values.MODEL_VALUES:
                if site.position is not None:
                    self.fail(f"'{v}' takes no position", site.position.span)
                if v == "tokens" and ctx.kind != "generate":
                    self.fail("'tokens' are the generated tokens: they exist only under generate", site.span)
                if writing:
                    self.fail(f"'{v}' is read-only: a write targets a block's value, e.g. L0.state_output",
                              site.span)
                return [_Target(None, v, None, None, None, v, False, ctx.step)]
            if v in values.CATALOGUE:
                shown = ast.format_site(site)
                self.fail(f"'{v}' is a value of each block: name the block(s), e.g. L0.{shown} or L*.{shown}",
                          site.span)
            self.unknown_value(site, block_level=False)
        if v not in values.CATALOGUE:
            if v in values.MODEL_VALUES:
                self.fail(f"'{v}' is a value of the whole model, not of a block: {verb} {v}", site.span)
            self.unknown_value(site, block_level=True)
        info = values.CATALOGUE[v]
        if writing and not info.writable:
            hint = "; write state_after(t) for one token's state, or state_output" if v == "states" else ""
            self.fail(f"'{v}' is read-only{hint}", site.span)
        if info.positional and site.position is None:
            self.fail(f"'{v}' needs a position: {v}(3), {v}(-1) for the last token, or {v}(\"word\")", site.span)
        if not info.positional and site.position is not None:
            hint = f"; for the state after one token write state_after({ast.format_position(site.position)})" \
                if v == "states" else ""
            self.fail(f"'{v}' takes no position{hint}", site.position.span)
        assert site.block is not None
        blocks = self.expand(site.block, v, site.span, ctx)
        position, position_var, step = self.site_position(site, ctx)
        raw = site.position
        if isinstance(site.block, ast.BlockVar):  # a sweep template: one op, its block bound per point
            return [_Target(None, v, position, site.block.name, position_var, ast.format_site(site), False, step,
                            raw)]
        multi = isinstance(site.block, (ast.AllBlocks, ast.BlockList))
        return [_Target(b, v, position, None, position_var, ast.format_site(attrs.evolve(site, block=ast.Block(b))),
                        multi, step, raw) for b in blocks]

    def unknown_value(self, site: ast.Site, block_level: bool) -> NoReturn:
        """The error for a value name the catalogue does not know."""
        v = site.value
        if v in values.PYTHON_ONLY:
            self.fail(f"'{v}' is the Python API's spelling; in a program write states (after every token) "
                      f"or state_after(t)", site.span)
        options = list(values.CATALOGUE) + list(values.MODEL_VALUES)
        guess = difflib.get_close_matches(v, options, n=1, cutoff=0.6)
        hint = f"; did you mean '{guess[0]}'?" if guess else ""
        if not block_level and v in self.defined:
            kind = self.defined[v][0]
            self.fail(f"'{v}' is a {kind}, not a value: a site is BLOCK.VALUE or logits, next_token_probs, tokens",
                      site.span)
        self.fail(f"no value named '{v}'{hint}", site.span,
                  notes=[] if guess else ["values: " + ", ".join(values.CATALOGUE) + "; model-level: "
                                          + ", ".join(values.MODEL_VALUES)])

    def site_position(self, site: ast.Site, ctx: _Ctx) -> tuple[int | None, str | None, int | None]:
        """(position, position variable, step) of a site in its run."""
        pos = site.position
        step = ctx.step
        if pos is None:
            return None, None, step
        if ctx.kind == "generate" and step is None:
            step = 0  # a position lives in the prompt: step 0
        if isinstance(pos, ast.VarPos):
            return None, self.position_var(pos, ctx), step
        if ctx.kind == "generate" and step is not None and step > 0:
            return self.decode_position(pos, ctx, step), None, step
        if isinstance(pos, ast.IntPos):
            return self.index(pos.value, ctx.toks, ctx.prompt, pos.span), None, step
        return self.piece(pos, ctx.toks, ctx.prompt), None, step

    def decode_position(self, pos: ast.Position, ctx: _Ctx, step: int) -> int:
        """At generate step k > 0 the model runs one token: new token k, at position n+k-1."""
        here = len(ctx.toks) + step - 1
        if isinstance(pos, ast.IntPos) and pos.value in (-1, here):
            return here
        shown = ast.format_position(pos)
        self.fail(f"at step {step} the model runs one token (position {here}, or -1); position {shown} "
                  f"is not computed at this step", pos.span,
                  notes=["positions of the prompt are computed at step 0: write 'step 0: ...'"])

    def position_var(self, pos: ast.VarPos, ctx: _Ctx) -> str:
        """A position given by a sweep variable: it must range over positions."""
        axis = ctx.axes.get(pos.name)
        if pos.name in ctx.broken:
            raise _Fail  # its axis's error is reported
        if axis is None:
            self.fail(f"unknown position '{pos.name}': a position is a number (3, -1), a quoted piece of the "
                      f"prompt (\"Tower\"), or a sweep variable", pos.span)
        ctx.used.add(pos.name)
        if axis.kind != "position":
            self.fail(f"'{pos.name}' ranges over blocks, not positions: a position variable ranges over "
                      f"numbers (t in 0..9)", pos.span)
        return pos.name

    def index(self, p: int, toks: PromptTokens, prompt: str, span: Span, prefix: str = "") -> int:
        """A numbered position made non-negative; an error if it is outside the prompt."""
        n = len(toks)
        if -n <= p < n:
            return p % n
        self.fail(f"{prefix}position {p} is past the end of prompt '{prompt}': it has {n} tokens "
                  f"(positions 0..{n - 1}, or -{n}..-1 from the end)", span)

    def piece(self, pos: ast.PiecePos, toks: PromptTokens, prompt: str) -> int:
        """A quoted piece: the last token of its first occurrence in the prompt."""
        if not pos.text:
            self.fail("an empty piece names no token: quote a word of the prompt, e.g. \"Tower\"", pos.span)
        found = toks.find(pos.text)
        if found is None:
            notes = []
            low = toks.text.lower().find(pos.text.lower())
            if low >= 0:
                notes.append(f"it occurs as {ast.quote(toks.text[low:low + len(pos.text)])}: pieces match case "
                             "and spaces exactly")
            self.fail(f"{ast.quote(pos.text)} does not occur in prompt '{prompt}': {ast.quote(toks.text)}",
                      pos.span, notes)
        cut = toks.cut(pos.text)
        if cut:
            parts = " and ".join(f"token {i} ({toks.display[i]!r})" for i in cut)
            self.warn(f"{ast.quote(pos.text)} covers only part of {parts} in prompt '{prompt}': it names position "
                      f"{found} ({toks.display[found]!r}), the whole token", pos.span)
        if found in toks.unknown(self.unk):
            self.warn(f"{ast.quote(pos.text)} falls on token {found} of prompt '{prompt}', a word the tokenizer does "
                      f"not know: the model reads {toks.display[found]!r} there", pos.span)
        return found

    def expand(self, sel: ast.Selector, value: str | None, span: Span, ctx: _Ctx | None = None) -> list[int]:
        """The blocks a selector covers (for a sweep variable: the variable's blocks)."""
        n = self.spec.num_layers
        blocks_note = f"the model has {n} blocks (L0..L{n - 1})"
        if isinstance(sel, ast.Block):
            if not 0 <= sel.index < n:
                self.fail(f"no block L{sel.index}: {blocks_note}", sel.span)
            blocks = [sel.index]
        elif isinstance(sel, ast.AllBlocks):
            blocks = [i for i in range(n) if value is None or self.spec.unavailable(i, value) is None]
            if not blocks:
                self.fail(f"no block of this model has '{value}'", sel.span)
            return blocks
        elif isinstance(sel, ast.BlockList):
            blocks = self.bracket(sel, n, blocks_note)
        else:
            blocks = self.block_var(sel, ctx)
        if value is not None:
            for b in blocks:
                why = self.spec.unavailable(b, value)
                if why is not None:
                    if isinstance(sel, ast.Block):
                        self.fail(f"L{b} has no value '{value}': {why}", span)
                    what = f"'{sel.name}'" if isinstance(sel, ast.BlockVar) else ast.format_selector(sel)
                    self.fail(f"{what} covers L{b}, which has no value '{value}': {why}", span,
                              notes=[f"L[linear] or L* selects only the blocks that have '{value}'"])
        return blocks

    def bracket(self, sel: ast.BlockList, n: int, blocks_note: str) -> list[int]:
        """The blocks of `L[...]`: the union of its numbers, slices and kinds, in block order."""
        chosen: set[int] = set()
        for item in sel.items:
            if isinstance(item, ast.SelIndex):
                i = item.index + n if item.index < 0 else item.index
                if not 0 <= i < n:
                    self.fail(f"no block {item.index}: {blocks_note}", item.span)
                chosen.add(i)
            elif isinstance(item, ast.SelSlice):
                for end in (item.start, item.stop):
                    if end is not None and not -n <= end <= n:
                        self.fail(f"the slice {ast.format_sel_item(item)} reaches past the last block: {blocks_note}",
                                  item.span)
                got = list(range(n))[item.start:item.stop]
                if not got:
                    self.fail(f"the slice {ast.format_sel_item(item)} selects no blocks (slices are half-open)",
                              item.span)
                chosen.update(got)
            else:
                got = self.spec.linear_layers() if item.kind == "linear" else self.spec.attention_layers()
                if not got:
                    self.fail(f"the model has no {item.kind} blocks", item.span)
                chosen.update(got)
        return sorted(chosen)

    def block_var(self, sel: ast.BlockVar, ctx: _Ctx | None) -> list[int]:
        """The blocks of a sweep variable used as a block (`L.state_after(t)`)."""
        axis = ctx.axes.get(sel.name) if ctx is not None else None
        if ctx is not None and sel.name in ctx.broken:
            raise _Fail  # its axis's error is reported
        if axis is None:
            if sel.name in self.defined:
                kind = self.defined[sel.name][0]
                self.fail(f"'{sel.name}' is a {kind}, not a block; to take a value from a run write "
                          f"'from {sel.name}.VALUE'", sel.span)
            self.fail(f"'{sel.name}' is not a block: a block is L3, L*, L[linear], L[0:6] or L[0,2,4]"
                      + (" (or a sweep variable)" if ctx is not None and ctx.kind == "sweep" else ""), sel.span)
        assert ctx is not None
        ctx.used.add(sel.name)
        if axis.kind != "block":
            self.fail(f"'{sel.name}' ranges over positions, not blocks: a block variable ranges over a selector "
                      f"(L in L[linear])", sel.span)
        return list(axis.values)

    # -- write sources --

    def write_source(self, src: ast.Source, t: _Target, n: int, count: int, ctx: _Ctx) -> Any:
        """The source of a write to target block number `n` of `count` (`= NAME` is left pending)."""
        if isinstance(src, ast.ZerosSource):
            return Zeros()
        if isinstance(src, ast.ScaleSource):
            return Scale(src.factor)
        if isinstance(src, ast.NamedSource):
            return _NamedPending(src, t, ctx.name, ctx.toks)
        if isinstance(src, ast.MeanSource):
            return self.mean(src, t, ctx)
        return self.from_run(src, t, n, count, ctx)

    def run_target(self, name: str, span: Span, ctx: _Ctx, what: str) -> tuple[str, str, PromptTokens]:
        """(run name, run kind, its prompt's tokens) for a name in `from` or `kl`."""
        if name == ctx.name:
            self.fail(f"'{name}' cannot take a value from itself: {what} names another run or a prompt", span)
        if name in self.runs:
            run = self.runs[name]
            if isinstance(run, ast.Sweep):
                self.fail(f"'{name}' is a sweep: {what} takes a trace, a generate or a prompt", span)
            p = self.prompts.get(run.prompt)
            if not isinstance(p, ast.PromptDecl):
                raise _Fail  # the run's own header error is reported there
            return name, "generate" if isinstance(run, ast.Generate) else "trace", self.tokens(p.text)
        if name == "main" and self.main_items:
            if self.main_prompt is None:
                raise _Fail  # why `main` has no prompt is reported at its first statement
            text = self.prompt_texts[self.main_prompt]
            assert isinstance(text, str)
            return "main", "trace", self.tokens(text)
        p = self.prompts.get(name)
        if isinstance(p, ast.PromptDecl):
            self.implicit.setdefault(name, span)
            return name, "trace", self.tokens(p.text)
        if isinstance(p, ast.PromptListDecl):
            self.fail(f"'{name}' is a prompt list: {what} takes one run or prompt; for the mean over the list "
                      f"write '= mean({name})'", span)
        if name in self.aliases:
            self.fail(f"'{name}' is the name of a read: write '= {name}' to write its value", span)
        options = list(self.runs) + list(self.prompt_names())
        self.fail(f"unknown run or prompt '{name}'" + _did_you_mean(name, options), span,
                  notes=[f"runs and prompts: {', '.join(options)}"] if options else [])

    def from_run(self, src: ast.FromSource, t: _Target, n: int, count: int, ctx: _Ctx) -> FromRun:
        """`from RUN` (the same site there) or `from RUN.SITE`, for target block number `n` of `count`."""
        run, kind, dtoks = self.run_target(src.run, src.span, ctx, "'from'")
        step = t.step if kind == "generate" else None
        site = src.site
        value, layer, layer_var = t.value, t.layer, t.layer_var
        raw, span = t.raw, src.span
        if site is not None:
            value = site.value
            if value not in values.CATALOGUE:
                if value in values.MODEL_VALUES:
                    self.fail(f"'{value}' is a value of the whole model; a write takes a block's value", site.span)
                self.unknown_value(site, block_level=True)
            if _shape_class(value) != _shape_class(t.value):
                self.fail(f"the shapes do not fit: {t.value} is {_shape(t.value)}, {value} is {_shape(value)}",
                          site.span)
            if site.block is not None:
                blocks = self.expand(site.block, value, site.span, ctx)
                if isinstance(site.block, ast.BlockVar):
                    layer, layer_var = None, site.block.name
                elif len(blocks) == 1:
                    layer, layer_var = blocks[0], None
                elif len(blocks) == count:
                    layer, layer_var = blocks[n], None
                else:
                    self.fail(f"{ast.format_selector(site.block)} covers {len(blocks)} blocks and the write {count}: "
                              f"name one block, or as many as the write", site.block.span)
            elif layer is not None and self.spec.unavailable(layer, value) is not None:
                self.fail(f"L{layer} has no value '{value}': {self.spec.unavailable(layer, value)}", site.span)
            positional = values.CATALOGUE[value].positional
            if not positional and site.position is not None:
                self.fail(f"'{value}' takes no position", site.position.span)
            if positional and site.position is not None:
                raw, span = site.position, site.position.span
                if isinstance(raw, ast.VarPos):
                    self.position_var(raw, ctx)
            elif positional and raw is None:
                self.fail(f"'{value}' needs a position: {value}(3), {value}(-1) or {value}(\"word\")", site.span)
            elif not positional:
                raw = None
        explicit = site is not None and site.position is not None
        position, pmap = self.donor_position(raw, explicit, t, value, run, kind, dtoks, span, ctx)
        if kind == "generate" and step is None and (position is not None or pmap):
            step = 0  # a position of the prompt: step 0
        self.check_rows(value, t, dtoks, f"'{run}'", src.span, ctx)
        pvar = raw.name if isinstance(raw, ast.VarPos) else None
        return FromRun(run, layer, value, position, step, layer_var, pvar, pmap)

    def donor_position(self, raw: ast.Position | None, explicit: bool, t: _Target, value: str, run: str,
                       kind: str, dtoks: PromptTokens, span: Span, ctx: _Ctx,
                       ) -> tuple[int | None, tuple[tuple[int, int], ...]]:
        """Where the donor reads: (position, {target position: donor position} for a sweep variable).

        A position written as a number from the end (-1) or a sweep variable over
        such numbers counts from the donor's own end; a quoted piece named on the
        donor site is found in the donor's prompt; otherwise the donor reads the
        same position number as the target.
        """
        if raw is None:
            return None, ()
        n = len(dtoks)
        if t.step is not None and t.step > 0 and kind == "generate" and not explicit:
            return n + t.step - 1, ()  # the donor's own token at this decode step
        if isinstance(raw, ast.VarPos):
            axis = ctx.axes[raw.name]
            pairs = []
            for v, label in zip(axis.values, axis.labels, strict=True):
                p = label if label < 0 else v
                pairs.append((v, self.index(p, dtoks, run, span, f"{raw.name} = {label} in '{run}': ")))
            return None, tuple(pairs)
        if isinstance(raw, ast.IntPos) and (raw.value < 0 or explicit):
            return self.index(raw.value, dtoks, run, span), ()
        if isinstance(raw, ast.PiecePos) and explicit:
            return self.piece(raw, dtoks, run), ()
        assert t.position is not None
        if t.position >= n:
            if run.startswith("mean"):
                self.fail(f"position {t.position} is past the end of a prompt of {run}: {ast.quote(dtoks.text)} "
                          f"has {_tokens(n)}; a position from the end (-1) fits every prompt", span)
            self.fail(f"position {t.position} is past the end of '{run}', whose prompt has {_tokens(n)} "
                      f"(0..{n - 1}); name a position of its own: from {run}.{value}(\"word\") or "
                      f"from {run}.{value}(-1)", span)
        return t.position, ()

    def check_rows(self, value: str, t: _Target, dtoks: PromptTokens, run: str, span: Span, ctx: _Ctx) -> None:
        """A value with a row per token only fits a prompt of as many tokens."""
        info = values.CATALOGUE.get(value)
        if info is not None and info.per_token and not (t.step or 0) > 0 and len(dtoks) != len(ctx.toks):
            self.fail(f"the shapes do not fit: {value} has a row per token, and '{ctx.prompt}' has "
                      f"{_tokens(len(ctx.toks))} while {run} has {len(dtoks)}", span)

    def mean(self, src: ast.MeanSource, t: _Target, ctx: _Ctx) -> Mean:
        texts: list[str] = []
        for name in src.prompts:
            p = self.prompts.get(name)
            if isinstance(p, ast.PromptDecl):
                texts.append(p.text)
            elif isinstance(p, ast.PromptListDecl):
                texts.extend(p.texts)
            elif name in self.runs:
                self.fail(f"mean takes prompts; '{name}' is a run (write 'from {name}' for one run's value)",
                          src.span)
            else:
                self.fail(f"unknown prompt '{name}' in mean(...)" + _did_you_mean(name, list(self.prompts)),
                          src.span)
        if t.position_var is not None:
            self.fail("mean(...) at a sweep variable's position is not supported: name the position", src.span)
        positions: list[int] = []
        label = "mean(" + ", ".join(src.prompts) + ")"
        for text in texts:
            toks = self.tokens(text)
            pos, _ = self.donor_position(t.raw, False, t, t.value, label, "trace", toks, src.span, ctx)
            if pos is not None:
                positions.append(pos)
            self.check_rows(t.value, t, toks, f"the prompt {ast.quote(text)} of {label}", src.span, ctx)
        return Mean(tuple(src.prompts), tuple(texts), tuple(positions) if t.raw is not None else None)

    def finish_deferred(self) -> None:
        """Resolve `= NAME` sources now that every read's result names are known."""
        for ops, i, pending in self.deferred:
            try:
                ops[i] = attrs.evolve(ops[i], source=self.named(pending))
            except _Fail:
                ops[i] = None
        self.deferred = []

    def named(self, p: "_NamedPending") -> Named:
        src, t = p.src, p.target
        entry = self.aliases.get(src.name)
        if entry is None:
            if src.name in self.runs or src.name in self.prompts:
                self.fail(f"'{src.name}' is a run or prompt, not a value: write 'from {src.name}' for the same "
                          f"site there", src.span)
            self.fail(f"unknown name '{src.name}': '= NAME' takes the name of a read ('read ... as NAME')"
                      + _did_you_mean(src.name, [a for a, e in self.aliases.items() if e.kind == "read"]), src.span)
        if entry.kind != "read":
            self.fail(f"'{src.name}' is a measure, not a value to write", src.span)
        if entry.in_sweep:
            self.fail(f"'{src.name}' is read in a sweep, one value per point: it cannot feed a write", src.span)
        if not entry.entries or entry.value is None:
            raise _Fail  # the read itself did not resolve; its error is reported there
        if _shape_class(entry.value) != _shape_class(t.value):
            self.fail(f"the shapes do not fit: {t.value} is {_shape(t.value)}, '{src.name}' holds {entry.value} "
                      f"({_shape(entry.value)})", src.span)
        if len(entry.entries) == 1:
            name = next(iter(entry.entries.values()))
        elif t.layer in entry.entries:
            name = entry.entries[t.layer]
        else:
            held = ", ".join(entry.entries.values())
            self.fail(f"'{src.name}' holds {held}: nothing for L{t.layer}", src.span)
        info = values.CATALOGUE.get(entry.value)
        run = self.runs.get(entry.run)
        if info is not None and info.per_token and run is not None:
            p_text = self.prompt_texts.get(run.prompt)
            if isinstance(p_text, str) and len(self.tokens(p_text)) != len(p.toks):
                self.fail(f"the shapes do not fit: {entry.value} has a row per token, and '{src.name}' comes "
                          f"from a prompt of {len(self.tokens(p_text))} tokens, this run's has {len(p.toks)}",
                          src.span)
        return Named(name, entry.run)

    # -- measures --

    def measure(self, call: ast.MeasureCall, alias: str | None, ctx: _Ctx) -> list[ResolvedMeasure]:
        step = ctx.step
        if isinstance(call, (ast.Prob, ast.Rank, ast.LogitDiff)):
            texts = (call.a, call.b) if isinstance(call, ast.LogitDiff) else (call.token,)
            ids = tuple(self.single_token(s, call.span) for s in texts)
            kind = {ast.Prob: "prob", ast.Rank: "rank", ast.LogitDiff: "logit_diff"}[type(call)]
            text = _measure_call_text(kind, texts, None, "")
            name = measure_result_name(ctx.name, step, text, alias, None, False)
            return [ResolvedMeasure(kind, name, step, ids, texts, written=text, alias=alias, span=call.span)]
        if isinstance(call, ast.KL):
            run, _, _ = self.run_target(call.run, call.span, ctx, "kl")
            text = f"kl({run})"
            name = measure_result_name(ctx.name, step, text, alias, None, False)
            return [ResolvedMeasure("kl", name, step, against=run, written=text, alias=alias, span=call.span)]
        out = []
        for t in self.targets(call.site, ctx, writing=False):
            pos_shown: Any = t.position if t.position_var is None else f"{{{t.position_var}}}"
            text = f"norm({site_text(t.layer, t.value, pos_shown, t.layer_var)})"
            name = measure_result_name(ctx.name, t.step, text, alias, t.layer, t.multi)
            out.append(ResolvedMeasure("norm", name, t.step, layer=t.layer, value=t.value, position=t.position,
                                       written=f"norm({t.written})", alias=alias, layer_var=t.layer_var,
                                       position_var=t.position_var, span=call.span))
        return out

    def single_token(self, text: str, span: Span) -> int:
        """The one token id `text` stands for; an error naming its pieces if it is several."""
        if not text:
            self.fail("an empty string is no token", span)
        ids = token_id(self.spec, text)
        if len(ids) == 1 and ids[0] == self.unk:
            unk = self.spec.tokenizer.unk_token
            self.fail(f"{ast.quote(text)} is not in this model's vocabulary: the tokenizer reads it as {unk!r} "
                      f"(token {ids[0]}), and a measure of {unk!r} is not one of {ast.quote(text)}", span)
        if len(ids) == 1:
            return ids[0]
        pieces = " ".join(repr(t) for t in self.spec.tokenizer.convert_ids_to_tokens(ids))
        self.fail(f"{ast.quote(text)} is {len(ids)} tokens for this model's tokenizer ({pieces}); a measure "
                  f"takes one token", span,
                  notes=[f"its first token alone is {ast.quote(self.spec.tokenizer.decode(ids[:1]))}"] if ids else [])


@attrs.define
class _NamedPending:
    """A `= NAME` source waiting for every read to be resolved."""

    src: ast.NamedSource
    target: _Target
    run: str
    toks: PromptTokens


@attrs.define
class _Draft:
    """A run being resolved: its header fields, and ops some of which wait for `= NAME`."""

    head: ResolvedRun
    ops: list[Any]
    measures: list[ResolvedMeasure]

    def build(self) -> ResolvedRun:
        """The final run: failed ops dropped, repeated reads of one result kept once."""
        seen: set[Any] = set()
        ops: list[ResolvedOp] = []
        for op in self.ops:
            if op is None:
                continue
            if op.kind == "read":
                key = (op.result_name, op.written, op.step)
                if key in seen:
                    continue
                seen.add(key)
            ops.append(op)
        measures: list[ResolvedMeasure] = []
        names: set[str] = set()
        for m in self.measures:
            if m.result_name not in names:
                names.add(m.result_name)
                measures.append(m)
        return attrs.evolve(self.head, ops=tuple(ops), measures=tuple(measures))
