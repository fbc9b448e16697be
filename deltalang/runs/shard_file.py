"""A safetensors file written from tensors as they lie in memory, and a writer thread that takes one at a time.

`write_file(path, tensors)`: `tensors` maps each name to a list of pieces (contiguous CPU tensors of one dtype,
laid end to end: a record axis first is the pieces stacked); the file is what `safetensors.torch.save_file` of
the joined tensors holds, without joining or copying them, flushed and synced to disk (`sync`, which every
file a run saves goes through). `Writer.submit(job)` runs
one job at a time on one thread (`submit` first waits for the one before; a job run is let go, and what it
wrote with it); `wait()` re-raises a job's failure
in the caller, `close()` waits and stops. A collection's shards are written
this way while the next records' forward runs.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

# safetensors' names of torch's dtypes
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def sync(f: Any) -> None:
    """Flush an open file and ask the disk to keep it (a filesystem that cannot is let be)."""
    f.flush()
    try:
        os.fsync(f.fileno())
    except OSError:  # pragma: no cover - some filesystems
        pass


def write_file(path: Path, tensors: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]) -> None:
    """Write `tensors` (name -> a tensor, or pieces joined along a new first axis; see the module doc)."""
    header: dict[str, object] = {}
    data: list[torch.Tensor] = []  # in the file's order
    offset = 0
    for name, given in sorted(tensors.items()):
        pieces = [given] if isinstance(given, torch.Tensor) else list(given)
        first = pieces[0]
        if any(p.dtype != first.dtype or p.shape != first.shape or p.device.type != "cpu" or not p.is_contiguous()
               for p in pieces):
            raise ValueError(f"the pieces of {name} differ in dtype or shape, or are not contiguous CPU tensors")
        size = sum(p.numel() * p.element_size() for p in pieces)
        shape = list(first.shape) if isinstance(given, torch.Tensor) else [len(pieces), *first.shape]
        header[name] = {"dtype": DTYPES[first.dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
        data += pieces
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for p in data:
            if p.numel():
                f.write(memoryview(p.reshape(-1).view(torch.uint8).numpy()))  # the tensor's own bytes, no copy
        sync(f)


class Writer:
    """One thread running submitted jobs in order (see the module doc)."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="deltalang-shard-writer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                if self._failed is None:
                    job()
            except BaseException as e:  # handed to the caller by wait()
                self._failed = e
            finally:
                job = None  # what it wrote is not held while the thread waits for the next
                self._jobs.task_done()
        self._jobs.task_done()

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` on the thread once the one before it has run (a failure before it raised here)."""
        self.wait()
        self._jobs.put(job)

    def wait(self) -> None:
        """Until every submitted job has run; a failure raised here."""
        self._jobs.join()
        self._raise()

    def close(self) -> None:
        """Stop the thread once its job has run (a failure is not raised: `wait()` first for that)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _raise(self) -> None:
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
