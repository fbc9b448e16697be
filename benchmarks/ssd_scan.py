"""The Mamba-2 scan's cost on one block at the 0.8B benchmark's scale (docs/mamba2.md quotes it).

One random granitemoehybrid Mamba-2 mixer (hidden 1024, 32 heads of 64, d_state 128, one group,
chunk 256), a 512-token prompt; the scan's inputs are taken from inside the mixer's forward. Cases:
  block        the mixer's whole forward (in_proj, conv, transformers' scan, gated norm, out_proj)
  scan         transformers' `mamba2_chunk_scan` alone, with its final state
  split        `ssd.split` at t = s/2 with that scan (two calls, initial_states between)
  final        `ssd.per_token(final_state=True)`
  half         `ssd.final_state` over the prefix ..s/2: the state's half of transformers' scan (a read's side call)
  beside       a write after s/2 as the mixer serves it: the scan unchanged, `half`, `ssd.carried`
  states       `ssd.per_token`: every token's state `[1, s, 32, 64, 128]` float32
  reduced      `ssd.per_token_reduced`: the same states streamed into a mean over positions (one group at a time)
  sqnorms      `ssd.per_token_sq_norms`: each head's squared state norm after every token, without the states
  loop         `ssd.per_token_loop` (token by token)

    python benchmarks/ssd_scan.py [--length 512] [--repeat 3] [--cases scan final ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

from deltalang import measures
from deltalang.models import internals, testing_ssd
from deltalang.runtime import ssd


def _mixer() -> tuple[Any, Any]:
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING["granitemoehybrid"](
        hidden_size=1024, num_hidden_layers=1, layer_types=["linear_attention"], mamba_n_heads=32, mamba_d_head=64,
        mamba_d_state=128, mamba_n_groups=1, mamba_chunk_size=256, mamba_expand=2, num_attention_heads=16,
        num_key_value_heads=4, intermediate_size=512, shared_intermediate_size=512, vocab_size=300)
    module = testing_ssd.modeling_module("granitemoehybrid")
    return module.GraniteMoeHybridMambaLayer(cfg, layer_idx=0).eval(), module


def scan_inputs(length: int) -> tuple[Any, torch.Tensor, tuple, dict[str, Any], Callable[..., Any]]:
    """`(mixer, x, (x, dt, A, B, C), keywords, scan)`: the mixer of `_mixer` (seed 0), a random prompt of `length`
    tokens, the scan's inputs as the mixer's forward passes them to transformers' scan, and that scan."""
    torch.manual_seed(0)
    mixer, module = _mixer()
    x = torch.randn(1, length, 1024)
    original = getattr(module, internals.SCAN_GLOBAL)
    got: dict[str, Any] = {}

    def capture(*a: Any, **k: Any) -> Any:
        got["a"], got["k"] = a, k
        return original(*a, **k)
    setattr(module, internals.SCAN_GLOBAL, capture)
    try:
        with torch.no_grad():
            mixer(x)
    finally:
        setattr(module, internals.SCAN_GLOBAL, original)
    return mixer, x, got["a"][:5], got["k"], original


def _reduced(a: tuple, kw: dict) -> torch.Tensor:
    stream = measures.Reduction(("b", "s", "heads", "key_dim", "value_dim"), [("mean", ("s",))]).stream(1, a[0].shape[1])
    ssd.per_token_reduced(*a, [stream.add], **kw)
    return stream.result()


def _beside(scan: Callable[..., Any], a: tuple, chunk: int, kw: dict, t: int) -> Any:
    y, final = scan(*a, chunk, return_final_states=True, **kw)
    at_t = ssd.final_state(*(x[:, :t + 1] if x.dim() > 1 else x for x in a), chunk, **kw)
    cum = ssd.log_decays(a[1], a[2], kw["dt_bias"], kw["dt_softplus"], kw["dt_limit"])
    add, add_final = ssd.carried(a[4], cum, torch.zeros_like(at_t) - at_t, t)
    return y[:, t + 1:] + add, final + add_final


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cases", nargs="*", default=None)
    args = ap.parse_args()
    mixer, x, a, k, original = scan_inputs(args.length)
    kw = dict(D=k["D"], dt_bias=k["dt_bias"], dt_softplus=True, dt_limit=k["dt_limit"])
    chunk = k["chunk_size"]
    t = args.length // 2
    cases: dict[str, Callable[[], Any]] = {
        "block": lambda: mixer(x),
        "scan": lambda: original(*a, chunk, return_final_states=True, **kw),
        "split": lambda: ssd.split(original, *a, chunk, [args.length // 2], **kw),
        "split/al": lambda: ssd.split(original, *a, chunk, [args.length // 2 - 1], **kw),
        "final": lambda: ssd.per_token(*a, final_state=True, **kw),
        "half": lambda: ssd.final_state(*(x[:, :t + 1] if x.dim() > 1 else x for x in a), chunk, **kw),
        "beside": lambda: _beside(original, a, chunk, kw, t),
        "states": lambda: ssd.per_token(*a, **kw),
        "reduced": lambda: _reduced(a, kw),
        "sqnorms": lambda: ssd.per_token_sq_norms(*a, **kw),
        "loop": lambda: ssd.per_token_loop(*a, **kw),
    }
    cases = {c: fn for c, fn in cases.items() if c == "scan" or args.cases is None or c in args.cases}
    times: dict[str, list[float]] = {c: [] for c in cases}
    with torch.no_grad():
        for _ in range(args.repeat):
            for name, fn in cases.items():  # interleaved, so that a busy machine slows every case alike
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["scan"])
    print(f"{args.length} tokens, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.repeat}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:8s} {med * 1e3:9.1f} ms  {med / base:6.2f}x scan")


if __name__ == "__main__":
    main()
