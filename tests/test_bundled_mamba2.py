"""The second bundled model (deltalang/models/bundled/mamba2_model/, a granitemoehybrid Mamba-2 hybrid trained on the
bundled world): it loads by its name, deltalang serves its Mamba-2 blocks, it knows its landmark facts, a
write of its memory through deltalang equals the same write through transformers' cache, and
examples/causal_trace_mamba2.dl runs both grids. No training here: these read the shipped weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from reference import cache_after, states_written

import deltalang
from deltalang.cli import main
from deltalang.models.bundled import MAMBA2_NAME, MAMBA2_PATH, MODELS, NAME, measure, world
from deltalang.models.testing_ssd import ssd_mixers

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
    assert MODELS == {NAME: deltalang.models.bundled.PATH, MAMBA2_NAME: MAMBA2_PATH} and NAME != MAMBA2_NAME


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
    header = next(line for line in out.splitlines() if "┃ block" in line)
    assert [c.strip() for c in header.split("┃")[4:7]] == ["heads", "head_dim", "d_state"]  # a state's axes
    d = deltalang.load_spec(MAMBA2_NAME).dims
    first = next(line for line in out.splitlines() if line.startswith("│ L0 "))
    assert [c.strip() for c in first.split("│")[4:7]] == [str(d["heads"]), str(d["head_dim"]), str(d["d_state"])]


def test_a_collection_names_a_mamba2_states_axes(tmp_path: Path, model: deltalang.DeltaModel) -> None:
    """A run over a dataset that reads a Mamba-2 state collects transformers' cached state after the subject
    (`[heads, head_dim, d_state]` per record) and its manifest names the axes so."""
    from deltalang.models.testing import load_hf
    from deltalang.runs.dataset_run import run_dataset

    rec = RECORDS[0]
    (tmp_path / "facts.jsonl").write_text(json.dumps(rec) + "\n", encoding="utf-8")
    source = 'dataset facts = "facts.jsonl"\ntrace t on facts {\n    read L1.state_after(facts.subject) as s\n}\n'
    (tmp_path / "p.dl").write_text(source, encoding="utf-8")
    col = run_dataset(source, model, filename=str(tmp_path / "p.dl"), out=tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "collection.json").read_text())
    assert manifest["reads"][0]["axes"] == ["record", "heads", "head_dim", "d_state"]
    enc = model.tokenizer(rec["prompt"], return_offsets_mapping=True)
    start = rec["prompt"].index(rec["subject"])
    end = start + len(rec["subject"])
    last = max(i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a < end and b > start)
    hf = load_hf(MAMBA2_PATH, dtype=torch.float32).eval()
    want = cache_after(hf, torch.tensor([enc["input_ids"]]), last).get_recurrent_state(1)[0].float()
    got = col[0][1]["s"].float()
    assert got.shape == want.shape and float((got - want).norm() / want.norm()) < 1e-4


def test_a_missing_bundled_model_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MODELS, MAMBA2_NAME, tmp_path / "absent")
    with pytest.raises(deltalang.ground.errors.DeltaModelError, match="bundled model .* is missing from"):
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
    """The whole held-out set (600 prompts) measured again: the report's figures, hit for hit."""
    acc = measure.heldout_accuracy(model._module, model.spec.tokenizer)
    report = _report()["heldout_accuracy"]
    assert acc == report
    assert acc["overall"]["n"] == len(world.heldout()) and acc["landmark"]["accuracy"] > 0.9


def test_its_answers_live_in_its_mamba2_memory(model: deltalang.DeltaModel) -> None:
    """Through transformers' own cache (measure.landmark_memory): every Mamba-2 block's whole memory after a
    landmark replaced by another landmark's makes the model answer the other landmark's city; the figures are
    the report's."""
    got = measure.landmark_memory(model._module, model.spec.tokenizer)
    report = _report()["landmarks"]
    for key in ("whole_memory_halves_share", "state_only_halves_share",
                "whole_memory_from_other_landmark_answers_donor_city_share"):
        assert got[key] == pytest.approx(report[key], abs=1e-6), key
    assert got["whole_memory_halves_share"] > 0.9 and got["whole_memory_from_other_landmark_answers_donor_city_share"] > 0.9


def test_the_causal_trace_example_runs_its_grid(model: deltalang.DeltaModel) -> None:
    """The example on the first two records: its axes, and the corrupt run's answer moves toward the clean one
    where a block's whole memory after the subject is restored (the normalised effect is positive somewhere)."""
    path = ROOT / "examples" / "causal_trace_mamba2.dl"
    out = deltalang.run(path.read_text(), model, filename=str(path), data={"facts": RECORDS[:2]})
    assert isinstance(out, deltalang.DatasetSweepResults)
    ssm = tuple(f"L{i}" for i in model.spec.ssm_layers())
    assert ssm == ("L0", "L1", "L2", "L4", "L5", "L6")
    assert out.axes["memory"] == (("L", ssm), ("t", LABELS))
    hf, tok = model._module, model.spec.tokenizer
    for i, record in enumerate(RECORDS[:2]):
        probs = measure.next_token_probs(hf, tok, [record["corrupt"]])[0].log()
        corrupt = float(probs[measure.answer_id(tok, record["answer"])] - probs[measure.answer_id(tok, record["foil"])])
        cells = [out.values("memory", {"L": lab, "t": "facts.subject + 1"}, MEASURE)[i] for lab in ssm]
        assert max(cells) > corrupt + 1.0, (i, cells, corrupt)


def test_the_cli_reads_the_states_of_a_written_run(tmp_path: Path, model: deltalang.DeltaModel) -> None:
    """`deltalang run --model` the bundled Mamba-2 model, a trace that writes L1's state after token 5 from another
    prompt and reads L1's states (whole and `.norm(d_state)`): exit 0, and the states are those of transformers'
    run token by token with token 5's state update replaced by the other prompt's state after token 5."""
    from transformers import AutoModelForCausalLM

    clean, other = RECORDS[0]["prompt"], RECORDS[1]["prompt"]
    program = tmp_path / "written.dl"
    program.write_text(f'prompt clean = "{clean}"\nprompt other = "{other}"\n'
                       "trace w on clean { write L1.state_after(5) from other; read L1.states as st; "
                       "read L1.states.norm(d_state) as n }\n")
    assert main(["run", str(program), "--model", MAMBA2_NAME, "--out", str(tmp_path / "out")]) == 0
    got = safetensors.torch.load_file(str(tmp_path / "out" / "results.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(MAMBA2_PATH).eval()  # plain transformers, no deltalang site
    tok = model.spec.tokenizer
    ids = tok(clean, return_tensors="pt").input_ids
    assert ids.shape[1] > 6
    donor = cache_after(hf, tok(other, return_tensors="pt").input_ids, 5).get_recurrent_state(1).clone()
    want = states_written("granitemoehybrid", hf, ids, {5: {1: donor}}, (1,))[1]
    scale = float(want.abs().max())
    assert float((got["st"] - want).abs().max()) <= 2e-4 * scale
    norms = torch.linalg.vector_norm(want, dim=-1)
    assert float((got["n"] - norms).abs().max()) <= 2e-4 * float(norms.max())
    plain = cache_after(hf, ids, ids.shape[1] - 1).get_recurrent_state(1)
    assert float((plain - want[:, -1]).abs().max()) > 100 * float((got["st"] - want).abs().max())
