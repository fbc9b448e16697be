"""A token's write as a value (`write_keys`, `write_values`), against transformers' own cache and kernel inputs.

Truth: transformers' cache after tokens 0..t holds the state after t, so the update token t adds is
S_t - a_t S_(t-1) (a_t = exp of the log decay the kernel receives: per head, or per key channel on KDA; on
Mamba-2 exp(A dt_t), dt_t = softplus(dt + dt_bias) clamped, from the scan's own arguments). The two factors
read must multiply (outer product, the state's axis order) to that update; the keys must be those the
delta-rule kernel receives, l2-normed where it normalises them, and the values beta_t (v_t - (a_t
S_(t-1))^T k_t) from its values and betas and the cache's S_(t-1); on Mamba-2 the values must be the B the scan
receives. A read leaves the logits bit for bit.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from reference import cache_after, delta_calls, hf_forward, kernel_calls

import deltalang
from deltalang.models import internals, testing_ssd
from deltalang.models.testing import FAMILY_NAMES, load_hf, tiny_checkpoint

PROMPT = "The Eiffel Tower is in"  # 22 byte tokens: crosses the chunked rule's chunk of 16
SHORT = "Big cats"
POSITIONS = (0, 7, 15, 16, 21)


@functools.lru_cache(maxsize=None)
def _delta(family: str) -> tuple[Any, Any]:
    path = tiny_checkpoint(family)
    return deltalang.load_model(path), load_hf(path).eval()


@functools.lru_cache(maxsize=None)
def _ssd(name: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    path = testing_ssd.tiny_ssd_checkpoint(name)
    return deltalang.load_model(path), AutoModelForCausalLM.from_pretrained(path).eval()


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    scale = max(1.0, float(want.abs().max()))
    err = float((got.float() - want.float()).abs().max())
    assert err <= tol * scale, f"max |diff| {err:.3g} > {tol:g} * {scale:.3g}"


def _kernel_inputs(model: Any, hf: Any, ids: torch.Tensor) -> list[dict[str, Any]]:
    """What transformers' own forward hands its delta-rule chunk kernel, one call per DeltaNet block in order."""
    return [{"key": a[1], "value": a[2], "g": kw["g"], "beta": kw["beta"],
             "l2": bool(kw.get("use_qk_l2norm_in_kernel", False))} for a, kw in delta_calls(model.family, hf, ids)]


def _state(hf: Any, ids: torch.Tensor, layer: int, t: int) -> torch.Tensor:
    """transformers' recurrent state of `layer` after tokens 0..t (zeros before the first)."""
    with torch.no_grad():
        cache = hf(ids[:, :t + 1], use_cache=True).past_key_values if t >= 0 else None
    if cache is None:
        return torch.zeros_like(_state(hf, ids, layer, 0))
    return cache.get_recurrent_state(layer).float()


def _decayed(S: torch.Tensor, g_t: torch.Tensor) -> torch.Tensor:
    """a_t S: `g_t` `[b, h]` per head, `[b, h, dk]` per key channel (KDA)."""
    a = g_t.float().exp()
    return S * (a[..., None] if a.dim() == 3 else a[..., None, None])


def _delta_truth(model: Any, hf: Any, ids: torch.Tensor, layer: int, seen: dict[str, Any], t: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys `[b, h, dk]`, values `[b, h, dv]`, the update `[b, h, dk, dv]`) of token t from transformers."""
    heads = model.spec.dims["heads"]
    k = seen["key"][:, t].float()
    k = k.repeat_interleave(heads // k.shape[-2], dim=-2)
    if seen["l2"]:
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = seen["g"][:, t]
    before = _decayed(_state(hf, ids, layer, t - 1), g)
    after = _state(hf, ids, layer, t)
    v = seen["value"][:, t].float()
    u = seen["beta"][:, t].float()[..., None] * (v - torch.einsum("bhkv,bhk->bhv", before, k))
    return k, u, after - before


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_write_factors_are_the_update_the_cache_takes(family: str) -> None:
    """On every delta-rule block, after every token checked: write_keys ⊗ write_values = S_t - a_t S_(t-1)."""
    model, hf = _delta(family)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layers = model.spec.linear_layers()
    got: dict[int, tuple[Any, Any]] = {}
    with torch.no_grad():
        with model.trace(PROMPT):
            for i in layers:
                mix = model.layers[i].linear_attn
                got[i] = (mix.write_keys.save(), mix.write_values.save())
            read = model.logits.save()
        with model.trace(PROMPT):
            plain = model.logits.save()
    assert torch.equal(read, plain)  # a read never changes the forward
    seen = _kernel_inputs(model, hf, ids)
    d = model.spec.dims
    for n, i in enumerate(layers):
        keys, writes = got[i]
        assert keys.shape == (1, ids.shape[1], d["heads"], d["key_dim"])
        assert writes.shape == (1, ids.shape[1], d["heads"], d["value_dim"])
        for t in POSITIONS:
            k, u, update = _delta_truth(model, hf, ids, i, seen[n], t)
            _close(keys[:, t], k)
            _close(writes[:, t], u)
            _close(keys[:, t, :, :, None] * writes[:, t, :, None, :], update)
            assert float(update.abs().max()) > 1e-3  # a token that writes something


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_write_factors_in_a_shared_forward_are_each_runs_own(family: str) -> None:
    """Two runs of different lengths share a left-padded forward; each one's factors and reductions are its
    prompt's alone (from transformers on that prompt)."""
    model, hf = _delta(family)
    i = model.spec.linear_layers()[-1]
    program = (f'prompt long = "{PROMPT}"\nprompt short = "{SHORT}"\n'
               f"trace a on long {{\n    read L{i}.write_values, L{i}.write_keys.norm(key_dim)\n}}\n"
               f"trace b on short {{\n    read L{i}.write_values, L{i}.write_values.head(1).mean(positions)\n}}\n")
    res = deltalang.run(program, model=model)
    for run, text in (("a", PROMPT), ("b", SHORT)):
        ids = model.tokenizer(text, return_tensors="pt").input_ids
        seen = _kernel_inputs(model, hf, ids)[model.spec.linear_layers().index(i)]
        writes = res[f"{run}.L{i}.write_values"]
        assert writes.shape[1] == ids.shape[1]
        truth = torch.stack([_delta_truth(model, hf, ids, i, seen, t)[1] for t in range(ids.shape[1])], dim=1)
        _close(writes, truth)
        if run == "a":
            keys = torch.stack([_delta_truth(model, hf, ids, i, seen, t)[0] for t in range(ids.shape[1])], dim=1)
            _close(res[f"a.L{i}.write_keys.norm(key_dim)"], keys.norm(dim=-1))
        else:
            _close(res[f"b.L{i}.write_values.head(1).mean(positions)"], truth[:, :, 1].mean(dim=1))


_SCAN = ("hidden_states", "dt", "A", "B", "C")
_STEP = ("state", "hidden_states", "dt", "A", "B", "C", "D")


def _named(call: tuple[tuple, dict], names: tuple[str, ...]) -> dict[str, Any]:
    """A recorded kernel call's arguments by name (`reference.kernel_calls`), tensors detached."""
    args, kw = call
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in (dict(zip(names, args)) | kw).items()}


def _step_sizes(call: dict[str, Any]) -> torch.Tensor:
    """dt as transformers' scan or step makes it from its arguments: dt_bias, softplus, the clamp, float32."""
    dt = call["dt"] + call["dt_bias"] if call.get("dt_bias") is not None else call["dt"]
    dt = F.softplus(dt) if call.get("dt_softplus") else dt
    return dt.clamp(*call.get("dt_limit", (0.0, float("inf")))).float()


@pytest.mark.parametrize("name", testing_ssd.MAMBA2_FAMILY_NAMES)
def test_mamba2_write_factors_are_the_update_the_cache_takes(name: str) -> None:
    """On every Mamba-2 block: write_values is the scan's B (of each head's group), write_keys ⊗ write_values =
    h_t - exp(A dt_t) h_(t-1), the state's `[head_dim, d_state]` order."""
    model, hf = _ssd(name)
    ids = torch.randint(3, 259, (1, 13), generator=torch.Generator().manual_seed(0))
    layers = model.spec.ssm_layers()
    got: dict[int, tuple[Any, Any]] = {}
    with torch.no_grad():
        with model.trace(ids):
            for i in layers:
                mix = model.layers[i].linear_attn
                got[i] = (mix.write_keys.save(), mix.write_values.save())
            read = model.logits.save()
        with model.trace(ids):
            plain = model.logits.save()
    assert torch.equal(read, plain)
    seen = kernel_calls(name, hf, ids)
    d = model.spec.dims
    for i in layers:
        keys, writes = got[i]
        assert keys.shape == (1, 13, d["heads"], d["head_dim"]) and writes.shape == (1, 13, d["heads"], d["d_state"])
        call = _named(seen[i], _SCAN)
        B = call["B"].float().repeat_interleave(d["heads"] // call["B"].shape[2], dim=2)
        _close(writes, B)
        dt = _step_sizes(call)
        for t in (0, 5, 8, 12):
            after = cache_after(hf, ids, t).get_recurrent_state(i).float()
            before = cache_after(hf, ids, t - 1).get_recurrent_state(i).float() if t else torch.zeros_like(after)
            update = after - before * (call["A"].float() * dt[:, t]).exp()[..., None, None]
            _close(keys[:, t, :, :, None] * writes[:, t, :, None, :], update, tol=2e-5)
            assert float(update.abs().max()) > 1e-4


def test_write_values_are_collected_over_a_dataset(tmp_path: Path) -> None:
    """`read L[linear].write_values as w` over a dataset: each record's `[s, heads, value_dim]`, its own prompt's."""
    model, hf = _delta("qwen3_5")
    texts = [PROMPT, SHORT, "Tea time is at four"]
    data = tmp_path / "facts.jsonl"
    data.write_text("".join(f'{{"prompt": "{t}"}}\n' for t in texts))
    program = f'dataset facts = "{data}"\ntrace t on facts {{\n    read L[linear].write_values as w\n}}\n'
    deltalang.run(program, model=model, out=tmp_path / "out")
    col = deltalang.load_results(tmp_path / "out")
    layers = model.spec.linear_layers()
    for n, text in enumerate(texts):
        record, tensors = col[n]
        ids = model.tokenizer(text, return_tensors="pt").input_ids
        seen = _kernel_inputs(model, hf, ids)
        for j, i in enumerate(layers):
            truth = torch.stack([_delta_truth(model, hf, ids, i, seen[j], t)[1] for t in range(ids.shape[1])])
            _close(tensors[f"w.L{i}"], truth[:, 0])


# ---- writes: what a written token adds, and the tokens after it continuing from the state it left --------------


def _donor(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.5


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("factor", ["write_values", "write_keys"])
def test_a_written_write_is_what_the_token_adds_and_the_rest_continue(family: str, factor: str) -> None:
    """Token t's factor replaced (write_keys in place, write_values assigned): the state after t is a_t S_(t-1) +
    k'_t ⊗ u'_t from transformers' cache after t-1 (the other factor as read), token t reads it and the later
    tokens run the rule on from it, through transformers (`reference.Reference`: its kernels token by token,
    that state written after t)."""
    from reference import Reference, Write, set_to

    model, hf = _delta(family)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layers = model.spec.linear_layers()
    layer, t = layers[len(layers) // 2], 17
    d = model.spec.dims
    dim = d["value_dim"] if factor == "write_values" else d["key_dim"]
    new_t = _donor((1, d["heads"], dim), seed=3)
    with torch.no_grad():
        with model.trace(PROMPT):
            mix = model.layers[layer].linear_attn
            if factor == "write_keys":  # in place: what a worker changes in the copy it was served is written
                getattr(mix, factor)[:, t] = new_t
            else:
                new = getattr(mix, factor).clone()
                new[:, t] = new_t
                setattr(mix, factor, new)
            final = mix.state_output.save()
            logits = model.logits.save()
        with model.trace(PROMPT):
            clean = model.logits.save()
    seen = _kernel_inputs(model, hf, ids)[layers.index(layer)]
    k, u, _ = _delta_truth(model, hf, ids, layer, seen, t)
    k, u = (new_t, u) if factor == "write_keys" else (k, new_t)
    state = _decayed(_state(hf, ids, layer, t - 1), seen["g"][:, t]) + k[..., :, None] * u[..., None, :]
    record = Reference(hf).run(ids, [Write(layer, "state_after", set_to(state), position=t)])
    _close(final, record.value(layer, "state_output"), tol=1e-4)
    want = record.value(None, "logits")
    _close(logits, want, tol=1e-4)
    assert float((logits[:, t + 1:] - clean[:, t + 1:]).abs().max()) > 1e-2  # the write moved what follows
    assert torch.equal(logits[:, :t], clean[:, :t]) or float((logits[:, :t] - clean[:, :t]).abs().max()) < 1e-5


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear", "olmo_hybrid"])
def test_one_heads_writes_silenced_in_the_language_are_betas_of_zero(family: str) -> None:
    """`write L.write_values.head(1) *= 0`: every token of head 1 adds nothing, as a zero beta makes transformers'
    kernel add nothing; the other heads run as they were."""
    from reference import Reference, Write

    model, hf = _delta(family)
    layer = model.spec.linear_layers()[0]
    # the written run is the shorter one of a shared forward: left-padded, its padding never written
    program = (f'prompt p = "{SHORT}"\nprompt long = "{PROMPT}"\ntrace t on p {{\n'
               f"    write L{layer}.write_values.head(1) *= 0\n    read L{layer}.state_output, logits\n}}\n"
               f"trace c on long {{\n    read L{layer}.state_output, logits\n}}\n")
    res = deltalang.run(program, model=model)

    def zero_head(x: torch.Tensor, i: int) -> torch.Tensor:
        x = x.clone()
        x[:, :, 1] = 0
        return x

    ids = model.tokenizer(SHORT, return_tensors="pt").input_ids
    record = Reference(hf).run(ids, [Write(layer, "betas", zero_head)])
    want = record.value(layer, "state_output")
    assert float(want[:, 1].abs().max()) == 0.0
    _close(res[f"t.L{layer}.state_output"], want, tol=1e-4)
    _close(res["t.logits"], record.value(None, "logits"), tol=1e-4)
    clean = Reference(hf).run(model.tokenizer(PROMPT, return_tensors="pt").input_ids)  # the other run: as it was
    _close(res[f"c.L{layer}.state_output"], clean.value(layer, "state_output"), tol=1e-4)
    _close(res["c.logits"], clean.value(None, "logits"), tol=1e-4)


def _ssd_written(name: str, hf: Any, ids: torch.Tensor, layer: int, state: torch.Tensor, t: int) -> tuple[Any, Any]:
    """transformers with token t's state update of `layer` ending in `state` (token t reads it), the rest of the
    prompt continued from that cache: (the logits of tokens t.., the final state)."""
    from reference import step_replaced

    cache = internals.output_cache(hf_forward(hf, ids[:, :t]))
    with step_replaced(name, hf, {layer: state}):
        out = hf_forward(hf, ids[:, t:t + 1], cache, start=t)
    rest = hf_forward(hf, ids[:, t + 1:], internals.output_cache(out), start=t + 1)
    return torch.cat([out.logits, rest.logits], dim=1), internals.output_cache(rest).get_recurrent_state(layer)


@pytest.mark.parametrize("name", testing_ssd.MAMBA2_FAMILY_NAMES)
@pytest.mark.parametrize("factor", ["write_values", "write_keys"])
def test_a_written_mamba2_write_is_what_the_token_adds(name: str, factor: str) -> None:
    """Token t's factor replaced on a Mamba-2 block: the state after t is exp(A dt_t) h_(t-1) + k' ⊗ v' from the
    cache after t-1, token t reads it (y = h C + D x), the later tokens continue through transformers."""
    model, hf = _ssd(name)
    ids = torch.randint(3, 259, (1, 13), generator=torch.Generator().manual_seed(0))
    layer, t = model.spec.ssm_layers()[0], 6
    d = model.spec.dims
    new_t = _donor((1, d["heads"], d["d_state"] if factor == "write_values" else d["head_dim"]), seed=5)
    with torch.no_grad():
        with model.trace(ids):
            mix = model.layers[layer].linear_attn
            old = getattr(mix, factor)
            new = old.clone()
            new[:, t] = new_t
            setattr(mix, factor, new)
            final = mix.state_output.save()
            logits = model.logits.save()
    call = _named(kernel_calls(name, hf, ids)[layer], _SCAN)
    B = call["B"].float().repeat_interleave(d["heads"] // call["B"].shape[2], dim=2)[:, t]
    step = _step_sizes(call)
    x_dt = call["hidden_states"].float()[:, t] * step[:, t, :, None]
    k, v = (new_t, B) if factor == "write_keys" else (x_dt, new_t)
    before = cache_after(hf, ids, t - 1).get_recurrent_state(layer).float()
    state = before * (call["A"].float() * step[:, t]).exp()[..., None, None] + k[..., :, None] * v[..., None, :]
    want_logits, want_final = _ssd_written(name, hf, ids, layer, state, t)
    _close(logits[:, t:], want_logits, tol=1e-3)
    _close(final, want_final, tol=2e-4)
    with torch.no_grad():
        clean = hf_forward(hf, ids).logits
    assert float((final - cache_after(hf, ids, 12).get_recurrent_state(layer).float()).abs().max()) > 1e-3
    _close(logits[:, :t], clean[:, :t], tol=1e-4)


def _step_written(model: Any, prompt: Any, layer: int, new: torch.Tensor, later: str) -> tuple[dict[str, Any], Any]:
    """A generate of 3 tokens whose step 1 reads `layer`'s write factors, writes `new` as its one token's
    write_values and reads its state_output; at step 2 `later` ("logits": the last logits, or "state_input"):
    (what was read, the tokens)."""
    got: dict[str, Any] = {}
    with torch.no_grad():
        with model.generate(prompt, max_new_tokens=3, do_sample=False) as tracer:
            for step in tracer.iter[:3]:
                mix = model.layers[layer].linear_attn
                if step == 1:
                    got["keys"] = mix.write_keys.save()
                    old = mix.write_values
                    got["values"] = old.clone().save()
                    written = old.clone()
                    written[:, 0] = new
                    mix.write_values = written
                    got["after"] = mix.state_output.save()
                if step == 2:
                    got[later] = (model.logits[:, -1] if later == "logits" else mix.state_input).save()
            tokens = tracer.result.save()
    return got, tokens


@pytest.mark.parametrize("name", testing_ssd.MAMBA2_FAMILY_NAMES)
def test_a_mamba2_decode_steps_write_is_read_and_written(name: str) -> None:
    """Under generate, step 1 (one token, transformers' one-token state update): its factors' outer product is
    the cache's h - exp(A dt) h_before; a written write_values there is the state the cache then holds, read by
    the token (`reference.step_replaced`), and the next step continues from it."""
    from reference import step_replaced

    model, hf = _ssd(name)
    ids = torch.randint(3, 259, (1, 9), generator=torch.Generator().manual_seed(1))
    layer = model.spec.ssm_layers()[-1]
    d = model.spec.dims
    new_v = _donor((1, d["heads"], d["d_state"]), seed=9)
    got, tokens = _step_written(model, ids, layer, new_v, "logits")
    first = tokens[:, ids.shape[1]:ids.shape[1] + 1]
    cache = internals.output_cache(hf_forward(hf, ids))
    before = cache.get_recurrent_state(layer).float().clone()
    clean_cache = copy.deepcopy(cache)
    seen = _named(kernel_calls(name, hf, first, internals.STEP_GLOBAL, clean_cache, ids.shape[1])[layer], _STEP)
    after = clean_cache.get_recurrent_state(layer).float()
    decay = (_step_sizes(seen)[..., None] * seen["A"].float()).exp()  # dt [b, h, P], A [h, P, N], as the step
    update = after - before * decay
    _close(got["keys"][:, 0, :, :, None] * got["values"][:, 0, :, None, :], update, tol=2e-5)
    written = before * decay + got["keys"][:, 0, :, :, None] * new_v[:, :, None, :]
    with step_replaced(name, hf, {layer: written}):
        out = hf_forward(hf, first, cache, start=ids.shape[1])
    _close(got["after"], cache.get_recurrent_state(layer), tol=2e-4)
    assert float((written - after).abs().max()) > 1e-2 * max(1.0, float(after.abs().max()))  # the write shows
    second = tokens[:, ids.shape[1] + 1:ids.shape[1] + 2]
    assert torch.equal(second, out.logits[:, -1:].argmax(-1))
    nxt = hf_forward(hf, second, internals.output_cache(out), start=ids.shape[1] + 1)
    _close(got["logits"], nxt.logits[:, -1], tol=1e-3)


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear", "olmo_hybrid"])
def test_a_delta_rule_decode_steps_write_is_the_state_the_next_step_starts_from(family: str) -> None:
    """Under generate, step 1 (transformers' recurrent kernel, one token): its factors multiply to the cache's
    S - a S_before, and a written write_values makes the state after it a S_before + k ⊗ u', which the next step
    starts from."""
    model, hf = _delta(family)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layer = model.spec.linear_layers()[-1]
    d = model.spec.dims
    new_u = _donor((1, d["heads"], d["value_dim"]), seed=11)
    got, tokens = _step_written(model, PROMPT, layer, new_u, "state_input")
    n = ids.shape[1]
    with torch.no_grad():
        cache = hf(ids, use_cache=True).past_key_values
        before = cache.get_recurrent_state(layer).float().clone()
    calls = delta_calls(model.family, hf, tokens[:, n:n + 1], model.family.recurrent_kernel, cache)
    seen = [kw for _, kw in calls]
    g = seen[model.spec.linear_layers().index(layer)]["g"][:, 0]
    decayed = _decayed(before, g)
    _close(got["keys"][:, 0, :, :, None] * got["values"][:, 0, :, None, :],
           cache.get_recurrent_state(layer).float() - decayed)
    written = decayed + got["keys"][:, 0, :, :, None] * new_u[:, :, None, :]
    _close(got["after"], written)
    assert torch.equal(got["state_input"], got["after"])
    assert float((written - cache.get_recurrent_state(layer).float()).abs().max()) > 1e-2
