"""Reductions of reads and measures: `SITE.norm(AXES)`, `.mean(AXES)`, `.head(K)`, `.project(load(F))`,
`.svd(K)`, `.rank(TOL)`, `.erank()` (of a state's matrix), `norm(SITE, over=[AXES])`, `project(SITE, load(F))`.

`reduced_read()` gives a read op its `ir.Reduce`, `reduced_measures()` the measures; both check every step
against the value's axes (`values.axes`, the catalogue's shape names on the target's block kind: a Mamba-2
state's are `head_dim, d_state`, a DeltaNet one's `key_dim, value_dim`; `positions` stands for `s`, `key` for
`key_dim`, `value` for `value_dim`) with `measures.step_axes`, the one statement of what a step leaves,
and a direction's shape (its safetensors header, read here) against the axes it contracts: a located
error before anything runs. Reductions run in traces, generates and sweeps; a sweep's reduced measure leaves one
number per cell (or one per token); its head may be the sweep's variable over heads, bound per cell
(`ir.Reduce.at`; the engine reduces the recomputed value, `sweep.engine`). `states.head(K)` is a reduction too:
the value layer then serves one head, a group of chunks at a time.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import attrs

from deltalang.ground import measures
from deltalang.models import values
from deltalang.models.spec import text_config

from .. import ast
from ..ir import (HEAD_AXIS, Arith, Const, Load, MeanDirection, Reduce, ResolvedMeasure, ResolvedOp,
                  measure_result_name, site_text)
from .scope import Ctx, Scope, Target
from .sites import targets
from .sources import mean, tensor_header, value_shape

ALIASES = {"positions": "s", "position": "s", "key": "key_dim", "value": "value_dim", "head": "heads",
           "batch": "b"}


def wanted(site: ast.Site, ctx: Ctx) -> bool:
    """Whether a read of `site` is a reduction: one written, or one head of `states`."""
    return bool(site.reduce) or (site.value == "states" and isinstance(site.head, ast.IntPos))


def reduced_read(scope: Scope, op: ResolvedOp, site: ast.Site, t: Target, ctx: Ctx) -> ResolvedOp:
    """`op` (a read of target `t` of `site`) with its reduction, named `RUN.L0.states.norm(...)`."""
    if not wanted(site, ctx):
        return op
    red = build(scope, site, t, ctx, [])
    name = op.result_name if op.alias is not None else f"{op.result_name}{red.text}"
    return attrs.evolve(op, reduce=red, result_name=name)


def wanted_measure(call: ast.MeasureCall, ctx: Ctx) -> bool:
    """Whether a measure is computed in the forward: a projection, a norm over axes or of a reduced site, or
    a norm of `states` (whose every state would otherwise exist at once) or of one head."""
    if isinstance(call, ast.Project):
        return True
    if not isinstance(call, ast.Norm):
        return False
    return call.over is not None or bool(call.site.reduce) or call.site.value == "states" or call.site.head is not None


def reduced_measures(scope: Scope, call: ast.Norm | ast.Project, alias: str | None,
                     ctx: Ctx) -> list[ResolvedMeasure]:
    """A norm or projection computed in the forward, one per block of its site."""
    kind = "project" if isinstance(call, ast.Project) else "norm"
    if kind == "project":
        last = ast.Reduce("project", direction=call.direction, span=call.direction.span)  # type: ignore[union-attr]
        tail = f", {ast.format_expr(call.direction)})"  # type: ignore[union-attr]
    else:
        over = call.over  # type: ignore[union-attr]
        last = ast.Reduce("norm", over or (), span=call.span)
        tail = ")" if over is None else f", over=[{', '.join(over)}])"
    out = []
    for t in targets(scope, call.site, ctx, writing=False):
        red = build(scope, call.site, t, ctx, [last])
        left = [a for a, _ in red.shape]
        if ctx.kind == "sweep" and left not in (["b"], ["b", "s"]):
            scope.fail(f"{kind}(...) leaves {red.shown()}, and a sweep's cell holds one number (or one per "
                       f"token): reduce every axis but b (and s)", call.span)
        pos: Any = t.position if t.position_var is None else f"{{{t.position_var}}}"  # a sweep's: bound per cell
        head: Any = t.head if t.head_var is None else f"{{{t.head_var}}}"
        shown = site_text(t.layer, t.value, pos, t.layer_var, head) + "".join(
            ast.format_reduce(r) for r in call.site.reduce)
        name = measure_result_name(ctx.name, t.step, f"{kind}({shown}{tail}", alias, t.layer, t.multi)
        out.append(ResolvedMeasure(kind, name, t.step, layer=t.layer, value=t.value, position=t.position,
                                   written=f"{kind}({t.written}{tail}", alias=alias, layer_var=t.layer_var,
                                   position_var=t.position_var, span=call.span, reduce=red))
    return out


def build(scope: Scope, site: ast.Site, t: Target, ctx: Ctx, extra: Sequence[ast.Reduce]) -> Reduce:
    """The `ir.Reduce` of target `t`: its head (of `states`), the site's reductions, then `extra`."""
    chain = [*site.reduce, *extra]
    per_channel = bool(scope.spec.family.per_channel_decay)
    kind = scope.spec.kind(t.layer) if t.layer is not None else values.DELTANET
    axes = values.axes(t.value, per_channel, kind)
    if axes is None:
        scope.fail(f"'{t.value}' has no axes to reduce", site.span)
    sizes = _sizes(scope, t, ctx)
    steps: list[tuple[str, Any]] = []
    text = ""
    if t.head is not None or t.head_var is not None:  # the first step (`states`: one head a group of chunks at
        steps.append(("head", t.head if t.head_var is None else t.head_var))  # a time); a variable: `Reduce.at`
    have = measures.reduced_axes(axes, steps)
    for i, r in enumerate(chain):
        arg: Any = r.index if r.kind in ("head", "svd") else r.tol if r.kind == "rank" else None
        if r.kind in ("norm", "mean") and r.axes:
            arg = tuple(ALIASES.get(a, a) for a in r.axes)
        try:
            after = measures.step_axes(have, r.kind, arg)
        except measures.ReductionError as e:
            scope.fail(f"{ast.format_reduce(r)[1:]}: {e}", r.span)
        if r.kind == "head" and not 0 <= r.index < sizes["heads"]:  # type: ignore[operator]
            mixer = "Mamba-2 blocks" if kind == values.SSM else "DeltaNet blocks"
            scope.fail(f"no head {r.index}: this model's {mixer} have {sizes['heads']} value heads", r.span)
        if r.kind == "svd":
            matrix = [a for a in have if a not in after]
            most = min(sizes.get(a) or 0 for a in matrix)
            if r.index > most:  # type: ignore[operator]
                scope.fail(f"svd({r.index}): a state matrix [{', '.join(f'{a}={sizes.get(a)}' for a in matrix)}] has "
                           f"{most} singular values", r.span)
            sizes = {**sizes, measures.SINGULAR: r.index}
        if r.kind == "project":
            assert r.direction is not None
            contracted = [a for a in have if a not in ("b", "s")]
            arg = direction(scope, r.direction, contracted, sizes) if isinstance(r.direction, ast.LoadSource) \
                else mean_direction(scope, r.direction, t, ctx, contracted, sizes)
        steps.append((r.kind, arg))
        have = after
        if i < len(site.reduce):
            text += ast.format_reduce(r)
    return Reduce(tuple(axes), tuple(steps), text, tuple((a, sizes.get(a)) for a in have))


def _sizes(scope: Scope, t: Target, ctx: Ctx) -> dict[str, int | None]:
    """Each axis's size in this run: its prompt's tokens for `s` (one at a decode step), the model's dims."""
    d = scope.spec.dims
    cfg = text_config(scope.spec.config)
    s: int | None = len(ctx.toks)
    if ctx.kind == "generate":
        s = len(ctx.toks) if t.step == 0 else (1 if t.step is not None else None)
    named = ("heads", "key_dim", "value_dim", "head_dim", "d_state", "groups", "inner", "conv_dim")
    return {"b": 1, "s": s, **{a: d.get(a) for a in named}, "hidden": getattr(cfg, "hidden_size", None),
            "vocab": getattr(cfg, "vocab_size", None), "window": d["conv_width"] - 1 if "conv_width" in d else None}


def direction(scope: Scope, src: ast.LoadSource, axes: list[str], sizes: dict[str, int | None]) -> Load:
    """A projection's direction: the file relative to the program's, its shape (from its header only) the
    axes it contracts (with or without a batch axis of 1)."""
    path, key, shape = tensor_header(scope, src)
    want = tuple(sizes.get(a) for a in axes)
    if shape not in (want, (1, *want)) or not axes:
        shown = "[" + ", ".join(f"{a}={sizes.get(a)}" for a in axes) + "]"
        scope.fail(f"a direction of the wrong shape: {ast.quote(key)} in {src.path} is {list(shape)}, and the "
                   f"projection contracts {shown} ({math.prod(n or 0 for n in want)} numbers)", src.span)
    return Load(str(path.resolve()), key, src.path)


def mean_direction(scope: Scope, expr: ast.Expr, t: Target, ctx: Ctx, axes: list[str],
                   sizes: dict[str, int | None]) -> MeanDirection:
    """A projection's direction from means: each `mean(PROMPTS)` is the projected site's value averaged over
    clean runs of the prompts, at each prompt's position by the rules of a write's `= mean(...)` (one head's
    slice after `.head(h)`); its shape must be what the projection contracts."""
    shown = ast.format_expr(expr)
    if ctx.kind == "sweep":
        scope.fail(f"a direction from means ({shown}) is not computed in a sweep: read it in a trace and save it, "
                   f"then project onto load(\"dir.safetensors\")", expr.span)

    def operand(e: ast.Expr) -> object:
        if isinstance(e, ast.BinOp):
            return Arith(e.op, operand(e.left), operand(e.right))
        if isinstance(e, ast.Number):
            return Const(e.value)
        assert isinstance(e, ast.MeanSource)
        return mean(scope, e, t, ctx)

    if not any(isinstance(a, ast.MeanSource) for a in ast.expr_operands(expr)):
        scope.fail(f"a direction needs a mean among its operands: {shown} is a number", expr.span)
    shape = value_shape(scope, t.value, len(ctx.toks))
    if shape is not None and t.head is not None:
        shape = tuple(n for i, n in enumerate(shape) if i != HEAD_AXIS.get(t.value, 2) - 1)
    want = tuple(sizes.get(a) for a in axes)
    if shape != want or not axes:
        where = t.value + ("" if t.head is None else f".head({t.head})")
        got = "?" if shape is None else str(list(shape))
        shown_axes = "[" + ", ".join(f"{a}={sizes.get(a)}" for a in axes) + "]"
        scope.fail(f"a direction of the wrong shape: {shown} is the mean of {where}, {got} (without the batch "
                   f"axis), and the projection contracts {shown_axes}; a direction from means fits a site of one "
                   f"position or head projected whole (state_after(t), state_output)", expr.span)
    return MeanDirection(operand(expr), shown, None if t.head is None else (t.value, t.head))
