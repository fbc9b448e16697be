"""Which implementation runs behind a transformers kernel global, and which one serves a call.

`of(fn)` reads a kernel global (a family's prompt kernel, its conv, ...) as transformers'
hub-kernel wrapper bound it: the compiled implementation it chose (FLA, causal-conv1d, mamba_ssm's
`mamba_chunk_scan_combined` / `selective_state_update` behind a Mamba-2 family's scan globals) and the torch
reference, or whatever else the global is. `Backend.pick(device)` is the function a call on `device` runs:
mode `"auto"` (default) the compiled one for CUDA tensors and the reference elsewhere, `"reference"` or
`"compiled"` one of them everywhere (`using(mode)` for a `with` block); with no compiled implementation
it returns the global itself, so nothing changes without FLA. `not_bound(b)` gives, in one line, why an
installed package was not bound; `Backend.handoff` names FlashQLA, which deltalang's calls route around
(`FLA_FLASH_QLA=0` per call). `per_sequence` runs a kernel once per packed sequence. Why: docs/gpu.md.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import attrs
import torch

from deltalang.ground.errors import DeltaValueError
from deltalang.models import internals

MODES = ("auto", "reference", "compiled")
_MODE = ["auto"]


@attrs.frozen
class Backend:
    """What one kernel global runs: its torch reference and its compiled implementation, if any."""

    fn: Callable[..., Any]  # the global as transformers bound it
    reference: Callable[..., Any] | None  # transformers' pure-torch function
    compiled: Callable[..., Any] | None  # what runs the compiled implementation (None: torch only)
    name: str  # the compiled implementation in words ("fla chunk_gated_delta_rule"), "" if none
    tried: tuple[str, str] | None = None  # (package, function) transformers tried to import and did not bind
    handoff: str = ""  # a package the compiled one would hand calls to, turned off for them ("FlashQLA")

    def pick(self, device: torch.device | str | None) -> Callable[..., Any] | None:
        """The function a call on `device` runs under the current mode (None: nothing can serve it)."""
        if self.compiled is None:
            return self.fn
        mode = _MODE[0]
        cuda = device is not None and torch.device(device).type == "cuda"
        if mode == "compiled" or (mode == "auto" and (cuda or self.reference is None)):
            return self.compiled  # (auto: compiled code without a reference runs where it is bound)
        return self.reference

    def describe(self, device: torch.device | str | None = None) -> str:
        """In words: what serves a call on `device` (None: every device, as a rule)."""
        if self.compiled is None:
            return "torch reference"
        if self.reference is None:
            return f"{self.name} (compiled; no torch reference)"
        if device is None:
            if _MODE[0] == "auto":
                return f"{self.name} (compiled) on CUDA, torch reference elsewhere"
            return f"{self.name} (compiled)" if _MODE[0] == "compiled" else "torch reference"
        return f"{self.name} (compiled)" if self.pick(device) is self.compiled else "torch reference"


def of(fn: Callable[..., Any]) -> Backend:
    """Read what a kernel global runs (see the module docstring for the forms it knows)."""
    fn = internals.kernel_function(fn)  # 5.25: a `Func` module calling the function
    w = internals.hub.wrapper(fn)
    if w is not None:
        impl, ref = w.implementation, w.torch_function
        if impl is ref or not callable(impl):
            tried = (w.package, w.func_name) if w.package is not None and w.func_name is not None else None
            return Backend(fn, ref, None, "", tried)
        name = w.func_name or getattr(impl, "__name__", "implementation")
        label = f"{w.package} {name}" if w.package is not None else _where(impl)
        compiled = internals.hub.direct(w)  # not through the wrapper: 5.25's sends a CPU's inputs to torch
        if (w.package, name) == ("fla", "chunk_gated_delta_rule") and flash_qla_version():
            return Backend(fn, ref, _without_flash_qla(compiled), label, handoff=FLASH_QLA)
        return Backend(fn, ref, compiled, label)
    inner = _innermost(fn)
    if inner is fn:
        if _is_transformers_torch(fn):
            return Backend(fn, fn, None, "")
        return Backend(fn, None, fn, _where(fn))  # compiled code with no reference
    if _is_transformers_torch(inner):
        return Backend(fn, inner, fn, f"{_where(fn)} (a wrapper of unknown form)")
    return Backend(fn, None, fn, _where(fn))


def _innermost(fn: Any) -> Any:
    seen = 0
    while hasattr(fn, "__wrapped__") and seen < 16:
        fn = fn.__wrapped__
        seen += 1
    return fn


def _is_transformers_torch(fn: Any) -> bool:
    return (getattr(fn, "__module__", "") or "").startswith("transformers.") and hasattr(fn, "__code__")


def _where(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


FLASH_QLA = "FlashQLA"
FLASH_QLA_ENV = "FLA_FLASH_QLA"
_DISTRIBUTIONS = {"fla": "flash-linear-attention", "flash_qla": "flash-qla", "mamba_ssm": "mamba-ssm",
                  "causal_conv1d": "causal-conv1d"}
_PROBES: dict[tuple[str, str], str] = {}  # (package, function) -> why its import failed


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, None if it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def flash_qla_version() -> str | None:
    """FlashQLA's version where FLA would find it (FLA looks for the module `flash_qla`), else None."""
    try:
        found = importlib.util.find_spec("flash_qla") is not None
    except (ImportError, ValueError):
        found = False
    return (installed_version(_DISTRIBUTIONS["flash_qla"]) or "(version unknown)") if found else None


def flash_qla_on() -> bool:
    """Whether FLA would hand `chunk_gated_delta_rule` calls to FlashQLA (where the GPU and inputs suit it)."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":  # FLA's switch for every handoff
        return False
    return os.environ.get(FLASH_QLA_ENV, "1") != "0" and flash_qla_version() is not None


def _without_flash_qla(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (FLA's chunk kernel bound by transformers) with FLA's handoff to FlashQLA off for each call.

    FLA reads `FLA_FLASH_QLA` at every call; it is set to "0" for the call and put back after.
    """
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        before = os.environ.get(FLASH_QLA_ENV)
        os.environ[FLASH_QLA_ENV] = "0"
        try:
            return fn(*args, **kwargs)
        finally:
            if before is None:
                os.environ.pop(FLASH_QLA_ENV, None)
            else:
                os.environ[FLASH_QLA_ENV] = before

    return run


def note(b: Backend) -> str:
    """What `describe` leaves out, in one line: a package installed but not bound, or FLA's FlashQLA handoff."""
    if b.handoff == FLASH_QLA and flash_qla_on():
        return (f"FlashQLA {flash_qla_version()} is installed: FLA hands chunk_gated_delta_rule to it on SM90+ "
                f"GPUs (bf16/fp16, K = V = 128); deltalang's calls run FLA's Triton kernel instead "
                f"({FLASH_QLA_ENV}=0 for each call: docs/gpu.md)")
    return not_bound(b)


def not_bound(b: Backend) -> str:
    """One line where the package transformers tried is installed but not bound (its import error), else ""."""
    if b.compiled is not None or b.tried is None:
        return ""
    package, func = b.tried
    dist = _DISTRIBUTIONS.get(package, package.replace("_", "-"))
    version = installed_version(dist)
    if version is None:
        return ""
    if b.tried not in _PROBES:
        _PROBES[b.tried] = _import_error(package, func)
    return f"{dist} {version} is installed but not bound: {_PROBES[b.tried]}; transformers runs its torch kernels"


def _import_error(package: str, func: str) -> str:
    """Import `func` as transformers does (the package, then its internal module); why it fails, in words."""
    internal = internals.hub.internal_path(func)
    module = f"{package}.{internal}" if internal else package
    try:
        found = getattr(importlib.import_module(module), func, None)
    except Exception as e:  # noqa: BLE001  (whatever the import raises is the answer)
        text = str(e).strip().splitlines()
        line = f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__
        triton = installed_version("triton")
        return f"{line} ({f'triton {triton}' if triton else 'triton is not installed'})"
    if found is None:
        return f"{module} has no {func}"
    return f"{module} imports now, but did not when transformers imported the model's code (restart the process)"


def mode() -> str:
    """The process-wide implementation mode (`auto`, `reference` or `compiled`)."""
    return _MODE[0]


def set_mode(new: str) -> None:
    """Set the process-wide implementation mode (see the module docstring)."""
    if new not in MODES:
        raise DeltaValueError(f"unknown kernel mode {new!r}; one of {', '.join(MODES)}")
    _MODE[0] = new


@contextmanager
def using(new: str) -> Iterator[None]:
    """The implementation mode for a `with` block; the mode before it is restored after."""
    before = _MODE[0]
    set_mode(new)
    try:
        yield
    finally:
        _MODE[0] = before


def device_of(args: tuple, kwargs: dict) -> torch.device | None:
    """The device of a kernel call: that of its first tensor argument."""
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            return x.device
    return None


def per_sequence(fn: Callable[..., Any], cu_seqlens: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                 **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A delta-rule kernel over packed sequences, one call per sequence, as FLA does with `cu_seqlens`.

    Inputs `[1, total, heads, d]`; `initial_state` `[n, heads, dk, dv]` (one per sequence) or None;
    the final states come back `[n, heads, dk, dv]`.
    """
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if query.shape[0] != 1 or bounds[0] != 0 or bounds[-1] != query.shape[1] or bounds != sorted(bounds):
        raise DeltaValueError(f"cu_seqlens {bounds} does not pack a batch of one row of {query.shape[1]} tokens")
    n = len(bounds) - 1
    if initial_state is not None and initial_state.shape[0] != n:
        raise DeltaValueError(f"cu_seqlens packs {n} sequences but initial_state has {initial_state.shape[0]}")
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        start = initial_state[i:i + 1] if initial_state is not None else None
        if a == b:  # an empty sequence: no output, its state unchanged
            shape = (1, value.shape[2], key.shape[3], value.shape[3])
            finals.append(start if start is not None else query.new_zeros(shape, dtype=torch.float32))
            continue
        out, final = fn(query[:, a:b], key[:, a:b], value[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                        initial_state=start, output_final_state=True, **kw)
        outs.append(out)
        finals.append(final)
    out = torch.cat(outs, dim=1) if outs else value.new_zeros(value.shape)
    return out, (torch.cat(finals, dim=0) if output_final_state else None)


def conv_per_sequence(fn: Callable[..., Any], cu_seqlens: torch.Tensor, hidden_states: torch.Tensor,
                      *args: Any, **kw: Any) -> torch.Tensor:
    """A prompt's short convolution over packed sequences (`[1, channels, total]`), one call per sequence."""
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if hidden_states.shape[0] != 1 or bounds[0] != 0 or bounds[-1] != hidden_states.shape[-1]:
        raise DeltaValueError(f"cu_seqlens {bounds} does not pack a batch of one row of "
                              f"{hidden_states.shape[-1]} tokens")
    parts = [fn(hidden_states[..., a:b], *args, **kw) for a, b in zip(bounds, bounds[1:]) if b > a]
    return torch.cat(parts, dim=-1)
