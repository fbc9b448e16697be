"""deltalang.runs.shard_file: the safetensors files a collection writes from its tensors in place, read back by
safetensors itself, and the writer thread's order and failures."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltalang.runs import shard_file


def test_a_file_written_from_pieces_is_what_safetensors_saves_of_them_stacked(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    pieces = [torch.randn(3, 5, generator=gen) for _ in range(4)]
    alone = torch.randn(2, 7, generator=gen).to(torch.bfloat16)
    ints = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    flags = torch.tensor([True, False, True])
    ours = tmp_path / "ours.safetensors"
    shard_file.write_file(ours, {"s.L0": pieces, "t@3": alone, "ids": [ints], "mask": flags, "empty": torch.zeros(0)})
    want = {"s.L0": torch.stack(pieces), "t@3": alone, "ids": ints[None], "mask": flags, "empty": torch.zeros(0)}
    theirs = tmp_path / "theirs.safetensors"
    save_file(want, str(theirs))
    got = load_file(str(ours))
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    with safe_open(str(ours), "pt") as f:
        assert f.get_slice("s.L0").get_shape() == [4, 3, 5]
    data = sum(v.numel() * v.element_size() for v in want.values())
    assert ours.stat().st_size - data == 8 + int.from_bytes(ours.read_bytes()[:8], "little")  # nothing else in it


def test_pieces_that_do_not_stack_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="s.L0"):
        shard_file.write_file(tmp_path / "x.safetensors", {"s.L0": [torch.zeros(2), torch.zeros(3)]})
    with pytest.raises(ValueError, match="contiguous"):
        shard_file.write_file(tmp_path / "x.safetensors", {"s": [torch.zeros(4, 4).t()]})


def test_the_writer_runs_jobs_one_at_a_time_in_order_off_the_callers_thread() -> None:
    writer = shard_file.Writer()
    seen: list[tuple[int, bool]] = []
    main = threading.get_ident()
    for n in range(5):
        writer.submit(lambda n=n: seen.append((n, threading.get_ident() != main)))
    writer.wait()
    writer.close()
    assert seen == [(n, True) for n in range(5)]


def test_a_failed_job_is_raised_in_the_caller_and_the_jobs_after_it_do_not_run() -> None:
    writer = shard_file.Writer()
    ran: list[int] = []

    def fail() -> None:
        raise OSError("disk full")

    writer.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        writer.submit(lambda: ran.append(1))
    writer.wait()  # raised once
    writer.close()
    assert ran == []
