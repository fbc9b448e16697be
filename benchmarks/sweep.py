"""A zero-ablation sweep, every DeltaNet block x 8 positions: a loop of traces, the engine, and the limit.

Side by side, in one run, on a random model with Qwen3.5-0.8B's shapes and a 64-token prompt:
  loop    what users write today: one nnsight trace per cell (deltalang's value layer,
          `set_state_after(t, zeros)`), reading the next-token probabilities
  engine  deltalang's sweep engine (`run_sweeps`): one clean capture, then each cell
          recomputes only blocks L.. at positions t.., cells batched as rows
  limit   the summed share of a forward the cells must recompute,
          sum over cells of (blocks from L)/(blocks) x (positions from t)/(positions),
          times the measured plain transformers forward. The plain forward is timed between the
          engine's forwards of cells (`on_chunk`; those seconds are taken out of the engine's), so
          the engine and its limit see the same load on shared cores
Like for like: a cell needs the next-token logits only, and the engine applies the final
norm and the LM head to the last position only (`deltalang.sweep.recompute.run_rows`), so the loop's
traces and the plain forward pass `logits_to_keep=1` (the head over all 64 positions is about
a third of this model's forward: its vocabulary is 248,320). The LM head's calls are recorded
and checked: one position per call in the plain forward, the loop and the engine's cells (the
engine's one clean capture, a full forward, is counted apart and printed).
Target on a CPU: engine >= 3x faster than the loop, and within 1.5x of the limit.
Every cell's P(token) from the engine is checked against the loop's (atol 1e-4).

    python benchmarks/sweep.py [--repeat 3] [--threads N]
    python benchmarks/sweep.py --repeat 1 --warmup 0 --blocks 3 --positions 2     # a smoke test

`--mamba2` runs the Mamba-2 case instead: the same zero ablation over every Mamba-2 block x the positions of a
small random granitemoehybrid (`small_granitemoehybrid`), the engine against the reference path (`engine="naive"`:
full forwards, cells batched as invokes), both through `run_sweeps`, side by side; every cell of one is checked
against the other (atol 1e-4).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved, machine, qwen35_08b_shaped, tokenizer_for

import deltalang
from deltalang.run import Experiment
from deltalang.runtime.model import wrap_model
from deltalang.sweep import run_sweeps

TEXT = "The Eiffel Tower is in the city of Paris, and the Louvre is near the "  # cut to --tokens bytes


def spread(n: int, k: int) -> list[int]:
    """k positions spread over 0..n-1, first and last included."""
    if k == 1:
        return [n - 1]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def ablation(model: Any, text: str, n_tok: int, blocks: list[int], positions: list[int]) -> Experiment:
    """The sweep zeroing each block's state after each position of `text`, measuring prob("a"): the program's
    position axis narrowed to `positions` (the language writes position axes as ranges a..b; the resolved
    program holds any list)."""
    source = (f"prompt p = {deltalang.language.ast.quote(text)}\n"
              f"sweep ablate on p over L in L[{', '.join(map(str, blocks))}], t in 0..{n_tok} {{\n"
              f"    write L.state_after(t) = zeros\n    measure prob(\"a\")\n}}\n")
    full = deltalang.compile(source, model).resolved
    sweep = full.runs[0]
    t_axis = attrs.evolve(sweep.axes[1], values=tuple(positions), labels=tuple(positions))
    return Experiment(source, model, resolved=attrs.evolve(full, runs=(attrs.evolve(sweep, axes=(sweep.axes[0], t_axis)),)))


def small_granitemoehybrid(seed: int = 0) -> torch.nn.Module:
    """Random weights: hidden 512, 8 blocks (three Mamba-2 blocks per attention block: 6 Mamba-2), 16 Mamba-2 heads
    of 64 x d_state 64 in one group, chunk 64, a dense MLP of 1024, the byte vocabulary (259)."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(seed)
    cfg = GraniteMoeHybridConfig(
        vocab_size=259, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=1024, shared_intermediate_size=1024, num_local_experts=0,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, mamba_n_heads=16, mamba_d_head=64,
        mamba_d_state=64, mamba_n_groups=1, mamba_chunk_size=64, mamba_d_conv=4, mamba_expand=2,
        position_embedding_type="rope", pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    return GraniteMoeHybridForCausalLM(cfg).eval()


def mamba2_case(args: argparse.Namespace) -> None:
    """The engine against the reference path on a small random granitemoehybrid (see the module doc)."""
    from deltalang.models.testing import byte_tokenizer

    model = wrap_model(small_granitemoehybrid(), byte_tokenizer(), "random small granitemoehybrid")
    text = (TEXT * 4)[: args.tokens]
    n_tok = len(model.spec.token_ids(text))
    ssm = model.spec.ssm_layers()[: args.blocks]
    positions = spread(n_tok, args.positions)
    exp = ablation(model, text, n_tok, ssm, positions)
    got: dict[str, dict[str, float]] = {}

    def case(engine: str) -> Callable[[], None]:
        def run() -> None:
            outcome = run_sweeps(exp, progress=False, batch_size=args.batch_size, engine=engine)
            assert outcome.paths["ablate"] == "engine" if engine == "auto" else outcome.paths["ablate"].startswith("naive")
            got[engine] = dict(outcome.results)
        return run

    t0 = time.perf_counter()
    times = interleaved({"naive": case("naive"), "auto": case("auto")}, repeat=args.repeat, warmup=args.warmup)
    wall = time.perf_counter() - t0
    worst = max(abs(got["auto"][k] - v) for k, v in got["naive"].items())
    assert set(got["auto"]) == set(got["naive"]) and worst <= 1e-4, f"engine and reference path disagree by {worst:.2e}"
    n_cells = len(ssm) * len(positions)
    print(f"benchmarks/sweep.py --mamba2 — {datetime.date.today()} — {machine()}")
    print(f"zero ablation of state_after(t): {len(ssm)} Mamba-2 blocks x {len(positions)} positions {positions} = "
          f"{n_cells} cells; random small granitemoehybrid, {n_tok}-token prompt; median of {args.repeat} "
          f"(benchmark wall {wall:.0f} s); engine vs reference path max |dP| {worst:.1e}")
    print(f"{'reference path (full forwards)':>30} | {'engine':>10} | {'reference / engine':>18}")
    print(f"{times['naive']:>28.2f} s | {times['auto']:>8.2f} s | {times['naive'] / times['auto']:>17.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of each case first")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--positions", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=None, help="only the first N DeltaNet blocks (smoke tests)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--batch-size", type=int, default=None, help="the engine's rows per forward (default: memory)")
    ap.add_argument("--mamba2", action="store_true", help="the Mamba-2 case: engine vs reference path")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.mamba2:
        mamba2_case(args)
        return

    hf = qwen35_08b_shaped()
    model = wrap_model(hf, tokenizer_for(), "random Qwen3.5-0.8B-shaped")
    text = (TEXT * 4)[: args.tokens]
    ids = torch.tensor([model.spec.token_ids(text)])
    n_tok = ids.shape[1]
    assert n_tok == args.tokens, (n_tok, args.tokens)
    linear = model.spec.linear_layers()[: args.blocks]
    positions = spread(n_tok, args.positions)
    token = model.spec.token_ids("a")[0]
    n_layers = model.spec.num_layers

    exp = ablation(model, text, n_tok, linear, positions)  # the engine: the sweep program
    cells = [(L, t) for L in linear for t in positions]
    share = sum((n_layers - L) / n_layers * (n_tok - t) / n_tok for L, t in cells)
    d = model.spec.dims
    zeros = torch.zeros(1, d["heads"], d["key_dim"], d["value_dim"])
    loop_probs: dict[tuple[int, int], float] = {}
    engine_probs: dict[tuple[int, int], float] = {}

    # positions of each LM head call, per case: every case computes next-token logits only
    head_calls: dict[str, list[int]] = {"plain": [], "loop": [], "engine": []}
    case = ["plain"]
    head = hf.get_output_embeddings().register_forward_hook(
        lambda module, args, out: head_calls[case[0]].append(int(out.shape[1])))

    plain_runs: list[list[float]] = []  # per engine run: the plain forwards timed between its forwards
    engine_runs: list[float] = []  # per engine run: its seconds, the plain forwards taken out

    def plain() -> float:
        case[0] = "plain"
        t = time.perf_counter()
        hf(ids, logits_to_keep=1)
        dt = time.perf_counter() - t
        plain_runs[-1].append(dt)
        case[0] = "engine"
        return dt

    def loop() -> None:
        case[0] = "loop"
        for L, t in cells:
            with model.trace(text, logits_to_keep=1):
                model.layers[L].linear_attn.set_state_after(t, zeros)
                probs = model.next_token_probs.save()
            loop_probs[(L, t)] = float(probs[0, token])

    def engine() -> None:
        case[0] = "engine"
        plain_runs.append([])
        t = time.perf_counter()
        outcome = run_sweeps(exp, progress=False, batch_size=args.batch_size, on_chunk=lambda done: plain())
        engine_runs.append(time.perf_counter() - t - sum(plain_runs[-1]))
        for (L, t) in cells:
            engine_probs[(L, t)] = outcome.results[f'ablate[L={L},t={t}].prob("a")']

    # untimed: a process's first forward pays one-time costs that --warmup 0 would charge to `plain`
    hf(ids, logits_to_keep=1)
    head_calls["plain"].clear()
    t0 = time.perf_counter()
    times = interleaved({"loop": loop, "engine": engine}, repeat=args.repeat, warmup=args.warmup)
    wall = time.perf_counter() - t0
    head.remove()
    runs = args.warmup + args.repeat
    times["engine"] = statistics.median(engine_runs[args.warmup:])
    plain_times = [dt for run in plain_runs[args.warmup:] for dt in run]
    times["plain"] = statistics.median(plain_times)
    engine_full = [p for p in head_calls["engine"] if p != 1]  # its clean capture, one per run
    assert head_calls["plain"] == [1] * sum(map(len, plain_runs)), "the plain forward must keep the last position only"
    assert head_calls["loop"] == [1] * (runs * len(cells)), "the loop must apply the LM head to the last position only"
    assert engine_full == [n_tok] * runs and len(head_calls["engine"]) > runs, head_calls["engine"]
    worst = max(abs(loop_probs[c] - engine_probs[c]) for c in cells)
    assert worst <= 1e-4, f"engine and loop disagree by {worst:.2e}"

    limit = share * times["plain"]
    print(f"benchmarks/sweep.py — {datetime.date.today()} — {machine()}")
    print(f"zero ablation of state_after(t): {len(linear)} DeltaNet blocks x {len(positions)} positions "
          f"{positions} = {len(cells)} cells; random Qwen3.5-0.8B-shaped model, {n_tok}-token prompt; "
          f"median of {args.repeat} (plain forward: of {len(plain_times)}, timed between the engine's forwards; "
          f"benchmark wall {wall:.0f} s); engine vs loop max |dP| {worst:.1e}")
    print(f"LM head on the last position only in the plain forward, the loop's {len(cells)} traces and the "
          f"engine's {len(head_calls['engine']) // runs - 1} forwards of cells; the engine's clean capture "
          f"applies it to all {n_tok} positions, once")
    print(f"{'plain forward':>14} | {'loop: a trace per cell':>23} | {'engine':>16} | {'limit':>22} | "
          f"{'loop / engine':>13} | {'engine / limit':>14}")
    print(f"{times['plain'] * 1000:>11.0f} ms | {times['loop']:>21.2f} s | {times['engine']:>14.2f} s | "
          f"{limit:>8.2f} s ({share:>5.1f} fwd) | {times['loop'] / times['engine']:>12.2f}x | "
          f"{times['engine'] / limit:>13.2f}x")


if __name__ == "__main__":
    main()
