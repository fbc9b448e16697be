"""Reads over a dataset collected into sharded safetensors as the run goes (`collect_records`).

    dataset facts = "facts.jsonl"
    trace t on facts { read L[linear].state_after(facts.subject) as s }

Called by `dataset_run.run_dataset` for a program over a dataset that reads; needs `out=DIR`. Each read
of the template is a label named as written (`s.L0`); a record's values are its own, whatever shares its
forward. Writes `shard-NNNNN.safetensors` (fixed-shape labels one tensor per shard, record axis first;
per-token values per record, `t.L1.states@17`, never padded), `index.jsonl` (a record is done when its
line is), `progress.json` first and the manifest `collection.json` last (nothing looks complete before
it). A shard is written once its records' values reach `shard_bytes`, or `shard_seconds` after the one before (a
killed run loses the records since then); a record's values are held until their shard is written, no longer, so
memory holds a group's values and at most two shards. `resume=True` continues the same program, model and shard
size (a group of records with one not saved runs whole, so every record shares its forward with the same
records); a shard no index line names is removed. The output's size is checked against the free disk first.
Problems are DeltaErrors.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch

from deltalang.ground.datasets import Dataset
from deltalang.ground.errors import DeltaError
from deltalang.language import ast
from deltalang.language.ir import Named, Resolved, ResolvedOp, site_text
from deltalang.language.resolve import RecordResolution
from deltalang.models.values import DELTANET

from . import shard_file
from .dataset_store import RecordProgress
from .results import axis_names

SHARD_BYTES = 256 * 2**20
SHARD_SECONDS = 60.0  # a shard at least this often, whatever its size: what a kill can lose
MANIFEST, PROGRESS, INDEX = "collection.json", "progress.json", "index.jsonl"
KIND = "collection"


def shard_name(n: int) -> str:
    return f"shard-{n:05d}.safetensors"


def collects(resolutions: Sequence[RecordResolution]) -> bool:
    """Whether a program over a dataset reads (then it is a collection): its first resolved record's runs."""
    first = next((r.resolved for r in resolutions if r.resolved is not None), None)
    return first is not None and any(op.kind == "read" for run in first.runs for op in run.ops)


@attrs.frozen
class Slot:
    """One read of the template: its label, what it holds, and whether its shape is each record's own."""

    label: str
    value: str
    layer: int | None
    per_record: bool
    block: str = DELTANET  # the kind of the model's recurrent blocks: names the axes (a Mamba-2 state's)
    # the value's axes as read, `b` first (a reduction's or one head's: `ir.Reduce.shape`); None: unnamed
    axes: tuple[str, ...] | None = attrs.field(default=None, converter=lambda a: None if a is None else tuple(a))


def read_label(program: ast.Program, run: str, op: Any) -> str:
    """A read named as the template writes it (the same in every record): its `as` name, else
    `t.L0.state_after(facts.subject)` (a field's position as written)."""
    if op.alias is not None:
        return op.result_name
    site = next((n for n in ast.walk(program) if isinstance(n, ast.Site) and n.span == op.span
                 and op.span != ast.NOSPAN), None)
    pos = op.position if site is None or site.position is None else ast.format_position(site.position)
    return f"{run}.{site_text(op.layer, op.value, pos, head=op.head)}"


def canonical(program: ast.Program, resolved: Resolved) -> tuple[Resolved, dict[str, str]]:
    """A record's program with its reads renamed `RUN.rJ` (no `as` names, so that records merge), and
    {result name: label}. A program whose writes take a read's value (`= NAME`) keeps its names."""
    named = any(isinstance(op.source, Named) for run in resolved.runs for op in run.ops)
    labels: dict[str, str] = {}
    runs = []
    for run in resolved.runs:
        ops = []
        for j, op in enumerate(run.ops):
            if op.kind == "read":
                new = op if named else attrs.evolve(op, alias=None, result_name=f"{run.name}.r{j}")
                labels[new.result_name] = read_label(program, run.name, op)
                op = new
            ops.append(op)
        runs.append(attrs.evolve(run, ops=tuple(ops)))
    return attrs.evolve(resolved, runs=tuple(runs)), labels


def record_tokens(r: RecordResolution) -> int:
    assert r.resolved is not None
    return max(len(run.token_ids) for run in r.resolved.runs)


@attrs.define
class Collected:
    """One group's values, by record: {record: {label: tensor}} and {record: {measure label: value}}."""

    values: dict[int, dict[str, torch.Tensor]]
    measures: dict[int, dict[str, float]]


def read_axes(op: ResolvedOp, ndim: int, block: str = DELTANET) -> tuple[str, ...] | None:
    """The axes of a read's value as served (`ndim` of them, `b` first): a reduction's (`.norm(key_dim,
    value_dim)`: `b, heads`), one head's (the value's without `heads`), else the catalogue's; None if unnamed."""
    if op.reduce is not None:
        return tuple(a for a, _ in op.reduce.shape)
    names = axis_names(op.value, ndim + (op.head is not None), block)
    if names is not None and op.head is not None:
        names = [a for a in names if a != "heads"] if "heads" in names else None
    return None if names is None else tuple(names)


def slots_of(first: Mapping[str, torch.Tensor], ops: Mapping[str, ResolvedOp], block: str = DELTANET) -> list[Slot]:
    """The labels of a record's values (`ops`: each label's read): per record when the value's axes have the
    record's tokens (`s`) or are unnamed; `block`: the kind of the model's recurrent blocks (`Family.block_kind`)."""
    out = []
    for label, v in first.items():
        op = ops[label]
        names = read_axes(op, v.dim() + 1, block)
        out.append(Slot(label, op.value, op.layer, names is None or "s" in names, block, names))
    return out


def estimate(group: Collected, groups: Sequence[Sequence[RecordResolution]], slots: Sequence[Slot]) -> int:
    """Bytes the todo records' values take: per record for fixed shapes, per token for the rest."""
    fixed = {s.label for s in slots if not s.per_record}
    recs = list(group.values)
    per_fixed = sum(v.numel() * v.element_size() for k, v in group.values[recs[0]].items() if k in fixed)
    toks = {r.record.index: record_tokens(r) for g in groups for r in g}
    varying = sum(v.numel() * v.element_size() for i in recs for k, v in group.values[i].items() if k not in fixed)
    per_token = varying / max(1, sum(toks[i] for i in recs))
    n = sum(len(g) for g in groups)
    return int(n * per_fixed + per_token * sum(toks.values()) + 512 * n)  # + headers and index lines


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def check_fits(directory: Path, need: int, n: int) -> None:
    """A DeltaError with the figures if `need` bytes would not fit on the disk holding `directory`."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        raise DeltaError(f"the collection of {n} record(s) needs about {human(need)} in {directory}, and its disk has "
                         f"{human(free)} free: free space, read fewer values (fewer blocks, a head), or choose "
                         f"another --out")


class CollectStore:
    """`DIR/progress.json`, then shards and `DIR/index.jsonl` record by record, then the manifest."""

    def __init__(self, directory: Path, meta: Mapping[str, Any], resume: bool, shard_bytes: int,
                 shard_seconds: float = SHARD_SECONDS) -> None:
        self.dir, self.shard_bytes, self.shard_seconds = directory, shard_bytes, shard_seconds
        self.last_write = time.monotonic()
        self.meta = dict(meta, kind=KIND, done=0, complete=False)
        self.entries: dict[int, dict[str, Any]] = {}
        self.made_dir = not directory.exists()
        self.started = False
        self.buffer: list[tuple[int, dict[str, Any], dict[str, torch.Tensor]]] = []
        self.buffered = 0
        self.slots: list[Slot] = []
        if resume:
            self._resume(meta)
        elif (directory / PROGRESS).exists() and not (directory / MANIFEST).exists():
            raise DeltaError(f"{directory} holds an unfinished collection: rerun with --resume to continue it, or "
                             f"choose another --out")
        self.next_shard = 1 + max((int(e["shard"][6:11]) for e in self.entries.values()), default=-1)
        self.writer = shard_file.Writer()

    @property
    def done(self) -> set[int]:
        return set(self.entries)

    def _resume(self, meta: Mapping[str, Any]) -> None:
        try:
            old = json.loads((self.dir / PROGRESS).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DeltaError(f"nothing to resume in {self.dir}: it holds no {PROGRESS}") from None
        except (OSError, ValueError):
            raise DeltaError(f"{self.dir / PROGRESS} does not parse; delete {self.dir} to start over") from None
        for key in ("kind", "program_sha256", "model", "shard_bytes"):
            if old.get(key) != self.meta.get(key):
                raise DeltaError(f"{self.dir} holds a run with another {key.replace('_sha256', '')} "
                                 f"({old.get(key)!r}, this one {self.meta.get(key)!r}): --resume continues the "
                                 f"same collection only")
        self.slots = [Slot(**s) for s in old.get("slots", [])]
        path = self.dir / INDEX
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        for line in text[: text.rfind("\n") + 1].splitlines():  # a torn last line is dropped
            e = json.loads(line)
            if (self.dir / e["shard"]).is_file():
                self.entries[e["record"]] = e
        named = {e["shard"] for e in self.entries.values()}
        for f in self.dir.glob("shard-*.safetensors"):
            if f.name not in named:  # written, but its records never indexed
                f.unlink()

    def start(self, slots: Sequence[Slot]) -> None:
        """Create DIR and its `progress.json` (and rewrite the index without torn lines)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DeltaError(f"cannot save results in {self.dir}: {e.strerror or e}") from None
        self.slots = self.slots or list(slots)
        self.meta["slots"] = [attrs.asdict(s) for s in self.slots]
        self.meta["done"] = len(self.entries)
        (self.dir / MANIFEST).unlink(missing_ok=True)
        self._write_meta()
        with open(self.dir / INDEX, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(self.entries[i]) + "\n" for i in sorted(self.entries))
            shard_file.sync(f)
        self.started = True

    def _write_meta(self) -> None:
        tmp = self.dir / (PROGRESS + ".tmp")
        tmp.write_text(json.dumps(self.meta, indent=1), encoding="utf-8")
        os.replace(tmp, self.dir / PROGRESS)

    def add(self, record: int, entry: dict[str, Any], values: dict[str, torch.Tensor]) -> None:
        """Buffer a record's values; write a shard once `shard_bytes` are buffered or `shard_seconds` have passed
        since the last shard."""
        self.buffer.append((record, entry, values))
        self.buffered += sum(v.numel() * v.element_size() for v in values.values())
        if self.buffered >= self.shard_bytes or time.monotonic() - self.last_write >= self.shard_seconds:
            self.flush()

    def flush(self) -> None:
        """Hand the buffered records to the writer thread as one shard (written and synced, then indexed, while
        the next records run; the shard before it finished first)."""
        if not self.buffer:
            return
        name = shard_name(self.next_shard)
        tensors: dict[str, torch.Tensor | list[torch.Tensor]] = {}
        for s in self.slots:
            if s.per_record:
                tensors.update({f"{s.label}@{i}": v[s.label].contiguous() for i, _, v in self.buffer})
            else:
                tensors[s.label] = [v[s.label].contiguous() for _, _, v in self.buffer]  # stacked as written
        buffer = self.buffer
        self.writer.submit(lambda: self._write_shard(name, tensors, buffer))
        self.next_shard += 1
        self.buffer, self.buffered, self.last_write = [], 0, time.monotonic()

    def _write_shard(self, name: str, tensors: Mapping[str, torch.Tensor | list[torch.Tensor]],
                     buffer: list[tuple[int, dict[str, Any], dict[str, torch.Tensor]]]) -> None:
        """(On the writer thread.) The shard, synced, then its records' index lines, synced, then the progress."""
        tmp = self.dir / (name + ".tmp")
        shard_file.write_file(tmp, tensors)
        os.replace(tmp, self.dir / name)
        with open(self.dir / INDEX, "a", encoding="utf-8") as f:
            for row, (i, entry, _) in enumerate(buffer):
                self.entries[i] = dict(entry, shard=name, row=row)
                f.write(json.dumps(self.entries[i]) + "\n")
            shard_file.sync(f)
        self.meta["done"] = len(self.entries)
        self._write_meta()

    def finish(self, manifest: Mapping[str, Any], write_rest: Callable[[Path], None]) -> None:
        """Write the last shard, the other files, then the manifest; the run is complete."""
        self.flush()
        self.writer.wait()
        self.writer.close()
        write_rest(self.dir)
        shards = sorted({e["shard"] for e in self.entries.values()})
        whole = dict(manifest, kind=KIND, records_collected=len(self.entries), shards=shards,
                     bytes=sum((self.dir / s).stat().st_size for s in shards), shard_bytes=self.shard_bytes,
                     reads=[dict(attrs.asdict(s), **self._shape(s)) for s in self.slots])
        tmp = self.dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(whole, indent=1, allow_nan=True), encoding="utf-8")
        os.replace(tmp, self.dir / MANIFEST)
        self.meta["complete"] = True
        self._write_meta()

    def _shape(self, s: Slot) -> dict[str, Any]:
        """A label's shape (per row; None per record), axes and dtype, read from its first shard."""
        from safetensors import safe_open

        first = min(self.entries.values(), key=lambda e: (e["shard"], e["row"]), default=None)
        if first is None:
            return {"shape": None, "axes": None, "dtype": None}
        with safe_open(str(self.dir / first["shard"]), "pt") as f:
            key = f"{s.label}@{first['record']}" if s.per_record else s.label
            sl = f.get_slice(key)
            shape, dtype = list(sl.get_shape()), sl.get_dtype()
        full = s.axes if s.axes is not None else axis_names(s.value, len(shape) + (1 if s.per_record else 0), s.block)
        axes = ["record", *full[1:]] if full is not None else None
        return {"shape": None if s.per_record else shape[1:], "axes": axes, "dtype": dtype}

    def abandon(self) -> None:
        """After a failure: with no record indexed, remove what was written (and DIR if made here). A shard being
        written is finished first (a failure of its own is dropped: the run's failure is the one raised)."""
        try:
            self.writer.wait()
        except Exception:
            pass
        self.writer.close()
        if self.entries or not self.started:
            return
        for f in [*self.dir.glob("shard-*.safetensors*"), self.dir / INDEX, self.dir / PROGRESS]:
            f.unlink(missing_ok=True)
        if self.made_dir:
            try:
                self.dir.rmdir()
            except OSError:
                pass


def prepare(program: ast.Program, resolutions: Sequence[RecordResolution], done: set[int]) \
        -> tuple[list[RecordResolution], dict[int, dict[str, str]]]:
    """The records to run, their programs `canonical` (so that they share forwards), and their labels."""
    todo, labels = [], {}
    for r in resolutions:
        if r.resolved is not None and r.record.index not in done:
            res, labels[r.record.index] = canonical(program, r.resolved)
            todo.append(RecordResolution(r.record, res, None))
    return todo, labels


def run_group(group: Sequence[RecordResolution], labels: Mapping[int, Mapping[str, str]],
              run: Callable[[Resolved], Any], merge: Callable[[list[tuple[int, Resolved]]], Resolved],
              measure_label: Callable[[str, Any], str]) -> Collected:
    """A group's values by record and label (each record's own: the batch axis dropped), and its measures.
    Taken read by read, each read's batch tensor dropped once every record's row of it is copied out, so that
    the group's values and its forward's outputs are never all held at once."""
    parts = [(r.record.index, r.resolved) for r in group if r.resolved is not None]
    results = run(merge(parts))
    keys = {i: f"#{i}" if len(parts) > 1 else "" for i, _ in parts}
    measures = {i: {measure_label(run_.name, m): float(results[_key(m.result_name, keys[i])])
                    for run_ in res.runs for m in run_.measures} for i, res in parts}
    served = {(i, name): results[_key(name, keys[i])] for i, _ in parts for name in labels[i]}
    del results  # the served tensors are now held by `served` only
    values: dict[int, dict[str, torch.Tensor]] = {i: {} for i, _ in parts}
    for name in dict.fromkeys(n for i, _ in parts for n in labels[i]):  # read by read: its rows, then its batch
        for i, _ in parts:
            if name in labels[i]:
                values[i][labels[i][name]] = _own(served.pop((i, name))[0])
    return Collected({i: {label: values[i][label] for label in labels[i].values()} for i, _ in parts}, measures)


def _own(value: torch.Tensor) -> torch.Tensor:
    """A record's value kept until its shard is written: the tensor itself where it is all of its own memory
    (a read's row, made for it), else a copy (a view would keep a whole batch's tensor alive)."""
    value = value.detach().cpu()
    whole = value.is_contiguous() and value.untyped_storage().nbytes() == value.numel() * value.element_size()
    return value if whole else value.clone()


def _key(name: str, k: str) -> str:
    """A result's name in a merged program: `t#3.r0` for `t.r0` (record 3's runs renamed `t#3`)."""
    if not k:
        return name
    run, _, rest = name.partition(".")
    return f"{run}{k}" + (f".{rest}" if rest else "")


def reads_of(resolved: Resolved, labels: Mapping[str, str]) -> dict[str, ResolvedOp]:
    """{label: read} of a record's reads (`labels`: its result names' labels)."""
    return {labels[op.result_name]: op for run in resolved.runs for op in run.ops
            if op.kind == "read" and op.result_name is not None}


def collect_groups(program: ast.Program, ds: Dataset, groups: list[list[RecordResolution]], store: CollectStore,
                   ready: list[Collected], run: Callable[[list[RecordResolution]], Collected],
                   progress: RecordProgress, on_group: Callable[[list[int]], None] | None) -> dict[int, dict[str, float]]:
    """Write each group's records to the store; the measures of every record done. `ready`: the first group's
    values if already run, taken out of the list, so that no group's values outlive their turn (the store holds
    them until their shard is written)."""
    measures: dict[int, dict[str, float]] = {i: e.get("measures", {}) for i, e in store.entries.items()}
    with progress as bar:
        for group in groups:
            got = ready.pop() if ready else run(group)
            new = [r for r in group if r.record.index not in store.entries]  # resumed: a group rerun whole
            for r in new:
                i = r.record.index
                entry = {"record": i, "line": r.record.line, "fields": dict(r.record.fields),
                         "tokens": record_tokens(r), "measures": got.measures[i]}
                store.add(i, entry, got.values[i])
                measures[i] = got.measures[i]
            del got  # before the next group runs
            bar.advance(len(new), len(new))
            if on_group is not None:
                on_group([r.record.index for r in new])
    return measures
