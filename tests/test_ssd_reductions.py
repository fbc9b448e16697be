"""Reductions of a Mamba-2 block's `states`, served without every token's state, against transformers' cache.

Ground truth: a plain transformers model of the same tiny checkpoint; its cache after the first t + 1 tokens
holds the state after token t (`get_recurrent_state(i)`), and the same reduction is taken of those states in
plain torch. The value layer's reduced forms (`ssd.per_token_sq_norms` for norms over head_dim and d_state,
`ssd.per_token_projected` for projections onto a direction, `ssd.per_token_reduced` a group of chunks at a time
for the rest) are also checked never to make a tensor the size of every token's state, and the mixer never to
call `ssd.per_token` for a reduction.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from reference import Largest, cache_after, hf_forward, step_replaced

import deltalang
from deltalang import measures
from deltalang.models import testing_ssd
from deltalang.models.internals import output_cache
from deltalang.runtime import ssd

FAMILIES = ("bamba", "granitemoehybrid")
PROMPT = "The Eiffel Tower is in Paris, and the Gate is in Berlin."  # 56 byte tokens: past two of ssd's chunks
SHORT = PROMPT[:19]
AXES = ("b", "s", "heads", "head_dim", "d_state")


@functools.lru_cache(maxsize=None)
def _truth(name: str) -> tuple[Any, Any, dict[int, torch.Tensor]]:
    """(deltalang's model, plain transformers, per Mamba-2 block the cache's state after every token of PROMPT
    `[1, s, heads, head_dim, d_state]`)."""
    from transformers import AutoModelForCausalLM

    path = testing_ssd.tiny_ssd_checkpoint(name)
    model, hf = deltalang.load_model(path), AutoModelForCausalLM.from_pretrained(path).eval()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layers = [i for i, _ in testing_ssd.ssd_mixers(hf)]
    per: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    for t in range(ids.shape[1]):
        cache = cache_after(hf, ids, t)
        for i in layers:
            per[i].append(cache.get_recurrent_state(i).float())
    return model, hf, {i: torch.stack(v, dim=1) for i, v in per.items()}


def _close(got: Any, want: torch.Tensor, tol: float = 2e-5) -> None:
    got = torch.as_tensor(got).float()
    assert tuple(got.shape) == tuple(want.shape), (got.shape, want.shape)
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
    assert err < tol, err


def _run(model: Any, body: str, prompt: str = PROMPT) -> Any:
    return deltalang.run(f'prompt p = "{prompt}"\ntrace t on p {{\n{body}\n}}\n', model=model)


@pytest.fixture
def no_every_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reduction must not make every token's state: `ssd.per_token` (which does) refuses."""
    def refused(*a: Any, **k: Any) -> Any:
        if not k.get("final_state"):
            raise AssertionError("ssd.per_token made every token's state for a reduction")
        return real(*a, **k)
    real = ssd.per_token
    monkeypatch.setattr(ssd, "per_token", refused)


@pytest.mark.parametrize("name", FAMILIES)
def test_norms_means_and_heads_of_states_equal_the_cache(name: str, no_every_state: None) -> None:
    model, _, states = _truth(name)
    i, j = sorted(states)[:2]
    r = _run(model, f"read L{i}.states.norm(head_dim, d_state) as n\nread L{i}.states.mean(positions) as m\n"
                    f"read L{i}.states.head(1) as h\nread L{i}.states.head(0).mean(positions).norm() as hm\n"
                    f"measure norm(L[ssm].states)\nmeasure norm(L{j}.states, over=[positions, heads]) as np")
    s = states[i]
    _close(r["n"], torch.linalg.vector_norm(s, dim=(-2, -1)))
    _close(r["m"], s.mean(dim=1))
    _close(r["h"], s[:, :, 1])
    _close(r["hm"], torch.linalg.vector_norm(s[:, :, 0].mean(dim=1), dim=(-2, -1)))
    _close(r["np"], torch.linalg.vector_norm(states[j], dim=(1, 2)))
    for k in states:
        _close(r[f"t.norm(L{k}.states)"], torch.linalg.vector_norm(states[k].flatten(2), dim=-1))


@pytest.mark.parametrize("name", FAMILIES)
def test_a_mamba2_states_axes_are_head_dim_and_d_state(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a Mamba-2 block a state's axes are head_dim (x's side, the cache state's axis -2) and d_state (B's and
    C's, axis -1): a norm over either one is that axis of transformers' cached state, per token (streamed), after
    token t and in a measure; a norm over both (and heads) is served from the squared norms, nothing streamed.
    `key_dim` there is a located error naming the axes the value has; `check` and the summary name the axes."""
    from deltalang.ground.errors import DeltaError

    model, _, states = _truth(name)
    i, j = sorted(states)[:2]
    r = _run(model, f"read L{i}.states.norm(d_state) as nd\nread L{i}.states.norm(head_dim) as nh\n"
                    f"read L{j}.state_after(5).norm(d_state) as ad\nread L{j}.state_output.mean(head_dim) as oh\n"
                    f"measure norm(L{j}.states, over=[head_dim]) as mh\nread L{j}.state_output as so")
    _close(r["nd"], torch.linalg.vector_norm(states[i], dim=-1))
    _close(r["nh"], torch.linalg.vector_norm(states[i], dim=-2))
    _close(r["ad"], torch.linalg.vector_norm(states[j][:, 5], dim=-1))
    _close(r["oh"], states[j][:, -1].mean(dim=-2))
    _close(r["mh"], torch.linalg.vector_norm(states[j], dim=-2))
    d = model.spec.dims
    summary = next(line for line in r.summary().splitlines() if line.startswith("so "))
    assert summary.endswith(f"[b=1, heads={d['heads']}, head_dim={d['head_dim']}, d_state={d['d_state']}]"), summary

    def refused(*a: Any, **k: Any) -> None:
        raise AssertionError("a norm over a Mamba-2 state's axes was streamed")
    monkeypatch.setattr(ssd, "per_token_reduced", refused)
    r = _run(model, f"read L{i}.states.norm(d_state, head_dim) as n\nmeasure norm(L{i}.states) as every")
    _close(r["n"], torch.linalg.vector_norm(states[i], dim=(-2, -1)))
    _close(r["every"], torch.linalg.vector_norm(states[i].flatten(2), dim=-1))
    shown = deltalang.check(f"read L{i}.states.norm(d_state) as nd", model.spec, prompt="abc").run("main").ops[0]
    assert shown.reduce.shape == (("b", 1), ("s", 3), ("heads", d["heads"]), ("head_dim", d["head_dim"]))
    wrong = ((f"read L{i}.states.norm(key_dim)", "norm(key"),
             ("measure norm(L[ssm].state_output, over=[value])", "norm(L"))
    for text, at in wrong:
        with pytest.raises(DeltaError) as err:
            deltalang.check(text, model.spec, prompt="abc")
        line = str(err.value)
        assert "axes are [b, " in line and "heads, head_dim, d_state]" in line, line
        assert f":1:{text.index(at) + 1}:" in line, line


def test_a_deltanet_states_axes_stay_key_dim_and_value_dim() -> None:
    """On a DeltaNet block a state's axes are still key_dim and value_dim: d_state is a located error there."""
    from deltalang.ground.errors import DeltaError

    spec = deltalang.load_spec()  # the bundled Qwen3.5 model
    i = spec.linear_layers()[0]
    assert deltalang.check(f"read L{i}.states.norm(key_dim) as n", spec, prompt="The").run("main").ops[0] \
        .reduce.shape[-1][0] == "value_dim"
    with pytest.raises(DeltaError) as err:
        deltalang.check(f"read L{i}.states.norm(d_state)", spec, prompt="The")
    assert "axes are [b, s, heads, key_dim, value_dim]" in str(err.value)


@pytest.mark.parametrize("engine", ["fast", "naive"])
def test_a_sweep_reduces_a_mamba2_state_over_its_named_axes(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep's measure of the last Mamba-2 block's state averaged over head_dim (one number a cell after its
    norm), the engine's and the reference path's: transformers with each cell's state after t zeroed (tokens
    0..t-1, token t a step whose state update ends in zeros, the rest continued from that cache)."""
    import importlib

    from deltalang.sweep import run_sweep

    model, hf, _ = _truth("bamba")
    ssm = model.spec.ssm_layers()
    last = ssm[-1]
    measure = f"norm(L{last}.state_output.mean(head_dim))"
    src = (f'prompt clean = "{SHORT}"\nsweep zero on clean over L in L[ssm], t in 4..6 {{\n'
           f"    write L.state_after(t) = zeros\n    measure {measure}\n}}\n")
    if engine == "fast":
        def refused(*a: Any, **k: Any) -> None:
            raise AssertionError("the sweep fell back to the reference path")
        monkeypatch.setattr(importlib.import_module("deltalang.sweep.engine"), "run_naive", refused)
    out = run_sweep(src, model, progress=False, **({} if engine == "fast" else {"engine": "naive"}))
    ids = model.tokenizer(SHORT, return_tensors="pt").input_ids
    seen = 0
    for layer in ssm:
        for t in (4, 5):
            cache = cache_after(hf, ids, t - 1)
            zeros = torch.zeros_like(cache.get_recurrent_state(layer))
            with step_replaced("bamba", hf, {layer: zeros}):
                cache = output_cache(hf_forward(hf, ids[:, t:t + 1], cache, start=t))
            cache = output_cache(hf_forward(hf, ids[:, t + 1:], cache, start=t + 1))
            want = cache.get_recurrent_state(last).float().mean(dim=-2).norm()
            got = out.results[f"zero[L={layer},t={t}].{measure}"]
            assert abs(float(got) - float(want)) <= 1e-4 * float(want), (layer, t, got, float(want))
            seen += 1
    assert seen == len(out.results) == 2 * len(ssm)


@pytest.mark.parametrize("name", FAMILIES)
def test_projection_onto_a_direction_is_the_dot_product(name: str, tmp_path: Path, no_every_state: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`.project(d)` of a whole state (then maybe a mean over positions) from each head's projection
    (`ssd.per_token_projected`: no state per token, so the streamed states are never asked for); a head's
    projection through the stream."""
    model, _, states = _truth(name)
    i = sorted(states)[-1]
    d = model.spec.dims
    gen = torch.Generator().manual_seed(3)
    direction = torch.randn(d["heads"], d["head_dim"], d["d_state"], generator=gen)
    per_head = torch.randn(d["head_dim"], d["d_state"], generator=gen)
    safetensors.torch.save_file({"d": direction}, str(tmp_path / "dir.safetensors"))
    safetensors.torch.save_file({"d": per_head}, str(tmp_path / "head.safetensors"))
    streamed = ssd.per_token_reduced

    def refused(*a: Any, **k: Any) -> None:
        raise AssertionError("a projection of whole states was streamed")
    monkeypatch.setattr(ssd, "per_token_reduced", refused)
    r = _run(model, f'read L{i}.states.project(load("{tmp_path}/dir.safetensors")) as every\n'
                    f'read L{i}.states.project(load("{tmp_path}/dir.safetensors")).mean(positions) as mean')
    _close(r["every"], (states[i] * direction).sum(dim=(2, 3, 4)))
    _close(r["mean"], (states[i] * direction).sum(dim=(2, 3, 4)).mean(dim=1))
    monkeypatch.setattr(ssd, "per_token_reduced", streamed)
    r = _run(model, f'read L{i}.states.head(2).project(load("{tmp_path}/head.safetensors")) as head')
    _close(r["head"], (states[i][:, :, 2] * per_head).sum(dim=(2, 3)))


def test_padded_invokes_reduce_their_own_positions_only(no_every_state: None) -> None:
    """Two runs of different lengths share a left-padded forward: each one's mean and norm over positions is over
    its own tokens (the short prompt is a prefix: the cache after its tokens is the same)."""
    model, _, states = _truth("bamba")
    i = sorted(states)[1]
    r = deltalang.run(f'prompt a = "{PROMPT}"\nprompt b = "{SHORT}"\n'
                      f"trace ta on a {{ read L{i}.states.mean(positions) as ma }}\n"
                      f"trace tb on b {{ read L{i}.states.mean(positions) as mb\n"
                      f"read L{i}.states.norm(head_dim, d_state, positions) as nb\n"
                      f"read L{i}.states.norm(head_dim, d_state) as pb }}\n", model=model)
    n = len(SHORT)
    _close(r["ma"], states[i].mean(dim=1))
    _close(r["mb"], states[i][:, :n].mean(dim=1))
    _close(r["nb"], torch.linalg.vector_norm(states[i][:, :n], dim=(1, 3, 4)))
    _close(r["pb"], torch.linalg.vector_norm(states[i][:, :n], dim=(-2, -1)))


def test_under_generate_a_decode_step_reduces_its_one_token() -> None:
    """At step k the call runs one token: its states' mean over positions and norm are those of the state after
    that token, which transformers' cache holds after the prompt and the tokens generated before it."""
    model, hf, _ = _truth("granitemoehybrid")
    i = sorted(_truth("granitemoehybrid")[2])[0]
    r = deltalang.run(f'prompt p = "{SHORT}"\ngenerate g on p max_new_tokens 2 {{\n'
                      f"read L{i}.states.mean(positions) as m\nread L{i}.states.norm() as n\nread tokens\n}}\n",
                      model=model)
    ids = model.tokenizer(SHORT, return_tensors="pt").input_ids
    new = torch.as_tensor(r["g.tokens"]).reshape(1, -1)[:, :1]
    seq = torch.cat([ids, new], dim=1)
    cache = cache_after(hf, seq, seq.shape[1] - 1)
    after = cache.get_recurrent_state(i).float()
    _close(r["m.step1"], after)
    _close(r["n.step1"], torch.linalg.vector_norm(after.flatten(1), dim=-1)[:, None])


# -- the reduced forms themselves ---------------------------------------------------------------


def _inputs(b: int, s: int, h: int, P: int, N: int, g: int = 1) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(1)
    args = (torch.randn(b, s, h, P, generator=gen), torch.randn(b, s, h, generator=gen),
            -torch.rand(h, generator=gen) * 2, torch.randn(b, s, g, N, generator=gen),
            torch.randn(b, s, g, N, generator=gen))
    kw = dict(D=torch.randn(h, generator=gen), dt_bias=torch.randn(h, generator=gen),
              initial_states=torch.randn(b, h, P, N, generator=gen), dt_softplus=True, dt_limit=(0.05, 2.0))
    return args, kw


def test_the_reduced_forms_never_make_every_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 512 tokens neither the streamed states nor the squared norms make a tensor a quarter the size of every
    token's state (nor of every chunk's starting state); both equal the states `per_token` makes."""
    b, s, h, P, N = 1, 512, 2, 16, 64
    monkeypatch.setattr(ssd, "_BLOCK_BYTES", 2 * ssd.CHUNK * h * P * N * 4)  # groups of 2 chunks
    args, kw = _inputs(b, s, h, P, N)
    red = measures.Reduction(AXES, [("head", 1), ("mean", ("s",))])
    acc = red.stream(b, s)
    with Largest() as streamed, torch.no_grad():
        ssd.per_token_reduced(*args, [acc.add], **kw)
    with Largest() as normed, torch.no_grad():
        sq = ssd.per_token_sq_norms(*args, **kw)
    with Largest() as projected, torch.no_grad():
        ssd.per_token_projected(*args, torch.ones(h, P, N), **kw)
    every = b * s * h * P * N
    largest = (streamed.largest, normed.largest, projected.largest)
    assert max(largest) < every // 4, largest
    with torch.no_grad():
        _, states = ssd.per_token(*args, **kw)
    _close(acc.result(), states[:, :, 1].mean(dim=1), 1e-5)
    _close(sq, states.double().square().sum(dim=(-2, -1)).float(), 1e-5)


@pytest.mark.parametrize("chunk", [ssd.CHUNK, 5])
def test_projections_equal_the_states_projected(chunk: int) -> None:
    """`per_token_projected` against `per_token_loop`, from an initial state, grouped heads, a ragged length."""
    args, kw = _inputs(2, 101, 4, 8, 12, g=2)
    direction = torch.randn(4, 8, 12, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        _, states = ssd.per_token_loop(*args, **kw)
        got = ssd.per_token_projected(*args, direction, chunk_size=chunk, **kw)
    _close(got, (states * direction).sum(dim=(-2, -1)), 1e-5)


@pytest.mark.parametrize("chunk", [ssd.CHUNK, 5])
def test_squared_norms_equal_the_states_norms(chunk: int) -> None:
    """`per_token_sq_norms` against `per_token_loop` (token by token), from an initial state, two groups of
    heads (B, C shared by two heads each), at a length no multiple of the chunk: each head within float32 noise."""
    args, kw = _inputs(2, 101, 4, 8, 12, g=2)
    with torch.no_grad():
        _, states = ssd.per_token_loop(*args, **kw)
        sq = ssd.per_token_sq_norms(*args, chunk_size=chunk, **kw)
    want = states.double().square().sum(dim=(-2, -1))
    assert float(((sq.double() - want).abs() / want).max()) < 1e-5


def test_streamed_blocks_cover_every_position_once() -> None:
    """`per_token_reduced` hands each position of each row to every sink exactly once, equal to the loop's state."""
    args, kw = _inputs(2, 45, 3, 4, 5)
    with torch.no_grad():
        _, want = ssd.per_token_loop(*args, **kw)
    got = torch.full_like(want, float("nan"))
    seen = torch.zeros(want.shape[:2], dtype=torch.long)

    def sink(row: int, start: int, blk: torch.Tensor) -> None:
        got[row, start:start + blk.shape[0]] = blk
        seen[row, start:start + blk.shape[0]] += 1
    with torch.no_grad():
        ssd.per_token_reduced(*args, [sink], chunk_size=8, **kw)
    assert bool((seen == 1).all())
    _close(got, want, 1e-5)
