"""A run over a dataset split across processes: which records shard K of N runs, where it writes, its marks.

    shard = shard_of("1/4") or from_env()        # --shard 1/4; torchrun / accelerate launch: RANK/WORLD_SIZE
    resolutions, part = select(ds, resolutions, shard, out, source, "run", model_id)
    finish(part, shard)                           # DIR/shard-1-of-4/done.json: the shard is complete

`split(tokens, n)` gives each record, in order, to the shard with the fewest tokens so far (a tie: the
lowest number): deterministic from the records' token counts (`record_tokens`) and N, so a shard can be
rerun alone. Shard K writes only `DIR/shard-K-of-N/` (what an unsharded run writes in DIR) and, once
complete, its `done.json`. `DIR/shards.json` (the run's kind, program, model, dataset and N) is created by
the first shard (`os.link`: one writer) and checked by the others; a mismatch is refused before it runs.
`merge` reads the marks. Problems are one-line DeltaErrors. The how-to: docs/shards.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import attrs

from .datasets import Dataset
from .errors import DeltaError

if TYPE_CHECKING:
    from .resolve import RecordResolution

MANIFEST, DONE = "shards.json", "done.json"
CHECKED = ("kind", "program_sha256", "model", "dataset_sha256", "n")


@attrs.frozen
class Shard:
    """Shard `k` (0-based) of `n`."""

    k: int
    n: int

    @property
    def name(self) -> str:
        return f"shard-{self.k}-of-{self.n}"


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
    """Each record's shard (see the module doc): greedy in record order to the shard with the fewest tokens."""
    load = [0] * n
    out = []
    for t in tokens:
        k = min(range(n), key=lambda j: (load[j], j))
        load[k] += t
        out.append(k)
    return out


def record_tokens(r: RecordResolution) -> int:
    """The tokens a record's program runs (1 for a record that does not resolve)."""
    return max(1, sum(len(run.token_ids) for run in r.resolved.runs)) if r.resolved is not None else 1


def dataset_sha256(ds: Dataset) -> str:
    """A hash of the dataset's records: their lines and fields, in record order."""
    text = json.dumps([ds.name, [[r.line, sorted(r.fields.items())] for r in ds.records]])
    return hashlib.sha256(text.encode()).hexdigest()


def select(ds: Dataset, resolutions: list[RecordResolution], shard: Shard | None, out: str | Path | None,
           source: str, kind: str, model: str) -> tuple[list[RecordResolution], Path | None]:
    """The shard's records and where it writes (`DIR/shard-K-of-N`; `out` as it is without a shard)."""
    if shard is None:
        return resolutions, None if out is None else Path(out)
    if kind == "generate":
        raise DeltaError(f"--shard {shard.k}/{shard.n}: a generate over a dataset is not split across processes yet "
                         f"(its parts have no merge); run it in one process")
    mine = [r for r, k in zip(resolutions, split([record_tokens(r) for r in resolutions], shard.n)) if k == shard.k]
    if out is None:
        return mine, None
    top = Path(out)
    meta = {"kind": kind, "program_sha256": hashlib.sha256(source.encode()).hexdigest(), "model": model,
            "dataset_sha256": dataset_sha256(ds), "n": shard.n, "program": source,
            "dataset": {"name": ds.name, "origin": ds.origin, "lines": [r.line for r in ds.records]}}
    _claim(top, meta)
    part = top / shard.name
    (part / DONE).unlink(missing_ok=True)
    return mine, part


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


def check_same(where: Path, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """A DeltaError unless `old` and `new` are parts of one run (kind, program, model, dataset, N)."""
    for key in CHECKED:
        if old.get(key) != new.get(key):
            what = {"kind": "kind of run", "program_sha256": "program", "dataset_sha256": "dataset",
                    "n": "number of shards"}.get(key, key)
            raise DeltaError(f"{where} holds parts of a run with another {what} ({_short(old.get(key))}, this one "
                             f"{_short(new.get(key))}): shards of one run only; give another --out")


def _short(v: Any) -> str:
    return repr(v[:12] + "...") if isinstance(v, str) and len(v) == 64 else repr(v)


def finish(part: Path | None, shard: Shard | None) -> None:
    """Mark shard `shard`'s part complete (after its files are written): its own `done.json`."""
    if part is None or shard is None:
        return
    meta = read_manifest(part.parent)
    done = {key: meta[key] for key in CHECKED} | {"k": shard.k}
    tmp = part / (DONE + ".tmp")
    tmp.write_text(json.dumps(done, indent=1), encoding="utf-8")
    os.replace(tmp, part / DONE)
