"""A run over a dataset saved record by record: `RecordStore` (`--out DIR`, `--resume`) and `RecordProgress`.

    store = RecordStore(Path("out"), meta, columns, resume=False)
    store.add(record_index, rows)   # appended to DIR/results.partial.csv and synced, then marked done
    store.rows_of(i)                # on --resume: the rows of a record done before

A record's rows are synced before `DIR/progress.json` marks it done (with the program's sha256, the model
and the options that change values), so an interrupted run loses no finished record and `resume`
continues the same run only; without `resume` a directory holding an unfinished run is an error.
`finish()` marks the run complete once the caller wrote its final files; `abandon()` removes what a run
that finished no record wrote. Floats round-trip through `repr`. `write_long_csv` and `write_summary` (`write_summary_json`) are
the one writer of `results.csv`, `summary.csv/json` and `program.dl`; `format_stats` the one form of a summary's statistics. `RecordProgress` is the progress
line (rich; nothing without a console). Problems are DeltaErrors.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from deltalang.ground import display
from deltalang.ground.errors import DeltaError
from deltalang.ground.html import NotebookProgress, ProgressDisplay

from .shard_file import sync

if TYPE_CHECKING:
    from rich.console import Console

    from deltalang.ground.datasets import Dataset

CSV_NAME, META_NAME, PARTIAL_NAME = "results.csv", "progress.json", "results.partial.csv"


def format_stats(s: Any) -> str:
    """`mean 1.2345  std 0.1234  n 24  95% CI [1.1, 1.3]`: the statistics of a `MeasureStats` (or anything with
    its fields: a generate's per-step statistics), as every summary prints them."""
    n = display.number
    return f"mean {n(s.mean)}  std {n(s.std)}  n {s.n}  95% CI [{n(s.ci_low)}, {n(s.ci_high)}]"


def program_meta(source: str, model_id: str, **fields: Any) -> dict[str, Any]:
    """What a saved run over a dataset records of its program (text and sha256) and model, then `fields`:
    the one place `--resume` and `merge` compare against."""
    return {"program_sha256": hashlib.sha256(source.encode()).hexdigest(), "program": source, "model": model_id,
            **fields}


def open_store(out: str | Path | None, source: str, model_id: str, columns: Sequence[str], records: int,
               resume: bool, options: Mapping[str, Any]) -> RecordStore | None:
    """The store of a run over a dataset that saves to `out` (None when it saves nothing), its meta from
    `program_meta` with the run's `options`, columns and number of records."""
    if out is None:
        return None
    meta = program_meta(source, model_id, options=dict(options), columns=list(columns), records=records)
    return RecordStore(Path(out), meta, columns, resume)


class RecordStore:
    """`DIR/results.partial.csv` appended record by record, `DIR/progress.json` saying which records are done."""

    def __init__(self, directory: Path, meta: Mapping[str, Any], columns: Sequence[str], resume: bool) -> None:
        self.dir = directory
        self.csv = directory / PARTIAL_NAME
        self.meta_path = directory / META_NAME
        self.columns = list(columns)
        self.rows: dict[int, list[dict[str, str]]] = {}
        self.made_dir = not directory.exists()
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DeltaError(f"cannot save results in {directory}: {e.strerror or e}") from None
        old = self._peek()
        done: set[int] = set()
        if resume:
            self._check_resumable(old, meta)
            assert old is not None
            done = set(old.get("done", []))
            self._load(done)
            done &= set(self.rows)  # a record marked done must have its rows
        elif old is not None and not old.get("complete", False):
            raise DeltaError(f"{directory} holds an unfinished run ({len(old.get('done', []))} record(s) done): "
                             f"rerun with --resume to continue it, or choose another --out")
        self.meta = dict(meta, done=sorted(done), complete=False)
        self._write_meta()
        self._rewrite()

    @property
    def done(self) -> set[int]:
        return set(self.meta["done"])

    def _peek(self) -> dict[str, Any] | None:
        if not self.meta_path.exists():
            return None
        try:
            return json.loads(self.meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise DeltaError(f"{self.meta_path} does not parse; delete {self.dir} to start over") from None

    def _check_resumable(self, old: dict[str, Any] | None, meta: Mapping[str, Any]) -> None:
        if old is None:
            raise DeltaError(f"nothing to resume in {self.dir}: it holds no {META_NAME}")
        for key, what in (("program_sha256", "program"), ("model", "model"), ("options", "options"),
                          ("columns", "columns")):
            if old.get(key) != meta.get(key):
                raise DeltaError(f"{self.dir} holds a run with another {what} ({old.get(key)!r}, this one "
                                 f"{meta.get(key)!r}): --resume continues the same run only")

    def _load(self, done: set[int]) -> None:
        path = self.csv if self.csv.exists() else self.dir / CSV_NAME  # a run saved before the partial name
        if not path.exists():
            return
        text = path.read_text(encoding="utf-8")
        if not text.endswith("\n"):
            text = text[: text.rfind("\n") + 1]  # a torn last line
        reader = csv.DictReader(io.StringIO(text, newline=""))
        if reader.fieldnames is not None and list(reader.fieldnames) != self.columns:
            raise DeltaError(f"{self.csv} has columns {reader.fieldnames}, expected {self.columns}")
        for row in reader:
            i = int(row["record"])
            if i in done:
                self.rows.setdefault(i, []).append(row)

    def rows_of(self, record: int) -> list[dict[str, str]]:
        """The CSV rows of a record done before (as text)."""
        return self.rows.get(record, [])

    def _write_meta(self) -> None:
        tmp = self.meta_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.meta, indent=1), encoding="utf-8")
        os.replace(tmp, self.meta_path)

    def _rewrite(self) -> None:
        tmp = self.csv.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, self.columns, restval="")
            w.writeheader()
            for i in sorted(self.rows):
                w.writerows(self.rows[i])
            sync(f)
        os.replace(tmp, self.csv)

    def add(self, record: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append a finished record's rows, sync, then mark it done."""
        text = [_as_text(r) for r in rows]
        with open(self.csv, "a", newline="", encoding="utf-8") as f:
            csv.DictWriter(f, self.columns, restval="").writerows(text)
            sync(f)
        self.rows[record] = text
        self.meta["done"] = sorted({*self.meta["done"], record})
        self._write_meta()

    def finish(self) -> None:
        """Mark the run complete (the caller has written its final files) and remove the partial CSV."""
        self.meta["complete"] = True
        self._write_meta()
        self.csv.unlink(missing_ok=True)

    def abandon(self) -> None:
        """After a failure: with no record done, remove what the store wrote (and DIR if it made it); with
        records done, keep them for --resume (under names no result has)."""
        if self.meta["done"]:
            return
        for path in (self.csv, self.meta_path):
            path.unlink(missing_ok=True)
        if self.made_dir:
            try:
                self.dir.rmdir()
            except OSError:  # something else was put there meanwhile
                pass


def _as_text(row: Mapping[str, Any]) -> dict[str, str]:
    """A long-format row as written: `value` through `repr(float)` (read back, the same float), the rest `str`."""
    return {k: (repr(float(v)) if k == "value" else str(v)) for k, v in row.items()}


def write_long_csv(path: Path, columns: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> None:
    """`results.csv` of a finished run: a header of `columns`, then the rows (missing columns empty)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, list(columns), restval="")
        w.writeheader()
        w.writerows(_as_text(r) for r in rows)


def write_summary(directory: Path, header: Sequence[str], rows: Iterable[Sequence[Any]], summary: Mapping[str, Any],
                  dataset: Dataset, skipped: Sequence[tuple[int, str]], program: str) -> None:
    """`summary.csv` (`header`, then `rows`), `summary.json` (the dataset's name, origin and size, `summary`, the
    records left out with their lines and why) and `program.dl` (the program as written)."""
    with open(directory / "summary.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    write_summary_json(directory, summary, dataset, skipped, program)


def write_summary_json(directory: Path, summary: Mapping[str, Any], dataset: Dataset,
                       skipped: Sequence[tuple[int, str]], program: str) -> None:
    """`summary.json` and `program.dl` of `write_summary` (a collection that measures nothing writes only these)."""
    whole = {"dataset": dataset.name, "origin": dataset.origin, "records": len(dataset.records), **summary,
             "left_out": [{"record": i, "line": dataset.records[i].line, "why": why} for i, why in skipped]}
    (directory / "summary.json").write_text(json.dumps(whole, indent=2, allow_nan=True) + "\n", encoding="utf-8")
    (directory / "program.dl").write_text(program, encoding="utf-8")


class RecordProgress(ProgressDisplay):
    """A rich progress bar over records (and the cells or measures in them), or nothing without a console."""

    def __init__(self, console: Console | None, records: int, units: int, unit: str, head: str) -> None:
        self.bar: Any = None
        self.records = records
        self.done = 0
        if console is None or records == 0:
            return
        if console.is_jupyter:  # a notebook: one line updated in place (rich's live display needs ipywidgets)
            console.print(head, highlight=False)
            self.bar, self.task = NotebookProgress(units, unit), 0
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        console.print(head, highlight=False)
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                            TimeElapsedColumn(), TextColumn("elapsed,"), TimeRemainingColumn(), TextColumn("left"),
                            console=console, transient=False)
        self.task = self.bar.add_task(f"record 0 of {records}", total=units)

    def advance(self, units: int, records: int = 0) -> None:
        """`units` more cells (or records) done, of them `records` records finished."""
        self.done += records
        if self.bar is not None:
            self.bar.update(self.task, advance=units, description=f"record {self.done} of {self.records}")
