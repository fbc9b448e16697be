"""Records to forwards: the one step every run over a dataset starts with, and the one it ends with.

    recs = open_records(program, source, spec, kind=None, shard=..., out=..., resume=..., strict=..., ...)
    recs.ds, recs.resolutions, recs.groups, recs.labels, recs.skipped, recs.part, recs.share, recs.out, recs.resume
    ... run recs.groups, saving each group's outputs in a store ...
    close_records(result, store, recs)

`open_records` loads the program's datasets (`load_datasets`), resolves each record's plain program, groups the
records that share a forward (`forward_groups`: by length, `MAX_GROUP` records and `plan.BATCH_TOKENS` padded
tokens at most; a generate's by prompt length, a collection's programs made `canonical`; a sweep's records each
alone), takes a shard's whole groups (`shards.select`), and names the records left out (`left_out`; `strict`: the
first is the error). `close_records` saves a result where the run wrote, closes its store and marks a shard's
part done. `dataset_run` (runs, generates, collections) and `sweep.dataset` (sweeps, attribution) go through both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import attrs

from deltalang.compiler.plan import BATCH_TOKENS
from deltalang.ground.datasets import Dataset, dataset_from_python, load_dataset
from deltalang.ground.errors import DeltaError, RecordsWarning, warn
from deltalang.language import ast
from deltalang.language.ir import Mean, Named, Resolved
from deltalang.language.resolve import RecordResolution, resolve_records
from deltalang.language.resolve.dataset import dataset_decls
from deltalang.models.spec import ModelSpec

from .collect import collects, prepare
from .dataset_generate import generate_groups, generates
from .dataset_store import RecordStore
from .shards import Part, Shard, finish, part_of, resumes, select, shard_of

MAX_GROUP = 32  # records per program when records share forwards


@attrs.frozen
class Records:
    """A run over a dataset, opened: this process's records (a shard's, or all), grouped into forwards."""

    ds: Dataset
    kind: str  # "run", "generate", "collection" or "sweep"
    resolutions: list[RecordResolution]  # this process's records, resolved or not
    groups: list[list[RecordResolution]]  # of those that resolve, the records sharing each forward
    labels: dict[int, dict[str, str]]  # a collection's result labels per record (`collect.prepare`)
    skipped: tuple[tuple[int, str], ...]  # the records left out: (index, why)
    part: Shard | None  # the shard this process runs
    share: Part | None  # the shard's share of the records, as the count lines say it
    out: Path | None  # where this process writes (a shard's part directory)
    resume: bool  # whether the run continues what `out` holds (a part never started is a start)


def open_records(program: ast.Program, source: str, spec: ModelSpec, *, kind: str | None = None,
                 filename: str = "<program>", data: Mapping[str, Any] | None = None,
                 datasets: Mapping[str, Dataset] | None = None, strict: bool = False, batch: bool = True,
                 shard: Any = None, out: str | Path | None = None, resume: bool = False, keep_done: bool = False,
                 vet: Callable[[list[RecordResolution]], None] | None = None) -> Records:
    """The records of `program`'s dataset to run (see the module doc). `kind`: "sweep", or None to tell a run, a
    generate and a collection apart by what the records' programs do. `keep_done`: as `shards.select`'s.
    `vet(resolutions)`: a path's own refusals, over every record before anything is written."""
    if resume and out is None:
        raise DeltaError("--resume continues the run in an --out directory: give --out DIR")
    if datasets is None:
        datasets = load_datasets(program, filename, data)
    ds, resolutions = resolve_records(program, datasets, spec, source=source, filename=filename)
    if vet is not None:
        vet(resolutions)
    if kind is None:
        kind = "generate" if generates(resolutions) else "collection" if collects(resolutions) else "run"
    part = shard_of(shard)
    groups, labels = forward_groups(program, resolutions, kind, batch)  # over every record: a shard takes whole ones
    units = None if kind == "sweep" else [[r.record.index for r in g] for g in groups]  # a sweep's: one by one
    resolutions, where = select(ds, resolutions, part, out, source, kind, spec.model_id, units, keep_done=keep_done)
    mine = {r.record.index for r in resolutions}
    return Records(ds=ds, kind=kind, resolutions=resolutions, groups=[g for g in groups if g[0].record.index in mine],
                   labels=labels, skipped=left_out(ds, resolutions, strict), part=part,
                   share=part_of(part, resolutions), out=where,
                   resume=resumes(None if part is None or where is None else where, resume))


def close_records(result: Any, store: RecordStore | None, recs: Records) -> None:
    """A run's end where it wrote: `result.save(out)`, its store closed, a shard's part marked done."""
    if recs.out is not None and store is not None:
        result.save(recs.out)
        store.finish()
        finish(recs.out, recs.part)


def load_datasets(program: ast.Program, filename: str, data: Mapping[str, Any] | None) -> dict[str, Dataset]:
    """The program's datasets: `data`'s (from Python) first, else each declared file, relative to the .dl file."""
    out = {name: dataset_from_python(name, d) for name, d in (data or {}).items()}
    base = Path(filename).parent if not filename.startswith("<") else Path.cwd()
    for decl in dataset_decls(program):
        if decl.name not in out:
            path = Path(decl.path) if Path(decl.path).is_absolute() else base / decl.path
            out[decl.name] = load_dataset(decl.name, path, shown=str(path))
    return out


def forward_groups(program: ast.Program, resolutions: list[RecordResolution], kind: str, batch: bool) \
        -> tuple[list[list[RecordResolution]], dict[int, dict[str, str]]]:
    """The groups of records that share forwards, over every record that resolves, as one process forms them
    (a collection's programs `canonical`, with their labels): a shard runs whole groups (`deltalang.runs.shards`)."""
    good = [r for r in resolutions if r.resolved is not None]
    if kind == "generate":
        return generate_groups(good, batch), {}
    if kind == "collection":
        todo, labels = prepare(program, good, set())
        return record_groups(todo, batch), labels
    if kind == "sweep":  # each record its own sweep
        return [[r] for r in good], {}
    return record_groups(good, batch), {}


def left_out(ds: Dataset, resolutions: list[RecordResolution], strict: bool) -> tuple[tuple[int, str], ...]:
    """The records whose program does not resolve, (index, why); with `strict` the first is the error.
    Each record's warnings are shown once."""
    _warn_once(ds, resolutions)
    skipped = tuple((r.record.index, _one_line(r.error)) for r in resolutions if r.error is not None)
    if skipped and strict:
        i, why = skipped[0]
        raise DeltaError(f"{ds.where(ds.records[i])}: record {i + 1} of '{ds.name}' does not resolve (--strict): "
                         f"{why}")
    return skipped


def _warn_once(ds: Dataset, resolutions: list[RecordResolution]) -> None:
    """Each record's warnings, each message once, naming the first record that gave it."""
    seen: set[str] = set()
    for r in resolutions:
        for w in r.resolved.warnings if r.resolved is not None else ():
            if w.message not in seen:
                seen.add(w.message)
                if not isinstance(w, RecordsWarning):  # one about many records names them itself
                    w.notes = (*w.notes, f"in record {r.record.index + 1} ({ds.where(r.record)})")
                warn(w)


def record_groups(resolutions: list[RecordResolution], batch: bool) -> list[list[RecordResolution]]:
    """Records that share forwards: sorted by length (little padding), at most `MAX_GROUP` records and
    `BATCH_TOKENS` padded tokens per run a group; a record whose program cannot be renamed apart runs alone.

    Runs of different lengths in one forward are left-padded; each value is still the run's own (see
    `deltalang.compiler.plan`)."""
    alone: list[list[RecordResolution]] = []
    mergeable: list[tuple[int, RecordResolution]] = []
    for r in resolutions:
        assert r.resolved is not None
        if not batch or not _mergeable(r.resolved):
            alone.append([r])
        else:
            mergeable.append((max(len(run.token_ids) for run in r.resolved.runs), r))
    out: list[list[RecordResolution]] = []
    current: list[RecordResolution] = []
    for n, r in sorted(mergeable, key=lambda x: x[0]):
        if current and (len(current) >= MAX_GROUP or (len(current) + 1) * n > BATCH_TOKENS):
            out.append(current)
            current = []
        current.append(r)
    return out + ([current] if current else []) + alone


def _mergeable(resolved: Resolved) -> bool:
    """Whether the program's runs can be renamed apart: no `as` names, `= NAME` or mean sources, no generate."""
    for run in resolved.runs:
        if run.kind != "trace" or any(m.alias is not None for m in run.measures):
            return False
        if any(op.alias is not None or isinstance(op.source, (Named, Mean)) for op in run.ops):
            return False
    return True


def _one_line(e: DeltaError | None) -> str:
    """An error's message on one line, without its location (the record's line stands for it)."""
    return "" if e is None else " ".join(str(e.message).split())
