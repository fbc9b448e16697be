"""A token's write as a value: the two factors of the rank-one update each token adds to its block's state.

- Delta rule (KDA: a per-key-channel decay): S_t = a_t S_(t-1) + k_t u_t^T. `write_keys` is k_t as the rule sees
  it (after its l2-norm, repeated to the value heads), `write_values` u_t = beta_t (v_t - (a_t S_(t-1))^T k_t),
  the chunked rule's corrections (`deltarule._chunk_system`, `corrections`: no state kept), `[b, s, h, dk|dv]`.
- Mamba-2: h_t = exp(A dt_t) h_(t-1) + (dt_t x_t) ⊗ B_t, its factors in the state's axis order `[head_dim,
  d_state]`: `write_keys` dt_t x_t `[b, s, h, P]`, `write_values` B_t of the head's group `[b, s, h, N]`.

A read is served beside the unchanged call (the forward's bits stay). A write: each (row, token, head) whose
factors it changed adds the outer product of its factors as written; every other token runs the rule from the
state it sees, so the tokens after a written one continue from the state it left (`run_written`: the chunked
rule with the written tokens' rows of its system fixed; on Mamba-2 the change of each written update carried to
the later outputs and the final state, the scan being linear: `ssd_written`). A row's left padding is never
written. A decode step serves and writes them too (on Mamba-2: `step_factors`, `step_change`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from deltalang.ground.errors import DeltaValueError

from .. import deltarule, ssd

NAMES = ("write_keys", "write_values")
# a write: (the keys written, the values written, which (row, token, head) wrote them `[b, s, h]`)
Fixed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _unchunked(x: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """`[bh, n, C, d]` as `[b, s, h, d]`."""
    return x.reshape(b, x.shape[0] // b, -1, x.shape[-1])[:, :, :s].transpose(1, 2)


def delta_factors(fam: Any, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial: torch.Tensor | None, l2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(write_keys `[b, s, h, dk]`, write_values `[b, s, h, dv]`) float32 of a delta-rule call."""
    k, _, _, cum, u0, w, S0, b, s, _, to_end = deltarule._chunk_system(fam, key, value, g, beta, initial, l2,
                                                                       deltarule.CHUNK)
    u = corrections(S0, u0, w, *deltarule._ends(k, cum, to_end))
    return _unchunked(k, b, s), _unchunked(u, b, s)


def corrections(S: torch.Tensor, u0: torch.Tensor, w: torch.Tensor, k_last: torch.Tensor,
                e_last: torch.Tensor) -> torch.Tensor:
    """`deltarule._scan`'s corrections `u` `[bh, n, C, dv]` alone (the write values). Without gradients the state
    is carried in place, no chunk's kept, and the decayed factors' subnormal entries (below 2^-126, where x86
    products slow several-fold) are zeros: each adds under 2^-126 |S| to a sum it cannot change at float32."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (S, u0, w, k_last, e_last)):
        return deltarule._scan(S, u0, w, k_last, e_last)[1]
    tiny = torch.finfo(torch.float32).tiny
    w, k_last, e_last = (x.masked_fill(x.abs() < tiny, 0.0) for x in (w, k_last, e_last))
    S, u = S.clone(), torch.empty_like(u0)
    for i in range(u0.shape[1]):
        ui = torch.baddbmm(u0[:, i], w[:, i], S, alpha=-1)
        u[:, i] = ui
        S.mul_(e_last[:, i]).baddbmm_(k_last[:, i], ui)
    return u


def serve_factors(call: Any, step: int, make: Any
                  ) -> tuple[Fixed | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """Serve `write_keys` and `write_values` to the workers waiting on them (`make()`: both, made once when first
    asked; each worker gets a copy, so that a write in place is seen too): (the write, if one changed them (its
    mask over (row, token, head) past each row's padding), else None; the factors, None if none was asked for)."""
    made: tuple[torch.Tensor, torch.Tensor] | None = None
    new: list[Any] = [None, None]
    for i, name in enumerate(NAMES):
        if made is None and call.wants(name):
            made = make()
        if made is not None and call.wants(name):
            new[i] = call.serve(name, made[i].clone(), step)
    if made is None:
        return None, None
    new = [m if n is None else n for n, m in zip(new, made)]
    keys, writes = (_checked(call, n, m, name) for n, m, name in zip(new, made, NAMES))
    mask = keys.ne(made[0]).any(-1) | writes.ne(made[1]).any(-1)
    for row, pad in enumerate(call.pads or ()):
        mask[row, :pad] = False
    return ((keys, writes, mask) if bool(mask.any()) else None), made


def _checked(call: Any, new: Any, like: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(new, torch.Tensor):
        raise DeltaValueError(f"L{call.layer}.{name}: a write must be a tensor, got {type(new).__name__}")
    if tuple(new.shape) != tuple(like.shape):
        if tuple(new.shape) != tuple(like.shape[1:]):
            raise DeltaValueError(f"L{call.layer}.{name}: a write of shape {list(new.shape)} does not fit "
                                  f"{list(like.shape)} [batch, seq, heads, dim]")
        new = new.unsqueeze(0).expand(like.shape)
    if not new.is_floating_point():
        raise DeltaValueError(f"L{call.layer}.{name}: a write must be floating point, got {new.dtype}")
    return new.to(device=like.device, dtype=like.dtype)


def refuse_positions(call: Any, step: int) -> None:
    """A call whose writes are written serves no `state_after(t)` (its split runs the unwritten rule)."""
    if call.positions("state_after", step) or call.wants("states_as_run") and call.family.block_kind == "ssm":
        raise DeltaValueError(f"L{call.layer}: a run that writes write_keys or write_values reads or writes no "
                              f"state_after(t) of that block (nor, on Mamba-2, states_as_run); read state_output")


def run_written(call: Any, step: int, inputs: tuple[torch.Tensor, ...], initial: torch.Tensor | None, l2: bool,
                fixed: Fixed) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta-rule call with the written tokens' writes fixed: (outputs `[b, s, h, dv]` in the query's dtype,
    the final state `[b, h, dk, dv]` float32); `states_as_run` served from the same chunks."""
    refuse_positions(call, step)
    query, key, value, g, beta = inputs
    k, kd, decay, cum, u0, w, S0, b, s, _, to_end = deltarule._chunk_system(
        call.family, key, value, g, beta, initial, l2, deltarule.CHUNK, fixed)
    starts, u = deltarule._scan(S0, u0, w, *deltarule._ends(k, cum, to_end))
    bh, n, C, dk = k.shape
    heads = bh // b
    q = query if query.shape[-2] == heads else query.repeat_interleave(heads // query.shape[-2], dim=2)
    q = deltarule._read_query(call.family, q.transpose(1, 2).to(torch.float32).contiguous(), l2)
    q = F.pad(q, (0, 0, 0, n * C - s)).reshape(bh, n, C, dk)
    out = deltarule._unchunk(deltarule._chunk_outputs(q, k, kd, decay, cum, starts, u), b, heads, s, query.dtype)
    if call.wants("states_as_run"):
        states = deltarule._chunk_states(k, kd, decay, cum, starts, u, b)
        assert states is not None
        call.serve("states_as_run", states[:, :s], step)
    return out, starts[n].reshape(b, heads, dk, u.shape[-1])


def ssd_factors(inputs: list[torch.Tensor], opts: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(write_keys dt_t x_t `[b, s, h, P]`, write_values B_t `[b, s, h, N]`) float32 of a Mamba-2 scan call."""
    x, dt, _, B, _ = inputs
    step = ssd.step_sizes(dt, opts["dt_bias"], opts["dt_softplus"], opts["dt_limit"])
    return x.float() * step[..., None], ssd._heads(B, x.shape[2])


def ssd_written(call: Any, step: int, y: torch.Tensor, final: torch.Tensor, inputs: list[torch.Tensor], opts: dict,
                served: tuple[torch.Tensor, torch.Tensor], fixed: Fixed) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan's outputs and final state with the written tokens' updates replaced: each one's change
    (written ⊗ minus served ⊗) read by its token and carried to the later tokens and the final state."""
    refuse_positions(call, step)
    keys, writes, mask = fixed
    cum = ssd.log_decays(inputs[1], inputs[2], opts["dt_bias"], opts["dt_softplus"], opts["dt_limit"])
    y, final = y.clone(), final.clone()
    C = inputs[4]
    for p in mask.any(dim=(0, 2)).nonzero().flatten().tolist():
        m = mask[:, p, :, None, None]
        change = (keys[:, p, :, :, None] * writes[:, p, :, None, :]
                  - served[0][:, p, :, :, None] * served[1][:, p, :, None, :]) * m
        y[:, p] = (y[:, p].float() + ssd.read_state(C[:, p], change)).to(y.dtype)
        if p + 1 < y.shape[1]:
            add, add_final = ssd.carried(C, cum, change, p)
            y[:, p + 1:] = (y[:, p + 1:].float() + add).to(y.dtype)
            final = (final.float() + add_final).to(final.dtype)
        else:
            final = (final.float() + change).to(final.dtype)
    return y, final


def step_factors(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A Mamba-2 decode step's factors, `[b, 1, h, P]` and `[b, 1, h, N]`: its x `[b, h, P]` times its step size
    (dt `[b, h, P]`, the head's repeated; bias and softplus as the step applies them), B `[b, g, N]` per head."""
    step = ssd.step_sizes(dt, kw.get("dt_bias"), bool(kw.get("dt_softplus")), (0.0, float("inf")))
    return (x.float() * step)[:, None], ssd._heads(B, x.shape[1])[:, None]


def step_change(served: tuple[torch.Tensor, torch.Tensor], fixed: Fixed) -> torch.Tensor:
    """What a decode step's written factors change its state by, `[b, h, P, N]` float32."""
    (k, v), (k_new, v_new, mask) = served, fixed
    change = k_new[:, 0, :, :, None] * v_new[:, 0, :, None, :] - k[:, 0, :, :, None] * v[:, 0, :, None, :]
    return change * mask[:, 0, :, None, None]
