"""Computing cells: the engine (fast path) and the reference (naive) path.

Contract: `run_job` runs the given cells of one sweep and hands each finished
chunk's ResultRows and results to `Context.emit`. The fast path groups cells by
start position, each group sorted by start block, so cells share a forward as
rows: at block i only the rows that start at or before i are computed, and the
work is the sum over cells of (blocks from L) x (positions from t); a few cells
at nearby later starts join an earlier start's forward (`MERGE_WORK`). A sweep the
engine cannot serve (`SweepJob.blocker`, or `Unsupported` found once the model
ran) runs through the naive path: cells batched as invokes of full forwards of
the compiled program. Both lay their forwards out from all the sweep's cells,
so a resumed sweep computes every cell bit for bit as an uninterrupted one.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import attrs
import safetensors.torch
import torch

from deltalang.ground import measures
from deltalang.language.ir import FromRun, Mean, Reduce, ResolvedMeasure, Scale, Zeros
from deltalang.runs.compiled import Experiment
from deltalang.runtime.kernels import routed
from deltalang.runtime.model import DeltaModel

from .errors import Unsupported
from .job import Cell, ResultRow, SweepJob, added_result_name, measure_label, start_of
from .memory import chunks, waves
from .recompute import Capture, Patch, Row, RowsOut, continuation_start, device_of, dtype_of, prefix_reads, run_rows
from .support import dependencies, referenced_runs, subprogram

if TYPE_CHECKING:
    from rich.console import Console


@attrs.define
class Context:
    """What the cells of one run of `run_sweeps` share."""

    exp: Experiment
    support: dict[str, Any]
    emit: Callable[[SweepJob, dict[int, list[ResultRow]], dict[str, Any]], None]
    capture: Callable[..., Capture]  # (model, text, first block, reads) -> the clean capture (`capture_clean`)


# A forward's fixed cost (reading every weight, launching every kernel) in rows x positions of work. On a
# CPU (a 0.8B-shaped model, one row: 1 position 0.33 s, 25 positions 0.87 s) it is about 15 positions of one
# row; 20 refined cells of one block at positions 39..63 of 64 took 8.1 s in 2 forwards at 16, 9.2 s in 3
# at 8, 9.2 s in 1 at 32, and 22 s one forward each. Cells starting at a later position join an earlier
# start's forward while the positions their rows recompute again (clean, before their write) cost less.
MERGE_WORK = 16


def _fast_rows_plan(model: DeltaModel, job: SweepJob, cells: Sequence[Cell]) -> dict[int, list[Cell]]:
    """Cells by the position their forward starts at, each group sorted by start block (then cell order).

    A cell's own start is its earliest write's position (`recompute.continuation_start`: on a Mamba-2
    model one token earlier at the last token); a group of cells joins the forward of an earlier
    start when its rows x the positions between the two starts is at most `MERGE_WORK` (a sparse set of
    cells, e.g. attribution's refined ones, then shares a few forwards instead of one each). A row that
    starts earlier than its write recomputes the clean values up to the write: the same, to float noise."""
    own: dict[int, list[Cell]] = {}
    for cell in cells:
        starts = [start_of(op) for op in job.writes(cell)]
        own.setdefault(continuation_start(model, len(job.run.token_ids), min(p for _, p in starts)), []).append(cell)
    groups: dict[int, list[Cell]] = {}
    first = -1
    for start in sorted(own):
        if groups and len(own[start]) * (start - first) <= MERGE_WORK:
            groups[first].extend(own[start])
        else:
            first = start
            groups[first] = list(own[start])
    for group in groups.values():
        group.sort(key=lambda c: (min(start_of(op)[0] for op in job.writes(c)), c.index))
    return groups


def _capture_reads(model: DeltaModel, job: SweepJob, groups: Mapping[int, Sequence[Cell]]
                   ) -> tuple[int, dict[int, set[tuple[str, int | None]]]]:
    """The first block any cell recomputes, and the values the clean forward must keep per DeltaNet block."""
    reads: dict[int, set[tuple[str, int | None]]] = {}
    first = model.spec.num_layers
    for start, group in groups.items():
        lowest = min(min(start_of(op)[0] for op in job.writes(c)) for c in group)
        first = min(first, lowest)
        for i, asked in prefix_reads(model, lowest, start).items():
            reads.setdefault(i, set()).update(asked)
        for cell in group:
            for op in job.writes(cell):
                if isinstance(op.source, Scale):
                    assert op.layer is not None
                    reads.setdefault(op.layer, set()).add((op.value, op.position))
    for m in job.run.measures:
        if m.kind in ("norm", "project") and m.value == "state_output":
            for cell in job.cells:
                bound = cell.run.measures[job.run.measures.index(m)]
                if bound.layer is not None:
                    reads.setdefault(bound.layer, set()).add(("state_output", None))
    return first, reads


def _patches(ctx: Context, job: SweepJob, cell: Cell, cap: Capture) -> tuple[Patch, ...]:
    """A cell's writes with the tensors they write (no batch axis)."""
    model = ctx.exp.model
    out = []
    for op, key in zip(job.writes(cell), job.donor_keys[cell.index], strict=True):
        assert op.layer is not None and op.position is not None
        like = cap.values.get((op.value, op.layer, op.position))
        src = op.source
        if isinstance(src, Zeros):
            tensor = torch.zeros(_shape(model, op.value), dtype=dtype_of(model, op.value), device=device_of(model))
        elif isinstance(src, Scale):
            assert like is not None
            tensor = like[0] * src.factor
        elif isinstance(src, FromRun):
            tensor = ctx.support[str(key)][0]
        elif isinstance(src, Mean):
            tensor = torch.stack([ctx.support[k] for k in key]).mean(dim=0)[0]
        else:  # pragma: no cover - fast_path_blocker refuses the rest
            raise Unsupported(f"source {src!r}")
        out.append(Patch(op.layer, op.value, op.position, tensor.to(device=device_of(model),
                                                                     dtype=dtype_of(model, op.value))))
    return tuple(out)


def _shape(model: DeltaModel, value: str) -> tuple[int, ...]:
    d = model.spec.dims
    if value == "state_after":
        return (d["heads"], d["key_dim"], d["value_dim"])
    return (d["conv_dim"], d["conv_width"] - 1)


def _logit_measure(m: ResolvedMeasure, logits: torch.Tensor, support: Mapping[str, Any],
                   references: Mapping[str, str]) -> float:
    """A prob/rank/logit_diff/kl measure of next-token logits `[1, vocab]` (or `[1, s, vocab]`)."""
    reference = support[references[m.against or ""]] if m.kind == "kl" else None
    return float(measures.evaluate(m.kind, logits, m.token_ids, reference))


def baselines(support: Mapping[str, Any], job: SweepJob) -> dict[str, tuple[float, float]]:
    """{measure label: (clean, corrupted)}: the values `--normalise` measures each cell against (none without it)."""
    if job.normalise is None:
        return {}
    clean, corrupted = (support[k] for k in job.normalise)
    refs = dict(job.reference_keys)
    return {measure_label(m): (_logit_measure(m, clean, support, refs), _logit_measure(m, corrupted, support, refs))
            for m in job.run.measures
            if m.kind in measures.LOGIT_KINDS and not (m.kind == "kl" and m.against not in refs)}


def _normalised_rows(ctx: Context, job: SweepJob, cell: Cell, values_: Mapping[str, float]) -> list[ResultRow]:
    """(patched - corrupted) / (clean - corrupted) for each logit measure of the cell."""
    out = []
    for label, (c, k) in baselines(ctx.support, job).items():
        effect = (values_[label] - k) / (c - k) if c != k else math.nan
        out.append(ResultRow(job.name, cell.index, cell.point, f"normalised({label})", None, effect))
    return out


def run_fast(ctx: Context, job: SweepJob, todo: Sequence[Cell], batch: int) -> None:
    """The engine: one clean capture, then each group of cells recomputed from its start position.

    The capture and the forwards' rows are laid out from all the sweep's cells, and a
    forward runs if one of its cells is in `todo`: a resumed sweep computes every cell
    exactly as an uninterrupted one (same kernel splits, same batches), bit for bit.
    """
    model = ctx.exp.model
    wanted = {c.index for c in todo}
    groups = _fast_rows_plan(model, job, job.cells)
    with _routed(model, job.run.route):
        for wave in waves(model, groups):
            if not any(wanted.intersection(c.index for c in wave[start]) for start in wave):
                continue
            first, reads = _capture_reads(model, job, wave)
            cap = ctx.capture(model, job.run.prompt_text, first, reads)
            outputs = sorted({i for i in model.spec.recurrent_layers()
                              if ("state_output", None) in reads.get(i, set())})
            for start, group in wave.items():
                for chunk in chunks(group, batch):
                    if wanted.intersection(c.index for c in chunk):
                        _run_chunk(ctx, job, cap, chunk, start, outputs, wanted)


def _run_chunk(ctx: Context, job: SweepJob, cap: Capture, chunk: Sequence[Cell], start: int,
               outputs: Sequence[int], wanted: set[int]) -> None:
    """One forward of a chunk of cells with the same start position; emits the wanted ones."""
    rows = [Row(c, min(op.layer or 0 for op in job.writes(c)), start, _patches(ctx, job, c, cap)) for c in chunk]
    with torch.no_grad():
        got = run_rows(ctx.exp.model, cap, rows, start, outputs)
    done: dict[int, list[ResultRow]] = {}
    results: dict[str, Any] = {}
    for n, row in enumerate(rows):
        if row.cell.index in wanted:
            done[row.cell.index] = _fast_cell_rows(ctx, job, row, n, got, cap, results)
    ctx.emit(job, done, results)


def _fast_cell_rows(ctx: Context, job: SweepJob, row: Row, n: int, got: RowsOut, cap: Capture,
                    results: dict[str, Any]) -> list[ResultRow]:
    cell = row.cell
    logits = got.logits[n:n + 1].float()
    out: list[ResultRow] = []
    by_label: dict[str, float] = {}
    for m, bound in zip(job.run.measures, cell.run.measures, strict=True):
        if m.kind in measures.LOGIT_KINDS:
            value = _logit_measure(bound, logits, ctx.support, job.reference_keys)
        elif bound.reduce is not None:  # a norm over axes or a projection of the same value, whole
            value = float(reduction_of(bound.reduce)(_norm_input(bound, row, n, got, cap)[None]).reshape(()))
        else:
            value = float(measures.evaluate(bound.kind, _norm_input(bound, row, n, got, cap)[None]))
        label = measure_label(m)
        by_label[label] = value
        results[bound.result_name] = value
        out.append(ResultRow(job.name, cell.index, cell.point, label, None, value))
    for r in _normalised_rows(ctx, job, cell, by_label):
        results[added_result_name(cell, r.measure)] = r.value
        out.append(r)
    return out


def reduction_of(red: Reduce) -> measures.Reduction:
    """The `measures.Reduction` of an `ir.Reduce`, its directions read from their files (once each)."""
    return measures.Reduction(red.axes, [(k, _direction(a.path, a.key, *_stamp(a.path)) if k == "project" else a)
                                         for k, a in red.steps])


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=16)
def _direction(path: str, key: str, mtime_ns: int, size: int) -> torch.Tensor:
    """A direction's tensor (the file's time and size in the key: a rewritten file is read again)."""
    return safetensors.torch.load_file(path)[key]


def _norm_input(m: ResolvedMeasure, row: Row, n: int, got: RowsOut, cap: Capture) -> torch.Tensor:
    """The value a served norm measure reads: a written site's value, or a block's state_output."""
    for p in row.patches:
        if (p.layer, p.value, p.position) == (m.layer, m.value, m.position):
            return p.tensor
    assert m.value == "state_output" and m.layer is not None
    final = got.state_outputs.get(m.layer)
    if final is not None and m.layer >= row.start_block:
        return final[n]
    return cap.values[("state_output", m.layer, None)][0]


def _routed(model: DeltaModel, route: str | None) -> Any:
    """Route the model family's prompt kernel for a while (a sweep's `route torch`), then restore it."""
    return nullcontext() if route is None else routed(model.family, route)


def run_naive(ctx: Context, job: SweepJob, cells: Sequence[Cell], batch: int) -> None:
    """The reference path: the `cells` as invokes of full forwards, `batch` per forward."""
    exp = ctx.exp
    deps = dependencies(exp.resolved, referenced_runs([job.run]))
    wanted = {c.index for c in cells}
    for chunk in chunks(job.cells, batch):  # laid out from all cells, as in run_fast
        if not wanted.intersection(c.index for c in chunk):
            continue
        got = subprogram(exp, tuple(deps) + tuple(c.run for c in chunk)).run()
        done: dict[int, list[ResultRow]] = {}
        results: dict[str, Any] = {}
        for cell in chunk:
            if cell.index not in wanted:
                continue
            rows: list[ResultRow] = []
            by_label: dict[str, float] = {}
            for m, bound in zip(job.run.measures, cell.run.measures, strict=True):
                value, label = got[bound.result_name], measure_label(m)
                results[bound.result_name] = value
                if isinstance(value, torch.Tensor):
                    flat = value.detach().float().reshape(-1).tolist()
                    rows.extend(ResultRow(job.name, cell.index, cell.point, label, p, v) for p, v in enumerate(flat))
                else:
                    by_label[label] = float(value)
                    rows.append(ResultRow(job.name, cell.index, cell.point, label, None, float(value)))
            for r in _normalised_rows(ctx, job, cell, by_label):
                results[added_result_name(cell, r.measure)] = r.value
                rows.append(r)
            for op in cell.run.ops:
                if op.kind == "read" and op.result_name in got:
                    results[op.result_name] = got[op.result_name]
            done[cell.index] = rows
        ctx.emit(job, done, results)


def run_job(ctx: Context, job: SweepJob, cells: Sequence[Cell], batch: int, finished: set[int],
            console: Console | None) -> None:
    """One sweep's cells: through the engine, or the naive path when the engine cannot serve them."""
    if not cells:
        return
    if job.fast:
        try:
            run_fast(ctx, job, cells, batch)
            return
        except Unsupported as e:  # found only once the model ran
            job.blocker = str(e)
            if console is not None:
                console.print(f"sweep {job.name}: the engine cannot serve it ({e}); naive path", highlight=False)
    run_naive(ctx, job, [c for c in cells if c.index not in finished], batch)
