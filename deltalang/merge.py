"""The parts of a run split by `--shard` joined: `merge(DIR)` (`deltalang merge DIR`) and `load_results(DIR)`.

    deltalang.merge.merge("out/")           # out/shard-K-of-N/ parts -> out/results.csv, summary.*, ...
    deltalang.load_results("out/")          # the same, merged first where out/ holds parts

`merge(DIR)` checks `DIR/shards.json` and every part's `done.json` (a part of another program, dataset,
model, kind, split or N, an unfinished one, or an attribution's part estimated but not refined, is a
DeltaError naming it), then writes into DIR what the unsharded run writes, from the parts' files alone:
rows in record order with statistics over every record, a generate's continuations, a collection's index
and manifest (written last) over every part, a dataset sweep's cells (and its groups, under `--by`) or an
attribution's. Merging again gives the same files; `shards.json` then says `merged`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import attrs

from .ground.datasets import Dataset, Record
from .ground.errors import DeltaError
from .runs.collect import INDEX
from .runs.collect import MANIFEST as COLLECTION
from .runs.collection import Collection
from .runs.collection import load_results as load_saved
from .runs.dataset_generate import DatasetGeneration, continuations_of, step_stats
from .runs.dataset_run import DatasetResults, stats_by_measure, stats_of
from .runs.shards import DONE, MANIFEST, Shard, check_same, read_done, read_manifest, read_rows
from .sweep.attribution_dataset import DatasetAttribution, cell_stats
from .sweep.dataset import Normalise, cell_results

PART = re.compile(r"shard-(\d+)-of-(\d+)")


def load_results(directory: str | Path) -> Any:
    """What a run saved in `directory` (`collection.load_results`), its shards' parts merged first."""
    if (Path(directory) / MANIFEST).is_file():
        merge(directory)
    return load_saved(directory)


def parts(top: Path) -> tuple[dict[str, Any], list[Path]]:
    """The manifest and the N parts, each checked complete and of this run (one DeltaError otherwise)."""
    meta = read_manifest(top)
    n = meta["n"]
    for d in sorted(top.iterdir()):
        m = PART.fullmatch(d.name)
        if d.is_dir() and m and int(m.group(2)) != n:
            raise DeltaError(f"{d} is a part of a run split in {m.group(2)}, {top / MANIFEST} says {n}: parts of "
                             f"one run only (move it elsewhere)")
    missing, estimated, tops = [], [], set()
    for k in range(n):
        part = top / Shard(k, n).name
        done = read_done(part)
        if done is None:
            missing.append(k)
            continue
        check_same(part, done, meta, f"`deltalang merge DIR` joins one run's parts: rerun shard {k}/{n} with "
                                     f"--out {top} and this run's program and options, or move {part.name} out")
        if done.get("phase") == "estimates":
            estimated.append(k)
        tops.add(json.dumps(done.get("top")))
    if missing:
        raise DeltaError(f"{top}: shard(s) {', '.join(f'{k}/{n}' for k in missing)} of {n} not complete (no "
                         f"{DONE} in {', '.join(Shard(k, n).name for k in missing)}): run them (--resume continues "
                         f"one that started), then merge")
    if estimated:
        raise DeltaError(f"{top}: shard(s) {', '.join(f'{k}/{n}' for k in estimated)} of {n} estimated but not "
                         f"refined (phase 1 of 2): run every shard again with --refine-from {top}, then merge")
    if len(tops) > 1:
        raise DeltaError(f"{top}: its shards refined different top cells (their estimates changed between the "
                         f"phases): run every shard again with --refine-from {top}, then merge")
    return meta, [top / Shard(k, n).name for k in range(n)]


def merge(directory: str | Path) -> Any:
    """Join the parts in `directory` (see the module doc); the merged results (a `Collection` for one)."""
    top = Path(directory)
    meta, dirs = parts(top)
    header, rows, skipped = _rows(dirs)
    kind = meta["kind"]
    got: Any = None
    if header is not None:
        fields = header[2:min(header.index(c) for c in ("sweep", "measure") if c in header)]
        ds = _dataset(meta, fields)
        if kind in ("run", "collection"):
            got = DatasetResults(ds, tuple(rows), stats_by_measure(rows), skipped, meta["program"])
        elif kind == "generate":
            got = _generation(dirs, ds, rows, skipped, meta["program"])
        elif "variant" not in header:
            got = _sweep(dirs, ds, header, rows, skipped, meta["program"])
        else:  # a sweep by attribution
            got = _attribution(dirs, ds, header, rows, skipped, meta["program"])
        got.save(top)
    if kind == "collection":
        got = _collection(top, dirs, skipped, meta["program"])
    meta = dict(meta, merged=True)
    tmp = top / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
    os.replace(tmp, top / MANIFEST)
    return got


def _dataset(meta: dict[str, Any], fields: list[str]) -> Dataset:
    """The dataset as its results need it (name, origin, record lines, the fields' order)."""
    d = meta["dataset"]
    return Dataset(d["name"], d["origin"], tuple(Record(i, line, dict.fromkeys(fields, ""))
                                                 for i, line in enumerate(d["lines"])))


def _rows(dirs: list[Path]) -> tuple[list[str] | None, list[dict[str, Any]], tuple[tuple[int, str], ...]]:
    """Every part's `results.csv` rows in record order (values as floats) and records left out."""
    header: list[str] | None = None
    rows: list[dict[str, Any]] = []
    skipped: list[tuple[int, str]] = []
    for d in dirs:
        summary = json.loads((d / "summary.json").read_text(encoding="utf-8")) if (d / "summary.json").is_file() \
            else json.loads((d / COLLECTION).read_text(encoding="utf-8"))
        skipped.extend((e["record"], e["why"]) for e in summary.get("left_out", []))
        columns, got = read_rows(d)
        if columns is None:
            continue
        if header is not None and columns != header:
            raise DeltaError(f"{d / 'results.csv'} has columns {columns}, the first part {header}")
        header = columns
        rows.extend(got)
    rows.sort(key=lambda r: r["record"])  # stable: a record's rows keep their order
    return header, rows, tuple(sorted(skipped))


def _generation(dirs: list[Path], ds: Dataset, rows: list[dict[str, Any]], skipped: tuple[tuple[int, str], ...],
                program: str) -> DatasetGeneration:
    """A generate's rows (steps as numbers) and every part's continuations, in record order."""
    rows = [dict(r, step=int(r["step"]) if r["step"] != "" else "") for r in rows]
    conts = [c for d in dirs for c in continuations_of(d)]
    conts.sort(key=lambda c: c["record"])  # stable: a record's runs keep their order
    return DatasetGeneration(ds, tuple(rows), tuple(conts), step_stats(rows, stats_of), skipped, program)


def _summary(part: Path) -> dict[str, Any]:
    return json.loads((part / "summary.json").read_text(encoding="utf-8"))


def _sweep(dirs: list[Path], ds: Dataset, header: list[str], rows: list[dict[str, Any]],
           skipped: tuple[tuple[int, str], ...], program: str) -> Any:
    first = _summary(dirs[0])
    axes = {s: tuple((v, tuple(labels)) for v, labels in a.items()) for s, a in first["axes"].items()}
    variables = header[header.index("sweep") + 1:header.index("measure")]
    tokens = "position" in header  # per-token measures (`sweep.aligned`): a token's rows, a cell's other rows
    rows = [{k: int(v) if k == "token" and v != "" else v for k, v in r.items()
             if k not in (*variables, "position", "token") or v != ""} for r in rows]
    got = cell_results(ds, rows, skipped, axes, program, Normalise.parse(first["normalise"]),
                       first.get("align") if tokens else None)
    by = {d: _summary(d).get("by") for d in dirs}  # `--by FIELD`: the merged run's groups too
    if len(set(by.values())) > 1:
        said = "; ".join(f"{d.name}: {f'--by {f}' if f else 'no --by'}" for d, f in by.items())
        raise DeltaError(f"the shards grouped their records differently ({said}): rerun the others with --resume and "
                         f"the same --by (their records are done: only their files are rewritten), then merge")
    return attrs.evolve(got, grouped_by=by[dirs[0]])


def _attribution(dirs: list[Path], ds: Dataset, header: list[str], rows: list[dict[str, Any]],
                 skipped: tuple[tuple[int, str], ...], program: str) -> DatasetAttribution:
    first = _summary(dirs[0])
    for d in dirs[1:]:
        other = _summary(d)
        if other["variants"] != first["variants"]:
            raise DeltaError(f"{d} estimated variants {other['variants']}, {dirs[0]} {first['variants']}: give every "
                             f"shard the same steps (the default differs where a shard's records lack a path)")
    axes = tuple((v, tuple(labels)) for v, labels in first["axes"].items())
    variants = tuple(first["variants"])
    rows = [r for r in rows if r["variant"] != "exact"] + [r for r in rows if r["variant"] == "exact"]  # as one run
    return DatasetAttribution(ds, first["sweep"], variants, first["default"], axes, tuple(rows),
                              cell_stats(rows, axes, variants), skipped, program, first["note"])


def _collection(top: Path, dirs: list[Path], skipped: tuple[tuple[int, str], ...], program: str) -> Collection:
    """One index over every part's shards, then the manifest; `program.dl` where the parts measure nothing."""
    entries: list[dict[str, Any]] = []
    manifests = []
    for d in dirs:
        manifests.append(json.loads((d / COLLECTION).read_text(encoding="utf-8")))
        text = (d / INDEX).read_text(encoding="utf-8")
        entries.extend(dict(e, shard=f"{d.name}/{e['shard']}") for e in map(json.loads, text.splitlines()))
    entries.sort(key=lambda e: e["record"])
    tmp = top / (INDEX + ".tmp")
    tmp.write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")
    os.replace(tmp, top / INDEX)
    if not (top / "program.dl").is_file():
        (top / "program.dl").write_text(program, encoding="utf-8")
    shaped = next((m for m in manifests if m.get("records_collected")), manifests[0])
    whole = dict(shaped, records_collected=len(entries),
                 shards=[f"{d.name}/{s}" for d, m in zip(dirs, manifests) for s in m.get("shards", [])],
                 bytes=sum(m.get("bytes", 0) for m in manifests),
                 left_out=[e for m in manifests for e in m.get("left_out", [])])
    whole["left_out"].sort(key=lambda e: e["record"])
    whole.pop("part", None)  # a part's share (`shards.Part`): the merged collection is the whole run's
    tmp = top / (COLLECTION + ".tmp")
    tmp.write_text(json.dumps(whole, indent=1, allow_nan=True), encoding="utf-8")
    os.replace(tmp, top / COLLECTION)
    return Collection(top)
