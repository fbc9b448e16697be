"""transformers 5.25: every hub-kernel function is bound as an instance of `kernels`' small `Func` module, whose
`forward` calls the function it wraps (held in its closure as `func`); the conv runs inside
`causal_conv1d_forward`, a Mamba-2 scan inside `mamba2_scan_forward` (both still calling the kernel globals);
a linear-attention cache layer counts its tokens (`cumulative_length_linear`, what `get_seq_length` returns)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

CACHE_KEYWORD = "cache"


def kernel_function(bound: Any) -> Callable[..., Any]:
    forward = getattr(type(bound), "forward", None)
    code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
    if code is None or not cells or "func" not in code.co_freevars:
        return bound
    return cells[code.co_freevars.index("func")].cell_contents


def count_tokens(layer: Any, tokens: int, device: torch.device | None) -> None:
    import torch

    if hasattr(layer, "cumulative_length_linear"):
        layer.cumulative_length_linear = torch.tensor(tokens, dtype=torch.long, device=device)
