"""Batch sizes: rows per forward from a memory budget, and clean captures split into waves.

Contract: `batch_for` gives a sweep's rows per forward (as asked, else what a
resumed sweep used, else from `memory_budget`); `waves` splits start positions
so one capture's prefix states stay under PREFIX_BYTES (a constant, so a resumed
sweep splits exactly as an uninterrupted one).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from deltalang.runtime.model import DeltaModel

from .job import Cell, SweepJob, start_of
from .recompute import decoder_config, device_of, weights_dtype

MAX_ROWS = {"cpu": 64, "cuda": 512}  # rows per forward at most, by device type


def memory_budget(device: torch.device) -> int:
    """Bytes a sweep's forwards may use: half the free GPU memory, else a quarter of free RAM (at most 4 GiB)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free // 2)
    available = 8 << 30
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(min(available // 4, 4 << 30))


def row_bytes(model: DeltaModel, positions: int) -> int:
    """A generous estimate of one row's activations through one block at `positions` positions."""
    cfg = decoder_config(model)
    d = model.spec.dims
    hidden = int(cfg.hidden_size)
    inter = int(getattr(cfg, "intermediate_size", None) or 4 * hidden)
    dtype = weights_dtype(model)
    size = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 4
    per_token = (12 * hidden + 4 * inter + 3 * d.get("conv_dim", hidden) + 4 * d["heads"] * 64) * max(size, 4)
    state = d["heads"] * d["key_dim"] * d["value_dim"] * 4
    return positions * per_token + 6 * state + int(getattr(cfg, "vocab_size", 0)) * 4


def default_batch_size(model: DeltaModel, positions: int) -> int:
    """Rows per forward that fit the memory budget (at most 64 on a CPU, 512 on a GPU)."""
    device = device_of(model)
    cap = MAX_ROWS.get(device.type, MAX_ROWS["cpu"])
    return max(1, min(cap, memory_budget(device) // max(1, row_bytes(model, positions))))


def chunks(items: Sequence[Any], size: int) -> Iterator[list[Any]]:
    """`items` in consecutive lists of `size` (the last may be shorter)."""
    for i in range(0, len(items), size):
        yield list(items[i:i + size])


PREFIX_BYTES = 1 << 30  # the clean states one capture keeps, at most (a constant: resumed runs split alike)


def waves(model: DeltaModel, groups: Mapping[int, list[Cell]]) -> list[dict[int, list[Cell]]]:
    """Start positions split into waves whose prefix states fit PREFIX_BYTES: one clean capture each."""
    d = model.spec.dims
    per_start = len(model.spec.recurrent_layers()) * 4 * (d["heads"] * d["key_dim"] * d["value_dim"]
                                                       + d["conv_dim"] * d["conv_width"])
    size = max(1, PREFIX_BYTES // max(1, per_start))
    starts = list(groups)
    return [{t: groups[t] for t in starts[i:i + size]} for i in range(0, len(starts), size)]


def batch_for(model: DeltaModel, job: SweepJob, asked: int | None, old: Mapping[str, Any] | None) -> int:
    """Rows per forward: as asked, else what a resumed sweep used, else from the memory budget."""
    if asked is not None:
        return asked
    previous = old.get("batch_size", {}) if old is not None else {}
    if isinstance(previous, dict) and isinstance(previous.get(job.name), int):
        return int(previous[job.name])
    s = len(job.run.token_ids)
    if job.fast:
        first = min(min(start_of(op)[1] for op in job.writes(c)) for c in job.cells)
        return default_batch_size(model, max(1, s - first))
    return default_batch_size(model, s)
