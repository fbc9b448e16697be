"""Write sources: `from RUN[.SITE]`, `= zeros`, `*= k`, `= mean(...)`, `= NAME`.

`write_source()` resolves the source of a write to one target block: the donor
run and its site and position (`from_run`, `donor_position`), or the prompts of
a mean. `= NAME` needs every read resolved first: it stays a `NamedPending`
until `finish_deferred()` resolves it (`named`). `run_target()` also serves
`kl(RUN)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
from safetensors import SafetensorError, safe_open

from deltalang.ground.errors import Span
from deltalang.models import values
from deltalang.models.spec import text_config

from .. import ast
from ..ir import Arith, Const, FromRun, Load, Mean, Named, Scale, Steer, Zeros, expr_atoms, map_atoms
from ..tokens import PromptTokens
from .scope import Ctx, Fail, Scope, Target, did_you_mean, n_tokens, shape_class, shape_of
from .sites import expand, index, piece, position_variable, unknown_value


@attrs.define
class NamedPending:
    """A `= NAME` source waiting for every read to be resolved."""

    src: ast.NamedSource
    target: Target
    run: str
    toks: PromptTokens


def write_source(scope: Scope, src: ast.Source, t: Target, n: int, count: int, ctx: Ctx) -> Any:
    """The source of a write to target block number `n` of `count` (`= NAME` is left pending)."""
    if isinstance(src, ast.ZerosSource):
        return Zeros()
    if isinstance(src, ast.ScaleSource):
        return Scale(src.factor)
    if isinstance(src, ast.NamedSource):
        return NamedPending(src, t, ctx.name, ctx.toks)
    if isinstance(src, ast.MeanSource):
        return mean(scope, src, t, ctx)
    if isinstance(src, ast.LoadSource):
        return load(scope, src, t, ctx)
    if isinstance(src, ast.ExprSource):
        return expression(scope, src, t, n, count, ctx)
    return from_run(scope, src, t, n, count, ctx)


def expression(scope: Scope, src: ast.ExprSource, t: Target, n: int, count: int, ctx: Ctx) -> Steer:
    """`= EXPR` / `+= EXPR`: each operand resolved as the source it is (a bare name of a run or prompt is a
    donor, as after `from`); every operand that is a tensor has the value's shape, numbers broadcast."""

    def operand(e: ast.Expr) -> Any:
        if isinstance(e, ast.BinOp):
            return Arith(e.op, operand(e.left), operand(e.right))
        if isinstance(e, ast.Number):
            return Const(e.value)
        if isinstance(e, ast.NamedSource) and e.name not in scope.aliases and (
                e.name in scope.runs or e.name in scope.prompts or (e.name == "main" and scope.main_items)):
            e = ast.FromSource(e.name, None, span=e.span)
        return write_source(scope, e, t, n, count, ctx)

    expr = operand(src.expr)
    if not src.add and all(isinstance(a, Const) for a in expr_atoms(expr)):
        scope.fail("'= EXPR' needs a value among its operands (a run, mean(...), a read's name, zeros, "
                   "load(...)); to scale write '*= K', to add '+= K'", src.span)
    return Steer(expr, src.add)


def is_pending(src: Any) -> bool:
    """Whether a source still waits for `= NAME` (itself, or an operand of its arithmetic)."""
    if isinstance(src, Steer):
        return any(isinstance(a, NamedPending) for a in expr_atoms(src.expr))
    return isinstance(src, NamedPending)


def tensor_header(scope: Scope, src: ast.LoadSource) -> tuple[Path, str, tuple[int, ...]]:
    """(the file, relative to the program's; the tensor's key; its shape) of `load("file.safetensors"[, "key"])`,
    from the file's header only (safetensors: no pickle, no code), or a located error."""
    if not src.path.endswith(".safetensors"):
        scope.fail(f"load reads safetensors files only (no pickle, no code): {ast.quote(src.path)}; save it with "
                   f"safetensors.torch.save_file", src.span)
    base = Path(scope.filename).parent if not scope.filename.startswith("<") else Path.cwd()
    path = Path(src.path) if Path(src.path).is_absolute() else base / src.path
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            key = src.key if src.key is not None else (keys[0] if len(keys) == 1 else None)
            if key is None or key not in keys:
                what = "names no tensor" if src.key is None else f"has no tensor {ast.quote(src.key)}"
                scope.fail(f"{path} {what}: it holds {', '.join(map(ast.quote, keys)) or 'none'}; name one: "
                           f"load({ast.quote(src.path)}, \"KEY\")", src.span)
            shape = tuple(f.get_slice(key).get_shape())
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # missing, unreadable, not safetensors
        scope.fail(f"cannot load {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}", src.span)
    return path, key, shape


def load(scope: Scope, src: ast.LoadSource, t: Target, ctx: Ctx) -> Load:
    """`load("file.safetensors"[, "key"])` as a write's source: the tensor's shape is the value's, with or
    without the batch axis of 1."""
    path, key, shape = tensor_header(scope, src)
    want = value_shape(scope, t.value, len(ctx.toks))
    if want is not None and shape not in (want, (1, *want)):
        scope.fail(f"the shapes do not fit: {t.value} is {list(want)} (without the batch axis), "
                   f"{ast.quote(key)} in {src.path} is {list(shape)}", src.span)
    return Load(str(path.resolve()), key, src.path)


def value_shape(scope: Scope, value: str, n: int) -> tuple[int, ...] | None:
    """A value's shape without the batch axis, from the catalogue's and the model's dimensions."""
    info = values.CATALOGUE.get(value)
    if info is None or "Kimi" in info.shape and scope.spec.family.per_channel_decay:
        return None
    tc = text_config(scope.spec.config)
    hidden = scope.spec.family.stream_width(tc) if value == "output" else getattr(tc, "hidden_size", 0)
    d = dict(scope.spec.dims, s=n, hidden=hidden)
    d["width-1"] = d.get("conv_width", 1) - 1
    names = info.shape.split("]")[0].strip("[ ").split(", ")[1:]
    return tuple(int(d.get(x, 0)) for x in names)


def run_target(scope: Scope, name: str, span: Span, ctx: Ctx, what: str) -> tuple[str, str, PromptTokens]:
    """(run name, run kind, its prompt's tokens) for a name in `from` or `kl`."""
    if name == ctx.name:
        scope.fail(f"'{name}' cannot take a value from itself: {what} names another run or a prompt", span)
    if name in scope.runs:
        run = scope.runs[name]
        if isinstance(run, ast.Sweep):
            scope.fail(f"'{name}' is a sweep: {what} takes a trace, a generate or a prompt", span)
        p = scope.prompts.get(run.prompt)
        if not isinstance(p, ast.PromptDecl):
            raise Fail  # the run's own header error is reported there
        return name, "generate" if isinstance(run, ast.Generate) else "trace", scope.tokens(p.text)
    if name == "main" and scope.main_items:
        if scope.main_prompt is None:
            raise Fail  # why `main` has no prompt is reported at its first statement
        text = scope.prompt_texts[scope.main_prompt]
        assert isinstance(text, str)
        return "main", "trace", scope.tokens(text)
    p = scope.prompts.get(name)
    if isinstance(p, ast.PromptDecl):
        scope.implicit.setdefault(name, span)
        return name, "trace", scope.tokens(p.text)
    if isinstance(p, ast.PromptListDecl):
        scope.fail(f"'{name}' is a prompt list: {what} takes one run or prompt; for the mean over the list "
                   f"write '= mean({name})'", span)
    if name in scope.aliases:
        scope.fail(f"'{name}' is the name of a read: write '= {name}' to write its value", span)
    options = list(scope.runs) + list(scope.prompt_names())
    scope.fail(f"unknown run or prompt '{name}'" + did_you_mean(name, options), span,
               notes=[f"runs and prompts: {', '.join(options)}"] if options else [])


def from_run(scope: Scope, src: ast.FromSource, t: Target, n: int, count: int, ctx: Ctx) -> FromRun:
    """`from RUN` (the same site there) or `from RUN.SITE`, for target block number `n` of `count`."""
    run, kind, dtoks = run_target(scope, src.run, src.span, ctx, "'from'")
    step = t.step if kind == "generate" else None
    site = src.site
    value, layer, layer_var = t.value, t.layer, t.layer_var
    raw, span = t.raw, src.span
    if site is not None:
        value = site.value
        if value not in values.CATALOGUE:
            if value in values.MODEL_VALUES:
                scope.fail(f"'{value}' is a value of the whole model; a write takes a block's value", site.span)
            unknown_value(scope, site, block_level=True)
        if shape_class(value) != shape_class(t.value):
            scope.fail(f"the shapes do not fit: {t.value} is {shape_of(t.value)}, {value} is {shape_of(value)}",
                       site.span)
        if site.block is not None:
            blocks = expand(scope, site.block, value, site.span, ctx)
            if isinstance(site.block, ast.BlockVar):
                layer, layer_var = None, site.block.name
            elif len(blocks) == 1:
                layer, layer_var = blocks[0], None
            elif len(blocks) == count:
                layer, layer_var = blocks[n], None
            else:
                scope.fail(f"{ast.format_selector(site.block)} covers {len(blocks)} blocks and the write {count}: "
                           f"name one block, or as many as the write", site.block.span)
        elif layer is not None and scope.spec.unavailable(layer, value) is not None:
            scope.fail(f"L{layer} has no value '{value}': {scope.spec.unavailable(layer, value)}", site.span)
        positional = values.CATALOGUE[value].positional
        if not positional and site.position is not None:
            scope.fail(f"'{value}' takes no position", site.position.span)
        if isinstance(site.position, (ast.AllPos, ast.RangePos)):
            scope.fail(f"a donor site names one position; `write ...({ast.format_position(site.position)}) from "
                       f"{src.run}` reads each position's own", site.position.span)
        if positional and site.position is not None:
            raw, span = site.position, site.position.span
            if isinstance(raw, ast.VarPos):
                position_variable(scope, raw, ctx)
        elif positional and raw is None and src.at is None:
            scope.fail(f"'{value}' needs a position: {value}(3), {value}(-1) or {value}(\"word\")", site.span)
        elif not positional:
            raw = None
    explicit = site is not None and site.position is not None
    if src.at is not None:  # `from RUN at POS`: the donor's own position, in its prompt
        raw, span, explicit = donor_at(scope, src, value), src.at.span, True
    position, pmap = donor_position(scope, raw, explicit, t, value, run, kind, dtoks, span, ctx)
    if kind == "generate" and step is None and (position is not None or pmap):
        step = 0  # a position of the prompt: step 0
    check_rows(scope, value, t, dtoks, f"'{run}'", src.span, ctx)
    pvar = raw.name if isinstance(raw, ast.VarPos) else None
    head, head_var = donor_head(scope, site, t, ctx)
    return FromRun(run, layer, value, position, step, layer_var, pvar, pmap, head, head_var)


def donor_at(scope: Scope, src: ast.FromSource, value: str) -> ast.Position:
    """The position `from RUN at POS` names in the donor: a number (from the donor's end when negative) or a
    quoted piece of the donor's prompt (a record's field is that record's piece by now)."""
    at = src.at
    assert at is not None
    info = values.CATALOGUE.get(value)
    if info is None or not info.positional:
        scope.fail(f"'{value}' takes no position, so the donor has none to name: drop 'at "
                   f"{ast.format_position(at)}'", at.span)
    if isinstance(at, ast.Field):
        scope.fail(f"'{at.dataset}.{at.field}': a record's field names a donor position only in a run on its "
                   f"dataset", at.span)
    if not isinstance(at, (ast.IntPos, ast.PiecePos)):
        scope.fail(f"after 'at' comes the donor's position: a number (3, -1), a quoted piece of its prompt "
                   f"(\"Tower\") or, over a dataset, a record's field (facts.foil_subject)", at.span)
    return at


def donor_head(scope: Scope, site: ast.Site | None, t: Target, ctx: Ctx) -> tuple[int | None, str | None]:
    """The donor's head for a write of one head: the same head, or the one `from RUN.SITE.head(k)` names."""
    if site is None or site.head is None:
        return t.head, t.head_var  # the donor's same head (None: the whole value)
    if t.head is None and t.head_var is None:
        scope.fail(f"the shapes do not fit: {ast.format_site(site)} is one head, the write takes the whole "
                   f"{t.value}; write one head too (.head(h))", site.head.span)
    if isinstance(site.head, ast.VarPos):
        axis = ctx.axes.get(site.head.name)
        if axis is None or axis.kind != "head":
            scope.fail(f"'{site.head.name}' is not a variable over heads: head(...) takes a head number or a "
                       f"variable over heads (over h in heads)", site.head.span)
        ctx.used.add(site.head.name)
        return None, site.head.name
    heads = scope.spec.dims["heads"]
    if not -heads <= site.head.value < heads:
        scope.fail(f"no head {site.head.value}: this model's DeltaNet blocks have {heads} value heads "
                   f"(0..{heads - 1})", site.head.span)
    return site.head.value % heads, None


def donor_position(scope: Scope, raw: ast.Position | None, explicit: bool, t: Target, value: str, run: str,
                   kind: str, dtoks: PromptTokens, span: Span, ctx: Ctx,
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
            pairs.append((v, index(scope, p, dtoks, run, span, f"{raw.name} = {label} in '{run}': ")))
        return None, tuple(pairs)
    if isinstance(raw, ast.IntPos) and (raw.value < 0 or explicit):
        return index(scope, raw.value, dtoks, run, span), ()
    if isinstance(raw, ast.PiecePos) and explicit:
        return piece(scope, raw, dtoks, run), ()
    assert t.position is not None
    if t.position >= n:
        if run.startswith("mean"):
            scope.fail(f"position {t.position} is past the end of a prompt of {run}: {ast.quote(dtoks.text)} "
                       f"has {n_tokens(n)}; a position from the end (-1) fits every prompt", span)
        scope.fail(f"position {t.position} is past the end of '{run}', whose prompt has {n_tokens(n)} "
                   f"(0..{n - 1}); name a position of its own: from {run}.{value}(\"word\") or "
                   f"from {run}.{value}(-1)", span)
    return t.position, ()


def check_rows(scope: Scope, value: str, t: Target, dtoks: PromptTokens, run: str, span: Span, ctx: Ctx) -> None:
    """A value with a row per token only fits a prompt of as many tokens."""
    info = values.CATALOGUE.get(value)
    if info is not None and info.per_token and not (t.step or 0) > 0 and len(dtoks) != len(ctx.toks):
        scope.fail(f"the shapes do not fit: {value} has a row per token, and '{ctx.prompt}' has "
                   f"{n_tokens(len(ctx.toks))} while {run} has {len(dtoks)}", span)


def mean(scope: Scope, src: ast.MeanSource, t: Target, ctx: Ctx) -> Mean:
    texts: list[str] = []
    for name in src.prompts:
        p = scope.prompts.get(name)
        if isinstance(p, ast.PromptDecl):
            texts.append(p.text)
        elif isinstance(p, ast.PromptListDecl):
            texts.extend(p.texts)
        elif name in scope.runs:
            scope.fail(f"mean takes prompts; '{name}' is a run (write 'from {name}' for one run's value)",
                       src.span)
        else:
            scope.fail(f"unknown prompt '{name}' in mean(...)" + did_you_mean(name, list(scope.prompts)),
                       src.span)
    label = "mean(" + ", ".join(src.prompts) + ")"
    if t.position_var is not None:  # each value of the variable, in each prompt by the rules of `from`
        axis = ctx.axes[t.position_var]
        pmap = tuple((v, tuple(index(scope, lab if lab < 0 else v, scope.tokens(text), label, src.span,
                                     f"{t.position_var} = {lab} in a prompt of {label}: ") for text in texts))
                     for v, lab in zip(axis.values, axis.labels, strict=True))
        for text in texts:
            check_rows(scope, t.value, t, scope.tokens(text), f"the prompt {ast.quote(text)} of {label}", src.span,
                       ctx)
        return Mean(tuple(src.prompts), tuple(texts), None, t.position_var, pmap)
    positions: list[int] = []
    for text in texts:
        toks = scope.tokens(text)
        pos, _ = donor_position(scope, t.raw, False, t, t.value, label, "trace", toks, src.span, ctx)
        if pos is not None:
            positions.append(pos)
        check_rows(scope, t.value, t, toks, f"the prompt {ast.quote(text)} of {label}", src.span, ctx)
    return Mean(tuple(src.prompts), tuple(texts), tuple(positions) if t.raw is not None else None)


def finish_deferred(scope: Scope) -> None:
    """Resolve `= NAME` sources now that every read's result names are known."""
    for ops, i, pending in scope.deferred:
        try:
            if isinstance(pending, Steer):
                source: Any = attrs.evolve(pending, expr=map_atoms(
                    pending.expr, lambda a: named(scope, a) if isinstance(a, NamedPending) else a))
            else:
                source = named(scope, pending)
            ops[i] = attrs.evolve(ops[i], source=source)
        except Fail:
            ops[i] = None
    scope.deferred = []


def named(scope: Scope, p: NamedPending) -> Named:
    src, t = p.src, p.target
    if t.head is not None or t.head_var is not None:
        scope.fail("a write of one head takes from RUN, from RUN.SITE.head(k), zeros, *= K or mean(...); "
                   "'= NAME' is not supported there", src.span)
    entry = scope.aliases.get(src.name)
    if entry is None:
        if src.name in scope.runs or src.name in scope.prompts:
            scope.fail(f"'{src.name}' is a run or prompt, not a value: write 'from {src.name}' for the same "
                       f"site there", src.span)
        scope.fail(f"unknown name '{src.name}': '= NAME' takes the name of a read ('read ... as NAME')"
                   + did_you_mean(src.name, [a for a, e in scope.aliases.items() if e.kind == "read"]), src.span)
    if entry.kind != "read":
        scope.fail(f"'{src.name}' is a measure, not a value to write", src.span)
    if entry.in_sweep:
        scope.fail(f"'{src.name}' is read in a sweep, one value per point: it cannot feed a write", src.span)
    if not entry.entries or entry.value is None:
        raise Fail  # the read itself did not resolve; its error is reported there
    if entry.head:
        scope.fail(f"'{src.name}' holds one head of {entry.value} (a read with .head(h)), and the write takes "
                   f"the whole value", src.span)
    if shape_class(entry.value) != shape_class(t.value):
        scope.fail(f"the shapes do not fit: {t.value} is {shape_of(t.value)}, '{src.name}' holds {entry.value} "
                   f"({shape_of(entry.value)})", src.span)
    if len(entry.entries) == 1:
        name = next(iter(entry.entries.values()))
    elif t.layer in entry.entries:
        name = entry.entries[t.layer]
    else:
        held = ", ".join(entry.entries.values())
        scope.fail(f"'{src.name}' holds {held}: nothing for L{t.layer}", src.span)
    info = values.CATALOGUE.get(entry.value)
    run = scope.runs.get(entry.run)
    if info is not None and info.per_token and run is not None:
        p_text = scope.prompt_texts.get(run.prompt)
        if isinstance(p_text, str) and len(scope.tokens(p_text)) != len(p.toks):
            scope.fail(f"the shapes do not fit: {entry.value} has a row per token, and '{src.name}' comes "
                       f"from a prompt of {len(scope.tokens(p_text))} tokens, this run's has {len(p.toks)}",
                       src.span)
    return Named(name, entry.run)
