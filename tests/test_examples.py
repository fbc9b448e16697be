"""Every example runs on the bundled model and prints what the README and docs/examples.md show.

The pages' `deltalang run examples/FILE.dl` outputs are the claim: each
line of each example's printed summary must match it, text exactly and each
decimal number to one unit of its last printed digit (the printed precision; the
numbers are fixed facts of the shipped weights in float32).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import deltalang
from deltalang.models.bundled import PATH as BUNDLED

ROOT = Path(__file__).parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.dl"))
pytestmark = pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")

# a decimal number as the summary prints it (0.3196, 1.24032e-05, 1e-05); integers (shapes, positions) are text
DECIMAL = re.compile(r"(?<![\w.])-?(?:\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+)(?![\w.])")


def readme_outputs() -> dict[str, list[str]]:
    """{example stem: its printed lines} from the `deltalang run examples/FILE.dl` outputs README.md and docs/ show
    (paired by scripts/regenerate_docs.py, the script that writes them)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import regenerate_docs as regen

    out: dict[str, list[str]] = {}
    for page in (p for p in regen.PAGES if p.exists()):
        for shown in regen.outputs(page)[0]:
            m = re.fullmatch(r"examples/(\w+)\.dl", shown.command[1]) if len(shown.command) == 2 else None
            if shown.program is None and shown.command[0] == "run" and m:
                out.setdefault(m[1], [line.rstrip() for line in shown.shown.splitlines() if line.strip()])
    return out


README = readme_outputs()


RTOL = 1e-5  # the one slack of a shown number beyond its last digit: float32 sums differ by thread count and CPU


# a sweep cell is a difference of two float32 measures of order 1 (probabilities): its rounding is absolute, up to
# about one float32 epsilon whatever the cell's own size (the causal-tracing grids' near-zero cells, between CPUs:
# 5.502e-05 against 5.500e-05, -4.336e-09 against 2.368e-08)
CELL_ATOL = 2.0 ** -23  # float32's epsilon


def number_matches(got: str, want: str, atol: float = 0.0) -> bool:
    """A printed number against the page's: within one unit of its last printed digit, RTOL of it, or `atol`."""
    return abs(float(got) - float(want)) <= max(printed_unit(want) * 1.0001, RTOL * abs(float(want)), atol)


def printed_unit(number: str) -> float:
    """One unit of the last printed digit of `number` ("0.3196": 1e-4; "1.24032e-05": 1e-10)."""
    mantissa, _, exponent = number.lower().partition("e")
    decimals = len(mantissa.split(".", 1)[1]) if "." in mantissa else 0
    return 10.0 ** (-decimals + (int(exponent) if exponent else 0))


def assert_line_matches(got: str, want: str) -> None:
    """The same text, each number within one unit of its last printed digit or 1e-5 of itself (float32 summation
    differs between CPUs: a probability of 8e-8 is exp of a logit near -16, printed to 6 digits)."""
    assert DECIMAL.sub("#", got).rstrip() == DECIMAL.sub("#", want).rstrip(), f"\n got: {got}\nwant: {want}"
    for g, w in zip(DECIMAL.findall(got), DECIMAL.findall(want), strict=True):
        assert number_matches(g, w), f"{g}, the README: {w}\n got: {got}\nwant: {want}"


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


def test_the_readme_shows_every_example() -> None:
    # sweeps: tests/test_sweep.py; the dataset sweeps: tests/test_dataset_sweep.py, tests/test_bundled_mamba2.py
    shown = {p.stem for p in EXAMPLES if not p.stem.startswith(("sweep", "causal_trace"))}
    assert set(README) == shown
    assert all(README.values())


def test_the_comparison_can_fail() -> None:
    assert_line_matches("x    (1, 4)   norm 0.3197", "x    (1, 4)   norm 0.3196")
    assert_line_matches("p    8.0586e-08", "p    8.05858e-08")  # 2.5e-6 of itself: float32 noise
    with pytest.raises(AssertionError):
        assert_line_matches("p    8.0590e-08", "p    8.05858e-08")
    for got in ("x    (1, 4)   norm 0.3198", "x    (1, 5)   norm 0.3196", "y    (1, 4)   norm 0.3196"):
        with pytest.raises(AssertionError):
            assert_line_matches(got, "x    (1, 4)   norm 0.3196")
    with pytest.raises(AssertionError):
        assert_line_matches("p   1.24034e-05", "p   1.24032e-05")


@pytest.mark.parametrize("name", sorted(README))
def test_example_prints_what_the_readme_shows(name: str, model: deltalang.DeltaModel) -> None:
    path = ROOT / "examples" / f"{name}.dl"
    results = deltalang.run(path.read_text(), model, filename=str(path))  # a dataset's file is beside it
    got = results.summary().splitlines()
    assert len(got) == len(README[name]), "\n".join(got)
    for g, w in zip(got, README[name]):
        assert_line_matches(g, w)


def test_replacing_the_whole_memory_after_tower_at_least_halves_paris(model: deltalang.DeltaModel) -> None:
    path = ROOT / "examples" / "whole_memory.dl"
    r = deltalang.run(path.read_text(), model, filename=path.name)
    clean = r['base.prob(" Paris")']
    state_only = r['state_only.prob(" Paris")']
    whole = r['whole_memory.prob(" Paris")']
    assert clean >= 0.5
    assert whole < clean / 2, (clean, state_only, whole)
