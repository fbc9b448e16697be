"""Shared pieces of the benchmarks: a random model with Qwen3.5-0.8B's shapes, and a timer.

Timings are medians of interleaved repetitions measured in one process, so the
ratios in a table compare like with like on whatever machine runs them.
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Callable

import torch


def qwen35_08b_shaped(vocab_size: int = 248320, seed: int = 0, layers: int = 24) -> torch.nn.Module:
    """Random weights, Qwen3.5-0.8B's shapes: hidden 1024, 24 blocks (18 DeltaNet), 16 value heads of 128;
    `layers`: the first that many blocks of its layout only (6: five DeltaNet blocks and one attention block)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16,
        layer_types=((["linear_attention"] * 3 + ["full_attention"]) * 6)[:layers],
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    model = Qwen3_5ForCausalLM(cfg).eval()
    return model


def tokenizer_for(vocab_size: int = 248320):
    """A stand-in tokenizer: prompts are given as ids, this only has to exist."""
    from deltalang.models.testing import byte_tokenizer

    return byte_tokenizer()


def median_time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(cases: dict[str, Callable[[], object]], repeat: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per case, the cases taking turns so that drift hits them all alike."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeat):
        for k, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def machine() -> str:
    """The machine in one line, its CPU's model named: tables from different VMs compare only by that (the cost
    of subnormal floats in matrix products, say, differs several-fold between CPU models)."""
    import os

    return (f"{platform.machine()} {cpu_model() or platform.processor()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads")


def cpu_model() -> str:
    """The CPU's model name as Linux reports it ('' elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""
