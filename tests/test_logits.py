"""The logits every read and measure sees are the model's own, on every family: transformers' `model(ids).logits`,
after whatever the family does past its LM head. The tiny granitemoehybrid divides its logits by
`logits_scaling` 2.0 and the tiny falcon_h1 multiplies them by `lm_head_multiplier` 0.5 (testing_ssd), as the
real checkpoints do with their own values; nemotron_h and mamba2 cast them to float32. Checked in a trace
(`model.logits`, `model.next_token_probs`), in a program (`read logits`, `read next_token_probs`,
`measure prob`) and at a generate's decode step. The sweep engine's cells on those two families are held to
transformers in test_ssd_sweep.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import deltalang
from deltalang.models import testing, testing_ssd

FAMILIES = testing.FAMILY_NAMES + testing_ssd.MAMBA2_FAMILY_NAMES
PROMPT = "The Eiffel Tower is in"

pytestmark = pytest.mark.usefixtures("one_thread")


def _path(family: str) -> Any:
    if family in testing_ssd.MAMBA2_FAMILY_NAMES:
        return testing_ssd.tiny_ssd_checkpoint(family)
    return testing.tiny_checkpoint(family)


@functools.lru_cache(maxsize=None)
def _models(family: str) -> tuple[deltalang.DeltaModel, Any]:
    path = _path(family)
    return deltalang.load_model(path), testing.load_hf(path).eval()


def _truth(hf: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids, use_cache=False).logits


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def test_the_tiny_checkpoints_scale_their_logits_past_the_head() -> None:
    """Without the scale the comparisons below could not tell the head's output from the model's logits."""
    _, hf = _models("granitemoehybrid")
    assert hf.config.logits_scaling == 2.0
    _, hf = _models("falcon_h1")
    assert hf.model.lm_head_multiplier == 0.5


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_in_a_trace_and_a_program_are_the_models_own(family: str) -> None:
    model, hf = _models(family)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    want = _truth(hf, ids)
    with torch.no_grad(), model.trace(ids):
        logits = model.logits.save()
        probs = model.next_token_probs.save()
    _close(logits, want, "model.logits")
    _close(probs, want[:, -1].float().softmax(-1), "model.next_token_probs")
    answer = model.tokenizer("P", add_special_tokens=False).input_ids[0]
    got = deltalang.run(f'prompt p = "{PROMPT}"\ntrace t on p {{\n    read logits, next_token_probs\n'
                        f'    measure prob("P")\n}}\n', model)
    _close(got["t.logits"], want, "read logits")
    _close(got["t.next_token_probs"], want[:, -1].float().softmax(-1), "read next_token_probs")
    assert got['t.prob("P")'] == pytest.approx(float(want[0, -1].float().softmax(-1)[answer]), abs=1e-6)


@pytest.mark.parametrize("family", ["granitemoehybrid", "falcon_h1", "qwen3_5"])
def test_logits_at_a_decode_step_are_the_models_own(family: str) -> None:
    model, hf = _models(family)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    got = deltalang.run(f'prompt p = "{PROMPT}"\ngenerate g on p max_new_tokens 2 {{\n'
                        f'    step 1: read logits\n    read tokens\n}}\n', model)
    new = got["g.tokens"].reshape(-1)[-2:]
    want = _truth(hf, torch.cat([ids, new[:1].view(1, 1)], dim=1))[:, -1:]
    _close(got["g.step1.logits"].reshape(want.shape), want, "step 1 logits")
