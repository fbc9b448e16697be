"""One way from records to forwards: every run over a dataset opens its records through `records.open_records`.

A run, a generate, a collection, a sweep and a sweep by attribution over the same dataset each group their records
into forwards once (`records.forward_groups`, counted here, which only `open_records` calls), under their own kind;
a sweep's records each stand alone, the others' share forwards. Each path's numbers are checked against
transformers by its own tests (test_datasets, test_dataset_generate, test_collect, test_dataset_sweep,
test_attribution_dataset); this one holds the shared step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import deltalang
from deltalang.models.bundled import PATH as BUNDLED
from deltalang.runs import records
from deltalang.runs.dataset_run import run_dataset
from deltalang.sweep.dataset import run_dataset_sweep

pytestmark = pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")

ROOT = Path(__file__).parents[1]
RECORDS = [json.loads(line) for line in (ROOT / "examples" / "data" / "landmarks.jsonl").read_text().splitlines()][:3]
HEAD = 'dataset facts = "facts.jsonl"\n'
PROGRAMS = {
    "run": HEAD + "trace t on facts {\n    measure prob(facts.answer)\n}\n",
    "generate": HEAD + "generate g on facts max_new_tokens 2 {\n    measure prob(facts.answer)\n}\n",
    "collection": HEAD + "trace t on facts {\n    read L0.state_output as s\n}\n",
    "sweep": HEAD + ("sweep s on facts.corrupt over t in facts.subject, -1 {\n    write L0.state_after(t) from facts\n"
                     "    measure logit_diff(facts.answer, facts.foil)\n}\n"),
    "attribution": HEAD + ("sweep s on facts over L in L[linear], t in facts.subject, -1 method attribution {\n"
                           "    write L.state_after(t) from facts.corrupt\n"
                           "    measure logit_diff(facts.answer, facts.foil)\n}\n"),
}


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


@pytest.fixture
def grouped(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[int]]]:
    """Each call of `records.forward_groups`: its kind and the sizes of the groups it formed."""
    calls: list[tuple[str, list[int]]] = []
    real = records.forward_groups

    def counting(program: Any, resolutions: Any, kind: str, batch: bool) -> Any:
        groups, labels = real(program, resolutions, kind, batch)
        calls.append((kind, [len(g) for g in groups]))
        return groups, labels

    monkeypatch.setattr(records, "forward_groups", counting)
    return calls


@pytest.mark.parametrize("kind", ["run", "generate", "collection", "sweep", "attribution"])
def test_every_dataset_path_opens_its_records_once(kind: str, model: deltalang.DeltaModel, tmp_path: Path,
                                                    grouped: list[tuple[str, list[int]]]) -> None:
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    source = PROGRAMS[kind]
    filename = str(tmp_path / "x.dl")
    if kind in ("sweep", "attribution"):
        run_dataset_sweep(source, model, filename=filename, out=tmp_path / "out", progress=False)
    else:
        run_dataset(source, model, filename=filename, out=tmp_path / "out")
    assert [k for k, _ in grouped] == ["sweep" if kind == "attribution" else kind]
    sizes = grouped[0][1]
    assert sum(sizes) == len(RECORDS)
    if kind in ("sweep", "attribution"):
        assert sizes == [1] * len(RECORDS)  # each record its own sweep
    elif kind != "generate":  # a generate's records share one `model.generate` per prompt length
        assert sizes == [len(RECORDS)]  # few records of one program share one forward
