"""The shipped bundled model (deltalang/models/bundled/model/): it loads like any checkpoint, knows its facts,
and its answers depend on its DeltaNet memory. No training here: these read the shipped weights."""

from __future__ import annotations

import json

import pytest
import torch
from test_examples import printed_unit

import deltalang.models.bundled
from deltalang.models.bundled import measure, world

PATH = deltalang.models.bundled.PATH
pytestmark = pytest.mark.skipif(not (PATH / "model.safetensors").exists(), reason="bundled model not built")


@pytest.fixture(scope="module")
def loaded():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(PATH)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(PATH)
    return model, tokenizer


def test_loads_through_auto_classes(loaded):
    model, tokenizer = loaded
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    types = model.config.layer_types
    assert len(types) >= 8
    assert types.count("linear_attention") == 3 * types.count("full_attention")
    assert model.config.linear_conv_kernel_dim == 4
    assert tokenizer.padding_side == "left"
    assert tokenizer.convert_ids_to_tokens(tokenizer(world.EIFFEL_PROMPT).input_ids)[:3] == ["The", "ĠEiffel", "ĠTower"]
    assert tokenizer.decode(tokenizer(world.EIFFEL_ANSWER).input_ids) == " Paris"
    assert {tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token} == set(world.SPECIALS)


def test_size():
    assert sum(p.stat().st_size for p in PATH.iterdir()) <= 15 * 1024 * 1024


def test_tokenizer_matches_world(loaded):
    _, tokenizer = loaded
    assert tokenizer.get_vocab() == world.build_tokenizer().get_vocab()


# The figures docs/examples.md states for the shipped weights (its "The bundled model" section), as printed there.
README_HELDOUT = {"landmark": ("1.000", 150), "person": ("0.917", 120), "food": ("1.000", 30),
                  "recall": ("1.000", 300), "overall": ("0.983", 600)}
README_P_PARIS = "0.999997"
README_EIFFEL = {"clean": "0.999997", "state_only": "0.996302", "whole_memory": "0.0000139"}
README_LANDMARKS = {"state_only_halves_share": "0.107", "whole_memory_halves_share": "0.967"}  # 10.7%, 96.7%
README_DONOR_PAIRS = 146  # "With another landmark's whole memory the model answers that landmark's city in 146 of 146"


def _report() -> dict:
    return json.loads((PATH / "training_report.json").read_text())


def _printed(x: float, shown: str) -> bool:
    """`x` is the number printed as `shown`, to one unit of its last digit."""
    return abs(x - float(shown)) <= printed_unit(shown) * 1.0001


def test_printed_comparison_can_fail():
    assert _printed(0.9963021, "0.996302") and _printed(1.3922e-05, "0.0000139")
    assert not _printed(0.996305, "0.996302") and not _printed(1.42e-05, "0.0000139") and not _printed(0.91, "0.917")


def test_heldout_accuracy(loaded):
    """Measured on the whole held-out set (600 prompts, batched by length): the README's table and the report."""
    acc = measure.heldout_accuracy(*loaded)
    report = _report()["heldout_accuracy"]
    for relation, (shown, n) in README_HELDOUT.items():
        assert acc[relation]["n"] == n == report[relation]["n"], relation
        assert _printed(acc[relation]["accuracy"], shown), (relation, acc[relation])
        assert acc[relation]["accuracy"] == report[relation]["accuracy"], relation  # hits / n: exact
    assert acc["overall"]["n"] == len(world.heldout())


def test_paris(loaded):
    p = measure.answer_prob(*loaded, world.EIFFEL_PROMPT, world.EIFFEL_ANSWER)
    assert _printed(p, README_P_PARIS), p
    assert p == pytest.approx(_report()["eiffel"]["clean"], rel=1e-5)


def test_pizza_answer(loaded):
    probs = measure.next_token_probs(*loaded, [world.PIZZA_PROMPT])[0]
    assert int(probs.argmax()) == measure.answer_id(loaded[1], world.PIZZA_ANSWER)


def test_cache_split_reproduces_full_forward(loaded):
    assert measure.split_consistency(*loaded, world.EIFFEL_PROMPT, 3) < 1e-4


def test_memory_patches_through_the_cache(loaded):
    """Every DeltaNet block's state (and, for the whole memory, convolution window) after 'The Eiffel Tower'
    replaced by 'My favourite food''s through transformers' cache: the README's table and the report."""
    e = measure.eiffel_memory(*loaded)
    report = _report()["eiffel"]
    for key, shown in README_EIFFEL.items():
        assert _printed(e[key], shown), (key, e[key])
        assert e[key] == pytest.approx(report[key], rel=1e-4), key
    assert e["whole_memory"] <= e["clean"] / 2 < e["state_only"]


def test_memory_patches_over_the_landmarks(loaded):
    """Over all 150 landmarks, through the cache: the shares the README states, and the donor-city pairs."""
    got = measure.landmark_memory(*loaded)
    report = _report()["landmarks"]
    assert got["n"] == 150
    for key, shown in README_LANDMARKS.items():
        assert _printed(got[key], shown), (key, got[key])
        assert got[key] == pytest.approx(report[key], abs=1e-6), key
    assert got["other_landmark_donor_pairs"] == README_DONOR_PAIRS == report["other_landmark_donor_pairs"]
    assert got["whole_memory_from_other_landmark_answers_donor_city_share"] == 1.0
