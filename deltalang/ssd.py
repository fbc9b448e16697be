"""The Mamba-2 (SSD) scan itself, for what transformers' kernels do not give: every token's state, one token's read.

Per head: h_t = exp(A dt_t) h_(t-1) + (dt_t x_t) ⊗ B_t (`[P, N]`), y_t = h_t C_t + D x_t, so a state written
after t changes token t's own output. Arguments are those of transformers' `mamba2_chunk_scan`
(`SCAN_GLOBAL`): hidden_states `[b, s, h, P]`, raw dt `[b, s, h]`, A, B/C `[b, s, g, N]`, D, dt_bias,
initial_states `[b, h, P, N]`.
- `per_token(...)` -> (y `[b, s, h, P]` float32, states `[b, s, h, P, N]` float32), in chunks of `CHUNK`
  with a loop over chunks only; `final_state=True` the last state alone; `per_token_loop` token by token;
- `read_state(C_t, state, x_t, D)`: one token's output from a (replaced) state;
- `split(scan, ..., positions, replace)`: the family's own scan cut at each t and continued with
  `initial_states`, the state replaced where asked; exact against an unsplit run otherwise.
Design and measurements: docs/mamba2.md.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from .errors import DeltaError

# transformers' module globals of the six Mamba-2 modeling modules (hub-kernel names in the note)
SCAN_GLOBAL = "mamba2_chunk_scan"  # "mamba_chunk_scan_combined" (mamba_ssm)
STEP_GLOBAL = "mamba2_selective_state_update"  # "selective_state_update" (mamba_ssm)
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
    x, xdt, a, Bh, Ch = prepare(hidden_states, dt, A, B, C, dt_bias, dt_softplus, dt_limit)
    b, h, s, P = x.shape
    N = Bh.shape[-1]
    S0 = _start(initial_states, (b, h, P, N), x.device)
    c = chunk_size
    pad = (-s) % c
    n = (s + pad) // c
    # padding: zero inputs write nothing, zero log decay keeps the state; (b, h) merged
    xdt, Bh, Ch = (F.pad(t, (0, 0, 0, pad)).reshape(b * h, n, c, -1) for t in (xdt, Bh, Ch))
    cum = F.pad(a, (0, pad)).reshape(b * h, n, c).cumsum(dim=-1)  # [bh, n, c]
    upper = torch.ones(c, c, dtype=torch.bool, device=x.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [bh, n, t, j]
    starts = _scan(S0.reshape(b * h, P, N), xdt, Bh, cum)
    intra = (Ch @ Bh.transpose(-1, -2)) * decay  # [bh, n, t, j]: C_t . B_j exp(G_t - G_j)
    y = intra @ xdt + cum.exp()[..., None] * (Ch @ starts[:n].transpose(0, 1).transpose(-1, -2))
    y = y.reshape(b, h, n * c, P)[:, :, :s].transpose(1, 2)
    if D is not None:
        y = y + D.float()[:, None] * hidden_states.float()
    if final_state:
        return y, starts[n].reshape(b, h, P, N)
    return y, _chunk_states(xdt, Bh, decay, cum, starts, b)[:, :s]


def _scan(S: torch.Tensor, xdt: torch.Tensor, Bh: torch.Tensor, cum: torch.Tensor) -> torch.Tensor:
    """The scan over chunks: each chunk's starting state `[n + 1, bh, P, N]` (the last: the final state)."""
    n = xdt.shape[1]
    last = cum[:, :, -1:]  # [bh, n, 1]
    # what each chunk adds from zero, sum_j exp(G_last - G_j) (dt_j x_j) ⊗ B_j: [bh, n, P, N]
    local = (xdt * (last - cum).exp()[..., None]).transpose(-1, -2) @ Bh
    e_last = last.exp()[..., None]  # [bh, n, 1, 1]
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


def _chunk_states(xdt: torch.Tensor, Bh: torch.Tensor, decay: torch.Tensor, cum: torch.Tensor,
                  starts: torch.Tensor, b: int) -> torch.Tensor:
    """states[t] = sum_j decay[t, j] (dt_j x_j) ⊗ B_j + exp(G_t) S0, straight into `[b, n * c, h, P, N]`.

    A group of chunks of one batch row at a time (about `_BLOCK_BYTES`), so that the start term is
    added while the first is still in cache; under autograd, fresh tensors per group."""
    bh, n, c, P = xdt.shape
    h, N = bh // b, Bh.shape[-1]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (xdt, Bh, cum, starts))
    group = max(1, _BLOCK_BYTES // (c * h * P * N * 4))
    out = None if grad else torch.empty((b, n * c, h, P, N), dtype=torch.float32, device=xdt.device)
    e_cum = cum.exp().view(b, h, n, c)
    parts = []
    for r in range(b):
        rows = slice(r * h, (r + 1) * h)
        for i in range(0, n, group):
            j = min(n, i + group)
            # left[k, t, h, p, j] = decay[t, j] * (dt x)_j[p]; right[k, 1, h, j, N] = B_j
            left = decay[rows, i:j].permute(1, 2, 0, 3)[:, :, :, None, :] * xdt[rows, i:j].permute(1, 0, 3, 2)[:, None]
            right = Bh[rows, i:j].permute(1, 0, 2, 3)[:, None]
            start = (e_cum[r, :, i:j].permute(1, 2, 0)[..., None, None], starts[i:j, rows, None].transpose(1, 2))
            if out is None:
                parts.append(torch.addcmul(left.contiguous() @ right, *start))
                continue
            blk = out.view(b, n, c, h, P, N)[r, i:j]
            torch.matmul(left.contiguous(), right, out=blk)
            blk.addcmul_(*start)
    if out is None:
        return torch.cat(parts).view(b, n * c, h, P, N)
    return out


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

    `scan` is the modeling module's global (`SCAN_GLOBAL`) called as its mixer calls it, with
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
