"""Gradients of a scalar measure with respect to every recurrent block's memory after every token.

`record(hf, family, layers, forward)` runs a plain transformers forward with gradients, recording each
recurrent block's kernel (the delta rule's, or Mamba-2's scan: `BlockRecord.scan`) and convolution inputs and
outputs; `Recording.backward(measure)` takes the measure's gradient at those outputs only (no weight
gradient). Then, per block, one block's per-token states at a time:
- `state_gradients(block)`: dM/dS_t for every token, `[b, s, h, dk, dv]` (Mamba-2: `[b, s, h, P, N]`) float32
  (S_t = `state_after(t)`), by the delta rule's adjoint scan or the SSD scan's (`ssd_adjoint`, in chunks);
  `state_dots(block, delta)` the same scan dotted with a difference, `[b, s]`;
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

from deltalang.ground.errors import DeltaValueError
from deltalang.models import families

from . import kernels, ssd

# tokens per chunk of the Mamba-2 adjoint (`_ssd_adjoint`): a chunk's gradients are c x c x P x N products
ADJOINT_CHUNK = 32


@attrs.define
class ScanRecord:
    """One Mamba-2 scan call's inputs, as transformers' prompt scan took them (detached)."""

    x: torch.Tensor  # hidden_states `[b, s, h, P]`
    dt: torch.Tensor  # raw step sizes `[b, s, h]` (`ssd.step_sizes` adds the bias, softplus, clamp)
    A: torch.Tensor  # `[h]`
    B: torch.Tensor  # `[b, s, g, N]`
    C: torch.Tensor
    D: torch.Tensor | None
    dt_bias: torch.Tensor | None
    dt_softplus: bool
    dt_limit: tuple[float, float]

    def options(self) -> dict[str, Any]:
        return {"D": self.D, "dt_bias": self.dt_bias, "dt_softplus": self.dt_softplus, "dt_limit": self.dt_limit}

    def cut(self, part: slice) -> tuple[torch.Tensor, ...]:
        """(x, dt, A, B, C) at tokens `part`, as `ssd.per_token` takes them."""
        return self.x[:, part], self.dt[:, part], self.A, self.B[:, part], self.C[:, part]


@attrs.define
class BlockRecord:
    """One recurrent block's kernel call in a recorded forward (the delta rule's, or Mamba-2's: `scan`)."""

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
    scan: ScanRecord | None = None  # a Mamba-2 block's scan call (then query .. beta stay None)
    conv_skip: int = 0  # leading columns of `conv_x` before the call's tokens (a Mamba-2 cache's padding)


class _Recorder:
    """A `kernels.Site` that runs a mixer's kernels as they are, keeping their inputs and outputs."""

    def __init__(self, block: BlockRecord, shift: torch.Tensor | None = None, ssm: bool = False) -> None:
        self.layer = block.layer
        self.block = block
        self.shift = shift
        self.ssm = ssm

    def active(self) -> bool:
        return True

    def kernel(self, fn: Callable[..., Any], decode: bool, *args: Any, **kw: Any) -> Any:
        if decode:
            raise DeltaValueError(f"L{self.layer}: gradients over the memory are taken on a prompt, not a decode step")
        if self.ssm:
            return self._scan(fn, *args, **kw)
        return self._delta_rule(fn, *args, **kw)

    def _delta_rule(self, fn: Callable[..., Any], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    g: torch.Tensor | None = None, beta: torch.Tensor | None = None, **kw: Any) -> Any:
        kw.pop("chunk_size", None)
        b = self.block
        b.query, b.key, b.value = query.detach(), key.detach(), value.detach()
        b.g = None if g is None else g.detach()
        b.beta = None if beta is None else beta.detach()
        init = kw.get("initial_state")
        b.initial = None if init is None else init.detach().clone()
        b.l2 = bool(kw.get("use_qk_l2norm_in_kernel", False))
        out, final = fn(query, key, value, g=g, beta=beta, **kw)
        b.out = self._shifted(out)
        return b.out, final

    def _scan(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """One Mamba-2 scan call (the prompt scan's arguments), run as it is; its output `y` is `out`."""
        names = ("hidden_states", "dt", "A", "B", "C", "chunk_size")
        call = dict(zip(names, args)) | kw
        x, dt, A, B, C = (call[n].detach() for n in names[:5])
        det = {k: None if call.get(k) is None else call[k].detach() for k in ("D", "dt_bias", "initial_states")}
        b = self.block
        b.scan = ScanRecord(x, dt, A, B, C, det["D"], det["dt_bias"], bool(call.get("dt_softplus", False)),
                            tuple(call.get("dt_limit", (0.0, float("inf")))))  # type: ignore[arg-type]
        b.initial = None if det["initial_states"] is None else det["initial_states"].clone()
        if b.conv_x is not None:  # a cache hands the convolution its window (or padding) before the tokens
            b.conv_skip = int(b.conv_x.shape[-1]) - int(x.shape[1])
        got = fn(*args, **kw)
        y = self._shifted(got[0] if isinstance(got, tuple) else got)
        b.out = y
        return (y, *got[1:]) if isinstance(got, tuple) else y

    def _shifted(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.shift is None else out + self.shift.to(out.dtype)

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
    """Every recurrent block's record of one forward, and its result (what the measure is taken of)."""

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
    """Run `forward()` recording every recurrent block in `layers` (`mixers(i)`: block i's mixer module).

    `shifts`: {block: a tensor added to that block's kernel output} (a path through the memory's outputs).
    """
    shifts = shifts or {}
    fam = families.resolve(family)
    kernels.install(fam)
    ssm = fam.block_kind == families.SSM_KIND
    blocks = {i: BlockRecord(i) for i in layers}
    hooks = []
    depth: dict[int, int] = {}

    def enter(i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            depth[i] = kernels.enter(_Recorder(blocks[i], shifts.get(i), ssm))
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
    missing = [i for i, b in blocks.items() if b.query is None and b.scan is None]
    if missing:
        raise DeltaValueError(f"blocks {missing}: their {'Mamba-2 scan' if ssm else 'delta-rule kernel'} was not "
                              f"called in the recorded forward")
    return Recording(fam, blocks, result)


def _prepared(fam: families.Family, blk: BlockRecord) -> tuple[torch.Tensor, ...]:
    assert blk.query is not None and blk.key is not None and blk.value is not None
    assert blk.g is not None and blk.beta is not None
    return kernels.prepare(fam, blk.query, blk.key, blk.value, blk.g, blk.beta, blk.l2)


def states(fam: families.Family, blk: BlockRecord) -> torch.Tensor:
    """The block's state after every token, `[b, s, h, dk, dv]` float32 (`kernels.per_token`; Mamba-2:
    `ssd.per_token`, `[b, s, h, P, N]`)."""
    if blk.scan is not None:
        sc = blk.scan
        return ssd.per_token(*sc.cut(slice(None)), initial_states=blk.initial, **sc.options())[1]
    assert blk.query is not None and blk.key is not None and blk.value is not None
    assert blk.g is not None and blk.beta is not None
    return kernels.per_token(fam, blk.query, blk.key, blk.value, blk.g, blk.beta, blk.initial, blk.l2)[1]


def states_at(fam: families.Family, blk: BlockRecord, ts: Iterable[int]) -> dict[int, torch.Tensor]:
    """The block's state after each token t of `ts`, `[b, h, dk, dv]` float32, without the others: the
    delta rule (or the SSD scan) up to the first, then from each to the next (one pass over tokens 0..max(ts))."""
    out: dict[int, torch.Tensor] = {}
    state, done = blk.initial, 0
    for t in sorted(set(ts)):
        cut = slice(done, t + 1)
        if blk.scan is not None:
            sc = blk.scan
            state = ssd.per_token(*sc.cut(cut), initial_states=state, final_state=True, **sc.options())[1]
        else:
            assert blk.query is not None and blk.key is not None and blk.value is not None
            assert blk.g is not None and blk.beta is not None
            state = kernels.per_token(fam, blk.query[:, cut], blk.key[:, cut], blk.value[:, cut], blk.g[:, cut],
                                      blk.beta[:, cut], state, blk.l2, final_state=True)[1]
        out[t], done = state, t + 1
    return out


def windows(blk: BlockRecord) -> torch.Tensor:
    """The convolution window after every token, `[b, s, conv_dim, width-1]` (zeros before the prompt; a
    cache's window where the call's input begins with one: `conv_skip`)."""
    assert blk.conv_x is not None and blk.conv_weight is not None
    x = blk.conv_x.float()
    w = blk.conv_weight.shape[-1]
    s = x.shape[-1]
    padded = F.pad(x, (w - 2, 0))  # column t + w - 2 of padded is token t
    return padded.unfold(-1, w - 1, 1)[:, :, blk.conv_skip:s].permute(0, 2, 1, 3).contiguous()


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


def _ssd_adjoint(blk: BlockRecord, grad: BlockRecord, visit: Callable[[list[int], torch.Tensor], None],
                 at: Iterable[int] | None = None) -> None:
    """The Mamba-2 scan's adjoint in chunks of `ADJOINT_CHUNK`, from the last back to the first:
    `visit(ts, G)` with G = dM/dS_t at the tokens `ts` of `at` in the chunk (None: every token), `[b, len(ts),
    h, P, N]` float32. The transitions and C are `blk`'s, the gradient at the output `grad`'s.

    With a_t = A dt_t (the log decay), G_t = go_t C_t^T + exp(a_(t+1)) G_(t+1); within a chunk, with L the
    cumulative log decay from its first token, G_t = sum_(j >= t) exp(L_j - L_t) go_j C_j^T
    + exp(L_last - L_t) E, E = exp(a_(t1)) G_(t1) carried from the next chunk (every exponent <= 0). Only
    the tokens asked (and each chunk's first, for the carry) are computed."""
    sc = blk.scan
    assert sc is not None
    if grad.grad_out is None:
        raise DeltaValueError(f"L{blk.layer}: no gradient at the scan's output: call Recording.backward first")
    heads = sc.x.shape[2]
    a = (sc.A.float() * ssd.step_sizes(sc.dt, sc.dt_bias, sc.dt_softplus, sc.dt_limit)).transpose(1, 2)  # [b, h, s]
    Ch = sc.C.float().repeat_interleave(heads // sc.C.shape[2], dim=2).transpose(1, 2)  # [b, h, s, N]
    go = grad.grad_out.float().transpose(1, 2)  # [b', h, s, P]
    s, c = a.shape[-1], ADJOINT_CHUNK
    wanted = None if at is None else set(at)
    E: torch.Tensor | None = None  # [b', h, P, N]
    for t0 in reversed(range(0, s, c)):
        t1 = min(s, t0 + c)
        asked = [t for t in range(t0, t1) if wanted is None or t in wanted]
        rows = sorted({0, *(t - t0 for t in asked)})
        idx = torch.tensor(rows, device=a.device)
        L = a[..., t0:t1].cumsum(-1)  # [b, h, n]
        later = torch.arange(t1 - t0, device=a.device)[None, :] < idx[:, None]  # [rows, j]: j < t is not read
        W = (L[..., None, :] - L[..., idx, None]).masked_fill(later, float("-inf")).exp()  # [b, h, rows, j]
        gT, Cc = go[..., t0:t1, :].transpose(-1, -2), Ch[..., t0:t1, :]  # [b', h, P, n], [b, h, n, N]
        G = (W[..., :, None, :] * gT[..., None, :, :]) @ Cc[..., None, :, :]  # [b', h, rows, P, N]
        if E is not None:
            G = G + (L[..., -1:] - L[..., idx]).exp()[..., None, None] * E[..., None, :, :]
        if asked:
            keep = [rows.index(t - t0) for t in asked]
            visit(asked, (G if len(keep) == G.shape[2] else G[:, :, keep]).transpose(1, 2))
        E = a[..., t0].exp()[..., None, None] * G[:, :, 0]


def state_gradients(fam: families.Family, blk: BlockRecord) -> torch.Tensor:
    """dM/dS_t for every token t of one block, `[b, s, h, dk, dv]` float32 (see the module's contract)."""
    if blk.scan is not None:
        b, s = blk.scan.x.shape[:2]
    else:
        assert blk.value is not None
        b, s = blk.value.shape[:2]
    out: torch.Tensor | None = None

    def keep(t: int, lam: torch.Tensor) -> None:
        nonlocal out
        if out is None:
            out = torch.empty(b, s, *lam.shape[1:], dtype=torch.float32, device=lam.device)
        out[:, t] = lam

    if blk.scan is not None:
        _ssd_adjoint(blk, blk, lambda ts, lam: [keep(t, lam[:, n]) for n, t in enumerate(ts)])
    else:
        _scan(fam, blk, keep)
    assert out is not None
    return out


def state_dots(fam: families.Family, blk: BlockRecord, delta: Callable[[int], torch.Tensor],
               grad: BlockRecord | None = None, at: Iterable[int] | None = None) -> torch.Tensor:
    """sum(lambda_t * delta(t)) per row, `[b, s]`: a first-order effect of changing every S_t by delta(t).

    `grad`: the record whose output gradient drives the scan (default `blk`; `blk` gives the transitions);
    `at`: the tokens whose delta may be nonzero (None: every one; the others are left 0).
    """
    g = blk if grad is None else grad
    assert g.grad_out is not None
    ref = blk.scan.x if blk.scan is not None else blk.value
    assert ref is not None
    b, s = max(ref.shape[0], g.grad_out.shape[0]), ref.shape[1]  # a gradient may have more rows
    out = torch.zeros(b, s, dtype=torch.float32, device=ref.device)
    keep = None if at is None else set(at)

    def dot(t: int, lam: torch.Tensor) -> None:
        if keep is None or t in keep:
            out[:, t] = (lam * delta(t)).flatten(1).sum(-1)

    def dots(ts: list[int], lam: torch.Tensor) -> None:
        out[:, ts] = (lam * torch.stack([delta(t) for t in ts], dim=1)).flatten(2).sum(-1)

    if blk.scan is not None:
        _ssd_adjoint(blk, g, dots, keep)
    else:
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
    return out[:, blk.conv_skip:]
