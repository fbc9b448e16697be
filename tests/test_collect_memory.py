"""What a collection holds in memory, and what a killed one keeps on disk.

A collection holds a group's values and at most two shards (docs/benchmarks.md, "Collecting the memory over a
dataset"): counted here as the bytes of every tensor Python can reach (`live_bytes`), not the process's size,
which the allocator decides. A shard is also written on a time bound, so a killed run keeps what it wrote and
`resume` continues it to the collection an uninterrupted run makes (its tensors equal).
"""

from __future__ import annotations

import gc
import json
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import deltalang
from deltalang.runs import collect, records
from deltalang.runs.dataset_run import run_dataset

RECORDS = [
    {"prompt": "The Eiffel Tower is in the city of", "subject": "Eiffel Tower"},
    {"prompt": "The Blue Mosque is in the city of Istanbul the Leaning Tower is in the city of",
     "subject": "Leaning Tower"},
    {"prompt": "The Blue Mosque is in", "subject": "Blue Mosque"},
    {"prompt": "The Space Needle is in the city of Seattle the Eiffel Tower is in the city of Paris the "
               "Brandenburg Gate is in the city of", "subject": "Brandenburg Gate"},
    {"prompt": "The Space Needle is in the city of", "subject": "Space Needle"},
    {"prompt": "The Brandenburg Gate is in the city of Berlin the Space Needle is in", "subject": "Space Needle"},
]
PROGRAM = """dataset facts = "facts.jsonl"
trace t on facts {
    read L[linear].states as st
    read L[linear].state_after(facts.subject) as s
}
"""


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


def _program(tmp: Path) -> tuple[str, str]:
    (tmp / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    (tmp / "p.dl").write_text(PROGRAM, encoding="utf-8")
    return PROGRAM, str(tmp / "p.dl")


def live_bytes() -> int:
    """The bytes of every tensor storage Python can reach (each storage once)."""
    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for t in tensors:
        if t.device.type == "cpu":
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def record_bytes(col: deltalang.Collection) -> list[int]:
    """Each record's values, in bytes."""
    return [sum(v.numel() * v.element_size() for v in col[n][1].values()) for n in range(len(col))]


def test_no_group_is_held_after_its_shard_is_written(tmp_path: Path, model: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Between groups only the store's shards are held (one shard a record here: at most two records), never a
    group that ran before (the first group was held to the end, and each group until the next one had run)."""
    monkeypatch.setattr(records, "MAX_GROUP", 2)  # records sharing forwards, three groups
    source, filename = _program(tmp_path)
    base = live_bytes()
    held: list[int] = []
    col = run_dataset(source, model, filename=filename, out=tmp_path / "out", shard_bytes=1,
                      on_group=lambda _: held.append(live_bytes() - base))
    biggest = max(record_bytes(col))
    assert len(held) == 3 and len(col) == len(RECORDS)
    assert max(held) <= 2 * biggest + 2**16, (held, biggest)  # two shards of one record, and small change


def test_a_group_copies_its_values_read_by_read(tmp_path: Path, model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's values are copied out of the forward's batch tensors one read at a time, each batch tensor
    dropped once its rows are copied: never the whole group's values beside every batch tensor."""
    source, filename = _program(tmp_path)
    seen: list[tuple[int, int]] = []  # (live bytes, the storage of the value being copied) at each copy
    own = collect._own

    def watched(value: torch.Tensor) -> torch.Tensor:
        seen.append((live_bytes(), value.untyped_storage().nbytes()))
        return own(value)

    monkeypatch.setattr(collect, "_own", watched)
    col = run_dataset(source, model, filename=filename, out=tmp_path / "out")  # one group, rows of batch tensors
    assert len(seen) == len(RECORDS) * 2 * len(model.spec.linear_layers()) and len(col) == len(RECORDS)
    first, batch = seen[0][0], max(b for _, b in seen)
    assert sum(record_bytes(col)) > 2 * batch  # what holding every copy beside every batch tensor would add
    assert max(live for live, _ in seen) - first <= batch, (seen, batch)


def test_a_shard_is_written_on_the_time_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Far below the shard size, a shard is written once `shard_seconds` have passed since the last."""
    now = [0.0]
    monkeypatch.setattr(collect.time, "monotonic", lambda: now[0])
    store = collect.CollectStore(tmp_path / "out", {"program_sha256": "x", "model": "m"}, False, 2**30, 60.0)
    value = {"s": torch.arange(4.0)}
    store.start(collect.slots_of(value, {"s": _FakeRead()}))
    store.add(0, {"record": 0, "line": 1}, value)
    now[0] = 59.0
    store.add(1, {"record": 1, "line": 2}, value)
    store.writer.wait()
    assert not list((tmp_path / "out").glob("shard-*")) and store.entries == {}
    now[0] = 60.0
    store.add(2, {"record": 2, "line": 3}, value)
    store.writer.wait()
    assert sorted(store.entries) == [0, 1, 2] and [p.name for p in (tmp_path / "out").glob("shard-*")] == [
        "shard-00000.safetensors"]
    now[0] = 100.0
    store.add(3, {"record": 3, "line": 4}, value)  # 40 s after the last shard
    store.writer.wait()
    assert sorted(store.entries) == [0, 1, 2]
    store.writer.close()


class _FakeRead:
    """What `slots_of` asks of a read: a value with no reduction and no head."""

    value, layer, reduce, head = "state_output", 0, None, None


KILLED = """
import os, signal, sys
import torch
import deltalang
from deltalang.runs.dataset_run import run_dataset
torch.set_num_threads(int(sys.argv[3]))  # the test's: the same bits
done = []
def kill(indices):
    done.extend(indices)
    if len(done) >= 3:
        os.kill(os.getpid(), signal.SIGKILL)
run_dataset(open(sys.argv[1]).read(), deltalang.load_model(), filename=sys.argv[1], out=sys.argv[2], batch=False,
            shard_seconds=0, on_group=kill)
"""


def test_a_killed_collection_keeps_its_shards_and_resumes_to_the_same_tensors(tmp_path: Path, model: Any) -> None:
    """Killed (SIGKILL) after three records, far below one shard's size: the records written on the time bound are
    on disk; `resume` runs the rest, and every tensor equals an uninterrupted run's."""
    source, filename = _program(tmp_path)
    out = tmp_path / "out"
    got = subprocess.run([sys.executable, "-c", KILLED, filename, str(out), str(torch.get_num_threads())],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == -signal.SIGKILL, got.stderr
    assert not (out / "collection.json").exists()
    kept = [json.loads(line)["record"] for line in (out / "index.jsonl").read_text().splitlines()]
    assert len(kept) >= 2, kept  # each record's shard written (the third's perhaps not yet when killed)
    rerun: list[int] = []
    col = run_dataset(source, model, filename=filename, out=out, batch=False, resume=True, on_group=rerun.extend)
    whole = run_dataset(source, model, filename=filename, out=tmp_path / "whole", batch=False)
    assert sorted(rerun) == sorted(set(range(len(RECORDS))) - set(kept))
    assert len(col) == len(whole) == len(RECORDS)
    for n in range(len(RECORDS)):
        (rec, got_values), (want_rec, want) = col[n], whole[n]
        assert rec == want_rec and got_values.keys() == want.keys()
        assert all(torch.equal(got_values[k], want[k]) for k in want), n
