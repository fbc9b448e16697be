"""deltalang's own cost: a program through `deltalang.run` against the same trace written by hand.

Side by side, in one run, on a random model with Qwen3.5-0.8B's shapes (the model loaded once):
  plain        transformers' forward
  by hand      the nnsight trace a researcher writes with deltalang's value layer
  deltalang    `deltalang.run(program)`: parse, check, plan, emit, execute
and the compile time (parse + check + plan + emit) of a 50-statement program.
Target: deltalang within 1.05x of the hand-written trace; compile under 20 ms.

    python benchmarks/overhead.py [--repeat 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, machine, qwen35_08b_shaped, tokenizer_for  # noqa: E402

import deltalang  # noqa: E402
from deltalang.runtime.model import wrap_model  # noqa: E402

PROGRAM = """
prompt clean = "{text}"
trace t on clean {{
    read L[linear].state_output
    write L[linear].state_after({t}) = zeros
    read next_token_probs
}}
"""


def fifty_statements(text: str, linear: list[int]) -> str:
    lines = [f'prompt clean = "{text}"', f'prompt other = "{text[::-1]}"', "trace t on clean {"]
    for i in range(48):
        layer = linear[i % len(linear)]
        kind = i % 4
        if kind == 0:
            lines.append(f"    read L{layer}.state_after({i % 30})")
        elif kind == 1:
            lines.append(f"    write L{layer}.state_after({(i * 7) % 30}) from other")
        elif kind == 2:
            lines.append(f"    read L{layer}.attention_output as a{i}")
        else:
            lines.append(f"    write L{layer}.conv_window_after({(i * 3) % 30}) = zeros")
    lines.append("}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    tok = tokenizer_for()
    hf = qwen35_08b_shaped()
    model = wrap_model(hf, tok, "random Qwen3.5-0.8B-shaped")
    text = ("The Eiffel Tower is in the city of Paris, and the Louvre is nearby. " * 8)[: args.tokens]
    ids = tok(text, return_tensors="pt").input_ids
    assert ids.shape[1] == args.tokens
    t = args.tokens // 2
    linear = model.spec.linear_layers()
    program = PROGRAM.format(text=text, t=t)
    results: dict[str, torch.Tensor] = {}

    def plain() -> None:
        hf(ids)

    def by_hand() -> None:
        with torch.no_grad(), model.trace(text):
            for i in linear:
                mix = model.layers[i].linear_attn
                mix.set_state_after(t, torch.zeros_like(mix.state_after(t)))
                results[f"L{i}"] = mix.state_output.save()
            results["probs"] = model.next_token_probs.save()

    def through_deltalang() -> None:
        deltalang.run(program, model)

    # the two give the same numbers
    by_hand()
    ours = deltalang.run(program, model)
    assert torch.equal(ours["t.next_token_probs"], results["probs"])
    times = interleaved({"plain": plain, "by hand": by_hand, "deltalang": through_deltalang}, repeat=args.repeat)

    fifty = fifty_statements(text, linear)
    n_statements = sum(1 for line in fifty.splitlines() if line.strip() and not line.strip() in ("}",))
    compile_times = []
    for _ in range(max(5, args.repeat)):
        t0 = time.perf_counter()
        deltalang.compile(fifty, model)
        compile_times.append(time.perf_counter() - t0)

    print(f"benchmarks/overhead.py — {datetime.date.today()} — {machine()}")
    print(f"random Qwen3.5-0.8B-shaped model, {args.tokens} tokens; read 18 final states, zero the state after "
          f"token {t} on 18 blocks, read next-token probs; median of {args.repeat}")
    print(f"{'plain forward':>14} | {'by hand (nnsight)':>18} | {'deltalang.run':>14} | {'deltalang / by hand':>20}")
    print(f"{times['plain'] * 1000:>11.0f} ms | {times['by hand'] * 1000:>15.0f} ms | "
          f"{times['deltalang'] * 1000:>11.0f} ms | {times['deltalang'] / times['by hand']:>19.3f}x")
    print(f"compile (parse + check + plan + emit), {n_statements}-statement program: "
          f"{statistics.median(compile_times) * 1000:.1f} ms (median of {len(compile_times)})")


if __name__ == "__main__":
    main()
