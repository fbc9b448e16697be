"""transformers' hub-kernel decorator as deltalang reads what it bound: the one module that knows its shape.

`use_kernel_func_from_hub_with_fallback(hub_name, package)` (`HUB_DECORATOR`) wraps a modeling module's torch function
in a closure holding the package's implementation it imported (or the torch function again where it could not),
`torch_function`, `package`, `func_name` and `applicable_params`. `wrapper(fn)` reads that closure along a chain of
`functools.wraps` (None for anything else); `direct(w)` calls the implementation as the wrapper does (its keyword
arguments filtered to those it takes), on any device; `internal_path(func)` the module it imports `func` from: 5.25's wrapper sends inputs on a device the package is not
listed for (a CPU) to the torch function, which a test of FLA's kernels under Triton's interpreter must not.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import attrs

HUB_DECORATOR = "use_kernel_func_from_hub_with_fallback"


@attrs.frozen
class Wrapper:
    """What transformers' hub wrapper of one kernel function holds."""

    fn: Callable[..., Any]  # the wrapper itself
    implementation: Any  # the package's function, or `torch_function` where it was not imported
    torch_function: Callable[..., Any]
    package: str | None
    func_name: str | None
    params: tuple[str, ...] | None  # the implementation's parameters (None: not recorded, pass every keyword)
    cell: Any = None  # the closure's cell holding the implementation (read at each call, as the wrapper does)


def _cells(f: Any) -> dict[str, Any]:
    code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None)
    if code is None or not cells:
        return {}
    return dict(zip(code.co_freevars, cells))


def _closure(f: Any) -> dict[str, Any]:
    out = {}
    for name, cell in _cells(f).items():
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return out


def wrapper(fn: Callable[..., Any]) -> Wrapper | None:
    """The hub wrapper along `fn`'s chain of wrappers (outermost first), None where there is none."""
    f: Any = fn
    for _ in range(16):
        if f is None:
            return None
        closure = _closure(f)
        if "implementation" in closure and "torch_function" in closure:
            package, func = closure.get("package"), closure.get("func_name")
            params = closure.get("applicable_params")
            return Wrapper(f, closure["implementation"], closure["torch_function"],
                           package if isinstance(package, str) else None, func if isinstance(func, str) else None,
                           tuple(params) if isinstance(params, tuple) else None, _cells(f)["implementation"])
        f = getattr(f, "__wrapped__", None)
    return None


def direct(w: Wrapper) -> Callable[..., Any]:
    """The implementation called as the wrapper calls it, whatever the device of the inputs."""
    cell, params = w.cell, w.params

    @functools.wraps(w.fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if params is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return cell.cell_contents(*args, **kwargs)

    return run


def internal_path(func: str) -> str | None:
    """The module under its package transformers imports hub function `func` from (`ops.gated_delta_rule`), if any."""
    try:
        from transformers.integrations import hub_kernels
        return getattr(hub_kernels, "_KERNELS_INTERNAL_PATH_MAPPINGS", {}).get(func)
    except Exception:  # noqa: BLE001  (moved: the package alone)
        return None
