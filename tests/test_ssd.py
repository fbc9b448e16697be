"""The Mamba-2 scan (`deltalang.runtime.ssd`) against transformers itself, on tiny checkpoints of all six families.

Ground truth is transformers: its own chunked scan (`mamba2_chunk_scan`, the modeling module's
global) and its cache, whose `get_recurrent_state(i)` after running the first t + 1 tokens is the
true state after token t. The scan's inputs are taken from inside a real forward by wrapping the
module global the mixer calls; nothing is compared with deltalang's own output.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
from reference import hf_forward as _forward
from reference import kernel_patched

from deltalang.models import internals, testing_ssd
from deltalang.runtime import ssd

FAMILIES = testing_ssd.MAMBA2_FAMILY_NAMES
PROMPT_LEN = 21  # crosses the tiny configs' chunk of 8 unevenly (and `per_token` is run at chunk 3 too)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    """Equal within float32 noise, relative to the larger of 1 and the truth's size."""
    scale = max(1.0, float(want.abs().max()))
    err = float((got.float() - want.float()).abs().max())
    assert err <= tol * scale, f"max |diff| {err:.3g} > {tol:g} * {scale:.3g}"


@functools.lru_cache(maxsize=None)
def _model(name: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(testing_ssd.tiny_ssd_checkpoint(name)).eval()


def _ids(n: int = PROMPT_LEN, rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 259, (rows, n), generator=torch.Generator().manual_seed(seed))


def _cache_states(out: Any, layers: list[int]) -> dict[int, torch.Tensor]:
    cache = internals.output_cache(out)
    return {i: cache.get_recurrent_state(i).clone() for i in layers}


def _capture(name: str, model: Any, ids: torch.Tensor) -> tuple[Any, dict[int, tuple[tuple, dict, Any]]]:
    """A full forward, and each Mamba-2 layer's scan call: (args, kwargs, what transformers' scan returned)."""
    calls: dict[int, tuple[tuple, dict, Any]] = {}

    def record(layer: int, original: Callable, a: tuple, k: dict) -> Any:
        result = original(*a, **k)
        calls[layer] = (a, k, result)
        return result
    with kernel_patched(name, model, internals.SCAN_GLOBAL, record):
        out = _forward(model, ids)
    return out, calls


def _scan_kwargs(k: dict) -> dict[str, Any]:
    return {f: k.get(f) for f in ("D", "dt_bias", "initial_states")} | {
        "dt_softplus": bool(k.get("dt_softplus", False)), "dt_limit": k.get("dt_limit", (0.0, float("inf")))}


# --------------------------------------------------------------------------
# The scan on its own: the chunked form, the loop and transformers' scan agree.
# --------------------------------------------------------------------------


def _random_inputs(b: int = 2, s: int = 37, h: int = 4, P: int = 8, N: int = 6, g: int = 2) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(1)
    args = (torch.randn(b, s, h, P, generator=gen), torch.randn(b, s, h, generator=gen),
            -torch.rand(h, generator=gen) * 2, torch.randn(b, s, g, N, generator=gen), torch.randn(b, s, g, N, generator=gen))
    kw = dict(D=torch.randn(h, generator=gen), dt_bias=torch.randn(h, generator=gen),
              initial_states=torch.randn(b, h, P, N, generator=gen), dt_softplus=True, dt_limit=(0.05, 2.0))
    return args, kw


@pytest.mark.parametrize("chunk", [16, 5, 64])
def test_per_token_is_the_loop_and_transformers_scan(chunk: int) -> None:
    args, kw = _random_inputs()
    y, states = ssd.per_token(*args, chunk_size=chunk, **kw)
    y_loop, states_loop = ssd.per_token_loop(*args, **kw)
    _close(y, y_loop)
    _close(states, states_loop)
    scan = getattr(testing_ssd.modeling_module("mamba2"), internals.SCAN_GLOBAL)
    y_tf, final_tf = scan(*args, 8, return_final_states=True, **kw)
    _close(y, y_tf)
    _close(states[:, -1], final_tf)
    y_f, final = ssd.per_token(*args, chunk_size=chunk, final_state=True, **kw)
    assert final.shape == final_tf.shape and final.dtype == torch.float32
    _close(final, final_tf)
    _close(y_f, y_tf)


def test_per_token_follows_gradients() -> None:
    args, kw = _random_inputs(s=11)
    x = args[0].clone().requires_grad_()
    _, states = ssd.per_token(x, *args[1:], **kw)
    states[:, 7].sum().backward()
    assert x.grad is not None and x.grad[:, :8].abs().sum() > 0
    assert x.grad[:, 8:].abs().sum() == 0  # the state after token 7 depends on tokens 0..7 only


def test_split_refuses_positions_it_cannot_cut() -> None:
    args, kw = _random_inputs(s=9)
    scan = getattr(testing_ssd.modeling_module("mamba2"), internals.SCAN_GLOBAL)
    with pytest.raises(ssd.SSDError, match="tokens 0..8"):
        ssd.split(scan, *args, 8, [9], **kw)
    with pytest.raises(ssd.SSDError, match="not a split position"):
        ssd.split(scan, *args, 8, [3], replace={4: torch.zeros(2, 4, 8, 6)}, **kw)
    with pytest.raises(ssd.SSDError, match="initial state of shape"):
        ssd.per_token(*args, **(kw | {"initial_states": torch.zeros(2, 4, 6, 8)}))


# --------------------------------------------------------------------------
# Every family against transformers' forward and cache.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_checkpoint_has_mamba2_mixers(name: str) -> None:
    model = _model(name)
    layers = [i for i, _ in testing_ssd.ssd_mixers(model)]
    assert layers, f"{name}: no Mamba-2 mixer"
    n_blocks = model.config.num_hidden_layers
    if name not in ("mamba2", "falcon_h1", "zamba2"):  # the hybrids with attention-only blocks
        assert len(layers) < n_blocks, f"{name}: every block is Mamba-2; the tiny config asks for attention too"
    out = _forward(model, _ids())
    for i in layers:
        assert internals.output_cache(out).get_recurrent_state(i).shape == (1, 4, 32, 16)


@pytest.mark.parametrize("name", FAMILIES)
def test_left_padded_batch_equals_unpadded_runs(name: str) -> None:
    """transformers' own padded Mamba-2 forward, before anything is built on it: each row of a
    left-padded batch gives its unpadded run's logits and final states."""
    model = _model(name)
    layers = [i for i, _ in testing_ssd.ssd_mixers(model)]
    long, short = _ids(PROMPT_LEN, seed=2), _ids(PROMPT_LEN - 5, seed=3)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 5, dtype=torch.long), short], 1)])
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    out = _forward(model, ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    states = _cache_states(out, layers)
    for row, alone in enumerate((long, short)):
        ref = _forward(model, alone)
        _close(out.logits[row, -alone.shape[1]:], ref.logits[0])
        for i, want in _cache_states(ref, layers).items():
            _close(states[i][row], want[0])


@pytest.mark.parametrize("name", FAMILIES)
def test_per_token_states_are_the_cache_after_every_prefix(name: str) -> None:
    model = _model(name)
    ids = _ids()
    _, calls = _capture(name, model, ids)
    assert calls, f"{name}: the forward never called {internals.SCAN_GLOBAL}"
    with torch.no_grad():
        mine = {i: ssd.per_token(*a[:5], **_scan_kwargs(k)) for i, (a, k, _) in calls.items()}
        small = {i: ssd.per_token(*a[:5], chunk_size=3, **_scan_kwargs(k))[1] for i, (a, k, _) in calls.items()}
    for i, (a, k, (y_tf, _)) in calls.items():
        _close(mine[i][0], y_tf)  # every token's output, D·x included
    for t in range(ids.shape[1]):
        truth = _cache_states(_forward(model, ids[:, : t + 1]), list(calls))
        for i, want in truth.items():
            _close(mine[i][1][:, t], want)
            _close(small[i][:, t], want)
            a, k, (y_tf, _) = calls[i]
            # one token's read of the true state is transformers' output at that token
            with torch.no_grad():
                _close(ssd.read_state(a[4][:, t], want, a[0][:, t], k.get("D")), y_tf[:, t])


@pytest.mark.parametrize("name", FAMILIES)
def test_split_continues_exactly(name: str) -> None:
    """The family's scan cut at t (and at a second point across a chunk boundary) and continued from
    its own final state reproduces the plain forward's logits and the cache's final states."""
    model = _model(name)
    ids = _ids()
    plain, calls = _capture(name, model, ids)
    reached: dict[int, list[torch.Tensor]] = {}

    def cut(layer: int, original: Callable, a: tuple, k: dict) -> Any:
        y, states, final = ssd.split(original, *a[:5], k["chunk_size"], [3, 9, 16], **_scan_kwargs(k))
        reached[layer] = states
        return (y, final) if k.get("return_final_states") else y
    with kernel_patched(name, model, internals.SCAN_GLOBAL, cut):
        out = _forward(model, ids)
    _close(out.logits, plain.logits)
    layers = list(calls)
    for i, want in _cache_states(plain, layers).items():
        _close(internals.output_cache(out).get_recurrent_state(i), want)
    for t, j in ((3, 0), (9, 1), (16, 2)):
        for i, want in _cache_states(_forward(model, ids[:, : t + 1]), layers).items():
            _close(reached[i][j], want)


def _edit(state: torch.Tensor) -> torch.Tensor:
    return -1.5 * state + torch.randn(state.shape, generator=torch.Generator().manual_seed(4))


def _written(name: str, model: Any, ids: torch.Tensor, layer: int, t: int, edited: torch.Tensor, reread: bool) -> Any:
    """The full forward with `layer`'s scan split at t and continued from `edited` (deltalang's write)."""
    def write(i: int, original: Callable, a: tuple, k: dict) -> Any:
        if i != layer:
            return original(*a, **k)
        y, _, final = ssd.split(original, *a[:5], k["chunk_size"], [t], replace={t: edited}, reread=reread,
                                **_scan_kwargs(k))
        return (y, final) if k.get("return_final_states") else y
    with kernel_patched(name, model, internals.SCAN_GLOBAL, write):
        return _forward(model, ids)


def _middle_mixer(model: Any) -> int:
    layers = [i for i, _ in testing_ssd.ssd_mixers(model)]
    return layers[len(layers) // 2]


@pytest.mark.parametrize("name", FAMILIES)
def test_replaced_state_continues_like_an_edited_cache(name: str) -> None:
    """A state written after token t, token t keeping its output: the later tokens' logits and the final
    state are those of transformers' own continuation from a cache whose state after t was edited in place."""
    model = _model(name)
    ids, t, layer = _ids(), 6, _middle_mixer(model)
    cache = internals.output_cache(_forward(model, ids[:, : t + 1]))
    state = cache.get_recurrent_state(layer)
    edited = _edit(state)
    state.copy_(edited)
    rest = _forward(model, ids[:, t + 1:], cache=cache, start=t + 1)
    out = _written(name, model, ids, layer, t, edited, reread=False)
    clean = _forward(model, ids)
    changed = float((clean.logits[:, t + 1:] - rest.logits).abs().max())
    assert changed > 1e-2, f"{name}: the edit did not move the later logits ({changed:.3g})"
    _close(out.logits[:, t + 1:], rest.logits)
    _close(out.logits[:, : t + 1], clean.logits[:, : t + 1])
    _close(internals.output_cache(out).get_recurrent_state(layer), internals.output_cache(rest).get_recurrent_state(layer))


@pytest.mark.parametrize("name", FAMILIES)
def test_replaced_state_is_read_by_its_own_token(name: str) -> None:
    """deltalang's write of the state after t (token t's output reads it, as the delta rule's does), against
    transformers by hand: the prefix run whose scan returns the edited state, its last output
    C_t · h + D x_t, and the cache carrying the edited state on through the rest of the prompt."""
    model = _model(name)
    ids, t, layer = _ids(), 6, _middle_mixer(model)
    edited = _edit(_cache_states(_forward(model, ids[:, : t + 1]), [layer])[layer])

    def by_hand(i: int, original: Callable, a: tuple, k: dict) -> Any:
        y, final = original(*a, **k)
        if i == layer:
            heads = edited.shape[1]
            C_t = a[4][:, -1].float().repeat_interleave(heads // a[4].shape[2], dim=1)  # [b, h, N]
            y = y.clone()
            y[:, -1] = torch.einsum("bhpn,bhn->bhp", edited, C_t) + k["D"].float()[:, None] * a[0][:, -1].float()
            final = edited.clone()
        return y, final
    with kernel_patched(name, model, internals.SCAN_GLOBAL, by_hand):
        prefix = _forward(model, ids[:, : t + 1])
    rest = _forward(model, ids[:, t + 1:], cache=internals.output_cache(prefix), start=t + 1)
    out = _written(name, model, ids, layer, t, edited, reread=True)
    clean = _forward(model, ids)
    assert float((clean.logits[:, t] - prefix.logits[:, t]).abs().max()) > 1e-2  # token t moved
    _close(out.logits[:, : t + 1], prefix.logits)
    _close(out.logits[:, t + 1:], rest.logits)
    _close(internals.output_cache(out).get_recurrent_state(layer), internals.output_cache(rest).get_recurrent_state(layer))
