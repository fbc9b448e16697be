"""Sweeps over a dataset: one sweep per record through the engine, every record's value kept, a mean per cell.

    out = run_dataset_sweep(source, model, filename="causal.dl", normalise="clean=facts,corrupted=facts.corrupt")
    out.rows, out.stats, out.grid("trace", 'normalised(logit_diff(facts.answer, facts.foil))'); out.save("out/")

A record's value in a cell is its plain one-prompt program's (`resolve.dataset.expand`), run by the engine.
A cell is named by its labels as written (`L3`, `facts.subject`, `-1`), the same for every record; a token
several labels name counts for each. `normalise` divides each record's effect by its own clean and
corrupted runs before averaging. `DatasetSweepResults`: long-format `rows`, per cell and measure mean, std,
n, 95% CI; `save(DIR)` writes results.csv, summary.csv/json, program.dl, heatmaps; `out`/`resume` save and
continue record by record. A per-token measure gives a row per token, aligned by `align=` (`sweep.aligned`).
`method attribution` goes to `sweep.attribution_dataset`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from deltalang.ground import display
from deltalang.ground.compat import pandas
from deltalang.ground.datasets import Dataset, Record
from deltalang.ground.errors import DeltaError
from deltalang.language import ast
from deltalang.language.ir import Resolved, ResolvedRun
from deltalang.language.parse import parse
from deltalang.language.resolve.dataset import axis_positions, field_prompt, measure_label
from deltalang.runs.compiled import Experiment
from deltalang.runs.dataset_run import MeasureStats, stats_of
from deltalang.runs.dataset_store import (RecordProgress, RecordStore, format_stats, open_store, write_long_csv,
                                          write_summary)
from deltalang.runs.records import close_records, open_records
from deltalang.runs.results import save_atomically
from deltalang.runs.shards import Part, count_line, finish
from deltalang.runtime.model import DeltaModel

from .aligned import COLUMNS as TOKEN_COLUMNS
from .aligned import Alignment, aligned_records
from .aligned import offset as _offset
from .aligned import order as token_order
from .aligned import per_token_lines
from .attribution import Method, method_of
from .attribution_dataset import DatasetAttribution, RecordProgram, attribute_records, marks, read_phase, refine_out
from .driver import SweepOutcome, _console_for, run_sweeps
from .grouped import Grouped, check_field, group_by
from .inline import dataset_sweep_html
from .job import Normalise
from .job import measure_label as cell_measure_label
from .plots import colour_label, heatmap, slug

if TYPE_CHECKING:
    from rich.console import Console

FILES = ("results.csv", "summary.csv", "summary.json", "program.dl")


@attrs.frozen
class CellStats:
    """A measure of one cell over the records: the cell's sweep and labels, and the statistics."""

    sweep: str
    point: tuple[tuple[str, str], ...]  # (variable, label as written)
    stats: MeasureStats
    position: str | None = None  # a per-token measure: the aligned position (`facts.subject + 1`, `-2`)


@attrs.frozen
class DatasetSweepResults:
    """What a sweep over a dataset gives: every record's rows, statistics per cell, the records left out."""

    dataset: Dataset
    rows: tuple[dict[str, Any], ...]
    stats: tuple[CellStats, ...]
    skipped: tuple[tuple[int, str], ...]
    axes: Mapping[str, tuple[tuple[str, tuple[str, ...]], ...]]  # sweep -> ((variable, labels), ...)
    program: str = ""
    normalise: str | None = None
    align: str | None = None  # with per-token measures: what their positions are counted from (`sweep.aligned`)
    part: Part | None = None  # a shard's run: its share of the records (`shards.count_line`); None: the whole run
    grouped_by: str | None = None  # `--by FIELD`: summary and save add the records grouped by it (`sweep.grouped`)

    @property
    def variables(self) -> list[str]:
        return list(dict.fromkeys(v for axes in self.axes.values() for v, _ in axes))

    def values(self, sweep: str, point: Mapping[str, str], measure: str, position: str | None = None) -> list[float]:
        """A cell's value for each record that ran, in record order (a per-token measure's at `position`)."""
        return [r["value"] for r in self.rows if r["sweep"] == sweep and r["measure"] == measure
                and all(r.get(k) == v for k, v in point.items()) and r.get("position") == position]

    def stat(self, sweep: str, point: Mapping[str, str], measure: str, position: str | None = None) -> MeasureStats:
        want = tuple(point.items())
        return next(c.stats for c in self.stats if c.sweep == sweep and c.point == want
                    and c.stats.measure == measure and c.position == position)

    def measures(self, sweep: str) -> list[str]:
        """The sweep's measures of one number per cell (`positions(...)`: those of a number per token)."""
        return list(dict.fromkeys(c.stats.measure for c in self.stats if c.sweep == sweep and c.position is None))

    def positions(self, sweep: str, measure: str) -> list[str]:
        """A per-token measure's aligned positions, in order of their offset (none for a measure of one number)."""
        return token_order(c.position for c in self.stats if c.sweep == sweep and c.stats.measure == measure
                           and c.position is not None)

    def curve(self, sweep: str, point: Mapping[str, str], measure: str) -> list[tuple[str, MeasureStats]]:
        """A per-token measure of one cell: (aligned position, its statistics over the records) in order."""
        return [(p, self.stat(sweep, point, measure, p)) for p in self.positions(sweep, measure)
                if any(c.sweep == sweep and c.point == tuple(point.items()) and c.position == p for c in self.stats)]

    def grid(self, sweep: str, measure: str) -> tuple[tuple[str, ...], tuple[str, ...], list[list[float]]]:
        """A two-axis sweep's mean per cell: (row labels: the first axis, column labels, rows x columns)."""
        (rv, rows), (cv, cols) = self.axes[sweep]
        means = {c.point: c.stats.mean for c in self.stats if c.sweep == sweep and c.stats.measure == measure}
        return rows, cols, [[means.get(((rv, r), (cv, c)), math.nan) for c in cols] for r in rows]

    def summary(self) -> str:
        """Records run and left out, then per sweep and measure the mean of each cell (rows: the first axis)."""
        lines = [count_line(self.dataset.name, len(self.dataset.records), len(self.skipped), self.part)
                 + (f"; normalised against {self.normalise}" if self.normalise else "")]
        for sweep, axes in self.axes.items():
            for m in self.measures(sweep):
                if len(axes) == 2:
                    rows, cols, grid = self.grid(sweep, m)
                    lines.append(f"{sweep}: {m}, mean over records ({axes[0][0]} down, {axes[1][0]} across)")
                    width = max(8, *(len(c) for c in cols))
                    lines.append(" " * 8 + "".join(f"{c:>{width + 1}}" for c in cols))
                    lines.extend(f"{r:8}" + "".join(f"{display.cell(x):>{width + 1}}" for x in row) for r, row in zip(rows, grid))
                else:
                    for c in self.stats:
                        if c.sweep == sweep and c.stats.measure == m:
                            at = ", ".join(f"{k}={v}" for k, v in c.point)
                            lines.append(f"{sweep}[{at}] {m}: {format_stats(c.stats)}")
        lines.extend(per_token_lines(self.stats, self.align))
        for c in self.stats:
            if c.sweep not in self.axes:
                lines.append(f"{c.stats.measure:48} {format_stats(c.stats)}")
        if self.grouped_by is not None:
            lines.append(self.by(self.grouped_by).summary())
        lines.extend(self.dataset.left_out_lines(self.skipped))
        return "\n".join(lines)

    def columns(self) -> list[str]:
        tokens = list(TOKEN_COLUMNS) if any(c.position is not None for c in self.stats) else []
        return ["record", "line", *self.dataset.fields, "sweep", *self.variables, "measure", *tokens, "value"]

    def __repr__(self) -> str:
        n = len(self.dataset.records)
        sweeps = ", ".join(f"{s} ({' x '.join(f'{v}: {len(labs)}' for v, labs in a)})" for s, a in self.axes.items())
        return (f"<DatasetSweepResults: {n - len(self.skipped)} of {n} records of '{self.dataset.name}', sweeps "
                f"{sweeps}; {len(self.rows)} rows, {len(self.stats)} cell statistics; .summary(), .to_pandas(), "
                f".save(DIR)>")

    def to_pandas(self) -> Any:
        """The rows in long format, as results.csv has them (its columns, one row per record, cell and measure)."""
        pd = pandas()

        cols = self.columns()
        return pd.DataFrame([{k: r.get(k, "") for k in cols} for r in self.rows], columns=cols)

    def by(self, field: str) -> Grouped:
        """The cells' statistics with the records grouped by a field's text (`by("distance")`: recall by distance;
        `sweep.grouped`): `.summary()`, `.grid(sweep, measure)`, `.save(DIR)` (a heatmap of cells x groups)."""
        return group_by(self.rows, field, self.dataset.name, self.dataset.fields, tuple(self.axes))

    def _repr_html_(self) -> str:
        """Notebooks: what `summary()` prints, as HTML tables with each grid's heatmap inline (`sweep.inline`)."""
        return dataset_sweep_html(self)

    def save(self, directory: str | Path) -> Path:
        """Write `FILES` and the heatmaps into `directory`, each replacing its former version at once."""
        return save_atomically(directory, self._write)

    def _write(self, tmp: Path) -> None:
        write_long_csv(tmp / "results.csv", self.columns(), self.rows)
        cols = ["mean", "std", "n", "ci_low", "ci_high"]
        at = ["position"] if any(c.position is not None for c in self.stats) else []
        rows = ([c.sweep, *(dict(c.point).get(v, "") for v in self.variables), c.stats.measure,
                 *([c.position or ""] if at else []), *(getattr(c.stats, k) for k in cols)] for c in self.stats)
        summary = {"normalise": self.normalise, "axes": {s: dict(a) for s, a in self.axes.items()},
                   **({"align": self.align or "-1"} if at else {}),
                   **({"by": self.grouped_by} if self.grouped_by is not None else {}),
                   "cells": [{"sweep": c.sweep, **dict(c.point), **({"position": c.position} if at else {}),
                              **attrs.asdict(c.stats)} for c in self.stats]}
        write_summary(tmp, ["sweep", *self.variables, "measure", *at, *cols], rows, summary, self.dataset,
                      self.skipped, self.program)
        for sweep, m, name in self._heatmaps():
            rows, cols, grid = self.grid(sweep, m)
            (rv, _), (cv, _) = self.axes[sweep]
            kind = "normalised" if m.startswith("normalised(") else m.split("(")[0]
            heatmap(grid, cols, rows, f"{sweep}: {m}\nmean over {self._n(sweep, m)} records", cv, rv, tmp / name,
                    kind=kind, label=colour_label(m, kind))
        if self.grouped_by is not None:
            self.by(self.grouped_by).save(tmp)

    def _heatmaps(self) -> list[tuple[str, str, str]]:
        """(sweep, measure, file name) of each two-axis sweep's heatmap `save` draws."""
        return [(sweep, m, f"{sweep}-{slug(m)}.png") for sweep, axes in self.axes.items() if len(axes) == 2
                for m in self.measures(sweep)]

    def files(self) -> list[str]:
        """The names `save` writes: `FILES`, each two-axis sweep's heatmaps, and with `grouped_by` the groups'."""
        return [*FILES, *(name for _, _, name in self._heatmaps()),
                *(self.by(self.grouped_by).files() if self.grouped_by is not None else ())]

    def _n(self, sweep: str, measure: str) -> int:
        return max((c.stats.n for c in self.stats if c.sweep == sweep and c.stats.measure == measure), default=0)


def run_dataset_sweep(source: str, model: DeltaModel, *, filename: str = "<program>",
                      data: Mapping[str, Any] | None = None, datasets: Mapping[str, Dataset] | None = None,
                      strict: bool = False, normalise: str | Mapping[str, str] | None = None,
                      out: str | Path | None = None, resume: bool = False, batch_size: int | None = None,
                      engine: str = "auto", progress: bool | None = None, console: Console | None = None,
                      on_record: Callable[[int], None] | None = None, method: str | None = None,
                      steps: int | None = None, refine: int | None = None,
                      path: str | None = None, align: str | None = None,
                      shard: Any = None, refine_from: str | Path | None = None, by: str | None = None,
                      program: ast.Program | None = None
                      ) -> DatasetSweepResults | DatasetAttribution:
    """Run a program with sweeps over its dataset (see the module doc); `on_record(i)`: after record i is saved.
    `method`, `steps`, `refine`, `path`: as `run_sweep`'s; by attribution, a `DatasetAttribution`. `align`: where a
    per-token measure's positions count from: a field (`facts.subject[0]`) or -1, each record's end (`sweep.aligned`).
    `shard`: as `run_dataset`'s; an attribution's refine split by shards runs again with `refine_from=DIR`. `by`
    (`--by hay.distance`): each cell's mean per group of records too (`sweep.grouped`). `program`: `source` parsed."""
    if program is None:
        program = parse(source, filename)
    recs = open_records(program, source, model.spec, kind="sweep", filename=filename, data=data, datasets=datasets,
                        strict=strict, shard=shard, out=refine_out(out, refine_from), resume=resume,
                        keep_done=refine_from is not None)
    ds, resolutions, skipped, part, out = recs.ds, recs.resolutions, recs.skipped, recs.part, recs.out
    good = [(r.record, r.resolved) for r in resolutions if r.resolved is not None]
    if not good:
        raise DeltaError(f"none of the {len(ds.records)} records of '{ds.name}' resolves: nothing to run")
    how = method_of(Experiment(source, model, filename=filename, resolved=good[0][1]), method, steps, refine, path)
    check_field(by, ds.name, ds.fields, "an attribution's estimates are not grouped" if how else "")  # before a run
    if how is not None:
        return _attribution(program, ds, good, skipped, model, source, filename, how, normalise=normalise, out=out,
                            resume=resume, batch_size=batch_size, engine=engine, console=_console_for(progress,
                            console), on_record=on_record, part=part, refine_from=refine_from,
                            share=recs.share)
    if refine_from is not None:
        raise DeltaError("--refine-from is the second phase of a sweep by attribution with refine split by --shard; "
                         "this sweep runs exactly: drop it")
    resume = recs.resume  # a part never started: a start
    norm = Normalise.parse(normalise)
    tokens, alignment, good, skipped = aligned_records(program, ds, good, skipped, align, model.spec, strict)
    axes = template_axes(program, good[0][1])
    variables = list(dict.fromkeys(v for a in axes.values() for v, _ in a))
    columns = ["record", "line", *ds.fields, "sweep", *variables, "measure", *(TOKEN_COLUMNS if tokens else ()),
               "value"]
    options = {"normalise": None if norm is None else norm.text(), "engine": engine, "batch_size": batch_size,
               **({"align": alignment.text} if tokens else {})}
    store = open_store(out, source, model.spec.model_id, columns, len(ds.records), resume, options)
    done = store.done if store is not None else set()
    todo = [(rec, res) for rec, res in good if rec.index not in done]
    console = _console_for(progress, console)
    cells = sum(_cells(res) for _, res in todo)
    head = _head(ds, len(todo), len(good), cells, engine)
    rows: dict[int, list[dict[str, Any]]] = {rec.index: _reread(store, rec, variables, tokens) for rec, _ in good
                                             if rec.index in done}
    bar = RecordProgress(console, len(todo), cells, "cells", head)
    try:
        with bar:
            for rec, res in todo:
                rows[rec.index] = _run_record(program, ds, rec, res, model, source, filename, norm, batch_size,
                                              engine, bar, alignment)
                if store is not None:
                    store.add(rec.index, [{k: r.get(k, "") for k in columns} for r in rows[rec.index]])
                if on_record is not None:
                    on_record(rec.index)
    except KeyboardInterrupt:
        if console is not None:
            where = f"saved in {out}; rerun with --resume to continue" if out else "not saved (no --out)"
            console.print(f"interrupted: {bar.done} of {len(todo)} record(s) done, {where}")
        raise
    result = attrs.evolve(cell_results(ds, [r for i in sorted(rows) for r in rows[i]], skipped, axes, source, norm,
                                       alignment.text if tokens else None), part=recs.share,
                         grouped_by=by)
    close_records(result, store, recs)
    return result


def _head(ds: Dataset, todo: int, good: int, cells: int, engine: str) -> str:
    """The progress line's head: the records to run (and done before), the cells, the path."""
    return (f"sweep over '{ds.name}': {todo} record(s) to run" + (f", {good - todo} done before" if todo < good
            else "") + f", {cells} cells; each record's sweep through "
            + ("the engine (a forward per cell where it cannot serve one)" if engine == "auto" else "the naive path"))


def _attribution(program: ast.Program, ds: Dataset, good: Sequence[tuple[Record, Resolved]],
                 skipped: tuple[tuple[int, str], ...], model: DeltaModel, source: str, filename: str, how: Method, *,
                 normalise: Any, out: str | Path | None, resume: bool, batch_size: int | None, engine: str,
                 console: Console | None, on_record: Callable[[int], None] | None,
                 part: Any = None, refine_from: str | Path | None = None, share: Part | None = None
                 ) -> DatasetAttribution:
    """A sweep by attribution over the dataset (`sweep.attribution_dataset`), each record's cells labelled."""
    if resume:
        raise DeltaError("--resume continues an exact sweep over a dataset; an attribution sweep reruns (it is "
                         "fast): drop --resume")
    if normalise is not None:
        raise DeltaError("--normalise applies to an exact sweep; attribution estimates M(patched) - M(clean) per "
                         "record: drop --normalise (or say method exact)")
    programs = []
    for rec, res in good:
        run = next(r for r in res.runs if r.kind == "sweep")  # the sweep estimated: the program's first
        names = {cell_measure_label(m): _template_measure(program, m) for m in run.measures}
        programs.append(RecordProgram(rec, res, _labels_by_value(program, ds, rec, run, model), names))
    axes = template_axes(program, good[0][1])[run.name]
    phase = read_phase(how.refine, part, None if out is None else Path(out), refine_from, axes)  # a sharded refine
    got = attribute_records(programs, ds, skipped, axes, model, source, filename, steps=how.steps, refine=how.refine,
                            path=how.path, exact=partial(run_sweeps, batch_size=batch_size, engine=engine),
                            console=console, on_record=on_record, phase=phase)
    if out is not None:
        got.save(out)
        finish(Path(out), part, **marks(got, phase))
    return attrs.evolve(got, part=share)


def _cells(resolved: Resolved) -> int:
    return sum(math.prod(len(a.values) for a in r.axes) for r in resolved.runs if r.kind == "sweep")


def _run_record(program: ast.Program, ds: Dataset, rec: Record, resolved: Resolved, model: DeltaModel, source: str,
                filename: str, norm: Normalise | None, batch_size: int | None, engine: str,
                bar: RecordProgress, alignment: Alignment | None = None) -> list[dict[str, Any]]:
    """One record's sweep(s), through the engine, as rows labelled as the template writes its cells."""
    seen = [0]

    def advance(n: int) -> None:
        bar.advance(n - seen[0])
        seen[0] = n

    exp = Experiment(source, model, filename=filename, resolved=resolved)
    try:
        outcome = run_sweeps(exp, normalise=_record_normalise(program, ds, norm), progress=False,
                             batch_size=batch_size, engine=engine, on_chunk=advance)
    except DeltaError as e:
        e.notes = (*e.notes, f"in record {rec.index + 1} ({ds.where(rec)})")
        raise
    bar.advance(0, 1)
    return record_rows(program, ds, rec, resolved, outcome, model, alignment)



def _record_normalise(program: ast.Program, ds: Dataset, norm: Normalise | None) -> Normalise | None:
    """`--normalise` in a record's program: a field's text `facts.corrupt` is the prompt the record declares."""
    if norm is None:
        return None

    def name(n: str) -> str:
        head, _, field = n.partition(".")
        return field_prompt(program, ds, field) if head == ds.name and field else n

    return Normalise(name(norm.clean), name(norm.corrupted))


def template_axes(program: ast.Program, resolved: Resolved) -> dict[str, tuple[tuple[str, tuple[str, ...]], ...]]:
    """Each sweep's axes as the template writes them: (variable, labels): `L3`, `2`, `facts.subject`, `-1`."""
    out: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {}
    for item in program.items:
        if isinstance(item, ast.Sweep):
            run = resolved.run(item.name)
            axes = []
            for axis, got in zip(item.axes, run.axes, strict=True):
                d = axis.domain
                if isinstance(d, ast.PosList):
                    labels = tuple(ast.format_position(p) for p in d.items)
                elif got.kind == "block":
                    labels = tuple(f"L{b}" for b in got.values)
                else:
                    labels = tuple(str(v) for v in got.labels)
                axes.append((axis.var, labels))
            out[item.name] = tuple(axes)
    return out


def _labels_by_value(program: ast.Program, ds: Dataset, rec: Record, run: ResolvedRun,
                     model: DeltaModel) -> dict[str, dict[int, list[str]]]:
    """{variable: {a record's block or token: the labels naming it}} for one sweep."""
    item = next(i for i in program.items if isinstance(i, ast.Sweep) and i.name == run.name)
    where = axis_positions(program, ds, rec, model.spec)
    out: dict[str, dict[int, list[str]]] = {}
    for axis, got in zip(item.axes, run.axes, strict=True):
        m: dict[int, list[str]] = {}
        if isinstance(axis.domain, ast.PosList):
            for p, at in zip(axis.domain.items, where[(run.name, axis.var)], strict=True):
                m.setdefault(at, []).append(ast.format_position(p))
        else:
            for v, lab in zip(got.values, got.labels, strict=True):
                m.setdefault(v, []).append(f"L{v}" if got.kind == "block" else str(lab))
        out[axis.var] = m
    return out


def record_rows(program: ast.Program, ds: Dataset, rec: Record, resolved: Resolved, outcome: SweepOutcome,
                model: DeltaModel, alignment: Alignment | None = None) -> list[dict[str, Any]]:
    """A record's rows: one per cell label and measure of each sweep (and token, of a per-token measure, its
    position named by `alignment`), one per measure of its other traces."""
    base = {"record": rec.index, "line": rec.line, **rec.fields}
    out: list[dict[str, Any]] = []
    tables = {t.name: t for t in outcome.tables}
    for run in resolved.runs:
        if run.kind == "sweep":
            names = {cell_measure_label(m): _template_measure(program, m) for m in run.measures}
            names.update({f"normalised({k})": f"normalised({v})" for k, v in names.items()})
            labels = _labels_by_value(program, ds, rec, run, model)
            for r in tables[run.name].rows:
                at = {} if r.position is None else {
                    "position": (alignment or Alignment()).label(rec, run, r.position), "token": r.position}
                choices = [[(var, lab) for lab in labels[var][v]] for var, v in r.point]
                for point in itertools.product(*choices):
                    out.append({**base, "sweep": run.name, **dict(point), "measure": names[r.measure], **at,
                                "value": r.value})
        elif not run.implicit:
            for m in run.measures:
                out.append({**base, "sweep": run.name, "measure": measure_label(program, run.name, m),
                            "value": float(outcome.results[m.result_name])})
    return out


def _template_measure(program: ast.Program, m: Any) -> str:
    """A sweep's measure as the template writes it: `logit_diff(facts.answer, facts.foil)`, or its `as` name."""
    if m.alias is not None:
        return cell_measure_label(m)
    call = next((n for n in ast.walk(program) if isinstance(n, (ast.Prob, ast.Rank, ast.LogitDiff, ast.KL, ast.Norm))
                 and n.span == m.span and m.span != ast.NOSPAN), None)
    return cell_measure_label(m) if call is None else ast.format_measure(call)


def _reread(store: RecordStore | None, rec: Record, variables: Sequence[str],
            tokens: bool = False) -> list[dict[str, Any]]:
    """A record's rows saved before (--resume), as `record_rows` gives them."""
    assert store is not None
    base = {"record": rec.index, "line": rec.line, **rec.fields}
    return [{**base, "sweep": r["sweep"], **{v: r[v] for v in variables if r[v] != ""}, "measure": r["measure"],
             **({"position": r["position"], "token": int(r["token"])} if tokens and r.get("position") else {}),
             "value": float(r["value"])} for r in store.rows_of(rec.index)]


def cell_results(ds: Dataset, rows: list[dict[str, Any]], skipped: tuple[tuple[int, str], ...],
             axes: dict[str, tuple[tuple[str, tuple[str, ...]], ...]], source: str,
             norm: Normalise | None, align: str | None = None) -> DatasetSweepResults:
    """Statistics per cell and measure (and aligned position), cells in the order of their axes' labels."""
    variables = list(dict.fromkeys(v for a in axes.values() for v, _ in a))
    groups: dict[tuple[str, tuple[tuple[str, str], ...], str, str | None], list[float]] = {}
    for r in rows:
        point = tuple((v, r[v]) for v in variables if v in r)
        groups.setdefault((r["sweep"], point, r["measure"], r.get("position")), []).append(r["value"])

    def order(key: tuple[str, tuple[tuple[str, str], ...], str, str | None]) -> tuple[Any, ...]:
        sweep, point, _, at = key
        labels = dict(axes.get(sweep, ()))
        return (sweep not in axes, tuple(labels[v].index(lab) for v, lab in point), at is not None,
                0 if at is None else _offset(at))

    keys = sorted(groups, key=order)  # stable: measures keep their first-seen order
    stats = tuple(CellStats(s, p, stats_of(m, groups[(s, p, m, at)]), at) for s, p, m, at in keys)
    return DatasetSweepResults(ds, tuple(rows), stats, skipped, axes, source, None if norm is None else norm.text(),
                               align)
