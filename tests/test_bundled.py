"""The shipped bundled model (deltalang/bundled/model/): it loads like any checkpoint, knows its facts,
and its answers depend on its DeltaNet memory. No training here: these read the shipped weights."""

from __future__ import annotations

import json

import pytest
import torch

import deltalang.bundled
from deltalang.bundled import measure, world

PATH = deltalang.bundled.PATH
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


def test_heldout_accuracy(loaded):
    # the whole held-out set (600 prompts, batched by length): about a second
    acc = measure.heldout_accuracy(*loaded)
    assert acc["overall"]["n"] == len(world.heldout())
    assert acc["overall"]["accuracy"] >= 0.95, acc


def test_paris(loaded):
    assert measure.answer_prob(*loaded, world.EIFFEL_PROMPT, world.EIFFEL_ANSWER) >= 0.5


def test_pizza_answer(loaded):
    probs = measure.next_token_probs(*loaded, [world.PIZZA_PROMPT])[0]
    assert int(probs.argmax()) == measure.answer_id(loaded[1], world.PIZZA_ANSWER)


def test_cache_split_reproduces_full_forward(loaded):
    assert measure.split_consistency(*loaded, world.EIFFEL_PROMPT, 3) < 1e-4


def test_whole_memory_patch_halves_paris(loaded):
    """Every DeltaNet block's state and convolution window after 'The Eiffel Tower' replaced by
    'My favourite food''s, through transformers' cache: P(' Paris') at least halves."""
    model, tokenizer = loaded
    args = ([world.EIFFEL_PROMPT], 3, [world.EIFFEL_ANSWER])
    clean = float(measure.memory_patch(model, tokenizer, *args, mode="none")[0])
    whole = float(measure.memory_patch(model, tokenizer, *args, mode="whole")[0])
    assert clean >= 0.5
    assert whole <= clean / 2, (clean, whole)


def test_report_matches_shipped_weights(loaded):
    """The shipped training_report.json was written from these weights."""
    report = json.loads((PATH / "training_report.json").read_text())
    e = measure.eiffel_memory(*loaded)
    for key in ("clean", "state_only", "whole_memory"):
        assert e[key] == pytest.approx(report["eiffel"][key], abs=1e-5)
    assert all(report["checks"].values())
