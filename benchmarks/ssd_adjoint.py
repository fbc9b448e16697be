"""The Mamba-2 adjoint's cost on one block at the 0.8B benchmark's scale (docs/benchmarks.md quotes it).

One random granitemoehybrid Mamba-2 mixer (hidden 1024, 32 heads of 64, d_state 128, one group,
chunk 256), a 512-token prompt; the scan's inputs are taken from inside the mixer's forward, the gradient
at its output is random. Cases, each against `scan` in the same run:
  scan         transformers' `mamba2_chunk_scan` alone (no gradient), the baseline
  backward     autograd through that scan to its inputs (x, dt, B, C): what a gradient pass pays for it
  gradients    `gradients.state_gradients`: dM/dS_t for every token, `[1, s, 32, 64, 128]` float32
  dots         `gradients.state_dots` at the last 64 tokens, the gradient of 3 rows (plain and blk2's two
               points, as an estimate of a donor's state takes them)
  dots2        the same at 2 tokens (a dataset sweep's `t in facts.subject, -1`)

    python benchmarks/ssd_adjoint.py [--length 512] [--repeat 3] [--cells 64]
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
from common import median_time  # benchmarks/, beside this script
from ssd_scan import scan_inputs

from deltalang.runtime import gradients


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cells", type=int, default=64)
    args = ap.parse_args()
    _, _, (xs, dt, A, B, C), k, original = scan_inputs(args.length)
    kw = dict(D=k["D"], dt_bias=k["dt_bias"], dt_softplus=True, dt_limit=k["dt_limit"])
    chunk = k["chunk_size"]
    go = torch.randn(1, *xs.shape[1:])
    blk = gradients.BlockRecord(0, scan=gradients.ScanRecord(xs, dt, A, B, C, kw["D"], kw["dt_bias"], True,
                                                             tuple(kw["dt_limit"])), grad_out=go)
    rows = attrs_rows(blk, 3)
    cells = list(range(args.length - args.cells, args.length))
    delta = torch.randn(1, *xs.shape[2:], B.shape[-1])

    def backward() -> None:
        ins = [t.clone().requires_grad_(True) for t in (xs, dt, B, C)]
        with torch.enable_grad():
            y = original(ins[0], ins[1], A, ins[2], ins[3], chunk, **kw)
            torch.autograd.grad(y, ins, go)

    cases: dict[str, Callable[[], Any]] = {
        "scan": lambda: original(xs, dt, A, B, C, chunk, **kw),
        "backward": backward,
        "gradients": lambda: gradients.state_gradients(None, blk),  # type: ignore[arg-type]
        "dots": lambda: gradients.state_dots(None, blk, lambda t: delta, rows, cells),  # type: ignore[arg-type]
        "dots2": lambda: gradients.state_dots(None, blk, lambda t: delta, rows,  # type: ignore[arg-type]
                                              [args.length // 3, args.length - 1]),
    }
    with torch.no_grad():
        base = None
        for name, fn in cases.items():
            with torch.enable_grad() if name == "backward" else torch.no_grad():
                fn()  # warm
                took = median_time(fn, args.repeat)
            base = took if base is None else base
            print(f"{name:10s} {took:8.3f} s  {took / base:5.2f}x scan")


def attrs_rows(blk: gradients.BlockRecord, n: int) -> gradients.BlockRecord:
    """`blk` with its output gradient repeated as `n` rows (the variants an estimate scans together)."""
    import attrs

    assert blk.grad_out is not None
    return attrs.evolve(blk, grad_out=blk.grad_out.expand(n, *blk.grad_out.shape[1:]).clone())


if __name__ == "__main__":
    main()
