"""Datasets, side by side in one run on a random model with Qwen3.5-0.8B's shapes.

(b) `part_b`: a dataset sweep, every DeltaNet block (18) x 3 positions (the subject's last
    token, the token after it, the last token) over 32 records of 16-96 tokens (each a
    prompt, a corrupt prompt of the same length, a subject, an answer and a foil):
  loop     what users write today: per record, one nnsight trace of the prompt reading the
           54 clean states, then one nnsight trace of the corrupt prompt per cell writing one of
           them and reading the logits (deltalang's value layer)
  engine   `run_dataset_sweep`: per record, its plain one-prompt sweep through the sweep engine
           (the clean runs, one clean capture, then each cell recomputes blocks L.. at tokens t..);
           resolution of every record included
Like for like: both sides apply the LM head to the last position only (`logits_to_keep=1`) for
the patched runs, and both compute the same 32 x 54 logit differences, checked to agree (atol 1e-3).
(a), one patch and one measure per record against a loop and the plain batched forward, is
`benchmarks/dataset_records.py` until it moves here.

    python benchmarks/datasets.py [--records 32] [--repeat 1]
    python benchmarks/datasets.py --records 2 --blocks 2 --low 16 --high 20     # a smoke test
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, machine, qwen35_08b_shaped, tokenizer_for
from dataset_records import records as _records

from deltalang.runtime.model import DeltaModel, wrap_model
from deltalang.sweep.dataset import run_dataset_sweep

LABELS = ("facts.subject", "facts.subject + 1", "-1")


def sweep_program(blocks: list[int]) -> str:
    return (f"sweep s on facts.corrupt over L in L[{', '.join(map(str, blocks))}], t in {', '.join(LABELS)} {{\n"
            "    write L.state_after(t) from facts\n    measure logit_diff(facts.answer, facts.foil)\n}\n")


def part_b(model: DeltaModel, n_records: int = 32, low: int = 16, high: int = 96, blocks: int | None = None,
           repeat: int = 1, warmup: int = 0) -> None:
    """(b) a dataset sweep: the engine vs a loop of one nnsight trace per cell per record; prints the table."""
    tok = model.tokenizer
    data = _records(n_records, low, high, shuffle=False)
    linear = model.linear_layers()[:blocks]
    program = sweep_program(linear)
    x, y = tok("x").input_ids[0], tok("y").input_ids[0]
    cells_of: list[list[tuple[int, str, int]]] = []
    for r in data:
        n = len(tok(r["prompt"]).input_ids)
        assert n == len(tok(r["corrupt"]).input_ids)
        last_subject = len(tok(r["prompt"][:r["prompt"].index(r["subject"]) + len(r["subject"])]).input_ids) - 1
        where = dict(zip(LABELS, (last_subject, last_subject + 1, n - 1), strict=True))
        cells_of.append([(L, lab, where[lab]) for L in linear for lab in LABELS])
    got: dict[str, dict[tuple[int, int, str], float]] = {"loop": {}, "engine": {}}

    def loop() -> None:
        box: dict[str, Any] = {}  # values leave a trace body through a container
        for i, r in enumerate(data):
            with torch.no_grad(), model.trace(r["prompt"], logits_to_keep=1):
                box["clean"] = {(L, p): model.layers[L].linear_attn.state_after(p).save()
                                for L, _, p in cells_of[i]}
            for L, lab, p in cells_of[i]:
                with torch.no_grad(), model.trace(r["corrupt"], logits_to_keep=1):
                    model.layers[L].linear_attn.set_state_after(p, box["clean"][(L, p)])
                    box["logits"] = model.logits.save()
                got["loop"][(i, L, lab)] = float(box["logits"][0, -1, x] - box["logits"][0, -1, y])

    def engine() -> None:
        out = run_dataset_sweep(program, model, data={"facts": data}, progress=False)
        for row in out.rows:
            got["engine"][(row["record"], int(row["L"][1:]), row["t"])] = row["value"]

    t0 = time.perf_counter()
    times = interleaved({"loop": loop, "engine": engine}, repeat=repeat, warmup=warmup)
    wall = time.perf_counter() - t0
    assert got["loop"].keys() == got["engine"].keys(), "the loop and the engine must compute the same cells"
    worst = max(abs(got["loop"][k] - got["engine"][k]) for k in got["loop"])
    assert worst <= 1e-3, f"engine and loop disagree by {worst:.2e}"
    lengths = [len(tok(r["prompt"]).input_ids) for r in data]
    cells = sum(len(c) for c in cells_of)
    print(f"benchmarks/datasets.py (b) — {datetime.date.today()} — {machine()}")
    print(f"dataset sweep: {len(linear)} DeltaNet blocks x {len(LABELS)} positions ({', '.join(LABELS)}) over "
          f"{len(data)} records of {min(lengths)}-{max(lengths)} tokens = {cells} cells: restore the clean state into "
          f"the corrupt run, measure logit_diff; random Qwen3.5-0.8B-shaped model; median of {repeat} "
          f"(benchmark wall {wall:.0f} s); engine vs loop max |diff| {worst:.1e}")
    print(f"{'loop: a trace per cell per record':>34} | {'engine':>9} | {'loop / engine':>13}")
    print(f"{times['loop']:>32.2f} s | {times['engine']:>7.2f} s | {times['loop'] / times['engine']:>12.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=32)
    ap.add_argument("--low", type=int, default=16)
    ap.add_argument("--high", type=int, default=96)
    ap.add_argument("--blocks", type=int, default=None, help="only the first N DeltaNet blocks (smoke tests)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = wrap_model(qwen35_08b_shaped(), tokenizer_for(), "random Qwen3.5-0.8B-shaped")
    part_b(model, args.records, args.low, args.high, args.blocks, args.repeat, args.warmup)


if __name__ == "__main__":
    main()
