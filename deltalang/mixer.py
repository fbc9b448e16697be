"""Serving the DeltaNet values: the model side (`MixerSite`) and the user side (`DeltaNetEnvoy`).

nnsight runs a trace body as a worker that parks on a *location* string until
the model reaches it. A module's `.output` is one such location; the values of
DESIGN section 1 are more: each is `"{mixer path}.{value}"`, and
`state_after(t)` is `"{mixer path}.state_after.{t}"`.

The model side serves them from inside the kernel call (see
`deltalang.kernels`): the kernel's inputs are the queries, keys, values,
decays and betas; its initial state is `state_input`; its outputs are the head
outputs and `state_output`. Per-position states are served lazily: before
running the prompt, the site looks at which `state_after` positions a worker is
parked on, runs the chunked kernel up to the first, serves (and maybe replaces)
the state there, looks again, and continues with `initial_state` from it. Only
the positions an experiment asks for are ever materialised, and the work is the
chunked kernel's.

Steps: nnsight counts a location's visits. A value here is visited once per
call of the mixer, so its visit count is the generation step: step 0 is the
prompt, step k the k-th new token, whichever kernel ran.

Several wrappers, one module: a `MixerSite` belongs to the transformers module
(one per mixer, however often the model is wrapped) and knows every wrapper that
bound it, weakly. Each call serves the wrapper whose trace is interleaving when
the call begins; a dropped wrapper is not kept alive.

The stack of running mixers (`current_site`) is process-wide. A call's exit
hook (torch calls it even when the forward raises an `Exception`) unwinds the
stack to where the call began, nested calls included. A `BaseException`
(KeyboardInterrupt) skips torch's exit hooks: a traced forward is unwound by
`unwinding()` around it (`DeltaModel.interleave`), a plain forward the next
time the interrupted mixer runs (a mixer never runs inside its own forward).
"""

from __future__ import annotations

import re
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.nn.functional as F
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.interleaver import Event, Interleaver, Mediator

from . import kernels, values
from .errors import DeltaValueError

if TYPE_CHECKING:
    from .families import Family

_STACK: list["MixerSite"] = []
DIRECT = "!direct"  # names of positions written through `MixerSite.direct`, without a trace
# the values this module serves from inside the kernel call (the others are nnsight's own)
SERVED = frozenset(name for name, v in values.CATALOGUE.items() if v.kernel) | {"states_as_run"}
_POSITION = re.compile(r"\.(state_after|conv_window_after)\.(-?\d+)(?:@(\d+))?$")


def current_site() -> "MixerSite | None":
    """The DeltaNet mixer whose forward is running now, if any."""
    return _STACK[-1] if _STACK else None


def _unwind(depth: int) -> None:
    """Drop the calls from `depth` up: they have ended, by their exit hook or by an exception."""
    for site in _STACK[depth:]:
        site._ended()
    del _STACK[depth:]


@contextmanager
def unwinding() -> Iterator[None]:
    """Leave the stack of running mixers as it was, however what runs inside ends."""
    depth = len(_STACK)
    try:
        yield
    finally:
        _unwind(depth)


class MixerSite:
    """The model side of one DeltaNet mixer: hooks, and the values it serves."""

    def __init__(self, module: torch.nn.Module, family: "Family", layer: int, dims: dict[str, int]) -> None:
        self.module = module
        self.family = family
        self.layer = layer
        self.dims = dims
        # every wrapper that bound this mixer: (its interleaver, weakly; the envoy path it uses)
        self._routes: list[tuple[weakref.ref[Interleaver], str]] = []
        # the wrapper the running call serves (None between calls)
        self.interleaver: Interleaver | None = None
        self.path = ""
        self._depth: int | None = None  # where the running call entered the stack
        self.pads: list[int] | None = None  # per row, left padding of this call
        self.seq_len = 0
        self.cache: Any = None
        self.running = False
        # writes applied without a trace (the sweep engine): (value kind, absolute position) ->
        # (rows of the batch, the value for those rows)
        self.direct: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._hooks = [
            module.register_forward_pre_hook(self._enter, with_kwargs=True),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def bind(self, interleaver: Interleaver, path: str) -> None:
        """Serve a wrapper's traces too (weakly: a dropped wrapper drops out)."""
        self._routes = [r for r in self._routes if r[0]() not in (None, interleaver)]
        self._routes.append((weakref.ref(interleaver), path))

    def _route(self) -> tuple[Interleaver | None, str]:
        """The bound wrapper whose trace is interleaving now, if any."""
        for ref, path in self._routes:
            il = ref()
            if il is not None and il.interleaving:
                return il, path
        return None, ""

    # -- hooks ---------------------------------------------------------------

    def _enter(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._depth is not None:  # left by a forward that ended in a BaseException
            _unwind(self._depth)
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        self.seq_len = int(hidden.shape[1]) if hidden is not None else 0
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == self.seq_len:
            self.pads = [int(x) for x in (mask.shape[1] - mask.to(torch.long).sum(dim=1)).tolist()]
        else:
            self.pads = None
        self.cache = kwargs.get("cache", kwargs.get("cache_params", kwargs.get("past_key_values")))
        self.interleaver, self.path = self._route()
        self.running = True
        self._depth = len(_STACK)
        _STACK.append(self)

    def _exit(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._depth is not None:
            _unwind(self._depth)

    def _ended(self) -> None:
        self.running = False
        self._depth = None
        self.interleaver = None  # neither a wrapper nor a cache is held between calls
        self.cache = None

    # -- what is asked for -----------------------------------------------------

    def active(self) -> bool:
        """Whether some worker of the running trace waits on one of this mixer's values."""
        if self.direct:
            return True
        il = self.interleaver
        if il is None or not il.interleaving or not il.parked:
            return False
        prefix = self.path + "."
        n = len(prefix)
        return any(p.startswith(prefix) and p[n:].split(".", 1)[0].split("@", 1)[0] in SERVED for p in il.parked)

    def _mediators(self) -> list[Mediator]:
        return [] if self.interleaver is None else self.interleaver.mediators

    def step(self) -> int:
        """Which call of this mixer in the running trace this is: the generation step."""
        loc = self.path + ".input"
        il = self.interleaver
        if il is None or not il.interleaving:
            return 0
        for m in self._mediators():
            return il.counts.get(loc, 0) - m.counts_at_start.get(loc, 0) - 1
        return 0

    def _parked_on(self, loc: str) -> list[Mediator]:
        return [m for m in self._mediators() if m.pending is not None and m.pending.provider == loc]

    def serve(self, name: str, value: Any, step: int) -> Any:
        """Hand `value` to the workers waiting on this mixer's `name` at `step`; return it, maybe replaced."""
        if name.endswith(DIRECT):
            return self._apply_direct(name, value)
        il = self.interleaver
        loc = f"{self.path}.{name}"
        if il is None or loc not in il.parked:
            return value
        waiting = self._parked_on(loc)
        if not waiting:
            return value
        il.counts[loc] = waiting[0].counts_at_start.get(loc, 0) + step
        return il.handle(loc, value)

    def wants(self, name: str) -> bool:
        il = self.interleaver
        return il is not None and f"{self.path}.{name}" in il.parked

    def positions(self, kind: str, step: int, offset: int = 0) -> dict[int, list[str]]:
        """Absolute positions (in this call's padded rows) that workers wait on for `kind`, with their names."""
        il = self.interleaver
        out: dict[int, list[str]] = {}
        for (k, pos), _ in self.direct.items():
            if k == kind:
                out.setdefault(pos + offset, []).append(f"{kind}.{pos}{DIRECT}")
        if il is None or not il.interleaving:
            return out
        prefix = self.path
        for m in self._mediators():
            p = m.pending
            if p is None or p.provider is None or not p.provider.startswith(prefix):
                continue
            match = _POSITION.search(p.provider)
            if match is None or match.group(1) != kind or p.provider[: match.start()] != prefix:
                continue
            if p.iteration != step:
                continue
            t = int(match.group(2))
            row = int(match.group(3)) if match.group(3) is not None else 0
            pad = self.pads[row] if self.pads else 0
            n = self.seq_len - pad
            pos = t + n if t < 0 else t
            if not 0 <= pos < n:
                raise DeltaValueError(
                    f"L{self.layer}.{kind}({t}): position out of range: this call has {n} token(s)"
                    + (f" at step {step}" if step else ""))
            out.setdefault(pad + pos + offset, []).append(f"{kind}.{match.group(2)}" + (
                f"@{match.group(3)}" if match.group(3) is not None else ""))
        return out

    def _names_at(self, kind: str, step: int, p: int, offset: int = 0) -> Iterator[str]:
        """The requests waiting at position p, including those a served worker makes next."""
        served: set[str] = set()
        while True:
            fresh = [n for n in self.positions(kind, step, offset).get(p, []) if n not in served]
            if not fresh:
                return
            for name in fresh:
                served.add(name)
                yield name

    def _apply_direct(self, name: str, value: torch.Tensor) -> torch.Tensor:
        kind, pos = name[: -len(DIRECT)].rsplit(".", 1)
        rows, new = self.direct[(kind, int(pos))]
        out = value.clone()
        out[rows] = new.to(device=out.device, dtype=out.dtype)
        return out

    # -- the kernel ------------------------------------------------------------

    def kernel(self, fn: Callable[..., Any], decode: bool, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, g: torch.Tensor | None = None, beta: torch.Tensor | None = None,
               **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one delta-rule call, serving every value workers wait on."""
        step = self.step()
        kw.pop("chunk_size", None)
        initial = kw.pop("initial_state", None)
        want_final = bool(kw.pop("output_final_state", False))
        l2 = bool(kw.pop("use_qk_l2norm_in_kernel", False))
        kw.pop("cu_seqlens", None)
        query = self.serve("attention_queries", query, step)
        key = self.serve("attention_keys", key, step)
        value = self.serve("attention_values", value, step)
        g = self.serve("decays", g, step)
        beta = self.serve("betas", beta, step)
        self._check_shapes(query, key, value, g, beta)
        served_in = initial.clone() if initial is not None else None
        if served_in is None and self._writes("state_input"):
            served_in = torch.zeros(self._state_shape(value), dtype=torch.float32, device=value.device)
        new_in = self.serve("state_input", served_in, step)
        if new_in is not served_in:
            initial = self._checked_state(new_in, value, "state_input")
        elif served_in is not None and initial is None:
            initial = served_in

        def run(a: int, b: int, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            out, final = fn(query[:, a:b], key[:, a:b], value[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=l2)
            return out, final

        s = query.shape[1]
        if self.wants("states"):
            # every position: the token-by-token kernel, once; segments before any write are
            # slices of it, so `states` and `state_after(t)` agree bit for bit
            token_fn = kernels.token_by_token(self.family)
            full, states = kernels.per_token(self.family, query, key, value, g, beta, initial, l2)
            self.serve("states", states, step)  # read-only: a write is refused on the user side
            clean = [initial]

            def run(a: int, b: int, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
                if state is clean[-1]:
                    clean.append(states[:, b - 1])
                    return full[:, a:b], clean[-1]
                out, final = token_fn(query[:, a:b], key[:, a:b], value[:, a:b], g=g[:, a:b],
                                      beta=beta[:, a:b], initial_state=state, output_final_state=True,
                                      use_qk_l2norm_in_kernel=l2)
                return out, final

        pieces, state = self._split(run, s, initial, step, query, l2)
        if self.wants("states_as_run"):
            # the state after every token of the forward as it ran, the writes at positions applied
            parts = [kernels.per_token(self.family, query[:, a:b], key[:, a:b], value[:, a:b], g[:, a:b],
                                       beta[:, a:b], start, l2)[1] for a, b, start in self.segments]
            as_run = torch.cat(parts, dim=1)
            for (_, end, _), (_, _, start) in zip(self.segments, self.segments[1:]):
                as_run[:, end - 1] = start  # a segment ends at a split position: the state there as written
            self.serve("states_as_run", as_run, step)
        out = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
        out = self.serve("attention_head_outputs", out, step)
        final = self.serve("state_output", state, step)
        if final is not state:
            final = self._checked_state(final, value, "state_output")
        return out, (final if want_final else None)

    def _split(self, run: Callable[..., tuple[torch.Tensor, torch.Tensor]], s: int,
               initial: torch.Tensor | None, step: int, query: torch.Tensor,
               l2: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Run [0, s) in segments ending at each asked-for position, serving the state there."""
        pieces: list[torch.Tensor] = []
        pos, state = 0, initial
        self.segments: list[tuple[int, int, torch.Tensor | None]] = []
        while True:
            asked = self.positions("state_after", step)
            later = sorted(p for p in asked if p >= pos)
            if not later:
                self.segments.append((pos, s, state))
                out, state = run(pos, s, state)
                pieces.append(out)
                return pieces, state
            p = later[0]
            self.segments.append((pos, p + 1, state))
            out, state = run(pos, p + 1, state)
            for name in self._names_at("state_after", step, p):
                new = self.serve(name, state, step)
                if new is not state:
                    state = self._checked_state(new, query, "state_after")
                    # token p reads the state it has just written
                    out = out.clone()
                    out[:, -1] = kernels.read_state(self.family, query[:, p], state, out.shape[2], l2)
            pieces.append(out)
            pos = p + 1
            if pos >= s:
                return pieces, state

    # -- the convolution -------------------------------------------------------

    def conv(self, fn: Callable[..., Any], hidden_states: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None, activation: str | None = None, **kw: Any) -> torch.Tensor:
        """A prompt's short convolution, serving `conv_window_after(t)`."""
        out = fn(hidden_states, weight, bias, activation=activation, **kw)
        step = self.step()
        offset = hidden_states.shape[-1] - self.seq_len  # columns of a cached window in front
        width = weight.shape[-1]
        asked = self.positions("conv_window_after", step, offset)
        done: set[int] = set()
        x = hidden_states
        while asked:
            later = sorted(p for p in asked if p not in done)
            if not later:
                break
            p = later[0]
            window = _window(x, p, width)
            for name in self._names_at("conv_window_after", step, p, offset):
                new = self.serve(name, window, step)
                if new is not window:
                    new = self._checked_window(new, window)
                    out = self._rewindow(fn, x, out, p, new, weight, bias, activation, kw)
                    x = x.clone()
                    lo = p - (width - 1) + 1
                    cols = new[..., max(0, -lo):]
                    x[:, :, max(0, lo):p + 1] = cols.to(x.dtype)
                    window = new
            done.add(p)
            asked = self.positions("conv_window_after", step, offset)
        if x is not hidden_states and self.cache is not None:
            self._store_conv_cache(x, width)
        return out

    def conv_update(self, fn: Callable[..., Any], hidden_states: torch.Tensor, conv_state: torch.Tensor,
                    weight: torch.Tensor, bias: torch.Tensor | None = None,
                    activation: str | None = None, **kw: Any) -> torch.Tensor:
        """A decode step's convolution; the window after its token is the cache's tail."""
        out = fn(hidden_states, conv_state, weight, bias, activation, **kw)
        step = self.step()
        width = weight.shape[-1]
        asked = self.positions("conv_window_after", step)
        for p in list(asked):
            window = conv_state[:, :, -(width - 1):].clone()
            for name in self._names_at("conv_window_after", step, p):
                new = self.serve(name, window, step)
                if new is not window:
                    conv_state[:, :, -(width - 1):] = self._checked_window(new, window).to(conv_state.dtype)
        return out

    def _rewindow(self, fn: Callable[..., Any], x: torch.Tensor, out: torch.Tensor, p: int, window: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                  kw: dict) -> torch.Tensor:
        """Recompute the convolution outputs after position p, seeing `window` as the tokens up to p."""
        width = weight.shape[-1]
        if p + 1 >= x.shape[-1]:
            return out
        tail = torch.cat([window.to(x.dtype), x[:, :, p + 1:]], dim=-1)
        y = F.conv1d(tail.to(weight.dtype), weight.unsqueeze(1), bias, padding=0, groups=x.shape[1])
        if activation is not None:
            from transformers.activations import ACT2FN

            y = ACT2FN[activation](y)
        out = out.clone()
        out[:, :, p + 1:] = y.to(out.dtype)
        return out

    def _store_conv_cache(self, x: torch.Tensor, width: int) -> None:
        try:
            buf = self.cache.get_conv_state(self.layer)
        except (AttributeError, ValueError):
            return
        if buf is None:
            return
        tail = x[:, :, -width:]
        if tail.shape[-1] < width:
            tail = F.pad(tail, (width - tail.shape[-1], 0))
        buf.copy_(tail.to(buf.dtype))

    # -- checks ----------------------------------------------------------------

    def _writes(self, name: str) -> bool:
        loc = f"{self.path}.{name}"
        return any(m.pending.event is Event.SWAP for m in self._parked_on(loc))

    def _state_shape(self, value: torch.Tensor) -> tuple[int, ...]:
        return (value.shape[0], self.dims["heads"], self.dims["key_dim"], self.dims["value_dim"])

    def _checked_state(self, new: Any, like: torch.Tensor, name: str) -> torch.Tensor:
        shape = self._state_shape(like)
        if not isinstance(new, torch.Tensor):
            raise DeltaValueError(f"L{self.layer}.{name}: a write must be a tensor, got {type(new).__name__}")
        if tuple(new.shape) != shape:
            if new.dim() == 3 and tuple(new.shape) == shape[1:]:
                new = new.unsqueeze(0).expand(shape)
            else:
                raise DeltaValueError(
                    f"L{self.layer}.{name}: a write of shape {list(new.shape)} does not fit {list(shape)} "
                    f"[batch, heads, key_dim, value_dim]")
        if not new.is_floating_point():
            raise DeltaValueError(f"L{self.layer}.{name}: a write must be floating point, got {new.dtype}")
        return new.to(device=like.device, dtype=torch.float32)

    def _checked_window(self, new: Any, like: torch.Tensor) -> torch.Tensor:
        if not isinstance(new, torch.Tensor) or tuple(new.shape) != tuple(like.shape):
            got = list(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
            raise DeltaValueError(
                f"L{self.layer}.conv_window_after: a write of shape {got} does not fit {list(like.shape)} "
                f"[batch, conv_dim, width-1]")
        return new.to(device=like.device, dtype=like.dtype)

    def _check_shapes(self, *tensors: Any) -> None:
        names = ("attention_queries", "attention_keys", "attention_values", "decays", "betas")
        b, s = tensors[0].shape[:2]
        for name, t in zip(names, tensors):
            if not isinstance(t, torch.Tensor) or tuple(t.shape[:2]) != (b, s):
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise DeltaValueError(f"L{self.layer}.{name}: a write of shape {got} does not fit [batch={b}, seq={s}, ...]")


def _window(x: torch.Tensor, p: int, width: int) -> torch.Tensor:
    """Columns p-width+2..p of x `[b, c, L]`, zero-filled on the left: `[b, c, width-1]`."""
    lo = p - (width - 1) + 1
    w = x[:, :, max(0, lo):p + 1]
    if w.shape[-1] < width - 1:
        w = F.pad(w, (width - 1 - w.shape[-1], 0))
    return w.clone()


# ---------------------------------------------------------------------------
# The user side
# ---------------------------------------------------------------------------


def _mediator(what: str) -> Mediator:
    return Mediator.current(what)


class DeltaNetEnvoy(Envoy):
    """A DeltaNet mixer in a trace: the values of DESIGN section 1 as properties and calls.

    Reads park until the model reaches the value; assignments replace it. Under
    `tracer.iter[k]` a value addresses generation step k.
    """

    @property
    def site(self) -> MixerSite:
        site = getattr(self._module, "_deltalang_site", None)
        if site is None:
            raise DeltaValueError(f"{self.path} is not a DeltaNet mixer deltalang has wrapped")
        return site

    # -- plumbing --------------------------------------------------------------

    def _wanted_step(self, mediator: Mediator) -> int:
        if mediator.iteration is not None:
            return mediator.iteration
        # relaxed (after a tracer.iter pin was hit): this call if it is running, else the next
        calls = mediator.occurrence(self.path + ".input")
        return calls - 1 if self.site.running else calls

    def _location(self, name: str, mediator: Mediator) -> str:
        loc = f"{self.path}.{name}"
        if mediator.batch_group is not None and _POSITION.search(loc):
            loc += f"@{mediator.batch_group[0]}"
        return loc

    def _pad(self, mediator: Mediator) -> int:
        pads = self.site.pads
        if not pads:
            return 0
        group = mediator.batch_group
        rows = pads[group[0]:group[0] + group[1]] if group is not None else pads
        if len(set(rows)) > 1:
            raise DeltaValueError(
                f"{self.path}: the rows of one invoke have different padding; give each prompt its own invoke")
        return rows[0] if rows else 0

    def _get(self, name: str) -> Any:
        mediator = _mediator(name)
        step = self._wanted_step(mediator)
        previous, mediator.iteration = mediator.iteration, step
        try:
            raw = Mediator.value(self._location(name, mediator))
        finally:
            mediator.iteration = previous
        spec = values.get(name.split(".")[0])
        per_token = spec.per_token if spec is not None else name == "states_as_run"
        if per_token and isinstance(raw, torch.Tensor):
            pad = self._pad(mediator)
            if pad:
                raw = raw[:, pad:]
        return raw

    def _set(self, name: str, value: Any) -> None:
        base = name.split(".")[0]
        spec = values.get(base)
        if spec is not None and not spec.writable:
            raise DeltaValueError(f"L{self.site.layer}.{base} is read-only")
        mediator = _mediator(name)
        step = self._wanted_step(mediator)
        if spec is not None and spec.per_token and isinstance(value, torch.Tensor):
            pad = self._pad(mediator)
            if pad:
                value = torch.cat([value.new_zeros((value.shape[0], pad, *value.shape[2:])), value], dim=1)
        previous, mediator.iteration = mediator.iteration, step
        try:
            Mediator.swap(self._location(name, mediator), value)
        finally:
            mediator.iteration = previous

    # -- the values ------------------------------------------------------------

    @property
    def attention_queries(self) -> torch.Tensor:
        """Queries the delta rule receives, before l2-norm and 1/sqrt(key_dim): [b, s, heads, key_dim]."""
        return self._expand_heads(self._get("attention_queries"))

    @attention_queries.setter
    def attention_queries(self, value: torch.Tensor) -> None:
        self._set("attention_queries", self._fold_heads(value))

    @property
    def attention_keys(self) -> torch.Tensor:
        """Keys the delta rule receives, before l2-norm: [b, s, heads, key_dim]."""
        return self._expand_heads(self._get("attention_keys"))

    @attention_keys.setter
    def attention_keys(self, value: torch.Tensor) -> None:
        self._set("attention_keys", self._fold_heads(value))

    @property
    def attention_values(self) -> torch.Tensor:
        """Values the delta rule receives: [b, s, heads, value_dim]."""
        return self._get("attention_values")

    @attention_values.setter
    def attention_values(self, value: torch.Tensor) -> None:
        self._set("attention_values", value)

    @property
    def decays(self) -> torch.Tensor:
        """Log of the share of the state each token keeps (<= 0): [b, s, heads] (Kimi: [b, s, heads, key_dim])."""
        return self._get("decays")

    @decays.setter
    def decays(self, value: torch.Tensor) -> None:
        self._set("decays", value)

    @property
    def betas(self) -> torch.Tensor:
        """Write strength of each token: [b, s, heads]."""
        return self._get("betas")

    @betas.setter
    def betas(self, value: torch.Tensor) -> None:
        self._set("betas", value)

    @property
    def state_input(self) -> torch.Tensor | None:
        """The state the call starts from: None on a fresh prompt, a copy of the cached state on a decode step."""
        return self._get("state_input")

    @state_input.setter
    def state_input(self, value: torch.Tensor) -> None:
        self._set("state_input", value)

    @property
    def state_output(self) -> torch.Tensor:
        """The state after the call's last token: [b, heads, key_dim, value_dim]."""
        return self._get("state_output")

    @state_output.setter
    def state_output(self, value: torch.Tensor) -> None:
        self._set("state_output", value)

    @property
    def states(self) -> torch.Tensor:
        """The state after every token of the call: [b, s, heads, key_dim, value_dim] (read-only)."""
        return self._get("states")

    @states.setter
    def states(self, value: Any) -> None:
        raise DeltaValueError(
            f"L{self.site.layer}.states is read-only; write one position with set_state_after(t, value)")

    @property
    def states_as_run(self) -> torch.Tensor:
        """Like `states`, but served after this call's `set_state_after` writes: the forward as it ran.

        `states` is served before any position is written (it reads every position); this one is
        served once the last written position has run, so tokens after a write show its effect.
        """
        return self._get("states_as_run")

    def state_after(self, t: int) -> torch.Tensor:
        """The state after token t of the call (t may be negative): [b, heads, key_dim, value_dim]."""
        return self._get(f"state_after.{int(t)}")

    def set_state_after(self, t: int, value: torch.Tensor) -> None:
        """Replace the state after token t: token t's output reads it, tokens t+1.. continue from it."""
        self._set(f"state_after.{int(t)}", value)

    def conv_window_after(self, t: int) -> torch.Tensor:
        """The short-convolution inputs tokens after t still see: [b, conv_dim, width-1]."""
        return self._get(f"conv_window_after.{int(t)}")

    def set_conv_window_after(self, t: int, value: torch.Tensor) -> None:
        """Replace what tokens after t see of the tokens up to t through the convolution."""
        self._set(f"conv_window_after.{int(t)}", value)

    @property
    def state(self) -> torch.Tensor:
        """Under `for t in tracer.iter[t]`: the state after token t of the prompt."""
        return self._token_state(None)

    @state.setter
    def state(self, value: torch.Tensor) -> None:
        self._token_state(value)

    def _token_state(self, value: torch.Tensor | None) -> torch.Tensor:
        mediator = _mediator("state")
        t = mediator.iteration if mediator.iteration is not None else 0
        previous, mediator.iteration = mediator.iteration, 0
        try:
            if value is None:
                return self.state_after(t)
            self.set_state_after(t, value)
            return value
        finally:
            mediator.iteration = previous

    @property
    def attention_head_outputs(self) -> torch.Tensor:
        """Each head's read of the state, before the gated norm and output projection: [b, s, heads, value_dim]."""
        return self._get("attention_head_outputs")

    @attention_head_outputs.setter
    def attention_head_outputs(self, value: torch.Tensor) -> None:
        self._set("attention_head_outputs", value)

    @property
    def attention_output(self) -> torch.Tensor:
        """What the mixer adds to the residual stream: [b, s, hidden]."""
        return self.output

    @attention_output.setter
    def attention_output(self, value: torch.Tensor) -> None:
        self.output = value

    # queries/keys arrive with the key heads; the table promises value heads
    def _expand_heads(self, x: torch.Tensor) -> torch.Tensor:
        heads = self.site.dims["heads"]
        if isinstance(x, torch.Tensor) and x.shape[-2] != heads:
            return x.repeat_interleave(heads // x.shape[-2], dim=-2)
        return x

    def _fold_heads(self, x: torch.Tensor) -> torch.Tensor:
        heads, key_heads = self.site.dims["heads"], self.site.dims["key_heads"]
        if isinstance(x, torch.Tensor) and heads != key_heads and x.shape[-2] == heads:
            rep = heads // key_heads
            folded = x.reshape(*x.shape[:-2], key_heads, rep, x.shape[-1])
            if not torch.equal(folded, folded[..., :1, :].expand_as(folded)):
                raise DeltaValueError(
                    f"L{self.site.layer}: this mixer shares each query/key head across {rep} value heads; "
                    f"a write must give the repeated heads equal values (or pass {key_heads} heads)")
            return folded[..., 0, :]
        return x
