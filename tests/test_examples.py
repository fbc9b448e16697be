"""Every example runs on the bundled model; the memory claims the README makes hold on it."""

from __future__ import annotations

from pathlib import Path

import pytest

import deltalang
from deltalang.bundled import PATH as BUNDLED

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.dl"))
pytestmark = pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


@pytest.mark.parametrize("path", [p for p in EXAMPLES if not p.stem.startswith("sweep")], ids=lambda p: p.stem)
def test_example_runs(path: Path, model: deltalang.DeltaModel) -> None:
    results = deltalang.run(path.read_text(), model, filename=path.name)
    assert len(results) > 0


def test_replacing_the_whole_memory_after_tower_at_least_halves_paris(model: deltalang.DeltaModel) -> None:
    path = Path(__file__).parents[1] / "examples" / "whole_memory.dl"
    r = deltalang.run(path.read_text(), model, filename=path.name)
    clean = r['base.prob(" Paris")']
    state_only = r['state_only.prob(" Paris")']
    whole = r['whole_memory.prob(" Paris")']
    assert clean >= 0.5
    assert whole < clean / 2, (clean, state_only, whole)


def test_the_recipe_patch_moves_the_answer(model: deltalang.DeltaModel) -> None:
    path = Path(__file__).parents[1] / "examples" / "patch_after_token.dl"
    r = deltalang.run(path.read_text(), model, filename=path.name)
    assert r['base.prob(" Paris")'] >= 0.5
    assert not r["before"].equal(r["after"])
