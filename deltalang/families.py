"""The five hybrid families deltalang knows, and where each keeps its DeltaNet parts.

One `Family` per transformers modeling module. Everything the rest of the
package needs to know about a family's code lives here: the mixer class, the
attribute the mixer sits under on its block, the kernel globals it calls, and
how to read its head counts and dimensions off a config.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import attrs


@attrs.frozen
class Family:
    """A gated-DeltaNet family: one transformers modeling module."""

    name: str
    module_name: str
    model_types: tuple[str, ...]
    mixer_class: str
    mixer_attr: str  # attribute of a DeltaNet block that holds the mixer
    chunk_kernel: str
    recurrent_kernel: str
    conv_fn: str = "causal_conv1d_fn"
    conv_update: str = "causal_conv1d_update"
    per_channel_decay: bool = False

    @property
    def module(self) -> ModuleType:
        """The transformers modeling module (imported on first use)."""
        return importlib.import_module(self.module_name)

    @property
    def mixer_type(self) -> type:
        return getattr(self.module, self.mixer_class)

    def is_linear_layer(self, config: Any, index: int) -> bool:
        kinds = getattr(config, "layer_types", None) or []
        return index < len(kinds) and kinds[index] in LINEAR_LAYER_TYPES

    def dims(self, config: Any) -> dict[str, int]:
        """Value heads, key_dim, value_dim, key heads and conv width of the mixer."""
        if self.name == "kimi_linear":
            heads = config.linear_num_heads
            return {
                "heads": heads,
                "key_heads": heads,
                "key_dim": config.linear_head_dim,
                "value_dim": config.linear_head_dim,
                "conv_width": config.linear_conv_kernel_dim,
                "conv_dim": 3 * heads * config.linear_head_dim,
            }
        heads = config.linear_num_value_heads
        key_heads = config.linear_num_key_heads
        kd, vd = config.linear_key_head_dim, config.linear_value_head_dim
        return {
            "heads": heads,
            "key_heads": key_heads,
            "key_dim": kd,
            "value_dim": vd,
            "conv_width": config.linear_conv_kernel_dim,
            "conv_dim": 2 * key_heads * kd + heads * vd,
        }

    def __repr__(self) -> str:
        return f"<deltalang family {self.name} ({self.module_name})>"


LINEAR_LAYER_TYPES = ("linear_attention",)

_M = "transformers.models"
qwen3_5 = Family(
    "qwen3_5", f"{_M}.qwen3_5.modeling_qwen3_5", ("qwen3_5", "qwen3_5_text"),
    "Qwen3_5GatedDeltaNet", "linear_attn",
    "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
)
qwen3_5_moe = Family(
    "qwen3_5_moe", f"{_M}.qwen3_5_moe.modeling_qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"),
    "Qwen3_5MoeGatedDeltaNet", "linear_attn",
    "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
)
qwen3_next = Family(
    "qwen3_next", f"{_M}.qwen3_next.modeling_qwen3_next", ("qwen3_next",),
    "Qwen3NextGatedDeltaNet", "linear_attn",
    "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
)
olmo_hybrid = Family(
    "olmo_hybrid", f"{_M}.olmo_hybrid.modeling_olmo_hybrid", ("olmo_hybrid",),
    "OlmoHybridGatedDeltaNet", "linear_attn",
    "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
)
kimi_linear = Family(
    "kimi_linear", f"{_M}.kimi_linear.modeling_kimi_linear", ("kimi_linear",),
    "KimiLinearDeltaAttention", "self_attn",
    "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention",
    per_channel_decay=True,
)
# aliases the recipes use
qwen3_5_text = qwen3_5

ALL: tuple[Family, ...] = (qwen3_5, qwen3_5_moe, qwen3_next, olmo_hybrid, kimi_linear)


def by_name(name: str) -> Family:
    for fam in ALL:
        if name == fam.name or name in fam.model_types:
            return fam
    raise KeyError(name)


def for_config(config: Any) -> Family | None:
    """The family of a config (a text config or a composite one), or None."""
    model_type = getattr(config, "model_type", None)
    text = getattr(config, "text_config", None)
    for fam in ALL:
        if model_type in fam.model_types:
            return fam
    if text is not None and text is not config:
        return for_config(text)
    return None


def supported_names() -> str:
    return ", ".join(f.name for f in ALL)


def resolve(family: Family | ModuleType | str) -> Family:
    """Accept a Family, its modeling module, or a name."""
    if isinstance(family, Family):
        return family
    if isinstance(family, str):
        return by_name(family)
    if isinstance(family, ModuleType):
        for fam in ALL:
            if family.__name__ == fam.module_name:
                return fam
    raise ValueError(f"not a deltalang family: {family!r}; supported: {supported_names()}")
