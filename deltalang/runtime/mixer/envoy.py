"""`DeltaNetEnvoy`: the user side of a DeltaNet mixer in an nnsight trace.

The values of DESIGN section 1 are its properties (`.states`, `.betas`, ...) and,
for a value at a position, a pair of calls (`.state_after(t)` /
`.set_state_after(t, value)`). They are generated from the value catalogue
(`deltalang.models.values.CATALOGUE`), which holds their names, docstrings and which
can be written: a read parks the worker on `"{mixer path}.{value}"` until the
model side (`MixerSite`) serves it; an assignment replaces it; a read-only value
refuses a write. Queries and keys arrive with the key heads and are shown with
the value heads the table promises; `attention_output` is the mixer's own
`.output`; a Mamba-2 mixer's `gate` is what its gated norm `norm(y, gate)` receives (`.norm.inputs`). `states_as_run` and the recipes' `state` are Python-only.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.interleaver import Mediator

from deltalang.ground.errors import DeltaValueError
from deltalang.models import values

from .reduced import register
from .requests import _POSITION
from .site import MixerSite


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

    # -- Python-only values ----------------------------------------------------

    @property
    def states_as_run(self) -> torch.Tensor:
        """Like `states`, but served after this call's `set_state_after` writes: the forward as it ran.

        `states` is served before any position is written (it reads every position); this one is
        served once the last written position has run, so tokens after a write show its effect.
        """
        return self._get("states_as_run")

    def states_reduced(self, reduction: Any) -> torch.Tensor:
        """A `measures.Reduction` of `states` computed in the kernel call a group of chunks at a time, so the
        state after every token (`[b, s, heads, key_dim, value_dim]`) never exists (`deltalang.runtime.mixer.reduced`)."""
        raw = self._get(register(self.site, reduction))
        if reduction.keeps_positions and isinstance(raw, torch.Tensor):
            pad = self._pad(_mediator("states_reduced"))
            return raw[:, pad:] if pad else raw
        return raw

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


# how a read or write of a value is converted on the user side (the others pass as they are)
_HEADS = ("attention_queries", "attention_keys")
# what a refused write of a read-only value suggests instead
_READ_ONLY_HINT = {"states": "write one position with set_state_after(t, value)"}


def _generated(name: str, doc: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    fn.__name__, fn.__qualname__, fn.__doc__ = name, f"DeltaNetEnvoy.{name}", doc
    return fn


def _value_property(v: values.Value) -> property:
    """A value without a position as a property: a read parks, an assignment replaces (or is refused)."""
    name = v.name
    if name == "gate":
        return property(_generated(name, v.doc, _gate), _set_gate)
    if not v.kernel:  # the mixer's own output: nnsight serves it (past a left-padded row's padding)
        def get(self: DeltaNetEnvoy) -> Any:
            out = self.output  # parks until the mixer has run: its padding is then this call's
            pad = self._pad(_mediator(name))
            return out[:, pad:] if pad else out

        def write(self: DeltaNetEnvoy, value: Any) -> None:
            if self.site.pads and isinstance(value, torch.Tensor):  # a padded call (or the last one was)
                out = self.output
                pad = self._pad(_mediator(name))
                if pad:  # in place: the padded positions keep what they hold
                    out[:, pad:] = value.to(out.dtype)
                    return
            self.output = value
    elif name in _HEADS:
        def get(self: DeltaNetEnvoy) -> Any:
            return self._expand_heads(self._get(name))

        def write(self: DeltaNetEnvoy, value: Any) -> None:
            self._set(name, self._fold_heads(value))
    else:
        def get(self: DeltaNetEnvoy) -> Any:
            return self._get(name)

        def write(self: DeltaNetEnvoy, value: Any) -> None:
            self._set(name, value)
    return property(_generated(name, v.doc, get), write if v.writable else _refusal(name))


def _norm_inputs(self: DeltaNetEnvoy) -> tuple[Any, tuple, dict]:
    """(the gate, the args and kwargs of the gated norm `norm(y, gate)` of a Mamba-2 mixer) when it runs."""
    if self.site.family.block_kind != values.SSM:
        raise DeltaValueError(f"L{self.site.layer}.gate is a value of Mamba-2 blocks only")
    if isinstance(getattr(self.site.module, "norm", None), torch.nn.Identity):  # falcon_h1 without mamba_rms_norm
        raise DeltaValueError(f"L{self.site.layer}.gate: this mixer runs no gated norm (its gate reaches a decode "
                              f"step's kernel only)")
    args, kwargs = self.norm.inputs
    return (args[1] if len(args) > 1 else kwargs.get("gate")), tuple(args), dict(kwargs)


def _gate(self: DeltaNetEnvoy) -> Any:
    gate = _norm_inputs(self)[0]
    pad = self._pad(_mediator("gate"))
    return gate[:, pad:] if pad else gate


def _set_gate(self: DeltaNetEnvoy, value: Any) -> None:
    """Replace the gate the gated norm receives (a left-padded row's padding keeps its own)."""
    gate, args, kwargs = _norm_inputs(self)
    pad = self._pad(_mediator("gate"))
    want = (gate.shape[0], gate.shape[1] - pad, *gate.shape[2:])
    if not isinstance(value, torch.Tensor) or tuple(value.shape) not in (want, want[1:]):
        got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise DeltaValueError(f"L{self.site.layer}.gate: a write of shape {got} does not fit {list(want)}")
    new = gate.clone()
    new[:, pad:] = value.to(device=gate.device, dtype=gate.dtype)
    if len(args) > 1:
        args = (args[0], new, *args[2:])
    else:
        kwargs["gate"] = new
    self.norm.inputs = (args, kwargs)


def _refusal(name: str) -> Callable[..., None]:
    """The setter of a read-only value: refuses, saying what to write instead where there is something."""
    hint = _READ_ONLY_HINT.get(name)

    def refuse(self: DeltaNetEnvoy, value: Any) -> None:
        raise DeltaValueError(f"L{self.site.layer}.{name} is read-only" + (f"; {hint}" if hint else ""))
    return refuse


def _value_calls(v: values.Value) -> dict[str, Callable[..., Any]]:
    """A value at a position as calls: `name(t)` reads, `set_name(t, value)` writes (if it can be written)."""
    name = v.name

    def get(self: DeltaNetEnvoy, t: int) -> Any:
        return self._get(f"{name}.{int(t)}")

    def set_(self: DeltaNetEnvoy, t: int, value: Any) -> None:
        self._set(f"{name}.{int(t)}", value)

    calls = {name: _generated(name, v.doc, get)}
    if v.writable:
        calls[f"set_{name}"] = _generated(f"set_{name}", v.write_doc, set_)
    return calls


def _install_values(cls: type[DeltaNetEnvoy]) -> None:
    for v in values.CATALOGUE.values():
        if not set(values.RECURRENT) & set(v.kinds) or v.name == "output":  # `output`: the block's, not the mixer's
            continue
        members: dict[str, Any] = _value_calls(v) if v.positional else {v.name: _value_property(v)}
        for member, attr in members.items():
            assert member not in cls.__dict__, f"DeltaNetEnvoy.{member} is both written and generated"
            setattr(cls, member, attr)


_install_values(DeltaNetEnvoy)
