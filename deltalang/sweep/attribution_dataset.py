"""Attribution over a dataset: each record's one-prompt estimates, a mean per cell, the top cells exact on every record.

`attribute_records` (called by `sweep.dataset.run_dataset_sweep`, which resolves each record's program and
says how the template labels its cells) runs `attribution.attribute` on each record's own program with
refine 0, so a record's estimate is what that program alone estimates. Every record gets the same variants
(`steps` checked on every record first; not given, the one-prompt default where every record has a path,
else `plain`). A cell is named by its labels as written; per variant its value is the mean over records
(std, n, 95% CI). `refine K` runs the K cells of largest |mean default estimate| exactly on every record;
split by `--shard`, in two phases (`Phase`, `read_phase`: the estimates, then with `--refine-from DIR` the top
of every shard's estimates refined; `marks` go in each shard's `done.json`; docs/shards.md).
`DatasetAttribution`: long-format `rows`, `cells`, `values()`, `grid()`, `refined()`, `table()`, `summary()`,
`save(DIR)` (results.csv, summary.csv/json, program.dl, a heatmap). No weights or grads change.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from deltalang.ground import display, html
from deltalang.ground.compat import pandas
from deltalang.ground.datasets import Dataset, Record
from deltalang.ground.errors import DeltaError
from deltalang.language.ir import Resolved
from deltalang.runs.compiled import Experiment
from deltalang.runs.dataset_run import MeasureStats, stats_of
from deltalang.runs.dataset_store import RecordProgress, write_long_csv, write_summary
from deltalang.runs.results import save_atomically
from deltalang.runs.shards import Part, Shard, count_line, read_done, read_rows
from deltalang.runtime.model import DeltaModel

from .attribution import (Attribution, AttributionRow, Target, attribute, check_path, default_steps, refine_cells,
                          target_of)
from .job import measure_label
from .plots import colour_label, heatmap, slug
from .table import decoded_tokens, describe, left_out

if TYPE_CHECKING:
    from rich.console import Console

FILES = ("results.csv", "summary.csv", "summary.json", "program.dl")
Axes = tuple[tuple[str, tuple[str, ...]], ...]  # ((variable, labels as written), ...) in the template's order
Point = tuple[tuple[str, str], ...]  # ((variable, label), ...) in the axes' order


@attrs.frozen
class RecordProgram:
    """A record that resolved: its plain program, the labels naming its blocks and tokens, its measures' names."""

    record: Record
    resolved: Resolved
    labels: Mapping[str, Mapping[int, Sequence[str]]]  # variable -> {block or token number: labels}
    measures: Mapping[str, str]  # the record's measure label -> the template's (`logit_diff(facts.answer, ...)`)


@attrs.frozen
class CellAttribution:
    """One cell and measure over the records: each variant's estimates and, refined, the exact effects."""

    point: Point
    measure: str
    estimates: Mapping[str, MeasureStats]
    exact: MeasureStats | None = None


@attrs.frozen
class DatasetAttribution:
    """What an attribution sweep over a dataset gives (see the module doc)."""

    dataset: Dataset
    sweep: str
    variants: tuple[str, ...]
    default: str
    axes: Axes
    rows: tuple[dict[str, Any], ...]
    cells: tuple[CellAttribution, ...]
    skipped: tuple[tuple[int, str], ...]
    program: str = ""
    note: str = ""
    phase: str | None = None  # a sharded refine's phase ("estimates", "refine"; `Phase`), None otherwise
    clean: Mapping[int, Mapping[str, float]] = attrs.field(factory=dict, repr=False)  # record -> clean measures
    part: Part | None = None  # a shard's run: its share of the records (`shards.count_line`); None: the whole run

    @property
    def variables(self) -> list[str]:
        return [v for v, _ in self.axes]

    def _measure(self, measure: str | None) -> str:
        return measure or self.cells[0].measure

    def cell(self, point: Mapping[str, str], measure: str | None = None) -> CellAttribution:
        """A cell by its labels, `{"L": "L4", "t": "facts.subject"}`."""
        want, m = tuple((v, point[v]) for v in self.variables), self._measure(measure)
        return next(c for c in self.cells if c.point == want and c.measure == m)

    def values(self, point: Mapping[str, str], measure: str | None = None, variant: str | None = None) -> list[float]:
        """A cell's value for each record, in record order: a variant's estimate, or "exact" (refined cells)."""
        m, v = self._measure(measure), variant or self.default
        return [r["value"] for r in self.rows if r["measure"] == m and r["variant"] == v
                and all(r[k] == point[k] for k in self.variables)]

    def grid(self, measure: str | None = None, variant: str | None = None) -> dict[tuple[str, ...], float]:
        """{labels in the axes' order: the mean} of one measure (default: the first) and variant (or "exact")."""
        m, v = self._measure(measure), variant or self.default
        out = {}
        for c in self.cells:
            if c.measure == m and (v != "exact" or c.exact is not None):
                s = c.exact if v == "exact" else c.estimates[v]
                assert s is not None
                out[tuple(lab for _, lab in c.point)] = s.mean
        return out

    def refined(self) -> list[CellAttribution]:
        return [c for c in self.cells if c.exact is not None]

    def table(self, top: int = 20) -> str:
        """The cells of largest |mean default estimate|, mean estimates and mean exact effect side by side."""
        head = [*self.variables, "measure", *self.variants, "exact", "n"]
        cells = sorted(self.cells, key=lambda c: -abs(c.estimates[self.default].mean))[:top]
        body = [[*(lab for _, lab in c.point), c.measure, *(display.signed(c.estimates[v].mean) for v in self.variants),
                 "" if c.exact is None else display.signed(c.exact.mean), str(c.estimates[self.default].n)] for c in cells]
        widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
        lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip() for line in [head, *body]]
        note = (f"sweep {self.sweep}: estimated effect M(patched) - M(clean) per cell, mean over the records; "
                f"{describe(self.default)} is the default; exact: the sweep engine's patch on every record "
                f"(refined cells), its mean")
        return "\n".join([note, *lines, *left_out(len(cells), len(self.cells), "cells", "summary.csv")])

    def summary(self) -> str:
        """Records run and left out, the note on the variants, then `table()` (every refined cell in it)."""
        lines = [count_line(self.dataset.name, len(self.dataset.records), len(self.skipped), self.part)]
        if self.note:
            lines.append(self.note)
        lines.append(self.table(max(20, len(self.refined()))))
        lines.extend(self.dataset.left_out_lines(self.skipped))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return html.pre(self.summary())

    def columns(self) -> list[str]:
        return ["record", "line", *self.dataset.fields, "sweep", *self.variables, "measure", "variant", "value"]

    def __repr__(self) -> str:
        n = len(self.dataset.records)
        axes = " x ".join(f"{v}: {len(labs)}" for v, labs in self.axes)
        return (f"<DatasetAttribution: sweep {self.sweep} ({axes}) over {n - len(self.skipped)} of {n} records of "
                f"'{self.dataset.name}'; variants {', '.join(self.variants)} (default {self.default}), "
                f"{len(self.refined())} cell(s) refined exactly; {len(self.rows)} rows; .summary(), .table(), "
                f".to_pandas(), .save(DIR)>")

    def to_pandas(self) -> Any:
        """The rows in long format, as results.csv has them (its columns: a row per record, cell, measure, variant)."""
        pd = pandas()

        cols = self.columns()
        return pd.DataFrame([{k: r.get(k, "") for k in cols} for r in self.rows], columns=cols)

    def save(self, directory: str | Path) -> Path:
        """Write `FILES` and a heatmap per measure into `directory`, each replacing its former version at once."""
        return save_atomically(directory, self._write)

    def _write(self, tmp: Path) -> None:
        write_long_csv(tmp / "results.csv", self.columns(), self.rows)
        cols = ["mean", "std", "n", "ci_low", "ci_high"]
        rows = ([self.sweep, *(lab for _, lab in c.point), c.measure, variant, *(getattr(s, k) for k in cols)]
                for c in self.cells
                for variant, s in [*c.estimates.items(), *((("exact", c.exact),) if c.exact is not None else ())])
        summary = {"sweep": self.sweep, "variants": list(self.variants), "default": self.default, "note": self.note,
                   "axes": dict(self.axes),
                   "cells": [{**dict(c.point), "measure": c.measure,
                              **{v: attrs.asdict(s) for v, s in c.estimates.items()},
                              "exact": None if c.exact is None else attrs.asdict(c.exact)} for c in self.cells]}
        write_summary(tmp, ["sweep", *self.variables, "measure", "variant", *cols], rows, summary, self.dataset,
                      self.skipped, self.program)
        for m, name in self._heatmaps():
            (rv, rows), (cv, cols_) = self.axes
            means = self.grid(m)
            grid = [[means.get((r, c), math.nan) for c in cols_] for r in rows]
            kind = m.split("(")[0]
            heatmap(grid, cols_, rows, f"{self.sweep}: {m}, {self.default} estimate\nmean over the records", cv,
                    rv, tmp / name, kind=kind, label=colour_label(m, kind))

    def _heatmaps(self) -> list[tuple[str, str]]:
        """(measure, file name) of each heatmap `save` draws: one per measure of a two-axis sweep."""
        if len(self.axes) != 2:
            return []
        return [(m, f"{self.sweep}-{slug(m)}.png") for m in dict.fromkeys(c.measure for c in self.cells)]

    def files(self) -> list[str]:
        """The names `save` writes: `FILES` and the heatmaps."""
        return [*FILES, *(name for _, name in self._heatmaps())]


@attrs.frozen
class Phase:
    """An attribution with refine split by `--shard` runs in two phases (docs/shards.md): "estimates" (this shard's
    records estimated, each record's clean measures kept) or "refine": this shard's estimate `rows` and `clean`
    measures read back, the `top` cells chosen from the mean of every shard's estimates (`read_phase`)."""

    name: str
    rows: tuple[dict[str, Any], ...] = ()
    clean: Mapping[int, Mapping[str, float]] = attrs.Factory(dict)
    top: tuple[Point, ...] = ()
    variants: tuple[str, ...] = ()
    default: str = ""
    note: str = ""


def attribute_records(programs: Sequence[RecordProgram], ds: Dataset, skipped: tuple[tuple[int, str], ...],
                      axes: Axes, model: DeltaModel, source: str, filename: str, *, steps: int | None, refine: int,
                      path: str, exact: Callable[..., Any], console: Console | None = None,
                      on_record: Callable[[int], None] | None = None, phase: Phase | None = None) -> DatasetAttribution:
    """Estimate each record's sweep, average per cell, refine the top `refine` cells on every record (`phase`:
    one of the two phases of a sharded refine)."""
    if refine < 0:
        raise DeltaError(f"refine is a count (0 or more), got {refine}")
    if not programs:
        raise DeltaError(f"no record of '{ds.name}' resolves: nothing to estimate")
    exps = [Experiment(source, model, filename=filename, resolved=p.resolved) for p in programs]
    targets = [_each(ds, p, partial(target_of, e)) for p, e in zip(programs, exps, strict=True)]
    if phase is not None and phase.name == "refine":  # the estimates saved in phase one, the top of every shard's
        rows, variants, default, note = list(phase.rows), phase.variants, phase.default, phase.note
        got = [_saved(model, t, variants, default, phase.clean[p.record.index]) for p, t in zip(programs, targets)]
        top = list(phase.top)
    else:
        got, rows, note = _estimate_all(ds, programs, exps, targets, model, steps, path, console, on_record)
        variants, default = tuple(got[0].variants), got[0].default
        top = top_cells(rows, axes, default, refine) if phase is None else []
    if top:
        bar = RecordProgress(console, len(programs), len(programs), "records",
                             f"refine: {len(top)} cell(s) run exactly on every record")
        with bar:
            for p, e, t, a in zip(programs, exps, targets, got, strict=True):
                rows.extend(_refined(ds, p, e, t, a, set(top), exact))
                bar.advance(1, 1)
    cells = cell_stats(rows, axes, variants)
    return DatasetAttribution(ds, targets[0].sweep.name, variants, default, axes, tuple(rows), cells, skipped, source,
                              note, phase=None if phase is None else phase.name,
                              clean={p.record.index: a.clean for p, a in zip(programs, got, strict=True)})


def read_phase(refine: int, shard: Shard | None, part: Path | None, refine_from: str | Path | None,
               axes: Axes) -> Phase | None:
    """Which phase of a sharded refine this run is (`Phase`; None: one process, or refine 0). Phase two reads
    every shard's estimates in DIR and chooses the top cells from their mean; a problem is one line."""
    if refine_from is not None and shard is None:
        raise DeltaError("--refine-from DIR is the second phase of an attribution with refine split by --shard: "
                         "give --shard K/N (or run it under torchrun)")
    if refine_from is not None and not refine:
        raise DeltaError("--refine-from: this sweep refines no cells (refine 0), so it has no second phase: drop "
                         "--refine-from")
    if shard is None or not refine:
        return None
    if part is None:
        raise DeltaError(f"--shard with attribution's refine {refine}: the top cells are chosen from every shard's "
                         f"estimates, which the shards save under --out: give --out DIR")
    if refine_from is None:
        return Phase("estimates")
    top, own, clean, summaries, missing = part.parent, [], {}, [], []
    rows: list[dict[str, Any]] = []
    for k in range(shard.n):
        d = top / Shard(k, shard.n).name
        done = read_done(d)
        if done is None or done.get("phase") not in ("estimates", "refine"):
            missing.append(k)
            continue
        est = [r for r in read_rows(d)[1] if r["variant"] != "exact"]
        rows.extend(est)
        summaries.append(json.loads((d / "summary.json").read_text(encoding="utf-8")))
        if k == shard.k:
            own, clean = est, {int(i): v for i, v in done["clean"].items()}
    if missing:
        raise DeltaError(f"--refine-from {top}: shard(s) {', '.join(f'{k}/{shard.n}' for k in missing)} of "
                         f"{shard.n} have not estimated (phase 1): run them without --refine-from first")
    if any(x["variants"] != summaries[0]["variants"] for x in summaries):
        raise DeltaError(f"--refine-from {top}: the shards estimated different variants (the default steps differ "
                         f"where a shard's records lack a path): give every shard the same steps")
    rows.sort(key=lambda r: r["record"])  # stable: as one process has them, record by record
    mine = summaries[shard.k]
    return Phase("refine", tuple(own), clean, tuple(top_cells(rows, axes, mine["default"], refine)),
                 tuple(mine["variants"]), mine["default"], mine["note"])


def refine_out(out: str | Path | None, refine_from: str | Path | None) -> str | Path | None:
    """Where a run writes: phase two of a sharded refine (`refine_from`) where phase one did."""
    if refine_from is not None and out is not None and Path(out).resolve() != Path(refine_from).resolve():
        raise DeltaError(f"--refine-from {refine_from} refines the parts its shards saved there: drop --out {out}")
    return out if refine_from is None else refine_from


def marks(got: DatasetAttribution, phase: Phase | None) -> dict[str, Any]:
    """What a phase of a sharded refine adds to the shard's `done.json`: its phase, each record's clean measures
    (phase two reads them), the top cells refined (merge checks every shard refined the same)."""
    if phase is None:
        return {}
    return {"phase": phase.name, "clean": {str(i): dict(v) for i, v in got.clean.items()},
            "top": [[list(x) for x in pt] for pt in phase.top]}


def _estimate_all(ds: Dataset, programs: Sequence[RecordProgram], exps: Sequence[Experiment],
                  targets: Sequence[Target], model: DeltaModel, steps: int | None, path: str,
                  console: Console | None, on_record: Callable[[int], None] | None
                  ) -> tuple[list[Attribution], list[dict[str, Any]], str]:
    """Each record's estimates (refine 0), their rows in record order, and the note on the variants."""
    steps, note = _steps(model, ds, programs, targets, steps, path)
    head = (f"attribution over '{ds.name}': {len(programs)} record(s), {len(targets[0].cells)} cells each, "
            f"estimated from gradients")
    got: list[Attribution] = []
    bar = RecordProgress(console, len(programs), len(programs), "records", head)
    with bar:
        for p, e in zip(programs, exps, strict=True):
            got.append(_each(ds, p, partial(attribute, e, steps=steps, refine=0, path=path)))
            bar.advance(1, 1)
            if on_record is not None:
                on_record(p.record.index)
    rows = [row for p, t, a in zip(programs, targets, got, strict=True) for row in _rows(ds, p, t, a, a.variants)]
    return got, rows, note


def top_cells(rows: Sequence[dict[str, Any]], axes: Axes, default: str, refine: int) -> list[Point]:
    """The `refine` cells of largest |mean default estimate| of the first measure (rows in record order)."""
    if not refine or not rows:
        return []
    first = rows[0]["measure"]
    means = _means([r for r in rows if r["measure"] == first and r["variant"] == default], axes)
    return sorted(means, key=lambda pt: -abs(means[pt]))[:refine]


def _saved(model: DeltaModel, t: Target, variants: Sequence[str], default: str,
           clean: Mapping[str, float]) -> Attribution:
    """A record's attribution as phase two refines it: the rows `attribute` makes (no estimates: those are saved
    rows) and the clean measures phase one kept."""
    tokens = decoded_tokens(model, t.sweep)
    rows = [AttributionRow(b, pos, tokens[pos], measure_label(m), {}) for m in t.measures
            for b, pos in t.cells]
    return Attribution(t.sweep.name, list(variants), default, rows, dict(clean))


def _each(ds: Dataset, p: RecordProgram, fn: Callable[[], Any]) -> Any:
    """`fn()`, a DeltaError in it naming the record."""
    try:
        return fn()
    except DeltaError as e:
        raise DeltaError(f"record {p.record.index + 1} ({ds.where(p.record)}): {e.message}") from None


def _steps(model: DeltaModel, ds: Dataset, programs: Sequence[RecordProgram], targets: Sequence[Target],
           steps: int | None, path: str) -> tuple[int, str]:
    """The steps every record runs with, and a note where some record has no path (then `plain` for all)."""
    if steps is not None:
        if steps < 0:
            raise DeltaError(f"steps is a count (0 or more), got {steps}")
        for p, t in zip(programs, targets, strict=True):
            _each(ds, p, partial(check_path, model, t, steps, path))
        return steps, ""
    each = [default_steps(model, t, path) for t in targets]
    if min(each) == max(each):
        return each[0], ""
    p = programs[each.index(0)]
    return 0, (f"plain only: record {p.record.index + 1} ({ds.where(p.record)}) has no path to integrate along "
               f"(a donor of another length than its prompt), and every record gets the same estimates")


def _points(p: RecordProgram, t: Target, cell: tuple[int, int]) -> list[Point]:
    """The labels a record's cell (block, token) has: every combination of its block's and its token's."""
    at = {a.var: (cell[0] if a.kind == "block" else cell[1]) for a in t.sweep.axes}
    out: list[Point] = [()]
    for a in t.sweep.axes:
        out = [(*pt, (a.var, lab)) for pt in out for lab in p.labels[a.var][at[a.var]]]
    return out


def _rows(ds: Dataset, p: RecordProgram, t: Target, a: Attribution, variants: Sequence[str]) -> list[dict[str, Any]]:
    """A record's estimates in long format, one row per label combination, measure and variant."""
    base = {"record": p.record.index, "line": p.record.line, **p.record.fields, "sweep": a.sweep}
    return [{**base, **dict(pt), "measure": p.measures[r.measure], "variant": v, "value": r.estimates[v]}
            for r in a.rows for pt in _points(p, t, (r.block, r.position)) for v in variants]


def _refined(ds: Dataset, p: RecordProgram, e: Experiment, t: Target, a: Attribution, top: set[Point],
             exact: Callable[..., Any]) -> list[dict[str, Any]]:
    """The record's exact effects of its tokens of the `top` cells (the engine, `refine_cells`), as rows."""
    cells = sorted({c for c in t.cells if top.intersection(_points(p, t, c))})
    if not cells:
        return []
    _each(ds, p, partial(refine_cells, e, t, a, cells, exact))
    base = {"record": p.record.index, "line": p.record.line, **p.record.fields, "sweep": a.sweep}
    return [{**base, **dict(pt), "measure": p.measures[r.measure], "variant": "exact", "value": r.exact}
            for r in a.rows if r.exact is not None for pt in _points(p, t, (r.block, r.position)) if pt in top]


def _means(rows: Sequence[dict[str, Any]], axes: Axes) -> dict[Point, float]:
    groups: dict[Point, list[float]] = {}
    for r in rows:
        groups.setdefault(tuple((v, r[v]) for v, _ in axes), []).append(r["value"])
    return {pt: sum(xs) / len(xs) for pt, xs in groups.items()}


def cell_stats(rows: Sequence[dict[str, Any]], axes: Axes, variants: Sequence[str]) -> tuple[CellAttribution, ...]:
    """Statistics per cell, measure and variant; cells in the order of their axes' labels, measures as first seen."""
    groups: dict[tuple[Point, str], dict[str, list[float]]] = {}
    for r in rows:
        key = (tuple((v, r[v]) for v, _ in axes), r["measure"])
        groups.setdefault(key, {}).setdefault(r["variant"], []).append(r["value"])
    index = {v: {lab: i for i, lab in enumerate(labels)} for v, labels in axes}
    measures = list(dict.fromkeys(r["measure"] for r in rows))
    keys = sorted(groups, key=lambda k: (tuple(index[v][lab] for v, lab in k[0]), measures.index(k[1])))
    return tuple(CellAttribution(pt, m, {v: stats_of(m, groups[(pt, m)][v]) for v in variants},
                                 stats_of(m, groups[(pt, m)]["exact"]) if "exact" in groups[(pt, m)] else None)
                 for pt, m in keys)
