"""Reads of `state_after(t)` served beside the forward's kernel call: `read_only`, `Forward`, `serve_reads`.

Invariant: a read never changes the forward. The delta-rule call runs once over the whole prompt and every
row, as it runs without the trace (never in pieces: on some CPUs a piece's bits differ from the same tokens in
the whole call, the kernel's matrix products laid out by its number of chunks), and the state after t comes from
the same kernel over the prefix (what transformers' cache after t+1 tokens holds), independent of other reads;
requests at one position share one side call. A worker that writes what it was served (`*= 0.5`) splits its own
rows there: token t reads the written state and they run on from it, the others keep the forward's outputs.
`read_only(call)`; `serve_reads(call, forward, step)` returns the head outputs, the final state and each row
group's segments `(start, end, state at start)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from nnsight.intervention.interleaver import Event

from .. import deltarule, kernels
from .rows import CHUNK, Segments, _invokes

if TYPE_CHECKING:
    from .state import DeltaRuleCall

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v, g, beta
SideCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"],
                    torch.Tensor]  # (q, k, v, g, beta, start) -> the final state


def read_only(call: DeltaRuleCall) -> bool:
    """Whether no write of a `state_after` position waits (the engine's direct writes included)."""
    if any(kind == "state_after" for kind, _ in call.direct):
        return False
    prefix = call.path + ".state_after."
    for m in call._mediators():
        p = m.pending
        if p is not None and p.event is Event.SWAP and p.provider and p.provider.startswith(prefix):
            return False
    return True


def _run(fn: Callable[..., Any], inputs: Inputs, rows: list[int], a: int, e: int,
         state: torch.Tensor | None, l2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over rows' tokens [a, e) from `state` (None: zeros): outputs and the final state."""
    b = inputs[0].shape[0]
    idx: Any = slice(None) if rows == list(range(b)) else rows
    q, k, v, g, beta = (x[idx, a:e] for x in inputs)
    return fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=l2)


class _Rows:
    """Each row's base (where the forward's call for it starts, the state there) and its segments."""

    def __init__(self, b: int, s: int, initial: torch.Tensor | None) -> None:
        self.b, self.s, self.initial = b, s, initial
        self.pos = [0] * b
        self.state: list[torch.Tensor | None] = [None] * b  # None: the call's initial state
        self.spans: list[list[tuple[int, int]]] = [[(0, s)] for _ in range(b)]
        self.starts: list[list[torch.Tensor]] = [[] for _ in range(b)]  # the state at each later span's start

    def start(self, rows: list[int]) -> torch.Tensor | None:
        """The state the rows' forward call starts from (rows of one base position)."""
        if all(self.state[r] is None for r in rows):
            return None if self.initial is None else self.initial[rows]
        like = next(x for x in self.state if x is not None)
        return torch.stack([x if (x := self.state[r]) is not None else
                            torch.zeros_like(like) if self.initial is None else self.initial[r].to(like)
                            for r in rows])

    def by_base(self, rows: list[int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for r in rows:
            out.setdefault(self.pos[r], []).append(r)
        return out

    def write(self, rows: list[int], p: int, new: torch.Tensor) -> None:
        for i, r in enumerate(rows):
            self.pos[r], self.state[r] = p + 1, new[i]
            a, e = self.spans[r][-1]
            if p + 1 < e:
                self.spans[r][-1:] = [(a, p + 1), (p + 1, e)]
                self.starts[r].append(new[i])

    def row_segments(self) -> list[tuple[list[int], Segments]]:
        """The rows grouped by where they were written, with each span's starting state."""
        groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for r in range(self.b):
            groups.setdefault(tuple(self.spans[r]), []).append(r)
        out = []
        for spans, rows in groups.items():
            first = None if self.initial is None else (self.initial if len(rows) == self.b else self.initial[rows])
            segs: Segments = [(spans[0][0], spans[0][1], first)]
            segs += [(a, e, torch.stack([self.starts[r][n] for r in rows])) for n, (a, e) in enumerate(spans[1:])]
            out.append((rows, segs))
        return out


class Forward:
    """The forward's own call over every row and token, run once as it runs without the trace (its bits): `out`
    the head outputs, `state` the final state. Rows written leave it, their outputs after the write and their
    final states replaced."""

    def __init__(self, fn: Callable[..., Any], inputs: Inputs, initial: torch.Tensor | None, l2: bool) -> None:
        self.fn, self.inputs, self.l2, self.initial = fn, inputs, l2, initial
        self.b, self.s = inputs[0].shape[:2]
        self.out, self.state = _run(fn, inputs, list(range(self.b)), 0, self.s, initial, l2)
        self.finals: list[tuple[list[int], torch.Tensor]] = []  # the final states of rows that left

    def put(self, rows: list[int], a: int, out: torch.Tensor) -> None:
        """Rows' head outputs for tokens [a, a + out's length)."""
        idx: Any = slice(None) if len(rows) == self.b else rows
        self.out[idx, a:a + out.shape[1]] = out

    def leave(self, rows: list[int], final: torch.Tensor) -> None:
        """Rows written: `final` is their state after the last token."""
        self.finals.append((rows, final))

    def final_of(self, rows: list[int]) -> torch.Tensor:
        """The state after the last token of rows."""
        return torch.stack([self._final(r) for r in rows])

    def _final(self, r: int) -> torch.Tensor:
        for rows, final in reversed(self.finals):
            if r in rows:
                return final[rows.index(r)]
        return self.state[r]

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The head outputs and the final state of every row."""
        if not self.finals:
            return self.out, self.state
        final = self.state.clone()
        for rows, last in self.finals:
            final[rows] = last.to(final.dtype)
        return self.out, final


def serve_reads(call: DeltaRuleCall, fwd: Forward, step: int
                ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[list[int], Segments]]]:
    """Serve every `state_after` request of this call from the prefix (see the module doc), in position order."""
    inputs, l2 = fwd.inputs, fwd.l2
    query = inputs[0]
    b, s = query.shape[:2]
    invokes, every = _invokes(call, b), list(range(b))
    book = _Rows(b, s, fwd.initial)
    padded, (side, no_ops) = _pads_itself(call, fwd.fn), _side_call(call, fwd.fn, l2)  # decided once per call
    known: dict[tuple[int, int], torch.Tensor] = {}  # (position, row) -> the state after it
    pos = 0
    while pos < s:
        asked = {p: names for p, names in call.positions("state_after", step).items() if p >= pos}
        if not asked:
            break
        p = min(asked)
        wanted = {p: {r for n in names for r in _rows_of(n, invokes, every)} for p, names in asked.items()}
        _prefetch(book, side, inputs, fwd, known, wanted, padded, no_ops)  # every request parked now, together
        for name in call._names_at("state_after", step, p):
            rows = _rows_of(name, invokes, every)
            _prefetch(book, side, inputs, fwd, known, {p: set(rows)}, padded, no_ops)  # a worker's next request
            state = torch.stack([known[p, r] for r in rows])
            new = call.serve(name, state, step)
            if new is not state:  # a write: these rows' forward splits at p
                new = call._checked_state(new, query[rows], "state_after")
                _written(book, fwd, rows, p, new, call)
                for key in [k for k in known if k[1] in rows and k[0] > p]:
                    del known[key]  # computed from the state before the write
                known.update(((p, r), new[i]) for i, r in enumerate(rows))
        pos = p + 1
    out, final = fwd.finish()
    return out, final, book.row_segments()


def _pads_itself(call: DeltaRuleCall, fn: Callable[..., Any]) -> bool:
    """Whether `fn` is a pure-torch kernel, which pads a call to whole chunks with zeros itself (zeros after a
    part then change none of its bits); not a compiled one (FLA's masks the last chunk instead)."""
    fam = call.family
    for name in (fam.chunk_kernel, fam.recurrent_kernel):
        b = kernels.backend(fam, name)
        if fn is b.compiled or (fn is b.fn and not kernels.has_python_source(fn, fam.module_name)):
            return False
    return True


def _prefetch(book: _Rows, side: SideCall, inputs: Inputs, fwd: Forward,
              known: dict[tuple[int, int], torch.Tensor], wanted: dict[int, set[int]], padded: bool,
              no_ops: bool) -> None:
    """The states after the wanted positions not yet known, each row's from its base (where it was written, or
    the call's start): the state after the last token is the forward call's final state; the others come from side calls over each prefix, left-aligned
    (zeros after a part leave its state as it was) and sharing a call where that costs no extra chunk
    (`padded`: the kernel pads to whole chunks itself, so the part's bits are those of its call alone), else
    where their lengths are equal; `no_ops`: the side call is `deltarule.final_state`, where a part's tokens after
    its end are made no-ops in place of zeros (`_masked`)."""
    parts: list[tuple[list[int], int, int]] = []
    for p, rows in sorted(wanted.items()):
        todo = sorted(r for r in rows if (p, r) not in known)
        if p == book.s - 1 and todo:
            known.update(((p, r), x) for r, x in zip(todo, fwd.final_of(todo)))
            continue
        parts += [(group, a, p + 1) for a, group in book.by_base(todo).items()]
    calls: dict[int, list[tuple[list[int], int, int]]] = {}
    for part in parts:
        length = part[2] - part[1]
        calls.setdefault(-(-length // CHUNK) if padded else length, []).append(part)
    for group in calls.values():
        one_base = padded and no_ops and len({a for _, a, _ in group}) == 1
        states = _masked(book, side, inputs, group) if one_base else _left_aligned(book, side, inputs, group)
        n = 0
        for rows, _, e in group:
            known.update(((e - 1, r), states[n + i]) for i, r in enumerate(rows))
            n += len(rows)


def _side_call(call: DeltaRuleCall, fn: Callable[..., Any], l2: bool) -> tuple[SideCall, bool]:
    """The final state of a side call `(q, k, v, g, beta, start) -> state`: behind transformers' own chunked torch
    kernel of the gated delta rule, only its state's half (`deltarule.final_state`, its final state within float32
    rounding); else the kernel itself (FLA's, KDA's, a routed one), its outputs unused; and whether it is the
    state's half. Decided once per forward call."""
    fam, b = call.family, kernels.backend(call.family, call.family.chunk_kernel)
    torch_only = fn is b.reference or (b.compiled is None and fn is b.fn)  # transformers' own torch function
    if not fam.per_channel_decay and torch_only and fn is not b.compiled:
        return lambda q, k, v, g, beta, start: deltarule.final_state(fam, q, k, v, g, beta, start, l2), True
    return (lambda q, k, v, g, beta, start: fn(q, k, v, g=g, beta=beta, initial_state=start, output_final_state=True,
                                               use_qk_l2norm_in_kernel=l2)[1]), False


def _left_aligned(book: _Rows, side: SideCall, inputs: Inputs, parts: list[tuple[list[int], int, int]]
                  ) -> torch.Tensor:
    """One side call over the parts (rows, start, end) stacked, each followed by zeros to the longest:
    the final states, the parts' rows in order."""
    if len(parts) == 1:
        rows, a, e = parts[0]
        b = inputs[0].shape[0]
        idx: Any = slice(None) if rows == list(range(b)) else rows
        q, k, v, g, beta = (x[idx, a:e] for x in inputs)
        return side(q, k, v, g, beta, book.start(rows))
    width = max(e - a for _, a, e in parts)
    stacked = []
    for x in inputs:
        zeros = x.new_zeros((sum(len(r) for r, _, _ in parts), width, *x.shape[2:]))
        n = 0
        for rows, a, e in parts:
            zeros[n:n + len(rows), :e - a] = x[rows, a:e]
            n += len(rows)
        stacked.append(zeros)
    starts = [book.start(rows) for rows, _, _ in parts]
    start = None
    if any(x is not None for x in starts):
        like = next(x for x in starts if x is not None)
        start = torch.cat([x if x is not None else like.new_zeros((len(rows), *like.shape[1:]))
                           for x, (rows, _, _) in zip(starts, parts)])
    q, k, v, g, beta = stacked
    return side(q, k, v, g, beta, start)


def _masked(book: _Rows, side: SideCall, inputs: Inputs, parts: list[tuple[list[int], int, int]]) -> torch.Tensor:
    """One side call over the parts (rows, start, end) of one start, behind a kernel that pads itself: the rows'
    tokens in place up to the longest end, each row's tokens after its own end made no-ops (beta 0: nothing
    written; decay 0: nothing forgotten), which leaves the bits of its state those of the zero-padded prefix (a
    no-op token adds exact zeros), without a copy per part. The final states, the parts' rows in order."""
    rows = [r for group, _, _ in parts for r in group]
    a, width = parts[0][1], max(e for _, _, e in parts) - parts[0][1]
    b = inputs[0].shape[0]
    idx: Any = slice(None) if rows == list(range(b)) else rows
    k, v, g, beta = (x[idx, a:a + width] for x in inputs[1:])  # the query unsliced: the state's half never reads it
    ends = torch.tensor([e - a for group, _, e in parts for _ in group], device=beta.device)
    after = torch.arange(width, device=beta.device)[None, :] >= ends[:, None]  # [rows, width]
    g = g.masked_fill(after.view(*after.shape, *([1] * (g.dim() - 2))), 0)
    beta = beta.masked_fill(after.view(*after.shape, *([1] * (beta.dim() - 2))), 0)
    return side(inputs[0], k, v, g, beta, book.start(rows))


def _rows_of(name: str, invokes: dict[int, list[int]] | None, every: list[int]) -> list[int]:
    """The rows a request is served: its invoke's (then the worker gets them as they are), else every row."""
    if "@" in name and invokes is not None:
        rows = invokes.get(int(name.rsplit("@", 1)[1]))
        if rows is not None:
            return rows
    return every


def _written(book: _Rows, fwd: Forward, rows: list[int], p: int, new: torch.Tensor, call: DeltaRuleCall) -> None:
    """Rows whose state after p a worker replaced: their outputs before p are the forward's, token p reads the
    written state, the kernel runs on from p+1 from it."""
    inputs, fn, l2 = fwd.inputs, fwd.fn, fwd.l2
    read = kernels.read_state(call.family, inputs[0][rows, p], new, inputs[2].shape[2], l2)
    fwd.put(rows, p, read[:, None].to(fwd.out.dtype))
    if p + 1 < book.s:
        tail, last = _run(fn, inputs, rows, p + 1, book.s, new, l2)
        fwd.put(rows, p + 1, tail)
    else:
        last = new
    fwd.leave(rows, last)
    book.write(rows, p, new)
