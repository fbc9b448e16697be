"""One state patch and one measure per record, over a dataset of prompts of different lengths.

Side by side, in one run, on a random model with Qwen3.5-0.8B's shapes, records of 16-96 tokens
(each a prompt, a corrupt prompt of the same length, a subject, an answer and a foil):
  loop     what users write today: per record, one nnsight trace of the corrupt prompt reading every
           DeltaNet block's state after the subject, and one of the prompt writing them and reading
           the logits (deltalang's value layer, as `deltalang emit` writes it)
  deltalang  `deltalang.run(program, data=...)`: records sorted by length share forwards (left-padded),
           resolution of every record included
  plain    the floor: transformers' own batched forwards over the same sequences (every corrupt
           prompt, then every prompt), in the same batches, left-padded, no intervention
Like for like: every side applies the LM head to the last position only (`logits_to_keep=1`).
Every record's logit difference from deltalang is checked against the loop's (atol 1e-3).
Targets on a CPU: deltalang >= 2x faster than the loop, and <= 1.3x the plain batched forwards.

    python benchmarks/dataset_records.py [--records 128] [--repeat 1]
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, machine, qwen35_08b_shaped, tokenizer_for

import deltalang
from deltalang.runs.records import MAX_GROUP
from deltalang.runtime.model import wrap_model

PROGRAM = """trace t on facts {
    write L[linear].state_after(facts.subject) from facts.corrupt
    measure logit_diff(facts.answer, facts.foil)
}
"""
WORDS = ["tower", "river", "garden", "bridge", "castle", "market", "temple", "harbor", "museum", "palace"]


def records(n: int, low: int, high: int, seed: int = 0, shuffle: bool = True) -> list[dict[str, str]]:
    """n records of low..high bytes (tokens of the byte tokenizer), the subject in the middle; in a
    random order unless `shuffle` is False (then shortest first)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = low + (high - low) * i // max(n - 1, 1)
        subject, other = rng.sample(WORDS[:4], 2) if i % 2 else rng.sample(WORDS[4:], 2)
        other = other[:len(subject)].ljust(len(subject), "s")
        head = "".join(rng.choice("abcdefgh ") for _ in range((length - len(subject)) // 2))
        tail = "".join(rng.choice("abcdefgh ") for _ in range(length - len(subject) - len(head)))
        out.append({"prompt": head + subject + tail, "corrupt": head + other + tail, "subject": subject,
                    "answer": "x", "foil": "y"})
    if shuffle:
        rng.shuffle(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=128)
    ap.add_argument("--low", type=int, default=16)
    ap.add_argument("--high", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hf = qwen35_08b_shaped()
    tok = tokenizer_for()
    model = wrap_model(hf, tok, "random Qwen3.5-0.8B-shaped")
    data = records(args.records, args.low, args.high)
    linear = model.linear_layers()
    ids = {k: [tok(r[k]).input_ids for r in data] for k in ("prompt", "corrupt")}
    subject_pos = [len(tok(r["prompt"][:r["prompt"].index(r["subject"]) + len(r["subject"])]).input_ids) - 1
                   for r in data]
    x, y = tok("x").input_ids[0], tok("y").input_ids[0]
    assert all(len(a) == len(b) for a, b in zip(ids["prompt"], ids["corrupt"]))
    got: dict[str, list[float]] = {}

    def loop() -> None:
        out = []
        box: dict[str, Any] = {}  # values leave a trace body through a container (nnsight pushes no locals)
        for i in range(len(data)):
            with torch.no_grad(), model.trace(data[i]["corrupt"], logits_to_keep=1):
                box["states"] = [model.layers[L].linear_attn.state_after(subject_pos[i]).save() for L in linear]
            with torch.no_grad(), model.trace(data[i]["prompt"], logits_to_keep=1):
                for L, s in zip(linear, box["states"]):
                    model.layers[L].linear_attn.set_state_after(subject_pos[i], s)
                box["logits"] = model.logits.save()
            out.append(float(box["logits"][0, -1, x] - box["logits"][0, -1, y]))
        got["loop"] = out

    def ours() -> None:
        res = deltalang.run(PROGRAM, model, data={"facts": data})
        got["deltalang"] = res.values("t.logit_diff(facts.answer, facts.foil)")

    order = sorted(range(len(data)), key=lambda i: len(ids["prompt"][i]))
    batches = [order[i:i + MAX_GROUP] for i in range(0, len(order), MAX_GROUP)]

    def plain() -> None:
        for field in ("corrupt", "prompt"):
            for b in batches:
                enc = tok.pad({"input_ids": [ids[field][i] for i in b]}, return_tensors="pt")
                with torch.no_grad():
                    hf(**enc, logits_to_keep=1)

    t0 = time.perf_counter()
    times = interleaved({"plain": plain, "loop": loop, "deltalang": ours}, repeat=args.repeat, warmup=args.warmup)
    wall = time.perf_counter() - t0
    worst = max(abs(a - b) for a, b in zip(got["loop"], got["deltalang"]))
    assert worst <= 1e-3, f"deltalang and the loop disagree by {worst:.2e}"
    lengths = [len(i) for i in ids["prompt"]]
    print(f"benchmarks/dataset_records.py — {datetime.date.today()} — {machine()}")
    print(f"{len(data)} records of {min(lengths)}-{max(lengths)} tokens: write every DeltaNet block's "
          f"({len(linear)}) state after the subject from the corrupt prompt, measure logit_diff; random "
          f"Qwen3.5-0.8B-shaped model; median of {args.repeat} (benchmark wall {wall:.0f} s); "
          f"deltalang vs loop max |diff| {worst:.1e}")
    print(f"{'plain batched forwards':>22} | {'loop: 2 traces a record':>23} | {'deltalang':>10} | "
          f"{'loop / deltalang':>16} | {'deltalang / plain':>17}")
    print(f"{times['plain']:>20.2f} s | {times['loop']:>21.2f} s | {times['deltalang']:>8.2f} s | "
          f"{times['loop'] / times['deltalang']:>15.2f}x | {times['deltalang'] / times['plain']:>16.2f}x")


if __name__ == "__main__":
    main()
