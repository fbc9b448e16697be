"""The Mamba-2 (SSD) scan itself, for what transformers' kernels do not give: every token's state, one token's read.

Per head: h_t = exp(A dt_t) h_(t-1) + (dt_t x_t) ⊗ B_t (`[P, N]`), y_t = h_t C_t + D x_t. Arguments are those of
transformers' prompt scan (`internals.SCAN_GLOBAL`): hidden_states `[b, s, h, P]`, raw dt `[b, s, h]`, A, B/C
`[b, s, g, N]`, D, dt_bias, initial_states `[b, h, P, N]`.
- `per_token` (y and every state, float32, chunked), `per_token_loop` (token by token, the tests' reference);
- without every state at once: `per_token_reduced` (a group of chunks of one row at a time, to sinks),
  `per_token_sq_norms` (each head's squared norm, from Gram matrices), `per_token_projected` (onto a direction);
- `read_state`: one token's output from a (replaced) state; `final_state`: the state's half of transformers'
  torch scan, its final state bit for bit (a read's side call);
- `log_decays`, `carried`: a state changed after q changes each later output and the final state linearly (a write
  beside the unchanged call); `split`: the family's own scan cut at each t and continued with `initial_states`.
Design and measurements: docs/mamba2.md.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from deltalang.ground.errors import DeltaError

# chunk length of `per_token`: materialising the states costs s * CHUNK * P * N multiply-adds per
# head, the scan over chunks s / CHUNK sequential steps; at P 64, N 128 on a CPU 32 was the fastest
# for `states` (16: 1.3x slower, 128: 2x) and close to the fastest for `final_state` (64)
CHUNK = 32
# the states are written a group of chunks of one batch row at a time, about this many bytes
_BLOCK_BYTES = 8 << 20
_NO_LIMIT = (0.0, float("inf"))

Scan = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class SSDError(DeltaError):
    """A Mamba-2 scan asked for something its inputs cannot give (a position past the end, a wrong shape)."""


def step_sizes(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool,
               dt_limit: tuple[float, float]) -> torch.Tensor:
    """The step sizes the scan uses, `[b, s, h]` float32: bias, softplus and clamp in dt's own dtype, as transformers."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C `[..., g, N]` float32 with each group repeated over its heads: `[..., h, N]`."""
    return t.float().repeat_interleave(heads // t.shape[-2], dim=-2)


def _start(initial_states: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if initial_states is None:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    if tuple(initial_states.shape) != shape:
        raise SSDError(f"initial state of shape {tuple(initial_states.shape)}, the scan's is {shape}")
    return initial_states.to(device=device, dtype=torch.float32)


def prepare(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
            dt_bias: torch.Tensor | None, dt_softplus: bool,
            dt_limit: tuple[float, float]) -> tuple[torch.Tensor, ...]:
    """The scan's inputs heads first, float32: x `[b, h, s, P]`, dt·x, log decay a = A·dt `[b, h, s]`, B, C `[b, h, s, N]`."""
    heads = hidden_states.shape[2]
    step = step_sizes(dt, dt_bias, dt_softplus, dt_limit)
    x = hidden_states.float()
    xdt = x * step[..., None]
    a = A.float() * step
    Bh, Ch = _heads(B, heads), _heads(C, heads)
    return tuple(t.transpose(1, 2).contiguous() for t in (x, xdt, a, Bh, Ch))


def _chunked(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             dt_bias: torch.Tensor | None, initial_states: torch.Tensor | None, dt_softplus: bool,
             dt_limit: tuple[float, float], chunk_size: int) -> tuple[torch.Tensor, ...]:
    """The scan's inputs in chunks, (b, h) merged: dt·x `[bh, n, c, P]`, B, C `[bh, n, c, N]`, the cumulative log
    decay from each chunk's start `[bh, n, c]`, decay[t, j] = exp(G_t - G_j) for j <= t `[bh, n, c, c]` (the sum over
    j < l <= t: `_segment_sum`), the
    starting state `[bh, P, N]`. Padding: zero inputs write nothing, zero log decay keeps the state."""
    x, xdt, a, Bh, Ch = prepare(hidden_states, dt, A, B, C, dt_bias, dt_softplus, dt_limit)
    b, h, s, P = x.shape
    S0 = _start(initial_states, (b, h, P, Bh.shape[-1]), x.device).reshape(b * h, P, -1)
    c = chunk_size
    pad = (-s) % c
    n = (s + pad) // c
    xdt, Bh, Ch = (F.pad(t, (0, 0, 0, pad)).reshape(b * h, n, c, -1) for t in (xdt, Bh, Ch))
    a = F.pad(a, (0, pad)).reshape(b * h, n, c)
    # each decay a sum of the log decays it spans, not a difference of cumulative ones (whose rounding is the
    # whole chunk's: a hard-forgetting token left every later decay of its chunk ~1e-4 off)
    decay = _segment_sum(a).exp()  # [bh, n, t, j]
    return xdt, Bh, Ch, a.cumsum(dim=-1), decay, S0


def per_token(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              *, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
              initial_states: torch.Tensor | None = None, dt_softplus: bool = False,
              dt_limit: tuple[float, float] = _NO_LIMIT, chunk_size: int = CHUNK,
              final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 scan keeping every state, in chunks: batched matrix products, a loop over chunks only.

    Within a chunk starting from state S0, with cumulative log decay G_t from the chunk's start,
    h_t = exp(G_t) S0 + sum_{j<=t} exp(G_t - G_j) (dt_j x_j) ⊗ B_j. Equal to `per_token_loop`
    within float32 noise. Returns (y `[b, s, h, P]` float32, states `[b, s, h, P, N]` float32), or
    with `final_state` (y, the state after the last token `[b, h, P, N]`).
    """
    xdt, Bh, Ch, cum, decay, S0 = _chunked(hidden_states, dt, A, B, C, dt_bias, initial_states, dt_softplus,
                                           dt_limit, chunk_size)
    b, s, h, P = hidden_states.shape
    bh, n, c, N = Bh.shape
    starts = _scan(S0, xdt, Bh, cum, decay)
    intra = (Ch @ Bh.transpose(-1, -2)) * decay  # [bh, n, t, j]: C_t . B_j exp(G_t - G_j)
    y = intra @ xdt + cum.exp()[..., None] * (Ch @ starts[:n].transpose(0, 1).transpose(-1, -2))
    y = y.reshape(b, h, n * c, P)[:, :, :s].transpose(1, 2)
    if D is not None:
        y = y + D.float()[:, None] * hidden_states.float()
    if final_state:
        return y, starts[n].reshape(b, h, P, N)
    return y, _chunk_states(xdt, Bh, decay, cum, starts, b)[:, :s]


def _scan(S: torch.Tensor, xdt: torch.Tensor, Bh: torch.Tensor, cum: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """The scan over chunks: each chunk's starting state `[n + 1, bh, P, N]` (the last: the final state)."""
    n = xdt.shape[1]
    local, e_last = _local(xdt, Bh, cum, decay)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (S, xdt, Bh, cum)):
        parts = [S]
        for i in range(n):  # fresh tensors: autograd follows
            parts.append(torch.addcmul(local[:, i], parts[i], e_last[:, i]))
        return torch.stack(parts)
    starts = torch.empty((n + 1, *S.shape), dtype=torch.float32, device=S.device)
    starts[0] = S
    for i in range(n):
        torch.addcmul(local[:, i], starts[i], e_last[:, i], out=starts[i + 1])
    return starts


def _local(xdt: torch.Tensor, Bh: torch.Tensor, cum: torch.Tensor,
           decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What each chunk adds from zero, sum_j exp(G_last - G_j) (dt_j x_j) ⊗ B_j `[bh, n, P, N]` (decay's last row),
    and the chunk's whole decay exp(G_last) `[bh, n, 1, 1]`."""
    return (xdt * decay[:, :, -1, :, None]).transpose(-1, -2) @ Bh, cum[:, :, -1:].exp()[..., None]


def _groups(S0: torch.Tensor, xdt: torch.Tensor, Bh: torch.Tensor, cum: torch.Tensor, decay: torch.Tensor,
            group: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """The scan over chunks a group at a time: (first chunk i, end j, the starting states of chunks i..j-1
    `[j - i, bh, P, N]`), the state carried from group to group: memory of one group, whatever the length.
    The same operations as `_scan` (no autograd: the reduced reads run under no_grad)."""
    n, S = xdt.shape[1], S0
    for i in range(0, n, group):
        j = min(n, i + group)
        local, e_last = _local(xdt[:, i:j], Bh[:, i:j], cum[:, i:j], decay[:, i:j])
        starts = torch.empty((j - i, *S.shape), dtype=torch.float32, device=S.device)
        for k in range(j - i):
            starts[k] = S
            S = torch.addcmul(local[:, k], S, e_last[:, k])
        yield i, j, starts


def _group_states(xdt: torch.Tensor, Bh: torch.Tensor, decay: torch.Tensor, e_cum: torch.Tensor,
                  starts: torch.Tensor, rows: slice, i: int, j: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The states of chunks i..j-1 of one batch row (`rows` of bh), `[j - i, c, h, P, N]`: sum_j decay[t, j]
    (dt x)_j ⊗ B_j + exp(G_t) S0 (`starts` `[j - i, h, P, N]`: those chunks' starting states), into `out`."""
    # left[k, t, h, p, j] = decay[t, j] * (dt x)_j[p]; right[k, 1, h, j, N] = B_j
    left = decay[rows, i:j].permute(1, 2, 0, 3)[:, :, :, None, :] * xdt[rows, i:j].permute(1, 0, 3, 2)[:, None]
    right = Bh[rows, i:j].permute(1, 0, 2, 3)[:, None]
    start = (e_cum[rows, i:j].permute(1, 2, 0)[..., None, None], starts[:, None])
    if out is None:
        return torch.addcmul(left.contiguous() @ right, *start)
    torch.matmul(left.contiguous(), right, out=out)
    return out.addcmul_(*start)


def _chunk_states(xdt: torch.Tensor, Bh: torch.Tensor, decay: torch.Tensor, cum: torch.Tensor,
                  starts: torch.Tensor, b: int) -> torch.Tensor:
    """states[t] = sum_j decay[t, j] (dt_j x_j) ⊗ B_j + exp(G_t) S0, straight into `[b, n * c, h, P, N]`.

    A group of chunks of one batch row at a time (about `_BLOCK_BYTES`), so that the start term is
    added while the first is still in cache; under autograd, fresh tensors per group."""
    bh, n, c, P = xdt.shape
    h, N = bh // b, Bh.shape[-1]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (xdt, Bh, cum, starts))
    group = max(1, _BLOCK_BYTES // (c * h * P * N * 4))
    out = None if grad else torch.empty((b, n, c, h, P, N), dtype=torch.float32, device=xdt.device)
    e_cum = cum.exp()
    parts = []
    for r in range(b):
        rows = slice(r * h, (r + 1) * h)
        for i in range(0, n, group):
            j = min(n, i + group)
            blk = _group_states(xdt, Bh, decay, e_cum, starts[i:j, rows], rows, i, j,
                                None if out is None else out[r, i:j])
            if out is None:
                parts.append(blk)
    if out is None:
        return torch.cat(parts).view(b, n * c, h, P, N)
    return out.view(b, n * c, h, P, N)


def per_token_reduced(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      C: torch.Tensor, sinks: Sequence[Callable[[int, int, torch.Tensor], None]], *,
                      dt_bias: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
                      dt_softplus: bool = False, dt_limit: tuple[float, float] = _NO_LIMIT,
                      chunk_size: int = CHUNK, **_: Any) -> None:
    """`per_token`'s states handed to every sink as `sink(row, first position, block [t, h, P, N])`, one chunk of
    one row at a time (a view of one reused buffer holding a group of chunks, about `_BLOCK_BYTES`), past the end
    cut: the states of every token never exist together, and the scan over chunks keeps one group's starts."""
    xdt, Bh, Ch, cum, decay, S0 = _chunked(hidden_states, dt, A, B, C, dt_bias, initial_states, dt_softplus,
                                           dt_limit, chunk_size)
    b, s, h, P = hidden_states.shape
    bh, n, c, N = Bh.shape
    group = max(1, _BLOCK_BYTES // (c * h * P * N * 4))
    scratch = torch.empty((h, min(group, n), c * P, N), dtype=torch.float32, device=xdt.device)
    lefts = torch.empty((h, min(group, n), c, P, c), dtype=torch.float32, device=xdt.device)
    e_cum = cum.exp()
    for i, j, starts in _groups(S0, xdt, Bh, cum, decay, group):
        for r in range(b):
            rows = slice(r * h, (r + 1) * h)
            # left[h, k, t, p, j] = decay[t, j] (dt x)_j[p]: one plain batched product over (h, k), nothing broadcast
            left = torch.mul(decay[rows, i:j, :, None, :], xdt[rows, i:j, None].transpose(-1, -2),
                             out=lefts[:, : j - i])
            blk = torch.matmul(left.view(h, j - i, c * P, c), Bh[rows, i:j], out=scratch[:, : j - i])
            blk = blk.view(h, j - i, c, P, N)
            blk.addcmul_(e_cum[rows, i:j, :, None, None], starts[:, rows].transpose(0, 1)[:, :, None])
            for k in range(j - i):
                first = (i + k) * c
                if first < s:
                    part = blk[:, k, : s - first].transpose(0, 1)  # [t, h, P, N], a view
                    for sink in sinks:
                        sink(r, first, part)


def per_token_sq_norms(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                       C: torch.Tensor, *, dt_bias: torch.Tensor | None = None,
                       initial_states: torch.Tensor | None = None, dt_softplus: bool = False,
                       dt_limit: tuple[float, float] = _NO_LIMIT, chunk_size: int = CHUNK, **_: Any) -> torch.Tensor:
    """The squared Frobenius norm of each head's state after every token, `[b, s, h]` float32, without the
    states: with h_t = e^G_t S0 + sum_j decay[t, j] u_j ⊗ B_j in a chunk (u = dt x), |h_t|^2 is |e^G_t S0|^2,
    plus twice e^G_t sum_j decay[t, j] u_j^T S0 B_j, plus sum_{j,l} decay[t, j] decay[t, l] (u_j.u_l)(B_j.B_l):
    C x C Gram matrices within each chunk, never a `[P, N]` state per token (the sums in float64: terms cancel)."""
    xdt, Bh, Ch, cum, decay, S0 = _chunked(hidden_states, dt, A, B, C, dt_bias, initial_states, dt_softplus,
                                           dt_limit, chunk_size)
    b, s, h, P = hidden_states.shape
    bh, n, c, N = Bh.shape
    out = torch.empty((bh, n, c), dtype=torch.float64, device=xdt.device)
    for i, j, starts in _groups(S0, xdt, Bh, cum, decay, max(1, _BLOCK_BYTES // (bh * P * N * 4))):
        S = starts.transpose(0, 1)  # [bh, j - i, P, N]
        u, Bg, d = xdt[:, i:j], Bh[:, i:j], decay[:, i:j].double()
        e = cum[:, i:j].double().exp()
        first = e.square() * torch.linalg.vector_norm(S, dim=(-2, -1)).double().square()[..., None]
        cross = 2 * e * (d @ ((u @ S) * Bg).sum(-1).double()[..., None])[..., 0]
        u64, B64 = u.double(), Bg.double()
        gram = (u64 @ u64.transpose(-1, -2)) * (B64 @ B64.transpose(-1, -2))
        out[:, i:j] = first + cross + ((d @ gram) * d).sum(-1)
    return out.clamp_min(0).float().reshape(b, h, n * c)[:, :, :s].transpose(1, 2)


def per_token_projected(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                        C: torch.Tensor, direction: torch.Tensor, *, dt_bias: torch.Tensor | None = None,
                        initial_states: torch.Tensor | None = None, dt_softplus: bool = False,
                        dt_limit: tuple[float, float] = _NO_LIMIT, chunk_size: int = CHUNK, **_: Any) -> torch.Tensor:
    """Each head's state after every token projected onto `direction` `[h, P, N]`, `<h_t, D_h>` `[b, s, h]` float32,
    without the states: in a chunk <h_t, D> = e^G_t <S0, D> + sum_j decay[t, j] u_j^T D B_j (u = dt x), one
    `[P, N]` product per token, never a state per token."""
    xdt, Bh, Ch, cum, decay, S0 = _chunked(hidden_states, dt, A, B, C, dt_bias, initial_states, dt_softplus,
                                           dt_limit, chunk_size)
    b, s, h, P = hidden_states.shape
    bh, n, c, N = Bh.shape
    D = direction.to(device=xdt.device, dtype=torch.float32).expand(b, h, P, N).reshape(bh, 1, P, N)
    q = ((xdt @ D) * Bh).sum(-1)  # [bh, n, c]: u_j^T D B_j
    out = (decay @ q[..., None])[..., 0]
    for i, j, starts in _groups(S0, xdt, Bh, cum, decay, max(1, _BLOCK_BYTES // (bh * P * N * 4))):
        out[:, i:j] += cum[:, i:j].exp() * (starts.transpose(0, 1) * D).sum(dim=(-2, -1))[..., None]
    return out.reshape(b, h, n * c)[:, :, :s].transpose(1, 2)


def final_state(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                chunk_size: int, *, dt_bias: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
                dt_softplus: bool = False, dt_limit: tuple[float, float] = _NO_LIMIT, **_: Any) -> torch.Tensor:
    """The state after the last token alone, `[b, h, P, N]` float32: the state's half of transformers' torch scan
    (`internals.SCAN_GLOBAL`), its operations in its order and chunking, so that the state is the scan's own final state bit
    for bit while the outputs (the C.B products within each chunk: most of the scan's cost) are never computed.
    A read's side call over a prefix, behind transformers' torch scan only (C is not used)."""
    b, s, h, P = hidden_states.shape
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    x = hidden_states.float()
    Bh = B.float().repeat_interleave(h // B.shape[2], dim=2, output_size=h)
    pad = (chunk_size - s % chunk_size) % chunk_size
    x = x * dt[..., None].float()
    a = A.to(x.dtype) * dt.float()
    x, a, Bh = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)).reshape(b, -1, chunk_size, *t.shape[2:]) for t in (x, a, Bh))
    cum = torch.cumsum(a.permute(0, 3, 1, 2), dim=-1)  # [b, h, chunks, c]
    B_decay = Bh * torch.exp(cum[:, :, :, -1:] - cum).permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)
    previous = (initial_states[:, None].to(dtype=states.dtype, device=states.device) if initial_states is not None
                else torch.zeros_like(states[:, :1]))
    states = torch.cat([previous, states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(cum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    return torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)[:, -1]


def _segment_sum(t: torch.Tensor) -> torch.Tensor:
    """transformers' `segment_sum`: out[..., i, j] = sum of t[..., j+1..i] for j <= i, else -inf (masked cumsums)."""
    n = t.size(-1)
    t = t[..., None].expand(*t.size(), n)
    t = t.masked_fill(~torch.tril(torch.ones(n, n, device=t.device, dtype=torch.bool), diagonal=-1), 0)
    out = torch.cumsum(t, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(n, n, device=t.device, dtype=torch.bool), diagonal=0), -torch.inf)


def log_decays(dt: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool,
               dt_limit: tuple[float, float]) -> torch.Tensor:
    """Each token's cumulative log decay from the call's start, `[b, s, h]` float64 (so that differences of
    far-apart positions keep their digits): a state added after token q reaches token u scaled by
    exp(cum[u] - cum[q])."""
    return (A.double() * step_sizes(dt, dt_bias, dt_softplus, dt_limit).double()).cumsum(dim=1)


def carried(C: torch.Tensor, cum: torch.Tensor, change: torch.Tensor, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a change of the state after token q (`[b, h, P, N]`) adds, the scan being linear in its state: to the
    outputs of tokens q+1.. `[b, s-q-1, h, P]` float32 (C_u . exp(cum[u] - cum[q]) change), and to the final state."""
    heads = change.shape[1]
    scale = (cum[:, q + 1:] - cum[:, q:q + 1]).exp().float()  # [b, u, h]
    Ch = _heads(C[:, q + 1:], heads)  # [b, u, h, N]
    change = change.float()
    out = torch.einsum("bhpn,buhn->buhp", change, Ch) * scale[..., None]
    last = (cum[:, -1] - cum[:, q]).exp().float()  # [b, h]
    return out, change * last[..., None, None]


def per_token_loop(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   *, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                   initial_states: torch.Tensor | None = None, dt_softplus: bool = False,
                   dt_limit: tuple[float, float] = _NO_LIMIT) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 recurrence token by token, the plain statement of what `per_token` computes in chunks.

    Slow (a Python loop over tokens); kept as the tests' statement. Returns (y `[b, s, h, P]`
    float32, states `[b, s, h, P, N]` float32).
    """
    x, xdt, a, Bh, Ch = prepare(hidden_states, dt, A, B, C, dt_bias, dt_softplus, dt_limit)
    b, h, s, P = x.shape
    N = Bh.shape[-1]
    S = _start(initial_states, (b, h, P, N), x.device)
    states = torch.empty(b, s, h, P, N, dtype=torch.float32, device=x.device)
    y = torch.empty(b, h, s, P, dtype=torch.float32, device=x.device)
    for t in range(s):
        S = S * a[:, :, t].exp()[..., None, None] + xdt[:, :, t, :, None] * Bh[:, :, t, None, :]
        states[:, t] = S
        y[:, :, t] = (S @ Ch[:, :, t, :, None])[..., 0]
    if D is not None:
        y = y + D.float()[:, None, None] * x
    return y.transpose(1, 2), states


def read_state(C_t: torch.Tensor, state: torch.Tensor, x_t: torch.Tensor | None = None,
               D: torch.Tensor | None = None) -> torch.Tensor:
    """One token's output from a state: `h_t C_t + D x_t` float32 `[b, h, P]`.

    C_t `[b, g, N]` (groups repeated over heads), state `[b, h, P, N]`, x_t `[b, h, P]`, D `[h]`."""
    heads = state.shape[1]
    y = (state.float() @ _heads(C_t, heads)[..., None])[..., 0]
    if D is not None and x_t is not None:
        y = y + D.float()[:, None] * x_t.float()
    return y


def split(scan: Scan, hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
          C: torch.Tensor, chunk_size: int, positions: Sequence[int], *, D: torch.Tensor | None = None,
          dt_bias: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
          dt_softplus: bool = False, dt_limit: tuple[float, float] = _NO_LIMIT,
          replace: Mapping[int, torch.Tensor] | None = None,
          reread: bool = True) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The family's own scan cut after each of `positions`, continued from its final state (or `replace[t]`).

    `scan` is the modeling module's global (`internals.SCAN_GLOBAL`) called as its mixer calls it, with
    `initial_states` and `return_final_states=True`. Where `replace` holds a state `[b, h, P, N]` for
    t, the scan continues from it and token t's output is re-read from it (`read_state`; with
    `reread=False` token t keeps the output of the state it computed, as a cache edited after t does).
    Returns (y `[b, s, h, P]` float32, the state the scan reached after each position, the final state).
    """
    s = hidden_states.shape[1]
    cuts = sorted(set(int(t) for t in positions))
    if cuts and not 0 <= cuts[0] <= cuts[-1] < s:
        raise SSDError(f"split at {cuts[0] if cuts[0] < 0 else cuts[-1]}: the call has tokens 0..{s - 1}")
    replace = dict(replace or {})
    if set(replace) - set(cuts):
        raise SSDError(f"a state replaced at {sorted(set(replace) - set(cuts))}, not a split position")
    state, begin, ys, reached = initial_states, 0, [], []
    for end in [*(t + 1 for t in cuts), s]:
        if end == begin:  # the last cut is the call's last token
            continue
        part = slice(begin, end)
        y, state = scan(hidden_states[:, part], dt[:, part], A, B[:, part], C[:, part], chunk_size, D=D,
                        dt_bias=dt_bias, initial_states=state, dt_softplus=dt_softplus, dt_limit=dt_limit,
                        return_final_states=True)
        t = end - 1
        if t in cuts:
            reached.append(state)
            if t in replace:
                state = replace[t].to(device=state.device, dtype=state.dtype)
                if reread:
                    y = y.clone()
                    y[:, -1] = read_state(C[:, t], state, hidden_states[:, t], D).to(y.dtype)
        ys.append(y)
        begin = end
    assert state is not None
    return torch.cat(ys, dim=1), reached, state
