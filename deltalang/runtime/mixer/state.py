"""One delta-rule call of a mixer: reads served beside it, the call split where a write waits.

The kernel's inputs are the queries, keys, values, decays and betas, its initial state `state_input`, its
outputs the head outputs and `state_output`. A trace that only reads runs the call unchanged (the same
logits bit for bit): `states` from the chunked rule (`deltarule`) beside it, `state_after(t)` from the
kernel over the prefix (`reads`: the forward's call run whole, a read then written splitting its rows there).
Where a worker waits to write, the call is split lazily: run to the first parked position, serve (and maybe
replace) the state, look again, continue with `initial_state`.
Every segment is one call of the kernel `kernels` chose for the device; a packed call is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from deltalang.ground.errors import DeltaValueError

from .. import kernels
from .reads import Forward, read_only, serve_reads
from .reduced import serve_reduced
from .requests import Requests
from .rows import split_by_rows
from .writes import delta_factors, run_written, serve_factors

if TYPE_CHECKING:
    from deltalang.models.families import Family


def _aligned(x: torch.Tensor, parts: list[tuple[list[int], int, int]], width: int) -> torch.Tensor:
    """Each part's rows at its positions [a, e), right-aligned to `width` behind zeros (neutral tokens: a zero
    key, value, beta and log decay leave the state as it was), the parts stacked: `[rows, width, ...]`."""
    if all(e - a == width for _, a, e in parts):
        return torch.cat([x[rows, a:e] for rows, a, e in parts])
    out = x.new_zeros((sum(len(rows) for rows, _, _ in parts), width, *x.shape[2:]))
    n = 0
    for rows, a, e in parts:
        out[n:n + len(rows), width - (e - a):] = x[rows, a:e]
        n += len(rows)
    return out


class DeltaRuleCall(Requests):
    """The kernel side of `MixerSite`: one delta-rule call, serving every value asked of it."""

    family: "Family"
    dims: dict[str, int]

    def kernel(self, fn: Callable[..., Any], decode: bool, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, g: torch.Tensor | None = None, beta: torch.Tensor | None = None,
               **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one delta-rule call, serving every value workers wait on."""
        step = self.step()
        kw.pop("chunk_size", None)
        initial = kw.pop("initial_state", None)
        want_final = bool(kw.pop("output_final_state", False))
        l2 = bool(kw.pop("use_qk_l2norm_in_kernel", False))
        packed = kw.pop("cu_seqlens", None)
        if kw.pop("cu_seq_lens_q", None) is not None or packed is not None:  # never merge packed sequences
            raise DeltaValueError(
                f"L{self.layer}: packed sequences (cu_seqlens) are run, not served: a trace that reads or "
                f"writes a DeltaNet value needs them as a padded batch (one row per sequence)")
        query = self.serve("attention_queries", query, step)
        key = self.serve("attention_keys", key, step)
        value = self.serve("attention_values", value, step)
        g = self.serve("decays", g, step)
        beta = self.serve("betas", beta, step)
        self._check_shapes(query, key, value, g, beta)
        served_in = initial.clone() if initial is not None else None
        if served_in is None and self._writes("state_input"):
            served_in = torch.zeros(self._state_shape(value), dtype=torch.float32, device=value.device)
        new_in = self.serve("state_input", served_in, step)
        if new_in is not served_in:
            initial = self._checked_state(new_in, value, "state_input")
        elif served_in is not None and initial is None:
            initial = served_in
        fixed = serve_factors(self, step, lambda: delta_factors(self.family, key, value, g, beta, initial, l2))[0]

        def run(a: int, b: int, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            out, final = fn(query[:, a:b], key[:, a:b], value[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=l2)
            return out, final

        s = query.shape[1]
        serve_reduced(self, step, query, key, value, g, beta, initial, l2)  # reductions of `states`, beside it
        if fixed is not None:  # tokens' writes written: the rule with those fixed (`writes`)
            self._serve_states(step, (query, key, value, g, beta), initial, l2, None)
            out, state = run_written(self, step, (query, key, value, g, beta), initial, l2, fixed)
        elif read_only(self):  # the unchanged call, whole; the states asked for beside it
            forward = Forward(fn, (query, key, value, g, beta), initial, l2)
            if self.wants("states"):  # served before any write: the last is the whole call's final state
                self._serve_states(step, (query, key, value, g, beta), initial, l2, forward.state)
            out, state, self.row_segments = serve_reads(self, forward, step)
        else:
            self._serve_states(step, (query, key, value, g, beta), initial, l2, None)
            out, state = self._split_writes(fn, run, s, initial, step, (query, key, value, g, beta), l2)
        if fixed is None and self.wants("states_as_run"):
            self.serve("states_as_run", self._as_run(query, key, value, g, beta, l2), step)
        out = self.serve("attention_head_outputs", out, step)
        final = self.serve("state_output", state, step)
        if final is not state:
            final = self._checked_state(final, value, "state_output")
        return out, (final if want_final else None)

    def _serve_states(self, step: int, inputs: tuple[torch.Tensor, ...], initial: torch.Tensor | None, l2: bool,
                      final: torch.Tensor | None) -> None:
        """`states`, from the chunked rule beside the forward's call (which is the same with or without it);
        the last is the call's own final state where it ran unchanged (`final`)."""
        if self.wants("states"):
            states = kernels.per_token(self.family, *inputs, initial, l2)[1]
            if final is not None:
                states[:, -1] = final
            self.serve("states", states, step)  # read-only: a write is refused on the user side

    def _split_writes(self, fn: Callable[..., Any], run: Callable[..., tuple[torch.Tensor, torch.Tensor]], s: int,
                      initial: torch.Tensor | None, step: int, inputs: tuple[torch.Tensor, ...], l2: bool
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """A write waits: the call split at the asked positions (by row groups where rows ask apart)."""
        query, key, value, g, beta = inputs

        def run_aligned(parts: list[tuple[list[int], int, int]], states: list[torch.Tensor | None]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
            width = max(e - a for _, a, e in parts)
            args = [_aligned(x, parts, width) for x in (query, key, value, g, beta)]
            start = None if all(x is None for x in states) else torch.cat([
                x if x is not None else torch.zeros(len(rows), *self._state_shape(value)[1:], dtype=torch.float32,
                                                    device=value.device) for x, (rows, _, _) in zip(states, parts)])
            return fn(args[0], args[1], args[2], g=args[3], beta=args[4], initial_state=start,
                      output_final_state=True, use_qk_l2norm_in_kernel=l2)

        grouped = split_by_rows(self, run_aligned, s, initial, step, query, l2)  # rows asking apart
        if grouped is not None:
            self.row_segments = grouped[2]
            return grouped[0], grouped[1]
        pieces, state = self._split(run, s, initial, step, query, l2)
        self.row_segments = [(list(range(query.shape[0])), self.segments)]
        return (torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]), state

    def _as_run(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, l2: bool) -> torch.Tensor:
        """The state after every token of the forward as it ran, the writes at positions applied."""
        as_run = None
        for rows, segments in self.row_segments:
            parts = [kernels.per_token(self.family, query[rows, a:b], key[rows, a:b], value[rows, a:b],
                                       g[rows, a:b], beta[rows, a:b], start, l2)[1] for a, b, start in segments]
            part = torch.cat(parts, dim=1)
            for (_, end, _), (_, _, start) in zip(segments, segments[1:]):
                part[:, end - 1] = start  # a segment ends at a split position: the state there as written
            as_run = part.new_empty((query.shape[0], *part.shape[1:])) if as_run is None else as_run
            as_run[rows] = part
        assert as_run is not None
        return as_run

    def _split(self, run: Callable[..., tuple[torch.Tensor, torch.Tensor]], s: int,
               initial: torch.Tensor | None, step: int, query: torch.Tensor,
               l2: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Run [0, s) in segments ending at each asked-for position, serving the state there."""
        pieces: list[torch.Tensor] = []
        pos, state = 0, initial
        self.segments: list[tuple[int, int, torch.Tensor | None]] = []
        while True:
            asked = self.positions("state_after", step)
            later = sorted(p for p in asked if p >= pos)
            if not later:
                self.segments.append((pos, s, state))
                out, state = run(pos, s, state)
                pieces.append(out)
                return pieces, state
            p = later[0]
            self.segments.append((pos, p + 1, state))
            out, state = run(pos, p + 1, state)
            for name in self._names_at("state_after", step, p):
                new = self.serve(name, state, step)
                if new is not state:
                    state = self._checked_state(new, query, "state_after")
                    # token p reads the state it has just written
                    out = out.clone()
                    out[:, -1] = kernels.read_state(self.family, query[:, p], state, out.shape[2], l2)
            pieces.append(out)
            pos = p + 1
            if pos >= s:
                return pieces, state

    def _state_shape(self, value: torch.Tensor) -> tuple[int, ...]:
        return (value.shape[0], self.dims["heads"], self.dims["key_dim"], self.dims["value_dim"])

    def _checked_state(self, new: Any, like: torch.Tensor, name: str) -> torch.Tensor:
        shape = self._state_shape(like)
        if not isinstance(new, torch.Tensor):
            raise DeltaValueError(f"L{self.layer}.{name}: a write must be a tensor, got {type(new).__name__}")
        if tuple(new.shape) != shape:
            if new.dim() == 3 and tuple(new.shape) == shape[1:]:
                new = new.unsqueeze(0).expand(shape)
            else:
                raise DeltaValueError(
                    f"L{self.layer}.{name}: a write of shape {list(new.shape)} does not fit {list(shape)} "
                    f"[batch, heads, key_dim, value_dim]")
        if not new.is_floating_point():
            raise DeltaValueError(f"L{self.layer}.{name}: a write must be floating point, got {new.dtype}")
        return new.to(device=like.device, dtype=torch.float32)

    def _check_shapes(self, *tensors: Any) -> None:
        names = ("attention_queries", "attention_keys", "attention_values", "decays", "betas")
        b, s = tensors[0].shape[:2]
        for name, t in zip(names, tensors):
            if not isinstance(t, torch.Tensor) or tuple(t.shape[:2]) != (b, s):
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise DeltaValueError(f"L{self.layer}.{name}: a write of shape {got} does not fit [batch={b}, seq={s}, ...]")
