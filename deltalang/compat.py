"""The versions of transformers and nnsight deltalang runs on, and what differs between them.

- `SUPPORTED`: each dependency's range, as in pyproject.toml (`tests/test_compat.py` holds them together);
  docs/gpu.md, "Supported versions", says why each bound is where it is;
- `check_versions()`: `UnsupportedVersion`, one line naming the installed version and the range;
- `cache_keyword(target)` / `cache_kwargs(cache, target)`: the keyword a transformers forward takes its
  cache under (`past_key_values` before 5.24, `cache` after), read off the called function's signature,
  never assumed (an unknown keyword would be swallowed by `**kwargs`); `output_cache(out)` the cache a
  forward returned, under either name.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
from typing import Any, Callable

from packaging.version import InvalidVersion, Version

from .errors import DeltaModelError

# package -> (oldest supported, first unsupported): pyproject.toml says `>=low,<high`
SUPPORTED: dict[str, tuple[str, str]] = {
    "transformers": ("5.21.0", "6"),
    "nnsight": ("0.8.0", "0.9"),
}
# transformers >= 5.24, before; and before 5.24 the pure Mamba-2 model's own (`cache_params`, in and out)
CACHE_KEYWORDS = ("cache", "past_key_values", "cache_params")


class UnsupportedVersion(DeltaModelError):
    """An installed dependency lies outside the range deltalang supports."""


def requirement(package: str) -> str:
    """`package>=low,<high`, as pyproject.toml and pip write it."""
    low, high = SUPPORTED[package]
    return f"{package}>={low},<{high}"


def installed(package: str) -> str | None:
    """The installed version of `package` (from its metadata, nothing imported), or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def problem(package: str, version: str | None) -> str | None:
    """Why `version` of `package` is unsupported (one line), or None when it lies in the range."""
    need = requirement(package)
    if version is None:
        return f"{package} is not installed; deltalang needs {need} (pip install '{need}')"
    low, high = SUPPORTED[package]
    try:
        v = Version(version)
    except InvalidVersion:
        return f"cannot read {package}'s version {version!r}; deltalang needs {need}"
    if Version(low) <= v and Version(v.base_version) < Version(high):  # 5.22.0rc1 is in; 6.0.0rc1, 5.21.0.dev0 not
        return None
    return f"{package} {version} is not supported; deltalang needs {need} (pip install '{need}')"


def check_versions() -> None:
    """Raise `UnsupportedVersion` when transformers or nnsight is outside its supported range."""
    for package in SUPPORTED:
        why = problem(package, installed(package))
        if why is not None:
            raise UnsupportedVersion(why)


def cache_keyword(target: Any = None) -> str:
    """The keyword `target` takes a transformers cache under: `"cache"` (5.24 on) or `"past_key_values"`.

    `target` is what will be called: a function, a transformers module (its class's `forward`), or an
    nnsight wrapper of one (its `_module`). Without one, or when its forward names neither keyword (it
    passes them on through `**kwargs`), the installed transformers' `create_causal_mask` tells."""
    fn = _forward(target) if target is not None else None
    found = _keyword_of(fn) if fn is not None else None
    return found if found is not None else _installed_keyword()


def cache_kwargs(cache: Any, target: Any = None) -> dict[str, Any]:
    """`{"cache": cache}` or `{"past_key_values": cache}`: the keyword `target` takes (`cache_keyword`)."""
    return {cache_keyword(target): cache}


def output_cache(out: Any) -> Any:
    """The cache a forward returned: `out.cache` (5.24 on; `past_key_values` there is a deprecated alias that
    logs a warning) or `out.past_key_values` before (`out.cache_params`: Mamba-2's); None when it returned none."""
    for name in CACHE_KEYWORDS:
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
    return next((name for name in CACHE_KEYWORDS if name in params), None)


@functools.lru_cache(maxsize=1)
def _installed_keyword() -> str:
    from transformers import masking_utils

    found = _keyword_of(masking_utils.create_causal_mask)
    if found is None:
        raise UnsupportedVersion(f"transformers {installed('transformers')}'s create_causal_mask takes no cache "
                                 f"keyword deltalang knows ({', '.join(CACHE_KEYWORDS)}); "
                                 f"deltalang needs {requirement('transformers')}")
    return found
