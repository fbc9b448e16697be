"""The value layer's cost: patching the state after token t on all 18 DeltaNet blocks.

Side by side, in one run, on a random model with Qwen3.5-0.8B's shapes:
  plain          transformers' forward
  nnsight/final  hand-written nnsight reading all 18 final states (`.source` on the kernel call)
  split          deltalang: set_state_after(t) on all 18 blocks, by splitting the chunked kernel
  token          the same through the token-by-token route (route_kernels(family, "torch"))
Target: split within 1.3x of plain at 512 tokens.

    python benchmarks/values.py [--repeat 3] [--lengths 64 512]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, machine, qwen35_08b_shaped, tokenizer_for  # noqa: E402

import deltalang  # noqa: E402
from deltalang.model import wrap_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 512])
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    hf = qwen35_08b_shaped()
    plain_hf = qwen35_08b_shaped()  # a second copy: no deltalang hooks on it
    from nnsight import LanguageModel

    tok = tokenizer_for()
    nn_plain = LanguageModel(plain_hf, tokenizer=tok)
    model = wrap_model(hf, tok, "random Qwen3.5-0.8B-shaped")
    linear = model.spec.linear_layers()
    op = f"{deltalang.families.qwen3_5.chunk_kernel}_0"
    d = model.spec.dims
    rows = []
    for n in args.lengths:
        ids = torch.randint(3, 248000, (1, n))
        t = n // 2
        donor = torch.randn(1, d["heads"], d["key_dim"], d["value_dim"]) * 0.1

        def plain() -> None:
            plain_hf(ids)

        def nnsight_final() -> None:
            saved = []
            with nn_plain.trace(ids):
                for i in linear:
                    saved.append(getattr(nn_plain.model.layers[i].linear_attn.source, op).output[1].save())
            assert len(saved) == len(linear)

        def split() -> None:
            with model.trace(ids):
                for i in linear:
                    model.layers[i].linear_attn.set_state_after(t, donor)
                model.logits.save()

        def token() -> None:
            deltalang.route_kernels(model.family, "torch")
            try:
                with model.trace(ids):
                    for i in linear:
                        model.layers[i].linear_attn.set_state_after(t, donor)
                    model.logits.save()
            finally:
                deltalang.route_kernels(model.family, "default")

        times = interleaved({"plain": plain, "nnsight/final": nnsight_final, "split": split, "token": token},
                            repeat=args.repeat)
        rows.append((n, times))

    print(f"benchmarks/values.py — {datetime.date.today()} — {machine()}")
    print("set_state_after(t = n/2) on all 18 DeltaNet blocks; random Qwen3.5-0.8B-shaped model; "
          f"median of {args.repeat}")
    print(f"{'tokens':>6} | {'plain forward':>14} | {'nnsight 18 final states':>24} | {'deltalang split':>16} | "
          f"{'deltalang token-by-token':>25}")
    for n, t in rows:
        p = t["plain"]
        print(f"{n:>6} | {p * 1000:>11.0f} ms | {t['nnsight/final'] / p:>23.2f}x | {t['split'] / p:>15.2f}x | "
              f"{t['token'] / p:>24.2f}x")


if __name__ == "__main__":
    main()
