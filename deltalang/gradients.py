"""Gradients of a scalar measure with respect to every DeltaNet block's memory after every token.

`record(hf, family, layers, forward)` runs a plain transformers forward with gradients, recording each
DeltaNet block's kernel and convolution inputs and outputs; `Recording.backward(measure)` takes the
measure's gradient at those outputs only (no weight gradient). Then, per block, one block's per-token
states at a time:
- `state_gradients(block)`: dM/dS_t for every token, `[b, s, h, dk, dv]` float32 (S_t = `state_after(t)`),
  by the delta rule's adjoint scan; `state_dots(block, delta)` the same scan dotted with a difference, `[b, s]`;
- `window_gradients(block)`: dM/dW_t for `conv_window_after(t)`, `[b, s, conv_dim, width-1]`;
- `states(block)`, `windows(block)`, `states_at(block, ts)`: the block's own values a patch's difference needs.
Prompts only: a decode step's call is refused. The derivation: docs/attribution.md.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import attrs
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from . import families, kernels
from .errors import DeltaValueError


@attrs.define
class BlockRecord:
    """One DeltaNet block's kernel call in a recorded forward."""

    layer: int
    query: torch.Tensor | None = None  # as the kernel took them (detached)
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None
    g: torch.Tensor | None = None
    beta: torch.Tensor | None = None
    initial: torch.Tensor | None = None
    l2: bool = False
    out: torch.Tensor | None = None  # the kernel's output, in the graph (detached after `Recording.backward`)
    conv_x: torch.Tensor | None = None  # the convolution's input `[b, conv_dim, s]` (detached)
    conv_weight: torch.Tensor | None = None  # `[conv_dim, width]`
    conv_pre: torch.Tensor | None = None  # the convolution's output before its activation (as `out`)
    grad_out: torch.Tensor | None = None  # dM/d out, float32 `[b, s, h, dv]`
    grad_conv: torch.Tensor | None = None  # dM/d conv_pre, float32 `[b, conv_dim, s]`


class _Recorder:
    """A `kernels.Site` that runs a mixer's kernels as they are, keeping their inputs and outputs."""

    def __init__(self, block: BlockRecord, shift: torch.Tensor | None = None) -> None:
        self.layer = block.layer
        self.block = block
        self.shift = shift

    def active(self) -> bool:
        return True

    def kernel(self, fn: Callable[..., Any], decode: bool, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, g: torch.Tensor | None = None, beta: torch.Tensor | None = None,
               **kw: Any) -> Any:
        if decode:
            raise DeltaValueError(f"L{self.layer}: gradients over the memory are taken on a prompt, not a decode step")
        kw.pop("chunk_size", None)
        b = self.block
        b.query, b.key, b.value = query.detach(), key.detach(), value.detach()
        b.g = None if g is None else g.detach()
        b.beta = None if beta is None else beta.detach()
        init = kw.get("initial_state")
        b.initial = None if init is None else init.detach().clone()
        b.l2 = bool(kw.get("use_qk_l2norm_in_kernel", False))
        out, final = fn(query, key, value, g=g, beta=beta, **kw)
        if self.shift is not None:
            out = out + self.shift.to(out.dtype)
        b.out = out
        return out, final

    def conv(self, fn: Callable[..., Any], hidden_states: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None, activation: str | None = None, **kw: Any) -> torch.Tensor:
        pre = fn(hidden_states, weight, bias, activation=None, **kw)
        b = self.block
        b.conv_x, b.conv_weight, b.conv_pre = hidden_states.detach(), weight.detach(), pre
        if activation is None:
            return pre
        return ACT2FN[activation](pre)

    def conv_update(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        raise DeltaValueError(f"L{self.layer}: gradients over the memory are taken on a prompt, not a decode step")

    def ended(self) -> None:
        """Nothing is held between calls."""


@attrs.define
class Recording:
    """Every DeltaNet block's record of one forward, and its result (what the measure is taken of)."""

    family: families.Family
    blocks: dict[int, BlockRecord]
    result: Any = None

    def backward(self, measure: torch.Tensor) -> None:
        """Gradients of `measure` (a scalar) at every block's kernel and convolution outputs; the outputs
        themselves are kept, detached (the recording then also serves as a plain one of the forward)."""
        outs: list[torch.Tensor] = []
        where: list[tuple[BlockRecord, str]] = []
        for blk in self.blocks.values():
            for name in ("out", "conv_pre"):
                t = getattr(blk, name)
                if t is not None and t.requires_grad:
                    outs.append(t)
                    where.append((blk, name))
        if not outs:
            raise DeltaValueError("the recorded forward built no graph: run it with gradients enabled")
        grads = torch.autograd.grad(measure, outs, allow_unused=True)
        for (blk, name), gr, t in zip(where, grads, outs, strict=True):
            gr = torch.zeros_like(t) if gr is None else gr
            if name == "out":
                blk.grad_out = gr.detach().float()
            else:
                blk.grad_conv = gr.detach().float()
            setattr(blk, name, t.detach())  # the value stays, the graph goes


def record(hf: torch.nn.Module, family: Any, layers: Iterable[int], mixers: Callable[[int], torch.nn.Module],
           forward: Callable[[], Any], shifts: dict[int, torch.Tensor] | None = None) -> Recording:
    """Run `forward()` recording every DeltaNet block in `layers` (`mixers(i)`: block i's mixer module).

    `shifts`: {block: a tensor added to that block's kernel output} (a path through the memory's outputs).
    """
    shifts = shifts or {}
    fam = families.resolve(family)
    kernels.install(fam)
    blocks = {i: BlockRecord(i) for i in layers}
    hooks = []
    depth: dict[int, int] = {}

    def enter(i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            depth[i] = kernels.enter(_Recorder(blocks[i], shifts.get(i)))
        return hook

    def leave(i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, out: Any) -> None:
            d = depth.pop(i, None)
            if d is not None:
                kernels.unwind(d)
        return hook

    for i in blocks:
        m = mixers(i)
        hooks.append(m.register_forward_pre_hook(enter(i)))
        hooks.append(m.register_forward_hook(leave(i), always_call=True))
    try:
        with kernels.unwinding():
            result = forward()
    finally:
        for h in hooks:
            h.remove()
    missing = [i for i, b in blocks.items() if b.query is None]
    if missing:
        raise DeltaValueError(f"blocks {missing}: their delta-rule kernel was not called in the recorded forward")
    return Recording(fam, blocks, result)


def _prepared(fam: families.Family, blk: BlockRecord) -> tuple[torch.Tensor, ...]:
    assert blk.query is not None and blk.key is not None and blk.value is not None
    assert blk.g is not None and blk.beta is not None
    return kernels.prepare(fam, blk.query, blk.key, blk.value, blk.g, blk.beta, blk.l2)


def states(fam: families.Family, blk: BlockRecord) -> torch.Tensor:
    """The block's state after every token, `[b, s, h, dk, dv]` float32 (`kernels.per_token`)."""
    assert blk.query is not None and blk.key is not None and blk.value is not None
    assert blk.g is not None and blk.beta is not None
    return kernels.per_token(fam, blk.query, blk.key, blk.value, blk.g, blk.beta, blk.initial, blk.l2)[1]


def states_at(fam: families.Family, blk: BlockRecord, ts: Iterable[int]) -> dict[int, torch.Tensor]:
    """The block's state after each token t of `ts`, `[b, h, dk, dv]` float32, without the others: the
    delta rule up to the first, then from each to the next (one pass over tokens 0..max(ts))."""
    assert blk.query is not None and blk.key is not None and blk.value is not None
    assert blk.g is not None and blk.beta is not None
    out: dict[int, torch.Tensor] = {}
    state, done = blk.initial, 0
    for t in sorted(set(ts)):
        cut = slice(done, t + 1)
        state = kernels.per_token(fam, blk.query[:, cut], blk.key[:, cut], blk.value[:, cut], blk.g[:, cut],
                                  blk.beta[:, cut], state, blk.l2, final_state=True)[1]
        out[t], done = state, t + 1
    return out


def windows(blk: BlockRecord) -> torch.Tensor:
    """The convolution window after every token, `[b, s, conv_dim, width-1]` (zeros before the prompt)."""
    assert blk.conv_x is not None and blk.conv_weight is not None
    x = blk.conv_x.float()
    w = blk.conv_weight.shape[-1]
    s = x.shape[-1]
    padded = F.pad(x, (w - 2, 0))  # column t + w - 2 of padded is token t
    return padded.unfold(-1, w - 1, 1)[:, :, :s].permute(0, 2, 1, 3).contiguous()


def _scan(fam: families.Family, blk: BlockRecord, visit: Callable[[int, torch.Tensor], None],
          grad: BlockRecord | None = None) -> None:
    """The adjoint scan: `visit(t, lambda_t)` from the last token back to the first.

    The transitions and queries are `blk`'s; the gradient at the output is `grad`'s (default: `blk`'s).
    """
    grad = blk if grad is None else grad
    if grad.grad_out is None:
        raise DeltaValueError(f"L{blk.layer}: no gradient at the kernel output: call Recording.backward first")
    q, k, v, gg, bb = _prepared(fam, blk)
    go = grad.grad_out.transpose(1, 2).float()  # [b, h, s, dv]
    decay = gg.exp()  # [b, h, s] or [b, h, s, dk]
    s = k.shape[2]
    lam = q[:, :, s - 1, :, None] * go[:, :, s - 1, None, :]  # [b, h, dk, dv]
    visit(s - 1, lam)
    for t in range(s - 2, -1, -1):
        kt = k[:, :, t + 1, :, None]  # [b, h, dk, 1]
        lam = lam - (bb[:, :, t + 1, None, None] * kt) @ (kt.transpose(-1, -2) @ lam)
        lam = lam * (decay[:, :, t + 1, :, None] if decay.dim() == 4 else decay[:, :, t + 1, None, None])
        lam = lam + q[:, :, t, :, None] * go[:, :, t, None, :]
        visit(t, lam)


def state_gradients(fam: families.Family, blk: BlockRecord) -> torch.Tensor:
    """dM/dS_t for every token t of one block, `[b, s, h, dk, dv]` float32 (see the module's contract)."""
    assert blk.value is not None
    b, s = blk.value.shape[:2]
    out: torch.Tensor | None = None

    def keep(t: int, lam: torch.Tensor) -> None:
        nonlocal out
        if out is None:
            out = torch.empty(b, s, *lam.shape[1:], dtype=torch.float32, device=lam.device)
        out[:, t] = lam

    _scan(fam, blk, keep)
    assert out is not None
    return out


def state_dots(fam: families.Family, blk: BlockRecord, delta: Callable[[int], torch.Tensor],
               grad: BlockRecord | None = None) -> torch.Tensor:
    """sum(lambda_t * delta(t)) per row, `[b, s]`: a first-order effect of changing every S_t by delta(t).

    `grad`: the record whose output gradient drives the scan (default `blk`; `blk` gives the transitions).
    """
    assert blk.value is not None
    g = blk if grad is None else grad
    assert g.grad_out is not None
    b, s = max(blk.value.shape[0], g.grad_out.shape[0]), blk.value.shape[1]  # a gradient may have more rows
    out = torch.zeros(b, s, dtype=torch.float32, device=blk.value.device)

    def dot(t: int, lam: torch.Tensor) -> None:
        out[:, t] = (lam * delta(t)).flatten(1).sum(-1)

    _scan(fam, blk, dot, grad)
    return out


def window_gradients(blk: BlockRecord) -> torch.Tensor:
    """dM/dW_t for `conv_window_after(t)` at every token, `[b, s, conv_dim, width-1]` float32."""
    if blk.grad_conv is None or blk.conv_weight is None:
        raise DeltaValueError(f"L{blk.layer}: no gradient at the convolution: call Recording.backward first")
    gy = blk.grad_conv  # [b, C, s]
    wt = blk.conv_weight.float()  # [C, w]
    b, c, s = gy.shape
    w = wt.shape[-1]
    out = torch.zeros(b, s, c, w - 1, dtype=torch.float32, device=gy.device)
    for i in range(w - 1):
        for d in range(1, i + 2):
            if d >= s:
                break
            # window column i of the window after t, read by the output at t + d through tap i + 1 - d
            out[:, : s - d, :, i] += (wt[:, i + 1 - d] * gy[:, :, d:].transpose(1, 2))
    return out
