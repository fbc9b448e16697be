"""A run over a dataset split across processes: which records shard K of N runs, where it writes, its marks.

    shard = shard_of("1/4") or from_env()        # --shard 1/4; torchrun / accelerate launch: RANK/WORLD_SIZE
    resolutions, part = select(ds, resolutions, shard, out, source, "run", model_id, units)
    finish(part, shard)                           # DIR/shard-1-of-4/done.json: the shard is complete

The split assigns whole units: the groups of records one process runs in one forward (`units`, record
indices; each record alone without them), so a record shares its forward with the same records whatever N
is. `split(tokens, n)` gives each unit, the most tokens first, to the shard with the fewest tokens so far
(ties: the earlier unit, the lowest shard): deterministic from the dataset and N, so a shard can be rerun
alone; the manifest keeps the split's hash. Shard K writes only `DIR/shard-K-of-N/` and, once complete,
its `done.json` (`phase`: a sharded attribution's refine runs in two). `DIR/shards.json` (the run's kind,
program, model, dataset, split and N) is created by the first shard (`os.link`: one writer) and checked
by the others. `read_rows` reads a part's `results.csv`. Problems are one-line DeltaErrors (docs/shards.md).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import attrs

from deltalang.ground.datasets import Dataset
from deltalang.ground.errors import DeltaError

from .dataset_store import META_NAME as PROGRESS

if TYPE_CHECKING:
    from deltalang.language.resolve import RecordResolution

MANIFEST, DONE = "shards.json", "done.json"
CHECKED = ("kind", "program_sha256", "model", "dataset_sha256", "split_sha256", "n")


@attrs.frozen
class Shard:
    """Shard `k` (0-based) of `n`."""

    k: int
    n: int

    @property
    def name(self) -> str:
        return f"shard-{self.k}-of-{self.n}"


@attrs.frozen
class Part:
    """What shard `shard` of a run over a dataset took: `records`, its share of the dataset's records."""

    shard: Shard
    records: int


def part_from(meta: Mapping[str, Any] | None) -> Part | None:
    """A `Part` as a saved manifest keeps it (`{"k", "n", "records"}`; None: none)."""
    return None if not meta else Part(Shard(int(meta["k"]), int(meta["n"])), int(meta["records"]))


def part_of(shard: Shard | None, records: Sequence[Any]) -> Part | None:
    """The part a shard's selected `records` make (None without a shard: the whole run)."""
    return None if shard is None else Part(shard, len(records))


def count_line(name: str, total: int, skipped: int, part: Part | None = None) -> str:
    """A result's first line: the records that ran of dataset `name`'s `total` (`skipped` of them, or of the part's
    share, left out); a shard's part says it is one, and one that took no records says nothing ran."""
    if part is None:
        return f"{total - skipped} of {total} records of '{name}'"
    where = f"shard {part.shard.k}/{part.shard.n}"
    if part.records == 0:
        return (f"{where} has no records of '{name}' (its {total} records went to the other shards, in whole groups "
                f"sharing forwards): nothing ran")
    share = f": its {part.records}, {skipped} left out" if skipped else ""
    return f"{part.records - skipped} of {total} records of '{name}' ({where}{share})"


def shard_of(value: Shard | str | Sequence[int] | None) -> Shard | None:
    """`"K/N"`, `(K, N)` or a `Shard` as a `Shard` (None: none); a DeltaError unless 0 <= K < N."""
    if value is None or isinstance(value, Shard):
        return value
    try:
        k, n = (int(x) for x in (value.split("/") if isinstance(value, str) else value))
    except (TypeError, ValueError):
        raise DeltaError(f"--shard {value!r}: give K/N, shard K (from 0) of N processes, e.g. 0/4") from None
    if not 0 <= k < n:
        raise DeltaError(f"--shard {k}/{n}: K counts from 0 and must be below N (0/{max(n, 1)} .. "
                         f"{max(n, 1) - 1}/{max(n, 1)})")
    return Shard(k, n)


def from_env(environ: Mapping[str, str] | None = None) -> Shard | None:
    """The shard `torchrun` or `accelerate launch` names (`RANK` of `WORLD_SIZE`); None for one process."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    shard = shard_of((env["RANK"], env["WORLD_SIZE"]))
    return shard if shard is not None and shard.n > 1 else None


def launch_device(count: int, environ: Mapping[str, str] | None = None) -> str | None:
    """`cuda:LOCAL_RANK` (modulo the `count` GPUs: more processes than GPUs share them) for a process `torchrun` or
    `accelerate launch` started; None without LOCAL_RANK or without a GPU."""
    env = os.environ if environ is None else environ
    if from_env(env) is None or "LOCAL_RANK" not in env or count < 1:
        return None
    return f"cuda:{int(env['LOCAL_RANK']) % count}"


def split(tokens: Sequence[int], n: int) -> list[int]:
    """Each unit's shard (see the module doc): the most tokens first, each to the shard with the fewest tokens."""
    load = [0] * n
    out = [0] * len(tokens)
    for i in sorted(range(len(tokens)), key=lambda j: (-tokens[j], j)):
        k = min(range(n), key=lambda j: (load[j], j))
        load[k] += tokens[i]
        out[i] = k
    return out


def record_tokens(r: RecordResolution) -> int:
    """The tokens a record's program runs (1 for a record that does not resolve)."""
    return max(1, sum(len(run.token_ids) for run in r.resolved.runs)) if r.resolved is not None else 1


def dataset_sha256(ds: Dataset) -> str:
    """A hash of the dataset's records: their lines and fields, in record order."""
    text = json.dumps([ds.name, [[r.line, sorted(r.fields.items())] for r in ds.records]])
    return hashlib.sha256(text.encode()).hexdigest()


def select(ds: Dataset, resolutions: list[RecordResolution], shard: Shard | None, out: str | Path | None,
           source: str, kind: str, model: str, units: Sequence[Sequence[int]] | None = None, keep_done: bool = False
           ) -> tuple[list[RecordResolution], Path | None]:
    """The shard's records and where it writes (`DIR/shard-K-of-N`; `out` as it is without a shard). `units`: the
    records (indices) that share forwards, which go to one shard together (a record in none: alone). The part's
    `done.json` is removed (it runs again) unless `keep_done` (a refine's second phase reads it first)."""
    if shard is None:
        return resolutions, None if out is None else Path(out)
    by_index = {r.record.index: r for r in resolutions}
    grouped = [list(u) for u in units or ()]
    seen = {i for u in grouped for i in u}
    grouped += [[r.record.index] for r in resolutions if r.record.index not in seen]
    cost = [len(u) * max(record_tokens(by_index[i]) for i in u) for u in grouped]  # padded tokens
    chosen = {i for u, k in zip(grouped, split(cost, shard.n)) if k == shard.k for i in u}
    mine = [r for r in resolutions if r.record.index in chosen]
    if not mine and kind == "sweep":  # a sweep's records, split one by one, are fewer than the shards
        raise DeltaError(f"--shard {shard.k}/{shard.n}: {len(resolutions)} record(s) split in {shard.n} shards leave "
                         f"this one none: run at most {len(resolutions)} shards")
    if out is None:
        return mine, None
    top = Path(out)
    order = sorted(grouped, key=lambda u: u[0])
    meta = {"kind": kind, "program_sha256": hashlib.sha256(source.encode()).hexdigest(), "model": model,
            "dataset_sha256": dataset_sha256(ds), "n": shard.n,
            "split_sha256": hashlib.sha256(json.dumps(order).encode()).hexdigest(), "program": source,
            "dataset": {"name": ds.name, "origin": ds.origin, "lines": [r.line for r in ds.records]}}
    _claim(top, meta)
    part = top / shard.name
    if not keep_done:
        (part / DONE).unlink(missing_ok=True)
    return mine, part


def resumes(part: Path | None, resume: bool) -> bool:
    """Whether a shard's run continues its part: `resume` asked, and the part has started (its `progress.json`,
    which every saved run over a dataset writes first). A resume of a part that never started is its start: a
    job array's failed task is rerun with the same `--shard` and `--resume`, wherever it failed."""
    return resume and (part is None or (part / PROGRESS).is_file())


def _claim(top: Path, meta: dict[str, Any]) -> None:
    """Create `top/shards.json` (first shard to start) or check that it is this run's."""
    try:
        top.mkdir(parents=True, exist_ok=True)
        tmp = top / f".{MANIFEST}.{uuid.uuid4().hex}.tmp"  # this process's own (job arrays: several machines)
        tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
        try:
            os.link(tmp, top / MANIFEST)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        raise DeltaError(f"cannot save results in {top}: {e.strerror or e}") from None
    check_same(top, read_manifest(top), meta)


def read_manifest(top: Path) -> dict[str, Any]:
    try:
        return json.loads((top / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DeltaError(f"{top} holds no {MANIFEST}: not the output of a run with --shard") from None
    except (OSError, ValueError):
        raise DeltaError(f"{top / MANIFEST} does not parse; delete {top} to start over") from None


def check_same(where: Path, old: Mapping[str, Any], new: Mapping[str, Any], fix: str = "give another --out") -> None:
    """A DeltaError unless `old` and `new` are parts of one run (kind, program, model, dataset, N); `fix`: what the
    command that found them can do about it."""
    for key in CHECKED:
        if old.get(key) != new.get(key):
            what = {"kind": "kind of run", "program_sha256": "program", "dataset_sha256": "dataset",
                    "split_sha256": "split of the records (records sharing forwards: give every shard the same "
                                    "options)", "n": "number of shards"}.get(key, key)
            raise DeltaError(f"{where} holds parts of a run with another {what} ({_short(old.get(key))}, this one "
                             f"{_short(new.get(key))}): shards of one run only; {fix}")


def _short(v: Any) -> str:
    return repr(v[:12] + "...") if isinstance(v, str) and len(v) == 64 else repr(v)


def finish(part: Path | None, shard: Shard | None, **extra: Any) -> None:
    """Mark shard `shard`'s part complete (after its files are written): its own `done.json` (with `extra`)."""
    if part is None or shard is None:
        return
    meta = read_manifest(part.parent)
    done = {key: meta.get(key) for key in CHECKED} | {"k": shard.k} | extra
    tmp = part / (DONE + ".tmp")
    tmp.write_text(json.dumps(done, indent=1), encoding="utf-8")
    os.replace(tmp, part / DONE)


def read_done(part: Path) -> dict[str, Any] | None:
    """A part's `done.json`, or None where it has none (or one that does not parse)."""
    try:
        return json.loads((part / DONE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def wrote(out: str | Path, shard: Shard | None, files: str, estimated: bool = False) -> str:
    """The line a command ends with: where it wrote (`out`, the --out DIR; a shard's part in it) and, for a shard,
    how many parts are done and what next (`estimated`: a refine's first phase; every shard runs again)."""
    if shard is None:
        return f"wrote {out}/: {files}"
    top = Path(out)
    dones = [read_done(top / Shard(k, shard.n).name) for k in range(shard.n)]
    if estimated:
        count = sum(d is not None for d in dones)
        then = (f"{count} of {shard.n} shards estimated; once all are, run each again with --refine-from {top} "
                f"(phase 2 of 2), then `deltalang merge {top}`")
    else:
        count = sum(d is not None and d.get("phase") != "estimates" for d in dones)
        then = f"all {shard.n} shards done: `deltalang merge {top}`" if count == shard.n else \
            f"{count} of {shard.n} shards done; once all are, `deltalang merge {top}`"
    return f"wrote {top / shard.name}/ (shard {shard.k}/{shard.n}): {files}; {then}"


def read_rows(part: Path) -> tuple[list[str] | None, list[dict[str, Any]]]:
    """A part's `results.csv`: its header and rows (record and line ints, value a float); (None, []) without one."""
    if not (part / "results.csv").is_file():
        return None, []
    with open(part / "results.csv", newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = [{**r, "record": int(r["record"]), "line": int(r["line"]), "value": float(r["value"])} for r in reader]
        return list(reader.fieldnames or []), rows
