"""Collecting the state at the subject of every record: deltalang vs plain batched forwards, side by side.

On a random model with Qwen3.5-0.8B's shapes (18 DeltaNet blocks, one state 16 x 128 x 128 float32 =
1 MiB, so 18 MiB a record), records of 16-96 tokens (`dataset_records.records`):
  plain      transformers' own forwards over the same records, in the same batches (sorted by length,
             `MAX_GROUP` a forward, left-padded), no intervention, nothing kept, `logits_to_keep=1`
  deltalang  `read L[linear].state_after(facts.subject) as s` over the dataset, every record's 18 states
             written to sharded safetensors in a fresh --out (`deltalang.runs.collect`), resolution included
Both sides run in one process whose allocator keeps freed memory for reuse (`deltalang.keep_freed_memory()`,
what the command line does for itself) unless `--allocator default` leaves glibc's defaults (docs/benchmarks.md:
"The allocator"). For each number of records: the median time of each (cases interleaved), deltalang / plain, the peak
resident memory above the process's size before the case (sampled every 2 ms), the bytes written
and the write rate (bytes / deltalang's time). Peak memory should not grow with the records: a
group's values and at most two shards (one being written) are held at once. The collection's first record is checked
against a plain trace of the same model (rel. 1e-4).

    python benchmarks/collect.py [--records 128 1024] [--repeat 1] [--allocator kept|default] [--read state|write_values]
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, qwen35_08b_shaped, tokenizer_for  # noqa: E402
from dataset_records import records  # noqa: E402
from values import peak_memory  # noqa: E402

import deltalang  # noqa: E402
from deltalang.runs.collect import human  # noqa: E402
from deltalang.runs.records import MAX_GROUP  # noqa: E402
from deltalang.runtime.model import wrap_model  # noqa: E402

# what each record keeps (`--read`): the state at the subject (18 MiB a record), or every token's write_values
# (the second factor of each token's write, [s, heads, value_dim] a block: 144 KiB a token), an SAE's training set
PROGRAMS = {
    "state": "trace t on facts {\n    read L[linear].state_after(facts.subject) as s\n}\n",
    "write_values": "trace t on facts {\n    read L[linear].write_values as s\n}\n",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--low", type=int, default=16)
    ap.add_argument("--high", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--allocator", choices=("kept", "default"), default="kept",
                    help="kept: deltalang.keep_freed_memory() before anything runs (both sides); default: glibc's own")
    ap.add_argument("--out", default=None, help="where the collections go (default: a temporary directory)")
    ap.add_argument("--read", choices=tuple(PROGRAMS), default="state",
                    help="state: the state at the subject; write_values: every token's write_values")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    kept = args.allocator == "kept" and deltalang.keep_freed_memory()
    if args.allocator == "kept" and not kept:
        print("note: the allocator's settings were not taken (not glibc, or MALLOC_* set): its defaults are measured")
    hf = qwen35_08b_shaped()
    tok = tokenizer_for()
    model = wrap_model(hf, tok, "random Qwen3.5-0.8B-shaped")
    linear = model.linear_layers()
    base = Path(args.out or tempfile.mkdtemp(prefix="deltalang-collect-"))
    print(f"benchmarks/collect.py — {datetime.date.today()} — {machine()}")
    print(f"{PROGRAMS[args.read].splitlines()[1].strip()} ({len(linear)} blocks) over records of {args.low}-{args.high} "
          f"tokens; random Qwen3.5-0.8B-shaped model; median of {args.repeat}; allocator: "
          f"{'freed memory kept (both sides)' if kept else 'glibc defaults'}")
    print(f"{'records':>7} | {'plain':>8} | {'deltalang':>9} | {'dl / plain':>10} | {'peak plain':>10} | "
          f"{'peak dl':>9} | {'written':>9} | {'write rate':>11}")
    for n in args.records:
        data = records(n, args.low, args.high)
        ids = [tok(r["prompt"]).input_ids for r in data]
        order = sorted(range(n), key=lambda i: len(ids[i]))
        batches = [order[i:i + MAX_GROUP] for i in range(0, n, MAX_GROUP)]
        out = base / f"n{n}"

        def plain() -> None:
            for b in batches:
                enc = tok.pad({"input_ids": [ids[i] for i in b]}, return_tensors="pt")
                hf(**enc, logits_to_keep=1)

        def ours() -> None:
            deltalang.run(PROGRAMS[args.read], model, data={"facts": data}, out=out)

        t0 = time.perf_counter()
        times, peaks = timed({"plain": plain, "deltalang": ours}, args.repeat,
                             before={"deltalang": lambda: shutil.rmtree(out, ignore_errors=True)})
        wall = time.perf_counter() - t0
        col = deltalang.load_results(out)
        _check_first(model, data, col, linear, args.read)
        written = sum(f.stat().st_size for f in out.iterdir())
        print(f"{n:>7} | {times['plain']:>6.1f} s | {times['deltalang']:>7.1f} s | "
              f"{times['deltalang'] / times['plain']:>9.2f}x | {human(peaks['plain']):>10} | "
              f"{human(peaks['deltalang']):>9} | {human(written):>9} | {human(written / times['deltalang']):>9}/s"
              f"   (wall {wall:.0f} s, {len(col.manifest['shards'])} shards)")
        shutil.rmtree(out, ignore_errors=True)


def timed(cases: dict[str, Callable[[], object]], repeat: int, before: dict[str, Callable[[], object]]
          ) -> tuple[dict[str, float], dict[str, int]]:
    """Median seconds and highest peak memory of each case, the cases taking turns (each run timed and watched;
    `before` a case, untimed: the previous collection removed)."""
    samples: dict[str, list[float]] = {k: [] for k in cases}
    peaks = dict.fromkeys(cases, 0)
    for _ in range(repeat):
        for name, fn in cases.items():
            before.get(name, lambda: None)()
            t0 = time.perf_counter()
            peaks[name] = max(peaks[name], peak_memory(fn))
            samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}, peaks


def _check_first(model: deltalang.DeltaModel, data: list[dict[str, str]], col: deltalang.Collection,
                 linear: list[int], read: str) -> None:
    """The first record's values equal a plain trace of its prompt alone."""
    record, values = col[0]
    prompt, subject = record["prompt"], record["subject"]
    pos = len(model.tokenizer(prompt[:prompt.index(subject) + len(subject)]).input_ids) - 1
    box: dict[str, list[torch.Tensor]] = {}
    with model.trace(prompt):
        box["s"] = [model.layers[L].linear_attn.state_after(pos).save() if read == "state"
                    else model.layers[L].linear_attn.write_values.save() for L in linear]
    for L, want in zip(linear, box["s"]):
        got = values[f"s.L{L}"]
        assert float((got - want[0]).norm() / want.norm()) < 1e-4, L


if __name__ == "__main__":
    main()
