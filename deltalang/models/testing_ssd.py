"""Tiny random-weight checkpoints of the six Mamba-2 (SSD) families of transformers, built offline.

Contract:
- `MAMBA2_FAMILY_NAMES` names the model types whose modeling modules carry the Mamba-2 scan
  (`internals.SCAN_GLOBAL`): granitemoehybrid, nemotron_h, falcon_h1, bamba, zamba2, mamba2.
- `tiny_ssd_config(name)` is a small config from transformers' own config class (hidden 64, 4 heads
  of 32, d_state 16, chunk 8; the hybrids with Mamba-2 and attention blocks both);
  `build_tiny_ssd(name, path, **fields)` writes a loadable checkpoint (config, safetensors, byte tokenizer);
  `tiny_ssd_checkpoint(name)` builds one once per process in a temporary directory.
- `ssd_mixers(model)` lists the model's Mamba-2 mixers as (cache layer index, module), in order;
  `modeling_module(name)` is the family's modeling module (where the scan global lives).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from . import testing

MAMBA2_FAMILY_NAMES: tuple[str, ...] = ("granitemoehybrid", "nemotron_h", "falcon_h1", "bamba", "zamba2", "mamba2")

# the Mamba-2 part of every tiny config: 4 heads of 32 over an inner width of 128, d_state 16, one group
_HEADS, _STATE, _CHUNK, _CONV = 4, 16, 8, 4


def _common() -> dict[str, Any]:
    return dict(vocab_size=259, hidden_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False, max_position_embeddings=256)


def _attention() -> dict[str, Any]:
    return dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)


def _granitemoehybrid(cls: Any) -> Any:
    return cls(**_common(), **_attention(), num_hidden_layers=4,
               layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
               mamba_n_heads=_HEADS, mamba_d_head=32, mamba_d_state=_STATE, mamba_chunk_size=_CHUNK,
               mamba_d_conv=_CONV, mamba_expand=2, num_local_experts=4, num_experts_per_tok=2,
               shared_intermediate_size=64, position_embedding_type="rope",
               logits_scaling=2.0)  # the model divides its logits by it after the LM head, as Granite's do


def _nemotron_h(cls: Any) -> Any:
    return cls(**_common(), **_attention(), head_dim=16,
               layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"],
               mamba_num_heads=_HEADS, mamba_head_dim=32, ssm_state_size=_STATE, n_groups=2,
               chunk_size=_CHUNK, conv_kernel=_CONV, expand=2)


def _falcon_h1(cls: Any) -> Any:
    return cls(**_common(), **_attention(), num_hidden_layers=3, head_dim=16, mamba_d_ssm=128,
               mamba_n_heads=_HEADS, mamba_d_head=32, mamba_d_state=_STATE, mamba_chunk_size=_CHUNK,
               mamba_d_conv=_CONV, mamba_expand=2,
               lm_head_multiplier=0.5)  # the model multiplies its logits by it after the LM head


def _bamba(cls: Any) -> Any:
    return cls(**_common(), **_attention(), num_hidden_layers=4, attn_layer_indices=[2],
               mamba_n_heads=_HEADS, mamba_d_head=32, mamba_d_state=_STATE, mamba_chunk_size=_CHUNK,
               mamba_d_conv=_CONV, mamba_expand=2)


def _zamba2(cls: Any) -> Any:
    common = _common() | {"tie_word_embeddings": True}
    return cls(**common, **_attention(), num_hidden_layers=5,
               layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid", "linear_attention"],
               n_mamba_heads=_HEADS, mamba_d_state=_STATE, chunk_size=_CHUNK, mamba_d_conv=_CONV,
               mamba_expand=2, num_mem_blocks=1, adapter_rank=8)


def _mamba2(cls: Any) -> Any:
    return cls(**_common(), num_hidden_layers=3, num_heads=_HEADS, head_dim=32, state_size=_STATE,
               n_groups=2, chunk_size=_CHUNK, conv_kernel=_CONV, expand=2)


_RECIPES: dict[str, Callable[[Any], Any]] = {
    "granitemoehybrid": _granitemoehybrid, "nemotron_h": _nemotron_h, "falcon_h1": _falcon_h1,
    "bamba": _bamba, "zamba2": _zamba2, "mamba2": _mamba2,
}


def modeling_module(name: str) -> ModuleType:
    """transformers' modeling module of Mamba-2 family `name` (the scan's module global lives there)."""
    if name not in MAMBA2_FAMILY_NAMES:
        raise ValueError(f"not a Mamba-2 family: {name!r} (one of {', '.join(MAMBA2_FAMILY_NAMES)})")
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def tiny_ssd_config(name: str) -> Any:
    """A small config of Mamba-2 family `name` from transformers' own config class."""
    from transformers import CONFIG_MAPPING

    modeling_module(name)  # refuses a name that is not a Mamba-2 family
    return _RECIPES[name](CONFIG_MAPPING[name])


def build_tiny_ssd(name: str, path: str | Path, seed: int = 0, **fields: Any) -> Path:
    """Write a random-weight checkpoint of Mamba-2 family `name` to `path` and return the path; `fields` set
    on its tiny config first (zamba2's `use_mem_rope=True`)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    cfg = tiny_ssd_config(name)
    for key, value in fields.items():
        setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_config(cfg)
    model.eval()
    _enlarge_random_weights(model)
    model.save_pretrained(path)
    testing.byte_tokenizer().save_pretrained(path)
    return path


def _enlarge_random_weights(model: torch.nn.Module) -> None:
    """Scale the projections (random init is std 0.02) so that states and logits move visibly; spread
    the step sizes' bias and A over heads so that heads decay at different rates."""
    testing._enlarge_random_weights(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.uniform_(-3.0, 0.5)
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.5)
            elif name.endswith(".D"):
                p.normal_(0.0, 1.0)


def tiny_ssd_checkpoint(name: str) -> Path:
    """A tiny checkpoint of Mamba-2 family `name`, built once per process in a temporary directory."""
    return testing.built_once(name, build_tiny_ssd, prefix="deltalang-ssd-")


def ssd_mixers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """The Mamba-2 mixers of `model` as (cache layer index, module), ordered by layer index."""
    found = {}
    for module in model.modules():
        if all(hasattr(module, a) for a in ("A_log", "dt_bias", "D", "conv1d", "in_proj", "layer_idx")):
            found[int(module.layer_idx)] = module
    return sorted(found.items())
