"""The resolver's scope: what one resolution knows and collects, and the records it passes along.

`Scope` holds the program, the model's shape, every name the first pass declares
(prompts, runs, `as` names), the errors and warnings recorded so far and the
tokenized prompts; each step of the resolver takes it as its first argument
instead of sharing one large object. `Fail` abandons the node being resolved
once its error is recorded (`Scope.fail`); `Ctx` is where a statement is being
resolved, `Target` one block a site stands for. Depends on `ast`, `values`,
`errors`, `spec`, `tokens` and `ir` only.
"""

from __future__ import annotations

import difflib
from typing import Any, NoReturn, Sequence

import attrs

from deltalang.ground.errors import DeltaError, DeltaResolveError, DeltaWarning, Span
from deltalang.models import values
from deltalang.models.spec import ModelSpec

from .. import ast
from ..ir import SweepAxis
from ..tokens import PromptTokens, tokenize


class Fail(Exception):
    """Internal: abandon the node being resolved (its error is already recorded)."""


@attrs.define
class Alias:
    """What `read ... as NAME` (or `measure ... as NAME`) defines."""

    run: str
    kind: str  # "read" | "measure"
    span: Span
    entries: dict[int | None, str] = attrs.Factory(dict)  # layer -> result name
    value: str | None = None
    in_sweep: bool = False
    head: bool = False  # a read of one head (`.head(h)`): not the whole value


@attrs.define
class Ctx:
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
class Target:
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
    head: int | None = None  # `.head(h)`: one value head (non-negative); None: the whole value
    head_var: str | None = None  # sweep templates: the head is this variable's


_STATE_SHAPED = {"state_input", "state_output", "state_after"}
_HIDDEN_SHAPED = {"output", "attention_output"}


def shape_class(value: str) -> str:
    if value in _STATE_SHAPED:
        return "state"
    if value in _HIDDEN_SHAPED:
        return "hidden"
    return value


def shape_of(value: str) -> str:
    v = values.get(value)
    return v.shape if v is not None else values.MODEL_VALUES.get(value, "?")


def n_tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def did_you_mean(word: str, options: Sequence[str]) -> str:
    guess = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"; did you mean '{guess[0]}'?" if guess else ""


class Scope:
    """What one resolution knows and collects, passed to every step of the resolver.

    The program and the model's shape; the names the first pass declares (prompts,
    runs, `as` names, the implicit run `main`); the errors and warnings recorded
    so far; the tokenized prompts; the `= NAME` sources waiting for every read.
    """

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
        self.aliases: dict[str, Alias] = {}
        self.main_items: list[ast.Statement] = []
        self.main_prompt: str | None = None
        self.model: str | None = None
        self.model_span: Span | None = None
        self.global_route: str | None = None
        self.implicit: dict[str, Span] = {}  # prompts that need a clean run of their own
        self.tok_cache: dict[str, PromptTokens] = {}
        self.deferred: list[tuple[list[Any], int, Any]] = []
        self.unread: list[tuple[str, Target, str, Span]] = []  # (run, write, why nothing reads it, where): warned
        # once every run is resolved, unless a read, a norm or a donor takes the written value itself

    # -- errors --

    def error(self, message: str, span: Span | None, notes: Sequence[str] = ()) -> None:
        self.errors.append(DeltaResolveError(message, span, notes=notes))

    def fail(self, message: str, span: Span | None, notes: Sequence[str] = ()) -> NoReturn:
        self.error(message, span, notes)
        raise Fail

    def warn(self, message: str, span: Span | None, notes: Sequence[str] = ()) -> None:
        w = DeltaWarning(message, span, notes=notes)
        self.warnings.append(w.located(self.source, self.filename) if self.source else w)

    def sorted_warnings(self) -> tuple[DeltaWarning, ...]:
        """The warnings in source order, each once (a site over several blocks resolves its position once each)."""
        seen: dict[tuple[str, Span | None], DeltaWarning] = {}
        for w in self.warnings:
            seen.setdefault((w.message, w.span), w)
        return tuple(sorted(seen.values(), key=lambda w: (w.span.line, w.span.column) if w.span else (0, 0)))

    # -- names and prompts --

    def define(self, name: str, kind: str, span: Span) -> bool:
        """Enter a name; a second definition is an error pointing at the first."""
        if name in self.defined:
            other_kind, other = self.defined[name]
            self.error(f"'{name}' is already defined: {other_kind} '{name}' at line {other.line}", span)
            return False
        self.defined[name] = (kind, span)
        return True

    def tokens(self, text: str) -> PromptTokens:
        if text not in self.tok_cache:
            self.tok_cache[text] = tokenize(self.spec, text)
        return self.tok_cache[text]

    def prompt_names(self) -> list[str]:
        return [n for n, p in self.prompts.items() if isinstance(p, ast.PromptDecl)]
