"""Packed sequences once deltalang's dispatchers hold a family's kernel globals: exact, or refused.

Packed input is what `DataCollatorWithFlattening` makes: several sequences concatenated in one
row, `position_ids` restarting at 0 for each, and the flash-attention kwargs (`cu_seq_lens_q`,
`cu_seq_lens_k`, `max_length_q`, `max_length_k`; transformers' own
`prepare_fa_kwargs_from_position_ids`), which the DeltaNet mixers pass on to their kernels.
Without flash-linear-attention transformers refuses them ("can't keep packed sequences apart");
deltalang must never turn that refusal into a wrong number, in a plain forward of a model in the
same process or inside a trace.

Ground truth: each sequence run alone through transformers with its own kernels, the dispatchers
taken out of the modeling module's globals for the reference (`plain_kernels`), and transformers'
cache after that run. Today every case of several sequences is refused (`deltalang.runtime.kernels` says why); the
checks accept an exact answer too, never a wrong one.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

import deltalang
from deltalang.ground.errors import DeltaError
from deltalang.models.internals import cache_kwargs
from deltalang.models.testing import FAMILY_NAMES
from deltalang.runtime import kernels

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (5, 70, 9)  # one sequence longer than a chunk (64 tokens)


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    """Each family's model, loaded once for the module (`_model`)."""
    return {}


def _model(models: dict[str, Any], tiny_path: Any, family: str) -> Any:
    if family not in models:
        models[family] = deltalang.load_model(tiny_path(family))  # installs the dispatchers
    return models[family]


@contextmanager
def plain_kernels(model: Any) -> Iterator[None]:
    """The family's modeling module with the very functions transformers bound, not deltalang's dispatchers."""
    module = model.family.module
    swapped = {name: fn for name, fn in vars(module).items() if hasattr(fn, "__wrapped_kernel__")}
    assert swapped, "deltalang's dispatchers are not installed: the test would not test them"
    try:
        for name in swapped:
            setattr(module, name, kernels.original(model.family, name))
        yield
    finally:
        for name, fn in swapped.items():
            setattr(module, name, fn)


def _packed_inputs(lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> tuple[list[torch.Tensor], dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, 250, (1, n), generator=gen) for n in lengths]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(pos)
    kw = dict(input_ids=torch.cat(seqs, dim=1), position_ids=pos, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
              max_length_q=max_q, max_length_k=max_k)
    return seqs, kw


def _alone(model: Any, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Each sequence's logits run alone through plain transformers (its own kernels), joined along the row."""
    with torch.no_grad(), plain_kernels(model):
        return torch.cat([model._module(s, use_cache=False).logits for s in seqs], dim=1)


def _assert_refused(err: BaseException) -> None:
    assert isinstance(err, (DeltaError, ValueError)), repr(err)
    msg = str(err)
    assert "\n" not in msg and "packed sequences" in msg, msg


def _exact_or_refused(run: Any, alone: torch.Tensor) -> str:
    try:
        with torch.no_grad():
            got = run()
    except Exception as err:  # noqa: BLE001 - the refusal is what is checked
        _assert_refused(err)
        return "refused"
    torch.testing.assert_close(got, alone, atol=1e-4, rtol=1e-4)
    return "exact"


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_plain_forward_on_packed_sequences_is_exact_or_refused(models: dict, tiny_path: Any, family: str,
                                                               use_cache: bool) -> None:
    """A plain forward of a model whose family deltalang has installed, as a peer in the process runs it
    (`use_cache=True` is transformers' default). Refused here: see `deltalang.runtime.kernels`."""
    model = _model(models, tiny_path, family)
    seqs, kw = _packed_inputs()
    alone = _alone(model, seqs)
    _exact_or_refused(lambda: model._module(**kw, use_cache=use_cache).logits, alone)
    with pytest.raises(ValueError, match="packed sequences"):  # catchable as transformers' own refusal
        with torch.no_grad():
            model._module(**kw, use_cache=use_cache)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_one_packed_sequence_with_cache_is_exact_and_its_cache_true(models: dict, tiny_path: Any,
                                                                    family: str) -> None:
    """A single sequence marked as packed (`cu_seqlens` [0, n]) keeps nothing apart: served, with the cache
    transformers' own kernels leave after that sequence, and a decode step after it exact."""
    model = _model(models, tiny_path, family)
    seqs, kw = _packed_inputs((13,))
    nxt = torch.tensor([[42]])
    with torch.no_grad():
        out = model._module(**kw, use_cache=True)
        step = model._module(nxt, **cache_kwargs(out.past_key_values, model._module)).logits
        with plain_kernels(model):
            ref = model._module(seqs[0], use_cache=True)
            ref_cache = ref.past_key_values
            ref_step = model._module(nxt, **cache_kwargs(ref_cache, model._module)).logits
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step, ref_step, atol=1e-4, rtol=1e-4)
    for i in model.linear_layers():
        torch.testing.assert_close(out.past_key_values.layers[i].recurrent_states[0],
                                   ref_cache.layers[i].recurrent_states[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.past_key_values.layers[i].conv_states[0],
                                   ref_cache.layers[i].conv_states[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_packed_sequences_continuing_a_cache_are_refused(models: dict, tiny_path: Any, family: str) -> None:
    model = _model(models, tiny_path, family)
    _, kw = _packed_inputs((4, 6))
    with torch.no_grad():
        cache = model._module(torch.tensor([[7, 8, 9]]), use_cache=True).past_key_values
        with pytest.raises(ValueError) as info:
            model._module(**kw, **cache_kwargs(cache, model._module))
    _assert_refused(info.value)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_trace_over_packed_sequences(models: dict, tiny_path: Any, family: str) -> None:
    """Inside a trace: logits exact or refused, with a cache or without; a DeltaNet value read or written refused."""
    model = _model(models, tiny_path, family)
    seqs, kw = _packed_inputs()
    alone = _alone(model, seqs)
    ids = kw.pop("input_ids")

    def logits(**extra: Any) -> torch.Tensor:
        with model.trace(ids, **kw, **extra):
            out = model.logits.save()
        return out

    _exact_or_refused(lambda: logits(use_cache=False), alone)
    _exact_or_refused(lambda: logits(use_cache=True), alone)
    block = model.linear_layers()[0]

    def read_state() -> torch.Tensor:
        with model.trace(ids, **kw, use_cache=False):
            model.layers[block].linear_attn.state_after(3).save()
            out = model.logits.save()
        return out

    def write_window() -> torch.Tensor:
        with model.trace(ids, **kw, use_cache=False):
            mix = model.layers[block].linear_attn
            mix.conv_window_after(6)[:] = 0
            out = model.logits.save()
        return out

    assert _exact_or_refused(read_state, alone) == "refused"
    assert _exact_or_refused(write_window, alone) == "refused"
