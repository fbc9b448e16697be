"""Runs: a trace, generate or sweep (or the implicit run `main`) resolved statement by statement.

`resolve_run()` and `resolve_main()` check a run's header (its prompt,
max_new_tokens, a sweep's axes) and resolve its body: `statement()` handles
`step K:`, `route`, reads, writes and measures, in source order, into a
`Draft` whose ops some `= NAME` sources still wait on; `Draft.build()` makes
the final `ResolvedRun`. `implicit_run()` is the clean run of a prompt named
in `from` or `kl`.
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Sequence

import attrs

from deltalang.ground import display
from deltalang.ground.errors import Span
from deltalang.models import values
from deltalang.models.spec import text_config

from .. import ast
from ..ir import (ResolvedMeasure, ResolvedOp, ResolvedRun, SweepAxis, measure_call_text, measure_result_name,
                  op_result_name, site_text)
from ..tokens import decoded, spaced_twin, token_id
from .effects import check_write
from .reductions import reduced_measures, reduced_read, wanted_measure
from .scope import Ctx, Fail, Scope, Target, did_you_mean, n_tokens
from .sites import expand, index, piece, targets
from .sources import is_pending, run_target, write_source


@attrs.define
class Draft:
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


def prompt_for_run(scope: Scope, name: str, span: Span) -> str:
    """The text of the prompt a run is on; errors for lists, runs, unknown names."""
    p = scope.prompts.get(name)
    if isinstance(p, ast.PromptDecl):
        return p.text
    if isinstance(p, ast.PromptListDecl):
        scope.fail(f"'{name}' is a prompt list; a run is on one prompt (lists feed '= mean({name})')", span)
    if name in scope.runs:
        scope.fail(f"'{name}' is a run, not a prompt", span)
    known = scope.prompt_names()
    scope.fail(f"unknown prompt '{name}'" + did_you_mean(name, known), span,
               notes=[f"the prompts: {', '.join(known)}" if known else f"declare it: prompt {name} = \"...\""])


def header_span(scope: Scope, run: ast.Trace | ast.Generate | ast.Sweep) -> Span:
    """The span of `on PROMPT` in a run's header when the source is known, else the header's."""
    s = run.span
    lines = scope.source.split("\n")
    if 1 <= s.line <= len(lines):
        m = re.compile(rf"\bon\s+({re.escape(run.prompt)})\b").search(lines[s.line - 1], s.column - 1)
        if m is not None:
            return Span(s.line, m.start(1) + 1, s.line, m.end(1) + 1)
    return Span(s.line, s.column, s.line, s.column + len(ast.format_run_header(run)))


def resolve_run(scope: Scope, run: ast.Trace | ast.Generate | ast.Sweep) -> Draft | None:
    if scope.runs.get(run.name) is not run:
        return None
    hs = header_span(scope, run)
    try:
        text = prompt_for_run(scope, run.prompt, hs)
    except Fail:
        return None
    toks = scope.tokens(text)
    kind = {ast.Trace: "trace", ast.Generate: "generate", ast.Sweep: "sweep"}[type(run)]
    max_new = run.max_new_tokens if isinstance(run, ast.Generate) else None
    if max_new is not None and max_new < 1:
        scope.error(f"generate makes at least one new token: max_new_tokens {max_new}", hs)
        return None
    ctx = Ctx(run.name, kind, run.prompt, toks, max_new, {})
    past_context(scope, ctx, hs if max_new is None else run.span)
    axes: tuple[SweepAxis, ...] = ()
    if isinstance(run, ast.Sweep):
        axes = resolve_axes(scope, run, ctx)
        ctx.axes = {a.var: a for a in axes}
        ctx.broken = {a.var for a in run.axes} - set(ctx.axes)
    ops, measures = resolve_body(scope, run.body, ctx)
    for a in axes:
        if a.var not in ctx.used:
            scope.error(f"sweep variable '{a.var}' is never used in the body of '{run.name}'", a.span)
    head = ResolvedRun(run.name, kind, run.prompt, text, toks.ids, toks.decoded, max_new, False,
                       route=ctx.route or scope.global_route, axes=axes, span=run.span,
                       method=run.method if isinstance(run, ast.Sweep) else None,
                       sampling=run.sampling if isinstance(run, ast.Generate) else None)
    return Draft(head, ops, measures)


def past_context(scope: Scope, ctx: Ctx, span: Span) -> None:
    """A warning when a run's tokens (its prompt and the tokens it generates) pass the model's context."""
    limit = getattr(text_config(scope.spec.config), "max_position_embeddings", None)
    total = len(ctx.toks) + (ctx.max_new_tokens or 0)
    if not isinstance(limit, int) or total <= limit:
        return
    made = f" and {ctx.max_new_tokens} new tokens" if ctx.max_new_tokens else ""
    scope.warn(f"'{ctx.name}' runs {total} tokens ({n_tokens(len(ctx.toks))} of prompt '{ctx.prompt}'{made}), past "
               f"this model's context of {limit} (max_position_embeddings): positions past {limit - 1} are ones "
               f"it never saw in training", span)


def resolve_main(scope: Scope) -> Draft | None:
    if scope.main_prompt is None:
        return None
    text = scope.prompt_texts[scope.main_prompt]
    assert isinstance(text, str)
    toks = scope.tokens(text)
    ctx = Ctx("main", "trace", scope.main_prompt, toks, None, {})
    past_context(scope, ctx, scope.main_items[0].span)
    ops, measures = resolve_body(scope, scope.main_items, ctx)
    head = ResolvedRun("main", "trace", scope.main_prompt, text, toks.ids, toks.decoded, None, True,
                       route=ctx.route or scope.global_route, span=scope.main_items[0].span)
    return Draft(head, ops, measures)


def implicit_run(scope: Scope, decl: ast.PromptDecl) -> ResolvedRun:
    toks = scope.tokens(decl.text)
    return ResolvedRun(decl.name, "trace", decl.name, decl.text, toks.ids, toks.decoded, None, True,
                       (), (), scope.global_route, (), span=decl.span)


def resolve_axes(scope: Scope, run: ast.Sweep, ctx: Ctx) -> tuple[SweepAxis, ...]:
    out: list[SweepAxis] = []
    seen: set[str] = set()
    for axis in run.axes:
        if axis.var in seen:
            scope.error(f"sweep variable '{axis.var}' is bound twice", axis.span)
            continue
        seen.add(axis.var)
        try:
            out.append(resolve_axis(scope, axis, ctx, run.body))
        except Fail:
            pass
    return tuple(out)


def _values_of_block_var(body: Sequence[ast.Statement], var: str) -> set[str]:
    """The catalogue values a sweep body reads or writes on the block variable `var`."""
    return {node.value for node in ast.walk(tuple(body))
            if isinstance(node, ast.Site) and isinstance(node.block, ast.BlockVar) and node.block.name == var
            and node.value in values.CATALOGUE}


def resolve_axis(scope: Scope, axis: ast.Axis, ctx: Ctx, body: Sequence[ast.Statement]) -> SweepAxis:
    d = axis.domain
    if isinstance(d, ast.Range):
        if d.start >= d.stop:
            scope.fail(f"the range {d.start}..{d.stop} is empty: ranges are half-open, {d.start}..{d.start + 1} "
                       f"is just {d.start}", d.span)
        labels = tuple(range(d.start, d.stop))
        positions = []
        for t in labels:
            p = index(scope, t, ctx.toks, ctx.prompt, d.span, f"{axis.var} in {d.start}..{d.stop} reaches {t}: ")
            positions.append(p)
        return SweepAxis(axis.var, "position", tuple(positions), labels, span=axis.span)
    if isinstance(d, ast.PosList):
        return position_list(scope, axis, d, ctx)
    if isinstance(d, ast.Heads):
        return head_axis(scope, axis, d)
    if isinstance(d, ast.AllBlocks):  # L*: the blocks that have every value the body takes from it
        wanted = _values_of_block_var(body, axis.var)
        blocks = [i for i in range(scope.spec.num_layers)
                  if all(scope.spec.unavailable(i, v) is None for v in wanted)]
        if not blocks:
            scope.fail(f"no block has all of {', '.join(sorted(wanted))}", axis.span)
    else:
        blocks = expand(scope, d, None, axis.span)
    return SweepAxis(axis.var, "block", tuple(blocks), tuple(blocks), span=axis.span)


def head_axis(scope: Scope, axis: ast.Axis, d: ast.Heads) -> SweepAxis:
    """`h in heads` (every value head) or `h in heads[0:4]`, `heads[0,2]`: head numbers, each once."""
    n = scope.spec.dims["heads"]
    chosen: list[int] = []
    for item in d.items or (ast.SelSlice(None, None, span=d.span),):
        if isinstance(item, ast.SelIndex):
            if not -n <= item.index < n:
                scope.fail(f"no head {item.index}: this model's DeltaNet blocks have {n} value heads "
                           f"(0..{n - 1})", item.span)
            got = [item.index % n]
        else:
            assert isinstance(item, ast.SelSlice)
            got = list(range(n))[item.start:item.stop]
            if not got:
                scope.fail(f"heads[{ast.format_sel_item(item)}] selects no heads of {n} (slices are half-open)",
                           item.span)
        chosen.extend(h for h in got if h not in chosen)
    return SweepAxis(axis.var, "head", tuple(chosen), tuple(chosen), span=axis.span)


def position_list(scope: Scope, axis: ast.Axis, d: ast.PosList, ctx: Ctx) -> SweepAxis:
    """`t in 2, "Tower", -1`: each position resolved in the sweep's prompt, none twice. A number from the
    end keeps its label (a donor counts it from its own end); a quoted piece's label is its position."""
    positions: list[int] = []
    labels: list[int] = []
    for p in d.items:
        if isinstance(p, ast.IntPos):
            labels.append(p.value)
            positions.append(index(scope, p.value, ctx.toks, ctx.prompt, p.span, f"{axis.var} reaches {p.value}: "))
        elif isinstance(p, ast.PiecePos):
            positions.append(piece(scope, p, ctx.toks, ctx.prompt))
            labels.append(positions[-1])
        else:
            scope.fail(f"'{ast.format_position(p)}' is a record's field: a sweep on a dataset's records "
                       f"(sweep NAME on {p.field.dataset} over ...) takes it", p.span)
        if positions[-1] in positions[:-1]:
            scope.fail(f"{axis.var} names token {positions[-1]} twice: each position once", p.span)
    return SweepAxis(axis.var, "position", tuple(positions), tuple(labels), span=axis.span)


# -- bodies --


def resolve_body(scope: Scope, body: Sequence[ast.Statement], ctx: Ctx) -> tuple[list[Any], list[ResolvedMeasure]]:
    """The ops and measures of a run's statements, in source order (`= NAME` sources pending)."""
    ops: list[Any] = []
    measures: list[ResolvedMeasure] = []
    for st in body:
        ctx.step = None
        try:
            statement(scope, st, ctx, ops, measures)
        except Fail:
            pass
    return ops, measures


def statement(scope: Scope, st: ast.Statement, ctx: Ctx, ops: list[Any], measures: list[ResolvedMeasure]) -> None:
    """Resolve one statement of a run into `ops` and `measures`."""
    if isinstance(st, ast.Step):
        if ctx.kind != "generate":
            scope.fail("'step' only works inside a generate block", st.span)
        assert ctx.max_new_tokens is not None
        if st.index < 0:
            scope.fail(f"steps count from 0 (the prompt): step {st.index}", st.span)
        if st.index >= ctx.max_new_tokens:
            scope.fail(f"step {st.index} is past the run: '{ctx.name}' makes {ctx.max_new_tokens} new tokens, "
                       f"so its steps are 0 (the prompt) to {ctx.max_new_tokens - 1}", st.span)
        ctx.step = st.index
        statement(scope, st.body, ctx, ops, measures)
        return
    if isinstance(st, ast.Route):
        if ctx.route is not None and ctx.route != st.kernel:
            scope.fail(f"'{ctx.name}' already routes '{ctx.route}'", st.span)
        ctx.route = st.kernel
        return
    if isinstance(st, ast.Read):
        for site in st.sites:
            try:
                if st.alias is not None and isinstance(site.position, (ast.AllPos, ast.RangePos)):
                    scope.fail(f"'as' names one position; ({ast.format_position(site.position)}) keeps one result "
                               f"per position, named by it (RUN.L0.state_after(3)): drop 'as {st.alias}'",
                               site.position.span)
                for t in targets(scope, site, ctx, writing=False):
                    ops.append(reduced_read(scope, read_op(scope, t, st.alias, ctx, site.span), site, t, ctx))
            except Fail:
                pass
        return
    if isinstance(st, ast.Write):
        for t, n, count in enumerate_targets(targets(scope, st.site, ctx, writing=True)):
            src = write_source(scope, st.source, t, n, count, ctx)
            check_write(scope, t, src, ctx, st.span)
            op = ResolvedOp("write", t.layer, t.value, t.position, t.step, None, None, t.written,
                            None, t.layer_var, t.position_var, t.head, t.head_var, span=st.span)
            if is_pending(src):
                ops.append(op)
                scope.deferred.append((ops, len(ops) - 1, src))
            else:
                ops.append(attrs.evolve(op, source=src))
        return
    if isinstance(st, ast.Measure):
        for call in st.calls:
            try:
                measures.extend(measure_at(scope, measure(scope, call, st.alias, ctx), st.at, ctx))
            except Fail:
                pass
        return
    raise TypeError(f"not a statement: {st!r}")


def enumerate_targets(ts: list[Target]) -> Iterator[tuple[Target, int, int]]:
    for n, t in enumerate(ts):
        yield t, n, len(ts)


def read_op(scope: Scope, t: Target, alias: str | None, ctx: Ctx, span: Span) -> ResolvedOp:
    """A read of one target, named by DESIGN's rules; `as NAME` records what the name holds."""
    name = op_result_name(ctx.name, t.step, t.layer, t.value,
                          t.position if t.position_var is None else f"{{{t.position_var}}}",
                          alias, t.multi, t.layer_var, t.head if t.head_var is None else f"{{{t.head_var}}}")
    if alias is not None and alias in scope.aliases and scope.aliases[alias].run == ctx.name:
        entry = scope.aliases[alias]
        entry.entries[t.layer] = name
        entry.value = t.value
        entry.head = t.head is not None or t.head_var is not None
    return ResolvedOp("read", t.layer, t.value, t.position, t.step, name, None, t.written, alias,
                      t.layer_var, t.position_var, t.head, t.head_var, span=span)


# -- measures --


def measure(scope: Scope, call: ast.MeasureCall, alias: str | None, ctx: Ctx) -> list[ResolvedMeasure]:
    step = ctx.step
    if isinstance(call, (ast.Prob, ast.Rank, ast.LogitDiff)):
        texts = (call.a, call.b) if isinstance(call, ast.LogitDiff) else (call.token,)
        kind = {ast.Prob: "prob", ast.Rank: "rank", ast.LogitDiff: "logit_diff"}[type(call)]
        answers = tuple(answer_tokens(scope, s, call.span, kind, ctx) for s in texts)
        ids = tuple(a[0] for a in answers)
        text = measure_call_text(kind, texts, None, "")
        name = measure_result_name(ctx.name, step, text, alias, None, False)
        spaced = tuple(spaced_twin(scope.spec, s, a) for s, a in zip(texts, answers, strict=True))
        return [ResolvedMeasure(kind, name, step, ids, texts, written=text, alias=alias, span=call.span,
                                answers=answers, spaced=spaced if any(spaced) else ())]
    if isinstance(call, ast.KL):
        run, _, _ = run_target(scope, call.run, call.span, ctx, "kl")
        text = f"kl({run})"
        name = measure_result_name(ctx.name, step, text, alias, None, False)
        return [ResolvedMeasure("kl", name, step, against=run, written=text, alias=alias, span=call.span)]
    if isinstance(call, ast.Top):
        return [top_measure(scope, call, alias, ctx)]
    if wanted_measure(call, ctx):  # norm over axes, projection: computed in the forward
        return reduced_measures(scope, call, alias, ctx)  # type: ignore[arg-type]
    out = []
    if call.site.head is not None:
        scope.fail("norm(...) of one head is not supported: norm takes a whole value", call.site.head.span)
    for t in targets(scope, call.site, ctx, writing=False):
        pos_shown: Any = t.position if t.position_var is None else f"{{{t.position_var}}}"
        text = f"norm({site_text(t.layer, t.value, pos_shown, t.layer_var)})"
        name = measure_result_name(ctx.name, t.step, text, alias, t.layer, t.multi)
        out.append(ResolvedMeasure("norm", name, t.step, layer=t.layer, value=t.value, position=t.position,
                                   written=f"norm({t.written})", alias=alias, layer_var=t.layer_var,
                                   position_var=t.position_var, span=call.span))
    return out


def top_measure(scope: Scope, call: ast.Top, alias: str | None, ctx: Ctx) -> ResolvedMeasure:
    """`top(k)`: the k most likely next tokens (k as its one "token id"); not a number, so not in a sweep."""
    if ctx.kind == "sweep":
        scope.fail(f"top({call.k}) gives tokens, not a number, and a sweep's cells hold numbers: measure prob(...) "
                   f"or rank(...) of a token here, or top({call.k}) in a trace", call.span)
    vocab = len(scope.spec.tokenizer)
    if call.k > vocab:
        scope.fail(f"top({call.k}): the vocabulary has {vocab} tokens", call.span)
    text = measure_call_text("top", (str(call.k),), None, "")
    name = measure_result_name(ctx.name, ctx.step, text, alias, None, False)
    return ResolvedMeasure("top", name, ctx.step, (call.k,), (str(call.k),), written=text, alias=alias,
                           span=call.span)


def measure_at(scope: Scope, ms: list[ResolvedMeasure], at: ast.IntPos | ast.PiecePos | None,
               ctx: Ctx) -> list[ResolvedMeasure]:
    """`measure ... at POS`: the next-token measures of the logits at POS of the run's prompt (the
    distribution of the token after it), named `RUN.CALL at P` with P from 0. `kl(RUN) at POS` compares with
    RUN's logits at its own position by the donor rules (-2 counts from RUN's end, 3 is RUN's token 3)."""
    if at is None:
        return ms
    if ctx.kind != "trace":
        scope.fail(f"'at' measures a position of one forward's prompt: not in a {ctx.kind} (under generate, a "
                   f"step's logits are its last token's; in a sweep, measure the last)", at.span)
    p = index(scope, at.value, ctx.toks, ctx.prompt, at.span) if isinstance(at, ast.IntPos) else \
        piece(scope, at, ctx.toks, ctx.prompt)
    out = []
    for m in ms:
        if m.kind not in ("prob", "rank", "logit_diff", "kl"):
            why = "norm takes a site of its own" if m.kind == "norm" else f"not to {m.kind}"
            scope.fail(f"'at' applies to prob, rank, logit_diff and kl (the logits of a position); {why}", at.span)
        if m.forced:
            scope.fail("'at' takes answers of one token: an answer of several is measured by teacher forcing "
                       "after the prompt's last token", at.span)
        against_at = None
        if m.kind == "kl" and m.against is not None:
            _, kind, dtoks = run_target(scope, m.against, m.span, ctx, "kl")
            if kind == "generate":
                scope.fail(f"kl({m.against}) at a position: '{m.against}' is a generate; name a trace", at.span)
            if isinstance(at, ast.IntPos) and at.value < 0:
                against_at = index(scope, at.value, dtoks, m.against, at.span)
            elif p >= len(dtoks):
                scope.fail(f"kl({m.against}) at position {p}: '{m.against}' has {len(dtoks)} tokens; a position "
                           f"from the end (-2) counts from each run's own end", at.span)
            else:
                against_at = p
        text = f"{m.written} at {p}"
        name = measure_result_name(ctx.name, m.step, text, m.alias, None, False)
        out.append(attrs.evolve(m, result_name=name, written=text, at=p, against_at=against_at))
    return out


def answer_tokens(scope: Scope, text: str, span: Span, kind: str, ctx: Ctx) -> tuple[int, ...]:
    """The token ids `text` stands for. Several are measured by teacher forcing (prob, logit_diff of a trace);
    `rank`, a generate and a sweep take one token: an error naming the pieces otherwise."""
    if not text:
        scope.fail("an empty string is no token", span)
    ids = tuple(token_id(scope.spec, text))
    unk = scope.spec.tokenizer.unk_token
    if scope.unk in ids:
        whole = f" (token {scope.unk})" if len(ids) == 1 else f" (token {scope.unk}, one of its {len(ids)} pieces)"
        scope.fail(f"{ast.quote(text)} is not in this model's vocabulary: the tokenizer reads it as "
                   f"{display.token(unk)}{whole}, and a measure of {display.token(unk)} is not one of "
                   f"{ast.quote(text)}", span)
    if len(ids) == 1:
        return ids
    pieces = " ".join(display.token(t) for t in decoded(scope.spec.tokenizer, ids))
    where = {"rank": "`rank` takes one token", "generate": "a measure in a generate takes one token",
             "sweep": "a measure in a sweep takes one token"}
    why = where.get(kind) or where.get(ctx.kind)
    if why is not None:
        scope.fail(f"{ast.quote(text)} is {len(ids)} tokens for this model's tokenizer ({pieces}); {why}", span,
                   notes=[f"its first token alone is {ast.quote(scope.spec.tokenizer.decode(list(ids[:1])))}; "
                          "prob and logit_diff in a trace measure an answer of several tokens by teacher forcing"])
    return ids
