"""The engine's mechanism: one clean capture, then blocks L.. recomputed at positions t.. over a frozen prefix.

A cell writing block L at position t changes nothing before block L or position t. `capture_clean` runs
the clean prompt once, keeping the residual stream entering every block, each block's call arguments,
the attention keys and values, and each recurrent (delta-rule or Mamba-2) block's state and window after
t-1 for every start t asked. `run_rows` recomputes rows (cells) from their start block at positions start..
over a cache of the clean prefix (`_prefix_cache`: each block's layer as the clean run's was, `internals.cache`),
each row's write applied inside the kernel call (`MixerSite.direct`); the LM head runs at the last
position only; `continuation_start` says where a cell's continuation starts. With `continuation`, the only sweep
modules touching `model._module`, transformers' cache through `internals.cache` (`device_of`, `dtype_of`, ... answer
the others).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import torch

from deltalang.models import values
from deltalang.models.internals import cache as hf_cache
from deltalang.models.internals import cache_keyword, cache_kwargs
from deltalang.models.internals.cache import (ATTENTION_LAYOUT, HYBRID_LAYOUT, LINEAR_LAYOUT, NO_CACHE_LAYOUT, CacheOf,
                                              CacheUnsupported)
from deltalang.runtime.model import DeltaModel, base_model, decoder

from . import continuation
from .errors import Unsupported
from .job import Cell


@attrs.define
class Capture:
    """What one clean forward of the sweep's prompt leaves for the cells."""

    seq_len: int
    inputs: dict[int, torch.Tensor]  # block -> the residual stream entering it [1, s, hidden]
    kwargs: dict[int, dict[str, Any]]  # block -> its call's keyword arguments (cache removed)
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # attention block -> the cache's keys, values
    values: dict[tuple[str, int, int | None], torch.Tensor]  # (value, block, position) -> [1, ...]
    caches: dict[int, CacheOf] = attrs.field(factory=dict)  # block -> what else its cache layer held
    threaded: dict[int, dict[str, int]] = attrs.field(factory=dict)  # block -> {kwarg: item of the last output}
    full_positions: bool = False  # the model keeps a position history in the cache: position embeddings whole
    layouts: dict[int, str] = attrs.field(factory=dict)  # block -> what its cache layer holds (`internals.cache.layout`)


def capture_clean(model: DeltaModel, text: str, first_block: int, reads: Mapping[int, set[tuple[str, int | None]]]
                  ) -> Capture:
    """One clean forward of `text`: block inputs, call arguments, keys/values, and the asked values.

    `reads`: DeltaNet block -> {(value, position)} with value one of state_after,
    conv_window_after (a position) or state_output (None). Read through the value
    layer in forward order; block inputs and arguments through forward pre-hooks.
    """
    saved: dict[tuple[str, int, int | None], Any] = {}
    order = {"conv_window_after": 0, "state_after": 1, "state_output": 2}

    def forward(cache: Any) -> None:
        with torch.no_grad(), model.trace(text, **cache_kwargs(cache, model), use_cache=True):
            for i in sorted(reads):
                mixer = model.layers[i].linear_attn
                for value, p in sorted(reads[i], key=lambda vp: (order[vp[0]], vp[1] or 0)):
                    if value == "state_output":
                        saved[(value, i, None)] = mixer.state_output.save()
                    elif value == "state_after":
                        saved[(value, i, p)] = mixer.state_after(p).save()
                    else:
                        saved[(value, i, p)] = mixer.conv_window_after(p).save()

    _, cap = capture_forward(model, first_block, forward)
    return attrs.evolve(cap, values=dict(saved))


T = TypeVar("T")


def capture_forward(model: DeltaModel, first_block: int, forward: Callable[[Any], T]) -> tuple[T, Capture]:
    """What `forward(cache)` leaves for `run_rows`, no values: `forward` is one forward of the clean prompt
    through the model given a fresh transformers cache (`**internals.cache_kwargs(cache, model), use_cache=True`),
    with or without gradients (what is kept is detached): the residual stream entering blocks first_block.. and
    their call arguments by name (forward pre-hooks; positional ones bound to the block's parameters,
    `continuation.named`), which of them the previous block's output hands on (`threaded`),
    the attention blocks' keys and values (a sliding window's cache told to keep them all) and indexer keys,
    and the inputs of any further convolution state a linear-attention layer keeps (`CacheOf`)."""
    hf = model._module
    layers = decoder(hf).layers
    inputs: dict[int, torch.Tensor] = {}
    kwargs: dict[int, dict[str, Any]] = {}
    threaded: dict[int, dict[str, int]] = {}
    last: list[Any] = [None]
    refused: list[str] = []

    def recorder(i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, kw: dict) -> None:
            try:
                stream, named = continuation.named(module, args, kw)
            except Unsupported as e:  # raised once the forward is over, not through the model's call
                refused.append(str(e))
                return
            inputs[i] = stream.detach()
            kwargs[i] = {k: _detached(v) for k, v in named.items()}
            prev = last[0] if isinstance(last[0], tuple) else ()
            threaded[i] = {k: j for k, v in named.items() for j, x in enumerate(prev)
                           if j > 0 and isinstance(v, torch.Tensor) and v is x}
        return hook

    def output(module: torch.nn.Module, args: tuple, out: Any) -> None:
        last[0] = out

    hooks = [layers[i].register_forward_pre_hook(recorder(i), with_kwargs=True)
             for i in range(first_block, len(layers))]
    hooks += [layer.register_forward_hook(output) for layer in layers]
    cache = hf_cache.fresh(hf.config)
    caches = hf_cache.watch(cache)
    try:
        result = forward(cache)
    finally:
        for h in hooks:
            h.remove()
    if refused:
        raise Unsupported(refused[0])
    kv = {}
    layouts = {i: hf_cache.layout(layer) for i, layer in enumerate(cache.layers)}
    for i in range(len(layers)):  # every attention block: masks are sized by the first one's cache
        if layouts.get(i) in (ATTENTION_LAYOUT, HYBRID_LAYOUT):
            layer: Any = cache.layers[i]
            keys = hf_cache.keys_of(layer)
            if keys is None:
                raise Unsupported(f"block {i}'s cache holds no keys ({type(layer).__name__})")
            kv[i] = keys
            indexer = hf_cache.indexer_keys(layer)
            if indexer is not None:
                caches.setdefault(i, CacheOf()).indexer = indexer
    missing = [i for i in range(first_block, len(layers))
               if i not in inputs or cache_keyword(layers[i]) not in kwargs[i]]
    if missing:
        raise Unsupported(f"blocks {missing} were not called with a cache")
    seq_len = int(next(iter(inputs.values())).shape[1])
    history = hf_cache.keeps_positions(cache)
    return result, Capture(seq_len, inputs, kwargs, kv, {}, caches, threaded, history, layouts)


def _detached(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, tuple) and all(isinstance(x, torch.Tensor) for x in v):
        return tuple(x.detach() for x in v)
    return v


def prefix_reads(model: DeltaModel, first_block: int, start: int) -> dict[int, set[tuple[str, int | None]]]:
    """The values `capture_clean` must keep for `run_rows` to continue from `start` at blocks first_block..:
    each recurrent block's state and convolution window after start - 1 (none from position 0)."""
    if start <= 0:
        return {}
    return {i: {("state_after", start - 1), ("conv_window_after", start - 1)}
            for i in model.spec.recurrent_layers() if i >= first_block}


def continuation_start(model: DeltaModel, seq_len: int, t: int) -> int:
    """Where a continuation whose first write is at position t starts: t, except at the last token of a
    model with Mamba-2 blocks, where it starts one token earlier (recomputing a clean token). A one-token
    continuation takes transformers' Mamba-2 decode step instead of its prompt scan, and they differ:
    nemotron_h's scan clamps the step sizes to `time_step_min`, its step does not; a cell's meaning is one
    full forward, the prompt scan."""
    if t == seq_len - 1 and t > 0 and model.spec.ssm_layers():
        return t - 1
    return t


def _prefix_cache(model: DeltaModel, cap: Capture, start: int) -> Any:
    """A transformers cache of the clean prefix [0, start), one row per block (resized per call)."""
    return hf_cache.of_layers([_prefix_layer(model, cap, i, start, 1) for i in range(model.spec.num_layers)])


def _prefix_layer(model: DeltaModel, cap: Capture, i: int, start: int, rows: int) -> Any:
    """Block i's cache layer of the clean prefix [0, start) for `rows` rows, as its cache layer was
    (`Capture.layouts`, `internals.cache.layout`): keys and values, state and windows, both, or transformers' empty `DummyLayer`."""
    held = cap.caches.get(i)
    layout = cap.layouts.get(i, ATTENTION_LAYOUT if model.spec.kind(i) == values.ATTENTION else LINEAR_LAYOUT)
    if layout == NO_CACHE_LAYOUT:
        return hf_cache.empty_layer()
    if layout == ATTENTION_LAYOUT:
        keys, vals = cap.kv[i]
        return hf_cache.frozen_attention(keys, vals, held, start, rows)
    width = model.spec.dims.get("conv_width", 4)
    hybrid = layout == HYBRID_LAYOUT
    try:
        if start == 0 or ("state_after", i, start - 1) not in cap.values:
            layer = hf_cache.frozen_linear(None, None, width, rows, held, start, hybrid)
        else:
            layer = hf_cache.frozen_linear(cap.values[("conv_window_after", i, start - 1)][0:1],
                                           cap.values[("state_after", i, start - 1)][0:1], width, rows, held, start,
                                           hybrid, in_place=model.spec.kind(i) == values.SSM and start == cap.seq_len - 1)
    except CacheUnsupported as e:
        raise Unsupported(str(e)) from None
    return hf_cache.frozen_attention(*cap.kv[i], held, start, rows, layer) if hybrid else layer


def _resize(model: DeltaModel, cache: Any, cap: Capture, i: int, start: int, rows: int) -> None:
    """Give block i's cache layer `rows` rows (a fresh layer of the prefix)."""
    cache.layers[i] = _prefix_layer(model, cap, i, start, rows)


def _masks(model: DeltaModel, cap: Capture, cache: Any, start: int) -> dict[str, Any]:
    """The attention masks of a continuation from `start`, per layer type and per kind the decoder's call of
    its blocks names (`continuation.passed_masks`), as the model makes them."""
    types, dec = model.spec.layer_types, decoder(model._module)
    kinds: dict[str, int | None] = {kind: types.index(kind) for kind in dict.fromkeys(types)}
    for block in dict.fromkeys(type(b) for b in dec.layers):
        kinds.update({k: None for k in continuation.passed_masks(type(dec), block).values() if k not in kinds})
    return continuation.masks(dec.config, cache, kinds, cap.seq_len, start,
                              next(iter(cap.inputs.values())))


@attrs.frozen
class Patch:
    """One write of a cell, made concrete: block, value, position and the tensor written (no batch axis)."""

    layer: int
    value: str
    position: int
    tensor: torch.Tensor = attrs.field(eq=False)


@attrs.frozen
class Row:
    """A cell as the engine computes it: from `start_block` on, at positions from `start`."""

    cell: Cell
    start_block: int
    start: int
    patches: tuple[Patch, ...]


@attrs.frozen
class RowsOut:
    """What one forward of rows gives: next-token logits and the state_output of asked blocks."""

    logits: torch.Tensor  # [rows, vocab]
    state_outputs: dict[int, torch.Tensor]  # block -> [rows, heads, key_dim, value_dim]


def run_rows(model: DeltaModel, cap: Capture, rows: Sequence[Row], start: int,
             state_outputs: Iterable[int] = ()) -> RowsOut:
    """Recompute blocks from each row's start block at positions start.., the rows' writes applied.

    `rows` are sorted by start block: at block i the rows starting at or before i
    (a prefix of the batch) are computed; the others still hold the clean stream.
    """
    hf = model._module
    dec = decoder(hf)
    starts = [r.start_block for r in rows]
    assert starts == sorted(starts), "rows must be sorted by start block"
    cache = _prefix_cache(model, cap, start)
    masks = _masks(model, cap, cache, start)
    want = set(state_outputs)
    finals: dict[int, torch.Tensor] = {}
    h: torch.Tensor | None = None
    out: Any = None
    for i in range(starts[0], model.spec.num_layers):
        k = bisect.bisect_right(starts, i)
        have = 0 if h is None else h.shape[0]
        if k > have:
            clean = cap.inputs[i][:, start:]
            fresh = clean.expand(k - have, *clean.shape[1:])
            h = fresh if h is None else torch.cat([h, fresh], dim=0)
        assert h is not None
        _resize(model, cache, cap, i, start, k)
        site = _site(model, i)
        if site is not None:
            site.direct = _direct_writes(rows[:k], i, start)
        try:
            block = dec.layers[i]
            kw = continuation.call_kwargs(cap.kwargs[i], cap.seq_len, start, cache,
                                          continuation.block_masks(dec, block, model.spec.layer_types[i], masks),
                                          block, k, cap.full_positions)
            for name, j in cap.threaded.get(i, {}).items():
                kw[name] = continuation.threaded_value(cap.kwargs[i][name], None if out is None else out[j],
                                                       have, k, start)
            out = block(h, **kw)
        finally:
            if site is not None:
                site.direct = {}
        h = out[0] if isinstance(out, tuple) else out
        final = getattr(cache.layers[i], "final", None) if i in want else None
        if final is not None:
            finals[i] = final
    assert h is not None
    logits = continuation.head(hf, base_model(hf), continuation.tail(dec)(h[:, -1:]))
    return RowsOut(logits, finals)


def _site(model: DeltaModel, i: int) -> Any:
    if model.spec.kind(i) not in values.RECURRENT:
        return None
    mixer = model.family.mixer_of(decoder(model._module).layers[i])  # zamba2's hybrid blocks: one level down
    return getattr(mixer, "_deltalang_site", None)


def _direct_writes(rows: Sequence[Row], layer: int, start: int
                   ) -> dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]:
    """The writes rows make at `layer`, keyed (value, position in the call) -> (row indices, values)."""
    by_site: dict[tuple[str, int], list[tuple[int, torch.Tensor]]] = {}
    for n, row in enumerate(rows):
        for p in row.patches:
            if p.layer == layer:
                by_site.setdefault((p.value, p.position - start), []).append((n, p.tensor))
    out = {}
    for key, items in by_site.items():
        idx = torch.tensor([n for n, _ in items], dtype=torch.long, device=items[0][1].device)
        out[key] = (idx, torch.stack([t for _, t in items]))
    return out


def device_of(model: DeltaModel) -> torch.device:
    """Where inputs start: the first parameter's device that is not `meta` (offloaded to disk by accelerate,
    whose hooks move inputs to each module's own device)."""
    return next((p.device for p in model._module.parameters() if p.device.type != "meta"), torch.device("cpu"))


def dtype_of(model: DeltaModel, value: str) -> torch.dtype:
    return torch.float32 if value == "state_after" else model._module.dtype


def weights_dtype(model: DeltaModel) -> torch.dtype:
    """The dtype the transformers model holds its weights in."""
    return model._module.dtype


def decoder_config(model: DeltaModel) -> Any:
    """The decoder stack's config (`hidden_size`, `vocab_size`, ...)."""
    return decoder(model._module).config
