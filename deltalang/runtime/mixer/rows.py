"""Rows of one delta-rule call that ask for different positions, split apart: `split_by_rows`.

Rows are grouped by the positions they ask for (a trace's invokes, requests named `...@FIRST_ROW`; or the
engine's direct writes); each group is cut only where it asks, and the groups advance in rounds, the
segments of a round taking the same number of chunks sharing one kernel call, right-aligned behind
neutral tokens (their outputs dropped, the state unchanged through them). Values equal each row's own to
float noise. An invoke's worker is served its own rows' state; the engine's direct writes one shared
full-batch buffer. `split_by_rows(call, run_aligned, s, initial, step, query, l2)` returns the batch's
head outputs and final states and each group's rows and segments `(start, end, state at start)`, or None
where one split serves (the caller runs `_split`). `run_aligned(parts, states)` runs one kernel call over
`parts` (rows, start, end) right-aligned to the longest. Why rounds and own rows: ARCHITECTURE.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Mapping

import attrs
import torch

from .. import kernels
from .requests import DIRECT

if TYPE_CHECKING:
    from .state import DeltaRuleCall

Part = tuple[list[int], int, int]  # rows, start, end
CHUNK = 64  # tokens per chunk of the chunked kernels (transformers' torch reference and FLA's)
RunAligned = Callable[[list[Part], list["torch.Tensor | None"]], tuple[torch.Tensor, torch.Tensor]]
Segments = list[tuple[int, int, "torch.Tensor | None"]]


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


@attrs.define
class Group:
    """Rows cut at the same positions: where they are, their state there, what they have run."""

    rows: list[int]
    starts: frozenset[str] | None  # the invokes' first rows (as in request names); None: direct writes
    written: frozenset[int] = frozenset()  # direct writes: the positions these rows write the state at
    members: dict[str, list[int]] = attrs.Factory(dict)  # an invoke's first row -> its rows' indices in `rows`
    pos: int = 0
    state: torch.Tensor | None = None
    served: int = 0  # states served so far (the k of the shared buffers)
    segments: Segments = attrs.Factory(list)

    def index(self) -> list[int] | slice:
        """The rows as an index: a slice when they are consecutive (a view, no gather)."""
        r = self.rows
        return slice(r[0], r[-1] + 1) if r == list(range(r[0], r[-1] + 1)) else r

    def asks(self, p: int, name: str) -> bool:
        """Whether the request `name` at position p is one of this group's."""
        if self.starts is None:
            return name.endswith(DIRECT) and p in self.written
        return "@" in name and not name.endswith(DIRECT) and name.rsplit("@", 1)[1] in self.starts

    def next_position(self, asked: Mapping[int, list[str]]) -> int | None:
        """The first position at or after `pos` this group asks for (None: none left); `asked`: the call's
        requests by position."""
        later = [p for p, names in asked.items() if p >= self.pos and any(self.asks(p, n) for n in names)]
        return min(later) if later else None


def row_groups(call: DeltaRuleCall, step: int, b: int) -> list[Group] | None:
    """Rows grouped by the positions they ask for now; None when that gives one group."""
    if b < 2:
        return None
    if call.direct:  # the engine's writes, without a trace (with one, the whole-batch split serves both)
        il = call.interleaver
        return None if il is not None and il.interleaving else _direct_groups(call, b)
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
        by_key.setdefault(frozenset(positions), []).append(start)
    covered = sorted(r for starts in by_key.values() for s in starts for r in invokes[s])
    if len(by_key) < 2 or covered != list(range(b)):
        return None
    groups = []
    for starts in by_key.values():
        rows = sorted(r for s in starts for r in invokes[s])
        at = {r: i for i, r in enumerate(rows)}
        groups.append(Group(rows, frozenset(str(s) for s in starts),
                            members={str(s): [at[r] for r in invokes[s]] for s in starts}))
    return groups


def _direct_groups(call: DeltaRuleCall, b: int) -> list[Group] | None:
    """The rows of the engine's direct writes, grouped by the positions they write the state at."""
    where: dict[int, set[int]] = {r: set() for r in range(b)}
    for (kind, pos), (rows, _) in call.direct.items():
        if kind == "state_after":
            for r in rows.tolist():
                where[int(r)].add(pos)
    by_key: dict[frozenset[int], list[int]] = {}
    for r, positions in where.items():
        by_key.setdefault(frozenset(positions), []).append(r)
    if len(by_key) < 2:
        return None
    return [Group(rows, None, positions) for positions, rows in by_key.items()]


def split_by_rows(call: DeltaRuleCall, run_aligned: RunAligned, s: int, initial: torch.Tensor | None, step: int,
                  query: torch.Tensor, l2: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[list[int], Segments]]] | None:
    """The groups in rounds of one aligned kernel call each (see the module doc); None: the whole-batch split."""
    b = query.shape[0]
    groups = row_groups(call, step, b)
    if groups is None:
        return None
    for g in groups:
        g.state = None if initial is None else initial[g.rows]
    shared: dict[int, torch.Tensor] = {}  # k -> the full-batch buffer of every group's k-th served state
    outs: list[torch.Tensor] = []  # the whole batch's head outputs, each round's pieces written in place
    while True:
        asked = call.positions("state_after", step)  # once a round: serving a state may add requests
        ends = {id(g): g.next_position(asked) for g in groups if g.pos < s}
        asking = [g for g in groups if ends.get(id(g)) is not None]
        last = not asking
        todo = [g for g in groups if g.pos < s] if last else asking
        if not todo:
            break
        stops = {id(g): s if last else int(ends[id(g)]) + 1 for g in todo}  # type: ignore[arg-type]
        _round(call, run_aligned, todo, stops, step, query, l2, shared, outs, serve=not last)
        if last:
            break
    final = groups[0].state
    assert final is not None
    final_all = final.new_empty((b, *final.shape[1:]))
    for g in groups:
        final_all[g.index()] = g.state  # type: ignore[assignment]
    return outs[0], final_all, [(g.rows, g.segments) for g in groups]


def _round(call: DeltaRuleCall, run_aligned: RunAligned, todo: list[Group], stops: dict[int, int], step: int,
           query: torch.Tensor, l2: bool, shared: dict[int, torch.Tensor], outs: list[torch.Tensor],
           serve: bool) -> None:
    """Each group in `todo` from its position to its stop, in as few kernel calls as cost no extra chunk,
    its head outputs written into the batch's (`outs[0]`, made on first use); with `serve`, states served
    at the stops (the last round runs to the end: nothing is asked there)."""
    parts = [(g.rows, g.pos, stops[id(g)]) for g in todo]
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for members in _calls(parts):
        out, final = run_aligned([parts[n] for n in members], [todo[n].state for n in members])
        first = 0
        for n in members:
            rows, a, e = parts[n]
            results[n] = out[first:first + len(rows), out.shape[1] - (e - a):], final[first:first + len(rows)]
            first += len(rows)
    for n, g in enumerate(todo):
        (rows, a, e), (piece, state) = parts[n], results[n]
        g.segments.append((a, e, g.state))
        p = e - 1
        changed: list[int] = []  # indices into g.rows whose state a worker replaced at p
        for name in (_names(call, g, step, p) if serve else ()):
            state = _serve(call, g, name, state, query, shared, changed, step)
        if changed:
            piece = piece.clone()  # token p reads the state it has just written
            mine = [g.rows[i] for i in changed]
            piece[changed, -1] = kernels.read_state(call.family, query[mine, p], state[changed], piece.shape[2], l2)
        if not outs:
            outs.append(piece.new_empty((query.shape[0], query.shape[1], *piece.shape[2:])))
        outs[0][g.index(), a:e] = piece
        g.state, g.pos = state, e


def _calls(parts: list[Part]) -> list[list[int]]:
    """The parts (by index) grouped into kernel calls: a chunked kernel pays whole chunks of `CHUNK` tokens per
    row, so parts share a call (right-aligned to the longest) only when that gives none of them a chunk more."""
    order = sorted(range(len(parts)), key=lambda n: -(parts[n][2] - parts[n][1]))
    calls: list[list[int]] = []
    for n in order:
        length = parts[n][2] - parts[n][1]
        if calls and -(-(parts[calls[-1][0]][2] - parts[calls[-1][0]][1]) // CHUNK) == -(-length // CHUNK):
            calls[-1].append(n)
        else:
            calls.append([n])
    return calls


def _serve(call: DeltaRuleCall, g: Group, name: str, state: torch.Tensor, query: torch.Tensor,
           shared: dict[int, torch.Tensor], changed: list[int], step: int) -> torch.Tensor:
    """Serve the request `name` of `g` its state; the group's state after the worker's write (a new tensor:
    one the worker may keep is never changed in place), the rows it replaced added to `changed`.

    An invoke's worker gets its own rows, not the batch's: a tensor whose first dimension is not the
    batch's passes through nnsight's batching as it is, so a write costs no copy of the whole batch.
    The engine's direct writes index the batch's rows: they get the full-batch buffer (`_widen`)."""
    b = query.shape[0]
    if g.starts is None:
        full = _widen(state, g.rows, b, shared, g.served)
        g.served += 1
        new = call.serve(name, full, step)
        if new is full:
            return state
        changed[:] = range(len(g.rows))
        return call._checked_state(new, query, "state_after")[g.rows]
    idx = g.members[name.rsplit("@", 1)[1]]
    whole = len(idx) == len(g.rows)
    served = state if whole else state[idx]
    new = call.serve(name, served, step)
    if new is served:
        return state
    new = call._checked_state(new, query[[g.rows[i] for i in idx]], "state_after")
    changed.extend(i for i in idx if i not in changed)
    if whole:
        return new
    state = state.clone()
    state[idx] = new
    return state


def _names(call: DeltaRuleCall, g: Group, step: int, p: int) -> Iterator[str]:
    """The requests of `g` at position p, including those its served workers make next."""
    for name in call._names_at("state_after", step, p):
        if g.asks(p, name):
            yield name


def _widen(state: torch.Tensor, rows: list[int], b: int, shared: dict[int, torch.Tensor], k: int) -> torch.Tensor:
    """The full-batch buffer of the groups' k-th served state with `state` at `rows` (other groups' states
    or zeros elsewhere: no other row's worker reads them)."""
    if k not in shared or shared[k].dtype != state.dtype:
        shared[k] = state.new_zeros((b, *state.shape[1:]))
    full = shared[k]
    full[rows] = state
    return full
