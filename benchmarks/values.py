"""The value layer's cost: patching the state after token t, and reading `states`, on all 18 DeltaNet blocks.

Side by side, in one run, on a random model with Qwen3.5-0.8B's shapes:
  plain          transformers' forward
  nnsight/final  hand-written nnsight reading all 18 final states (`.source` on the kernel call)
  split          deltalang: set_state_after(t) on all 18 blocks, by splitting the chunked kernel
  read           deltalang: state_after(t) read on all 18 blocks (the forward's call whole, its bits
                 unchanged; the state after t by a side call over the prefix)
  zeros          deltalang: the state after t read, then written as zeros on all 18 blocks (what `write
                 L[linear].state_after(t) = zeros` emits: set_state_after(t, torch.zeros_like(state_after(t))))
  token          the same through the token-by-token route (route_kernels(family, "torch"))
  states         deltalang: `states` (the state after every token) on all 18 blocks, each reduced
                 to its per-token norm inside the trace (`kernels.per_token`: chunked)
  states/loop    the same through the token-by-token loop (`kernels.per_token_loop`), the old way
Targets at 512 tokens: split within 1.3x of plain, states within 1.5x. Beside each time, the peak
resident memory above the process's resting size while the case ran (sampled every 2 ms). `--layers N`: the
first N blocks of that layout only (issue 38's shape: `--layers 6`, five DeltaNet blocks and an attention block).

With `--model granite`: a random granitemoehybrid at the same scale (hidden 1024, 24 blocks, three Mamba-2 blocks
per attention block: 18, 32 heads of 64, d_state 128, chunk 256; a dense MLP of 3584), and its own cases:
  plain          transformers' forward
  split          set_state_after(t) on all 18 Mamba-2 blocks (issue 26's target: <= 1.10x)
  read           state_after(t) read on all 18 (the forward's scan unchanged, the prefix's state beside it)
  zeros          state_after(t) read, then written as zeros on all 18
  states         `states` reduced to each head's norm after every token on all 18 (`ssd.per_token_sq_norms`;
                 issue 26's target: <= 1.5x)
  states/head    `states.head(0).mean(positions)` on all 18 (`ssd.per_token_reduced`: every state made, a
                 group of chunks at a time, and dropped)

    python benchmarks/values.py [--model qwen35|granite] [--layers 24] [--repeat 3] [--lengths 64 512]
        [--cases plain states ...]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, machine, qwen35_08b_shaped, tokenizer_for  # noqa: E402

import deltalang  # noqa: E402
from deltalang.runtime import kernels  # noqa: E402
from deltalang.runtime.model import wrap_model  # noqa: E402

CASES = ("plain", "nnsight/final", "split", "read", "zeros", "token", "states", "states/loop")
GRANITE_CASES = ("plain", "split", "read", "zeros", "states", "states/head")
STATE_AXES = ("b", "s", "heads", "key_dim", "value_dim")


def granite_shaped(seed: int = 0) -> torch.nn.Module:
    """Random weights, a granitemoehybrid at the 0.8B benchmark's scale: hidden 1024, 24 blocks (18 Mamba-2,
    three per attention block), 32 Mamba-2 heads of 64, d_state 128, one group, chunk 256, a dense MLP."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(seed)
    cfg = GraniteMoeHybridConfig(
        vocab_size=100352, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, mamba_n_heads=32, mamba_d_head=64,
        mamba_d_state=128, mamba_n_groups=1, mamba_chunk_size=256, mamba_d_conv=4, mamba_expand=2,
        num_local_experts=0, shared_intermediate_size=3584, intermediate_size=3584, position_embedding_type="rope",
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.architectures = ["GraniteMoeHybridForCausalLM"]
    return GraniteMoeHybridForCausalLM(cfg).eval()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def peak_memory(fn: Callable[[], object]) -> int:
    """Bytes of resident memory above the size before `fn`, at the highest point while it ran."""
    base, peak, done = _rss(), [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    try:
        fn()
    finally:
        done.set()
        th.join()
    return max(peak[0], _rss()) - base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--model", choices=("qwen35", "granite"), default="qwen35")
    ap.add_argument("--cases", nargs="+", choices=sorted(set(CASES) | set(GRANITE_CASES)), default=None)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layers", type=int, default=24, help="the first N blocks of the 0.8B layout (qwen35)")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.model == "granite":
        granite(args)
        return
    args.cases = args.cases or list(CASES)

    hf = qwen35_08b_shaped(layers=args.layers)
    plain_hf = qwen35_08b_shaped(layers=args.layers)  # a second copy: no deltalang hooks on it
    from nnsight import LanguageModel

    tok = tokenizer_for()
    nn_plain = LanguageModel(plain_hf, tokenizer=tok)
    model = wrap_model(hf, tok, "random Qwen3.5-0.8B-shaped")
    linear = model.spec.linear_layers()
    op = f"{deltalang.models.families.qwen3_5.chunk_kernel}_0"
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

        split, read, zeros = split_and_read(model, ids, linear, "linear_attn", t, donor)

        def token() -> None:
            deltalang.route_kernels(model.family, "torch")
            try:
                with model.trace(ids):
                    for i in linear:
                        model.layers[i].linear_attn.set_state_after(t, donor)
                    model.logits.save()
            finally:
                deltalang.route_kernels(model.family, "default")

        def states() -> None:
            norms = []
            with model.trace(ids):
                for i in linear:
                    norms.append(model.layers[i].linear_attn.states.norm(dim=(-2, -1)).save())
            assert all(x.shape == (1, n, d["heads"]) for x in norms)

        def states_loop() -> None:
            chunked, kernels.per_token = kernels.per_token, kernels.per_token_loop
            try:
                states()
            finally:
                kernels.per_token = chunked

        every = {"plain": plain, "nnsight/final": nnsight_final, "split": split, "read": read, "zeros": zeros,
                 "token": token,
                 "states": states, "states/loop": states_loop}
        rows.append((n, *_timed({k: every[k] for k in args.cases if k in every}, plain, args)))
    _table(rows, args, f"random Qwen3.5-0.8B-shaped model, {args.layers} blocks, all {len(linear)} DeltaNet blocks: "
           "set_state_after(t = n/2) (split, token), state_after(t) read (read), read then written as zeros (zeros), "
           "`states` reduced to per-token norms (states, states/loop)")


def split_and_read(model: deltalang.DeltaModel, ids: torch.Tensor, layers: list[int], mixer: str, t: int,
                   donor: torch.Tensor) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """The `split` case (`set_state_after(t, donor)` on every block of `layers`), the `read` case
    (`state_after(t)` read on each) and the `zeros` case (read, then written as zeros: what `= zeros` emits),
    the mixer being each block's attribute `mixer`; all keep the logits."""
    def split() -> None:
        with model.trace(ids):
            for i in layers:
                getattr(model.layers[i], mixer).set_state_after(t, donor)
            model.logits.save()

    def read() -> None:
        saved = []
        with model.trace(ids):
            for i in layers:
                saved.append(getattr(model.layers[i], mixer).state_after(t).save())
            model.logits.save()
        assert len(saved) == len(layers)

    def zeros() -> None:
        with model.trace(ids):
            for i in layers:
                m = getattr(model.layers[i], mixer)
                m.set_state_after(t, torch.zeros_like(m.state_after(t)))
            model.logits.save()
    return split, read, zeros


def _timed(cases: dict[str, Callable[[], None]], plain: Callable[[], None],
           args: argparse.Namespace) -> tuple[dict[str, float], dict[str, int]]:
    """Median seconds and peak memory above rest per case, plain first, the cases interleaved."""
    if "plain" not in cases:
        cases = {"plain": plain, **cases}
    peaks = dict.fromkeys(cases, 0)

    def tracked(k: str, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            peaks[k] = max(peaks[k], peak_memory(fn))
        return run

    times = interleaved({k: tracked(k, fn) for k, fn in cases.items()}, repeat=args.repeat, warmup=args.warmup)
    return times, peaks


def _table(rows: list, args: argparse.Namespace, what: str) -> None:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"benchmarks/values.py — {datetime.datetime.now():%Y-%m-%d %H:%M} — {machine()}; load average {load}")
    print(f"{what}; median of {args.repeat}, {args.warmup} warm-up; time relative to the plain forward, "
          "[peak memory above rest]")
    names = list(rows[0][1])
    print(f"{'tokens':>6} | " + " | ".join(f"{k:>22}" for k in names))
    for n, t, m in rows:
        p = t["plain"]
        cells = [f"{t[k] * 1000:>7.0f} ms [{m[k] / 2**20:>6.0f} MiB]" if k == "plain"
                 else f"{t[k] / p:>5.2f}x [{m[k] / 2**20:>6.0f} MiB]" for k in names]
        print(f"{n:>6} | " + " | ".join(f"{c:>22}" for c in cells))


def granite(args: argparse.Namespace) -> None:
    """The Mamba-2 cases (module docstring) on `granite_shaped`, side by side with a plain copy's forward."""
    from deltalang.ground.measures import Reduction

    hf, plain_hf = granite_shaped(), granite_shaped()  # the second: no deltalang hooks on it
    model = wrap_model(hf, tokenizer_for(), "random granitemoehybrid at the 0.8B scale")
    ssm = model.spec.ssm_layers()
    d = model.spec.dims
    cases = args.cases or list(GRANITE_CASES)
    rows = []
    for n in args.lengths:
        ids = torch.randint(3, 100000, (1, n))
        t = n // 2
        donor = torch.randn(1, d["heads"], d["key_dim"], d["value_dim"]) * 0.1

        def plain() -> None:
            plain_hf(ids)

        split, read, zeros = split_and_read(model, ids, ssm, "mamba", t, donor)

        def reduced(red: Reduction, shape: tuple[int, ...]) -> Callable[[], None]:
            def run() -> None:
                got = []
                with model.trace(ids):
                    for i in ssm:
                        got.append(model.layers[i].mamba.states_reduced(red).save())
                assert all(tuple(x.shape) == shape for x in got), [x.shape for x in got]
            return run

        every = {"plain": plain, "split": split, "read": read, "zeros": zeros,
                 "states": reduced(Reduction(STATE_AXES, [("norm", ("key_dim", "value_dim"))]), (1, n, d["heads"])),
                 "states/head": reduced(Reduction(STATE_AXES, [("head", 0), ("mean", ("s",))]),
                                        (1, d["key_dim"], d["value_dim"]))}
        rows.append((n, *_timed({k: every[k] for k in cases if k in every}, plain, args)))
    _table(rows, args, f"random granitemoehybrid at the 0.8B scale, all {len(ssm)} Mamba-2 blocks: set_state_after("
           "t = n/2) (split), state_after(t) read (read), read then written as zeros (zeros), `states` reduced to "
           "each head's norm per token (states), `states.head(0).mean(positions)` (states/head)")


if __name__ == "__main__":
    main()
