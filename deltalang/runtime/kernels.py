"""The delta-rule kernels under the values: dispatch, routing, the site registry.

`install(family)` rebinds the kernel globals of a family's modeling module (its prompt and decode
kernels, its conv and conv-update functions: the names its hub decorators give, `families.Family`)
to thin dispatchers; `uninstall(family)` puts back exactly what transformers bound. A dispatcher calls the
bound function at once unless a running mixer's `Site` (`current_site()`, entered by the mixer's forward;
known only through the `Site` protocol, so `mixer` is never imported) asks for values: then the site
serves the call. The function called is chosen per call by device (`backends`). `route_kernels` and
`routed(family, route)` change a table the dispatchers read (a `with` block restores the route before it).
Packed sequences are never merged: passed to FLA as they are, refused on the torch kernels
(`PackedSequencesError`) and in a trace that asks for values. `deltarule`'s names are re-exported.
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Protocol

import torch

from deltalang.ground.errors import DeltaValueError
from deltalang.models import families, internals

from . import backends
from .deltarule import CHUNK, per_token, per_token_loop, prepare, read_state


class PackedSequencesError(DeltaValueError, ValueError):
    """Packed sequences deltalang cannot keep apart exactly (a `ValueError`, as transformers' refusal is)."""


ROUTES = ("default", "torch")

# family name -> {global name: what transformers bound at import (5.25: a `Func` module), put back by `uninstall`}
_BOUND: dict[str, dict[str, Any]] = {}
# family name -> {global name: the function that runs (`internals.kernel_function` of what was bound)}
_ORIGINALS: dict[str, dict[str, Callable[..., Any]]] = {}
# family name -> {global name: what that function runs (`deltalang.runtime.backends`)}
_BACKENDS: dict[str, dict[str, backends.Backend]] = {}
# family name -> "default" | "torch"
_ROUTE: dict[str, str] = {}


# --------------------------------------------------------------------------
# The site registry: the stack of running mixers, which the dispatchers ask.
# --------------------------------------------------------------------------


class Site(Protocol):
    """The model side of one running mixer, as the dispatchers see it (`deltalang.runtime.mixer.MixerSite`)."""

    layer: int

    def active(self) -> bool:
        """Whether the running trace waits on one of this mixer's values (else the kernel runs as is)."""

    def kernel(self, fn: Callable[..., Any], decode: bool, *args: Any, **kwargs: Any) -> Any:
        """Run one delta-rule call through `fn`, serving the values asked for."""

    def conv(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a prompt's short convolution through `fn`, serving the windows asked for."""

    def conv_update(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a decode step's convolution through `fn`, serving the windows asked for."""

    def ended(self) -> None:
        """The call has left the stack (by its exit hook, or unwound after an exception)."""


_STACK: list[Site] = []


def current_site() -> Site | None:
    """The DeltaNet mixer whose forward is running now, if any."""
    return _STACK[-1] if _STACK else None


def enter(site: Site) -> int:
    """Put a starting call on the stack of running mixers; return where it entered (for `unwind`)."""
    depth = len(_STACK)
    _STACK.append(site)
    return depth


def unwind(depth: int) -> None:
    """Drop the calls from `depth` up: they have ended, by their exit hook or by an exception."""
    for site in _STACK[depth:]:
        site.ended()
    del _STACK[depth:]


@contextmanager
def unwinding() -> Iterator[None]:
    """Leave the stack of running mixers as it was, however what runs inside ends."""
    depth = len(_STACK)
    try:
        yield
    finally:
        unwind(depth)


def _kernel_names(fam: families.Family) -> tuple[str, str, str, str]:
    return (fam.chunk_kernel, fam.recurrent_kernel, fam.conv_fn, fam.conv_update)


def original(fam: families.Family, name: str) -> Callable[..., Any]:
    """The function a family's modeling module runs under `name` as transformers bound it at import."""
    install(fam)
    return _ORIGINALS[fam.name][name]


def bound(fam: families.Family, name: str) -> Any:
    """What a family's modeling module held under `name` at import, as it was (5.25: a `Func` module
    calling `original(fam, name)`): what `uninstall` puts back."""
    install(fam)
    return _BOUND[fam.name][name]


# by the function itself, weakly: an address is reused once its function is freed
_SOURCE: "weakref.WeakKeyDictionary[Callable[..., Any], bool]" = weakref.WeakKeyDictionary()


def has_python_source(fn: Callable[..., Any], family_module: str = "") -> bool:
    """Whether `fn` is transformers' pure-torch kernel (not a compiled one without source): defined in
    transformers, or in the family's own modeling module (one registered from outside transformers)."""
    try:
        return _SOURCE[fn]
    except (KeyError, TypeError):  # TypeError: not weakly referable (a builtin), not cached
        pass
    mod = getattr(fn, "__module__", "") or ""
    ok = mod.startswith("transformers.") or (bool(family_module) and mod == family_module)
    if ok:
        try:
            inspect.getsource(fn)
        except (OSError, TypeError):
            ok = False
    try:
        _SOURCE[fn] = ok
    except TypeError:
        pass
    return ok


def backend(fam: families.Family, name: str) -> backends.Backend:
    """What the kernel global `name` of `fam` runs: its torch reference and compiled implementation."""
    install(fam)
    return _BACKENDS[fam.name][name]


def chosen(fam: families.Family, name: str, device: torch.device | str | None) -> Callable[..., Any]:
    """The function a call of kernel `name` on `device` runs (`backends.Backend.pick`), or a DeltaError."""
    fn = backend(fam, name).pick(device)
    if fn is None:
        raise DeltaValueError(f"{name} -> {backend(fam, name).name} has no torch reference to run on {device}")
    return fn


def compiled_message(fam: families.Family, name: str) -> str:
    fn = _ORIGINALS[fam.name][name]
    where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    return (f"compiled kernel has no Python source: {name} -> {where}; call "
            f"deltalang.route_kernels(model.family, 'torch') (or uninstall flash-linear-attention / causal-conv1d)")


def compiled_kernels(fam: families.Family) -> dict[str, str]:
    """Kernel names of `fam` that are bound to compiled code, with where they come from."""
    install(fam)
    out = {}
    for name in _kernel_names(fam):
        fn = _ORIGINALS[fam.name][name]
        if not has_python_source(fn, fam.module_name):
            out[name] = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    return out


def install(fam: families.Family) -> None:
    """Put the dispatchers in place of `fam`'s kernel globals (once per process)."""
    if fam.name in _ORIGINALS:
        return
    module = fam.module
    bound = {name: _unwrapped(getattr(module, name)) for name in _kernel_names(fam)}
    _BOUND[fam.name] = bound
    originals = {name: internals.kernel_function(fn) for name, fn in bound.items()}
    _ORIGINALS[fam.name] = originals
    _BACKENDS[fam.name] = {name: backends.of(fn) for name, fn in originals.items()}
    _ROUTE.setdefault(fam.name, "default")
    for which, name in zip(("chunk", "recurrent", "conv", "conv_update"), _kernel_names(fam)):
        dispatch = _make_dispatch(fam, which, originals[name])
        dispatch.__bound_kernel__ = bound[name]  # type: ignore[attr-defined]
        setattr(module, name, dispatch)


def _unwrapped(fn: Any) -> Any:
    """What transformers bound under a deltalang dispatcher (one of an earlier copy of this module), else `fn`."""
    while hasattr(fn, "__wrapped_kernel__"):
        fn = getattr(fn, "__bound_kernel__", fn.__wrapped_kernel__)
    return fn


def uninstall(fam: families.Family) -> None:
    """Put back exactly the functions transformers bound at import."""
    _ORIGINALS.pop(fam.name, None)
    _BACKENDS.pop(fam.name, None)
    bound = _BOUND.pop(fam.name, None)
    if bound is None:
        return
    for name, fn in bound.items():
        setattr(fam.module, name, fn)


def route_kernels(family: Any, route: str = "torch") -> None:
    """Route a family's prompt kernel: `"torch"` = token by token, `"default"` = chunked.

    Process-wide, like installing a kernel package, and for every model of the
    family. Works before or after a model was traced. `"default"` restores the
    import-time routing exactly: the dispatcher then calls the very functions
    transformers bound. `routed(family, route)` routes for a `with` block only.
    """
    fam = _routable(family, route)
    _ROUTE[fam.name] = route


@contextmanager
def routed(family: Any, route: str) -> Iterator[None]:
    """Route a family's prompt kernel for a `with` block, then restore the route in force before it.

    `with deltalang.routed(model.family, "torch"): ...` is what a program's
    `route torch` runs as; blocks nest, and an exception restores the route too.
    """
    fam = _routable(family, route)
    before = _ROUTE[fam.name]
    _ROUTE[fam.name] = route
    try:
        yield
    finally:
        _ROUTE[fam.name] = before


def _routable(family: Any, route: str) -> families.Family:
    if route not in ROUTES:
        raise DeltaValueError(f"unknown route {route!r}; one of {', '.join(ROUTES)}")
    fam = families.resolve(family)
    if route == "torch" and fam.block_kind == families.SSM_KIND:
        raise DeltaValueError(f"route torch is the delta rule's token-by-token kernel; {fam.name}'s Mamba-2 "
                              f"scan runs transformers' own torch scan on a CPU already")
    install(fam)
    return fam


def current_route(family: Any) -> str:
    return _ROUTE.get(families.resolve(family).name, "default")


def prompt_kernel(fam: families.Family, device: torch.device | str | None = None) -> Callable[..., Any]:
    """The kernel a prompt on `device` runs through under the current route (None: the bound one)."""
    install(fam)
    if _ROUTE[fam.name] == "torch":
        return token_by_token(fam)
    if device is None:
        return _ORIGINALS[fam.name][fam.chunk_kernel]
    return chosen(fam, fam.chunk_kernel, device)


_TOKEN_KERNELS: dict[str, Callable[..., Any]] = {}


def token_by_token(fam: families.Family) -> Callable[..., Any]:
    """`per_token` with the signature of transformers' kernels: the routed prompt kernel."""
    if fam.name not in _TOKEN_KERNELS:
        def kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                   output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                   **_: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            out, final = per_token(fam, query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel,
                                   final_state=True)
            return out, (final if output_final_state else None)

        kernel.__name__ = f"deltalang_token_by_token_{fam.name}"
        _TOKEN_KERNELS[fam.name] = kernel
    return _TOKEN_KERNELS[fam.name]


def _make_dispatch(fam: families.Family, which: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    name = {"chunk": fam.chunk_kernel, "recurrent": fam.recurrent_kernel, "conv": fam.conv_fn,
            "conv_update": fam.conv_update}[which]
    impl = _BACKENDS[fam.name][name]

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        site = current_site()
        device = backends.device_of(args, kwargs)
        if which == "chunk":
            if site is not None and site.active():
                return site.kernel(prompt_kernel(fam, device), False, *args, **kwargs)
            if _ROUTE[fam.name] == "torch":
                kwargs.pop("chunk_size", None)
                return _packed(token_by_token(fam), impl, args, kwargs)
            return _packed(chosen(fam, name, device), impl, args, kwargs)
        run = chosen(fam, name, device)
        if which == "recurrent":
            if site is not None and site.active():
                return site.kernel(run, True, *args, **kwargs)
            return _packed(run, impl, args, kwargs)
        if which == "conv":
            cu = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seqlens"))
            if site is not None and site.active():
                if cu is not None and len(cu) > 2:
                    raise DeltaValueError(f"L{site.layer}: {_NOT_SERVED}")
                return site.conv(run, *args, **kwargs)
            if cu is not None:  # no conv implementation keeps packed sequences apart: one call each
                return _conv_packed(run, cu, args, kwargs)
            return run(*args, **kwargs)
        if site is not None and site.active():
            return site.conv_update(run, *args, **kwargs)
        return run(*args, **kwargs)

    def guarded(*args: Any, **kwargs: Any) -> Any:  # fn is compiled code: see below
        site = current_site()
        if site is not None and site.active() and which != "recurrent":
            if which != "chunk" or _ROUTE[fam.name] != "torch":
                name = fam.chunk_kernel if which == "chunk" else (fam.conv_fn if which == "conv" else fam.conv_update)
                raise DeltaValueError(f"L{site.layer}: {compiled_message(fam, name)}")
        return dispatch(*args, **kwargs)

    # the common case, a kernel with Python source, pays for no check
    out = dispatch if has_python_source(fn, fam.module_name) else guarded
    out.__name__ = getattr(fn, "__name__", which)
    out.__qualname__ = f"deltalang_dispatch.{out.__name__}"
    out.__wrapped_kernel__ = fn  # type: ignore[attr-defined]
    return out


_NOT_SERVED = ("packed sequences (cu_seqlens) are run, not served: a trace that reads or writes a "
               "DeltaNet value needs them as a padded batch (one row per sequence)")


def _refused(n: int, why: str) -> PackedSequencesError:
    return PackedSequencesError(f"{n} packed sequences (cu_seqlens) in one row {why}; pad them into a batch "
                                f"(one row per sequence)")


def _packed(run: Callable[..., Any], impl: backends.Backend, args: tuple, kwargs: dict) -> Any:
    """Call a delta-rule kernel; packed sequences (`cu_seqlens`) reach FLA as they are, else are refused.

    transformers' torch kernels refuse several packed sequences (Kimi's forward passes them on as
    `cu_seq_lens_q`, which its wrapper drops: merged); so does deltalang, for the reason in the module
    docstring. A single one (`[0, n]`) keeps nothing apart and runs as the plain call.
    """
    cu = kwargs.get("cu_seqlens")
    if cu is None:  # Kimi's forward passes the model's `cu_seq_lens_q` on as it is
        cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return run(*args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("cu_seqlens", "cu_seq_lens_q")}
    if run is impl.compiled and impl.reference is not None:  # FLA keeps the sequences apart itself
        return run(*args, cu_seqlens=cu, **kwargs)
    if len(cu) > 2:
        raise _refused(len(cu) - 1, "on transformers' torch kernels: refused, as transformers refuses them "
                                    "(run one by one, the rest of the model would still merge them: its "
                                    "attention with a cache, n-gram embeddings)")
    return backends.per_sequence(run, cu, *args, **kwargs)


def _conv_packed(run: Callable[..., Any], cu: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    """A prompt's convolution over packed sequences: one call each; refused behind a cached window."""
    hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
    if len(cu) <= 2:  # one sequence: nothing to keep apart (a cached window in front continues it)
        return run(*args, **kwargs)
    if isinstance(hidden, torch.Tensor) and hidden.shape[-1] > int(cu[-1]):
        raise _refused(len(cu) - 1, "cannot continue a cache (its convolution window is one row's)")
    return backends.conv_per_sequence(run, cu, *args, **kwargs)
