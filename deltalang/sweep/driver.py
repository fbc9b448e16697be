"""Driving sweeps: `run_sweeps(exp)` and `run_sweep(source)`, with progress, the store, tables and plots.

Contract: the program's other runs (and the support values) run once through the
compiler; each sweep runs through the engine or the naive path (the progress
output says which and why); with `out` every finished cell is saved as it
finishes (with `normalise`, sweep.json records the baselines) and `resume`
continues an interrupted sweep. Returns a SweepOutcome:
every result by name (the same names the reference path gives), a table per
sweep, the files written.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from deltalang.ground.html import NotebookProgress, ProgressDisplay
from deltalang.runs.compiled import Experiment
from deltalang.runs.results import Results
from deltalang.runtime.model import DeltaModel

from .attribution import Attribution, attribute, method_of, refuse_estimated
from .engine import Context, baselines, run_job
from .errors import DeltaSweepError
from .inline import outcome_html
from .job import Cell, Normalise, ResultRow, SweepJob, added_result_name, measure_label, plan_job, start_of
from .memory import batch_for
from .plots import plot_table
from .recompute import Capture, capture_clean
from .store import SweepStore, csv_columns, csv_rows, open_store, rows_from_csv
from .support import SUPPORT, Support
from .table import SweepTable, render_tables, token_texts

if TYPE_CHECKING:
    from rich.console import Console


@attrs.define
class SweepOutcome:
    """What `run_sweeps` returns: every result by name, a table per sweep, the files written."""

    results: Results
    tables: list[SweepTable]
    files: list[Path] = attrs.Factory(list)
    paths: dict[str, str] = attrs.Factory(dict)  # sweep -> "engine" | "naive: why"

    def _repr_html_(self) -> str:
        """Notebooks: each sweep's tables and plots, then the other results (`sweep.inline`)."""
        return outcome_html(self)

    def __repr__(self) -> str:
        """A text front end's view: each sweep's tables as the terminal prints them."""
        from rich.console import Console

        out = Console(file=io.StringIO(), width=200, color_system=None, force_jupyter=False, force_terminal=False)
        for table in self.tables:
            for item in render_tables(table):
                out.print(item)
        return f"{out.file.getvalue()}<SweepOutcome: {len(self.results)} results in .results, the tables in .tables>"


class _Progress(ProgressDisplay):
    """A rich progress bar (cells done, rate, time left), in a notebook one line updated in place, or nothing."""

    def __init__(self, console: Console | None, total: int) -> None:
        self.bar: Any = None
        if console is None or total == 0:
            return
        if console.is_jupyter:  # rich's live display needs ipywidgets there, and warns without it
            self.bar, self.task = NotebookProgress(total), 0
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)
        from rich.text import Text

        class Rate(ProgressColumn):
            def render(self, task: Any) -> Text:
                speed = task.finished_speed or task.speed
                return Text("" if speed is None else f"{speed:.2f} cells/s", style="progress.data.speed")

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("cells"), Rate(), TimeElapsedColumn(), TextColumn("elapsed,"),
                            TimeRemainingColumn(), TextColumn("left"), console=console, transient=False)
        self.task = self.bar.add_task("sweep", total=total)

    def advance(self, n: int, name: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=n, description=name)


def _work_share(model: DeltaModel, job: SweepJob, cells: Sequence[Cell]) -> float:
    """The engine's work in full forwards: the sum over cells of (blocks from L) x (positions from t) shares."""
    n, s = model.spec.num_layers, len(job.run.token_ids)
    total = 0.0
    for c in cells:
        starts = [start_of(op) for op in job.writes(c)]
        total += (n - min(b for b, _ in starts)) / n * (s - min(p for _, p in starts)) / max(1, s)
    return total


def _describe(model: DeltaModel, job: SweepJob, cells: Sequence[Cell], batch: int) -> str:
    axes = " x ".join(f"{a.var}: {len(a.values)} {a.kind}s"
                      for a in job.run.axes)
    head = f"sweep {job.name}: {len(job.cells)} cells ({axes})"
    if len(cells) < len(job.cells):
        head += f", {len(job.cells) - len(cells)} already done"
    if job.fast:
        return (f"{head}; engine: a cell writing block L at token t recomputes blocks L.. at tokens t.. only, "
                f"up to {batch} cells per forward: {_work_share(model, job, cells):.1f} forwards' work for "
                f"{len(cells)} cells")
    return f"{head}; naive path, a full forward per cell ({batch} per forward), because {job.blocker}"


def refuse_zero_denominator(norm: Normalise | None, lines: Mapping[str, Mapping[str, tuple[float, float]]]) -> None:
    """A `--normalise` whose two runs measure the same value: every normalised effect would divide by zero."""
    for job, by_label in lines.items():
        for label, (clean, corrupted) in by_label.items():
            if norm is not None and clean == corrupted:
                raise DeltaSweepError(f"--normalise {norm.text()}: '{norm.clean}' and '{norm.corrupted}' both give "
                                      f"{label} = {clean:.6g} in sweep '{job}', so (clean - corrupted) is 0 and "
                                      f"every normalised value would be nan: name two runs whose values differ")


def run_sweeps(exp: Experiment, *, out: str | Path | None = None, resume: bool = False,
               batch_size: int | None = None, normalise: str | Mapping[str, str] | Normalise | None = None,
               progress: bool | None = None, console: Console | None = None, engine: str = "auto",
               on_chunk: Callable[[int], None] | None = None, capture: Callable[..., Capture] = capture_clean
               ) -> SweepOutcome:
    """Run a compiled program that has sweeps: its other runs once, each sweep through the engine.

    `out`: write DIR/sweep.csv (as cells finish), sweep.json and the plots there; `resume`: continue
    the sweep in `out` without recomputing its finished cells; `batch_size`: rows per forward (default:
    from a memory budget); `normalise`: `clean=RUN,corrupted=RUN`; `progress`: show the bar and which
    path each sweep takes (default: on a terminal); `engine`: "auto" or "naive" (the reference path for
    every cell); `on_chunk(cells_done)`: called after each forward's cells are saved; `capture`: the
    engine's clean forward (attribution's refine passes one answered from its gradients' forward).
    """
    if engine not in ("auto", "naive"):
        raise DeltaSweepError(f"engine is 'auto' or 'naive', got {engine!r}")
    if batch_size is not None and batch_size < 1:
        raise DeltaSweepError(f"--batch-size must be at least 1, got {batch_size}")
    if resume and out is None:
        raise DeltaSweepError("--resume continues the sweep in an --out directory: give --out DIR")
    refuse_estimated(exp)
    model = exp.model
    norm = Normalise.parse(normalise)
    support = Support(exp.resolved)
    jobs = [plan_job(exp, r, support, norm, engine) for r in exp.resolved.runs if r.kind == "sweep"]
    console = _console_for(progress, console)
    directory = Path(out) if out is not None else None
    old = SweepStore.peek(directory) if directory is not None and resume else None
    batches = {job.name: batch_for(model, job, batch_size, old) for job in jobs}
    columns = csv_columns(jobs)
    support_results = support.run(exp)
    refuse_zero_denominator(norm, {job.name: baselines(support_results, job) for job in jobs} if norm else {})
    store = open_store(exp, jobs, directory, norm, batches, columns, resume) if directory is not None else None
    values_: dict[str, Any] = {k: v for k, v in support_results.items() if not k.startswith(SUPPORT)}
    if store is not None and norm is not None:
        store.set_baselines({job.name: baselines(support_results, job) for job in jobs})
    tables = {job.name: _table(model, job) for job in jobs}
    finished: dict[str, set[int]] = {job.name: set() for job in jobs}
    if store is not None:
        values_.update(_restore(store, jobs, columns, tables, finished))
    todo = {job.name: [c for c in job.cells if c.index not in finished[job.name]] for job in jobs}
    total = sum(len(v) for v in todo.values())
    done_count = [0]
    bar = _Progress(console, total)

    def emit(job: SweepJob, done: dict[int, list[ResultRow]], results: dict[str, Any]) -> None:
        if store is not None:
            store.add(job.name, csv_rows([r for rows in done.values() for r in rows], columns))
        for rows in done.values():
            tables[job.name].rows.extend(rows)
        finished[job.name].update(done)
        values_.update(results)
        done_count[0] += len(done)
        bar.advance(len(done), job.name)
        if on_chunk is not None:
            on_chunk(done_count[0])

    ctx = Context(exp, support_results, emit, capture)
    if console is not None:
        for job in jobs:
            console.print(_describe(model, job, todo[job.name], batches[job.name]), highlight=False)
    try:
        with bar:
            for job in jobs:
                run_job(ctx, job, todo[job.name], batches[job.name], finished[job.name], console)
    except KeyboardInterrupt:
        if console is not None:
            where = f"saved in {directory}; rerun with --resume to continue" if directory else "not saved (no --out)"
            console.print(f"interrupted: {done_count[0]} of {total} cell(s) done, {where}")
        raise
    files: list[Path] = []
    if store is not None and directory is not None:
        store.finish()
        files.append(store.csv)
        for job in jobs:
            files.extend(plot_table(tables[job.name], directory))
    for t in tables.values():
        t.rows.sort(key=lambda r: r.cell)
    return SweepOutcome(_results(exp, jobs, values_), [tables[j.name] for j in jobs], files,
                        {j.name: j.path for j in jobs})


def _table(model: DeltaModel, job: SweepJob) -> SweepTable:
    """A sweep's empty table: its axes, its prompt's tokens, its measures."""
    labels = [measure_label(m) for m in job.run.measures]
    return SweepTable(job.name, job.run.axes, token_texts(model, job.run), labels,
                      kinds={measure_label(m): m.kind for m in job.run.measures})


def _console_for(progress: bool | None, console: Console | None) -> Console | None:
    """Where progress goes: the console given, stderr (always, or on a terminal when `progress` is None), or nowhere."""
    from rich.console import Console

    if progress is False:
        return None
    if console is not None:
        return console
    console = Console(stderr=True)
    if progress is None and not (console.is_terminal or console.is_jupyter):
        return None
    return console


def _restore(store: SweepStore, jobs: Sequence[SweepJob], columns: list[str], tables: Mapping[str, SweepTable],
             finished: Mapping[str, set[int]]) -> dict[str, Any]:
    """The cells already on disk: into the tables and `finished`; returns their results by name."""
    out: dict[str, Any] = {}
    for job in jobs:
        for c in job.cells:
            if store.is_done(job.name, c.index):
                rows = rows_from_csv(store.rows[(job.name, c.index)], columns, job, c.index)
                tables[job.name].rows.extend(rows)
                finished[job.name].add(c.index)
                out.update(_results_of(job, c, rows))
    return out


def _results(exp: Experiment, jobs: Sequence[SweepJob], values_: dict[str, Any]) -> Results:
    """Every result by name, with what `Results.summary` needs to show them (cells show their sweep's tokens)."""
    return exp.results_of(values_, {c.run.name: job.run.tokens for job in jobs for c in job.cells})


def _results_of(job: SweepJob, cell: Cell, rows: Sequence[ResultRow]) -> dict[str, Any]:
    """Results by name of a cell read back from disk (per-token measures as a [1, s] tensor)."""
    out: dict[str, Any] = {}
    names = {measure_label(m): b.result_name for m, b in zip(job.run.measures, cell.run.measures, strict=True)}
    curves: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.position is not None:
            curves.setdefault(r.measure, {})[r.position] = r.value
        elif r.measure in names:
            out[names[r.measure]] = r.value
        else:
            out[added_result_name(cell, r.measure)] = r.value
    for label, pts in curves.items():
        out[names.get(label) or added_result_name(cell, label)] = torch.tensor([[pts[p] for p in sorted(pts)]])
    return out


def run_sweep(source: str, model: Any = None, *, out: str | Path | None = None, resume: bool = False,
              batch_size: int | None = None, normalise: str | Mapping[str, str] | Normalise | None = None,
              progress: bool | None = None, filename: str = "<program>", prompt: str | None = None,
              engine: str = "auto", on_chunk: Callable[[int], None] | None = None, method: str | None = None,
              steps: int | None = None, refine: int | None = None, path: str | None = None
              ) -> SweepOutcome | Attribution:
    """Compile and run a program with sweeps; see `run_sweeps` for the options.

        outcome = deltalang.run_sweep(text, out="runs/ablate", normalise="clean=clean,corrupted=other")
        outcome.tables[0].grid('prob(" Paris")')

    `method="attribution"` (or the sweep's own `method attribution`): estimate every cell of the sweep
    from gradients instead (`steps` points of the integrated `path`, `refine` top cells run exactly;
    given here they replace the program's; `sweep.attribution`).
    """
    exp = Experiment.from_source(source, model, filename=filename, prompt=prompt)
    how = method_of(exp, method, steps, refine, path)
    if how is not None:
        return attribute(exp, steps=how.steps, refine=how.refine, out=out, exact=run_sweeps, path=how.path)
    return run_sweeps(exp, out=out, resume=resume, batch_size=batch_size, normalise=normalise, progress=progress,
                      engine=engine, on_chunk=on_chunk)
