"""The delta rule itself, for what transformers' kernels do not give: every token's state, one token's read.

- `per_token(fam, q, k, v, g, beta, initial_state, l2)` -> (outputs `[b, s, h, dv]` in the query's dtype,
  states `[b, s, h, dk, dv]` float32): in chunks of `CHUNK` tokens, batched products, a loop over chunks
  only; `final_state=True` gives the last state alone.
- `per_token_reduced(..., sinks)`: each group of chunks of one row handed to every sink and dropped, so the
  `[b, s, h, dk, dv]` tensor never exists; `per_token_sq_norms` each head's squared norm after every token,
  `per_token_projections` its dot product with a direction, neither making any state per token.
- `per_token_loop`: the same recurrence token by token (the tests' statement); `prepare`: the kernels' own
  preprocessing; `read_state`: one token's read `q_t @ S`; `final_state`: the last state alone (a side call).
- `reusing()` / `release()`: inside a traced forward, a block's states reuse an earlier call's buffer once
  nothing references it; a tensor returned is never overwritten while anything can see it.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from deltalang.models import families

# chunk length of the chunked `per_token`: materialising the states costs s * CHUNK * dk * dv
# multiply-adds per head, the scan over chunks s / CHUNK sequential steps
CHUNK = 16
# the states are written a group of chunks at a time, about this many bytes, so that adding the
# chunk's starting state finds them still in cache
_BLOCK_BYTES = 8 << 20


def prepare(fam: families.Family, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            g: torch.Tensor, beta: torch.Tensor, use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    """The kernel's own preprocessing: float32, heads first, l2-norm, 1/sqrt(dk), repeated heads.

    Returns q, k, v `[b, h, s, d]`, g `[b, h, s]` (Kimi: `[b, h, s, dk]`), beta `[b, h, s]`.
    """
    heads = value.shape[-2]
    if key.shape[-2] != heads:
        rep = heads // key.shape[-2]
        query = query.repeat_interleave(rep, dim=2)
        key = key.repeat_interleave(rep, dim=2)
    # contiguous, so that a slice of the sequence reduces in the same order as the whole
    q, k, v, b_, gg = (x.transpose(1, 2).to(torch.float32).contiguous() for x in (query, key, value, beta, g))
    return _read_query(fam, q, use_qk_l2norm), _normed(fam, k, use_qk_l2norm), v, gg, b_


def _normed(fam: families.Family, x: torch.Tensor, use_qk_l2norm: bool) -> torch.Tensor:
    """A float32 query or key as the kernel normalises it: l2-norm over key_dim, when it asks for it."""
    return getattr(fam.module, "l2norm")(x, dim=-1, eps=1e-6) if use_qk_l2norm else x


def _read_query(fam: families.Family, q: torch.Tensor, use_qk_l2norm: bool) -> torch.Tensor:
    """A float32 query, heads repeated, as the kernel reads the state with it: normalised, times 1/sqrt(dk)."""
    q = _normed(fam, q, use_qk_l2norm)
    return q * (q.shape[-1] ** -0.5)


def _start_state(initial_state: torch.Tensor | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The state a delta-rule call starts from, float32: `initial_state`, or zeros of `shape`."""
    return (torch.zeros(shape, dtype=torch.float32, device=device) if initial_state is None
            else initial_state.to(device=device, dtype=torch.float32))


# -- the buffer the states of one call may reuse (inside `reusing()` only) ---------------------------------------

_REUSE = [0]  # depth of `reusing()` blocks
_SCRATCH: list[torch.Tensor] = []  # at most one buffer


@contextmanager
def reusing() -> Iterator[None]:
    """Let the calls inside reuse one states buffer, once nothing references it; drop it at the end."""
    _REUSE[0] += 1
    try:
        yield
    finally:
        _REUSE[0] -= 1
        if _REUSE[0] == 0:
            _SCRATCH.clear()


def release() -> None:
    """Drop the buffer kept for reuse (the forward's last DeltaNet block has run: `MixerSite`)."""
    _SCRATCH.clear()


def _unreferenced(buf: torch.Tensor) -> bool:
    """Whether only `_SCRATCH` holds `buf`'s memory (no tensor or view of it is alive elsewhere)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:  # cannot tell: never reuse
        return False
    return int(count(buf.untyped_storage()._cdata)) == 2  # `buf` and the storage object just made


def _states_buffer(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    numel = math.prod(shape)
    if _REUSE[0] and _SCRATCH:
        buf = _SCRATCH[0]
        if buf.device == device and buf.numel() >= numel and _unreferenced(buf):
            return buf[:numel].view(shape)
    buf = torch.empty(numel, dtype=torch.float32, device=device)
    if _REUSE[0]:
        _SCRATCH[:] = [buf]
    return buf.view(shape)


# -- the chunked delta rule ------------------------------------------------------------------------------------


def _inverse_unit_lower(a: torch.Tensor) -> torch.Tensor:
    """`(I + a)^-1` for `a` strictly lower triangular `[..., C, C]`: forward substitution over rows,
    each step batched over every chunk (the form transformers' chunked kernel uses)."""
    x = -a
    for i in range(1, a.shape[-1]):  # clones: autograd keeps what each step read
        row, sub = x[..., i, :i].clone(), x[..., :i, :i].clone()
        x[..., i, :i] = row + (row[..., None] * sub).sum(-2)
    return x + torch.eye(a.shape[-1], dtype=x.dtype, device=x.device)


def _log_decays(gg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's log decays from per-token ones `gg` `[bh, n, C, d]` (d: 1, or dk for Kimi), each a float32 sum
    of the very terms it spans, never a difference of two cumulative sums (whose rounding is that of the
    whole chunk's decay: one token forgetting hard, g = -300, left every later decay ~1e-4 off).

    Returns (cum `[bh, n, C, d]`: from the chunk's start through t; pair `[bh, n, C(t), C(j), d]`: from j to t,
    the sum over j < l <= t, -inf where j > t; to_end `[bh, n, C, d]`: from t to the chunk's end, l > t)."""
    C = gg.shape[2]
    below = torch.ones(C, C, dtype=torch.bool, device=gg.device).tril(-1)  # [l, j]: l > j
    pair = gg[:, :, :, None, :].expand(-1, -1, -1, C, -1).masked_fill(~below[..., None], 0).cumsum(dim=2)
    pair = pair.masked_fill(below.T[..., None], float("-inf"))
    to_end = pair[:, :, -1].clone()  # l > j through the chunk's last token
    to_end[:, :, -1] = 0.0
    return gg.cumsum(dim=2), pair, to_end


def _ends(k: torch.Tensor, cum: torch.Tensor, to_end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the scan over chunks carries: the keys decayed to the chunk's end `[bh, n, dk, C]` and the chunk's
    whole decay `[bh, n, 1 or dk, 1]`."""
    return (k * to_end.exp()).transpose(-1, -2), cum[:, :, -1, :, None].exp()


def per_token(fam: families.Family, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None,
              use_qk_l2norm: bool, chunk_size: int = CHUNK,
              final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule keeping every state, in chunks: batched matrix products, a loop over chunks only.
    Within a chunk starting from state S0, with cumulative log decay G_t from the chunk's start
    (per key channel for Kimi), S_t = exp(G_t) * S0 + sum_{j<=t} exp(G_t - G_j) * k_j^T u_j, where
    the corrections u (the delta rule's `beta * (v - k S)`) solve one unit-lower-triangular system
    per chunk (the UT form transformers' chunked kernel uses). Equal to `per_token_loop` within float32 noise.
    Returns (outputs `[b, s, h, dv]` in the query dtype, states `[b, s, h, dk, dv]` float32), or
    with `final_state` (outputs, the state after the last token `[b, h, dk, dv]`).
    """
    q, k, v, gg, bb = prepare(fam, query, key, value, g, beta, use_qk_l2norm)
    (b, h, s, dk), dv = k.shape, v.shape[-1]
    S0 = _start_state(initial_state, (b, h, dk, dv), v.device)
    per_head = gg.dim() == 3  # one decay per head, else per key channel (Kimi)
    if per_head:
        gg = gg[..., None]
    C = chunk_size
    pad, n = (-s) % C, -(-s // C)
    # padding: zero keys and betas write nothing, zero log decay keeps the state; (b, h) merged
    q, k, v, gg = (torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(b * h, n, C, -1) for x in (q, k, v, gg))
    bb = torch.nn.functional.pad(bb, (0, pad)).reshape(b * h, n, C, 1)
    cum, pair, to_end = _log_decays(gg)  # [bh, n, C, 1 or dk], [bh, n, C, C, 1 or dk], [bh, n, C, 1 or dk]
    if per_head:  # decay[t, j] = exp(G_t - G_j) for j <= t: [bh, n, C, C]; no key-sized product needed
        decay = pair[..., 0].exp()
        system = ((k * bb) @ k.transpose(-1, -2)) * decay
        kd = None
    else:  # kd[t, j, a] = exp(G_t - G_j)[a] * k_j[a] for j <= t, else 0: [bh, n, C, C, dk]
        kd = pair.exp() * k[..., None, :, :]
        system = (kd @ (k * bb)[..., None])[..., 0]  # beta_t k_t . kd[t, j]
        decay = None
    inverse = _inverse_unit_lower(system.tril(-1))
    u0 = inverse @ (v * bb)
    w = inverse @ (k * bb * cum.exp())
    starts, u = _scan(S0.reshape(b * h, dk, dv), u0, w, *_ends(k, cum, to_end))
    out = _unchunk(_chunk_outputs(q, k, kd, decay, cum, starts, u), b, h, s, query.dtype)
    if final_state:
        return out, starts[n].reshape(b, h, dk, dv)
    states = _chunk_states(k, kd, decay, cum, starts, u, b)
    assert states is not None
    return out, states[:, :s]


def final_state(fam: families.Family, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None, use_qk_l2norm: bool,
                chunk_size: int = 64) -> torch.Tensor:
    """The state after the last token alone, `[b, h, dk, dv]` float32, one decay per head (the gated delta
    rule): the query-free half of transformers' chunked kernel, its operations in its order (chunks of 64, the
    same triangular solves), its final state within float32 rounding, each row's bits its own whatever rows share
    the call (`_flat`); outputs, intra-chunk attention and state reads never computed (a read's side call over a
    prefix); one chunk from zeros skips the products that are exact zeros there (the start's decay and read)."""
    if key.shape[-2] != value.shape[-2]:
        key = key.repeat_interleave(value.shape[-2] // key.shape[-2], dim=2)
    k = _normed(fam, key.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format), use_qk_l2norm)
    v, gg, bb = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (value, g, beta))
    b, h, s, dk = k.shape
    C = chunk_size
    pad, n = (-s) % C, -(-s // C)
    k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(b, h, n, C, x.shape[-1]) for x in (k, v))
    gg, bb = (torch.nn.functional.pad(x, (0, pad)).reshape(b, h, n, C) for x in (gg, bb))
    cum = gg.cumsum(dim=-1)
    upper = torch.ones(C, C, dtype=torch.bool, device=v.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta = k * bb[..., None]
    system = _bmm(k_beta, k.transpose(-1, -2)) * decay
    u = _solve(system, v * bb[..., None])
    k_last = k * (cum[..., -1:] - cum).exp()[..., None]
    if n == 1 and initial_state is None:  # one chunk from zeros: the loop's decayed start and w @ S are zeros
        return _bmm(k_last[:, :, 0].transpose(-1, -2), u[:, :, 0])
    w = _solve(system, k_beta * cum.exp()[..., None])
    S = (torch.zeros((b, h, dk, v.shape[-1]), dtype=torch.float32, device=v.device) if initial_state is None
         else initial_state.to(u))
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(n):
        S = S * chunk_decay[:, :, i] + _bmm(k_last[:, :, i].transpose(-1, -2), u[:, :, i] - _bmm(w[:, :, i], S))
    return S


def _flat(x: torch.Tensor) -> torch.Tensor:
    """`[..., m, n]` as one batch of row-major matrices: torch lays a product of strided batches out by their
    shapes (a batch of one, a slice of several chunks), and on some CPUs (AMD EPYC, MKL) the bits follow it."""
    return x.reshape(-1, *x.shape[-2:]).contiguous()


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b`, each product's bits the same however many share the call (`_flat`)."""
    return torch.bmm(_flat(a), _flat(b)).view(*a.shape[:-2], a.shape[-2], b.shape[-1])


def _solve(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """`system^-1 @ rhs` for unit lower triangular `system`, as `_bmm`."""
    return torch.linalg.solve_triangular(_flat(system), _flat(rhs), upper=False, unitriangular=True).reshape(rhs.shape)


def per_token_reduced(fam: families.Family, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None, use_qk_l2norm: bool,
                      sinks: list[Callable[[int, int, torch.Tensor], None]], chunk_size: int = CHUNK) -> None:
    """`per_token`'s states handed to `sinks` a group of chunks of one batch row at a time (see the contract)."""
    k, kd, decay, cum, starts, u, b, s = _chunked(fam, query, key, value, g, beta, initial_state, use_qk_l2norm,
                                                  chunk_size)

    def sink(row: int, start: int, blk: torch.Tensor) -> None:
        blk = blk.reshape(-1, *blk.shape[2:])[: max(0, s - start)]  # [c * C, h, dk, dv], past the end cut
        for f in sinks:
            f(row, start, blk)
    _chunk_states(k, kd, decay, cum, starts, u, b, sink)


def per_token_sq_norms(fam: families.Family, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None, use_qk_l2norm: bool,
                       chunk_size: int = CHUNK) -> torch.Tensor:
    """The squared Frobenius norm of each head's state after every token, `[b, s, h]` float32, without the
    states: with S_t = E_t S0 + sum_j kd[t, j]^T u_j inside a chunk, |S_t|^2 is |E_t S0|^2, plus twice its
    inner product with the sum, plus the sum's square, which needs only the keys' and corrections' Gram
    matrices within the chunk (C x C), never a [dk, dv] state per token (in float64: the terms may cancel).
    The scan over chunks keeps no chunk's starting state: each one's products are taken as it passes."""
    k, kd, decay, cum, u0, w, S0, b, s, gram, to_end = _chunk_system(fam, key, value, g, beta, initial_state,
                                                                     use_qk_l2norm, chunk_size)
    bh, n, C, dk = k.shape
    u, sq0, inner = _scan_products(S0, u0, w, k, *_ends(k, cum, to_end), decay is not None)
    e = cum.double().exp()  # [bh, n, C, 1 or dk]
    gu = (u @ u.transpose(-1, -2)).double()  # [bh, n, C, C]
    if decay is not None:  # one decay per head; inner[j] = (k_j S0) . u_j
        d, e1 = decay.double(), e[..., 0]
        first = e1.square() * sq0[..., None]
        cross = 2 * e1 * (d @ inner[..., None])[..., 0]
        last = ((d @ (gram.double() * gu)) * d).sum(-1)
    else:  # per key channel (Kimi): kd[t, j, a] = exp(G_t - G_j)[a] k_j[a]; inner[j, a] = (S0 u_j^T)[a]
        assert kd is not None
        kd64 = kd.double()
        first = (e.square() @ sq0[..., None])[..., 0]
        cross = 2 * torch.einsum("xntja,xnja,xnta->xnt", kd64, inner, e)
        last = torch.einsum("xntja,xntla,xnjl->xnt", kd64, kd64, gu)
    total = (first + cross + last).clamp_min(0).float()  # [bh, n, C]
    return total.reshape(b, bh // b, n * C)[:, :, :s].transpose(1, 2)


def per_token_projections(fam: families.Family, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None, use_qk_l2norm: bool,
                          direction: torch.Tensor, chunk_size: int = CHUNK) -> torch.Tensor:
    """Each head's state after every token dotted with `direction` `[h, dk, dv]`, `[b, s, h]` float32, without
    the states: <S_t, D> = <E_t S0, D> + sum_j (k_j D) . u_j inside a chunk (Kimi: per key channel, through kd),
    the chunk's starting state dotted with D as the scan passes it, k D for every chunk in one product."""
    k, kd, decay, cum, u0, w, S0, b, s, _, to_end = _chunk_system(fam, key, value, g, beta, initial_state,
                                                                  use_qk_l2norm, chunk_size)
    bh, n, C, dk = k.shape
    h = bh // b
    D = direction.to(device=k.device, dtype=torch.float32).expand(b, h, dk, -1).reshape(bh, dk, -1)
    per_head = decay is not None
    k_last, e_last = _ends(k, cum, to_end)
    k_last = k_last.contiguous()  # [bh, n, dk, C]
    u = torch.empty((n, *u0.shape[:1], C, u0.shape[-1]), dtype=torch.float32, device=u0.device)
    dots = torch.empty((n, bh, *(() if per_head else (dk,))), dtype=torch.float32, device=u0.device)
    S = S0
    for i in range(n):
        torch.baddbmm(u0[:, i], w[:, i], S, alpha=-1, out=u[i])
        dots[i] = (S * D).sum(dim=(-2, -1) if per_head else -1)
        S = torch.baddbmm(S * e_last[:, i], k_last[:, i], u[i])
    u, dots, e = u.transpose(0, 1), dots.transpose(0, 1), cum.exp()
    if per_head:
        inner = (k @ D[:, None] * u).sum(-1)  # (k_j D) . u_j, [bh, n, C]
        total = e[..., 0] * dots[..., None] + (decay @ inner[..., None])[..., 0]
    else:
        assert kd is not None
        total = (e @ dots[..., None])[..., 0] + torch.einsum("xntja,xnja->xnt", kd, u @ D[:, None].transpose(-1, -2))
    return total.reshape(b, h, n * C)[:, :, :s].transpose(1, 2)


def _scan_products(S: torch.Tensor, u0: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_last: torch.Tensor,
                   e_last: torch.Tensor, per_head: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_scan` keeping, of each chunk's starting state S0, only what a norm needs: the corrections u
    `[bh, n, C, dv]`, |S0|^2 float64 (`[bh, n]`; per key row `[bh, n, dk]` for Kimi) and the inner products
    with the chunk's writes, float64: (k_j S0) . u_j `[bh, n, C]` (Kimi: S0 u_j^T `[bh, n, C, dk]`).
    One product of S0 with the chunk's `w` and `k` stacked; nothing of size `[n, dk, dv]` is kept."""
    bh, n, C, dv = u0.shape
    k_last = k_last.contiguous()  # [bh, n, dk, C]
    left = torch.cat([w, k], dim=2) if per_head else w.contiguous()  # [bh, n, 2C or C, dk]
    u = torch.empty((n, bh, C, dv), dtype=torch.float32, device=u0.device)
    sq0 = torch.empty((n, bh, *(() if per_head else (k.shape[-1],))), dtype=torch.float64, device=u0.device)
    inner = torch.empty((n, bh, C, *(() if per_head else (k.shape[-1],))), dtype=torch.float64, device=u0.device)
    for i in range(n):
        prod = torch.bmm(left[:, i], S)  # [bh, 2C or C, dv]: w S0 (and k S0)
        torch.sub(u0[:, i], prod[:, :C], out=u[i])
        if per_head:
            sq0[i] = torch.linalg.vector_norm(S, dim=(-2, -1)).double().square()
            inner[i] = (prod[:, C:] * u[i]).sum(-1, dtype=torch.float64)
        else:
            sq0[i] = S.square().sum(-1, dtype=torch.float64)
            inner[i] = torch.bmm(u[i], S.transpose(-1, -2))
        S = torch.baddbmm(S * e_last[:, i], k_last[:, i], u[i])
    return u.transpose(0, 1), sq0.transpose(0, 1), inner.transpose(0, 1)


def _chunk_system(fam: families.Family, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None, use_qk_l2norm: bool, chunk_size: int,
                  fixed: tuple[torch.Tensor, ...] | None = None) -> tuple[Any, ...]:
    """`per_token`'s chunked pieces before the scan, without the queries: (k, kd, decay, cum, u0, w, S0 `[bh, dk,
    dv]`, b, s, gram, to_end), u0 and w the chunk's corrections before and their dependence on its starting state,
    to_end each token's log decay to its chunk's end (`_log_decays`). `fixed` (keys `[b, s, h, dk]`, writes
    `[b, s, h, dv]`, mask `[b, s, h]`): where the mask holds, the token writes those keys and that u as given,
    no correction (its row of the system zero: a written write, `mixer.writes`)."""
    if key.shape[-2] != value.shape[-2]:
        key = key.repeat_interleave(value.shape[-2] // key.shape[-2], dim=2)
    k = _normed(fam, key.transpose(1, 2).to(torch.float32).contiguous(), use_qk_l2norm)
    v, gg, bb = (x.transpose(1, 2).to(torch.float32).contiguous() for x in (value, g, beta))
    v = v * bb[..., None]  # the right-hand side of the chunk's system: beta v
    if fixed is not None:
        keys, writes, mask = (x.transpose(1, 2) for x in fixed)
        k, v = torch.where(mask[..., None], keys.float(), k), torch.where(mask[..., None], writes.float(), v)
        bb = bb.masked_fill(mask, 0.0)
    (b, h, s, dk), dv = k.shape, v.shape[-1]
    S0 = _start_state(initial_state, (b, h, dk, dv), v.device)
    per_head = gg.dim() == 3
    if per_head:
        gg = gg[..., None]
    C = chunk_size
    pad, n = (-s) % C, -(-s // C)
    k, v, gg = (torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(b * h, n, C, -1) for x in (k, v, gg))
    bb = torch.nn.functional.pad(bb, (0, pad)).reshape(b * h, n, C, 1)
    cum, pair, to_end = _log_decays(gg)
    if per_head:
        decay = pair[..., 0].exp()
        gram = k @ k.transpose(-1, -2)  # the keys' Gram matrix, [bh, n, C, C]
        system, kd = gram * bb * decay, None
    else:
        gram = None
        kd = pair.exp() * k[..., None, :, :]
        system, decay = (kd @ (k * bb)[..., None])[..., 0], None
    inverse = _inverse_unit_lower(system.tril(-1))
    u0, w = inverse @ v, inverse @ (k * bb * cum.exp())
    return k, kd, decay, cum, u0, w, S0.reshape(b * h, dk, dv), b, s, gram, to_end


def _chunked(fam: families.Family, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
             beta: torch.Tensor, initial_state: torch.Tensor | None, use_qk_l2norm: bool, chunk_size: int
             ) -> tuple[Any, ...]:
    """`per_token`'s chunked pieces without its outputs: (k, kd, decay, cum, starts, u, b, s)."""
    k, kd, decay, cum, u0, w, S0, b, s, _, to_end = _chunk_system(fam, key, value, g, beta, initial_state,
                                                                  use_qk_l2norm, chunk_size)
    starts, u = _scan(S0, u0, w, *_ends(k, cum, to_end))
    return k, kd, decay, cum, starts, u, b, s


def _scan(S: torch.Tensor, u0: torch.Tensor, w: torch.Tensor, k_last: torch.Tensor,
          e_last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over chunks: each chunk's starting state `[n + 1, bh, dk, dv]` (the last: the final
    state) and its corrections `u = u0 - w S0` `[bh, n, C, dv]`."""
    n = u0.shape[1]
    starts, u = [S], []
    for i in range(n):  # no `out=`: autograd follows (a trace with gradients on)
        u.append(torch.baddbmm(u0[:, i], w[:, i], starts[i], alpha=-1))
        starts.append(torch.baddbmm(starts[i] * e_last[:, i], k_last[:, i], u[i]))
    return torch.stack(starts), torch.stack(u, dim=1)


def _chunk_outputs(q: torch.Tensor, k: torch.Tensor, kd: torch.Tensor | None, decay: torch.Tensor | None,
                   cum: torch.Tensor, starts: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Every token's output, `[bh, n, C, dv]`: out_t = (q_t * exp(G_t)) S0 + sum_j (q_t . kd[t, j]) u_j."""
    assert decay is not None or kd is not None
    intra = (q @ k.transpose(-1, -2)) * decay if decay is not None else (kd @ q[..., None])[..., 0]  # [bh, n, C, C]
    return (q * cum.exp()) @ starts[:u.shape[1]].transpose(0, 1) + intra @ u


def _unchunk(out: torch.Tensor, b: int, h: int, s: int, dtype: torch.dtype) -> torch.Tensor:
    """`[bh, n, C, dv]` outputs as transformers returns them: `[b, s, h, dv]` in the query's dtype."""
    return out.reshape(b, h, -1, out.shape[-1])[:, :, :s].transpose(1, 2).to(dtype)


def _chunk_states(k: torch.Tensor, kd: torch.Tensor | None, decay: torch.Tensor | None, cum: torch.Tensor,
                  starts: torch.Tensor, u: torch.Tensor, b: int,
                  sink: Callable[[int, int, torch.Tensor], None] | None = None) -> torch.Tensor | None:
    """states[t] = sum_j kd[t, j]^T u_j + exp(G_t) * S0, straight into the `[b, n * C, h, dk, dv]` layout.

    A group of chunks of one batch row at a time (about `_BLOCK_BYTES`), so that the second term
    is added while the first is still in cache. With `sink`, each group `[c, C, h, dk, dv]` is handed to
    `sink(row, first position, group)` instead, in one reused buffer, and nothing is returned."""
    bh, n, C, dk = k.shape
    h, dv = bh // b, u.shape[-1]
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (k, cum, starts, u))
    group = max(1, _BLOCK_BYTES // (C * h * dk * dv * 4))
    if sink is not None:
        scratch = None if grad else torch.empty((min(group, n), C, h, dk, dv), dtype=torch.float32, device=u.device)
        out = None
    else:
        out = None if grad else _states_buffer((b, n * C, h, dk, dv), u.device)
    e_cum = cum.exp().view(b, h, n, C, -1)
    parts = []
    for r in range(b):
        rows = slice(r * h, (r + 1) * h)
        for i in range(0, n, group):
            j = min(n, i + group)
            if decay is not None:  # left[c, t, h, a, j] = decay[t, j] * k_j[a], made contiguous once
                left = decay[rows, i:j].permute(1, 2, 0, 3)[:, :, :, None, :] * k[rows, i:j].permute(1, 0, 3, 2)[:, None]
            else:
                assert kd is not None
                left = kd[rows, i:j].permute(1, 2, 0, 4, 3)
            right = u[rows, i:j].permute(1, 0, 2, 3)[:, None]  # [c, 1, h, C(j), dv]
            start = (e_cum[r, :, i:j].permute(1, 2, 0, 3)[..., None], starts[i:j, rows, None].transpose(1, 2))
            if sink is not None:
                if scratch is None:
                    sink(r, i * C, torch.addcmul(left.contiguous() @ right, *start))
                    continue
                blk = scratch[: j - i]
                torch.matmul(left.contiguous(), right, out=blk)
                sink(r, i * C, blk.addcmul_(*start))
                continue
            if out is None:  # autograd follows: a fresh tensor per group
                parts.append(torch.addcmul(left.contiguous() @ right, *start))
                continue
            blk = out.view(b, n, C, h, dk, dv)[r, i:j]
            torch.matmul(left.contiguous(), right, out=blk)
            blk.addcmul_(*start)
    if sink is not None:
        return None
    if out is None:
        return torch.cat(parts).view(b, n * C, h, dk, dv)
    return out


def per_token_loop(fam: families.Family, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None,
                   use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule token by token, the plain statement of the math `per_token` computes in chunks.

    Slow (a Python loop over tokens); kept as the tests' statement of the recurrence.
    Returns (outputs `[b, s, h, dv]` in the query dtype, states `[b, s, h, dk, dv]` float32).
    """
    q, k, v, gg, bb = prepare(fam, query, key, value, g, beta, use_qk_l2norm)
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    S = _start_state(initial_state, (b, h, dk, dv), v.device)
    states = torch.empty(b, s, h, dk, dv, dtype=torch.float32, device=v.device)
    out = torch.empty(b, h, s, dv, dtype=torch.float32, device=v.device)
    decay = gg.exp()
    for t in range(s):
        if decay.dim() == 4:  # per key channel (Kimi)
            S = S * decay[:, :, t, :, None]
        else:
            S = S * decay[:, :, t, None, None]
        kt = k[:, :, t, None, :]  # [b, h, 1, dk]
        delta = (v[:, :, t, None, :] - kt @ S) * bb[:, :, t, None, None]  # [b, h, 1, dv]
        S = S + kt.transpose(-1, -2) @ delta
        out[:, :, t] = (q[:, :, t, None, :] @ S)[:, :, 0]
        states[:, t] = S
    return out.transpose(1, 2).to(query.dtype), states


def read_state(fam: families.Family, query_t: torch.Tensor, state: torch.Tensor, heads: int,
               use_qk_l2norm: bool) -> torch.Tensor:
    """One token's read of a state: `q_t @ S`, as the kernel computes it. query_t `[b, hk, dk]`."""
    q = query_t.to(torch.float32)
    if q.shape[-2] != heads:
        q = q.repeat_interleave(heads // q.shape[-2], dim=1)
    q = _read_query(fam, q, use_qk_l2norm)
    return (q[:, :, None, :] @ state.to(torch.float32))[:, :, 0].to(query_t.dtype)
