"""A sweep over a dataset with its records grouped by a field: a mean per cell and group (recall by distance).

    out = run_dataset_sweep(source, model)     # or deltalang.run(source, ...)
    g = out.by("distance")                     # or "hay.distance"; `deltalang sweep FILE --by hay.distance`
    g.summary(); g.grid("heads", "prob(hay.answer)"); g.save(DIR)

Each cell's rows (one per record, each carrying its record's fields) are split by the field's text, and a
group's statistics are `dataset_run.stats_of` of its records. Groups are ordered by their number when every
value is one (distances: 11 before 53), else as they first occur. Per sweep and measure: a table and a
heatmap with the cells down (a cell named by its labels, `L2, h=0`) and the groups across, a heads x distance
map (`DIR/<sweep>-<measure>-by-<field>.png`), and for at most `plots.MAX_CURVES` cells a curve each over the
groups, the traces' same measure dashed (`...-curves.png`: recall by distance); `DIR/by-<field>.csv` holds the
statistics. A trace's measure (a clean baseline) is one row of its own. A per-token measure's rows are not
grouped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from deltalang.ground import display
from deltalang.ground.errors import DeltaError
from deltalang.runs.dataset_run import MeasureStats, stats_of
from deltalang.runs.dataset_store import write_long_csv

from .plots import MAX_CURVES, colour_label, curves, heatmap, slug

Point = tuple[tuple[str, str], ...]  # (variable, label as written)


@attrs.frozen
class Grouped:
    """Statistics per (run, cell, measure, group): `stats[(sweep, point, measure)][group]`."""

    field: str
    groups: tuple[str, ...]
    stats: Mapping[tuple[str, Point, str], Mapping[str, MeasureStats]]
    sweeps: tuple[str, ...]  # the runs that are sweeps (the others are traces: a row each)

    def grid(self, sweep: str, measure: str) -> tuple[list[str], list[list[float]]]:
        """(cell labels down, [cells x groups] of means) of one sweep's measure; a trace's: one row."""
        keys = [k for k in self.stats if k[0] == sweep and k[2] == measure]
        labels = [", ".join(lab if re.fullmatch(r"L\d+", lab) else f"{v}={lab}" for v, lab in k[1]) or sweep
                  for k in keys]
        return labels, [[self.stats[k][g].mean if g in self.stats[k] else math.nan for g in self.groups]
                        for k in keys]

    def tables(self) -> list[tuple[str, str]]:
        """(run, measure) of every table, the sweeps first, in the order the rows came."""
        pairs = list(dict.fromkeys((s, m) for s, _, m in self.stats))
        return sorted(pairs, key=lambda p: p[0] not in self.sweeps)

    def summary(self) -> str:
        """Per sweep and measure the mean of each cell (down) in each group (across); then the traces'."""
        lines = []
        for sweep, m in self.tables():
            labels, grid = self.grid(sweep, m)
            n = min((s.n for k, by in self.stats.items() if k[0] == sweep and k[2] == m for s in by.values()),
                    default=0)
            what = f"{sweep}: {m}" if sweep in self.sweeps else m
            lines.append(f"{what}, mean over records by {self.field} (cells down, {self.field} across; n >= {n})")
            cells = [[display.cell(x) for x in row] for row in grid]
            first = max(8, *(len(lab) for lab in labels))
            width = max(*(len(g) for g in self.groups), *(len(c) for row in cells for c in row))
            lines.append(" " * first + "".join(f"{g:>{width + 1}}" for g in self.groups))
            lines.extend(f"{lab:{first}}" + "".join(f"{c:>{width + 1}}" for c in row)
                         for lab, row in zip(labels, cells))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def plots(self) -> list[tuple[str, str, str, bool]]:
        """(sweep, measure, file name less `.png`, with a curves plot) of each heatmap `save` draws."""
        return [(sweep, m, f"{sweep}-{slug(m)}-by-{slug(self.field)}", len(self.grid(sweep, m)[0]) <= MAX_CURVES)
                for sweep, m in self.tables() if sweep in self.sweeps]

    def files(self) -> list[str]:
        """The names `save` writes: `by-<field>.csv`, then each heatmap (and its curves)."""
        return [f"by-{slug(self.field)}.csv", *(f for _, _, name, with_curves in self.plots()
                                                for f in (f"{name}.png", *((f"{name}-curves.png",) if with_curves
                                                                            else ())))]

    def save(self, directory: str | Path) -> list[Path]:
        """`by-<field>.csv` and a heatmap per sweep and measure into `directory`; the files written (`files()`)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        variables = list(dict.fromkeys(v for _, point, _ in self.stats for v, _ in point))
        cols = ["mean", "std", "n", "ci_low", "ci_high"]
        rows = [{"sweep": s, **dict(point), "measure": m, self.field: g, **{c: getattr(st, c) for c in cols}}
                for (s, point, m), by in self.stats.items() for g, st in by.items()]
        files = [out / f"by-{slug(self.field)}.csv"]
        write_long_csv(files[0], ["sweep", *variables, "measure", self.field, *cols], rows)
        for sweep, m, name, with_curves in self.plots():
            labels, grid = self.grid(sweep, m)
            kind = "normalised" if m.startswith("normalised(") else m.split("(")[0]
            title = f"{sweep}: {m}\nmean over records by {self.field}"
            files.append(heatmap(grid, list(self.groups), labels, title, self.field, "cell",
                                 out / f"{name}.png", kind=kind, label=colour_label(m, kind)))
            if with_curves:  # few cells: a curve each, the traces of the measure dashed
                clean = {s: self.grid(s, t)[1][0] for s, t in self.tables() if t.endswith(f".{m}")}
                files.append(curves(list(self.groups), dict(zip(labels, grid)), title, self.field,
                                    colour_label(m, kind), out / f"{name}-curves.png", baselines=clean, kind=kind))
        return files


def group_by(rows: Sequence[Mapping[str, Any]], field: str, dataset: str, fields: Sequence[str],
             sweeps: Sequence[str]) -> Grouped:
    """The rows of a sweep over `dataset` (`DatasetSweepResults.rows`) grouped by `field` (`distance` or
    `hay.distance`); a field the records lack is an error naming the fields they have."""
    name = str(check_field(field, dataset, fields))
    cells: dict[tuple[str, Point, str], dict[str, list[float]]] = {}
    for r in rows:
        if r.get("position") is not None:
            continue
        point = tuple((k, r[k]) for k in r if k not in _NOT_LABELS and k not in fields)
        cells.setdefault((r["sweep"], point, r["measure"]), {}).setdefault(str(r[name]), []).append(r["value"])
    seen = list(dict.fromkeys(g for by in cells.values() for g in by))
    groups = sorted(seen, key=float) if all(_number(g) for g in seen) else seen
    stats = {k: {g: stats_of(k[2], by[g]) for g in groups if g in by} for k, by in cells.items()}
    return Grouped(name, tuple(groups), stats, tuple(sweeps))


def check_field(field: str | None, dataset: str, fields: Sequence[str], refused: str = "") -> str | None:
    """The field's name (`hay.distance` or `distance`; None: no grouping); an error if the records lack it, or
    `refused` says why the run cannot group."""
    if field is None:
        return None
    name = field.removeprefix(f"{dataset}.")
    if refused:
        raise DeltaError(f"--by {field} groups an exact sweep's cells by a field; {refused}: drop --by")
    if name not in fields:
        raise DeltaError(f"--by {field}: the records of '{dataset}' have no field '{name}' (they have "
                         f"{', '.join(fields)})")
    return name


_NOT_LABELS = ("record", "line", "sweep", "measure", "position", "token", "value")


def _number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
