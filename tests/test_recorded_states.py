"""A second oracle for `states`: transformers 5.25's own record of every state of a prompt.

From 5.25 a cache told `activate_past_recording(recurrent_states_to_keep=N)` runs a prompt's last N tokens through
the recurrent kernel one by one and keeps each state (`recurrent_states_history`: the state before them, then after
each but the last, which is the layer's state). With N the prompt's length that is the state after every token, in
one forward, from transformers' token-by-token kernels: independent of deltalang's chunked scans and of the first
oracle (the cache after each prefix, tests/test_states.py, tests/test_ssd_values.py). Releases before 5.25 have no
such record (the first oracle holds there).

And a trace that reads a value through a cache that records is refused in one line: the prompt then runs as decode
steps, which the value layer would mistake for them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import deltalang
from deltalang.ground.errors import DeltaValueError
from deltalang.models import internals, testing_ssd
from deltalang.models.testing import FAMILY_NAMES, load_hf, tiny_checkpoint

RECORDS = hasattr(__import__("transformers").cache_utils.LinearAttentionCacheLayerMixin, "activate_past_recording")
needs_recording = pytest.mark.skipif(not RECORDS, reason="transformers before 5.25 keeps no record of past states")
PROMPT_LEN = 21  # crosses the tiny configs' chunks (8 for Mamba-2, 64 for the delta rule: one partial chunk)


def _recorded(hf: Any, ids: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    """The state after every token of `ids`, per layer, `[1, s, ...]`, from transformers' own record."""
    cache = internals.cache.fresh(hf.config)
    s = ids.shape[1]
    cache.activate_past_recording(recurrent_states_to_keep=s)
    with torch.no_grad():
        hf(ids, **internals.cache_kwargs(cache, hf), use_cache=True)
    out = {}
    for i in layers:
        layer = cache.layers[i]
        history = layer.recurrent_states_history[0]
        states = [*history[1:], layer.recurrent_states[0]]  # history[0] is the state before the prompt
        assert len(states) == s, (i, len(states))
        out[i] = torch.stack(states, dim=1)
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _check(model: Any, hf: Any, ids: torch.Tensor, layers: list[int], tol: float) -> None:
    want = _recorded(hf, ids, layers)
    got = {}
    with torch.no_grad(), model.trace(ids):
        for i in layers:
            got[i] = model.layers[i].linear_attn.states.save()
    for i in layers:
        assert got[i].shape == want[i].shape, (i, got[i].shape, want[i].shape)
        assert _rel(got[i], want[i]) < tol, (i, _rel(got[i], want[i]))


def _ids(n: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(3, 259, (1, n), generator=torch.Generator().manual_seed(0))


@needs_recording
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_delta_rule_states_equal_transformers_record_of_every_state(family: str) -> None:
    path = tiny_checkpoint(family)
    model, hf = deltalang.load_model(path), load_hf(path).eval()
    _check(model, hf, _ids(), model.spec.linear_layers(), 5e-5)


@needs_recording
@pytest.mark.parametrize("name", testing_ssd.MAMBA2_FAMILY_NAMES)
def test_mamba2_states_equal_transformers_record_of_every_state(name: str) -> None:
    from transformers import AutoModelForCausalLM

    path = testing_ssd.tiny_ssd_checkpoint(name)
    model, hf = deltalang.load_model(path), AutoModelForCausalLM.from_pretrained(path).eval()
    _check(model, hf, _ids(), model.spec.ssm_layers(), 5e-5)


@needs_recording
def test_a_trace_through_a_recording_cache_is_refused_in_one_line() -> None:
    path = tiny_checkpoint(FAMILY_NAMES[0])
    model = deltalang.load_model(path)
    cache = internals.cache.fresh(load_hf(path).config)
    cache.activate_past_recording(recurrent_states_to_keep=3)
    layer = model.spec.linear_layers()[0]
    with pytest.raises(DeltaValueError, match=rf"^L{layer}: the cache records its past states") as info:
        with torch.no_grad(), model.trace(_ids(), **internals.cache_kwargs(cache, model), use_cache=True):
            model.layers[layer].linear_attn.states.save()
    assert "\n" not in str(info.value)
