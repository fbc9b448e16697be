"""deltalang's values on Mamba-2 (SSD) blocks, against transformers' own cache, on tiny checkpoints.

Ground truth is a plain transformers model of the same checkpoint (its own instance, no deltalang site):
its cache after running the first t + 1 tokens holds the true state after token t
(`get_recurrent_state(i)`) and the convolution window (`get_conv_state(i)`, less the column the next
token drops). A write of the state after t is transformers run on tokens 0..t-1, then token t as a
one-token step whose state update is replaced by the written state (token t reads it: y = h C + D x), then
the rest of the prompt continued from that cache. Nothing is compared with deltalang's own output, except
the logits of a trace with reads against the same model's trace without them (bit for bit).
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator

import pytest
import torch
from reference import cache_after as _cache_after
from reference import hf_forward as _forward
from reference import kernel_patched, states_written, step_replaced

import deltalang
from deltalang.models import internals, testing_ssd

SERVED = testing_ssd.MAMBA2_FAMILY_NAMES  # all six: zamba2's hybrid blocks nest the mixer, mamba2 has no attention
PROMPT_LEN = 13  # crosses the tiny configs' chunk of 8


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-4) -> None:
    scale = max(1.0, float(want.abs().max()))
    err = float((got.float() - want.float()).abs().max())
    assert err <= tol * scale, f"max |diff| {err:.3g} > {tol:g} * {scale:.3g}"


@functools.lru_cache(maxsize=None)
def _models(name: str) -> tuple[Any, Any]:
    """(deltalang's model, a plain transformers model of the same checkpoint)."""
    from transformers import AutoModelForCausalLM

    path = testing_ssd.tiny_ssd_checkpoint(name)
    return deltalang.load_model(path), AutoModelForCausalLM.from_pretrained(path).eval()


def _ids(n: int = PROMPT_LEN, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 259, (1, n), generator=torch.Generator().manual_seed(seed))


def _ssm(hf: Any) -> list[int]:
    return [i for i, _ in testing_ssd.ssd_mixers(hf)]


def _written_logits(name: str, hf: Any, ids: torch.Tensor, new: dict[int, torch.Tensor], t: int) -> torch.Tensor:
    """transformers' logits of tokens t.. with the state after t of each layer of `new` replaced (the module doc)."""
    cache = internals.output_cache(_forward(hf, ids[:, :t])) if t > 0 else None
    assert cache is not None, "the tests write after t >= 1"
    with step_replaced(name, hf, new):
        out = _forward(hf, ids[:, t:t + 1], cache, start=t)
    logits = [out.logits]
    if t + 1 < ids.shape[1]:
        logits.append(_forward(hf, ids[:, t + 1:], internals.output_cache(out), start=t + 1).logits)
    return torch.cat(logits, dim=1)


# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", SERVED)
def test_the_state_and_window_after_every_prefix_are_the_cache(name: str) -> None:
    model, hf = _models(name)
    ids = _ids()
    layers = _ssm(hf)
    assert model.spec.ssm_layers() == layers and model.spec.linear_layers() == []
    s = ids.shape[1]
    got: dict[Any, Any] = {}
    with torch.no_grad(), model.trace(ids):
        for i in layers:
            mixer = model.layers[i].linear_attn
            for t in range(s):
                got[i, "conv", t] = mixer.conv_window_after(t).save()
            got[i, "states"] = mixer.states.save()
            for t in range(s):
                got[i, "state", t] = mixer.state_after(t).save()
    for t in range(s):
        cache = _cache_after(hf, ids, t)
        for i in layers:
            want = cache.get_recurrent_state(i)
            _close(got[i, "state", t], want)
            _close(got[i, "states"][:, t], want)
            _close(got[i, "conv", t], cache.get_conv_state(i)[:, :, 1:])
            assert got[i, "state", t].shape == (1, *[model.spec.dims[k] for k in ("heads", "head_dim", "d_state")])


@pytest.mark.parametrize("name", SERVED)
def test_reads_leave_the_logits_bit_for_bit(name: str) -> None:
    model, _ = _models(name)
    ids = _ids()
    with torch.no_grad():
        with model.trace(ids):
            plain = model.logits.save()
        with model.trace(ids):
            for i in model.spec.ssm_layers():
                mixer = model.layers[i].linear_attn
                mixer.conv_window_after(2).save()
                for value in ("output_matrices", "input_matrices", "scan_inputs", "step_sizes", "decay_rates",
                              "states"):
                    getattr(mixer, value).save()
                mixer.state_after(3).save()
                mixer.state_after(-1).save()
                mixer.head_outputs.save()
                mixer.state_output.save()
            read = model.logits.save()
    assert torch.equal(plain, read)


@pytest.mark.parametrize("name", SERVED)
def test_a_read_is_the_same_bits_whatever_else_the_trace_reads(name: str) -> None:
    """The state after 11 is the scan over its prefix from the call's start, the same bits whether or not the
    other invoke, or its own, reads an earlier position (a side call started from that read's state gave other
    bits: float sums in another order), and the other invoke's logits stay bit for bit."""
    model, _ = _models(name)
    layer = model.spec.ssm_layers()[0]
    ids, other = _ids(seed=1), _ids(seed=2)

    def trace(own: tuple[int, ...], others: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke(ids):
                for t in own:
                    got["read"] = model.layers[layer].linear_attn.state_after(t).save()
            with tracer.invoke(other):
                for t in others:
                    model.layers[layer].linear_attn.state_after(t).save()
                got["logits"] = model.logits.save()
        return got["read"], got["logits"]

    alone = trace((11,), ())
    for own, others in (((11,), (3,)), ((3, 11), ()), ((2, 11), (9,))):
        got = trace(own, others)
        assert torch.equal(got[0], alone[0]), (own, others)
        assert torch.equal(got[1], alone[1])


@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_written_state_is_what_the_later_tokens_continue_from(name: str, where: str) -> None:
    model, hf = _models(name)
    ids = _ids()
    layers = _ssm(hf)
    layer = layers[0] if where == "first" else layers[-1]
    t = 5
    shape = (1, *[model.spec.dims[k] for k in ("heads", "head_dim", "d_state")])
    donor = _cache_after(hf, _ids(seed=7), 9).get_recurrent_state(layer).clone()
    for new in (torch.zeros(shape), donor):
        with torch.no_grad(), model.trace(ids):
            model.layers[layer].linear_attn.set_state_after(t, new)
            got = model.logits.save()
        want = _written_logits(name, hf, ids, {layer: new}, t)
        _close(got[:, t:], want, tol=1e-3)
        with torch.no_grad():
            clean = _forward(hf, ids).logits
        # the write changes what follows by far more than deltalang and transformers differ (falcon_h1's tiny
        # Mamba-2 blocks move its logits by ~1e-5 only: its written state is checked in the read-after-write test)
        err = float((got[:, t:] - want).abs().max())
        if name != "falcon_h1":
            assert float((got[:, t + 1:] - clean[:, t + 1:]).abs().max()) > 10 * err


@pytest.mark.parametrize("name", SERVED)
def test_a_read_after_a_write_sees_the_written_state(name: str) -> None:
    model, hf = _models(name)
    ids = _ids()
    layer = _ssm(hf)[0]
    donor = _cache_after(hf, _ids(seed=3), 4).get_recurrent_state(layer).clone()
    with torch.no_grad(), model.trace(ids):
        model.layers[layer].linear_attn.set_state_after(2, donor)
        later = model.layers[layer].linear_attn.state_after(6).save()
    # ground truth: the cache after token 6, continued from the donor's state after token 2
    cache = internals.output_cache(_forward(hf, ids[:, :2]))
    with step_replaced(name, hf, {layer: donor}):
        out = _forward(hf, ids[:, 2:3], cache, start=2)
    cache = internals.output_cache(_forward(hf, ids[:, 3:7], internals.output_cache(out), start=3))
    want = cache.get_recurrent_state(layer)
    _close(later, want)
    clean = _cache_after(hf, ids, 6).get_recurrent_state(layer)
    assert float((clean - want).abs().max()) > 100 * float((later - want).abs().max())  # the write shows


def _shape(model: Any) -> tuple[int, ...]:
    return (1, *[model.spec.dims[k] for k in ("heads", "head_dim", "d_state")])


@pytest.mark.parametrize("name", SERVED)
def test_states_after_a_write_are_the_written_runs(name: str) -> None:
    """`states_as_run` of a block whose state after t is written: the states of transformers' prompt run token by
    token, token t's state update replaced by the written state (`reference.states_written`): before t the clean
    ones, at t the written one, after it continued from it; a later block's states continue the written run too.
    Two writes in one block (zeros after 3, a donor after 9, past the chunk of 8) compose the same way."""
    model, hf = _models(name)
    ids = _ids()
    layers = _ssm(hf)
    first, last = layers[0], layers[-1]
    donor = _cache_after(hf, _ids(seed=7), 9).get_recurrent_state(first).clone()
    with torch.no_grad(), model.trace(ids):
        model.layers[first].linear_attn.set_state_after(5, donor)
        got_first = model.layers[first].linear_attn.states_as_run.save()
        got_last = model.layers[last].linear_attn.states_as_run.save()
    got = {first: got_first, last: got_last}
    want = states_written(name, hf, ids, {5: {first: donor}}, (first, last))
    clean = _cache_after(hf, ids, 8).get_recurrent_state(first)
    for i in (first, last):
        assert got[i].shape == want[i].shape == (1, ids.shape[1], *_shape(model)[1:])
        _close(got[i], want[i])
    assert float((clean - want[first][:, 8]).abs().max()) > 100 * float((got[first] - want[first]).abs().max())
    assert torch.equal(got[first][:, 5], donor.float())  # the written state itself
    with torch.no_grad(), model.trace(ids):
        mixer = model.layers[last].linear_attn
        mixer.set_state_after(3, torch.zeros(_shape(model)))
        mixer.set_state_after(9, donor)
        two = mixer.states_as_run.save()
    _close(two, states_written(name, hf, ids, {3: {last: torch.zeros(_shape(model))}, 9: {last: donor}}, (last,))[last])


@pytest.mark.parametrize("name", SERVED)
def test_a_program_reads_the_states_of_its_written_run(name: str) -> None:
    """Through the language: `write L.state_after(5) from other` with `read L.states` (whole and reduced) in the
    same trace reads the states of the written run (docs/language.md), against transformers' run token by token
    with token 5's state update replaced by the other prompt's state after 5."""
    model, hf = _models(name)
    layer = _ssm(hf)[0]
    clean, other = "The tower of London is old", "A cat sat on the mat today"
    text = (f'prompt clean = "{clean}"\nprompt other = "{other}"\ntrace w on clean {{\n'
            f"    write L{layer}.state_after(5) from other\n"
            f"    read L{layer}.states as st\n    read L{layer}.states.norm(d_state) as n\n"
            f"    read L{layer}.states.mean(positions) as m\n    read L{layer}.states.head(1).norm() as h\n}}\n")
    res = deltalang.run(text, model=model)
    ids = model.tokenizer(clean, return_tensors="pt")["input_ids"]
    donor = _cache_after(hf, model.tokenizer(other, return_tensors="pt")["input_ids"], 5).get_recurrent_state(layer)
    want = states_written(name, hf, ids, {5: {layer: donor.clone()}}, (layer,))[layer]
    _close(torch.as_tensor(res["st"]), want)
    _close(torch.as_tensor(res["n"]), torch.linalg.vector_norm(want, dim=-1))
    _close(torch.as_tensor(res["m"]), want.mean(dim=1))
    _close(torch.as_tensor(res["h"]), torch.linalg.vector_norm(want[:, :, 1].flatten(2), dim=-1))
    plain = _cache_after(hf, ids, ids.shape[1] - 1).get_recurrent_state(layer)
    assert float((plain - want[:, -1]).abs().max()) > 100 * float((torch.as_tensor(res["st"]) - want).abs().max())


@pytest.mark.parametrize("name", SERVED)
def test_a_decode_steps_states_after_its_write(name: str) -> None:
    """At a decode step, `states_as_run` after `set_state_after(-1, donor)` is its one token's written state,
    `[b, 1, heads, head_dim, d_state]`: transformers' cache after that step with its state update replaced."""
    model, hf = _models(name)
    ids = _ids(8)
    layer = _ssm(hf)[0]
    donor = _cache_after(hf, _ids(seed=11), 6).get_recurrent_state(layer).clone()
    with torch.no_grad(), model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
        for step in tracer.iter[1]:
            model.layers[layer].linear_attn.set_state_after(-1, donor)
            got = model.layers[layer].linear_attn.states_as_run.save()
    logits = _forward(hf, ids).logits[:, -1].clone()
    logits[:, hf.config.eos_token_id] = -float("inf")
    cache = _cache_after(hf, ids, ids.shape[1] - 1)
    with step_replaced(name, hf, {layer: donor}):
        out = _forward(hf, logits.argmax(-1, keepdim=True), cache, start=ids.shape[1])
    assert got.shape == (1, 1, *_shape(model)[1:])
    _close(got[:, 0], internals.output_cache(out).get_recurrent_state(layer))


def test_ssm_and_linear_selectors_on_granitemoehybrid() -> None:
    """granitemoehybrid's config calls its Mamba-2 blocks `linear_attention`: `L[ssm]` selects them, `L[linear]`
    none (an error naming it), `L*` of a DeltaNet-only value none."""
    from deltalang.ground.errors import DeltaError

    spec = deltalang.load_spec(testing_ssd.tiny_ssd_checkpoint("granitemoehybrid"))
    kinds = list(spec.config.layer_types)
    want = [i for i, k in enumerate(kinds) if k == "linear_attention"]
    assert len(want) == 3 and spec.ssm_layers() == want and spec.linear_layers() == []
    r = deltalang.check("read L[ssm].states\nread L[ssm].state_after(2)", spec, prompt="abcdef")
    assert sorted({op.layer for op in r.run("main").ops}) == want
    for text, words in (("read L[linear].states", "no linear blocks"),
                        ("read L*.attention_keys", "no block of this model has 'attention_keys'"),
                        ("read L2.step_sizes", "no Mamba-2 mixer on this block")):
        with pytest.raises(DeltaError) as err:
            deltalang.check(text, spec, prompt="abcdef")
        assert words in str(err.value)


@pytest.mark.parametrize("name", SERVED)
def test_a_program_writes_every_ssm_block(name: str) -> None:
    """`write L[ssm].state_after(t) = zeros` through the language equals transformers with every Mamba-2
    block's state after t replaced by zeros (zamba2: its hybrid blocks' nested mixers too)."""
    model, hf = _models(name)
    text = 'prompt p = "The tower of"\ntrace w on p {\n    write L[ssm].state_after(4) = zeros\n    read logits\n}\n'
    res = deltalang.run(text, model=model)
    ids = model.tokenizer("The tower of", return_tensors="pt")["input_ids"]
    shape = (1, *[model.spec.dims[k] for k in ("heads", "head_dim", "d_state")])
    assert model.spec.ssm_layers() == _ssm(hf)
    want = _written_logits(name, hf, ids, {i: torch.zeros(shape) for i in _ssm(hf)}, 4)
    _close(res["w.logits"][:, 4:], want, tol=1e-3)


@pytest.mark.parametrize("name", SERVED)
def test_a_written_window_is_what_the_later_tokens_see(name: str) -> None:
    """`conv_window_after(t)` written: transformers run on 0..t, its cache's window replaced, the rest continued."""
    model, hf = _models(name)
    ids = _ids()
    layer, t = _ssm(hf)[0], 4
    donor = _cache_after(hf, _ids(seed=5), 8).get_conv_state(layer)[:, :, 1:].clone()
    with torch.no_grad(), model.trace(ids):
        model.layers[layer].linear_attn.set_conv_window_after(t, donor)
        got = model.logits.save()
    cache = _cache_after(hf, ids, t)
    cache.get_conv_state(layer)[:, :, 1:] = donor
    want = _forward(hf, ids[:, t + 1:], cache, start=t + 1).logits
    _close(got[:, t + 1:], want, tol=1e-3)
    with torch.no_grad():
        clean = _forward(hf, ids).logits
    if name != "falcon_h1":  # as above: its tiny Mamba-2 blocks barely move its logits
        assert float((got[:, t + 1:] - clean[:, t + 1:]).abs().max()) > 10 * float((got[:, t + 1:] - want).abs().max())


@pytest.mark.parametrize("name", SERVED)
def test_decode_steps_serve_the_cached_state(name: str) -> None:
    """Under generate: a step's state_input is the cache after the prompt, its state_output the cache after the
    prompt and the generated token; a written state_input is what that step starts from."""
    model, hf = _models(name)
    ids = _ids(8)
    layer = _ssm(hf)[0]
    shape = (1, *[model.spec.dims[k] for k in ("heads", "head_dim", "d_state")])
    with torch.no_grad(), model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
        for step in tracer.iter[1]:
            entering = model.layers[layer].linear_attn.state_input.save()
            after = model.layers[layer].linear_attn.state_after(-1).save()
            leaving = model.layers[layer].linear_attn.state_output.save()
    logits = _forward(hf, ids).logits[:, -1].clone()
    logits[:, hf.config.eos_token_id] = -float("inf")  # min_new_tokens: greedy without end-of-text
    tokens = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    cache = _cache_after(hf, ids, ids.shape[1] - 1)
    _close(entering, cache.get_recurrent_state(layer))
    step = _forward(hf, tokens[:, ids.shape[1]:ids.shape[1] + 1], cache, start=ids.shape[1])
    _close(leaving, internals.output_cache(step).get_recurrent_state(layer))
    assert torch.equal(after, leaving)
    with torch.no_grad(), model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
        for step in tracer.iter[1]:
            model.layers[layer].linear_attn.state_input = torch.zeros(shape)
            zeroed = model.layers[layer].linear_attn.state_output.save()
    cache = _cache_after(hf, ids, ids.shape[1] - 1)
    cache.get_recurrent_state(layer).zero_()
    step = _forward(hf, tokens[:, ids.shape[1]:ids.shape[1] + 1], cache, start=ids.shape[1])
    _close(zeroed, internals.output_cache(step).get_recurrent_state(layer))


@pytest.mark.parametrize("name", SERVED)
def test_left_padded_invokes_are_each_their_own_prompt(name: str) -> None:
    """Two prompts of different lengths in one trace (the shorter left-padded): each invoke's reads are its own
    prompt's cache, and a write in one invoke is that prompt's write alone."""
    model, hf = _models(name)
    layer = _ssm(hf)[-1]
    long, short = "The Eiffel Tower is in", "A cat sat"
    shape = (1, *[model.spec.dims[k] for k in ("heads", "head_dim", "d_state")])
    with torch.no_grad(), model.trace() as tr:
        with tr.invoke(long):
            got_long = model.layers[layer].linear_attn.state_after(-1).save()
            logits_long = model.logits.save()
        with tr.invoke(short):
            got_mid = model.layers[layer].linear_attn.state_after(2).save()
            model.layers[layer].linear_attn.set_state_after(4, torch.zeros(shape))
            logits_short = model.logits.save()
    ids_long = model.tokenizer(long, return_tensors="pt")["input_ids"]
    ids_short = model.tokenizer(short, return_tensors="pt")["input_ids"]
    _close(got_long, _cache_after(hf, ids_long, ids_long.shape[1] - 1).get_recurrent_state(layer))
    _close(got_mid, _cache_after(hf, ids_short, 2).get_recurrent_state(layer))
    _close(logits_long, _forward(hf, ids_long).logits, tol=1e-3)
    want = _written_logits(name, hf, ids_short, {layer: torch.zeros(shape)}, 4)
    pad = logits_short.shape[1] - ids_short.shape[1]  # the short prompt's row is left-padded
    assert pad > 0
    _close(logits_short[:, pad + 4:], want, tol=1e-3)


def test_a_norm_of_states_is_the_norm_of_every_cached_state() -> None:
    """`measure norm(L0.states)` (a reduction of `states`, `mixer.reduced`) on a Mamba-2 block: each token's
    Frobenius norm of transformers' cached state after that token."""
    model, hf = _models("granitemoehybrid")
    layer = _ssm(hf)[0]
    text = f'prompt p = "The tower of"\ntrace a on p {{\n    measure norm(L{layer}.states)\n}}\n'
    got = deltalang.run(text, model=model)[f"a.norm(L{layer}.states)"]
    ids = model.tokenizer("The tower of", return_tensors="pt")["input_ids"]
    want = torch.stack([_cache_after(hf, ids, t).get_recurrent_state(layer).norm() for t in range(ids.shape[1])])
    _close(torch.as_tensor(got).flatten(), want)


def test_info_names_the_mamba2_blocks_and_what_serves_them() -> None:
    from deltalang.runtime import info

    spec = deltalang.load_spec(testing_ssd.tiny_ssd_checkpoint("granitemoehybrid"))
    text = info.format_info(spec)
    assert "3 Mamba-2" in text and text.count("│ Mamba-2") == 3
    served = text.split("served by", 1)[1]
    assert "states: deltalang's chunked Mamba-2 scan" in served and "step_sizes:" in served
    assert "attention_keys:" not in served  # a delta-rule value, on no block of this model
    assert info.status(spec, 0, "step_sizes") == info.AVAILABLE and info.status(spec, 0, "betas") != info.AVAILABLE


@pytest.mark.parametrize("name", SERVED)
def test_a_decode_step_written_after_its_token(name: str) -> None:
    """`state_after(-1)` written at a decode step: that step's token reads it (falcon_h1: gated by z in the
    kernel call), and the cache carries it on; against transformers' step with its state update replaced."""
    model, hf = _models(name)
    ids = _ids(8)
    layer = _ssm(hf)[0]
    donor = _cache_after(hf, _ids(seed=11), 6).get_recurrent_state(layer).clone()
    with torch.no_grad(), model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
        for step in tracer.iter[1]:
            model.layers[layer].linear_attn.set_state_after(-1, donor)
            leaving = model.layers[layer].linear_attn.state_output.save()
            got = model.logits.save()
    logits = _forward(hf, ids).logits[:, -1].clone()
    logits[:, hf.config.eos_token_id] = -float("inf")
    token = logits.argmax(-1, keepdim=True)
    cache = _cache_after(hf, ids, ids.shape[1] - 1)
    with step_replaced(name, hf, {layer: donor}):
        out = _forward(hf, token, cache, start=ids.shape[1])
    _close(got[:, -1], out.logits[:, -1], tol=1e-3)
    _close(leaving, internals.output_cache(out).get_recurrent_state(layer))
    _close(leaving, donor)


def _scan_patched(name: str, hf: Any, layer: int, value: str) -> AbstractContextManager[None]:
    """Layer `layer`'s prompt scan with one of its inputs or its output changed as the test below writes it."""
    def scan(current: int, original: Callable[..., Any], a: tuple, kw: dict) -> Any:
        if current != layer:
            return original(*a, **kw)
        x, dt, A, B, C, *rest = a
        if value == "step_sizes":  # transformers' own step sizes, doubled, passed as they are
            step = torch.clamp(torch.nn.functional.softplus(dt + kw["dt_bias"]), *kw["dt_limit"])
            dt, kw = 2 * step, kw | {"dt_bias": None, "dt_softplus": False, "dt_limit": (0.0, float("inf"))}
        elif value == "decay_rates":
            A = 0.5 * A
        elif value == "input_matrices":
            B = -B
        out = original(x, dt, A, B, C, *rest, **kw)
        if value == "head_outputs":
            y = torch.zeros_like(out[0] if isinstance(out, tuple) else out)
            return (y, out[1]) if isinstance(out, tuple) else y
        return out
    return kernel_patched(name, hf, internals.SCAN_GLOBAL, scan)


@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize("value", ["step_sizes", "decay_rates", "input_matrices", "head_outputs"])
def test_a_written_scan_input_or_output_is_what_the_scan_runs_on(value: str, name: str) -> None:
    model, hf = _models(name)
    ids = _ids()
    layer = _ssm(hf)[0]
    saved: dict[str, Any] = {}
    with torch.no_grad(), model.trace(ids):
        mixer = model.layers[layer].linear_attn
        if value == "step_sizes":
            mixer.step_sizes = mixer.step_sizes * 2
        elif value == "decay_rates":
            mixer.decay_rates = mixer.decay_rates * 0.5
        elif value == "input_matrices":
            mixer.input_matrices = -mixer.input_matrices
        if value == "head_outputs":  # after state_after in the forward's order
            mixer.head_outputs = torch.zeros_like(mixer.head_outputs)
        else:
            saved["after"] = mixer.state_after(6).save()
        got = model.logits.save()
    with _scan_patched(name, hf, layer, value):
        want = _forward(hf, ids).logits
        state = _cache_after(hf, ids, 6).get_recurrent_state(layer)
    _close(got, want, tol=1e-4)
    if value != "head_outputs":
        _close(saved["after"], state)
    clean = _forward(hf, ids).logits
    assert float((got - clean).abs().max()) > 10 * float((got - want).abs().max())


@pytest.mark.parametrize("name", SERVED)
def test_a_blocks_output_is_what_the_block_returns_or_refused_in_one_line(name: str) -> None:
    """Each family's blocks return what `Family.block_output` says (transformers' own forward, hooked); `output`
    is then served on every block, equal to that tensor (granitemoehybrid's blocks are annotated `-> tuple` but
    return a tensor), or refused in one line where the block returns a tuple (bamba, falcon_h1)."""
    from deltalang.runtime.model import decoder_layers

    model, hf = _models(name)
    ids = _ids()
    seen: dict[int, Any] = {}
    hooks = [b.register_forward_hook(lambda _m, _a, out, i=i: seen.__setitem__(i, out))
             for i, b in enumerate(decoder_layers(hf))]
    try:
        _forward(hf, ids)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == model.spec.num_layers
    tensor = model.family.block_output == "tensor"
    assert all(isinstance(out, torch.Tensor) == tensor for out in seen.values()), model.family.block_output
    reads = "".join(f"    read L{i}.output\n" for i in range(model.spec.num_layers))
    src = f'prompt p = "The tower of"\ntrace t on p {{\n{reads}}}\n'
    if not tensor:
        with pytest.raises(deltalang.DeltaError, match=r"<program>:\d+:.*error: .*return a tuple") as err:
            deltalang.check(src, model.spec)
        assert "attention_output" in str(err.value)
        return
    got: dict[int, Any] = {}
    with torch.no_grad(), model.trace(ids):
        for i in range(model.spec.num_layers):
            got[i] = model.layers[i].output.save()
    for i, out in got.items():
        _close(out, seen[i])


@pytest.mark.parametrize("name", ("zamba2", "falcon_h1"))
def test_a_write_in_every_hybrid_block_is_what_later_tokens_continue_from(name: str) -> None:
    """Blocks running attention beside (falcon_h1) or before (zamba2: one shared attention block) their
    Mamba-2 mixer: states written in all of them at once, against transformers with those states replaced."""
    model, hf = _models(name)
    ids, t = _ids(), 5
    hybrid = [i for i in _ssm(hf) if model.spec.attention_too(i)]
    assert hybrid and hybrid == [i for i, k in enumerate(model.spec.layer_types) if k == "hybrid"]
    donors = {i: _cache_after(hf, _ids(seed=7 + i), 9).get_recurrent_state(i).clone() for i in hybrid}
    with torch.no_grad(), model.trace(ids):
        for i in hybrid:
            model.layers[i].linear_attn.set_state_after(t, donors[i])
        got = model.logits.save()
    want = _written_logits(name, hf, ids, donors, t)
    _close(got[:, t:], want, tol=1e-3)
    clean = _forward(hf, ids).logits
    if name == "zamba2":  # falcon_h1's tiny Mamba-2 blocks barely move its logits (see above)
        assert float((got[:, t + 1:] - clean[:, t + 1:]).abs().max()) > 10 * float((got[:, t:] - want).abs().max())


@pytest.mark.parametrize("name", SERVED)
def test_check_and_explain_name_the_blocks_of_every_family(name: str) -> None:
    """`deltalang check`'s header names the Mamba-2 blocks (never "DeltaNet none"), the attention blocks and those
    with neither (nemotron_h's `mlp`); `L[attention]` selects attention blocks only, `L[ssm]` the Mamba-2 ones."""
    from deltalang.compiler.explain import format_resolved
    from deltalang.ground.errors import DeltaError

    spec = deltalang.load_spec(testing_ssd.tiny_ssd_checkpoint(name))
    kinds = list(spec.config.layer_types)
    attention = [i for i, k in enumerate(kinds) if k.endswith("attention") and k != "linear_attention"]
    mlp = [i for i, k in enumerate(kinds) if k in ("mlp", "moe")]
    ssm = _ssm(_models(name)[1])
    assert spec.ssm_layers() == ssm and spec.attention_layers() == attention and spec.layers_of("mlp") == mlp
    header = format_resolved(deltalang.check("read L[ssm].state_after(2)", spec, prompt="abcdef")).splitlines()[0]
    assert "DeltaNet" not in header and ("Mamba-2 " + " ".join(f"L{i}" for i in ssm)) in header
    assert f"attention {' '.join(f'L{i}' for i in attention) or 'none'}" in header
    assert ("MLP L" in header) == bool(mlp)
    if attention:
        r = deltalang.check("read L[attention].output", spec, prompt="abcdef") if spec.family.block_output == \
            "tensor" else None
        assert r is None or sorted({op.layer for op in r.run("main").ops}) == attention
    else:
        with pytest.raises(DeltaError, match="no attention blocks"):
            deltalang.check("read L[attention].output", spec, prompt="abcdef")
    for i in mlp:
        assert "an MLP block" in str(spec.unavailable(i, "states")) and spec.unavailable(i, "output") is None


@contextmanager
def _gates(hf: Any, seen: dict[int, torch.Tensor], scale: dict[int, float] | None = None) -> Iterator[None]:
    """Inside the block, each Mamba-2 mixer's gated norm `norm(y, gate)` records its gate (scaled where asked)."""
    def hook(i: int) -> Any:
        def pre(_m: Any, args: tuple) -> tuple:
            seen[i] = args[1].clone()
            return (args[0], args[1] * scale[i], *args[2:]) if scale and i in scale else args
        return pre
    hooks = [m.norm.register_forward_pre_hook(hook(i)) for i, m in testing_ssd.ssd_mixers(hf)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("name", SERVED)
def test_the_gate_is_what_the_gated_norm_receives_and_a_written_one_is_what_it_runs_on(name: str) -> None:
    """`gate` (z) against transformers' own gated norm: read on every Mamba-2 block (through a program too),
    written (doubled) on one, in a left-padded invoke beside a longer prompt; falcon_h1 (no gated norm with its
    default config: `mamba_rms_norm` false) refuses it in one line."""
    from deltalang.ground.errors import DeltaError

    model, hf = _models(name)
    layers = _ssm(hf)
    if name == "falcon_h1":
        with pytest.raises(DeltaError, match="run no gated norm with this config") as err:
            deltalang.check("read L0.gate", model.spec, prompt="abc")
        assert "mamba_rms_norm" in str(err.value)
        return
    ids, layer = _ids(), layers[-1]
    truth: dict[int, torch.Tensor] = {}
    with _gates(hf, truth):
        _forward(hf, ids)
    got: dict[int, Any] = {}
    with torch.no_grad(), model.trace(ids):
        for i in layers:
            got[i] = model.layers[i].linear_attn.gate.save()
    for i in layers:
        assert got[i].shape == (1, ids.shape[1], model.spec.dims["inner"])
        _close(got[i], truth[i])
    text = f'prompt p = "The tower of"\ntrace a on p {{\n    read L{layer}.gate\n}}\n'
    short = model.tokenizer("The tower of", return_tensors="pt")["input_ids"]
    with _gates(hf, truth):
        _forward(hf, short)
    _close(deltalang.run(text, model=model)[f"a.L{layer}.gate"], truth[layer])
    # a left-padded invoke: its own prompt's gate, and a write that is its own
    with torch.no_grad(), model.trace() as tr:
        with tr.invoke("The Eiffel Tower is in"):
            model.logits.save()
        with tr.invoke("The tower of"):
            read = model.layers[layer].linear_attn.gate.save()
            model.layers[layer].linear_attn.gate = read * 2
            written = model.logits.save()
    _close(read, truth[layer])
    with _gates(hf, {}, {layer: 2.0}):
        want = _forward(hf, short).logits
    pad = written.shape[1] - short.shape[1]
    assert pad > 0
    _close(written[:, pad:], want, tol=1e-3)
    clean = _forward(hf, short).logits
    assert float((written[:, pad:] - clean).abs().max()) > 10 * float((written[:, pad:] - want).abs().max())


@pytest.mark.parametrize("name", [n for n in SERVED if n != "falcon_h1"])
def test_a_decode_steps_gate_is_what_its_gated_norm_receives(name: str) -> None:
    """Under generate, step 1's `gate` is what transformers' gated norm receives on that decode step."""
    model, hf = _models(name)
    ids, layer = _ids(8), _ssm(hf)[0]
    with torch.no_grad(), model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
        for step in tracer.iter[1]:
            got = model.layers[layer].linear_attn.gate.save()
    logits = _forward(hf, ids).logits[:, -1].clone()
    logits[:, hf.config.eos_token_id] = -float("inf")
    cache = _cache_after(hf, ids, ids.shape[1] - 1)
    truth: dict[int, torch.Tensor] = {}
    with _gates(hf, truth):
        _forward(hf, logits.argmax(-1, keepdim=True), cache, start=ids.shape[1])
    assert got.shape == truth[layer].shape == (1, 1, model.spec.dims["inner"])
    _close(got, truth[layer])


@pytest.mark.parametrize("name", SERVED)
def test_info_and_support_name_every_block_of_every_family(name: str) -> None:
    """`deltalang info` marks each block by what transformers' model holds there (a Mamba-2 mixer, found by
    `testing_ssd.ssd_mixers`; attention beside it in a `hybrid` block; an MLP only), and `support()` serves every
    Mamba-2 value on every Mamba-2 block (zamba2's nested mixers, mamba2's `backbone`)."""
    from deltalang.runtime import info
    from deltalang.runtime.model import decoder_layers

    model, hf = _models(name)
    ssm = _ssm(hf)
    blocks = decoder_layers(hf)
    attends = [i for i, b in enumerate(blocks)
               if any(type(m).__name__.endswith("Attention") for m in b.modules())]
    rows = [line for line in info.format_info(model.spec).splitlines() if line.startswith("│ L")]
    assert len(rows) == len(blocks)
    for i, row in enumerate(rows):
        kind = row.split("│")[2].strip()
        if i in ssm:
            assert kind == ("Mamba-2 + attention" if i in attends else "Mamba-2"), (i, kind)
        else:
            assert kind == ("attention" if i in attends else "MLP"), (i, kind)
    table = model.support()
    for value in ("states", "state_after", "conv_window_after", "step_sizes", "head_outputs"):
        assert [i for i, st in enumerate(table[f"linear_attn.{value}"]) if st == info.AVAILABLE] == ssm


def test_falcon_h1_with_its_gated_norm_serves_the_gate() -> None:
    """falcon_h1 with `mamba_rms_norm` set runs the gated norm on a prompt: its `gate` is served there, against a
    plain copy of the same model (read, and the logits with the gate doubled)."""
    import copy

    from transformers import AutoModelForCausalLM

    from deltalang.models import testing
    from deltalang.runtime.model import wrap_model

    cfg = testing_ssd.tiny_ssd_config("falcon_h1")
    cfg.mamba_rms_norm = True
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    testing_ssd._enlarge_random_weights(hf)
    truth_model = copy.deepcopy(hf)
    model = wrap_model(hf, testing.byte_tokenizer())
    layer = model.spec.ssm_layers()[0]
    assert model.spec.unavailable(layer, "gate") is None
    ids = _ids()
    with torch.no_grad(), model.trace(ids):
        got = model.layers[layer].linear_attn.gate.save()
        model.layers[layer].linear_attn.gate = got * 2
        written = model.logits.save()
    seen: dict[int, torch.Tensor] = {}
    with _gates(truth_model, seen, {layer: 2.0}):
        want = _forward(truth_model, ids).logits
    _close(got, seen[layer])
    _close(written, want, tol=1e-3)
    clean = _forward(truth_model, ids).logits
    assert float((written - clean).abs().max()) > 10 * float((written - want).abs().max())


def test_a_kind_the_model_lacks_names_the_recurrent_blocks_it_has(tiny_spec: Any) -> None:
    """`L[linear]` on a Mamba-2 model points at `L[ssm]`, and `L[ssm]` on a DeltaNet model at `L[linear]`:
    the model's recurrent blocks by their selector, with their numbers."""
    from deltalang.ground.errors import DeltaError

    for spec, text, want in (
            (deltalang.load_spec(testing_ssd.tiny_ssd_checkpoint("granitemoehybrid")), "read L[linear].state_output",
             "the model has no linear blocks; its recurrent blocks are L[ssm]"),
            (tiny_spec("qwen3_5"), "read L[ssm].state_output",
             "the model has no ssm blocks; its recurrent blocks are L[linear]")):
        with pytest.raises(DeltaError) as err:
            deltalang.check(text, spec, prompt="abcdef")
        line = str(err.value).splitlines()[0]
        assert want in line, line
        have = spec.ssm_layers() or spec.linear_layers()
        assert ", ".join(f"L{i}" for i in have) in line, line


def test_info_names_nemotron_h_moe_blocks_moe(tmp_path: Any) -> None:
    """nemotron_h's config names each block (`layers_block_type`): a `moe` block is a mixture of experts, shown
    as MoE in `deltalang info` (it read MLP), its `mlp` blocks MLP; neither has a recurrent value."""
    import json
    import shutil

    from deltalang.compiler.explain import describe_model
    from deltalang.runtime import info

    src = testing_ssd.tiny_ssd_checkpoint("nemotron_h")
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    kinds = ["linear_attention", "moe", "full_attention", "mlp"]
    config["layers_block_type"] = config["layer_types"] = kinds
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = deltalang.load_spec(tmp_path)
    assert list(spec.layer_types) == kinds
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in info.format_info(spec).splitlines() if line.startswith("│ L")}
    assert (rows["L1"], rows["L3"]) == ("MoE", "MLP"), rows
    assert info.status(spec, 1, "states") != info.AVAILABLE
    assert "a MoE block" in str(spec.unavailable(1, "states")) and "an MLP block" in str(spec.unavailable(3, "states"))
    assert "; MLP L3; MoE L1)" in describe_model(spec)
