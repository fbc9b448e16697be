"""A reduction of `states` computed inside the forward: `measure norm(L[linear].states)` against a plain forward.

Side by side in one run, on a random model with Qwen3.5-0.8B's shapes (18 DeltaNet blocks, 16 heads of
128 x 128), one prompt of N tokens:
  plain    transformers' forward (logits of the last position only, as the compiled program asks)
  reduced  the compiled deltalang program `measure norm(L[linear].states)`: the state after every token of
           every DeltaNet block, reduced to its norm a group of chunks at a time (the full
           `[s, 16, 128, 128]` states, 1 GiB per 1,024 tokens per block, never exist)
Both sides run in one process on one model (built once: a random 0.8B model takes minutes to make on a
shared CPU), alternating; before each run the process's high-water mark is reset (/proc/self/clear_refs),
so each run's peak resident memory (VmHWM) is its own; times are medians over the repeats, wall and CPU.
Targets: peak within 1.2x of plain, time within 1.3x. The load average before and after is printed with the
table: on a shared machine the wall times are mostly waiting, and the CPU times are the comparison.

    python benchmarks/reductions.py [--tokens 1024] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).parent))

PROGRAM = "measure norm(L[linear].states)\n"


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measured(fn: Callable[[], object]) -> dict[str, float]:
    """One run of `fn`: wall and CPU seconds, the peak resident memory while it ran, the size before it."""
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS from here on
        f.write("5")
    rest, c0, t0 = _status("VmRSS"), _cpu(), time.perf_counter()
    out = fn()
    seconds, cpu = time.perf_counter() - t0, _cpu() - c0
    del out
    return {"seconds": seconds, "cpu": cpu, "peak": _status("VmHWM"), "rest": rest}


def _run_ids(model: object, ids: object) -> dict:
    """The code `deltalang emit` prints for PROGRAM, on a prompt given as ids (tests/test_reductions.py checks
    that the emitted code calls the same `states_reduced(Reduction(...))`)."""
    import torch

    from deltalang import measures
    from deltalang.models.values import axes

    red = measures.Reduction(axes("states"), [("norm", None)])
    saved = {}
    with torch.no_grad(), model.trace(ids, logits_to_keep=1):  # type: ignore[attr-defined]
        for i in model.spec.linear_layers():  # type: ignore[attr-defined]
            saved[i] = model.layers[i].linear_attn.states_reduced(red).save()  # type: ignore[attr-defined]
    return {f"main.norm(L{i}.states)": measures.reduced(v) for i, v in saved.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    import torch
    from common import machine, qwen35_08b_shaped, tokenizer_for

    from deltalang.runtime.model import wrap_model

    torch.set_grad_enabled(False)
    hf = qwen35_08b_shaped()
    model = wrap_model(hf, tokenizer_for(), "random Qwen3.5-0.8B-shaped")
    ids = torch.randint(3, 248000, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    sides: dict[str, Callable[[], object]] = {"plain": lambda: hf(ids, logits_to_keep=1),
                                              "reduced": lambda: _run_ids(model, ids)}
    norms = _run_ids(model, ids[:, :64])  # warm both
    hf(ids[:, :64], logits_to_keep=1)
    assert len(norms) == 18
    got: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
    load = [os.getloadavg()[0]]
    for _ in range(args.repeat):
        for k, fn in sides.items():
            got[k].append(measured(fn))
            print(k, got[k][-1], flush=True)
    load.append(os.getloadavg()[0])
    print(f"{machine()}; {args.tokens} tokens, median of {args.repeat}, interleaved in one process; load average "
          f"{load[0]:.1f} before, {load[1]:.1f} after (under load, read the CPU column: wall is mostly waiting)")
    t = {k: statistics.median(r["seconds"] for r in v) for k, v in got.items()}
    c = {k: statistics.median(r["cpu"] for r in v) for k, v in got.items()}
    p = {k: max(r["peak"] for r in v) for k, v in got.items()}
    above = {k: max(r["peak"] - r["rest"] for r in v) for k, v in got.items()}
    for k in got:
        print(f"  {k:8} {t[k]:8.2f} s ({t[k] / t['plain']:.2f}x), CPU {c[k]:8.2f} s ({c[k] / c['plain']:.2f}x)   "
              f"peak RSS {p[k] / 2**30:6.2f} GiB ({p[k] / p['plain']:.2f}x), {above[k] / 2**20:6.0f} MiB above "
              f"the size before the run ({above[k] / max(above['plain'], 1):.2f}x)")


if __name__ == "__main__":
    main()
