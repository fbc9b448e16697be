"""One Mamba-2 (SSD) scan call of a mixer: its values served beside it, the scan split where a write waits.

The kernel dispatchers hand this the calls of transformers' prompt scan (`internals.SCAN_GLOBAL`) and decode step
(`internals.STEP_GLOBAL`, updating the cache's state in place). A prompt serves
the scan's inputs (`output_matrices` C, `input_matrices` B, `scan_inputs` x, `step_sizes`, `decay_rates` A),
then `state_input`, reductions of `states` (`ssd.per_token_sq_norms`, `ssd.per_token_reduced`: the
states never all made), `states` (`ssd.per_token`), `state_after(t)`, `head_outputs` and `state_output`. The scan
runs once over the whole prompt, unchanged; `state_after(t)` is the state of the scan over the prefix beside it
(behind transformers' torch scan only its state's half: `ssd.final_state`), and a write there changes what the
scan is linear in: token t re-read from the written state, the change carried to the later tokens' outputs and the
final state (`ssd.carried`), in the written rows only (the others keep the call's bits); `states_as_run`, after
the writes, is `states` with each write's change carried to the later tokens the same way. A decode step serves
`state_input`, `state_after(0)`/`state_output`, `states` and its reductions, `states_as_run` (its token's state
after the writes). An invoke's worker gets its own rows.
Design: docs/mamba2.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from deltalang.ground.errors import DeltaValueError
from deltalang.ground.measures import Reduction
from deltalang.models import values

from .. import kernels, ssd
from .reduced import _pending, _waiting
from .requests import Requests
from .rows import _invokes
from .writes import serve_factors, ssd_factors, ssd_written, step_change, step_factors

if TYPE_CHECKING:
    from deltalang.models.families import Family


def _projected(red: Reduction, pads: list[int] | None) -> bool:
    """Whether a reduction of `states` starts with a projection onto a direction of a whole state `[h, P, N]` (so
    that `ssd.per_token_projected` serves it), and no later step over positions would count a row's padding."""
    if red.axes != STATE_AXES or not red.steps or red.steps[0][0] != "project" or red.steps[0][1].dim() != 3:
        return False
    return not any(pads or ()) or red.keeps_positions


# the prompt scan's inputs as served, in the mixer's forward order: (value, argument index)
_INPUTS = (("output_matrices", 4), ("input_matrices", 3), ("scan_inputs", 0))
# a write of `state_after(p)` in a prompt call: (p, the change written there, the state written there)
_Write = tuple[int, torch.Tensor, torch.Tensor]
# `states` as the catalogue names its axes on a Mamba-2 block: `[b, s, heads, head_dim, d_state]`, ssd's `[.., h, P, N]`
STATE_AXES = values.axes("states", kind=values.SSM)


class SSDCall(Requests):
    """The Mamba-2 side of `MixerSite`: one scan call (prompt or decode step), serving what workers wait on."""

    family: "Family"
    dims: dict[str, int]

    def ssd_kernel(self, fn: Callable[..., Any], decode: bool, *args: Any, **kw: Any) -> Any:
        for packed in ("cu_seqlens", "seq_idx", "cu_seq_lens_q"):
            if kw.get(packed) is not None:
                raise DeltaValueError(f"L{self.layer}: packed sequences ({packed}) are run, not served: a trace "
                                      f"that reads or writes a Mamba-2 value needs a padded batch")
        return self._scan_step(fn, *args, **kw) if decode else self._scan_prompt(fn, *args, **kw)

    # -- a prompt ----------------------------------------------------------------

    def _scan_prompt(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        step = self.step()
        names = ("hidden_states", "dt", "A", "B", "C", "chunk_size")
        call = dict(zip(names, args)) | kw
        inputs = [call.pop(n) for n in names[:5]]
        chunk = call.pop("chunk_size")
        want_final = bool(call.pop("return_final_states", False))
        opts = {"D": call.pop("D", None), "dt_bias": call.pop("dt_bias", None),
                "dt_softplus": bool(call.pop("dt_softplus", False)),
                "dt_limit": call.pop("dt_limit", (0.0, float("inf")))}
        initial = call.pop("initial_states", None)
        for name, i in _INPUTS:
            inputs[i] = self._per_token_input(name, inputs[i], step)
        if self.wants("step_sizes"):
            dt = ssd.step_sizes(inputs[1], opts["dt_bias"], opts["dt_softplus"], opts["dt_limit"])
            new = self.serve("step_sizes", dt, step)
            if new is not dt:  # the scan takes the written step sizes as they are
                inputs[1] = self._per_token_input("step_sizes", new, step, like=dt, serve=False)
                opts |= {"dt_bias": None, "dt_softplus": False, "dt_limit": (0.0, float("inf"))}
        A = inputs[2]
        new_A = self.serve("decay_rates", A, step)
        if new_A is not A:
            inputs[2] = self._checked(new_A, tuple(A.shape), "decay_rates", A)
        initial = self._state_input(initial, inputs[0], step)
        fixed, made = serve_factors(self, step, lambda: ssd_factors(inputs, opts))  # a token's write (`writes`)

        def run(a: int, e: int, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            x, dt, A_, B, C = inputs
            return fn(x[:, a:e], dt[:, a:e], A_, B[:, a:e], C[:, a:e], chunk, initial_states=state,
                      return_final_states=True, **opts, **call)

        b = kernels.backend(self.family, self.family.chunk_kernel)
        torch_only = fn is not b.compiled and (fn is b.reference or (b.compiled is None and fn is b.fn))

        def side(a: int, e: int, state: torch.Tensor | None) -> torch.Tensor:
            """The state after token e - 1 from `state` after a - 1: behind transformers' torch scan its state's
            half alone (`ssd.final_state`, the same bits), else the kernel itself, its outputs unused."""
            if not torch_only:
                return run(a, e, state)[1]
            x, dt, A_, B, C = inputs
            return ssd.final_state(x[:, a:e], dt[:, a:e], A_, B[:, a:e], C[:, a:e], chunk, initial_states=state,
                                   **opts)

        s = inputs[0].shape[1]
        self._scan_reduced(inputs, initial, opts, step)
        if self.wants("states"):
            self.serve("states", ssd.per_token(*inputs, initial_states=initial, **opts)[1], step)
        y, final = run(0, s, initial)  # the forward's own call, unchanged
        if fixed is not None:
            assert made is not None
            y, final = ssd_written(self, step, y, final, inputs, opts, made, fixed)
        y, final, writes, cum = self._scan_after(side, y, final, initial, step, inputs, opts)
        if self.wants("states_as_run"):
            self.serve("states_as_run", self._ssd_as_run(inputs, initial, opts, writes, cum), step)
        y = self._per_token_input("head_outputs", y, step)
        new = self.serve("state_output", final, step)
        if new is not final:
            final = self._checked(new, tuple(final.shape), "state_output", final)
        return (y, final) if want_final else y

    def _scan_after(self, side: Callable[[int, int, torch.Tensor | None], torch.Tensor], y: torch.Tensor,
                    final: torch.Tensor, initial: torch.Tensor | None, step: int, inputs: list[torch.Tensor],
                    opts: dict) -> tuple[torch.Tensor, torch.Tensor, list[_Write], torch.Tensor | None]:
        """Every `state_after` request, beside the forward's unchanged call. The state after p is the scan's over
        the prefix (`side`, from the call's start whatever else is read; the last position: the call's own final
        state) plus what earlier writes carried there;
        a write at p re-reads token p of its rows from the written state and adds what the change carries to the
        later tokens' outputs and the final state (`ssd.carried`: the scan is linear in its state). Rows that
        write nothing keep the call's outputs bit for bit. Returns the outputs, the final state, the writes in
        token order and the cumulative log decays they were carried with (None if nothing was written)."""
        s = y.shape[1]
        unchanged: dict[int, torch.Tensor] = {s - 1: final}
        writes: list[_Write] = []  # (position, the change written there, the state written there)
        cum: torch.Tensor | None = None
        done: set[str] = set()
        while True:
            asked = {p: [n for n in names if n not in done] for p, names in self.positions("state_after", step).items()}
            asked = {p: names for p, names in asked.items() if names}
            if not asked:
                return y, final, writes, cum
            p = min(asked)
            if p not in unchanged:  # from the call's start, never from another read's state: its bits its own
                unchanged[p] = side(0, p + 1, initial)
            state = unchanged[p]
            for q, change, _ in writes:  # what the earlier writes carried to p
                assert cum is not None
                state = state + change * (cum[:, p] - cum[:, q]).exp().float()[..., None, None]
            for name in asked[p]:
                done.add(name)
                new = self._serve_rows(name, state, step)
                if new is state:
                    continue
                if writes and p < writes[-1][0]:
                    raise DeltaValueError(f"L{self.layer}: a write of the state after {p} came after one after "
                                          f"{writes[-1][0]}: write a Mamba-2 block's states in token order")
                if cum is None:
                    cum = ssd.log_decays(inputs[1], inputs[2], opts["dt_bias"], opts["dt_softplus"], opts["dt_limit"])
                y, final, change = self._written(y, final, p, state, new, cum, inputs, opts["D"])
                writes.append((p, change, new))
                state = new

    def _ssd_as_run(self, inputs: list[torch.Tensor], initial: torch.Tensor | None, opts: dict, writes: list[_Write],
                    cum: torch.Tensor | None) -> torch.Tensor:
        """`states_as_run`: the state after every token of the forward as it ran, the `state_after` writes
        applied, `[b, s, h, P, N]` float32. The states of the call's (maybe written) inputs (`ssd.per_token`, as
        `states`) plus what each write carried to the later tokens, as the outputs were (h'_u = h_u +
        exp(cum_u - cum_t) Δ for u >= t); the written position holds the written state itself, in the rows it
        wrote (the others keep `states`' bits)."""
        states = ssd.per_token(*inputs, initial_states=initial, **opts)[1]
        for p, change, new in writes:
            assert cum is not None
            written = change.flatten(1).ne(0).any(dim=1)
            if not bool(written.any()):
                continue
            rows = written.nonzero().flatten()
            carry = (cum[rows, p:] - cum[rows, p:p + 1]).exp().float()[..., None, None]  # [r, s - p, h, 1, 1]
            states[rows, p:] = states[rows, p:] + change[rows].float()[:, None] * carry
            states[rows, p] = new[rows].float()
        return states

    def _written(self, y: torch.Tensor, final: torch.Tensor, p: int, state: torch.Tensor, new: torch.Tensor,
                 cum: torch.Tensor, inputs: list[torch.Tensor],
                 D: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The outputs and final state after `new` replaced `state` after p, in the rows it changed (new tensors:
        never change one a worker may hold), and the change."""
        change = new.float() - state.float()
        written = change.flatten(1).ne(0).any(dim=1)
        # every row: plain slices (views, no gathered copies); else the written rows' indices
        rows: Any = slice(None) if bool(written.all()) else written.nonzero().flatten()
        y, final = y.clone(), final.clone()
        x, C = inputs[0][rows], inputs[4][rows]
        y[rows, p] = ssd.read_state(C[:, p], new[rows], x[:, p], D).to(y.dtype)
        if p + 1 < y.shape[1]:
            add, add_final = ssd.carried(C, cum[rows], change[rows], p)
            y[rows, p + 1:] = (y[rows, p + 1:].float() + add).to(y.dtype)
            final[rows] = (final[rows].float() + add_final).to(final.dtype)
        else:
            final[rows] = new[rows].to(final.dtype)
        return y, final, change

    def _scan_reduced(self, inputs: list[torch.Tensor], initial: torch.Tensor | None, opts: dict, step: int) -> None:
        """Reductions of `states` a worker waits on (`mixer.reduced`), every token's state never made at once: a norm
        over head_dim, d_state (and heads) from each head's squared norm (`ssd.per_token_sq_norms`), a projection
        onto a direction from each head's (`ssd.per_token_projected`): no state per token at all; the others fed a
        group of chunks of one row at a time (`ssd.per_token_reduced`)."""
        while True:  # a worker asks for its next reduction once the last is served
            names = _waiting(self, step)
            if not names:
                return
            b, s = inputs[0].shape[:2]
            pending = _pending(self)
            asked = {n: pending.pop(n.split(".", 1)[1]) for n in names}
            fast = [n for n, red in asked.items() if red.uses_head_norms(self.pads)]
            if fast:
                sq = ssd.per_token_sq_norms(*inputs, initial_states=initial, **opts)
                for n in fast:
                    self.serve(n, asked.pop(n).from_head_norms(sq), step)
            for n in [n for n, red in asked.items() if _projected(red, self.pads)]:
                red = asked.pop(n)
                x = ssd.per_token_projected(*inputs, red.steps[0][1], initial_states=initial, **opts).sum(-1)
                self.serve(n, Reduction(("b", "s"), red.steps[1:])(x) if red.steps[1:] else x, step)
            streams = {n: red.stream(b, s, self.pads) for n, red in asked.items()}
            if streams:
                ssd.per_token_reduced(*inputs, [st.add for st in streams.values()], initial_states=initial, **opts)
            for n, st in streams.items():
                self.serve(n, st.result(), step)

    # -- a decode step -------------------------------------------------------------

    def _scan_step(self, fn: Callable[..., Any], state: torch.Tensor, hidden_states: torch.Tensor, dt: torch.Tensor,
              A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None, **kw: Any) -> Any:
        step = self.step()
        served = state.clone()
        new = self.serve("state_input", served, step)
        if new is not served:
            state.copy_(self._checked(new, tuple(state.shape), "state_input", state))
        out = fn(state, hidden_states, dt, A, B, C, D, **kw)

        def written(new: torch.Tensor) -> torch.Tensor:  # the cache continues from `new`; the token reads it
            state.copy_(new.to(state.dtype))
            y = ssd.read_state(C, new, hidden_states, D[:, 0] if D is not None and D.dim() == 2 else D)
            z = kw.get("z")
            return (y * F.silu(z.float()) if z is not None else y).to(out.dtype)
        fixed, made = serve_factors(self, step, lambda: step_factors(hidden_states, dt, B, kw))
        if fixed is not None:
            assert made is not None
            out = written(state.float() + step_change(made, fixed))
        self._step_reduced(state, step)
        if self.wants("states"):
            self.serve("states", state.float().unsqueeze(1).clone(), step)
        for name in self._names_at("state_after", step, 0):
            served = state.float().clone()
            new = self._serve_rows(name, served, step)
            if new is not served:
                out = written(new)
        if self.wants("states_as_run"):  # its one token's state as it ran: after the writes above
            self.serve("states_as_run", state.float().unsqueeze(1).clone(), step)
        served = state.float().clone()
        new = self.serve("state_output", served, step)
        if new is not served:
            state.copy_(self._checked(new, tuple(state.shape), "state_output", state))
        return out

    def _step_reduced(self, state: torch.Tensor, step: int) -> None:
        """Reductions of a decode step's `states`: its one token's state, `[b, 1, h, P, N]`."""
        while True:
            names = _waiting(self, step)
            if not names:
                return
            pending = _pending(self)
            for n in names:
                stream = pending.pop(n.split(".", 1)[1]).stream(state.shape[0], 1)
                for r in range(state.shape[0]):
                    stream.add(r, 0, state[r:r + 1].float())
                self.serve(n, stream.result(), step)

    # -- serving -------------------------------------------------------------------

    def _serve_rows(self, name: str, state: torch.Tensor, step: int) -> torch.Tensor:
        """Serve `state_after` request `name` its invoke's rows of `state`: `state` itself if nothing was
        written, else a new tensor holding the written rows."""
        b = state.shape[0]
        invokes = _invokes(self, b)
        rows = invokes.get(int(name.rsplit("@", 1)[1])) if "@" in name and invokes is not None else None
        if rows is None or rows == list(range(b)):
            new = self.serve(name, state, step)
            return state if new is state else self._checked(new, tuple(state.shape), "state_after", state)
        part = state[rows]
        new = self.serve(name, part, step)
        if new is part:
            return state
        out = state.clone()
        out[rows] = self._checked(new, tuple(part.shape), "state_after", part)
        return out

    def _state_input(self, initial: torch.Tensor | None, x: torch.Tensor, step: int) -> torch.Tensor | None:
        """`state_input`: a copy of the state the call starts from (zeros where a write waits on a fresh prompt)."""
        served = initial.clone() if initial is not None else None
        if served is None and self._writes("state_input"):
            d = self.dims
            served = torch.zeros((x.shape[0], d["heads"], d["head_dim"], d["d_state"]), dtype=torch.float32,
                                 device=x.device)
        new = self.serve("state_input", served, step)
        if new is not served:
            shape = (x.shape[0], self.dims["heads"], self.dims["head_dim"], self.dims["d_state"])
            return self._checked(new, shape, "state_input", x)
        return initial if initial is not None else served

    def _per_token_input(self, name: str, value: torch.Tensor, step: int, like: torch.Tensor | None = None,
                         serve: bool = True) -> torch.Tensor:
        """Serve a per-token value of the scan call; a write must keep its shape (a state's heads broadcast)."""
        new = self.serve(name, value, step) if serve else value
        if new is value and serve:
            return value
        like = value if like is None else like
        return self._checked(new, tuple(like.shape), name, like)

    def _checked(self, new: Any, shape: tuple[int, ...], name: str, like: torch.Tensor) -> torch.Tensor:
        if not isinstance(new, torch.Tensor):
            raise DeltaValueError(f"L{self.layer}.{name}: a write must be a tensor, got {type(new).__name__}")
        if tuple(new.shape) != shape:
            if tuple(new.shape) == shape[1:]:
                new = new.unsqueeze(0).expand(shape)
            else:
                raise DeltaValueError(f"L{self.layer}.{name}: a write of shape {list(new.shape)} does not fit "
                                      f"{list(shape)}")
        if not new.is_floating_point():
            raise DeltaValueError(f"L{self.layer}.{name}: a write must be floating point, got {new.dtype}")
        return new.to(device=like.device, dtype=like.dtype)
