"""The resolved program: what the resolver hands the compiler, and how results are named.

`Resolved` holds the runs in source order; each `ResolvedRun` has one `ResolvedOp` per block with every position a
plain non-negative token index, and its `ResolvedMeasure`s. Write sources are `FromRun`, `Zeros`, `Named`, `Scale`,
`Mean`. Sweeps stay templates (ops whose block or position is a sweep variable) with their axes resolved;
`ResolvedRun.points()` and `ResolvedRun.instantiate()` expand them. The naming rules (`op_result_name`,
`measure_result_name`, `measure_call_text`, `site_text`) are DESIGN's and live here alone: the resolver, the planner
and the sweep engine name results through them. `format_source` is the one spelling of a resolved write's source
(`check` and `emit --plan` print it; `token_note` names a token as `display` shows it). Needs `ast`, `display`, `spec`.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, Mapping, Sequence, Union

import attrs

from deltalang.ground import display
from deltalang.ground.errors import DeltaWarning, Span
from deltalang.models.spec import ModelSpec

from . import ast

# ---- the resolved program ------------------------------------------------------

@attrs.frozen
class FromRun:
    """Write the value a donor run reads at this site: the donor read this write implies."""

    run: str
    layer: int | None
    value: str
    position: int | None
    step: int | None
    layer_var: str | None = None  # sweep templates: the block is this variable's
    position_var: str | None = None  # sweep templates: the position is this variable's
    position_map: tuple[tuple[int, int], ...] = ()  # with position_var: (target position, donor position)
    head: int | None = None  # a write of one head: the donor's head it takes (the donor reads the whole value)
    head_var: str | None = None  # sweep templates: the donor's head is this variable's


@attrs.frozen
class Zeros:
    """Write zeros of the value's shape."""


@attrs.frozen
class Named:
    """Write the result `name` that run `run` reads (`read ... as NAME`)."""

    name: str
    run: str


@attrs.frozen
class Scale:
    """Write the value itself times `factor`."""

    factor: float


@attrs.frozen
class Mean:
    """Write the mean of the same site over clean runs of these prompts."""

    prompts: tuple[str, ...]  # the names as written (prompts or prompt lists)
    texts: tuple[str, ...]  # every prompt text, lists flattened
    positions: tuple[int, ...] | None = None  # the position in each text; None for values without one
    position_var: str | None = None  # sweep templates: the write's position is this variable's
    position_map: tuple[tuple[int, tuple[int, ...]], ...] = ()  # with position_var: (position, each text's)


@attrs.frozen
class Load:
    """Write a tensor from a safetensors file (`path` absolute), cast to the value's dtype and device."""

    path: str
    key: str
    shown: str  # the path as written


@attrs.frozen
class MeanDirection:
    """A projection's direction `mean(a) - mean(b)` (`shown`): `Arith`/`Const` over `Mean`s (planned: `Donor`s)."""

    expr: Any
    shown: str
    head: tuple[str, int] | None = None  # after `.head(h)`: (the site's value, h), that head of each mean


@attrs.frozen
class Const:
    """A number in a source's arithmetic."""

    value: float


@attrs.frozen
class Donor:
    """The planner's form of an operand taken from elsewhere: the results key that holds it."""

    key: str


@attrs.frozen
class Arith:
    """`LEFT OP RIGHT` over operands (`+`, `-`, `*`)."""

    op: str
    left: Any
    right: Any


@attrs.frozen
class Steer:
    """`= EXPR` or `+= EXPR` (added to the value the forward computed): arithmetic over sources."""

    expr: Any  # Arith | Const | FromRun | Zeros | Named | Mean | Load | Donor
    add: bool = False


def expr_atoms(e: Any) -> list[Any]:
    """The operands of an expression, left to right."""
    return expr_atoms(e.left) + expr_atoms(e.right) if isinstance(e, Arith) else [e]


def map_atoms(e: Any, fn: Callable[[Any], Any]) -> Any:
    """The expression with each operand replaced by `fn(operand)`."""
    if isinstance(e, Arith):
        return Arith(e.op, map_atoms(e.left, fn), map_atoms(e.right, fn))
    return fn(e)


WriteSource = Union[FromRun, Zeros, Named, Scale, Mean, Load, Steer]


def operand_ops(ops: Sequence["ResolvedOp"]) -> Iterator["ResolvedOp"]:
    """The ops, each write with arithmetic preceded by one op of kind "operand" per operand (its source the
    operand), so the planner finds every operand's value as it finds a plain source's (`with_donors`)."""
    for op in ops:
        if op.kind == "write" and isinstance(op.source, Steer):
            for a in expr_atoms(op.source.expr):
                yield attrs.evolve(op, kind="operand", source=a)
        yield op


def with_donors(src: Any, keys: list[str | None]) -> Any:
    """An arithmetic source with each operand the planner found a results key for (`keys`, in operand order,
    consumed) made a `Donor`; any other source unchanged."""
    if not isinstance(src, Steer):
        return src
    found = keys[:len(expr_atoms(src.expr))]
    del keys[:len(found)]
    it = iter(found)
    return attrs.evolve(src, expr=map_atoms(src.expr, lambda a: (lambda k: a if k is None else Donor(k))(next(it))))


def logits_kept(measures: Sequence[tuple[str, "ResolvedMeasure"]], n_tokens: Mapping[str, int]) -> dict[str, int]:
    """Run -> how many last positions of logits its measures `at POS` (and a kl's other run) read."""
    kept: dict[str, int] = {}
    for run, m in measures:
        for name, at in ((run, m.at), (m.against, m.against_at)):
            if at is not None and name is not None:
                kept[name] = max(kept.get(name, 1), n_tokens[name] - at)
    return kept


@attrs.frozen
class ResolvedOp:
    """One read or write of one value on one block (or of a model-level value)."""

    kind: str  # "read" | "write"
    layer: int | None  # None for model-level values (and sweep block variables)
    value: str
    position: int | None  # non-negative, in the run's prompt's own token coordinates
    step: int | None  # generate step; None: every step, or not a generate
    result_name: str | None  # reads: where the result is stored; writes: None
    source: WriteSource | None = None  # writes only
    written: str = ""  # the site as written, its block made concrete: L0.state_after("Tower")
    alias: str | None = None  # the `as NAME` of a read
    layer_var: str | None = None  # sweep templates: the block is this variable's
    position_var: str | None = None  # sweep templates: the position is this variable's
    head: int | None = None  # `.head(h)`: one value head's slice (axis HEAD_AXIS[value]); None: the whole value
    head_var: str | None = None  # sweep templates: the head is this variable's
    span: Span = attrs.field(default=ast.NOSPAN, eq=False, repr=False)
    reduce: "Reduce | None" = None  # a reduction computed in the forward (`.mean(positions)`, ...)


@attrs.frozen
class Reduce:
    """A reduction of a read or measured value, computed inside the forward (`measures.Reduction` runs it)."""

    axes: tuple[str, ...]  # the value's axes as served, `b` first (`values.axes`)
    steps: tuple[tuple[str, Any], ...]  # ("head", 2), ("norm", axes|None), ("mean", axes), ("project", direction)
    text: str  # what follows the site in a read's result name: `.norm(key_dim, value_dim)`
    shape: tuple[tuple[str, int | None], ...]  # the result's axes and sizes (None: a size that varies)

    def shown(self) -> str:
        """`[b=1, s=8, heads=4]`."""
        return "[" + ", ".join(a if n is None else f"{a}={n}" for a, n in self.shape) + "]"

    def at(self, point: Mapping[str, int]) -> "Reduce":  # a first step of a head variable's (`("head", "h")`)
        h = self.steps[0][1] if self.steps and self.steps[0][0] == "head" else None
        return self if not isinstance(h, str) else attrs.evolve(self, steps=(("head", point[h]), *self.steps[1:]))

    def loads(self) -> list["Load"]:
        return [a for k, a in self.steps if k == "project" and isinstance(a, Load)]


# the values with a value-head axis, and which axis it is (`.head(h)` slices it)
HEAD_AXIS: dict[str, int] = {"state_input": 1, "state_after": 1, "state_output": 1, "states": 2,
                             "attention_queries": 2, "attention_keys": 2, "attention_values": 2, "decays": 2,
                             "betas": 2, "attention_head_outputs": 2, "write_keys": 2, "write_values": 2}


@attrs.frozen
class ResolvedMeasure:
    """One measure of a run: prob, rank, logit_diff, kl or norm (one per block)."""

    kind: str
    result_name: str
    step: int | None = None
    token_ids: tuple[int, ...] = ()  # prob/rank: one id; logit_diff: (a, b) (an answer's first token)
    token_texts: tuple[str, ...] = ()  # the strings as written
    against: str | None = None  # kl: the other run
    layer: int | None = None  # norm: the site
    value: str | None = None
    position: int | None = None
    written: str = ""
    alias: str | None = None
    layer_var: str | None = None
    position_var: str | None = None
    span: Span = attrs.field(default=ast.NOSPAN, eq=False, repr=False)
    answers: tuple[tuple[int, ...], ...] = ()  # prob/logit_diff: each answer's every token
    at: int | None = None  # `at POS`: the position whose logits are measured (None: the last)
    against_at: int | None = None  # kl `at POS`: the position of the other run's logits
    reduce: Reduce | None = None  # norm/project computed in the forward: the site's reduction, the measure's last
    spaced: tuple[int | None, ...] = ()  # each answer's twin: itself after a space, one other token (`tokens.spaced_twin`)

    @property
    def forced(self) -> bool:
        """Whether an answer is several tokens: then measured by teacher forcing (sum of log-probabilities)."""
        return any(len(a) > 1 for a in self.answers)


@attrs.frozen
class SweepAxis:
    """One axis of a sweep: a variable over blocks or over positions."""

    var: str
    kind: str  # "block" | "position" | "head"
    values: tuple[int, ...]  # block indices, positions resolved in the sweep's prompt, or head indices
    labels: tuple[int, ...]  # the values as written (a range's numbers may be negative)
    span: Span = attrs.field(default=ast.NOSPAN, eq=False, repr=False)


@attrs.frozen
class ResolvedRun:
    """One forward (trace), one generate, or one sweep (a template over its axes)."""

    name: str
    kind: str  # "trace" | "generate" | "sweep"
    prompt: str  # the prompt's name
    prompt_text: str
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]  # each token decoded alone: ' Tower' (`display.token` shows it: ␣Tower)
    max_new_tokens: int | None = None
    implicit: bool = False  # `main`, or a clean run of a prompt named in `from`/`kl`
    ops: tuple[ResolvedOp, ...] = ()
    measures: tuple[ResolvedMeasure, ...] = ()
    route: str | None = None  # None | "torch" | "default"
    axes: tuple[SweepAxis, ...] = ()
    span: Span = attrs.field(default=ast.NOSPAN, eq=False, repr=False)
    method: ast.SweepMethod | None = None  # a sweep's `method ...` as written (None: exact)
    sampling: ast.Sampling | None = None  # a generate's `temperature/top_p/seed` (None: greedy)

    def points(self) -> Iterator[dict[str, int]]:
        """Every point of a sweep: {variable: block index or resolved position}."""
        names = [a.var for a in self.axes]
        for combo in itertools.product(*(a.values for a in self.axes)):
            yield dict(zip(names, combo, strict=True))

    def instantiate(self, binding: Mapping[str, int]) -> "ResolvedRun":
        """This sweep at one point: a trace named `NAME[var=value,...]` with concrete ops."""
        label = ",".join(f"{k}={v}" for k, v in binding.items())
        name = f"{self.name}[{label}]"
        ops = tuple(_bind_op(op, binding, name) for op in self.ops)
        measures = tuple(_bind_measure(m, binding, name) for m in self.measures)
        return attrs.evolve(self, name=name, kind="trace", ops=ops, measures=measures, axes=(), method=None)


@attrs.frozen
class Resolved:
    """A program checked against a model: the compiler's input."""

    model: str | None  # the program's `model "ID"`, if any
    prompts: dict[str, str | tuple[str, ...]]
    runs: tuple[ResolvedRun, ...]
    spec: ModelSpec = attrs.field(eq=False, repr=False)
    source: str = attrs.field(default="", eq=False, repr=False)
    filename: str = attrs.field(default="<program>", eq=False, repr=False)
    warnings: tuple[DeltaWarning, ...] = attrs.field(default=(), eq=False, repr=False)  # in source order

    def run(self, name: str) -> ResolvedRun:
        """The run called `name` (KeyError if none)."""
        for r in self.runs:
            if r.name == name:
                return r
        raise KeyError(name)

    @property
    def result_names(self) -> list[str]:
        """Every result the program stores, in source order."""
        out: list[str] = []
        for r in self.runs:
            out.extend(op.result_name for op in r.ops if op.result_name is not None)
            out.extend(m.result_name for m in r.measures)
        return out


# ---- naming -----------------------------------------------------------------------


def site_text(layer: int | None, value: str, position: Any, layer_var: str | None = None, head: Any = None) -> str:
    """`L0.state_after(3)`, `next_token_probs`, `L1.states.head(2)`; a sweep variable's block as `L{L}`."""
    text = value if position is None else f"{value}({position})"
    if head is not None:
        text += f".head({head})"
    if layer_var is not None:
        return f"L{{{layer_var}}}.{text}"
    return text if layer is None else f"L{layer}.{text}"


def op_result_name(run: str, step: int | None, layer: int | None, value: str, position: Any,
                   alias: str | None, multi: bool, layer_var: str | None = None, head: Any = None) -> str:
    """DESIGN's naming: `NAME`, `NAME.L<i>`, `RUN.L<i>.VALUE`, `RUN.step<k>.L<i>.VALUE` (`.head(h)` after it)."""
    if alias is not None:
        return f"{alias}.L{layer}" if multi else alias
    prefix = run if step is None else f"{run}.step{step}"
    return f"{prefix}.{site_text(layer, value, position, layer_var, head)}"


def measure_call_text(kind: str, texts: Sequence[str], against: str | None, site: str) -> str:
    """A measure's call as its result name spells it: `prob(" Paris")`, `kl(base)`, `norm(L0.state_output)`."""
    if kind in ("prob", "rank"):
        return f"{kind}({ast.quote(texts[0])})"
    if kind == "logit_diff":
        return f"logit_diff({ast.quote(texts[0])}, {ast.quote(texts[1])})"
    if kind == "kl":
        return f"kl({against})"
    if kind == "top":
        return f"top({texts[0]})"
    return f"norm({site})"


def measure_result_name(run: str, step: int | None, call: str, alias: str | None,
                        layer: int | None, multi: bool) -> str:
    """`RUN.prob(" Paris")`, `RUN.step2.kl(base)`, or the `as` name (`NAME.L<i>` over blocks)."""
    if alias is not None:
        return f"{alias}.L{layer}" if multi else alias
    prefix = run if step is None else f"{run}.step{step}"
    return f"{prefix}.{call}"


# ---- printing a write's source ------------------------------------------------------


def token_note(tokens: Sequence[str], position: int | None) -> str:
    """` (␣Tower)`: the token at a position of a prompt's `tokens` (`display.token`), or which generated token."""
    if position is None or position < 0:
        return ""
    if position >= len(tokens):
        return f" (new token {position - len(tokens) + 1})"
    return f" ({display.token(tokens[position])})"


def format_source(src: WriteSource | None, runs: Sequence[ResolvedRun] = (), *, donor_key: str | None = None,
                  number: Callable[[float], str] = ast.format_number) -> str:
    """A resolved write's source as printed after its site; the one spelling `check` and `emit --plan` share.

    `= zeros`, `*= 0.5` (the factor through `number`). A value taken from elsewhere is spelled with its donor made
    explicit (`check`): `from base.L0.state_after(3) (␣Tower)`, the token from the donor among `runs`; `= NAME
    (read in RUN)`; `= mean(p, q: 2 prompts, positions 3 4)`. Given `donor_key` it is the result the plan reads
    instead (`emit --plan`): `= ~base.L0.state_after(3)`. (`ast.format_source`: a source as written, unresolved.)
    """
    if isinstance(src, Zeros):
        return "= zeros"
    if isinstance(src, Scale):
        return f"*= {number(src.factor)}"
    if isinstance(src, Steer):
        return ("+= " if src.add else "= ") + _format_expr(src.expr, runs, number)
    if isinstance(src, Load):
        return f"= load({ast.quote(src.shown)}, {ast.quote(src.key)})"
    if isinstance(src, Donor):
        return f"= {src.key}"
    if donor_key is not None and isinstance(src, (FromRun, Named, Mean)):
        return f"= {donor_key}"
    if isinstance(src, FromRun):
        donor = next((r for r in runs if r.name == src.run), None)
        pos: Any = src.position if src.position_var is None else f"{{{src.position_var}}}"
        text = f"from {src.run}" + ("" if src.step is None else f".step{src.step}") + "."
        layer = src.layer
        if src.layer_var is not None:
            text += f"L{{{src.layer_var}}}."
        elif layer is not None:
            text += f"L{layer}."
        text += src.value if pos is None else f"{src.value}({pos})"
        if src.head is not None or src.head_var is not None:
            text += f".head({src.head if src.head_var is None else '{' + src.head_var + '}'})"
        if donor is not None and src.position is not None:
            text += token_note(donor.tokens, src.position)
        if src.position_map:
            text += f" ({src.position_var}: " + " ".join(f"{a}->{b}" for a, b in src.position_map) + ")"
        return text
    if isinstance(src, Named):
        return f"= {src.name} (read in {src.run})"
    if isinstance(src, Mean):
        n = len(src.texts)
        where = "" if not src.positions else ", positions " + " ".join(str(p) for p in src.positions)
        if src.position_map:  # a sweep's position: each prompt's position at each of its values
            where = f", at {src.position_var}: " + "; ".join(f"{v} -> {' '.join(map(str, ps))}"
                                                             for v, ps in src.position_map)
        return f"= mean({', '.join(src.prompts)}: {n} prompt{'s' if n != 1 else ''}{where})"
    return "?"


def _format_expr(e: Any, runs: Sequence[ResolvedRun], number: Callable[[float], str], outer: int = 0,
                 right: bool = False) -> str:
    """An expression source as `check` and `emit --plan` print it, each operand spelled by `format_source`."""
    if isinstance(e, Arith):
        prec = 2 if e.op == "*" else 1
        text = (f"{_format_expr(e.left, runs, number, prec)} {e.op} "
                f"{_format_expr(e.right, runs, number, prec, True)}")
        return f"({text})" if prec < outer or (right and prec == outer) else text
    if isinstance(e, Const):
        return number(e.value)
    text = format_source(e, runs, number=number)
    return text[2:] if text.startswith("= ") else text  # `from RUN...` keeps its word


def _bind_source(src: Any, b: Mapping[str, int]) -> Any:
    """A source (or an operand of one) at one point of a sweep: its block and positions made concrete."""
    if isinstance(src, FromRun):
        return attrs.evolve(src, layer=b[src.layer_var] if src.layer_var else src.layer,
                            position=dict(src.position_map)[b[src.position_var]] if src.position_var
                            else src.position, layer_var=None, position_var=None, position_map=(),
                            head=b[src.head_var] if src.head_var else src.head, head_var=None)
    if isinstance(src, Mean) and src.position_var is not None:
        return attrs.evolve(src, positions=dict(src.position_map)[b[src.position_var]], position_var=None,
                            position_map=())
    return src


def _bind_op(op: ResolvedOp, b: Mapping[str, int], run: str) -> ResolvedOp:
    layer = b[op.layer_var] if op.layer_var is not None else op.layer
    pos = b[op.position_var] if op.position_var is not None else op.position
    head = b[op.head_var] if op.head_var is not None else op.head
    src = op.source
    if isinstance(src, Steer):
        src = attrs.evolve(src, expr=map_atoms(src.expr, lambda a: _bind_source(a, b)))
    src = _bind_source(src, b)
    name = None
    if op.result_name is not None:
        multi = op.alias is not None and op.result_name != op.alias
        name = op_result_name(run, op.step, layer, op.value, pos, op.alias, multi, head=head)
        if op.alias is not None:
            name = f"{run}.{name}"  # one result per point of the sweep
        elif op.reduce is not None:
            name += op.reduce.text  # `.norm(key_dim)`: as the trace names it
    written = op.written
    if op.layer_var is not None:
        written = written.replace(f"{op.layer_var}.", f"L{layer}.", 1)
    if op.position_var is not None:
        written = written.replace(f"({op.position_var})", f"({pos})", 1)
    if op.head_var is not None:
        written = written.replace(f".head({op.head_var})", f".head({head})", 1)
    return attrs.evolve(op, layer=layer, position=pos, source=src, result_name=name, written=written, head=head,
                        layer_var=None, position_var=None, head_var=None, reduce=op.reduce and op.reduce.at(b))


def _bind_measure(m: ResolvedMeasure, b: Mapping[str, int], run: str) -> ResolvedMeasure:
    layer = b[m.layer_var] if m.layer_var is not None else m.layer
    pos = b[m.position_var] if m.position_var is not None else m.position
    if m.reduce is not None:  # `SWEEP.norm(L{L}.state_after({t}).head({h}), over=[...])`: its variables bound
        call = m.result_name.split(".", 1)[1] if m.alias is None else m.written
        for var, v in b.items():  # `{L}`, `{t}`, `{h}`
            call = call.replace(f"{{{var}}}", str(v))
        name = f"{run}.{call}" if m.alias is None else f"{run}.{m.result_name}"
        return attrs.evolve(m, layer=layer, position=pos, result_name=name, reduce=m.reduce.at(b),
                            written=call if m.alias is None else m.written, layer_var=None, position_var=None)
    site = site_text(layer, m.value or "", pos) if m.kind == "norm" else ""
    call = measure_call_text(m.kind, m.token_texts, m.against, site)
    multi = m.alias is not None and m.result_name != m.alias
    name = measure_result_name(run, m.step, call, m.alias, layer, multi)
    if m.alias is not None:
        name = f"{run}.{name}"  # one result per point of the sweep
    written = f"norm({site_text(layer, m.value or '', pos)})" if m.kind == "norm" else m.written
    return attrs.evolve(m, layer=layer, position=pos, result_name=name, written=written, layer_var=None,
                        position_var=None)
