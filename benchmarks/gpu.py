"""The GPU check: deltalang's values through flash-linear-attention's kernels (FLA), in bfloat16, on CUDA.

Needs a CUDA GPU and the `fla` extra (`pip install ".[fla]"`); run here without one it says so and
exits 2. Not a test: it prints tables, side by side, from one run.

1. Agreement. Every tiny family (`FAMILY_NAMES`) and a random model with Qwen3.5-0.8B's shapes, in
   bfloat16 on CUDA, where deltalang serves every value by splitting FLA's kernels (`backends` mode `auto`: CUDA
   tensors go to FLA), against the same reads in float32 through transformers' torch kernels
   (mode `reference`). Printed per value: the largest absolute difference and the relative one
   (|a - b| / |b|, Frobenius). States are float32 on both sides; the rest bf16 against float32.
   Also the state after t against transformers' own cache (float32, torch kernels).
2. Cost. The 0.8B-shaped model in bfloat16, all 18 DeltaNet blocks: a plain forward (FLA; its Triton
   kernel, as every call through deltalang's dispatchers: section 3),
   `set_state_after(t = n/2)` on every block (FLA split at t), the same through the torch reference,
   and `states` reduced to per-token norms; median of --repeat, the cases taking turns, times as
   ratios to the plain forward, beside each the peak CUDA memory above the model's.
3. FlashQLA, where it is installed and FLA would hand `chunk_gated_delta_rule` to it (SM90+, bf16,
   K = V = 128: the 0.8B shapes). deltalang turns that handoff off for its own calls (docs/gpu.md);
   this measures whether it would have to: FLA's chunk kernel called directly on random bf16 inputs of
   the 0.8B shapes (batch 1, --qla-lengths tokens, long enough for FlashQLA's intra-card split), with
   FlashQLA on and off (`FLA_FLASH_QLA`), each unsplit and split at t = n/2 (`output_final_state`, then
   `initial_state`, as deltalang splits), against transformers' torch kernel in float32; and the
   0.8B-shaped model's plain forward with FlashQLA (deltalang's dispatchers taken out) against the
   plain forward deltalang runs.

Before any of it, the kernels each family runs and what they leave out (`deltalang.runtime.info.kernel_notes`:
FLA installed but not bound, with its import error; FlashQLA). On CUDA it stops (exit 2) where FLA is
not bound: the tables would compare the torch reference with itself.

    python benchmarks/gpu.py [--lengths 512 4096] [--repeat 5] [--qla-lengths 4096 32768]
    python benchmarks/gpu.py --allow-cpu   # a smoke run of the code on this CPU (torch reference only)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import qwen35_08b_shaped, tokenizer_for  # noqa: E402

import deltalang  # noqa: E402
from deltalang.models import families  # noqa: E402
from deltalang.models.testing import FAMILY_NAMES, tiny_checkpoint  # noqa: E402
from deltalang.runtime import backends, info, kernels  # noqa: E402
from deltalang.runtime.model import wrap_model  # noqa: E402

VALUES = ("conv_window_after", "attention_queries", "attention_keys", "attention_values", "decays", "betas",
          "states", "state_after", "attention_head_outputs", "state_output", "attention_output", "output")


def read_all(model: deltalang.DeltaModel, ids: torch.Tensor, t: int) -> dict[str, torch.Tensor]:
    """Every value of every DeltaNet block at position t (per-token values whole), and the logits."""
    got: dict[str, Any] = {}
    with torch.no_grad(), model.trace(ids):
        for i in model.spec.linear_layers():
            mix = model.layers[i].linear_attn
            got[f"L{i}.conv_window_after"] = mix.conv_window_after(t).save()
            for name in VALUES[1:6]:
                got[f"L{i}.{name}"] = getattr(mix, name).save()
            got[f"L{i}.states"] = mix.states.save()  # forward order: the catalogue's
            got[f"L{i}.state_after"] = mix.state_after(t).save()
            got[f"L{i}.attention_head_outputs"] = mix.attention_head_outputs.save()
            got[f"L{i}.state_output"] = mix.state_output.save()
            got[f"L{i}.attention_output"] = mix.attention_output.save()
            got[f"L{i}.output"] = model.layers[i].output.save()
        got["logits"] = model.logits.save()
    return {k: (v[0] if isinstance(v, tuple) else v) for k, v in got.items()}


def agreement(name: str, fast: deltalang.DeltaModel, exact: deltalang.DeltaModel, ids: torch.Tensor,
              t: int) -> list[tuple[str, str, float, float]]:
    """Per value kind, the worst block: (model, value, max |a - b|, |a - b| / |b|)."""
    a = read_all(fast, ids, t)
    with backends.using("reference"):
        b = read_all(exact, ids, t)
    worst: dict[str, tuple[float, float]] = {}
    for key, x in a.items():
        y = b[key].float()
        diff = (x.float() - y)
        kind = key.split(".", 1)[-1]
        cell = (float(diff.abs().max()), float(diff.norm() / y.norm().clamp_min(1e-30)))
        old = worst.get(kind, (0.0, 0.0))
        worst[kind] = (max(old[0], cell[0]), max(old[1], cell[1]))
    return [(name, kind, m, r) for kind, (m, r) in worst.items()]


def cache_check(exact_hf: torch.nn.Module, fast: deltalang.DeltaModel, ids: torch.Tensor, t: int) -> float:
    """Largest relative difference of state_after(t) (FLA, bf16 model) against transformers' cache (fp32)."""
    layers = fast.spec.linear_layers()
    with torch.no_grad(), backends.using("reference"):
        cache = exact_hf(ids[:, : t + 1], use_cache=True).past_key_values
    got = {}
    with torch.no_grad(), fast.trace(ids):
        for i in layers:
            got[i] = fast.layers[i].linear_attn.state_after(t).save()
    worst = 0.0
    for i in layers:
        want = cache.get_recurrent_state(i).float()
        worst = max(worst, float((got[i].float() - want).norm() / want.norm().clamp_min(1e-30)))
    return worst


def timed(cases: dict[str, Callable[[], object]], repeat: int, sync: Callable[[], None]) -> dict[str, tuple]:
    """Median seconds and peak memory above the start, per case, the cases taking turns."""
    for fn in cases.values():
        fn()
    sync()
    samples: dict[str, list[float]] = {k: [] for k in cases}
    peaks = dict.fromkeys(cases, 0)
    for _ in range(repeat):
        for k, fn in cases.items():
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            fn()
            sync()
            samples[k].append(time.perf_counter() - t0)
            if torch.cuda.is_available():
                peaks[k] = max(peaks[k], torch.cuda.max_memory_allocated() - base)
    return {k: (sorted(v)[len(v) // 2], peaks[k]) for k, v in samples.items()}


def cost(device: str, dtype: torch.dtype, lengths: list[int], repeat: int) -> None:
    hf = qwen35_08b_shaped().to(device=device, dtype=dtype)
    model = wrap_model(hf, tokenizer_for(), "random Qwen3.5-0.8B-shaped")
    linear = model.spec.linear_layers()
    d = model.spec.dims
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    print(f"\ncost: random Qwen3.5-0.8B-shaped model, {dtype}, {device}, all {len(linear)} DeltaNet blocks; "
          f"median of {repeat}; time / plain forward [peak memory above the model]")
    print(f"{'tokens':>6} | {'plain':>20} | {'split (FLA)':>20} | {'split (torch ref)':>20} | {'states':>20}")
    for n in lengths:
        ids = torch.randint(3, 248000, (1, n), device=device)
        t = n // 2
        donor = torch.randn(1, d["heads"], d["key_dim"], d["value_dim"], device=device) * 0.1

        def plain() -> None:
            with torch.no_grad():
                hf(ids)

        def split() -> None:
            with torch.no_grad(), model.trace(ids):
                for i in linear:
                    model.layers[i].linear_attn.set_state_after(t, donor)
                model.logits.save()

        def split_reference() -> None:
            with backends.using("reference"):
                split()

        def states() -> None:
            with torch.no_grad(), model.trace(ids):
                for i in linear:
                    model.layers[i].linear_attn.states.norm(dim=(-2, -1)).save()

        got = timed({"plain": plain, "split": split, "ref": split_reference, "states": states}, repeat, sync)
        p = got["plain"][0]
        cells = [f"{got['plain'][0] * 1000:>7.1f} ms [{got['plain'][1] / 2**20:>5.0f} MiB]"]
        cells += [f"{got[k][0] / p:>6.2f}x [{got[k][1] / 2**20:>5.0f} MiB]" for k in ("split", "ref", "states")]
        print(f"{n:>6} | " + " | ".join(f"{c:>20}" for c in cells))


def kernels_report(device: str) -> bool:
    """Print what each family's prompt kernel runs and its notes; False where CUDA is here and FLA is not bound."""
    bound = True
    for family in FAMILY_NAMES:
        fam = families.by_name(family)
        b = kernels.backend(fam, fam.chunk_kernel)
        print(f"  {family}: {fam.chunk_kernel} -> {b.describe()}")
        bound = bound and b.compiled is not None
    notes = {line for family in FAMILY_NAMES
             for line in info.kernel_notes(deltalang.load_model(tiny_checkpoint(family)).spec)}
    for line in sorted(notes):
        print(f"  note: {line}")
    return bound or device != "cuda"


def _fla_chunk(qla: bool, *args: Any, **kwargs: Any) -> Any:
    """FLA's chunk kernel itself, FlashQLA's handoff on or off for the call (FLA reads FLA_FLASH_QLA per call)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    before = os.environ.get(backends.FLASH_QLA_ENV)
    os.environ[backends.FLASH_QLA_ENV] = "1" if qla else "0"
    try:
        return chunk_gated_delta_rule(*args, **kwargs)
    finally:
        if before is None:
            os.environ.pop(backends.FLASH_QLA_ENV, None)
        else:
            os.environ[backends.FLASH_QLA_ENV] = before


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def flash_qla_check(lengths: list[int], repeat: int) -> None:
    """Section 3 (see the module docstring): FlashQLA on and off, unsplit and split, against float32 torch."""
    if not backends.flash_qla_on() or torch.cuda.get_device_capability()[0] < 9:
        print("\nFlashQLA: not installed, off (FLA_FLASH_QLA=0) or not an SM90+ GPU: section 3 not run")
        return
    fam = families.by_name("qwen3_5")
    torch_kernel = kernels.backend(fam, fam.chunk_kernel).reference
    heads, dim = 16, 128  # Qwen3.5-0.8B's DeltaNet heads (key = value heads), K = V = 128
    print(f"\nFlashQLA {backends.flash_qla_version()}: FLA's chunk kernel, bf16, batch 1, {heads} heads, K = V = "
          f"{dim}; relative |a-b|/|b| against transformers' torch kernel in float32; split at t = n/2")
    print(f"{'tokens':>6} | {'kernel':>8} | {'out':>9} | {'final':>9} | {'split out':>9} | {'split fin':>9} | "
          f"{'split vs whole':>14} | {'ms':>7}")
    for n in lengths:
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn(1, n, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in "qkv")
        g = torch.nn.functional.logsigmoid(torch.randn(1, n, heads, device="cuda", generator=gen)).bfloat16()
        beta = torch.rand(1, n, heads, device="cuda", generator=gen).bfloat16()
        kw = {"use_qk_l2norm_in_kernel": True, "output_final_state": True}
        with torch.no_grad():
            want_o, want_h = torch_kernel(q.float(), k.float(), v.float(), g.float(), beta.float(), **kw)
            t = n // 2
            for qla in (True, False):
                o, h = _fla_chunk(qla, q, k, v, g, beta, **kw)
                o1, h1 = _fla_chunk(qla, q[:, :t + 1], k[:, :t + 1], v[:, :t + 1], g[:, :t + 1], beta[:, :t + 1], **kw)
                o2, h2 = _fla_chunk(qla, q[:, t + 1:], k[:, t + 1:], v[:, t + 1:], g[:, t + 1:], beta[:, t + 1:],
                                    initial_state=h1, **kw)
                split = torch.cat([o1, o2], dim=1)
                ms = timed({"k": lambda: _fla_chunk(qla, q, k, v, g, beta, **kw)}, repeat, torch.cuda.synchronize)
                print(f"{n:>6} | {'FlashQLA' if qla else 'Triton':>8} | {_rel(o, want_o):>9.3g} | "
                      f"{_rel(h, want_h):>9.3g} | {_rel(split, want_o):>9.3g} | {_rel(h2, want_h):>9.3g} | "
                      f"{max(_rel(split, o), _rel(h2, h)):>14.3g} | {ms['k'][0] * 1000:>7.2f}")


def plain_flash_qla(lengths: list[int], repeat: int) -> None:
    """The 0.8B-shaped model's plain forward with FlashQLA (dispatchers out) against deltalang's (FlashQLA off)."""
    if not backends.flash_qla_on() or torch.cuda.get_device_capability()[0] < 9:
        return
    hf = qwen35_08b_shaped().to(device="cuda", dtype=torch.bfloat16)
    wrap_model(hf, tokenizer_for(), "0.8B-shaped")  # installs deltalang's dispatchers
    fam = families.by_name("qwen3_5")
    print("\nplain forward, 0.8B-shaped, bf16: FlashQLA (transformers' own globals) vs deltalang's (FLA Triton)")
    for n in lengths:
        ids = torch.randint(3, 248000, (1, n), device="cuda")
        with torch.no_grad():
            mine = timed({"d": lambda: hf(ids)}, repeat, torch.cuda.synchronize)
            ours = hf(ids).logits.float()
            kernels.uninstall(fam)
            try:
                theirs_t = timed({"q": lambda: hf(ids)}, repeat, torch.cuda.synchronize)
                theirs = hf(ids).logits.float()
            finally:
                kernels.install(fam)
        print(f"{n:>6} tokens: FlashQLA {theirs_t['q'][0] * 1000:.1f} ms, deltalang's {mine['d'][0] * 1000:.1f} ms; "
              f"logits |a-b|/|b| {_rel(theirs, ours):.3g}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--qla-lengths", type=int, nargs="+", default=[4096, 32768],
                    help="tokens for the FlashQLA section (batch 1)")
    ap.add_argument("--allow-cpu", action="store_true", help="smoke-run on a CPU (torch reference only)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False here) and the fla extra "
              "(pip install '.[fla]'); --allow-cpu smoke-runs the code on this CPU without FLA", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    versions = ", ".join(f"{d} {backends.installed_version(d)}" for d in ("flash-linear-attention", "triton",
                                                                          "flash-qla") if backends.installed_version(d))
    print(f"benchmarks/gpu.py — {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'no GPU'}), "
          f"torch {torch.__version__}; {versions or 'no FLA, triton or FlashQLA installed'}; kernels:")
    if not kernels_report(device):
        print("FLA is not bound (see the notes above): on CUDA the tables would compare the torch reference with "
              "itself", file=sys.stderr)
        return 2
    rows = []
    cache_rows = []
    for family in FAMILY_NAMES:
        path = tiny_checkpoint(family)
        fast = deltalang.load_model(path, device=device, dtype=dtype)
        exact = deltalang.load_model(path, device=device, dtype=torch.float32)
        ids = fast.tokenizer("The Eiffel Tower is in the city of Paris", return_tensors="pt").input_ids.to(device)
        rows += agreement(family, fast, exact, ids, ids.shape[1] // 2)
        cache_rows.append((family, cache_check(exact._module, fast, ids, ids.shape[1] // 2)))
    if device == "cuda":  # the 0.8B-shaped model: every state of 18 blocks at 512 tokens is ~10 GB in float32
        fast = wrap_model(qwen35_08b_shaped().to(device=device, dtype=dtype), tokenizer_for(), "0.8B-shaped")
        exact = wrap_model(qwen35_08b_shaped().to(device=device), tokenizer_for(), "0.8B-shaped fp32")
        ids = torch.randint(3, 248000, (1, 512), device=device)
        rows += agreement("0.8B-shaped", fast, exact, ids, 255)
        cache_rows.append(("0.8B-shaped", cache_check(exact._module, fast, ids, 255)))
        del fast, exact
        torch.cuda.empty_cache()
    print(f"\nagreement: {dtype} through the served kernels vs float32 through transformers' torch kernels")
    print(f"{'model':>12} | {'value':>24} | {'max |a-b|':>10} | {'|a-b|/|b|':>10}")
    for name, kind, m, r in rows:
        print(f"{name:>12} | {kind:>24} | {m:>10.3g} | {r:>10.3g}")
    print("\nstate_after(t) against transformers' cache (float32, torch kernels), relative, worst block:")
    for name, r in cache_rows:
        print(f"{name:>12} | {r:.3g}")
    if device == "cuda":
        cost(device, dtype, args.lengths, args.repeat)
        flash_qla_check(args.qla_lengths, args.repeat)
        plain_flash_qla(args.lengths, args.repeat)
    else:
        print("\n(--allow-cpu: the 0.8B-shaped agreement and the cost table need a GPU; not run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
