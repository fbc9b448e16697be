"""transformers' cache as deltalang reads and rebuilds it: the one module that knows its classes and attributes.

- `argument(kwargs)`: the cache a mixer's forward was called with, under any era's keyword;
- `conv_state(cache, layer)` / `recurrent_state(cache, layer)`: a linear-attention layer's buffers (None where
  the cache holds none);
- `recording(cache, layer)`: whether the layer records its past (5.25's `activate_past_recording`);
- `layout(layer)`: what a cache layer holds (keys and values, a state and windows, both, nothing);
- `fresh(config)` and `watch(cache)`: the cache a clean capture runs with, every key of a sliding window kept and a
  linear-attention layer's further convolution states recorded (`CacheOf`);
- `frozen_attention`, `frozen_linear`, `empty_layer`, `of_layers`: a cache of a clean prefix, layer by layer, which a
  continuation reads and never overwrites (the recurrent layer records the call's final state as `final`).
The era's adapter (`eras.era()`) sets what differs: 5.25's layers count their tokens (`count_tokens`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import attrs

from .eras import era

if TYPE_CHECKING:
    import torch

ATTENTION_LAYOUT, LINEAR_LAYOUT, HYBRID_LAYOUT, NO_CACHE_LAYOUT = "attention", "linear", "hybrid", "none"
# the keyword a forward takes its cache under: 5.24 on, before, and the pure Mamba-2 model's own before 5.24
KEYWORDS = ("cache", "past_key_values", "cache_params")


class CacheUnsupported(Exception):
    """A cache layer this module cannot rebuild (the caller turns it into its own refusal)."""


@attrs.define
class CacheOf:
    """What a block's cache layer held after the clean run besides keys/values, states and windows."""

    indexer: torch.Tensor | None = None  # an indexer's keys [1, s, ...] (`update_indexer`)
    states: int = 1  # a linear-attention layer's number of conv/recurrent states
    extra: dict[int, tuple[torch.Tensor, int]] = attrs.field(factory=dict)  # state_idx >= 1 -> (input [.., s], width)


def argument(kwargs: dict[str, Any]) -> Any:
    """The cache a module's forward was called with (None without one)."""
    return next((kwargs[k] for k in KEYWORDS if kwargs.get(k) is not None), None)


def conv_state(cache: Any, layer: int) -> torch.Tensor | None:
    try:
        return cache.get_conv_state(layer)
    except (AttributeError, ValueError, KeyError, IndexError):
        return None


def recurrent_state(cache: Any, layer: int) -> torch.Tensor | None:
    try:
        return cache.get_recurrent_state(layer)
    except (AttributeError, ValueError, KeyError, IndexError):
        return None


def recording(cache: Any, layer: int) -> bool:
    """Whether `layer` of `cache` records its past states (a prompt then runs its last tokens one by one)."""
    probe = getattr(cache, "is_recording_past", None)
    try:
        return bool(probe(layer)) if probe is not None else False
    except (IndexError, KeyError):
        return False


def layout(layer: Any) -> str:
    """What a block's cache layer holds: keys and values (`attention`), a recurrent state and windows
    (`linear`), both (`hybrid`: falcon_h1's blocks run attention and a Mamba-2 mixer), or nothing (`none`:
    transformers' `DummyLayer` of an MLP-only block, nemotron_h's `mlp` and `moe`)."""
    from transformers import cache_utils

    dummy = getattr(cache_utils, "DummyLayer", None)
    if dummy is not None and isinstance(layer, dummy):
        return NO_CACHE_LAYOUT
    if isinstance(layer, cache_utils.LinearAttentionCacheLayerMixin):
        return HYBRID_LAYOUT if isinstance(layer, cache_utils.CacheLayerMixin) else LINEAR_LAYOUT
    return ATTENTION_LAYOUT


def fresh(config: Any) -> Any:
    """An empty transformers cache for a model of `config`, as `generate` would make it."""
    from transformers import DynamicCache

    return DynamicCache(config=config)


def keys_of(layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An attention layer's keys and values (detached), None where it holds none."""
    if getattr(layer, "keys", None) is None:
        return None
    return layer.keys.detach(), layer.values.detach()


def indexer_keys(layer: Any) -> torch.Tensor | None:
    keys = getattr(layer, "indexer_keys", None)
    return keys.detach() if keys is not None else None


def keeps_positions(cache: Any) -> bool:
    """Whether a layer keeps a position history (an indexer's), so a continuation takes positions whole."""
    return any(getattr(layer, "indexer_position_ids", None) is not None for layer in cache.layers)


def watch(cache: Any) -> dict[int, CacheOf]:
    """Keep every key of a sliding window's cache layer, and record each linear-attention layer's further
    convolution states (state_idx >= 1: their whole input and width) as the forward updates them."""
    out: dict[int, CacheOf] = {}
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False) and hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()  # the same keys returned; all of them kept
        states = getattr(layer, "number_of_states", None)
        if states is None:
            continue
        mine = out.setdefault(i, CacheOf(states=states))

        def update(conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                   _orig: Any = layer.update_conv_state, _mine: CacheOf = mine, **kw: Any) -> torch.Tensor:
            got = _orig(conv_states, state_idx=state_idx, conv_kernel_size=conv_kernel_size, **kw)
            if state_idx:
                _mine.extra[state_idx] = (conv_states.detach(), int(conv_kernel_size or conv_states.shape[-1]))
            return got
        layer.update_conv_state = update
    return out


def frozen_attention(keys: torch.Tensor, vals: torch.Tensor, held: CacheOf | None, start: int, rows: int,
                     layer: Any = None) -> Any:
    """An attention block's cache layer holding the clean prefix [0, start) for `rows` rows: a plain
    `DynamicLayer` (a sliding window's mask is made over all the prefix's keys), a `DynamicIndexedLayer`
    where the block's indexer keeps keys; or `layer` (a hybrid block's) given those keys. Fresh for each
    call, so it stores what the call adds as usual."""
    from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer

    def cut(x: torch.Tensor, axis: int) -> torch.Tensor:
        x = x.narrow(axis, 0, start)
        return x.expand(rows, *x.shape[1:])

    indexer = held.indexer if held is not None else None
    if layer is None:
        layer = DynamicLayer() if indexer is None else DynamicIndexedLayer()
    layer.keys, layer.values = cut(keys, -2), cut(vals, -2)
    layer.is_initialized, layer.device = True, keys.device
    if indexer is not None:
        layer.indexer_keys = cut(indexer, 1)
        layer.is_indexer_initialized = True
        layer.indexer_dtype, layer.indexer_device = indexer.dtype, indexer.device
    return layer


@functools.lru_cache(maxsize=None)
def _frozen_class(base: type) -> type:
    """`base` (transformers' linear-attention cache layer, or its hybrid with full attention) holding the
    state and windows after the prefix: a continuation reads them and never overwrites them, and the call's
    final state is recorded (`final`) instead of stored."""

    import torch

    class FrozenLinearLayer(base):  # type: ignore[misc, valid-type]
        final: torch.Tensor | None = None
        width: int = 4

        def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0,
                              conv_kernel_size: int | None = None, **kw: Any) -> torch.Tensor:
            if not self.has_previous_state[state_idx]:
                wide = self.width if state_idx == 0 else int(conv_kernel_size or conv_states.shape[-1])
                short = wide - conv_states.shape[-1]
                return torch.nn.functional.pad(conv_states, (short, 0)) if short > 0 else conv_states
            cached: Any = self.conv_states[state_idx]
            return torch.cat([cached, conv_states], dim=-1)

        def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0,
                                   **kw: Any) -> torch.Tensor:
            self.final = recurrent_states
            return recurrent_states

    return FrozenLinearLayer


def frozen_linear(window: torch.Tensor | None, state: torch.Tensor | None, width: int, rows: int,
                  held: CacheOf | None = None, start: int = 0, hybrid: bool = False, in_place: bool = False) -> Any:
    """A recurrent block's cache layer holding the state and conv window after the prefix [0, start).

    `hybrid`: the layer of a block with attention too (its keys set by `frozen_attention`); `in_place`: the call
    updates the state in place (transformers' Mamba-2 decode step, one token after the prefix): the rows get
    their own copy, which is then also the call's final state."""
    import torch
    from transformers import cache_utils

    base = cache_utils.LinearAttentionAndFullAttentionLayer if hybrid else cache_utils.LinearAttentionLayer
    layer: Any = _frozen_class(base)(number_of_states=held.states if held is not None else 1)
    layer.width = width
    layer.conv_kernel_size[0] = width
    if window is not None and state is not None:
        # the cache keeps `width` columns; the first is never read by a continuation
        conv = torch.cat([torch.zeros_like(window[..., :1]), window], dim=-1)
        layer.conv_states[0] = conv.expand(rows, *conv.shape[1:]).clone()  # a decode step updates it in place
        layer.recurrent_states[0] = state.expand(rows, *state.shape[1:])
        if in_place:
            layer.recurrent_states[0] = layer.final = layer.recurrent_states[0].clone()
        layer.has_previous_state[0] = True
        layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
        layer.device, layer.dtype = window.device, window.dtype
        for idx, (x, wide) in (held.extra.items() if held is not None else ()):
            layer.conv_states[idx] = _extra_state(x, wide, start).expand(rows, *x.shape[1:-1], wide)
            layer.conv_kernel_size[idx] = wide
            layer.has_previous_state[idx] = layer.is_conv_states_initialized[idx] = True
    era().count_tokens(layer, start, window.device if window is not None else None)
    return layer


def _extra_state(x: torch.Tensor, wide: int, start: int) -> torch.Tensor:
    """A further convolution state after the prefix [0, start): the last `wide` columns of its input there,
    as the cache keeps them (zero-filled on the left after fewer tokens)."""
    import torch

    if start >= wide:
        return x[..., start - wide:start]
    if x.is_floating_point():
        return torch.nn.functional.pad(x[..., :start], (wide - start, 0))
    raise CacheUnsupported(f"a cache state of token ids {wide} wide after only {start} tokens: the model's own code "
                           "pads so short a prefix itself")


def empty_layer() -> Any:
    """transformers' cache layer of a block that keeps nothing (an MLP-only block)."""
    from transformers.cache_utils import DummyLayer

    return DummyLayer()


def of_layers(layers: list[Any]) -> Any:
    """A transformers cache made of these layers."""
    from transformers.cache_utils import Cache

    return Cache(layers=layers)
