"""`states` where late blocks see large inputs, as trained models' do (activations grow with depth).

A head that forgets hard at one token (log decay g = -300) and keeps the next ones: the chunked delta rule's
decay between two tokens, taken as a difference of cumulative sums over the chunk, carries the rounding of the
whole sum (~1e-4 of the state), while the recurrence itself loses nothing there. Ground truth is transformers'
token-by-token kernel (the global its modeling module decodes with) run over the very inputs the forward handed
the block's chunk kernel: its state after token t. (transformers' own chunked kernel, and so its cache after a
prefix, carries the same rounding: measured 1e-4 of the state on these checkpoints, so it cannot be the
reference at 2e-5 here; on the unscaled tiny models `test_states.py` checks the cache itself.) A Mamba-2 block
likewise, against transformers' one-token state update (`internals.STEP_GLOBAL`) over its scan call's inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from reference import delta_calls, kernel_calls
from transformers import AutoModelForCausalLM

import deltalang
from deltalang.models import families, internals, testing_ssd
from deltalang.models.testing import FAMILY_NAMES, built_once, byte_tokenizer, load_hf, tiny_checkpoint

PROMPT = "The Eiffel Tower is in Paris, and the Brandenburg Gate is in Berlin, o"  # 70 byte tokens
# each DeltaNet block's projections scaled by GROWTH to the power of its order: inputs grow with depth
GROWTH = 3.0


def _save_grown(hf: Any, mixers: list[torch.nn.Module], path: Path) -> Path:
    """`hf` saved at `path` with each mixer's projections scaled by `GROWTH` to the power of its order."""
    with torch.no_grad():
        for order, mixer in enumerate(mixers):
            for p in mixer.parameters():
                if p.dim() == 2:
                    p.mul_(GROWTH ** order)
    hf.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def _build_large(family: str, path: Path) -> Path:
    fam = families.by_name(family)
    hf = load_hf(tiny_checkpoint(family)).eval()
    return _save_grown(hf, [m for m in hf.modules() if isinstance(m, fam.mixer_type)], path)


def _states_read(model: Any, layers: list[int]) -> dict[int, torch.Tensor]:
    """deltalang's `states` of each block of `layers` over PROMPT."""
    got: dict[int, torch.Tensor] = {}
    with torch.no_grad(), model.trace(PROMPT):
        for i in layers:
            got[i] = model.layers[i].linear_attn.states.save()
    return got


def large_checkpoint(family: str) -> Path:
    """The tiny checkpoint of `family`, each later DeltaNet block's projections larger (`GROWTH`)."""
    return built_once(family, _build_large, prefix="deltalang-large-")


def _recurrent_states(fam: families.Family, call: tuple[tuple, dict]) -> list[torch.Tensor]:
    """transformers' token-by-token kernel over one chunk-kernel call's inputs: the state after each token."""
    names = ("query", "key", "value", "g", "beta")
    a, k = call
    inputs = dict(zip(names, a)) | {n: k[n] for n in names if n in k}
    l2 = bool(k.get("use_qk_l2norm_in_kernel", False))
    recurrent = getattr(fam.module, fam.recurrent_kernel)
    state, out = k.get("initial_state"), []
    for t in range(inputs["key"].shape[1]):
        step = {n: x[:, t:t + 1] for n, x in inputs.items()}
        _, state = recurrent(**step, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=l2)
        out.append(state)
    return out


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_states_of_large_late_blocks_equal_transformers_recurrence(family: str) -> None:
    fam = families.by_name(family)
    path = large_checkpoint(family)
    model = deltalang.load_model(path)
    hf = load_hf(path).eval()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layers = model.spec.linear_layers()
    got = _states_read(model, layers)
    calls = delta_calls(fam, hf, ids)
    assert len(calls) == len(layers)
    worst = (0.0, -1, -1)
    with torch.no_grad():
        for i, call in zip(layers, calls):
            for t, want in enumerate(_recurrent_states(fam, call)):
                rel = float((got[i][:, t] - want).abs().max() / want.abs().max())
                worst = max(worst, (rel, i, t))
    # float32 rounding relative to the state's magnitude; the largest |g| is in the hundreds
    assert worst[0] < 2e-5, worst


# -- Mamba-2 blocks: transformers' one-token state update over the scan call's own inputs -------------------


def _build_large_ssd(name: str, path: Path) -> Path:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(testing_ssd.tiny_ssd_checkpoint(name)).eval()
    return _save_grown(hf, [mixer for _, mixer in testing_ssd.ssd_mixers(hf)], path)


def _stepped_states(name: str, a: tuple, k: dict) -> list[torch.Tensor]:
    """transformers' one-token state update (`internals.STEP_GLOBAL`) over one scan call's inputs, token by token:
    the state after each token. Its step sizes are the scan's (bias, softplus, then the scan's limits)."""
    x, dt, A, B, C = a[:5]
    step = getattr(testing_ssd.modeling_module(name), internals.STEP_GLOBAL)
    if k.get("dt_bias") is not None:
        dt = dt + k["dt_bias"].to(dt.dtype)
    if k.get("dt_softplus"):
        dt = torch.nn.functional.softplus(dt)
    dt = dt.clamp(*k.get("dt_limit", (0.0, float("inf"))))
    b, _, h, P = x.shape
    initial = k.get("initial_states")
    state = (torch.zeros(b, h, P, B.shape[-1]) if initial is None else initial.float()).clone()
    out = []
    for t in range(x.shape[1]):
        step(state, x[:, t], dt[:, t, :, None].expand(-1, -1, P), A[:, None, None].expand(-1, P, B.shape[-1]),
             B[:, t], C[:, t])
        out.append(state.clone())
    return out


@pytest.mark.parametrize("name", testing_ssd.MAMBA2_FAMILY_NAMES)
def test_states_of_large_late_mamba2_blocks_equal_transformers_steps(name: str) -> None:
    path = built_once(name, _build_large_ssd, prefix="deltalang-large-ssd-")
    model = deltalang.load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layers = model.spec.ssm_layers()
    calls = kernel_calls(name, hf, ids)
    assert sorted(calls) == layers
    got = _states_read(model, layers)
    worst = (0.0, -1, -1)
    with torch.no_grad():
        for i in layers:
            for t, want in enumerate(_stepped_states(name, *calls[i])):
                worst = max(worst, (float((got[i][:, t] - want).abs().max() / want.abs().max()), i, t))
    assert worst[0] < 2e-5, worst
