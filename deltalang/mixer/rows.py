"""Rows of one delta-rule call that ask for different positions, split apart: `split_by_rows`.

`DeltaRuleCall._split` runs the whole batch in segments ending at every asked
position. When the invokes sharing a forward ask for different positions (the
records of a dataset, each at its own subject, left-padded to one length), every
row would be cut at every row's positions: the chunked kernel's work grows with
the number of distinct positions. Here the rows are grouped by the positions
their invokes ask for, and each group runs its own segments on its own rows, so
each row is cut only where it asks. The values are the same: a row's segments
are the kernel over the same tokens from the same states.

The workers of an invoke see full-batch tensors, as always: a state served at a
group's position is the full batch's shape with the group's rows filled in (the
other rows' workers wait on other positions and never read it), and what a
worker writes back is taken from the group's rows. The groups of one call share
that full-batch buffer (one per k-th state a group is served), each filling its
own rows: a saved state is a view of it, so a buffer per group would keep
groups x batch states alive per block (at 32 records of a 0.8B-shaped model,
18 GiB) where one keeps the batch's.

Contract: `split_by_rows(call, run_rows, s, initial, step, query, l2)` returns the
head outputs and final states of the whole batch and each group's rows with its
segments `(start, end, state at start)` (for `states_as_run`), or None when the rows
cannot or need not be told apart (one group; a request for every row; a direct
write); then the caller runs `_split` as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from .. import kernels
from .requests import DIRECT

if TYPE_CHECKING:
    from .state import DeltaRuleCall

RunRows = Callable[[list[int], int, int, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]]


def _invokes(call: DeltaRuleCall, b: int) -> dict[int, list[int]] | None:
    """Each invoke's first row -> its rows; None if some worker spans the whole batch."""
    out: dict[int, list[int]] = {}
    for m in call._mediators():
        group = m.batch_group
        if group is None:
            return None
        start, size = int(group[0]), int(group[1])
        out[start] = list(range(start, start + size))
    return out if out else None


def row_groups(call: DeltaRuleCall, step: int, b: int) -> list[list[int]] | None:
    """Rows grouped by the positions their invokes ask for now; None when that gives one group."""
    if call.direct or b < 2:
        return None
    invokes = _invokes(call, b)
    if invokes is None:
        return None
    asked: dict[int, set[int]] = {start: set() for start in invokes}
    for p, names in call.positions("state_after", step).items():
        for name in names:
            if "@" not in name or name.endswith(DIRECT):
                return None  # a request for every row
            start = int(name.rsplit("@", 1)[1])
            if start not in asked:
                return None
            asked[start].add(p)
    by_key: dict[frozenset[int], list[int]] = {}
    for start, positions in asked.items():
        by_key.setdefault(frozenset(positions), []).extend(invokes[start])
    covered = sorted(r for rows in by_key.values() for r in rows)
    if len(by_key) < 2 or covered != list(range(b)):
        return None
    return [sorted(rows) for rows in by_key.values()]


Segments = list[tuple[int, int, "torch.Tensor | None"]]


def split_by_rows(call: DeltaRuleCall, run_rows: RunRows, s: int, initial: torch.Tensor | None, step: int,
                  query: torch.Tensor, l2: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[list[int], Segments]]] | None:
    """Each group of rows in its own segments (see the module doc); None: use the whole-batch split."""
    b = query.shape[0]
    groups = row_groups(call, step, b)
    if groups is None:
        return None
    outs: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    segments: list[tuple[list[int], Segments]] = []
    shared: dict[int, torch.Tensor] = {}  # k -> the full-batch buffer of every group's k-th served state
    for rows in groups:
        segs: Segments = []
        out, final = _split_rows(call, run_rows, rows, s, initial, step, query, l2, segs, shared)
        outs.append((rows, out, final))
        segments.append((rows, segs))
    _, out0, final0 = outs[0]
    out = out0.new_empty((b, *out0.shape[1:]))
    final = final0.new_empty((b, *final0.shape[1:]))
    for rows, o, f in outs:
        out[rows] = o
        final[rows] = f
    return out, final, segments


def _split_rows(call: DeltaRuleCall, run_rows: RunRows, rows: list[int], s: int, initial: torch.Tensor | None,
                step: int, query: torch.Tensor, l2: bool, segments: Segments,
                shared: dict[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`_split` on `rows` only: segments end at the positions these rows' invokes ask for (recorded); the
    k-th state served is served in `shared[k]` (made at first use), these rows filled in."""
    starts = {str(r) for r in rows}
    pieces: list[torch.Tensor] = []
    pos = 0
    state = None if initial is None else initial[rows]
    k = 0  # states served so far: a saved state is a view of its buffer, so each has its own
    while True:
        asked = {p for p, names in call.positions("state_after", step).items()
                 if any(n.rsplit("@", 1)[-1] in starts for n in names)}
        later = sorted(p for p in asked if p >= pos)
        end = later[0] + 1 if later else s
        segments.append((pos, end, state))
        out, state = run_rows(rows, pos, end, state)
        if later:
            p = later[0]
            for name in call._names_at("state_after", step, p):
                if name.rsplit("@", 1)[-1] not in starts:
                    continue
                full = _widen(state, rows, query.shape[0], shared, k)
                k += 1
                new = call.serve(name, full, step)
                if new is not full:
                    state = call._checked_state(new, query, "state_after")[rows]
                    out = out.clone()  # token p reads the state it has just written
                    out[:, -1] = kernels.read_state(call.family, query[rows, p], state, out.shape[2], l2)
        pieces.append(out)
        pos = end
        if pos >= s:
            return (torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]), state


def _widen(state: torch.Tensor, rows: list[int], b: int, shared: dict[int, torch.Tensor], k: int) -> torch.Tensor:
    """The full-batch buffer of the groups' k-th served state with `state` at `rows` (other groups' states
    or zeros elsewhere: no other row's worker reads them)."""
    if k not in shared or shared[k].dtype != state.dtype:
        shared[k] = state.new_zeros((b, *state.shape[1:]))
    full = shared[k]
    full[rows] = state
    return full
