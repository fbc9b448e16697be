"""What deltalang prints (issue 38): numbers with significant digits and never a negative zero in every table,
tokens shown one way, titles never wrapped inside a measure, the emitted script printing what `run` prints,
a one-prompt attribution sweep's heatmap and its table saying what it left out."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from deltalang.dataset_run import MeasureStats
from deltalang.dataset_store import format_stats
from deltalang.results import Results

ROOT = Path(__file__).parents[1]
NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def _close(shown: str, value: float) -> bool:
    return abs(float(shown) - value) <= 1e-3 * abs(value)


def test_a_small_norm_is_shown_with_significant_digits() -> None:
    value = torch.full((1, 2, 4, 4), 4.18e-06 / 8)  # a Frobenius norm of 4.18e-06
    line = Results({"s4": value}).summary().splitlines()[0]
    (shown, *_) = NUMBER.findall(line.split("‖·‖F", 1)[1])
    assert _close(shown, float(value.norm())), line


def test_a_small_std_is_shown_with_significant_digits() -> None:
    text = format_stats(MeasureStats("m", 1.0, 6.1e-06, 24, 1.0 - 2.6e-06, 1.0 + 2.6e-06))
    std = re.search(r"std (\S+)", text)[1]  # type: ignore[index]
    assert _close(std, 6.1e-06), text


def test_no_table_prints_a_negative_zero() -> None:
    text = format_stats(MeasureStats("m", -0.0, 0.0, 2, -0.0, 0.0))
    per_token = Results({"n": torch.tensor([[-0.0, 1.0]])}, kinds={"n": "norm"},
                        token_labels={"n": ("a", "b")}).summary()
    assert "-0" not in text and "-0" not in per_token, text + per_token


def test_no_module_formats_a_table_number_with_fixed_decimals() -> None:
    """Every table's numbers go through deltalang.display: no `:.4f`-like format outside it (times and
    sizes excepted: they are not measured values)."""
    fixed = re.compile(r"\{[^{}]*:[<>^]?\d*\.\d+f\}")
    allowed = {"cli.py", "collect.py", "html.py", "driver.py"}  # seconds, bytes, cells/s
    found = [f"{p.relative_to(ROOT)}: {m[0]}" for p in (ROOT / "deltalang").rglob("*.py") if p.name not in allowed
             for m in fixed.finditer(p.read_text(encoding="utf-8"))]
    assert not found, found
