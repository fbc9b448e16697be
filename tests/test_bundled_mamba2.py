"""The second bundled model (deltalang/bundled/mamba2_model/, a granitemoehybrid Mamba-2 hybrid trained on the
bundled world): it loads by its name, deltalang serves its Mamba-2 blocks, it knows its landmark facts, a
write of its memory through deltalang equals the same write through transformers' cache, and
examples/causal_trace_mamba2.dl runs both grids. No training here: these read the shipped weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import deltalang
from deltalang.bundled import MAMBA2_NAME, MAMBA2_PATH, MODELS, NAME, measure, world
from deltalang.cli import main
from deltalang.testing_ssd import ssd_mixers

ROOT = Path(__file__).resolve().parents[1]
RECORDS = [json.loads(line) for line in (ROOT / "examples" / "data" / "landmarks.jsonl").read_text().splitlines()]
LABELS = ("facts.subject[0]", "facts.subject", "facts.subject + 1", "-1")
MEASURE = "logit_diff(facts.answer, facts.foil)"
pytestmark = pytest.mark.skipif(not (MAMBA2_PATH / "model.safetensors").exists(),
                                reason="the bundled Mamba-2 model is not built")


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    torch.set_num_threads(2)
    return deltalang.load_model(MAMBA2_NAME)


def _report() -> dict:
    return json.loads((MAMBA2_PATH / "training_report.json").read_text())


def test_two_bundled_models_by_name() -> None:
    assert MODELS == {NAME: deltalang.bundled.PATH, MAMBA2_NAME: MAMBA2_PATH} and NAME != MAMBA2_NAME


def test_loads_by_its_name_and_its_ssm_blocks_are_served(model: deltalang.DeltaModel) -> None:
    assert model.spec.model_id == MAMBA2_NAME
    assert model.spec.family.name == "granitemoehybrid"
    config = model.spec.config
    types = list(config.layer_types)
    assert types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert config.position_embedding_type is None and config.num_local_experts == 0
    mamba = [i for i, _ in ssd_mixers(model._module)]  # the blocks transformers built a Mamba-2 mixer in
    assert mamba == [i for i, t in enumerate(types) if t == "linear_attention"]
    assert model.spec.ssm_layers() == mamba and model.spec.linear_layers() == []


def test_size() -> None:
    assert sum(p.stat().st_size for p in MAMBA2_PATH.iterdir()) <= 10 * 1024 * 1024


def test_info_lists_its_mamba2_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--model", MAMBA2_NAME]) == 0
    out = capsys.readouterr().out
    assert MAMBA2_NAME in out and "6 Mamba-2" in out
    rows = [line.split("│")[1:3] for line in out.splitlines() if line.startswith("│ L")]
    kinds = {block.strip(): kind.strip() for block, kind in rows[:8]}
    assert kinds == {f"L{i}": ("attention" if i in (3, 7) else "Mamba-2") for i in range(8)}


def test_a_missing_bundled_model_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MODELS, MAMBA2_NAME, tmp_path / "absent")
    with pytest.raises(deltalang.errors.DeltaModelError, match="bundled model .* is missing from"):
        deltalang.load_model(MAMBA2_NAME)


def test_knows_the_landmark_facts(model: deltalang.DeltaModel) -> None:
    """Every record of examples/data/landmarks.jsonl: its answer is the model's top-1 next token, and its
    corrupt prompt's is not (the causal-tracing grid needs both); P(' Paris') is the report's."""
    hf, tok = model._module, model.spec.tokenizer
    pairs = [(r["prompt"], r["answer"]) for r in RECORDS]
    assert measure.accuracy(hf, tok, pairs) == 1.0
    probs = measure.next_token_probs(hf, tok, [r["corrupt"] for r in RECORDS])
    assert all(int(probs[i].argmax()) != measure.answer_id(tok, r["answer"]) for i, r in enumerate(RECORDS))
    p = measure.answer_prob(hf, tok, world.EIFFEL_PROMPT, world.EIFFEL_ANSWER)
    assert p == pytest.approx(_report()["eiffel"]["clean"], rel=1e-5)


def test_heldout_accuracy_is_the_reports(model: deltalang.DeltaModel) -> None:
    acc = measure.heldout_accuracy(model._module, model.spec.tokenizer, every=5)
    full = _report()["heldout_accuracy"]
    assert acc["landmark"]["accuracy"] >= full["landmark"]["accuracy"] - 0.1
    assert acc["overall"]["n"] == sum(len(world.heldout_examples(r)[::5]) for r in world.RELATIONS)


def test_a_state_write_equals_transformers_cache(model: deltalang.DeltaModel) -> None:
    """Every Mamba-2 block's state after 'The Eiffel Tower' replaced by the pizza prompt's: deltalang's write
    and the same write into transformers' own cache (measure.memory_patch) give the same P(' Paris')."""
    hf, tok = model._module, model.spec.tokenizer
    n = len(tok("The Eiffel Tower", add_special_tokens=False).input_ids)
    donor = tok.decode(tok(world.PIZZA_PROMPT, add_special_tokens=False).input_ids[:n])
    got = {}
    for mode, writes in (("state", "write L[ssm].state_after(t) from donor"),
                         ("whole", "write L[ssm].state_after(t) from donor\n"
                                   "    write L[ssm].conv_window_after(t) from donor")):
        src = (f'prompt clean = "{world.EIFFEL_PROMPT}"\nprompt donor = "{donor}"\n'
               f"trace p on clean {{\n    {writes.replace('(t)', f'({n - 1})')}\n"
               f'    measure prob("{world.EIFFEL_ANSWER}")\n}}\n')
        got[mode] = float(deltalang.run(src, model)[f'p.prob("{world.EIFFEL_ANSWER}")'])
        want = float(measure.memory_patch(hf, tok, [world.EIFFEL_PROMPT], n, [world.EIFFEL_ANSWER], donor=donor,
                                          mode=mode)[0])
        assert got[mode] == pytest.approx(want, rel=1e-4, abs=1e-6), mode
    assert got["state"] != got["whole"]


def test_the_causal_trace_example_runs_both_grids(model: deltalang.DeltaModel) -> None:
    path = ROOT / "examples" / "causal_trace_mamba2.dl"
    out = deltalang.run(path.read_text(), model, filename=str(path), data={"facts": RECORDS[:2]})
    assert isinstance(out, deltalang.DatasetSweepResults)
    ssm = tuple(f"L{i}" for i in model.spec.ssm_layers())
    assert ssm == ("L0", "L1", "L2", "L4", "L5", "L6")
    for sweep in ("state", "memory"):
        assert out.axes[sweep] == (("L", ssm), ("t", LABELS))
    # the window after the last token feeds no later token: there the whole memory is the state (within float
    # noise, not bit for bit as on the delta rule: the window's write splits the convolution there too)
    for lab in ssm:
        assert out.values("memory", {"L": lab, "t": "-1"}, MEASURE) == pytest.approx(
            out.values("state", {"L": lab, "t": "-1"}, MEASURE), rel=1e-4, abs=1e-4)
    assert any(out.values("memory", {"L": lab, "t": "facts.subject"}, MEASURE)
               != out.values("state", {"L": lab, "t": "facts.subject"}, MEASURE) for lab in ssm)
