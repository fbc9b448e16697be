"""The value layer, checked against transformers itself on tiny checkpoints of every family.

Ground truth is transformers' own cache: the recurrent state it holds after
running the first t+1 tokens is the state after token t.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import deltalang
from deltalang.ground.errors import DeltaValueError
from deltalang.models.internals import cache_kwargs
from deltalang.models.spec import text_config
from deltalang.models.testing import FAMILY_NAMES, load_hf, tiny_checkpoint
from deltalang.runtime import kernels

PROMPT = "The Eiffel Tower is in"  # 22 byte tokens
OTHER = "My favourite food is pizza"


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def loaded(family: str) -> tuple[deltalang.DeltaModel, torch.nn.Module]:
    path = tiny_checkpoint(family)
    model = deltalang.load_model(path)
    hf = load_hf(path).eval()
    return model, hf


def _ids(model: deltalang.DeltaModel, text: str) -> torch.Tensor:
    return model.tokenizer(text, return_tensors="pt").input_ids


def _cache_after(hf: torch.nn.Module, ids: torch.Tensor) -> object:
    with torch.no_grad():
        return hf(ids, use_cache=True).past_key_values


def test_state_after_every_position_equals_the_cache(loaded: tuple) -> None:
    model, hf = loaded
    ids = _ids(model, PROMPT)
    n = ids.shape[1]
    assert n >= 20
    layers = model.spec.linear_layers()
    mixes = [model.layers[i].linear_attn for i in layers]
    got: dict[tuple[int, int], torch.Tensor] = {}
    with torch.no_grad(), model.trace(PROMPT):
        for i, mix in zip(layers, mixes):
            for t in range(n):
                got[i, t] = mix.state_after(t).save()
    for t in range(n):
        cache = _cache_after(hf, ids[:, : t + 1])
        for i in layers:
            torch.testing.assert_close(got[i, t], cache.get_recurrent_state(i), atol=1e-5, rtol=0)


def test_states_and_state_output(loaded: tuple) -> None:
    model, hf = loaded
    ids = _ids(model, PROMPT)
    layers = model.spec.linear_layers()
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad(), model.trace(PROMPT):
        for i in layers:
            mix = model.layers[i].linear_attn
            out[i] = (mix.states.save(), mix.state_output.save())
    cache = _cache_after(hf, ids)
    for i in layers:
        states, final = out[i]
        assert states.shape[:2] == (1, ids.shape[1])
        assert torch.equal(states[:, -1], final)
        torch.testing.assert_close(final, cache.get_recurrent_state(i), atol=1e-5, rtol=0)
        mid = _cache_after(hf, ids[:, :7]).get_recurrent_state(i)
        torch.testing.assert_close(states[:, 6], mid, atol=1e-5, rtol=0)


def _kernel_betas(model: deltalang.DeltaModel, hf: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """The betas transformers' own forward hands its chunk kernel, one per DeltaNet block in order."""
    fam = model.family
    module = fam.module
    real = kernels.original(fam, fam.chunk_kernel)
    saved = getattr(module, fam.chunk_kernel)
    seen: list[torch.Tensor] = []

    def spy(*args, **kwargs):
        seen.append(kwargs["beta"].clone())
        return real(*args, **kwargs)

    setattr(module, fam.chunk_kernel, spy)
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        setattr(module, fam.chunk_kernel, saved)
    return seen


def test_inputs_of_the_delta_rule(loaded: tuple, family: str) -> None:
    model, hf = loaded
    mix = model.layers[0].linear_attn
    d = model.spec.dims
    with torch.no_grad(), model.trace(PROMPT):
        q = mix.attention_queries.save()
        k = mix.attention_keys.save()
        v = mix.attention_values.save()
        g = mix.decays.save()
        b = mix.betas.save()
        y = mix.attention_head_outputs.save()
        o = mix.attention_output.save()
    n = _ids(model, PROMPT).shape[1]
    assert q.shape == k.shape == (1, n, d["heads"], d["key_dim"])
    assert v.shape == y.shape == (1, n, d["heads"], d["value_dim"])
    assert g.dtype == torch.float32 and bool((g <= 0).all())
    assert g.shape == ((1, n, d["heads"], d["key_dim"]) if model.family.per_channel_decay else (1, n, d["heads"]))
    # the betas served are the ones transformers' own forward gives its kernel
    truth = _kernel_betas(model, hf, _ids(model, PROMPT))
    assert len(truth) == len(model.spec.linear_layers())
    torch.testing.assert_close(b, truth[model.spec.linear_layers().index(0)], atol=0, rtol=0)
    upper = 2.0 if family == "olmo_hybrid" else 1.0
    assert bool((b > 0).all()) and bool((b < upper).all())
    if family == "olmo_hybrid":  # (0, 2): the 2x scale is applied, and these weights reach past 1
        assert hf.config.linear_allow_neg_eigval
        assert float(b.max()) > 1.0
    assert o.shape == (1, n, text_config(model.config).hidden_size)


def _reference_logits(model: deltalang.DeltaModel, hf: torch.nn.Module, ids: torch.Tensor, t: int,
                      written: torch.Tensor) -> torch.Tensor:
    """An independent token-by-token loop (transformers' recurrent kernel), with the state after t replaced."""
    fam = model.family
    module = fam.module
    recurrent = kernels.original(fam, fam.recurrent_kernel)
    l2norm = module.l2norm
    chunk_name = fam.chunk_kernel
    saved = getattr(module, chunk_name)

    def loop(query, key, value, g=None, beta=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kw):
        S = initial_state
        outs = []
        for i in range(query.shape[1]):
            o, S = recurrent(query[:, i:i + 1], key[:, i:i + 1], value[:, i:i + 1], g=g[:, i:i + 1],
                             beta=beta[:, i:i + 1], initial_state=S, output_final_state=True,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            if i == t:
                S = written.clone()
                q = query[:, i].float()
                heads = value.shape[-2]
                if q.shape[-2] != heads:
                    q = q.repeat_interleave(heads // q.shape[-2], dim=1)
                q = l2norm(q, dim=-1, eps=1e-6) * q.shape[-1] ** -0.5
                o = torch.einsum("bhk,bhkv->bhv", q, S)[:, None].to(o.dtype)
            outs.append(o)
        return torch.cat(outs, dim=1), (S if output_final_state else None)

    setattr(module, chunk_name, loop)
    try:
        with torch.no_grad():
            return hf(ids).logits[:, -1]
    finally:
        setattr(module, chunk_name, saved)


def test_set_state_after_matches_a_reference_loop(loaded: tuple) -> None:
    model, hf = loaded
    ids = _ids(model, PROMPT)
    t = ids.shape[1] - 3
    layers = model.spec.linear_layers()
    d = model.spec.dims
    torch.manual_seed(0)
    written = torch.randn(1, d["heads"], d["key_dim"], d["value_dim"]) * 0.5
    with torch.no_grad(), model.trace(PROMPT):
        for i in layers:
            model.layers[i].linear_attn.set_state_after(t, written)
        patched = model.logits[:, -1].save()
    with torch.no_grad(), model.trace(PROMPT):
        clean = model.logits[:, -1].save()
    ref = _reference_logits(model, hf, ids, t, written)
    torch.testing.assert_close(patched, ref, atol=1e-4, rtol=0)
    assert (patched - clean).abs().max() > 1e-3


@pytest.mark.parametrize("route", ["default", "torch"])
def test_reads_bracket_a_write(loaded: tuple, route: str) -> None:
    """Routed, as in the recipe, positions before a write equal `states` bit for bit."""
    model, _ = loaded
    mix = model.layers[0].linear_attn
    deltalang.route_kernels(model.family, route)
    try:
        with torch.no_grad(), model.trace(PROMPT):
            states = mix.states.save()
        t = 5
        zero = torch.zeros_like(states[:, 0])
        with torch.no_grad(), model.trace(PROMPT):
            before = mix.state_after(t - 1).save()
            mix.set_state_after(t, zero)
            at = mix.state_after(t).save()
            after = mix.state_after(t + 1).save()
        with torch.no_grad(), model.trace(PROMPT):
            states_again = mix.states.save()
            before_again = mix.state_after(t - 1).save()
    finally:
        deltalang.route_kernels(model.family, "default")
    if route == "torch":
        assert torch.equal(before, states[:, t - 1])
    torch.testing.assert_close(before, states[:, t - 1], atol=1e-6, rtol=0)
    # a read is the same bits beside a write as beside `states` (which comes from the chunked rule beside it)
    assert torch.equal(before_again, before)
    torch.testing.assert_close(before_again, states_again[:, t - 1], atol=1e-6, rtol=0)
    assert torch.equal(at, zero)
    assert not torch.allclose(after, states[:, t + 1])


def test_conv_window_after_equals_the_cache_and_writes_like_it(loaded: tuple) -> None:
    model, hf = loaded
    ids, other = _ids(model, PROMPT), _ids(model, OTHER)
    t = 8
    layers = model.spec.linear_layers()
    windows: dict[int, torch.Tensor] = {}  # bound outside: a dict first bound in the body would not survive it
    with torch.no_grad(), model.trace(PROMPT):
        for i in layers:
            windows[i] = model.layers[i].linear_attn.conv_window_after(t).save()
    cache = _cache_after(hf, ids[:, : t + 1])
    for i in layers:
        torch.testing.assert_close(windows[i], cache.get_conv_state(i)[:, :, 1:], atol=1e-5, rtol=0)
    # replace every block's window after t with the other prompt's, two ways
    donor = _cache_after(hf, other[:, : t + 1])
    with torch.no_grad(), model.trace(PROMPT):
        for i in layers:
            model.layers[i].linear_attn.set_conv_window_after(t, donor.get_conv_state(i)[:, :, 1:])
        patched = model.logits[:, -1].save()
    with torch.no_grad():
        for i in layers:
            cache.get_conv_state(i).copy_(donor.get_conv_state(i))
        ref = hf(ids[:, t + 1:], **cache_kwargs(cache, hf), use_cache=True).logits[:, -1]
    torch.testing.assert_close(patched, ref, atol=1e-4, rtol=0)


def test_decode_step_write_matches_the_cache_by_hand(loaded: tuple) -> None:
    model, hf = loaded
    layers = model.spec.linear_layers()
    mixes = [model.layers[i].linear_attn for i in layers]
    donors = []
    with torch.no_grad(), model.trace(OTHER):
        for mix in mixes:
            donors.append(mix.state_output.save())
    entering, leaving = [], []
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, do_sample=False) as tracer:
        for step in tracer.iter[:3]:
            if step == 1:  # in forward order: block 0's write, its reads, then the later blocks
                mixes[0].state_input = donors[0]
            s = mixes[0].state_input
            entering.append(s.save() if s is not None else None)
            leaving.append(mixes[0].state_output.save())
            if step == 1:
                for mix, donor in zip(mixes[1:], donors[1:]):
                    mix.state_input = donor
            if step == 2:
                last = model.logits[:, -1].save()
        ids = tracer.result.save()
    assert entering[0] is None
    assert torch.equal(entering[1], donors[0])
    assert torch.equal(leaving[1], entering[2])
    # by hand: prefill, copy the donor states into the cache, decode
    pid, oid = _ids(model, PROMPT), _ids(model, OTHER)
    with torch.no_grad():
        oc = _cache_after(hf, oid)
        out = hf(pid, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        toks = [nxt]
        for st in (1, 2):
            if st == 1:
                for i in layers:
                    cache.get_recurrent_state(i).copy_(oc.get_recurrent_state(i))
            out = hf(nxt, **cache_kwargs(cache, hf), use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            toks.append(nxt)
    n = pid.shape[1]
    assert ids[0, n:].tolist() == torch.cat(toks, dim=1)[0].tolist()
    torch.testing.assert_close(last, out.logits[:, -1], atol=1e-4, rtol=0)


def test_routed_and_default_kernels_agree(loaded: tuple) -> None:
    model, _ = loaded
    fam = model.family
    mix = model.layers[0].linear_attn
    first = ("attention_queries", "decays", "betas")
    then = ("attention_head_outputs", "state_output", "attention_output")

    def read_all() -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        with torch.no_grad(), model.trace(PROMPT):
            for name in first:
                got[name] = getattr(mix, name).save()
            got["state_after(4)"] = mix.state_after(4).save()
            for name in then:
                got[name] = getattr(mix, name).save()
            got["logits"] = model.logits.save()
        return got

    module = fam.module
    bound = {name: getattr(module, name) for name in (fam.chunk_kernel, fam.recurrent_kernel)}
    default = read_all()
    deltalang.route_kernels(fam, "torch")
    try:
        routed = read_all()
        with torch.no_grad():  # outside a trace too
            plain_routed = model._module(_ids(model, PROMPT)).logits
    finally:
        deltalang.route_kernels(fam, "default")
    for key in default:
        torch.testing.assert_close(routed[key], default[key], atol=1e-4, rtol=0)
    torch.testing.assert_close(plain_routed, default["logits"], atol=1e-4, rtol=0)
    # restored exactly: the same functions, and bit-identical results
    assert {name: getattr(module, name) for name in bound} == bound
    assert kernels.prompt_kernel(fam) is kernels.original(fam, fam.chunk_kernel)
    again = read_all()
    for key in default:
        assert torch.equal(again[key], default[key])


def test_uninstall_puts_back_the_import_time_functions() -> None:
    fam = deltalang.models.families.qwen3_5
    kernels.install(fam)
    originals = {n: kernels.bound(fam, n) for n in (fam.chunk_kernel, fam.recurrent_kernel)}
    kernels.uninstall(fam)
    try:
        for name, fn in originals.items():
            assert getattr(fam.module, name) is fn
    finally:
        kernels.install(fam)


def test_errors_name_the_block_and_value(loaded: tuple) -> None:
    model, _ = loaded
    mix = model.layers[0].linear_attn
    with pytest.raises(DeltaValueError, match=r"L0.state_after\(99\): position out of range"):
        with torch.no_grad(), model.trace(PROMPT):
            mix.state_after(99).save()
    with pytest.raises(DeltaValueError, match=r"L0.state_after: a write of shape \[3, 3\] does not fit"):
        with torch.no_grad(), model.trace(PROMPT):
            mix.set_state_after(2, torch.zeros(3, 3))
    with pytest.raises(DeltaValueError, match="L0.states is read-only"):
        with torch.no_grad(), model.trace(PROMPT):
            mix.states = torch.zeros(1)
    attention = model.spec.attention_layers()[0]
    assert getattr(model.layers[attention], "linear_attn", None) is None


def test_batched_invokes_count_each_prompts_own_tokens(loaded: tuple) -> None:
    model, _ = loaded
    mix = model.layers[1].linear_attn
    short = "My pizza"
    solo = {}
    for text in (PROMPT, short):
        with torch.no_grad(), model.trace(text):
            solo[text] = (mix.attention_values.save(), mix.state_after(3).save(), model.next_token_probs.save())
    together: dict[str, tuple] = {}
    with torch.no_grad(), model.trace() as tracer:
        for text in (PROMPT, short):
            with tracer.invoke(text):
                together[text] = (mix.attention_values.save(), mix.state_after(3).save(),
                                  model.next_token_probs.save())
    for text in (PROMPT, short):
        for a, b in zip(solo[text], together[text]):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_invokes_at_their_own_positions_equal_the_cache_and_hold_one_batch_of_states(loaded: tuple) -> None:
    """Invokes asking for different positions (the records of a dataset) each get the cache's state there, and
    what they keep holds one batch of states per served position and block, not one per invoke (a saved state
    is a view of the buffer it was served in: 32 records of a 0.8B-shaped model once kept 18 GiB)."""
    model, hf = loaded
    texts = (PROMPT, OTHER, "The Colosseum is in Rome")
    asked = ((3, 9), (5, 11), (2, 7))  # each invoke its own two positions, in order
    layers = model.spec.linear_layers()
    got: dict[tuple[int, int, int], torch.Tensor] = {}
    with torch.no_grad(), model.trace() as tracer:
        for n, (text, ts) in enumerate(zip(texts, asked)):
            with tracer.invoke(text):
                for i in layers:
                    for t in ts:
                        got[n, i, t] = model.layers[i].linear_attn.state_after(t).save()
    for n, (text, ts) in enumerate(zip(texts, asked)):
        ids = _ids(model, text)
        for t in ts:
            cache = _cache_after(hf, ids[:, : t + 1])
            for i in layers:
                torch.testing.assert_close(got[n, i, t], cache.get_recurrent_state(i), atol=1e-5, rtol=0)
    storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in got.values()}
    one = next(iter(got.values()))[0].numel() * 4  # one row's state, float32
    assert sum(storages.values()) <= len(layers) * 2 * len(texts) * one


def test_invokes_at_their_own_positions_share_each_kernel_call(loaded: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Invokes cut at their own positions (a dataset's records) share each kernel call: three invokes asking one
    position each take two calls per block (each to its position, right-aligned behind neutral tokens; then each
    to the end), not two per invoke; the values are the cache's."""
    model, hf = loaded
    real, calls = kernels.prompt_kernel, []

    def counted(fam: object, device: object = None) -> object:
        fn = real(fam, device)  # type: ignore[arg-type]

        def run(*args: object, **kwargs: object) -> object:
            calls.append(1)
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(kernels, "prompt_kernel", counted)
    texts = (PROMPT, OTHER, "The Colosseum is in Rome")
    asked = (3, 9, 5)
    layers = model.spec.linear_layers()
    got: dict[tuple[int, int], torch.Tensor] = {}
    with torch.no_grad(), model.trace() as tracer:
        for n, (text, t) in enumerate(zip(texts, asked)):
            with tracer.invoke(text):
                for i in layers:
                    got[n, i] = model.layers[i].linear_attn.state_after(t).save()
    assert len(calls) == 2 * len(layers)
    for n, (text, t) in enumerate(zip(texts, asked)):
        cache = _cache_after(hf, _ids(model, text)[:, : t + 1])
        for i in layers:
            torch.testing.assert_close(got[n, i], cache.get_recurrent_state(i), atol=1e-5, rtol=0)


def test_an_invoke_is_served_its_own_rows(loaded: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Invokes at their own positions: a worker is served its own rows' state, not the batch's, so nnsight
    splices no whole batch of states back per write; and a write in one invoke changes its own run only:
    every invoke's state and logits are those of its run alone."""
    from nnsight.intervention.batching import Batcher

    model, _ = loaded
    real, spliced = Batcher._widen_tensor, []

    def widen(self: Batcher, full: torch.Tensor, group: list, edited: torch.Tensor) -> torch.Tensor:
        if full.shape[0] == self.total:  # a batch's tensor: spliced by a copy of the whole batch
            spliced.append(tuple(full.shape))
        return real(self, full, group, edited)

    monkeypatch.setattr(Batcher, "_widen_tensor", widen)
    texts, asked = (PROMPT, OTHER, "The Colosseum is in Rome"), (3, 9, 5)
    layer = model.spec.linear_layers()[0]
    saved: dict[int, torch.Tensor] = {}
    logits: dict[int, torch.Tensor] = {}
    with torch.no_grad(), model.trace() as tracer:
        for n, (text, t) in enumerate(zip(texts, asked)):
            with tracer.invoke(text):
                mixer = model.layers[layer].linear_attn
                saved[n] = mixer.state_after(t).save()
                if n == 1:
                    mixer.set_state_after(t, torch.zeros_like(saved[n]))
                logits[n] = model.logits.save()
    assert not [shape for shape in spliced if len(shape) == 4], spliced  # no [batch, heads, key, value] state
    for n, (text, t) in enumerate(zip(texts, asked)):
        one = saved[n]
        with torch.no_grad(), model.trace(text):
            mixer = model.layers[layer].linear_attn
            alone = mixer.state_after(t).save()
            if n == 1:
                mixer.set_state_after(t, torch.zeros_like(alone))
            want = model.logits.save()
        torch.testing.assert_close(one, alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(logits[n][:, -len(want[0]):], want, atol=1e-4, rtol=0)


def test_a_compiled_kernel_is_reported_with_its_fix() -> None:
    """With flash-linear-attention installed the kernel name holds compiled code without source."""
    fam = deltalang.models.families.qwen3_5
    module = fam.module
    real = kernels.original(fam, fam.chunk_kernel)

    def chunk_gated_delta_rule(*args, **kwargs):  # stands in for fla's compiled kernel
        return real(*args, **kwargs)

    chunk_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule"
    kernels.uninstall(fam)
    setattr(module, fam.chunk_kernel, chunk_gated_delta_rule)
    kernels.install(fam)
    try:
        model = deltalang.load_model(tiny_checkpoint("qwen3_5"))
        status = model.support(layer=0)
        assert status["linear_attn.state_output"].startswith("compiled kernel has no Python source")
        assert "route_kernels" in status["linear_attn.state_output"]
        assert status["linear_attn.attention_output"] == "available"
        with pytest.raises(DeltaValueError, match="compiled kernel has no Python source"):
            with torch.no_grad(), model.trace(PROMPT):
                model.layers[0].linear_attn.state_output.save()
        with torch.no_grad(), model.trace(PROMPT):  # the mixer's output needs no kernel value
            model.layers[0].linear_attn.attention_output.save()
        deltalang.route_kernels(fam, "torch")
        assert model.support(layer=0)["linear_attn.state_output"] == "available"
        with torch.no_grad(), model.trace(PROMPT):
            final = model.layers[0].linear_attn.state_output.save()
        assert final.shape[0] == 1
    finally:
        deltalang.route_kernels(fam, "default")
        kernels.uninstall(fam)
        setattr(module, fam.chunk_kernel, real)
        kernels.install(fam)


def test_positions_under_generate_address_the_steps_own_tokens(loaded: tuple) -> None:
    model, _ = loaded
    mix = model.layers[0].linear_attn
    n = _ids(model, PROMPT).shape[1]
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        for step in tracer.iter[0]:
            prompt_mid = mix.state_after(n - 2).save()
            prompt_last = mix.state_after(-1).save()
            prompt_final = mix.state_output.save()
        for step in tracer.iter[2]:
            entering = mix.state_input.save()
            only = mix.state_after(0).save()
            last = mix.state_after(-1).save()
            leaving = mix.state_output.save()
    assert torch.equal(prompt_last, prompt_final)
    assert not torch.equal(prompt_mid, prompt_final)
    assert torch.equal(only, last) and torch.equal(last, leaving)
    assert not torch.equal(entering, leaving)
    with pytest.raises(DeltaValueError, match="position out of range: this call has 1 token"):
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
            for step in tracer.iter[1]:
                mix.state_after(1).save()
