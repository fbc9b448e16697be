"""A continuation's block calls, as the model's own forward would make them after a prefix: `recompute`'s half.

`recompute.run_rows` feeds blocks L.. at positions start.. over a cache of the clean prefix; this module
says what each block call takes there, read off the clean capture and the model's code, not per family:
`named` (a block call's arguments by name, positional ones bound to its forward's parameters), `masks` (one
per layer type and per kind the decoder's call names, `passed_masks`, by transformers' own mask functions,
`MASK_MAKERS`), `call_kwargs` (a block's clean arguments cut to start.. and expanded to the call's rows),
threaded outputs (a tuple's later items the model passes on, fed from the previous recomputed block:
`threaded`), `tail` (what the decoder does after its blocks) and `head` (what the causal LM does after
the decoder). Anything else is `Unsupported` with its
reason (the engine then runs the naive path).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

import torch

from deltalang.models.internals import cache_kwargs

from .errors import Unsupported

MASK_MAKERS = {"full_attention": "create_causal_mask", "indexed_attention": "create_causal_mask",
               "sliding_attention": "create_sliding_window_causal_mask",
               "chunked_attention": "create_chunked_causal_mask",
               "linear_attention": "create_recurrent_attention_mask",
               "hybrid": "create_causal_mask"}  # attention beside a Mamba-2 mixer (falcon_h1): the attention's
NO_MASK = {"mlp", "moe"}  # blocks without attention or a recurrent mixer (nemotron_h): the model passes None
NO_SKIP = {"indexed_attention"}  # an indexer overlays its selection on the mask: the model always makes one


def named(module: torch.nn.Module, args: tuple, kw: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A block call's residual stream (its first argument) and its other arguments by name: positional ones
    bound to the parameters of the block's forward (zamba2's blocks take the embeddings, the layer index and
    two masks positionally)."""
    names = positional_names(type(module))
    if len(args) > len(names):
        raise Unsupported(f"{type(module).__name__}.forward takes {len(args)} arguments positionally, "
                          f"more than it names ({len(names)})")
    first = names[0] if args else "hidden_states"
    bound = dict(zip(names, args)) | dict(kw)
    if first not in bound:
        raise Unsupported(f"{type(module).__name__} was called without its residual stream {first!r}")
    return bound.pop(first), bound


@functools.lru_cache(maxsize=None)
def positional_names(block: type) -> tuple[str, ...]:
    """The parameters of a block's forward that positional arguments bind to, in order (`self` left out)."""
    params = list(inspect.signature(inspect.unwrap(block.forward)).parameters.values())[1:]
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def masks(config: Any, cache: Any, kinds: Mapping[str, int | None], seq_len: int, start: int, like: torch.Tensor
          ) -> dict[str, Any]:
    """The attention mask of a continuation from `start` for each kind in `kinds` (a layer type -> its first
    block; a kind the decoder names that no layer type is -> None: the mask function finds the block itself,
    as in the model's own forward)."""
    from transformers import masking_utils

    dummy = torch.empty(1, seq_len - start, 1, dtype=like.dtype, device=like.device)
    positions = torch.arange(start, seq_len, device=like.device)[None]
    out: dict[str, Any] = {}
    for kind, first in kinds.items():
        if kind in NO_MASK:
            out[kind] = None
            continue
        name = MASK_MAKERS.get(kind)
        if name is None:
            raise Unsupported(f"layer type {kind!r}: no transformers mask function is known for it")
        fn = getattr(masking_utils, name)
        params = inspect.signature(fn).parameters
        kw: dict[str, Any] = {"config": config, "inputs_embeds": dummy, "attention_mask": None}
        if "position_ids" in params:
            kw["position_ids"] = positions
        if "layer_idx" in params and first is not None:
            kw["layer_idx"] = first
        if kind in NO_SKIP and "allow_is_causal_skip" in params:
            kw["allow_is_causal_skip"] = False
        out[kind] = fn(**kw, **cache_kwargs(cache, fn))
    return out


def is_token_tensor(v: Any, seq_len: int) -> bool:
    """A per-token `[1, s]` tensor (token ids, a padding mask)."""
    return isinstance(v, torch.Tensor) and v.dim() == 2 and tuple(v.shape) == (1, seq_len)


def _rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x.expand(rows, *x.shape[1:]) if x.shape[0] == 1 and rows != 1 else x


def call_kwargs(kw: Mapping[str, Any], seq_len: int, start: int, cache: Any, block_masks: Mapping[str, Any],
                block: torch.nn.Module, rows: int, full_positions: bool) -> dict[str, Any]:
    """A block's clean call arguments, cut to positions start.. of a continuation over `cache` (under the
    keyword `block` takes), for `rows` rows (see the module's contract). `block_masks`: its mask arguments
    by name, the continuation's (`block_masks`); the residual streams it takes beside its input (zamba2's
    embeddings, `original_hidden_states`) cut as the token ids are."""
    out = dict(kw)
    out.update(cache_kwargs(cache, block))
    for name, mask in block_masks.items():
        if name in out and not is_token_tensor(out[name], seq_len):
            out[name] = _rows(mask, rows) if isinstance(mask, torch.Tensor) else mask  # an indexer reads rows
    pe = out.get("position_embeddings")
    if isinstance(pe, tuple):
        out["position_embeddings"] = tuple(_rows(x if full_positions else x[..., start:, :], rows) for x in pe)
    for name, v in kw.items():
        if is_token_tensor(v, seq_len) or is_stream_tensor(v, seq_len):
            out[name] = _rows(v[:, start:], rows)
        elif name == "position_ids" and isinstance(v, torch.Tensor):
            out[name] = v[..., start:]
    return out


def is_stream_tensor(v: Any, seq_len: int) -> bool:
    """A per-token vector `[1, s, d]` (a residual stream: zamba2's embeddings beside every block's input)."""
    return isinstance(v, torch.Tensor) and v.dim() == 3 and tuple(v.shape[:2]) == (1, seq_len)


def block_masks(dec: torch.nn.Module, block: torch.nn.Module, layer_type: str, by_kind: Mapping[str, Any]
                ) -> dict[str, Any]:
    """A block's mask arguments by name, each the continuation's mask (`by_kind`) of the kind the model passes
    it: `attention_mask` its layer type's, and any argument the decoder's call gives as `MAPPING["kind"]` that
    kind's (`passed_masks`: falcon_h1's `mamba_attention_mask`, zamba2's two masks, the recurrent one under
    `attention_mask`)."""
    out = {"attention_mask": by_kind[layer_type]}
    out.update({name: by_kind[kind] for name, kind in passed_masks(type(dec), type(block)).items()})
    return out


@functools.lru_cache(maxsize=None)
def passed_masks(dec: type, block: type) -> dict[str, str]:
    """{parameter of `block`'s forward: mask kind} for each argument the decoder's call of its blocks (in its
    last loop over `self.layers`) gives as a subscript by a string, `causal_mask_mapping["full_attention"]`,
    positional ones bound to the forward's parameters. Empty where the call cannot be found."""
    body, at = _forward_body(dec)
    if at is None:
        return {}
    params = positional_names(block)
    loop = body[at]
    assert isinstance(loop, ast.For)
    targets = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    out: dict[str, str] = {}
    for call in ast.walk(loop):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in targets):
            continue
        args = [(params[n] if n < len(params) else "", a) for n, a in enumerate(call.args)]
        for name, expr in args + [(k.arg or "", k.value) for k in call.keywords]:
            if (name and isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant)
                    and isinstance(expr.slice.value, str)):
                out[name] = expr.slice.value
    return out


@functools.lru_cache(maxsize=None)
def _forward_body(dec: type) -> tuple[list[ast.stmt], int | None]:
    """The statements of the decoder's forward and the index of its last `for ... in ...self.layers...` loop."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(dec.forward))))
    body = tree.body[0].body  # type: ignore[attr-defined]
    loops = [n for n, s in enumerate(body) if isinstance(s, ast.For) and "self.layers" in ast.unparse(s.iter)]
    return body, loops[-1] if loops else None


def threaded_value(clean: torch.Tensor | None, previous: Any, have: int, rows: int, start: int) -> Any:
    """A threaded argument for `rows` rows: the previous block's recomputed output for the first `have`, the
    clean one (cut to start..) for the rows starting here."""
    fresh = None if clean is None else _rows(clean[:, start:], rows - have)
    if have == 0 or previous is None:
        return fresh
    if fresh is None or rows == have:
        return previous
    return torch.cat([previous, fresh], dim=0)


def tail(dec: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the decoder's forward applies to the residual stream after its blocks: its statements between the
    loop over `self.layers` and the return that assign `hidden_states`, each `hidden_states = self.a(self.b(...
    hidden_states))` (statements that leave it alone, such as collecting `all_hidden_states`, are skipped)."""
    body, at = _forward_body(type(dec))
    if at is None:
        raise Unsupported(f"{type(dec).__name__}.forward has no loop over self.layers the engine can follow")
    chains: list[list[str]] = []
    for stmt in body[at + 1:]:
        if isinstance(stmt, ast.Return):
            break
        if not _stores_residual(stmt):  # bookkeeping: `if output_hidden_states: all_hidden_states += ...`
            continue
        chain = _chain(stmt)
        if chain is None:
            raise Unsupported(f"{type(dec).__name__}.forward after its blocks: {ast.unparse(stmt)!r}")
        chains.append(chain)

    def apply(h: torch.Tensor) -> torch.Tensor:
        for chain in chains:
            for name in reversed(chain):
                h = getattr(dec, name)(h)
        return h
    return apply


class _Hidden(tuple):
    """What `head`'s stand-in for the base model returns: the final hidden state as `[0]` and as
    `.last_hidden_state`; every other field a causal LM's forward passes on (the cache, router logits,
    rope deltas) None."""

    def __new__(cls, h: torch.Tensor) -> "_Hidden":
        return super().__new__(cls, (h,))

    def __getattr__(self, name: str) -> Any:
        return self[0] if name == "last_hidden_state" else None


def head(hf: torch.nn.Module, base: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The next-token logits `[b, vocab]` the causal LM `hf` makes of the final hidden state `h` (`[b, s, d]`,
    after the decoder's `tail`), by its own forward with its base model `base` standing aside: the LM head
    and whatever the family does past it (granitemoehybrid's `logits_scaling`, falcon_h1's
    `lm_head_multiplier`, a cast to float32)."""
    own = base.__dict__.get("forward")
    base.forward = lambda *args, **kwargs: _Hidden(h)  # type: ignore[method-assign]
    try:
        logits = hf(input_ids=None, inputs_embeds=h, use_cache=False, logits_to_keep=1).logits
    finally:
        if own is None:
            del base.forward
        else:
            base.forward = own  # type: ignore[method-assign]
    return logits[:, -1]


def _stores_residual(stmt: ast.stmt) -> bool:
    """Whether `stmt` assigns the residual stream (`hidden_states`) anywhere in it."""
    return any(isinstance(n, ast.Name) and n.id == "hidden_states" and isinstance(n.ctx, ast.Store)
               for n in ast.walk(stmt))


def _chain(stmt: ast.stmt) -> list[str] | None:
    """`hidden_states = self.a(self.b(hidden_states))` -> ["a", "b"]; None for anything else."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    target, expr, names = stmt.targets[0].id, stmt.value, []
    while isinstance(expr, ast.Call) and len(expr.args) == 1 and not expr.keywords:
        f = expr.func
        if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self"):
            return None
        names.append(f.attr)
        expr = expr.args[0]
    return names if isinstance(expr, ast.Name) and expr.id == target and names else None
