"""Reductions in the language, computed inside the forward, against transformers' cache.

Ground truth: transformers' cache after the first t+1 tokens holds the state after token t
(`get_recurrent_state`), and a plain forward's hidden states the block outputs; every reduced read
and measure is compared with the same reduction of those. The value layer's streamed reduction of
`states` (a group of chunks at a time, `deltarule.per_token_reduced`) is also checked never to allocate
the whole `[b, s, heads, key_dim, value_dim]`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from reference import Largest

import deltalang
from deltalang import measures
from deltalang.ground.errors import DeltaError
from deltalang.models import families
from deltalang.models.testing import load_hf, tiny_checkpoint
from deltalang.runtime import deltarule, kernels

PROMPT = "The Eiffel Tower is in Paris, and the Brandenburg Gate is in Berlin, o"  # 70 byte tokens
FAMILIES = ("qwen3_5", "kimi_linear")


def _truth(family: str) -> tuple[Any, Any, torch.Tensor, dict[int, torch.Tensor]]:
    """The deltalang model, plain transformers, the prompt's ids, and per DeltaNet block the cache's state
    after every token `[1, s, heads, key_dim, value_dim]`."""
    path = tiny_checkpoint(family)
    model = deltalang.load_model(path)
    hf = load_hf(path).eval()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layers = model.spec.linear_layers()
    per: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    with torch.no_grad():
        for t in range(ids.shape[1]):
            cache = hf(ids[:, : t + 1], use_cache=True).past_key_values
            for i in layers:
                per[i].append(cache.get_recurrent_state(i).float())
    return model, hf, ids, {i: torch.stack(v, dim=1) for i, v in per.items()}


@pytest.fixture(scope="module", params=FAMILIES)
def truth(request: pytest.FixtureRequest) -> tuple[Any, Any, torch.Tensor, dict[int, torch.Tensor]]:
    return _truth(request.param)


def _close(got: Any, want: torch.Tensor, tol: float = 5e-5) -> None:
    got = torch.as_tensor(got).float()
    assert tuple(got.shape) == tuple(want.shape), (got.shape, want.shape)
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
    assert err < tol, err


def _run(model: Any, body: str) -> Any:
    return deltalang.run(f'prompt p = "{PROMPT}"\ntrace t on p {{\n{body}\n}}\n', model=model)


def test_norms_means_and_heads_of_states_equal_the_cache(truth: Any) -> None:
    model, _, _, states = truth
    i = model.spec.linear_layers()[0]
    r = _run(model, f"read L{i}.states.norm(key_dim, value_dim) as n\nread L{i}.states.mean(positions) as m\n"
                    f"read L{i}.states.head(1) as h\nread L{i}.states.head(0).mean(positions).norm() as hm\n"
                    f"measure norm(L[linear].states)\nmeasure norm(L{i}.states, over=[positions, heads]) as np")
    s = states[i]
    _close(r["n"], torch.linalg.vector_norm(s, dim=(-2, -1)))
    _close(r["m"], s.mean(dim=1))
    _close(r["h"], s[:, :, 1])
    _close(r["hm"], torch.linalg.vector_norm(s[:, :, 0].mean(dim=1), dim=(-2, -1)))
    _close(r["np"], torch.linalg.vector_norm(s, dim=(1, 2)))
    for j in model.spec.linear_layers():
        _close(r[f"t.norm(L{j}.states)"], torch.linalg.vector_norm(states[j].flatten(2), dim=-1))


def test_a_reduction_of_one_head_runs_on_that_head_alone(truth: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`.head(k)` first: the value layer cuts the call's inputs to value head k (and its key head, keys grouped
    two value heads to one in the tiny qwen3_5), so no other head's state is computed; a norm after it comes from
    the squared norms, anything else from the one head's states: each equal to the cache's head k reduced."""
    model, _, _, states = truth
    seen: list[int] = []
    for name in ("per_token_sq_norms", "per_token_reduced"):
        def spy(*args: Any, _fn: Any = getattr(deltarule, name), **kw: Any) -> Any:
            seen.append(args[3].shape[2])  # the value heads it was given
            return _fn(*args, **kw)
        monkeypatch.setattr(deltarule, name, spy)
    i = model.spec.linear_layers()[0]
    r = _run(model, f"measure norm(L{i}.states.head(3)) as n3\nread L{i}.states.head(1).norm(key_dim) as k1\n"
                    f"read L{i}.states.head(2).norm().mean(positions) as m2\nread L{i}.states.head(0) as h0")
    s = states[i]
    _close(r["n3"], torch.linalg.vector_norm(s[:, :, 3], dim=(-2, -1)))
    _close(r["k1"], torch.linalg.vector_norm(s[:, :, 1], dim=-2))
    _close(r["m2"], torch.linalg.vector_norm(s[:, :, 2], dim=(-2, -1)).mean(dim=1))
    _close(r["h0"], s[:, :, 0])
    assert seen and set(seen) == {1}, seen


def test_projection_onto_a_loaded_direction_is_the_dot_product(truth: Any, tmp_path: Path) -> None:
    model, _, _, states = truth
    i = model.spec.linear_layers()[-1]
    d = model.spec.dims
    direction = torch.randn(d["heads"], d["key_dim"], d["value_dim"], generator=torch.Generator().manual_seed(3))
    per_head = torch.randn(d["key_dim"], d["value_dim"], generator=torch.Generator().manual_seed(4))
    safetensors.torch.save_file({"d": direction}, str(tmp_path / "dir.safetensors"))
    safetensors.torch.save_file({"d": per_head}, str(tmp_path / "head.safetensors"))
    r = _run(model, f'measure project(L{i}.state_after(20), load("{tmp_path}/dir.safetensors")) as one\n'
                    f'read L{i}.states.project(load("{tmp_path}/dir.safetensors")) as every\n'
                    f'read L{i}.states.head(2).project(load("{tmp_path}/head.safetensors")) as head')
    s = states[i]
    assert isinstance(r["one"], float)
    _close(torch.tensor([r["one"]]), (s[:, 20] * direction).sum(dim=(1, 2, 3)))
    _close(r["every"], (s * direction).sum(dim=(2, 3, 4)))
    _close(r["head"], (s[:, :, 2] * per_head).sum(dim=(2, 3)))


def test_reductions_of_other_values_equal_plain_transformers(truth: Any) -> None:
    model, hf, ids, states = truth
    i = model.spec.linear_layers()[0]
    r = _run(model, f"read L{i}.output.mean(positions) as o\nread L{i}.state_output.head(1).norm() as f\n"
                    f"measure norm(L{i}.state_after(5), over=[key_dim])\nmeasure norm(L{i}.state_output.head(1)) as nh")
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states[i + 1]
    _close(r["o"], hidden.float().mean(dim=1), 1e-4)
    _close(torch.tensor([r["f"]]), torch.linalg.vector_norm(states[i][:, -1, 1], dim=(-2, -1)))
    _close(r[f"t.norm(L{i}.state_after(5), over=[key_dim])"], torch.linalg.vector_norm(states[i][:, 5], dim=2))
    _close(torch.tensor([r["nh"]]), torch.linalg.vector_norm(states[i][:, -1, 1], dim=(-2, -1)))


def test_padded_invokes_reduce_their_own_positions_only() -> None:
    """Two runs of different lengths share a left-padded forward: each one's mean over positions is over its
    own tokens (the cache of each prompt alone is the truth)."""
    model, _, ids, states = _truth("qwen3_5")
    i = model.spec.linear_layers()[1]
    short = PROMPT[:23]
    r = deltalang.run(f'prompt a = "{PROMPT}"\nprompt b = "{short}"\ntrace ta on a {{ read L{i}.states.mean(positions) '
                      f'as ma }}\ntrace tb on b {{ read L{i}.states.mean(positions) as mb\nread L{i}.states.norm() as nb\n'
                      f'read L{i}.states.head(1).norm().mean(positions) as hb\nread L{i}.states.head(3).norm() as hn }}\n',
                      model=model)
    _close(r["ma"], states[i].mean(dim=1))
    _close(r["mb"], states[i][:, :23].mean(dim=1))  # a prefix: the cache after its tokens is the same
    _close(r["nb"], torch.linalg.vector_norm(states[i][:, :23].flatten(2), dim=-1))
    _close(r["hb"], torch.linalg.vector_norm(states[i][:, :23, 1], dim=(-2, -1)).mean(dim=1))
    _close(r["hn"], torch.linalg.vector_norm(states[i][:, :23, 3], dim=(-2, -1)))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_streamed_reduction_never_makes_every_state(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fam = families.by_name(family)
    b, s, h, dk, dv = 1, 512, 2, 16, 128
    monkeypatch.setattr(deltarule, "_BLOCK_BYTES", 4 * deltarule.CHUNK * h * dk * dv * 4)  # groups of 4 chunks
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(b, s, h, dk, generator=gen), torch.randn(b, s, h, dk, generator=gen)
    v = torch.randn(b, s, h, dv, generator=gen)
    g = -torch.rand(b, s, h, dk, generator=gen) if fam.per_channel_decay else -torch.rand(b, s, h, generator=gen)
    beta = torch.rand(b, s, h, generator=gen)
    red = measures.Reduction(("b", "s", "heads", "key_dim", "value_dim"), [("norm", None)])
    acc = red.stream(b, s)
    with Largest() as mode, torch.no_grad():
        deltarule.per_token_reduced(fam, q, k, v, g, beta, None, True, [acc.add])
    assert mode.largest < b * s * h * dk * dv // 4, mode.largest
    _, every = deltarule.per_token(fam, q, k, v, g, beta, None, True)
    _close(acc.result(), torch.linalg.vector_norm(every.flatten(2), dim=-1), 1e-5)


def test_check_prints_each_reduced_shape_and_emit_reduces_in_the_value_layer(tmp_path: Path) -> None:
    from deltalang.compiler.explain import format_resolved
    from deltalang.language.check import check
    from deltalang.models.spec import load_spec

    spec = load_spec(tiny_checkpoint("qwen3_5"))
    out = check('prompt p = "The Eiffel"\nread L0.states.norm(key_dim, value_dim) as n\n'
                'read L0.states.mean(positions)\nmeasure norm(L0.states)\n', spec)
    text = format_resolved(out)
    d = spec.dims
    assert f"as n, shape [b=1, s=10, heads={d['heads']}]" in text, text
    assert f"shape [b=1, heads={d['heads']}, key_dim={d['key_dim']}, value_dim={d['value_dim']}]" in text
    code = deltalang.compile('prompt p = "The Eiffel"\nmeasure norm(L[linear].states)\n').code
    assert ".states_reduced(measures.Reduction(('b', 's', 'heads', 'key_dim', 'value_dim'), [('norm', None)]))" \
        in code and ".states.save()" not in code


def test_a_direction_of_the_wrong_shape_is_a_located_error(tmp_path: Path) -> None:
    from deltalang.language.check import check
    from deltalang.models.spec import load_spec

    spec = load_spec(tiny_checkpoint("qwen3_5"))
    safetensors.torch.save_file({"d": torch.zeros(3, 5)}, str(tmp_path / "d.safetensors"))
    prog = tmp_path / "p.dl"
    prog.write_text('prompt p = "The Eiffel"\nmeasure project(L0.state_output, load("d.safetensors"))\n')
    with pytest.raises(DeltaError) as info:
        check(prog.read_text(), spec, filename=str(prog))
    text = info.value.render()
    assert text.startswith(f"{prog}:2:34: error: a direction of the wrong shape: \"d\" in d.safetensors is [3, 5]"), text
    assert "^" in text


def test_under_generate_a_decode_step_reduces_its_one_token() -> None:
    """At step k the call runs one token: its states' mean over positions is the state after that token, which
    transformers' cache holds after the prompt and the tokens generated before it (the bundled model, whose
    greedy continuation does not stop at once)."""
    path = Path(deltalang.__file__).parent / "models" / "bundled" / "model"
    model, hf = deltalang.load_model(None), load_hf(path).eval()
    i = model.spec.linear_layers()[1]
    prompt = "The Eiffel Tower is in the city of"
    r = deltalang.run(f'prompt p = "{prompt}"\ngenerate g on p max_new_tokens 2 {{\n'
                      f'read L{i}.states.mean(positions) as m\nread L{i}.states.norm() as n\nread tokens\n}}\n', model=model)
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    new = torch.as_tensor(r["g.tokens"]).reshape(1, -1)[:, :1]
    with torch.no_grad():
        cache = hf(torch.cat([ids, new], dim=1), use_cache=True).past_key_values
    after = cache.get_recurrent_state(i).float()
    _close(r["m.step1"], after)
    _close(r["n.step1"], torch.linalg.vector_norm(after.flatten(1), dim=-1)[:, None])


def _random_inputs(fam: Any, s: int, scale: float, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A delta-rule call's inputs `q, k, v, g, beta, initial state` at random: 2 rows of s tokens, 4 value heads of
    32 x 16, grouped key heads (2) where the decay is per head (the gated rule's), log decays in [-scale, 0]."""
    b, h, dk, dv = 2, 4, 32, 16
    hk = h if fam.per_channel_decay else 2
    q, k = torch.randn(b, s, hk, dk, generator=gen), torch.randn(b, s, hk, dk, generator=gen)
    v = torch.randn(b, s, h, dv, generator=gen)
    g = -torch.rand(b, s, h, *([dk] if fam.per_channel_decay else []), generator=gen) * scale
    beta, init = torch.rand(b, s, h, generator=gen), torch.randn(b, h, dk, dv, generator=gen) * 3
    return q, k, v, g, beta, init


def _kernel_states(fam: families.Family, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
    """The state after every token `[b, s, h, dk, dv]` float64, from transformers' own recurrent kernel run one
    token at a time, each call from the last one's final state (keys repeated as 5.24's kernel repeats them)."""
    rq, rk = (x.repeat_interleave(v.shape[2] // x.shape[2], dim=2) for x in (q, k))
    fn, state, out = kernels.original(fam, fam.recurrent_kernel), init, []
    for t in range(q.shape[1]):
        part = slice(t, t + 1)
        state = fn(rq[:, part], rk[:, part], v[:, part], g=g[:, part], beta=beta[:, part], initial_state=state,
                   output_final_state=True, use_qk_l2norm_in_kernel=True)[1]
        out.append(state.double())
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scale", [0.01, 1.0, 8.0], ids=["slow-decay", "decay", "fast-decay"])
def test_head_norms_without_the_states_equal_transformers_states(family: str, scale: float) -> None:
    """`per_token_sq_norms` (what a norm over key_dim, value_dim, heads is served from: the Gram algebra, no
    state per token) against transformers' recurrent kernel's state after every token reduced in plain torch:
    from a non-zero initial state (a continuation), grouped key heads (the gated rule's), at lengths that are no
    multiple of the chunk, decays from almost none (the initial state's and cross terms dominate) to forgetting
    within a few tokens (log decays down to -8 a token), at several chunk sizes."""
    fam = families.by_name(family)
    q, k, v, g, beta, init = _random_inputs(fam, 101, scale, torch.Generator().manual_seed(1))
    want = _kernel_states(fam, q, k, v, g, beta, init).square().sum(dim=(-2, -1))  # [b, s, h]
    # measured worst (fast decay): 5e-6 at chunk 16, 9e-6 at 32, 2.2e-5 at 64, as the chunked states' own
    # float32 noise (`per_token`'s norms: 5e-6 at 16); a wrong term of the algebra is off by O(1)
    for chunk, tol in ((16, 1e-5), (32, 2e-5), (64, 5e-5)):
        sq = deltarule.per_token_sq_norms(fam, q, k, v, g, beta, init, True, chunk_size=chunk)
        assert sq.shape == want.shape and sq.dtype == torch.float32
        assert float(((sq.double() - want).abs() / want).max()) < tol, chunk
    # from no initial state, the first token's state is its write alone
    sq = deltarule.per_token_sq_norms(fam, q, k, v, g, beta, None, True)
    zero = _kernel_states(fam, q[:, :20], k[:, :20], v[:, :20], g[:, :20], beta[:, :20], torch.zeros_like(init))
    assert float(((sq[:, :20].double() - zero.square().sum(dim=(-2, -1))).abs() / zero.square().sum(dim=(-2, -1))
                  ).max()) < 2e-5


HAPPY = ("I am so glad to see you again today", "What a joy it is to be here")
SAD = "It was a gloomy and cold night"


def _cache_states(model: Any, hf: Any, text: str, layer: int, positions: tuple[int, ...]) -> torch.Tensor:
    """transformers' cache after each prefix ending at `positions` (from the end when negative), stacked."""
    ids = model.tokenizer(text, return_tensors="pt").input_ids
    out = []
    with torch.no_grad():
        for p in positions:
            stop = p + 1 if p >= 0 else ids.shape[1] + p + 1
            out.append(hf(ids[:, :stop], use_cache=True).past_key_values.get_recurrent_state(layer).float())
    return torch.cat(out)


def _mean_of(model: Any, hf: Any, texts: tuple[str, ...], layer: int, position: int) -> torch.Tensor:
    """The mean over prompts of the state after token `position` of each (by a write's mean rules: -1 is each
    prompt's own last token, a number >= 0 the same number), from transformers' caches."""
    return torch.cat([_cache_states(model, hf, t, layer, (position,)) for t in texts]).mean(dim=0)


def test_projection_onto_a_difference_of_means_equals_transformers_by_hand(truth: Any) -> None:
    """`project(SITE, mean(a) - mean(b))` and `.project(...)`: the site's value from transformers' cache, dotted
    by hand with (the mean of the prompts' values in their own caches) minus the other mean."""
    model, hf, _, states = truth
    i = model.spec.linear_layers()[-1]
    body = (f"measure project(L{i}.state_after(-1), mean(happy) - mean(sad)) as last\n"
            f"read L{i}.state_after(5).head(1).project(2 * (mean(happy) - mean(sad))) as head\n"
            f"read L{i}.state_output.project(mean(sad) - mean(happy)) as out")
    prog = (f'prompt p = "{PROMPT}"\nprompts happy = ["{HAPPY[0]}", "{HAPPY[1]}"]\nprompt sad = "{SAD}"\n'
            f"trace t on p {{\n{body}\n}}\n")
    r = deltalang.run(prog, model=model)
    s = states[i]
    d_last = _mean_of(model, hf, HAPPY, i, -1) - _mean_of(model, hf, (SAD,), i, -1)
    d_five = _mean_of(model, hf, HAPPY, i, 5) - _mean_of(model, hf, (SAD,), i, 5)
    assert isinstance(r["last"], float)
    _close(torch.tensor([r["last"]]), (s[:, -1] * d_last).sum(dim=(1, 2, 3)), 1e-4)
    _close(r["head"], (s[:, 5, 1] * 2 * d_five[1]).sum(dim=(1, 2)), 1e-4)
    _close(r["out"], (s[:, -1] * -d_last).sum(dim=(1, 2, 3)), 1e-4)
    code = deltalang.compile(prog, model).code  # the means are read in earlier passes, the direction from them
    assert "('project', (results['~mean(happy)" in code, code


def test_check_prints_a_mean_direction_shape_and_a_wrong_one_is_located(tmp_path: Path) -> None:
    from deltalang.compiler.explain import format_resolved
    from deltalang.language.check import check
    from deltalang.models.spec import load_spec

    spec = load_spec(tiny_checkpoint("qwen3_5"))
    head = 'prompt main = "The Eiffel"\nprompts a = ["Good day", "Fine"]\nprompt b = "Bad night"\n'
    text = format_resolved(check(head + "read L0.state_after(-1).project(mean(a) - mean(b)) as x\n"
                                 "measure project(L0.state_after(2).head(0), mean(a) - mean(b))\n", spec))
    assert "read L0.state_after(-1).project(mean(a) - mean(b)) -> position 9 (l) as x, shape [b=1]" in text, text
    assert "measure project(L0.state_after(2).head(0), mean(a) - mean(b)) as main.project(" in text, text
    prog = tmp_path / "p.dl"
    for bad, col, what in [("measure project(L0.output, mean(a) - mean(b))\n", 28, "the mean of output"),
                           ("read L0.state_after(-1).mean(key_dim).project(mean(a) - mean(b))\n", 47,
                            "the mean of state_after")]:
        prog.write_text(head + bad)
        with pytest.raises(DeltaError) as info:
            check(prog.read_text(), spec, filename=str(prog))
        shown = info.value.render()
        want = f"{prog}:4:{col}: error: a direction of the wrong shape: mean(a) - mean(b) is {what}"
        assert shown.startswith(want), shown


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scale", [0.01, 8.0], ids=["slow-decay", "fast-decay"])
def test_projections_without_the_states_equal_transformers_states(family: str, scale: float) -> None:
    """`per_token_projections` (what a projection of `states` is served from: no state per token) against
    transformers' recurrent kernel's state after every token dotted with the direction in plain torch: from a
    non-zero initial state, grouped key heads (the gated rule's), slow and fast decays."""
    fam = families.by_name(family)
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta, init = _random_inputs(fam, 83, scale, gen)
    direction = torch.randn(v.shape[2], k.shape[-1], v.shape[-1], generator=gen)
    want = (_kernel_states(fam, q, k, v, g, beta, init) * direction.double()).sum(dim=(-2, -1))  # [b, s, h]
    got = deltarule.per_token_projections(fam, q, k, v, g, beta, init, True, direction)
    assert got.shape == want.shape and got.dtype == torch.float32
    # dot products cancel: relative to the largest of each head's values
    assert float(((got.double() - want).abs() / want.abs().amax(dim=1, keepdim=True)).max()) < 2e-5
