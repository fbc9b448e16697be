"""The store on disk: `DIR/sweep.csv` (long format) written as cells finish, `DIR/sweep.json`, resume.

Contract: the CSV has the columns sweep, the axes, measure, position, value
(`position` set for per-token measures only). The rows of a chunk are written
and synced before its cells are marked done in sweep.json, with the program's
sha256, so an interrupted sweep loses no finished cell and `--resume` continues
the same program only. At the end the CSV is rewritten in cell order.
With `--normalise`, sweep.json's `baselines` holds, per sweep and logit measure,
the clean and corrupted values every normalised effect was computed against:
`{"SWEEP": {"prob(\" Paris\")": {"clean": 0.99, "corrupted": 0.01}}}`.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from deltalang.runs.compiled import Experiment
from deltalang.runs.shard_file import sync

from .errors import DeltaSweepError
from .job import Normalise, ResultRow, SweepJob

CSV_NAME, META_NAME = "sweep.csv", "sweep.json"


class SweepStore:
    """`DIR/sweep.csv` appended as cells finish, `DIR/sweep.json` saying what the sweep is and which cells are done.

    The CSV rows of a chunk are written and synced before the chunk's cells are
    marked done, so after a crash the CSV holds every cell marked done (and maybe
    a torn tail, dropped on resume).
    """

    def __init__(self, directory: Path, meta: dict[str, Any], columns: list[str], resume: bool,
                 locate: Callable[[list[str]], tuple[str, int] | None]) -> None:
        self.dir = directory
        self.locate = locate
        self.csv = directory / CSV_NAME
        self.meta_path = directory / META_NAME
        self.columns = columns
        self.done: dict[str, set[int]] = {}
        self.rows: dict[tuple[str, int], list[list[str]]] = {}  # (sweep, cell) -> CSV rows
        directory.mkdir(parents=True, exist_ok=True)
        old = self.peek(directory)
        if resume:
            self._check_resumable(old, meta)
            assert old is not None
            self.done = {k: set(v) for k, v in old.get("done", {}).items()}
            self._load_rows()
        elif old is not None and not old.get("complete", False):
            n = sum(len(v) for v in old.get("done", {}).values())
            raise DeltaSweepError(f"{directory} holds an unfinished sweep ({n} cell(s) done): rerun with --resume to "
                                  f"continue it, or choose another --out (or delete {directory})")
        self.meta = dict(meta, done={k: sorted(v) for k, v in self.done.items()}, complete=False)
        self._write_meta()
        self._rewrite()

    @staticmethod
    def peek(directory: Path) -> dict[str, Any] | None:
        """The sweep.json in `directory`, if any."""
        path = directory / META_NAME
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            raise DeltaSweepError(f"{path} does not parse; delete {directory} to start over") from None

    def _check_resumable(self, old: dict[str, Any] | None, meta: dict[str, Any]) -> None:
        if old is None:
            raise DeltaSweepError(f"nothing to resume in {self.dir}: it holds no {META_NAME}")
        if old.get("program_sha256") != meta["program_sha256"]:
            raise DeltaSweepError(
                f"{self.dir} holds a sweep of another program (sha256 {str(old.get('program_sha256'))[:12]}..., "
                f"this one {meta['program_sha256'][:12]}...): --resume continues the same program only; "
                f"choose another --out to start this one")
        for key, what in (("model", "model"), ("normalise", "--normalise"), ("prompt", "--prompt")):
            if old.get(key) != meta.get(key):
                raise DeltaSweepError(f"{self.dir} was run with {what} {old.get(key)!r}, this run has "
                                      f"{meta.get(key)!r}: --resume continues the same sweep only")

    def _load_rows(self) -> None:
        if not self.csv.exists():
            return
        text = self.csv.read_text()
        if not text.endswith("\n"):
            text = text[: text.rfind("\n") + 1]  # a torn last line
        reader = csv.reader(io.StringIO(text))
        header = next(reader, None)
        if header != self.columns:
            raise DeltaSweepError(f"{self.csv} has columns {header}, expected {self.columns}")
        for row in reader:
            where = self.locate(row)
            if where is not None and where[1] in self.done.get(where[0], set()):
                self.rows.setdefault(where, []).append(row)
        for sweep, cells in self.done.items():  # a cell marked done must have its rows
            lost = {c for c in cells if (sweep, c) not in self.rows}
            cells -= lost

    def _write_meta(self) -> None:
        tmp = self.meta_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.meta, indent=1))
        os.replace(tmp, self.meta_path)

    def _rewrite(self) -> None:
        """The CSV with every done cell, in cell order (atomically)."""
        tmp = self.csv.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(self.columns)
            for key in sorted(self.rows):
                w.writerows(self.rows[key])
            sync(f)
        os.replace(tmp, self.csv)

    def set_baselines(self, baselines: Mapping[str, Mapping[str, tuple[float, float]]]) -> None:
        """Record {sweep: {measure: (clean, corrupted)}}, what `--normalise` divides by, in sweep.json."""
        self.meta["baselines"] = {sweep: {m: {"clean": c, "corrupted": k} for m, (c, k) in by_measure.items()}
                                  for sweep, by_measure in baselines.items() if by_measure}
        self._write_meta()

    def is_done(self, sweep: str, cell: int) -> bool:
        return cell in self.done.get(sweep, set())

    def add(self, sweep: str, cells: dict[int, list[list[str]]]) -> None:
        """Append the rows of finished cells, sync, then mark them done."""
        with open(self.csv, "a", newline="") as f:
            w = csv.writer(f)
            for rows in cells.values():
                w.writerows(rows)
            sync(f)
        for cell, rows in cells.items():
            self.rows[(sweep, cell)] = rows
        self.done.setdefault(sweep, set()).update(cells)
        self.meta["done"] = {k: sorted(v) for k, v in self.done.items()}
        self._write_meta()

    def finish(self) -> None:
        """Rewrite the CSV in cell order, each cell once; mark the sweep complete."""
        self._rewrite()
        self.meta["complete"] = True
        self._write_meta()


FIXED_COLUMNS = ("sweep", "measure", "position", "value")


def axis_column(var: str) -> str:
    """The CSV column of a sweep variable (`axis_value` if the variable is called `value`, ...)."""
    return f"axis_{var}" if var in FIXED_COLUMNS else var


def csv_columns(jobs: Sequence[SweepJob]) -> list[str]:
    """`sweep`, every sweep's variables (first seen first), `measure`, `position`, `value`."""
    axes: list[str] = []
    for job in jobs:
        axes.extend(axis_column(a.var) for a in job.run.axes if axis_column(a.var) not in axes)
    return ["sweep", *axes, "measure", "position", "value"]


def csv_rows(rows: Iterable[ResultRow], columns: list[str]) -> dict[int, list[list[str]]]:
    """CSV rows per cell."""
    out: dict[int, list[list[str]]] = {}
    for r in rows:
        point = {axis_column(k): v for k, v in r.point}
        line = [r.sweep] + [str(point[c]) if c in point else "" for c in columns[1:-3]]
        line += [r.measure, "" if r.position is None else str(r.position), repr(float(r.value))]
        out.setdefault(r.cell, []).append(line)
    return out


def rows_from_csv(lines: Iterable[list[str]], columns: list[str], job: SweepJob, cell: int) -> list[ResultRow]:
    """The ResultRows of one cell read back from the CSV."""
    out = []
    axes = [a.var for a in job.run.axes]
    for line in lines:
        rec = dict(zip(columns, line))
        point = tuple((v, int(rec[axis_column(v)])) for v in axes)
        pos = int(rec["position"]) if rec["position"] else None
        out.append(ResultRow(job.name, cell, point, rec["measure"], pos, float(rec["value"])))
    return out


def cell_locator(jobs: Sequence[SweepJob], columns: list[str]) -> Callable[[list[str]], tuple[str, int] | None]:
    """Which (sweep, cell) a CSV row belongs to, by its sweep name and axis values."""
    index: dict[tuple[str, tuple[str, ...]], int] = {}
    for job in jobs:
        for cell in job.cells:
            point = {axis_column(k): v for k, v in cell.point}
            index[(job.name, tuple(str(point[c]) if c in point else "" for c in columns[1:-3]))] = cell.index

    def locate(row: list[str]) -> tuple[str, int] | None:
        if len(row) != len(columns):
            return None
        found = index.get((row[0], tuple(row[1:-3])))
        return None if found is None else (row[0], found)

    return locate


def open_store(exp: Experiment, jobs: Sequence[SweepJob], directory: Path, norm: Normalise | None,
               batches: Mapping[str, int], columns: list[str], resume: bool) -> SweepStore:
    """The store in `directory`, with what identifies this sweep (checked on --resume)."""
    meta = {"program_sha256": hashlib.sha256(exp.source.encode()).hexdigest(), "program": exp.source,
            "model": exp.model.spec.model_id, "normalise": norm.text() if norm else None,
            "prompt": getattr(exp, "prompt", None), "batch_size": dict(batches), "columns": columns,
            "sweeps": {j.name: {"cells": len(j.cells), "path": j.path} for j in jobs}}
    return SweepStore(directory, meta, columns, resume, cell_locator(jobs, columns))
