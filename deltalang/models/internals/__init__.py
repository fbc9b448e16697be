"""transformers' internals deltalang stands on: the one place that knows them, one adapter per era.

Every name deltalang reads or calls inside transformers beyond its public API is asked here: the form of a kernel
global (`kernel_function`), the decorator a modeling file wraps kernels with and what it holds (`hub`), the Mamba-2 scan's
module globals (`SCAN_GLOBAL`, `STEP_GLOBAL`), the keyword a forward takes its cache under (`cache_keyword`,
`cache_kwargs`, `output_cache`), and the cache's classes and attributes (`cache`). The adapter of the installed
release's era (`eras.era()`: `v5_21` for 5.21-5.23, `v5_24`, `v5_25`) answers what differs. A release whose internals
moved is a new adapter, a line in `eras.ERAS` and a line in `.ci/run`. Nothing here imports transformers at import time.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from . import cache, hub
from .cache import KEYWORDS
from .eras import ERAS, era, era_of
from .hub import HUB_DECORATOR

# the module globals of the six Mamba-2 modeling modules' prompt scan and decode step (hub names in the note)
SCAN_GLOBAL = "mamba2_chunk_scan"  # "mamba_chunk_scan_combined" (mamba_ssm)
STEP_GLOBAL = "mamba2_selective_state_update"  # "selective_state_update" (mamba_ssm)


def kernel_function(bound: Any) -> Callable[..., Any]:
    """The Python function a modeling module's kernel global runs (5.25 binds an `nn.Module` calling it)."""
    return era().kernel_function(bound)


def cache_keyword(target: Any = None) -> str:
    """The keyword `target` takes a transformers cache under: `"cache"` (5.24 on) or `"past_key_values"`.

    `target` is what will be called: a function, a transformers module (its class's `forward`), or an nnsight
    wrapper of one (its `_module`). Read off its signature, never assumed (an unknown keyword would be swallowed
    by `**kwargs`); where it names none (it passes them on through `**kwargs`), the era's."""
    fn = _forward(target) if target is not None else None
    found = _keyword_of(fn) if fn is not None else None
    return found if found is not None else era().CACHE_KEYWORD


def cache_kwargs(cache_: Any, target: Any = None) -> dict[str, Any]:
    """`{"cache": cache}` or `{"past_key_values": cache}`: the keyword `target` takes (`cache_keyword`)."""
    return {cache_keyword(target): cache_}


def output_cache(out: Any) -> Any:
    """The cache a forward returned: `out.cache` (5.24 on; `past_key_values` there is a deprecated alias that
    logs a warning) or `out.past_key_values` before (`out.cache_params`: Mamba-2's); None when it returned none."""
    for name in KEYWORDS:
        if name in out:
            return out[name]
    return None


def _forward(target: Any) -> Callable[..., Any] | None:
    inner = getattr(target, "_module", None)  # an nnsight wrapper's transformers model
    if inner is not None:
        target = inner
    if inspect.isfunction(target) or inspect.ismethod(target):
        return target
    forward = getattr(type(target), "forward", None)
    return forward if callable(forward) else None


@functools.lru_cache(maxsize=256)
def _keyword_of(fn: Callable[..., Any]) -> str | None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in KEYWORDS if name in params), None)


__all__ = ["ERAS", "HUB_DECORATOR", "SCAN_GLOBAL", "STEP_GLOBAL", "cache", "hub", "cache_keyword", "cache_kwargs", "era",
           "era_of", "kernel_function", "output_cache"]
