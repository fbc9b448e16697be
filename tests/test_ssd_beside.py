"""`state_after` on Mamba-2 blocks served beside the unchanged scan call, against transformers.

A read's side call behind transformers' torch scan computes only the state's half of it (`ssd.final_state`):
it must be transformers' own final state bit for bit. A write changes what the scan is linear in
(`ssd.carried`): checked against transformers' scan continued from the written state with `initial_states`,
and, through the language, against transformers' cache edited at two positions in turn (each write a one-token
step whose state update is replaced; the rest continued from that cache). A row that writes nothing keeps the
plain forward's logits bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from reference import hf_forward as _forward
from reference import step_replaced

import deltalang
from deltalang.ground.errors import DeltaError
from deltalang.models import internals, testing_ssd
from deltalang.runtime import ssd

FAMILIES = ("bamba", "granitemoehybrid", "falcon_h1", "nemotron_h")
PROMPT = "The Eiffel Tower is in Paris, o"  # 31 byte tokens: four of the tiny configs' chunks


def _inputs(b: int, s: int, h: int, P: int, N: int, g: int, init: bool) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(s)
    args = (torch.randn(b, s, h, P, generator=gen), torch.randn(b, s, h, generator=gen),
            -torch.rand(h, generator=gen) * 2, torch.randn(b, s, g, N, generator=gen),
            torch.randn(b, s, g, N, generator=gen))
    kw = dict(D=torch.randn(h, generator=gen), dt_bias=torch.randn(h, generator=gen),
              initial_states=torch.randn(b, h, P, N, generator=gen) if init else None, dt_softplus=True,
              dt_limit=(0.05, 2.0))
    return args, kw


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("shape", [(2, 37, 4, 8, 6, 2, 8, True), (1, 16, 4, 8, 6, 1, 8, False),
                                   (1, 300, 8, 64, 128, 1, 256, True)])
def test_the_state_half_is_the_scans_own_final_state_bit_for_bit(name: str, shape: tuple) -> None:
    b, s, h, P, N, g, chunk, init = shape
    scan = getattr(testing_ssd.modeling_module(name), internals.SCAN_GLOBAL)
    args, kw = _inputs(b, s, h, P, N, g, init)
    with torch.no_grad():
        _, want = scan(*args, chunk, return_final_states=True, **kw)
        got = ssd.final_state(*args, chunk, **kw)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("q", [0, 20, 35])
def test_a_change_carried_is_the_scan_continued_from_the_changed_state(q: int) -> None:
    """transformers' scan over tokens ..q, its state changed, continued over q+1.. with `initial_states`: the later
    outputs and final state are the unchanged call's plus `ssd.carried`."""
    scan = getattr(testing_ssd.modeling_module("bamba"), internals.SCAN_GLOBAL)
    args, kw = _inputs(2, 37, 4, 8, 6, 2, True)
    change = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y, final = scan(*args, 8, return_final_states=True, **kw)
        _, at_q = scan(*(a[:, :q + 1] if a.dim() > 1 else a for a in args), 8, return_final_states=True, **kw)
        cont, final2 = scan(*(a[:, q + 1:] if a.dim() > 1 else a for a in args), 8, return_final_states=True,
                            **(kw | {"initial_states": at_q + change}))
    cum = ssd.log_decays(args[1], args[2], kw["dt_bias"], True, (0.05, 2.0))
    add, add_final = ssd.carried(args[4], cum, change, q)
    scale = float(cont.abs().max())
    assert float((y[:, q + 1:] + add - cont).abs().max()) < 2e-6 * scale
    assert float((final + add_final - final2).abs().max()) < 2e-6 * float(final2.abs().max())


# -- through the language, against transformers' cache ------------------------------------------


@functools.lru_cache(maxsize=None)
def _models(name: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    path = testing_ssd.tiny_ssd_checkpoint(name)
    return deltalang.load_model(path), AutoModelForCausalLM.from_pretrained(path).eval()


def _edited_logits(name: str, ids: torch.Tensor, layer: int, writes: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """transformers' logits of every token, the state of `layer` after each written position replaced in turn."""
    hf = _models(name)[1]
    logits, cache, pos = [], None, 0
    for t, state in writes:
        if t > pos:
            out = _forward(hf, ids[:, pos:t], cache, pos)
            logits.append(out.logits)
            cache = internals.output_cache(out)
        with step_replaced(name, hf, {layer: state}):
            out = _forward(hf, ids[:, t:t + 1], cache, t)
        logits.append(out.logits)
        cache, pos = internals.output_cache(out), t + 1
    if pos < ids.shape[1]:
        logits.append(_forward(hf, ids[:, pos:], cache, pos).logits)
    return torch.cat(logits, dim=1)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-3) -> None:
    err = float((got.float() - want.float()).abs().max())
    assert err <= tol * max(1.0, float(want.abs().max())), err


@pytest.mark.parametrize("name", ("bamba", "granitemoehybrid"))
def test_two_writes_in_one_block_are_the_cache_edited_twice(name: str) -> None:
    """Zeros after token 4 and a scaled copy of the state read after token 17 (past a chunk), with a read of the
    state after token 25 between them: the later tokens continue from each in turn, the read sees both."""
    model, hf = _models(name)
    layer = [i for i, _ in testing_ssd.ssd_mixers(hf)][1]
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    mixer = model.layers[layer].mamba if hasattr(model.layers[layer], "mamba") else model.layers[layer].mixer
    d = model.spec.dims
    zeros = torch.zeros(1, d["heads"], d["head_dim"], d["d_state"])
    with torch.no_grad(), model.trace(ids):
        mixer.set_state_after(4, zeros)
        before = mixer.state_after(17).save()
        mixer.set_state_after(17, before * 0.5)
        read = mixer.state_after(25).save()
        logits = model.logits.save()
    # the state after 17 given the first write: transformers' cache edited at 4, continued to 17
    want_before = _cache_after(name, ids, layer, [(4, zeros)], 17)
    _close(before, want_before, 2e-4)
    writes = [(4, zeros), (17, want_before * 0.5)]
    _close(logits, _edited_logits(name, ids, layer, writes))
    _close(read, _cache_after(name, ids, layer, writes, 25), 2e-4)


def _cache_after(name: str, ids: torch.Tensor, layer: int, writes: list[tuple[int, torch.Tensor]],
                 t: int) -> torch.Tensor:
    """The state of `layer` in transformers' cache after token t, the writes (all before t) made in turn."""
    hf = _models(name)[1]
    cache, pos = None, 0
    for w, state in writes:
        if w > pos:
            cache = internals.output_cache(_forward(hf, ids[:, pos:w], cache, pos))
        with step_replaced(name, hf, {layer: state}):
            cache = internals.output_cache(_forward(hf, ids[:, w:w + 1], cache, w))
        pos = w + 1
    cache = internals.output_cache(_forward(hf, ids[:, pos:t + 1], cache, pos))
    return cache.get_recurrent_state(layer).float()


def test_a_row_that_writes_nothing_keeps_the_plain_logits_bit_for_bit() -> None:
    """Two invokes share a forward; the first writes zeros after token 3 of every Mamba-2 block, the second only
    reads: its logits are those of the trace without the write, bit for bit."""
    model, _ = _models("granitemoehybrid")
    ssm = model.spec.ssm_layers()
    d = model.spec.dims
    zeros = torch.zeros(1, d["heads"], d["head_dim"], d["d_state"])
    other = "The tower of London is o"
    with torch.no_grad(), model.trace() as tr:
        with tr.invoke(PROMPT):
            for i in ssm:
                model.layers[i].mamba.set_state_after(3, zeros)
        with tr.invoke(other):
            kept = model.logits.save()
    with torch.no_grad(), model.trace() as tr:
        with tr.invoke(PROMPT):
            pass
        with tr.invoke(other):
            plain = model.logits.save()
    assert torch.equal(kept, plain)


def test_writes_out_of_token_order_are_refused_in_one_line() -> None:
    model, hf = _models("bamba")
    layer = [i for i, _ in testing_ssd.ssd_mixers(hf)][0]
    d = model.spec.dims
    zeros = torch.zeros(1, d["heads"], d["head_dim"], d["d_state"])
    with pytest.raises(DeltaError, match="in token order"):
        with torch.no_grad(), model.trace(PROMPT):
            later = model.layers[layer].mamba.state_after(20).save()
            model.layers[layer].mamba.set_state_after(20, zeros)
            model.layers[layer].mamba.set_state_after(5, later)
