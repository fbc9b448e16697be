"""What a write can change: a write no later computation reads (a warning), a state that does not exist (an error).

`check_write()` looks at one write target in its run. A write of `state_output` or of `conv_window_after`
the last token leaves every number of a forward as it was (only a next generate step reads them): a
`DeltaWarning`, unless something in the run reads the written value (`warn_unread`, after every run is
resolved). A write that acts on `state_input` (`= zeros`, `*= K`, `+= ...`) or a donor's `state_input`
where none exists (a trace, a sweep, step 0) is an error. Depends on `ast`, `ir` and `scope` only.
"""

from __future__ import annotations

from typing import Any, Sequence

from deltalang.ground.errors import Span

from .. import ast
from ..ir import FromRun, ResolvedRun, Scale, Steer, Zeros, expr_atoms
from .scope import Ctx, Scope, Target


def check_write(scope: Scope, t: Target, source: Any, ctx: Ctx, span: Span) -> None:
    """Refuse a write acting on a state that does not exist; warn when nothing later reads what it changes."""
    if t.value == "state_input" and not _decode_step(ctx, t.step):
        acts = _acts_on_value(source)
        if acts is not None:
            where = _fresh_where(ctx, t.step)
            scope.fail(f"{t.written} is none {where}: the call starts from no state, so '{acts}' has nothing to "
                       f"act on; write a state taken from elsewhere (from RUN.state_output, = NAME, mean(...))"
                       + ("" if ctx.kind == "generate" else ", or under generate at a decode step (step K: "
                                                                 "with K >= 1)"), span)
    if isinstance(source, FromRun) and source.value == "state_input":
        donor_state_input(scope, source, span)
    why = unread(scope, t, ctx)
    if why is not None:
        scope.unread.append((ctx.name, t, f"nothing in this {ctx.kind} reads what the write changes: {why}", span))


def warn_unread(scope: Scope, runs: Sequence[ResolvedRun]) -> None:
    """Warn of each write nothing reads (`Scope.unread`), unless the program reads the written value itself:
    a read or norm of it in its run, or a donor (`from RUN.SITE`) taking it from there."""
    groups: dict[tuple[str, Span], list[tuple[Target, bool]]] = {}
    for run_name, t, message, span in scope.unread:
        groups.setdefault((message, span), []).append((t, any(_takes(run, run_name, t) for run in runs)))
    for (message, span), writes in groups.items():
        unread_ = [t for t, taken in writes if not taken]
        if len(unread_) == len(writes):
            scope.warn(message, span)
        elif unread_:
            blocks = ", ".join(f"L{t.layer}" for t in unread_)
            head, _, why = message.partition(": ")
            scope.warn(f"{head} on {blocks} (the program reads the other blocks' written value): {why}", span)


def _takes(run: ResolvedRun, writer: str, t: Target) -> bool:
    """Whether `run` reads the value written by `t` in run `writer` (None blocks, positions, steps match any)."""
    def same(layer: int | None, value: str | None, position: int | None, step: int | None) -> bool:
        return (value == t.value and (layer is None or t.layer is None or layer == t.layer)
                and (position is None or t.position is None or position == t.position)
                and (step is None or t.step is None or step == t.step))

    if run.name == writer:
        if any(op.kind == "read" and same(op.layer, op.value, op.position, op.step) for op in run.ops):
            return True
        if any(m.kind == "norm" and same(m.layer, m.value, m.position, m.step) for m in run.measures):
            return True
    for op in run.ops:
        atoms = expr_atoms(op.source.expr) if isinstance(op.source, Steer) else [op.source]
        if any(isinstance(a, FromRun) and a.run == writer and same(a.layer, a.value, a.position, a.step)
               for a in atoms):
            return True
    return False


def _decode_step(ctx: Ctx, step: int | None) -> bool:
    return ctx.kind == "generate" and step is not None and step > 0


def _fresh_where(ctx: Ctx, step: int | None) -> str:
    if ctx.kind != "generate":
        return "on a fresh prompt"
    if step is None:
        return "at step 0, the prompt (a statement without 'step K:' applies at every step, step 0 too)"
    return "at step 0, the prompt"


def _acts_on_value(source: Any) -> str | None:
    """How a source uses the value it replaces (`zeros` is made in its shape), or None if it does not."""
    if isinstance(source, Zeros):
        return "= zeros"
    if isinstance(source, Scale):
        return f"*= {source.factor:g}"
    if isinstance(source, Steer):
        if source.add:
            return "+= ..."
        if any(isinstance(a, (Zeros, Scale)) for a in expr_atoms(source.expr)):
            return "zeros"
    return None


def donor_state_input(scope: Scope, src: FromRun, span: Span) -> None:
    """A donor's `state_input` exists only at a decode step of a generate (or where the donor writes it)."""
    run = scope.runs.get(src.run)
    if isinstance(run, ast.Generate) and src.step is not None and src.step > 0:
        return
    if run is not None and any(isinstance(n, ast.Write) and n.site.value == "state_input"
                               for n in ast.walk(tuple(run.body))):
        return
    scope.fail(f"'{src.run}' has no state_input to give: it is none on a fresh prompt (it exists at a decode step "
               f"of a generate, step K: with K >= 1)", span)


def unread(scope: Scope, t: Target, ctx: Ctx) -> str | None:
    """Why nothing after this write reads what it changes, or None when something does."""
    n = len(ctx.toks)
    last = ctx.kind != "generate" or t.step == (ctx.max_new_tokens or 1) - 1
    carry = "; under generate it would carry into the next step" if ctx.kind != "generate" else \
        f"; under generate it carries into the next step, and step {t.step} is the last of '{ctx.name}'"
    if t.value == "state_output" and last:
        return ("state_output is the state after the last token, which only a next call would start from; "
                "to change what the last token reads write state_after(-1)" + carry)
    if t.value != "conv_window_after" or not last:
        return None
    window = "no token after the last sees its convolution window"
    if t.position_var is not None:
        axis = ctx.axes.get(t.position_var)
        at = [lab for v, lab in zip(axis.values, axis.labels, strict=True) if v == n - 1] if axis else []
        return f"at {t.position_var} = {at[0]} (the last token) {window}, so those cells measure no change" \
            if at else None
    if t.step is not None and t.step > 0:
        return window + carry  # a decode step runs its one token: the last
    return window + carry if t.position == n - 1 else None
