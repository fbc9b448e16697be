"""Ground truth for deltalang's values and writes: transformers' own forward over its own cache.

`Reference(hf).run(ids, writes, max_new_tokens)` runs a prompt through a plain
transformers model (no nnsight, no deltalang site) one token at a time, with the
cache transformers keeps between tokens, and then greedy decode steps. After
each token it records what the cache and the model hold: the recurrent state,
the convolution window, every block's output, the mixer's output, the kernel's
inputs and outputs, the logits. That is the definition of each of deltalang's
values, computed without deltalang:

- `state_after(t)` is the cache's recurrent state after token t; `states` all of
  them; `state_output` the last of a step; `state_input` the state a step's
  kernel starts from (None on a fresh prompt).
- `conv_window_after(t)` is the cache's convolution state after token t, less
  the column the next token drops (`[:, :, 1:]`).
- `attention_queries` ... `betas` are the kernel's inputs, `attention_head_outputs`
  its output, `attention_output` the mixer module's output, `output` the block's.

Writes are applied as deltalang defines them: a per-token value or `state_input`
replaces the kernel's input (queries and keys as the kernel takes them: per key
head, where deltalang shows them per value head); `state_after(t)` replaces the state after token t
(the cache then carries it on) and token t's own output reads the written state;
`conv_window_after(t)` replaces the cache's window after token t; `attention_output`
replaces the mixer's output. The kernels called are the functions transformers'
modeling module held at import (`deltalang.runtime.kernels.original`: the names
deltalang rebinds are put back around each run), so only the patching of the
values above is done here, by hand.

Steps: step 0 is the prompt (positions 0..n-1), step k >= 1 runs the k-th new
token's predecessor (position n+k-1); new tokens are greedy with end-of-text
suppressed (as `min_new_tokens=max_new_tokens` does).

For Mamba-2 (SSD) blocks the tests build their truth from the same pieces, kept here once:
`hf_forward` (transformers' forward with a cache, positions from `start` where the model takes them),
`cache_after` (its cache after tokens 0..t), `kernel_calls` (what a forward hands a kernel global, per mixer; `delta_calls` a delta-rule
family's kernels),
`kernel_patched` (a kernel global of the family's modeling module,
the scan `internals.SCAN_GLOBAL`, the decode step `internals.STEP_GLOBAL` or the convolution, called through a wrapper
told which Mamba-2 mixer runs: `mixer_running`, `kernel_global`) and `step_replaced` (a one-token step whose
state update ends in a written state, which the token reads: y = h C + D x); `states_written` is the state
after every token of a prompt run token by token with such steps at the written positions.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import attrs
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from deltalang.models import families, internals, testing_ssd
from deltalang.models.internals import cache_kwargs, output_cache
from deltalang.runtime import kernels
from deltalang.runtime.model import decoder, decoder_layers

PER_TOKEN_INPUTS = ("attention_queries", "attention_keys", "attention_values", "decays", "betas")
Fn = Callable[[Any, int], Any]  # (current value, token index within the step) -> new value


def set_to(value: Any) -> Fn:
    """A write of `value` (a donor's, a mean's)."""
    return lambda x, i: value


def zeros(x: torch.Tensor, i: int) -> torch.Tensor:
    """A write of zeros."""
    return torch.zeros_like(x)


def kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || this run) over the next token, in nats, from next-token logits `[1, vocab]`."""
    return float(F.kl_div(logits.float().log_softmax(-1), reference.float().log_softmax(-1), log_target=True,
                          reduction="sum"))


@attrs.frozen
class Write:
    """One write: `fn(current, i)` gives the new value (i: the token's index within its step).

    `position`: for `state_after` / `conv_window_after`, the prompt position (step 0).
    `step`: None applies a per-token value, `state_input` or `attention_output` at every step.
    """

    layer: int
    value: str
    fn: Fn
    position: int | None = None
    step: int | None = None

    def at(self, layer: int, value: str, step: int, position: int | None = None) -> bool:
        return (self.layer == layer and self.value == value and (self.step is None or self.step == step)
                and (position is None or self.position == position))


@attrs.define
class Step:
    """What one step recorded, per block: lists over the step's tokens."""

    inputs: dict[tuple[int, str], list[torch.Tensor]] = attrs.Factory(dict)
    head_outputs: dict[int, list[torch.Tensor]] = attrs.Factory(dict)
    states: dict[int, list[torch.Tensor]] = attrs.Factory(dict)
    state_input: dict[int, torch.Tensor | None] = attrs.Factory(dict)
    conv: dict[int, list[torch.Tensor]] = attrs.Factory(dict)
    mixer_out: dict[int, list[torch.Tensor]] = attrs.Factory(dict)
    block_out: dict[int, list[torch.Tensor]] = attrs.Factory(dict)
    logits: list[torch.Tensor] = attrs.Factory(list)


@attrs.define
class Record:
    steps: list[Step]
    new_tokens: torch.Tensor  # [b, max_new_tokens]

    def value(self, layer: int | None, value: str, position: int | None = None, step: int = 0) -> Any:
        """deltalang's `value` of block `layer` (None: the model's) at `step`, from the record."""
        s = self.steps[step]
        cat = lambda xs: torch.cat(xs, dim=1)  # noqa: E731
        if layer is None:
            if value == "logits":
                return cat(s.logits)
            if value == "next_token_probs":
                return s.logits[-1][:, -1].float().softmax(-1)
            if value == "tokens":
                return self.new_tokens
        elif value in PER_TOKEN_INPUTS:
            x = cat(s.inputs[layer, value])
            heads = s.states[layer][0].shape[1]
            if value in ("attention_queries", "attention_keys") and x.shape[2] != heads:
                x = x.repeat_interleave(heads // x.shape[2], dim=2)  # deltalang shows them per value head
            return x
        elif value == "attention_head_outputs":
            return cat(s.head_outputs[layer])
        elif value in ("states", "states_as_run"):
            return torch.stack(s.states[layer], dim=1)
        elif value == "state_after":
            assert position is not None
            return s.states[layer][position]
        elif value == "state_output":
            return s.states[layer][-1]
        elif value == "state_input":
            return s.state_input[layer]
        elif value == "conv_window_after":
            assert position is not None
            return s.conv[layer][position]
        elif value == "attention_output":
            return cat(s.mixer_out[layer])
        elif value == "output":
            return cat(s.block_out[layer])
        raise KeyError(f"no reference for {value!r}")


def _read_state(query_t: torch.Tensor, state: torch.Tensor, l2: bool) -> torch.Tensor:
    """One token's read of a state, `[b, 1, heads, value_dim]`, as the delta-rule kernels compute it."""
    q = query_t[:, 0].float()
    heads = state.shape[1]
    if q.shape[-2] != heads:
        q = q.repeat_interleave(heads // q.shape[-2], dim=1)
    if l2:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    return torch.einsum("bhk,bhkv->bhv", q, state.float())[:, None]


class Reference:
    """A plain transformers model (its own instance) as the ground truth of deltalang's values."""

    def __init__(self, hf: torch.nn.Module) -> None:
        self.hf = hf.eval()
        fam = families.for_config(hf.config)
        assert fam is not None, hf.config.model_type
        self.fam = fam
        self.layers = list(decoder_layers(hf))  # at `.model.language_model` in a composite model
        self.linear = [i for i, t in enumerate(decoder(hf).config.layer_types) if t == "linear_attention"]
        gen = getattr(hf, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        eos = eos if eos is not None else hf.config.eos_token_id
        self.eos = [eos] if isinstance(eos, int) else list(eos or [])

    def run(self, ids: torch.Tensor, writes: Sequence[Write] = (), max_new_tokens: int = 0) -> Record:
        """Run `ids` token by token, then `max_new_tokens - 1` greedy decode steps, with `writes` applied."""
        writes = list(writes)
        steps: list[Step] = []
        now: dict[str, Any] = {"layer": -1, "step": 0, "index": 0}  # where the forward is
        module = self.fam.module
        names = (self.fam.chunk_kernel, self.fam.recurrent_kernel)
        saved = {name: getattr(module, name) for name in names}

        def find(layer: int, value: str, position: int | None = None) -> list[Write]:
            return [w for w in writes if w.at(layer, value, now["step"], position)]

        def kernel(orig: Callable[..., Any]) -> Callable[..., Any]:
            def run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor | None = None,
                    beta: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                    **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
                layer, step, i = now["layer"], steps[-1], now["index"]
                got = {"attention_queries": query, "attention_keys": key, "attention_values": value,
                       "decays": g, "betas": beta}
                for name in PER_TOKEN_INPUTS:
                    for w in find(layer, name):
                        got[name] = w.fn(got[name], i)
                    step.inputs.setdefault((layer, name), []).append(got[name])
                if i == 0:
                    for w in find(layer, "state_input"):
                        initial_state = w.fn(initial_state, i)
                    step.state_input[layer] = None if initial_state is None else initial_state.clone()
                kw.pop("cu_seqlens", None)
                out, state = orig(got["attention_queries"], got["attention_keys"], got["attention_values"],
                                  g=got["decays"], beta=got["betas"], initial_state=initial_state,
                                  output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  **kw)
                position = i if now["step"] == 0 else None
                for w in find(layer, "state_after", position) if position is not None else []:
                    state = w.fn(state, i).to(state.dtype)
                    out = _read_state(got["attention_queries"], state, use_qk_l2norm_in_kernel).to(out.dtype)
                step.head_outputs.setdefault(layer, []).append(out)
                step.states.setdefault(layer, []).append(state.clone())
                return out, (state if output_final_state else None)

            return run

        def enter(layer: int) -> Callable[..., None]:
            def hook(mod: Any, args: Any) -> None:
                now["layer"] = layer

            return hook

        def mixer_exit(layer: int) -> Callable[..., Any]:
            def hook(mod: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
                for w in find(layer, "attention_output"):
                    output = w.fn(output, now["index"])
                steps[-1].mixer_out.setdefault(layer, []).append(output)
                return output

            return hook

        def block_exit(layer: int) -> Callable[..., None]:
            def hook(mod: Any, args: Any, output: Any) -> Any:
                out = output[0] if isinstance(output, tuple) else output
                for w in find(layer, "output"):
                    out = w.fn(out, now["index"])
                steps[-1].block_out.setdefault(layer, []).append(out)
                return (out, *output[1:]) if isinstance(output, tuple) else out

            return hook

        hooks = []
        for i, block in enumerate(self.layers):
            hooks.append(block.register_forward_hook(block_exit(i)))
            if i in self.linear:
                mixer = getattr(block, self.fam.mixer_attr)
                hooks.append(mixer.register_forward_pre_hook(enter(i)))
                hooks.append(mixer.register_forward_hook(mixer_exit(i)))
        for name in names:
            setattr(module, name, kernel(kernels.original(self.fam, name)))
        try:
            with torch.no_grad():
                cache = None
                n = ids.shape[1]
                tokens: list[torch.Tensor] = []
                steps.append(Step())
                for t in range(n):
                    now["index"] = t
                    cache = self._one(ids[:, t:t + 1], cache, steps[-1])
                    self._conv(cache, steps[-1], writes, t)
                for k in range(max_new_tokens):
                    logits = steps[-1].logits[-1][:, -1].float().clone()
                    logits[:, self.eos] = -float("inf")
                    tokens.append(logits.argmax(-1, keepdim=True))
                    if k + 1 == max_new_tokens:
                        break
                    now["step"], now["index"] = k + 1, 0
                    steps.append(Step())
                    cache = self._one(tokens[-1], cache, steps[-1])
        finally:
            for name in names:
                setattr(module, name, saved[name])
            for h in hooks:
                h.remove()
        new = torch.cat(tokens, dim=1) if tokens else torch.empty(ids.shape[0], 0, dtype=torch.long)
        return Record(steps, new)

    def _one(self, ids: torch.Tensor, cache: Any, step: Step) -> Any:
        kw = cache_kwargs(cache, self.hf) if cache is not None else {}  # the keyword this transformers takes
        out = self.hf(ids, **kw, use_cache=True)
        step.logits.append(out.logits)
        return output_cache(out)

    def _conv(self, cache: Any, step: Step, writes: Sequence[Write], t: int) -> None:
        """After prompt token t: apply `conv_window_after(t)` writes to the cache, record every window."""
        for layer in self.linear:
            window = cache.get_conv_state(layer)
            for w in writes:
                if w.at(layer, "conv_window_after", 0, t):
                    window[:, :, 1:] = w.fn(window[:, :, 1:].clone(), t)
            step.conv.setdefault(layer, []).append(window[:, :, 1:].clone())


# -- Mamba-2 (SSD) blocks: transformers' forward and cache, its kernel globals patched per mixer --------------


def hf_forward(hf: Any, ids: torch.Tensor, cache: Any = None, start: int = 0, *,
               attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
               no_grad: bool = True) -> Any:
    """transformers' forward of `ids` with a cache (continuing `cache` where given), at positions from `start`
    where the model takes them (bamba continues at its positions); `no_grad=False`: under the caller's mode."""
    kw: dict[str, Any] = {"use_cache": True}
    if cache is not None:
        kw |= cache_kwargs(cache, hf)
    if "position_ids" in inspect.signature(type(hf).forward).parameters:
        kw["position_ids"] = position_ids if position_ids is not None else torch.arange(start, start + ids.shape[1])[None]
    if attention_mask is not None:
        kw["attention_mask"] = attention_mask
    if not no_grad:
        return hf(ids, **kw)
    with torch.no_grad():
        return hf(ids, **kw)


def cache_after(hf: Any, ids: torch.Tensor, t: int) -> Any:
    """transformers' cache after tokens 0..t: its state after token t, its window."""
    return output_cache(hf_forward(hf, ids[:, :t + 1]))


@contextmanager
def mixer_running(hf: Any) -> Iterator[list[int]]:
    """[the cache index of the Mamba-2 mixer running now, -1 outside any] inside the block."""
    current = [-1]
    hooks = []
    for i, mixer in testing_ssd.ssd_mixers(hf):
        hooks.append(mixer.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i)))
        hooks.append(mixer.register_forward_hook(lambda *_: current.__setitem__(0, -1)))
    try:
        yield current
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def kernel_global(name: str, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Inside the block, family `name`'s modeling module holds `make(original)` as its global `attr`."""
    module = testing_ssd.modeling_module(name)
    original = getattr(module, attr)
    setattr(module, attr, make(original))
    try:
        yield
    finally:
        setattr(module, attr, original)


@contextmanager
def kernel_patched(name: str, hf: Any, attr: str, wrap: Callable[[int, Callable[..., Any], tuple, dict], Any]
                   ) -> Iterator[None]:
    """Inside the block, calls to kernel global `attr` go through `wrap(layer, original, args, kwargs)`, `layer`
    the cache index of the Mamba-2 mixer calling it."""
    with mixer_running(hf) as current, kernel_global(
            name, attr, lambda original: lambda *a, **k: wrap(current[0], original, a, k)):
        yield


def delta_calls(fam: families.Family, hf: Any, ids: torch.Tensor, kernel: str | None = None,
                cache: Any = None) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) of every call of a delta-rule family's kernel global `kernel` (its chunk kernel unless
    named: `fam.recurrent_kernel` for a decode step) in transformers' forward of `ids` (from `cache`), in block
    order; the kernel run is the one transformers' module held at import (`kernels.original`)."""
    name = kernel or fam.chunk_kernel
    calls: list[tuple[tuple, dict]] = []
    real = kernels.original(fam, name)
    saved = getattr(fam.module, name)

    def record(*a: Any, **k: Any) -> Any:
        calls.append((a, dict(k)))
        return real(*a, **k)
    setattr(fam.module, name, record)
    try:
        with torch.no_grad():
            hf(ids, **(cache_kwargs(cache, hf) if cache is not None else {}), use_cache=True)
    finally:
        setattr(fam.module, name, saved)
    return calls


def kernel_calls(name: str, hf: Any, ids: torch.Tensor, attr: str = internals.SCAN_GLOBAL, cache: Any = None,
                 start: int = 0) -> dict[int, tuple[tuple, dict]]:
    """The (args, kwargs) transformers' forward of `ids` (from `cache`, at `start`) hands kernel global `attr` of
    family `name` (the prompt scan; `internals.STEP_GLOBAL`: the decode step), per cache layer of its Mamba-2
    mixers: the last call of each."""
    calls: dict[int, tuple[tuple, dict]] = {}

    def record(layer: int, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        calls[layer] = (args, kwargs)
        return original(*args, **kwargs)

    with kernel_patched(name, hf, attr, record):
        hf_forward(hf, ids, cache, start=start)
    return calls


@contextmanager
def step_replaced(name: str, hf: Any, new: dict[int, torch.Tensor]) -> Iterator[None]:
    """Inside the block, each layer of `new`'s one-token state update ends in its state, which its token reads
    (y = h C + D x, gated where the decode kernel takes the gate: falcon_h1)."""
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, D: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
            out = original(state, x, dt, A, B, C, D, **kw)
            if current[0] not in new:
                return out
            state.copy_(new[current[0]].to(state.dtype))
            Ch = C.float().repeat_interleave(state.shape[1] // C.shape[1], dim=1)  # [b, h, N]
            y = (state.float() @ Ch[..., None])[..., 0] + D.float() * x.float()  # D: [h, P] as the mixer passes it
            if kw.get("z") is not None:
                y = y * F.silu(kw["z"].float())
            return y.to(out.dtype)
        return step
    with mixer_running(hf) as current, kernel_global(name, internals.STEP_GLOBAL, make):
        yield


def states_written(name: str, hf: Any, ids: torch.Tensor, writes: dict[int, dict[int, torch.Tensor]],
                   layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """Per layer of `layers`, transformers' recurrent state after every token of `ids` `[1, s, h, P, N]` float32,
    the prompt run token by token with its cache and, at each position t of `writes`, token t a one-token step
    whose state update ends in `writes[t][layer]` for each of its layers (`step_replaced`: token t reads it). The
    state after the last token is also checked against the rest of the prompt run as one forward from the cache
    after the last write (the prompt's tail continued from that cache, not token by token)."""
    per: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    cache, tail = None, None
    last = max(writes, default=-1)
    for u in range(ids.shape[1]):
        if u in writes:
            with step_replaced(name, hf, writes[u]):
                out = hf_forward(hf, ids[:, u:u + 1], cache, start=u)
        else:
            out = hf_forward(hf, ids[:, u:u + 1], cache, start=u)
        cache = output_cache(out)
        for i in layers:
            per[i].append(cache.get_recurrent_state(i).float().clone())
        if u == last and u + 1 < ids.shape[1]:  # the tail in one forward, from a cache built the same way again
            tail = _tail_after(name, hf, ids, writes, u)
    if tail is not None:
        for i in layers:
            err = float((tail.get_recurrent_state(i).float() - per[i][-1]).abs().max())
            assert err <= 2e-4 * max(1.0, float(per[i][-1].abs().max())), f"the tail in one forward differs: {err}"
    return {i: torch.stack(v, dim=1) for i, v in per.items()}


def _tail_after(name: str, hf: Any, ids: torch.Tensor, writes: dict[int, dict[int, torch.Tensor]], t: int) -> Any:
    """transformers' cache after the whole prompt: tokens up to t as `states_written` runs them, then the rest of
    the prompt in one forward."""
    cache = None
    for u in range(t + 1):
        with step_replaced(name, hf, writes.get(u, {})):
            cache = output_cache(hf_forward(hf, ids[:, u:u + 1], cache, start=u))
    return output_cache(hf_forward(hf, ids[:, t + 1:], cache, start=t + 1))


class Largest(TorchDispatchMode):
    """The largest tensor any op makes (elements): how the reductions' tests show a value was never made whole."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out
