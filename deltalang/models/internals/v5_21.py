"""transformers 5.21-5.23: kernel globals are functions (hub wrappers around the torch one); a forward takes its
cache as `past_key_values` (the pure Mamba-2 model: `cache_params`); a linear-attention cache layer keeps no
token count."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

CACHE_KEYWORD = "past_key_values"


def kernel_function(bound: Any) -> Callable[..., Any]:
    return bound


def count_tokens(layer: Any, tokens: int, device: torch.device | None) -> None:
    """Tell a rebuilt linear-attention cache layer how many tokens it holds (nothing to tell before 5.25)."""
