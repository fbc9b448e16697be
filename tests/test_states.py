"""`states` (the state after every token) computed in chunks, without a Python loop over tokens.

Ground truth is transformers: its cache after running the first t+1 tokens holds the state after
token t, and its own kernels (chunked and recurrent) give the outputs and the final state. The
token-by-token loop `kernels.per_token_loop` states the same recurrence plainly; the chunked
`kernels.per_token` must agree with all of them within float32 noise, for every family (Kimi's
decay is per key channel), with or without an initial state, at any length and chunk size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

import deltalang
from deltalang.models import families
from deltalang.models.testing import FAMILY_NAMES, load_hf, tiny_checkpoint
from deltalang.runtime import kernels

PROMPT = "The Eiffel Tower is in Paris, and the Brandenburg Gate is in Berlin, o"  # 70 byte tokens


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_states_equal_the_cache_after_every_token_of_a_70_token_prompt(family: str) -> None:
    path = tiny_checkpoint(family)
    model = deltalang.load_model(path)
    hf = load_hf(path).eval()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    n = ids.shape[1]
    assert n == 70
    layers = model.spec.linear_layers()
    got: dict[int, torch.Tensor] = {}
    with torch.no_grad(), model.trace(PROMPT):
        for i in layers:
            got[i] = model.layers[i].linear_attn.states.save()
    worst = 0.0
    with torch.no_grad():
        for t in range(n):
            cache = hf(ids[:, : t + 1], use_cache=True).past_key_values
            for i in layers:
                worst = max(worst, _rel(got[i][:, t], cache.get_recurrent_state(i)))
    # measured: 9e-6 (qwen3_5) to 2.2e-5 (qwen3_5_moe), as much as the token loop's 2.1e-5 there:
    # the prefix forwards' own float32 noise upstream of the block; the kernel tests below hold 1e-5
    assert worst < 5e-5, worst


def _inputs(fam: families.Family, b: int, s: int, hk: int, h: int, dk: int, dv: int, initial: bool,
            seed: int = 0) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(seed)
    if fam.per_channel_decay:
        hk = h
        g = -torch.rand(b, s, h, dk, generator=gen) * 2
    else:
        g = -torch.rand(b, s, h, generator=gen) * 3
    q = torch.randn(b, s, hk, dk, generator=gen)
    k = torch.randn(b, s, hk, dk, generator=gen)
    v = torch.randn(b, s, h, dv, generator=gen)
    beta = torch.rand(b, s, h, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen) if initial else None
    return q, k, v, g, beta, state


SHAPES = [  # b, s, key heads, value heads, dk, dv, initial state, chunk size
    (1, 1, 2, 4, 8, 8, False, 16),
    (2, 15, 2, 4, 8, 12, True, 16),
    (2, 16, 4, 4, 16, 8, False, 16),
    (1, 17, 1, 2, 8, 8, True, 16),
    (2, 70, 2, 4, 16, 16, True, 16),
    (1, 70, 2, 2, 8, 8, False, 1),
    (1, 70, 2, 2, 8, 8, True, 7),
    (1, 130, 2, 2, 8, 8, True, 64),
]


@pytest.mark.parametrize("fam", [families.qwen3_5, families.kimi_linear], ids=lambda f: f.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-s{}-hk{}-h{}-dk{}-dv{}-init{}-C{}".format(*s))
def test_chunked_states_equal_the_token_loop_and_transformers_kernels(fam: families.Family,
                                                                        shape: tuple) -> None:
    *dims, chunk = shape
    q, k, v, g, beta, state = _inputs(fam, *dims)
    out, states = kernels.per_token(fam, q, k, v, g, beta, state, True, chunk_size=chunk)
    out_loop, states_loop = kernels.per_token_loop(fam, q, k, v, g, beta, state, True)
    assert out.shape == out_loop.shape and states.shape == states_loop.shape
    assert out.dtype == q.dtype and states.dtype == torch.float32
    assert _rel(states, states_loop) < 1e-5
    assert _rel(out, out_loop) < 1e-5
    # transformers' own kernels, with each key head serving h / hk consecutive value heads as its mixers have it
    # (5.24's kernels repeat the keys inside; before 5.24 the mixer repeats them and the kernels take h key heads)
    rq, rk = (x.repeat_interleave(v.shape[2] // x.shape[2], dim=2) for x in (q, k))
    for name in (fam.chunk_kernel, fam.recurrent_kernel):
        ref_out, ref_final = kernels.original(fam, name)(rq, rk, v, g=g, beta=beta, initial_state=state,
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert _rel(out, ref_out) < 1e-5
        assert _rel(states[:, -1], ref_final) < 1e-5


@pytest.mark.parametrize("fam", [families.qwen3_5, families.kimi_linear], ids=lambda f: f.name)
def test_outputs_keep_the_query_dtype(fam: families.Family) -> None:
    q, k, v, g, beta, state = _inputs(fam, 1, 20, 2, 2, 8, 8, True)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    out, states = kernels.per_token(fam, q, k, v, g, beta, state, False)
    out_loop, states_loop = kernels.per_token_loop(fam, q, k, v, g, beta, state, False)
    assert out.dtype == torch.bfloat16 and states.dtype == torch.float32
    assert _rel(states, states_loop) < 1e-5
    assert _rel(out, out_loop) < 1e-2  # both rounded to bfloat16 at the end


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fam", [families.qwen3_5, families.kimi_linear], ids=lambda f: f.name)
def test_no_python_loop_over_tokens(fam: families.Family) -> None:
    """The number of tensor operations grows with the number of chunks, not of tokens."""
    counts = []
    for s in (256, 512):
        q, k, v, g, beta, state = _inputs(fam, 1, s, 2, 2, 8, 8, True)
        with _CountOps() as ops:
            kernels.per_token(fam, q, k, v, g, beta, state, True)
        counts.append(ops.calls)
    # measured: chunked 13 operations per chunk of 16 tokens (757 in all at 512 tokens); the token
    # loop about 40 per token
    extra_chunks = (512 - 256) // kernels.CHUNK
    assert counts[1] - counts[0] <= 40 * extra_chunks, counts
    assert counts[1] < 4 * 512, counts


def test_blocks_reuse_one_states_buffer_only_when_nothing_holds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a trace, a block's states go into the buffer of an earlier block once nothing references
    it; a block whose states were saved keeps its own. Every value still equals the cache."""
    from deltalang.runtime import deltarule

    path = tiny_checkpoint("qwen3_5")
    model = deltalang.load_model(path)
    hf = load_hf(path).eval()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layers = model.spec.linear_layers()
    assert len(layers) == 3
    buffers: list[int] = []
    real = deltarule._states_buffer

    def recorded(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        out = real(shape, device)
        buffers.append(out.data_ptr())
        return out

    monkeypatch.setattr(deltarule, "_states_buffer", recorded)
    norms: dict[int, torch.Tensor] = {}
    with torch.no_grad(), model.trace(PROMPT):
        for i in layers:  # (a name bound to a block's states would hold them through the next block)
            if i == layers[1]:
                kept = model.layers[i].linear_attn.states.save()  # held: the next block may not write over it
                norms[i] = kept.norm(dim=(-2, -1)).save()
            else:
                norms[i] = model.layers[i].linear_attn.states.norm(dim=(-2, -1)).save()
    assert buffers[1] == buffers[0] and buffers[2] != buffers[1], buffers
    assert not deltarule._SCRATCH  # dropped after the last DeltaNet block
    worst = 0.0
    with torch.no_grad():
        for t in range(ids.shape[1]):
            cache = hf(ids[:, : t + 1], use_cache=True).past_key_values
            worst = max(worst, _rel(kept[:, t], cache.get_recurrent_state(layers[1])))
            for i in layers:
                worst = max(worst, _rel(norms[i][:, t], cache.get_recurrent_state(i).norm(dim=(-2, -1))))
    assert worst < 5e-5, worst


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_states_of_a_bfloat16_model_are_float32_and_equal_its_cache(family: str) -> None:
    path = tiny_checkpoint(family)
    model = deltalang.load_model(path, dtype="bfloat16")
    hf = load_hf(path, dtype=torch.bfloat16).eval()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layers = model.spec.linear_layers()
    got: dict[int, torch.Tensor] = {}
    with torch.no_grad(), model.trace(PROMPT):
        for i in layers:
            got[i] = model.layers[i].linear_attn.states.save()
    worst = 0.0
    with torch.no_grad():
        for t in (0, 17, ids.shape[1] - 1):
            cache = hf(ids[:, : t + 1], use_cache=True).past_key_values
            for i in layers:
                want = cache.get_recurrent_state(i)
                assert got[i].dtype == torch.float32, got[i].dtype
                worst = max(worst, _rel(got[i][:, t], want))
    # the kernel takes bfloat16 inputs and keeps its state in float32, as transformers' cache does
    # (measured 1.4e-7 to 3.6e-7 over the five families)
    assert worst < 1e-5, worst


@pytest.mark.parametrize("fam", [families.qwen3_5, families.kimi_linear], ids=lambda f: f.name)
def test_gradients_flow_through_the_chunked_states_as_through_the_loop(fam: families.Family) -> None:
    """With gradients on (a recipe's trace without no_grad), `per_token` is differentiable like the loop."""
    grads = []
    for fn in (kernels.per_token, kernels.per_token_loop):
        q, k, v, g, beta, state = _inputs(fam, 2, 37, 2, 2, 8, 8, True)
        for x in (q, k, v, state):
            x.requires_grad_(True)
        out, states = fn(fam, q, k, v, g, beta, state, True)
        (out.square().sum() + states.square().sum()).backward()
        grads.append([x.grad for x in (q, k, v, state)])
    for got, want in zip(*grads):
        assert got is not None and _rel(got, want) < 1e-4
