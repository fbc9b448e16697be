"""nnsight scheduling for a mixer's values: which workers wait on what, serving them, asked positions.

A value is an nnsight location `"{mixer path}.{value}"` (`"{mixer path}.state_after.{t}"`, `"...@{row}"`
for an invoke's rows, `"...!direct"` for the sweep engine's writes without a trace). `Requests`, part of
`MixerSite`, says whether anything waits on this mixer (`active`), this call's generation step (`step`:
the location's visit count; 0 is the prompt, k the k-th new token), hands a value to its workers
(`serve`) and lists the positions they wait on (`positions`).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch
from nnsight.intervention.interleaver import Event, Interleaver, Mediator

from deltalang.ground.errors import DeltaValueError
from deltalang.models import values

DIRECT = "!direct"  # names of positions written through `MixerSite.direct`, without a trace
# the values this package serves from inside the kernel call (the others are nnsight's own)
SERVED = frozenset(name for name, v in values.CATALOGUE.items() if v.kernel) | {"states_as_run", "states_reduced"}
_POSITION = re.compile(r"\.(state_after|conv_window_after)\.(-?\d+)(?:@(\d+))?$")


class Requests:
    """What the running trace asks of one mixer (a part of `MixerSite`, which sets these attributes)."""

    layer: int
    interleaver: Interleaver | None  # the wrapper the running call serves (None between calls)
    path: str  # the mixer's envoy path in that wrapper
    pads: list[int] | None  # per row, left padding of this call
    seq_len: int
    direct: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]

    def active(self) -> bool:
        """Whether some worker of the running trace waits on one of this mixer's values."""
        if self.direct:
            return True
        il = self.interleaver
        if il is None or not il.interleaving or not il.parked:
            return False
        prefix = self.path + "."
        n = len(prefix)
        return any(p.startswith(prefix) and p[n:].split(".", 1)[0].split("@", 1)[0] in SERVED for p in il.parked)

    def _mediators(self) -> list[Mediator]:
        return [] if self.interleaver is None else self.interleaver.mediators

    def step(self) -> int:
        """Which call of this mixer in the running trace this is: the generation step."""
        loc = self.path + ".input"
        il = self.interleaver
        if il is None or not il.interleaving:
            return 0
        for m in self._mediators():
            return il.counts.get(loc, 0) - m.counts_at_start.get(loc, 0) - 1
        return 0

    def _parked_on(self, loc: str) -> list[Mediator]:
        return [m for m in self._mediators() if m.pending is not None and m.pending.provider == loc]

    def serve(self, name: str, value: Any, step: int) -> Any:
        """Hand `value` to the workers waiting on this mixer's `name` at `step`; return it, maybe replaced."""
        if name.endswith(DIRECT):
            return self._apply_direct(name, value)
        il = self.interleaver
        loc = f"{self.path}.{name}"
        if il is None or loc not in il.parked:
            return value
        waiting = self._parked_on(loc)
        if not waiting:
            return value
        il.counts[loc] = waiting[0].counts_at_start.get(loc, 0) + step
        return il.handle(loc, value)

    def wants(self, name: str) -> bool:
        il = self.interleaver
        return il is not None and f"{self.path}.{name}" in il.parked

    def positions(self, kind: str, step: int, offset: int = 0) -> dict[int, list[str]]:
        """Absolute positions (in this call's padded rows) that workers wait on for `kind`, with their names."""
        il = self.interleaver
        out: dict[int, list[str]] = {}
        for (k, pos), _ in self.direct.items():
            if k == kind:
                out.setdefault(pos + offset, []).append(f"{kind}.{pos}{DIRECT}")
        if il is None or not il.interleaving:
            return out
        prefix = self.path
        for m in self._mediators():
            p = m.pending
            if p is None or p.provider is None or not p.provider.startswith(prefix):
                continue
            match = _POSITION.search(p.provider)
            if match is None or match.group(1) != kind or p.provider[: match.start()] != prefix:
                continue
            if p.iteration != step:
                continue
            t = int(match.group(2))
            row = int(match.group(3)) if match.group(3) is not None else 0
            pad = self.pads[row] if self.pads else 0
            n = self.seq_len - pad
            pos = t + n if t < 0 else t
            if not 0 <= pos < n:
                raise DeltaValueError(
                    f"L{self.layer}.{kind}({t}): position out of range: this call has {n} token(s)"
                    + (f" at step {step}" if step else ""))
            out.setdefault(pad + pos + offset, []).append(f"{kind}.{match.group(2)}" + (
                f"@{match.group(3)}" if match.group(3) is not None else ""))
        return out

    def _names_at(self, kind: str, step: int, p: int, offset: int = 0) -> Iterator[str]:
        """The requests waiting at position p, including those a served worker makes next."""
        served: set[str] = set()
        while True:
            fresh = [n for n in self.positions(kind, step, offset).get(p, []) if n not in served]
            if not fresh:
                return
            for name in fresh:
                served.add(name)
                yield name

    def _apply_direct(self, name: str, value: torch.Tensor) -> torch.Tensor:
        kind, pos = name[: -len(DIRECT)].rsplit(".", 1)
        rows, new = self.direct[(kind, int(pos))]
        out = value.clone()
        out[rows] = new.to(device=out.device, dtype=out.dtype)
        return out

    def _writes(self, name: str) -> bool:
        loc = f"{self.path}.{name}"
        return any(m.pending.event is Event.SWAP for m in self._parked_on(loc))
