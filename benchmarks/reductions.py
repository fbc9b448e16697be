"""A reduction of `states` computed inside the forward: `measure norm(L[linear].states)` against a plain forward.

Side by side in one run, on a random model with Qwen3.5-0.8B's shapes (18 DeltaNet blocks, 16 heads of
128 x 128), one prompt of N tokens:
  plain    transformers' forward (logits of the last position only, as the compiled program asks)
  reduced  the compiled deltalang program `measure norm(L[linear].states)`: the state after every token of
           every DeltaNet block, reduced to its norm a group of chunks at a time (the full
           `[s, 16, 128, 128]` states, 1 GiB per 1,024 tokens per block, never exist)
Each side runs in a subprocess of its own, alternating, so that its peak resident memory (VmHWM, reset
after the model is built and warmed) is its own; times are medians over the repeats.
Targets: peak within 1.2x of plain, time within 1.3x.

    python benchmarks/reductions.py [--tokens 1024] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

PROGRAM = "measure norm(L[linear].states)\n"


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def side(which: str, tokens: int) -> dict[str, float]:
    """One side in this process: build, warm up, reset the high-water mark, run once timed."""
    import torch

    from common import qwen35_08b_shaped, tokenizer_for

    torch.set_grad_enabled(False)
    hf = qwen35_08b_shaped()
    ids = torch.randint(3, 248000, (1, tokens), generator=torch.Generator().manual_seed(1))
    if which == "plain":
        def run() -> object:
            return hf(ids, logits_to_keep=1)
    else:
        from deltalang.model import wrap_model

        model = wrap_model(hf, tokenizer_for(), "random Qwen3.5-0.8B-shaped")

        def run() -> object:
            return _run_ids(model, ids)
    small = ids[:, :64]
    (hf(small, logits_to_keep=1) if which == "plain" else _run_ids(model, small))  # warm: first-call costs
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS from here on
        f.write("5")
    rest = _status("VmRSS")
    t0 = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    if which == "reduced":
        norms = [v for k, v in out.items()]
        assert len(norms) == 18 and all(tuple(v.shape) == (1, tokens) for v in norms), [v.shape for v in norms]
    return {"seconds": seconds, "peak": peak, "rest": rest}


def _run_ids(model: object, ids: object) -> dict:
    """The code `deltalang emit` prints for PROGRAM, on a prompt given as ids (tests/test_reductions.py checks
    that the emitted code calls the same `states_reduced(Reduction(...))`)."""
    import torch

    from deltalang import measures
    from deltalang.values import axes

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
    ap.add_argument("--side", choices=("plain", "reduced"))
    args = ap.parse_args()
    if args.side:
        print(json.dumps(side(args.side, args.tokens)))
        return
    got: dict[str, list[dict[str, float]]] = {"plain": [], "reduced": []}
    for _ in range(args.repeat):
        for which in got:
            out = subprocess.run([sys.executable, __file__, "--side", which, "--tokens", str(args.tokens)],
                                 capture_output=True, text=True, check=True)
            got[which].append(json.loads(out.stdout.strip().splitlines()[-1]))
    from common import machine

    print(f"{machine()}; {args.tokens} tokens, median of {args.repeat} (each side a fresh process)")
    t = {k: statistics.median(r["seconds"] for r in v) for k, v in got.items()}
    p = {k: max(r["peak"] for r in v) for k, v in got.items()}
    above = {k: max(r["peak"] - r["rest"] for r in v) for k, v in got.items()}
    for k in got:
        print(f"  {k:8} {t[k]:8.2f} s ({t[k] / t['plain']:.2f}x)   peak RSS {p[k] / 2**30:6.2f} GiB "
              f"({p[k] / p['plain']:.2f}x), {above[k] / 2**20:7.0f} MiB above the model at rest")


if __name__ == "__main__":
    main()
