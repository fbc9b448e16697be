"""The syntax tree of a deltalang program, and a printer back to canonical source.

Nodes are small frozen attrs classes in the style of Jinja's `nodes.py`. Every
node has a keyword-only `span` (where it sits in the source) that takes no part
in equality or hashing, so `parse(format_program(tree)) == tree` holds for any
tree the parser can produce. The parser builds these; the resolver reads them.
"""

from __future__ import annotations

from typing import Any, Iterable, Union

import attrs

from deltalang.ground.errors import Span

NOSPAN = Span(0, 0, 0, 0)


def _span() -> Any:
    """The `span` field every node ends with: keyword-only, outside eq and hash."""
    return attrs.field(default=NOSPAN, eq=False, repr=False, kw_only=True)


# ---- positions -------------------------------------------------------------


@attrs.frozen
class IntPos:
    """A position by number: `3` (the fourth token) or `-1` (the last)."""

    value: int
    span: Span = _span()


@attrs.frozen
class PiecePos:
    """A position by a quoted piece of the prompt: the last token of its first occurrence."""

    text: str
    span: Span = _span()


@attrs.frozen
class VarPos:
    """A position given by a sweep variable: `t` in `over t in 0..9`."""

    name: str
    span: Span = _span()


@attrs.frozen
class Field:
    """A field of a dataset's record: `facts.subject` (a position, a donor prompt or a measured token)."""

    dataset: str
    field: str
    span: Span = _span()


@attrs.frozen
class AllPos:
    """`*`: every position of the prompt, one op per position."""

    span: Span = _span()


@attrs.frozen
class RangePos:
    """`2..6`: the positions 2 to 5 (half-open, as sweep ranges; a negative end counts from the end)."""

    start: int
    stop: int
    span: Span = _span()


Position = Union[IntPos, PiecePos, VarPos, Field, AllPos, RangePos]
Text = Union[str, Field]  # a measured token: quoted, or a record's field

# ---- selectors -------------------------------------------------------------


@attrs.frozen
class Block:
    """One block by number: `L3`."""

    index: int
    span: Span = _span()


@attrs.frozen
class AllBlocks:
    """`L*`: every block that has the value."""

    span: Span = _span()


@attrs.frozen
class SelIndex:
    """A block number inside `L[...]`; negative counts from the last block."""

    index: int
    span: Span = _span()


@attrs.frozen
class SelSlice:
    """A half-open range of blocks inside `L[...]`: `0:6`, `:6`, `2:`."""

    start: int | None
    stop: int | None
    span: Span = _span()


@attrs.frozen
class SelKind:
    """A kind of block inside `L[...]`: `linear` (DeltaNet) or `attention`."""

    kind: str
    span: Span = _span()


SelItem = Union[SelIndex, SelSlice, SelKind]


@attrs.frozen
class BlockList:
    """`L[...]`: the union of its items, in block order."""

    items: tuple[SelItem, ...]
    span: Span = _span()


@attrs.frozen
class BlockVar:
    """A block given by a sweep variable: `L` in `over L in L[linear]`."""

    name: str
    span: Span = _span()


Selector = Union[Block, AllBlocks, BlockList, BlockVar]

# ---- sites -----------------------------------------------------------------


@attrs.frozen
class Site:
    """`BLOCK.VALUE`, `BLOCK.VALUE(POS)`, or a model-level value when `block` is None."""

    block: Selector | None
    value: str
    position: Position | None = None
    head: Union[IntPos, VarPos, None] = None  # `.head(3)`, `.head(h)`: one value head's slice
    span: Span = _span()
    reduce: tuple["Reduce", ...] = ()  # `.mean(positions)`, `.norm(key_dim)`, ...: computed in the forward


@attrs.frozen
class Reduce:
    """One reduction after a site: `.norm(AXES)` (no axes: every axis but b and s), `.mean(AXES)`,
    `.head(K)` (after another reduction), `.project(load(FILE))`, and of a state's matrix `.svd(K)`,
    `.rank(TOL)`, `.erank()`."""

    kind: str  # "norm" | "mean" | "head" | "project" | "svd" | "rank" | "erank"
    axes: tuple[str, ...] = ()  # norm, mean: the axes as written
    index: int | None = None  # head; svd: how many singular values
    tol: float | None = None  # rank: the tolerance relative to the largest singular value
    direction: Union["LoadSource", "Expr", None] = None  # project: a file, or arithmetic over means
    span: Span = _span()


# ---- write sources -----------------------------------------------------------


@attrs.frozen
class FromSource:
    """`from RUN` (the same site there) or `from RUN.SITE` (a site of its own); `at POS` names the donor's
    position in the donor's own prompt (`from facts.corrupt at facts.foil_subject`, `from other at "Tower"`)."""

    run: str
    site: Site | None = None
    span: Span = _span()
    at: Position | None = None


@attrs.frozen
class ZerosSource:
    """`= zeros`."""

    span: Span = _span()


@attrs.frozen
class NamedSource:
    """`= NAME`: a value read elsewhere with `read ... as NAME`."""

    name: str
    span: Span = _span()


@attrs.frozen
class ScaleSource:
    """`*= FACTOR`: the value itself, scaled."""

    factor: float
    span: Span = _span()


@attrs.frozen
class MeanSource:
    """`= mean(PROMPTS)`: the same site, averaged over clean runs of the prompts."""

    prompts: tuple[str, ...]
    span: Span = _span()


@attrs.frozen
class LoadSource:
    """`load("direction.safetensors")` or `load("file.safetensors", "key")`: a tensor from a file."""

    path: str
    key: str | None = None
    span: Span = _span()


@attrs.frozen
class Number:
    """A number inside a source's arithmetic: `4` in `4 * mean(happy)`."""

    value: float
    span: Span = _span()


@attrs.frozen
class BinOp:
    """`LEFT OP RIGHT` with OP one of + - * over sources and numbers."""

    op: str
    left: "Expr"
    right: "Expr"
    span: Span = _span()


Atom = Union[FromSource, ZerosSource, NamedSource, MeanSource, LoadSource, Number]
Expr = Union[Atom, BinOp]


def expr_operands(e: Expr) -> list[Atom]:
    """The operands of an expression, left to right."""
    return expr_operands(e.left) + expr_operands(e.right) if isinstance(e, BinOp) else [e]


@attrs.frozen
class ExprSource:
    """`= EXPR` (arithmetic over sources) or `+= EXPR` (added to the value the forward computed)."""

    expr: Expr
    add: bool = False
    span: Span = _span()


Source = Union[FromSource, ZerosSource, NamedSource, ScaleSource, MeanSource, LoadSource, ExprSource]

# ---- measures --------------------------------------------------------------


@attrs.frozen
class Prob:
    """`prob(" tok")`: the next-token probability of one token."""

    token: Text
    span: Span = _span()


@attrs.frozen
class Top:
    """`top(5)`: the k most likely next tokens and their probabilities."""

    k: int
    span: Span = _span()


@attrs.frozen
class Rank:
    """`rank(" tok")`: the rank of one token in the next-token distribution (0 = top)."""

    token: Text
    span: Span = _span()


@attrs.frozen
class LogitDiff:
    """`logit_diff(" a", " b")`: the next-token logit of `a` minus that of `b`."""

    a: Text
    b: Text
    span: Span = _span()


@attrs.frozen
class KL:
    """`kl(RUN)`: KL divergence of this run's next-token distribution from RUN's."""

    run: str
    span: Span = _span()


@attrs.frozen
class Norm:
    """`norm(SITE)`: the Frobenius norm of a value; `norm(SITE, over=[AXES])` over those axes only."""

    site: Site
    span: Span = _span()
    over: tuple[str, ...] | None = None


@attrs.frozen
class Project:
    """`project(SITE, load(FILE))` or `project(SITE, mean(a) - mean(b))`: the value's dot product with a
    direction (per token, for a per-token value)."""

    site: Site
    direction: Union["LoadSource", "Expr"]
    span: Span = _span()


MeasureCall = Union[Prob, Rank, LogitDiff, KL, Norm, Top, Project]

# ---- statements ------------------------------------------------------------


@attrs.frozen
class Read:
    """`read SITE, ... [as NAME]`."""

    sites: tuple[Site, ...]
    alias: str | None = None
    span: Span = _span()


@attrs.frozen
class Write:
    """`write SITE SOURCE`."""

    site: Site
    source: Source
    span: Span = _span()


@attrs.frozen
class Measure:
    """`measure CALL, ... [as NAME]`."""

    calls: tuple[MeasureCall, ...]
    alias: str | None = None
    at: Union[IntPos, PiecePos, None] = None  # `at -2`: the logits of that position, not the last
    span: Span = _span()


@attrs.frozen
class Route:
    """`route torch|default`: which kernels the run uses."""

    kernel: str
    span: Span = _span()


@attrs.frozen
class Step:
    """`step K: STATEMENT` inside a generate block: the statement applies at step K only."""

    index: int
    body: Union[Read, Write, Measure]
    span: Span = _span()


Statement = Union[Read, Write, Measure, Route, Step]

# ---- declarations and runs ---------------------------------------------------


@attrs.frozen
class ModelDecl:
    """`model "ID"`."""

    name: str
    span: Span = _span()


@attrs.frozen
class PromptDecl:
    """`prompt NAME = "TEXT"`."""

    name: str
    text: str
    span: Span = _span()


@attrs.frozen
class DatasetDecl:
    """`dataset NAME = "FILE"`: records with named text fields (JSONL, CSV or TSV; relative to the .dl file)."""

    name: str
    path: str
    span: Span = _span()


@attrs.frozen
class PromptListDecl:
    """`prompts NAME = ["TEXT", ...]`."""

    name: str
    texts: tuple[str, ...]
    span: Span = _span()


@attrs.frozen
class Range:
    """`A..B`: the integers A to B-1."""

    start: int
    stop: int
    span: Span = _span()


@attrs.frozen
class FieldPos:
    """A position from a record's field in a dataset sweep's axis: `facts.subject` (its last token),
    `facts.subject[0]` (its first), `facts.subject + 1` (the token after it)."""

    field: Field
    index: int | None = None  # which of the piece's tokens: 0 the first, -1 the last (the default)
    offset: int = 0
    span: Span = _span()


AxisPos = Union[IntPos, PiecePos, FieldPos]


@attrs.frozen
class PosList:
    """A sweep axis's list of positions: `2, "Tower", -1`, or over a dataset `facts.subject, -1`."""

    items: tuple[AxisPos, ...]
    span: Span = _span()


@attrs.frozen
class Heads:
    """`heads` (every value head) or `heads[0:4]`, `heads[0,2]` in a sweep axis."""

    items: tuple[SelItem, ...] = ()  # empty: every head
    span: Span = _span()


@attrs.frozen
class Axis:
    """`VAR in SELECTOR`, `VAR in A..B`, `VAR in heads` or `VAR in POS, POS, ...` in a sweep header."""

    var: str
    domain: Union[Selector, Range, PosList, Heads]
    span: Span = _span()


@attrs.frozen
class Trace:
    """`trace NAME on PROMPT { ... }`: one forward pass."""

    name: str
    prompt: str
    body: tuple[Statement, ...]
    span: Span = _span()


@attrs.frozen
class Sampling:
    """`temperature T top_p P seed S` after a generate's max_new_tokens: sample instead of greedy."""

    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    span: Span = _span()


@attrs.frozen
class Generate:
    """`generate NAME on PROMPT max_new_tokens N [temperature T] [top_p P] [seed S] { ... }`."""

    name: str
    prompt: str
    max_new_tokens: int
    body: tuple[Statement, ...]
    sampling: Sampling | None = None  # None: greedy
    span: Span = _span()


@attrs.frozen
class SweepMethod:
    """`method attribution [steps K] [refine K] [path P]` after a sweep's axes: how its cells are computed."""

    name: str
    steps: int | None = None
    refine: int | None = None
    path: str | None = None
    span: Span = _span()


@attrs.frozen
class Sweep:
    """`sweep NAME on PROMPT over VAR in ..., ... [method ...] { ... }`: one trace per point of the axes."""

    name: str
    prompt: str
    axes: tuple[Axis, ...]
    body: tuple[Statement, ...]
    span: Span = _span()
    method: SweepMethod | None = None


Run = Union[Trace, Generate, Sweep]
Decl = Union[ModelDecl, PromptDecl, PromptListDecl, DatasetDecl]
Item = Union[ModelDecl, PromptDecl, PromptListDecl, DatasetDecl, Trace, Generate, Sweep, Read, Write, Measure, Route]


@attrs.frozen
class Comment:
    """A `# ...` comment, kept so that `deltalang fmt` can put it back."""

    text: str
    span: Span = _span()


@attrs.frozen
class Program:
    """A whole program: declarations, runs, and top-level statements (the implicit run `main`)."""

    items: tuple[Item, ...]
    comments: tuple[Comment, ...] = attrs.field(default=(), eq=False, repr=False)
    span: Span = _span()


RUN_TYPES = (Trace, Generate, Sweep)
DECL_TYPES = (ModelDecl, PromptDecl, PromptListDecl, DatasetDecl)
STATEMENT_TYPES = (Read, Write, Measure, Route, Step)

# ---- printing ----------------------------------------------------------------

INDENT = "    "
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def quote(text: str) -> str:
    """A string literal for `text`, escaping only what the grammar needs."""
    return '"' + "".join(_ESCAPES.get(c, c) for c in text) + '"'


def format_number(x: float) -> str:
    """The shortest literal that parses back to `x`."""
    return repr(float(x))


def format_text(t: Text) -> str:
    """A measured token as written: `" Paris"`, or a record's field `facts.answer`."""
    return quote(t) if isinstance(t, str) else f"{t.dataset}.{t.field}"


def format_position(p: Position | FieldPos) -> str:
    if isinstance(p, FieldPos):
        text = format_text(p.field) + ("" if p.index is None else f"[{p.index}]")
        return text + ("" if not p.offset else f" {'+' if p.offset > 0 else '-'} {abs(p.offset)}")
    if isinstance(p, IntPos):
        return str(p.value)
    if isinstance(p, PiecePos):
        return quote(p.text)
    if isinstance(p, Field):
        return format_text(p)
    if isinstance(p, AllPos):
        return "*"
    if isinstance(p, RangePos):
        return f"{p.start}..{p.stop}"
    return p.name


def format_sel_item(item: SelItem) -> str:
    """`3`, `0:6`, `:6`, `linear`: one item inside `L[...]`."""
    if isinstance(item, SelIndex):
        return str(item.index)
    if isinstance(item, SelSlice):
        return ("" if item.start is None else str(item.start)) + ":" + ("" if item.stop is None else str(item.stop))
    return item.kind


def format_selector(sel: Selector) -> str:
    """`L3`, `L*`, `L[0,2,4]`, `L[linear]`, or a sweep variable's name."""
    if isinstance(sel, Block):
        return f"L{sel.index}"
    if isinstance(sel, AllBlocks):
        return "L*"
    if isinstance(sel, BlockList):
        return "L[" + ",".join(format_sel_item(i) for i in sel.items) + "]"
    return sel.name


def format_site(site: Site) -> str:
    """`L0.state_after(3)`, `L[linear].states`, `next_token_probs`."""
    text = site.value if site.position is None else f"{site.value}({format_position(site.position)})"
    if site.head is not None:
        text += f".head({format_position(site.head)})"
    text += "".join(format_reduce(r) for r in site.reduce)
    return text if site.block is None else f"{format_selector(site.block)}.{text}"


def format_reduce(r: Reduce) -> str:
    """`.norm(key_dim, value_dim)`, `.mean(positions)`, `.head(2)`, `.project(load("d.safetensors"))`, `.svd(4)`,
    `.rank(0.01)`, `.erank()`."""
    if r.kind in ("head", "svd"):
        return f".{r.kind}({r.index})"
    if r.kind == "rank":
        return f".rank({r.tol!r})"
    if r.kind == "project":
        assert r.direction is not None
        return f".project({format_expr(r.direction)})"
    return f".{r.kind}({', '.join(r.axes)})"


def format_source(src: Source) -> str:
    """The part of a write after its site: `from other`, `= zeros`, `*= 0.5`..."""
    if isinstance(src, FromSource):
        at = "" if src.at is None else f" at {format_position(src.at)}"
        return f"from {src.run}" + ("" if src.site is None else "." + format_site(src.site)) + at
    if isinstance(src, ZerosSource):
        return "= zeros"
    if isinstance(src, NamedSource):
        return f"= {src.name}"
    if isinstance(src, ScaleSource):
        return f"*= {format_number(src.factor)}"
    if isinstance(src, ExprSource):
        return ("+= " if src.add else "= ") + format_expr(src.expr)
    return "= " + format_expr(src)


_PRECEDENCE = {"+": 1, "-": 1, "*": 2}


def format_expr(e: Expr, outer: int = 0, right: bool = False) -> str:
    """An operand of a source's arithmetic as written: `mean(a)`, `other.L2.state_output`, `4 * (a - b)`."""
    if isinstance(e, BinOp):
        prec = _PRECEDENCE[e.op]
        text = f"{format_expr(e.left, prec)} {e.op} {format_expr(e.right, prec, right=True)}"
        return f"({text})" if prec < outer or (right and prec == outer) else text
    if isinstance(e, Number):
        return str(int(e.value)) if e.value.is_integer() and abs(e.value) < 1e15 else format_number(e.value)
    if isinstance(e, FromSource):
        return e.run + ("" if e.site is None else "." + format_site(e.site))
    if isinstance(e, ZerosSource):
        return "zeros"
    if isinstance(e, NamedSource):
        return e.name
    if isinstance(e, LoadSource):
        return f"load({quote(e.path)}" + ("" if e.key is None else f", {quote(e.key)}") + ")"
    return "mean(" + ", ".join(e.prompts) + ")"


def format_measure(m: MeasureCall) -> str:
    """`prob(" Paris")`, `logit_diff(" a", " b")`, `kl(base)`, `norm(L0.state_output)`."""
    if isinstance(m, Prob):
        return f"prob({format_text(m.token)})"
    if isinstance(m, Rank):
        return f"rank({format_text(m.token)})"
    if isinstance(m, LogitDiff):
        return f"logit_diff({format_text(m.a)}, {format_text(m.b)})"
    if isinstance(m, KL):
        return f"kl({m.run})"
    if isinstance(m, Top):
        return f"top({m.k})"
    if isinstance(m, Project):
        return f"project({format_site(m.site)}, {format_expr(m.direction)})"
    over = "" if m.over is None else f", over=[{', '.join(m.over)}]"
    return f"norm({format_site(m.site)}{over})"


def _alias(alias: str | None) -> str:
    return "" if alias is None else f" as {alias}"


def format_statement(st: Statement | Decl) -> str:
    """One statement or declaration on one line."""
    if isinstance(st, Read):
        return "read " + ", ".join(format_site(s) for s in st.sites) + _alias(st.alias)
    if isinstance(st, Write):
        return f"write {format_site(st.site)} {format_source(st.source)}"
    if isinstance(st, Measure):
        at = "" if st.at is None else f" at {format_position(st.at)}"
        return "measure " + ", ".join(format_measure(m) for m in st.calls) + at + _alias(st.alias)
    if isinstance(st, Route):
        return f"route {st.kernel}"
    if isinstance(st, Step):
        return f"step {st.index}: {format_statement(st.body)}"
    if isinstance(st, ModelDecl):
        return f"model {quote(st.name)}"
    if isinstance(st, PromptDecl):
        return f"prompt {st.name} = {quote(st.text)}"
    if isinstance(st, PromptListDecl):
        return f"prompts {st.name} = [" + ", ".join(quote(t) for t in st.texts) + "]"
    if isinstance(st, DatasetDecl):
        return f"dataset {st.name} = {quote(st.path)}"
    raise TypeError(f"not a statement: {st!r}")


def format_axis(axis: Axis) -> str:
    d = axis.domain
    if isinstance(d, PosList):
        dom = ", ".join(format_position(p) for p in d.items)
    elif isinstance(d, Heads):
        dom = "heads" + ("[" + ",".join(format_sel_item(i) for i in d.items) + "]" if d.items else "")
    else:
        dom = f"{d.start}..{d.stop}" if isinstance(d, Range) else format_selector(d)
    return f"{axis.var} in {dom}"


def format_sampling(s: Sampling | None) -> str:
    """` temperature 0.7 top_p 0.9 seed 1`: the options a generate gives (empty when it is greedy)."""
    if s is None:
        return ""
    return "".join(f" {k} {format_number(v) if k != 'seed' else v}" for k, v in
                   (("temperature", s.temperature), ("top_p", s.top_p), ("seed", s.seed)) if v is not None)


def format_run_header(run: Run) -> str:
    """`trace NAME on PROMPT`, with the generate/sweep extras, without the brace."""
    if isinstance(run, Trace):
        return f"trace {run.name} on {run.prompt}"
    if isinstance(run, Generate):
        head = f"generate {run.name} on {run.prompt} max_new_tokens {run.max_new_tokens}"
        return head + format_sampling(run.sampling)
    head = f"sweep {run.name} on {run.prompt} over " + ", ".join(format_axis(a) for a in run.axes)
    return head if run.method is None else f"{head} {format_method(run.method)}"


def format_method(m: SweepMethod) -> str:
    """`method attribution steps 2 refine 20 path blocks` (the options given, in this order)."""
    opts = [(k, getattr(m, k)) for k in ("steps", "refine", "path")]
    return " ".join([f"method {m.name}", *(f"{k} {v}" for k, v in opts if v is not None)])


@attrs.frozen
class _Line:
    """One output line of the printer and the source lines it came from (0 = none)."""

    depth: int
    text: str
    first: int = 0
    last: int = 0
    blank_before: bool = False
    closes: bool = False  # a block's closing brace


def _lines(program: Program) -> list[_Line]:
    out: list[_Line] = []
    prev_was_run = False
    for n, item in enumerate(program.items):
        is_run = isinstance(item, RUN_TYPES)
        blank = n > 0 and (is_run or prev_was_run)
        s = item.span
        if isinstance(item, RUN_TYPES):
            out.append(_Line(0, format_run_header(item) + " {", s.line, s.line, blank))
            for st in item.body:
                out.append(_Line(1, format_statement(st), st.span.line, st.span.end_line))
            out.append(_Line(0, "}", s.end_line, s.end_line, closes=True))
        else:
            out.append(_Line(0, format_statement(item), s.line, s.end_line, blank))
        prev_was_run = is_run
    return out


def _comment_placement(source_lines: list[str], comment: Comment) -> bool:
    """True when a comment trails code on its line, False when it has the line to itself."""
    line = source_lines[comment.span.line - 1] if 0 < comment.span.line <= len(source_lines) else ""
    return bool(line[: comment.span.column - 1].strip())


def format_program(program: Program, source: str | None = None) -> str:
    """Canonical source for `program`: one statement per line, 4-space blocks.

    With the `source` the program was parsed from, its comments are kept (on
    their own line, or trailing the statement they trailed) and single blank
    lines between statements are kept too.
    """
    lines = _lines(program)
    if source is None or not program.comments:
        return _join(lines, [], source)
    return _join(lines, list(program.comments), source)


def _join(lines: list[_Line], comments: list[Comment], source: str | None) -> str:
    src_lines = source.split("\n") if source is not None else []  # lines as the parser counts them

    def blank_in_source(line_no: float) -> bool:
        n = int(line_no)
        return n == line_no and 1 < n <= len(src_lines) + 1 and not src_lines[n - 2].strip()

    # a trailing comment goes after the last printed line that ends on its source line;
    # one inside a statement that spans lines goes on its own line before that statement
    last_line_for: dict[int, int] = {}
    for i, ln in enumerate(lines):
        if ln.last:
            last_line_for[ln.last] = i
    trailing: dict[int, list[str]] = {}
    own: list[tuple[float, str]] = []  # (where: a source line, or just before one)
    for c in sorted(comments, key=lambda c: (c.span.line, c.span.column)):
        line = c.span.line
        if _comment_placement(src_lines, c) and line in last_line_for:
            trailing.setdefault(line, []).append(c.text)
            continue
        inside = next((ln for ln in lines if ln.first < line <= ln.last), None)
        own.append((inside.first - 0.5 if inside is not None else float(line), c.text))
    own.sort(key=lambda x: x[0])

    out: list[str] = []

    def emit(depth: int, text: str, blank: bool) -> None:
        if blank and out and out[-1] != "":
            out.append("")
        out.append(INDENT * depth + text)

    oi = 0
    prev_source_line = 0
    for i, ln in enumerate(lines):
        wanted_blank = ln.blank_before  # the canonical blank line goes before the comments
        while oi < len(own) and ln.first and own[oi][0] < ln.first:
            where, text = own[oi]
            emit(ln.depth + 1 if ln.closes else ln.depth, text, wanted_blank or blank_in_source(where))
            wanted_blank = False
            oi += 1
        text = ln.text
        if ln.last and last_line_for.get(ln.last) == i and ln.last in trailing:
            text += "  " + "  ".join(trailing[ln.last])
        fresh_line = ln.first > prev_source_line  # not the second statement of a `;` line
        blank = wanted_blank or (fresh_line and not ln.closes and blank_in_source(ln.first))
        emit(ln.depth, text, blank)
        prev_source_line = max(prev_source_line, ln.last)
    for where, text in own[oi:]:
        emit(0, text, blank_in_source(where))
    return "\n".join(out) + "\n"


def walk(node: Any) -> Iterable[Any]:
    """Every node under `node` (itself included), depth first."""
    yield node
    if attrs.has(type(node)):
        for f in attrs.fields(type(node)):
            if f.name == "span":
                continue
            yield from walk(getattr(node, f.name))
    elif isinstance(node, tuple):
        for x in node:
            yield from walk(x)
