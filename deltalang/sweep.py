"""Sweeps: ablation grids built from a template, run doing only the work each cell changes.

    text = deltalang.sweep('write L.state_after(t) = zeros; measure prob(" Paris")',
                           L="L[linear]", t=range(0, 8), prompt="The Eiffel Tower is in the city of")
    results = deltalang.run(text)                      # or: deltalang sweep FILE --out DIR

A sweep `sweep NAME on PROMPT over L in ..., t in ... { ... }` is one cell per
point of its axes. The reference meaning of a cell is the trace
`ResolvedRun.instantiate(point)`: one full forward with the cell's writes.

The engine. A cell that writes block L at position t (`state_after(t)`,
`conv_window_after(t)`) cannot change anything before block L, nor any position
before t. So the clean prompt runs ONCE (`capture_clean`), keeping what cells
need: the residual stream entering every block and each block's call arguments,
the attention blocks' keys and values, and each DeltaNet block's state and
convolution window after t-1 for every start position t. Then every cell
recomputes only blocks L.. at positions t.. (`run_rows`): a transformers cache
holds the clean prefix (`_prefix_cache`), block L is fed the clean residual
entering it at t.., and the cell's write is applied inside the kernel call by
`MixerSite.direct` (positions in the call's own coordinates). Cells with the
same start position share a forward as rows, sorted by their start block: at
block i only the rows that start at or before i are computed, so the work is
the sum over cells of (blocks from L) x (positions from t). The final norm and
the LM head run at the last position only. Donor values (`from other`), means
over prompt sets and reference logits (`kl(RUN)`, normalisation) come from one
ordinary compiled program (`Support`), the same code path as every other run.

A body the engine cannot serve (reads, writes to other values, `= NAME`, ...)
runs through the reference path, cells batched as invokes of full forwards; the
progress output says which path each sweep takes and why.

Results go to `DIR/sweep.csv` (long format: sweep, axes, measure, position,
value; `position` is set for per-token measures only) as cells finish, with
`DIR/sweep.json` recording the program's sha256 and the cells done, so an
interrupted sweep loses no finished cell and `--resume` continues it. At the
end the CSV is rewritten in cell order, and `deltalang.plots` draws it.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import hashlib
import io
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from . import ast, measures, values
from .errors import DeltaError
from .plan import donor_key
from .resolve import (
    FromRun,
    Mean,
    Named,
    Resolved,
    ResolvedMeasure,
    ResolvedOp,
    ResolvedRun,
    Scale,
    SweepAxis,
    Zeros,
    site_text,
)

if TYPE_CHECKING:
    from rich.console import Console

    from .model import DeltaModel
    from .run import Experiment, Results

SUPPORT = "sweep#"  # results keys of the values the engine asks the compiler for
FAST_VALUES = ("state_after", "conv_window_after")
LOGIT_MEASURES = ("prob", "rank", "logit_diff", "kl")
CSV_NAME, META_NAME = "sweep.csv", "sweep.json"


class DeltaSweepError(DeltaError):
    """A sweep cannot be built, resumed or written as asked."""


class _Unsupported(Exception):
    """Internal: the engine cannot serve this sweep; the message says why (the naive path runs it)."""


# ---------------------------------------------------------------------------
# the Python API: a sweep's program text
# ---------------------------------------------------------------------------


def sweep(template: str, *, prompt: str | None = None, prompts: Mapping[str, str | Sequence[str]] | None = None,
          on: str = "clean", name: str = "grid", model: str | None = None, **axes: Any) -> str:
    """The program text of a sweep: `template` (statements) over `axes`, on `prompt`.

    Axis values: a selector or range as written (`"L[linear]"`, `"L*"`, `"0..8"`), a
    `range` of positions (step 1), or a list of ints: blocks for a variable used as a
    block (`L.state_after(t)`), a contiguous run of positions for one used as a position.
    `prompts` declares more prompts (a list declares a prompt set for `mean(...)`).
    Run the text with `deltalang.run(text)`; save it to rerun it.

        deltalang.sweep('write L.state_after(t) = zeros; measure prob(" Paris")',
                        L="L[linear]", t=range(8), prompt="The Eiffel Tower is in the city of")
    """
    from .parse import parse

    if not axes:
        raise DeltaSweepError("a sweep needs at least one axis: sweep(template, L=\"L[linear]\", t=range(8), ...)")
    body = [line.strip() for line in template.strip().splitlines() if line.strip()]
    if not any(line and not line.startswith("#") for line in body):
        raise DeltaSweepError("the template has no statements")
    if any(c in template for c in "{}"):
        raise DeltaSweepError("the template is a sweep's body: statements only, without '{ }' or run headers")
    declared = dict(prompts or {})
    if prompt is not None:
        declared = {on: prompt, **{k: v for k, v in declared.items() if k != on}}
    if on not in declared:
        raise DeltaSweepError(f"the sweep runs on prompt '{on}': pass prompt=\"...\" (or prompts={{'{on}': ...}})")
    lines = ["# built by deltalang.sweep()"]
    if model is not None:
        lines.append(f"model {ast.quote(model)}")
    for pname, text in declared.items():
        if isinstance(text, str):
            lines.append(f"prompt {pname} = {ast.quote(text)}")
        else:
            lines.append(f"prompts {pname} = [{', '.join(ast.quote(t) for t in text)}]")
    over = ", ".join(f"{var} in {_axis_text(var, value, body)}" for var, value in axes.items())
    lines.append(f"sweep {name} on {on} over {over} {{")
    lines.extend(f"    {s}" for s in body)
    lines.append("}")
    text = "\n".join(lines) + "\n"
    parse(text, "<deltalang.sweep>")  # a syntax error points at the generated line
    return text


def _axis_text(var: str, value: Any, body: Sequence[str]) -> str:
    """An axis domain as the language writes it."""
    if isinstance(value, str):
        return value
    code = "\n".join(body)
    as_block = re.search(rf"(?<![\w.]){re.escape(var)}\.", code) is not None
    as_position = re.search(rf"\(\s*{re.escape(var)}\s*\)", code) is not None
    if not as_block and not as_position:
        raise DeltaSweepError(f"axis '{var}' is not used in the template as a block ({var}.state_after(...)) "
                              f"or a position (L.state_after({var}))")
    if isinstance(value, range):
        if value.step != 1 or len(value) == 0:
            raise DeltaSweepError(f"axis '{var}': a range of positions must be non-empty with step 1, got {value}")
        return f"{value.start}..{value.stop}"
    items = [value] if isinstance(value, int) else list(value)
    if not items or not all(isinstance(v, int) for v in items):
        raise DeltaSweepError(f"axis '{var}': give a selector string, a range, or a list of ints, got {value!r}")
    if as_block:
        return "L[" + ", ".join(str(v) for v in items) + "]"
    if items != list(range(items[0], items[0] + len(items))):
        raise DeltaSweepError(f"axis '{var}': positions must be contiguous (a range a..b), got {items}")
    return f"{items[0]}..{items[-1] + 1}"


# ---------------------------------------------------------------------------
# cells
# ---------------------------------------------------------------------------


@attrs.frozen
class Cell:
    """One point of a sweep and its concrete trace (the reference meaning of the cell)."""

    index: int
    point: tuple[tuple[str, int], ...]
    run: ResolvedRun


@attrs.frozen
class Patch:
    """One write of a cell, made concrete: block, value, position and the tensor written (no batch axis)."""

    layer: int
    value: str
    position: int
    tensor: torch.Tensor = attrs.field(eq=False)


@attrs.frozen
class Row:
    """A cell as the engine computes it: from `start_block` on, at positions from `start`."""

    cell: Cell
    start_block: int
    start: int
    patches: tuple[Patch, ...]


def cells_of(run: ResolvedRun) -> list[Cell]:
    """Every cell of a sweep, in the order of `ResolvedRun.points()`."""
    return [Cell(i, tuple(point.items()), run.instantiate(point)) for i, point in enumerate(run.points())]


def measure_label(m: ResolvedMeasure) -> str:
    """How a template measure is named in tables and the CSV: `prob(" Paris")`, or its `as` name."""
    if m.alias is None:
        return m.written
    return m.alias if m.result_name == m.alias else f"{m.alias}.L{m.layer}"


def fast_path_blocker(resolved: Resolved, run: ResolvedRun) -> str | None:
    """Why the engine cannot serve this sweep (the naive path then runs it), or None."""
    if not run.ops or all(op.kind != "write" for op in run.ops):
        return "the body writes nothing"
    writes = [op for op in run.ops if op.kind == "write"]
    for op in run.ops:
        if op.kind == "read":
            return f"it reads {op.written}: reads give a tensor per cell, which only full forwards serve"
        if op.value not in FAST_VALUES:
            return f"it writes {op.written}: the engine recomputes writes of state_after(t) and conv_window_after(t)"
        if op.step is not None:
            return f"it writes {op.written} at a step"
        if isinstance(op.source, Named):
            return f"'{op.written} = NAME' takes a value read in another run"
        if isinstance(op.source, Scale) and any(
                (w.layer, w.layer_var, w.position, w.position_var) != (op.layer, op.layer_var, op.position,
                                                                       op.position_var) for w in writes):
            return f"'{op.written} *= ...' scales a value that another write of the cell may change"
    runs = {r.name: r for r in resolved.runs}
    for m in run.measures:
        if m.step is not None:
            return f"measure {m.written} is at a step"
        if m.kind == "kl" and runs.get(m.against or "") is not None and runs[m.against or ""].kind != "trace":
            return f"kl({m.against}) compares with a generate"
        if m.kind == "norm" and not _norm_is_served(m, writes):
            return (f"measure {m.written}: the engine serves norms of a written site or of a block's "
                    f"state_output only")
    return None


def _norm_is_served(m: ResolvedMeasure, writes: Sequence[ResolvedOp]) -> bool:
    if m.value == "state_output" and m.position is None and m.position_var is None:
        return True
    return any((w.layer, w.layer_var, w.value, w.position, w.position_var)
               == (m.layer, m.layer_var, m.value, m.position, m.position_var) for w in writes)


# ---------------------------------------------------------------------------
# support values: donors, means and reference logits, through the compiler
# ---------------------------------------------------------------------------


@attrs.define
class Support:
    """The values cells take from other runs, asked of one ordinary compiled program.

    The program is the user's own runs (traces, generates; not the sweeps) with extra
    reads added (`sweep#...` keys), plus one clean run per prompt text of a `mean(...)`
    or a prompt named for normalisation.
    """

    resolved: Resolved
    reads: dict[str, list[ResolvedOp]] = attrs.Factory(dict)  # run name -> extra reads
    extra: dict[str, ResolvedRun] = attrs.Factory(dict)  # run name -> an added clean run
    results: dict[str, Any] = attrs.Factory(dict)

    def read(self, run: str, layer: int | None, value: str, position: int | None, step: int | None) -> str:
        """Ask for `value` of `run` (a run of the program or an added one); returns its results key."""
        key = SUPPORT + donor_key(run, layer, value, position, step)[1:]
        ops = self.reads.setdefault(run, [])
        if not any(op.result_name == key for op in ops):
            ops.append(ResolvedOp("read", layer, value, position, step, key,
                                  written=site_text(layer, value, position)))
        return key

    def prompt_run(self, text: str) -> str:
        """The name of an added clean run of `text` (one per text)."""
        for name, r in self.extra.items():
            if r.prompt_text == text:
                return name
        name = f"{SUPPORT}prompt{len(self.extra)}"
        self.extra[name] = ResolvedRun(name, "trace", name, text, (), (), implicit=True)
        return name

    def program(self) -> Resolved | None:
        """The user's runs (no sweeps) with the extra reads, and the added runs; None when empty."""
        kept: list[ResolvedRun] = []
        referenced = _referenced_runs([r for r in self.resolved.runs if r.kind != "sweep"])
        for r in self.resolved.runs:
            if r.kind == "sweep":
                continue
            extra = tuple(self.reads.get(r.name, ()))
            if r.implicit and not r.ops and not r.measures and not extra and r.name not in referenced:
                continue  # a clean run only the sweeps needed
            kept.append(attrs.evolve(r, ops=r.ops + extra) if extra else r)
        for name, r in self.extra.items():
            kept.append(attrs.evolve(r, ops=tuple(self.reads.get(name, ()))))
        return attrs.evolve(self.resolved, runs=tuple(kept)) if kept else None

    def run(self, exp: Experiment) -> dict[str, Any]:
        """Run the program; keep every value, `sweep#` ones included."""
        from .run import Experiment

        program = self.program()
        if program is None:
            return {}
        sub = Experiment(exp.source, exp.model, filename=exp.filename, resolved=program)
        self.results = dict(sub.run())
        return self.results


def _referenced_runs(runs: Iterable[ResolvedRun]) -> set[str]:
    """Runs other runs take values from (`from`, `= NAME`, `kl`)."""
    out: set[str] = set()
    for r in runs:
        for op in r.ops:
            if isinstance(op.source, (FromRun, Named)):
                out.add(op.source.run)
        out.update(m.against for m in r.measures if m.against is not None)
    return out


def _dependencies(resolved: Resolved, names: set[str]) -> list[ResolvedRun]:
    """The non-sweep runs `names` need, transitively, in program order."""
    runs = {r.name: r for r in resolved.runs if r.kind != "sweep"}
    need: set[str] = set()
    todo = [n for n in names if n in runs]
    while todo:
        n = todo.pop()
        if n in need:
            continue
        need.add(n)
        todo.extend(x for x in _referenced_runs([runs[n]]) if x in runs and x not in need)
    return [r for r in resolved.runs if r.name in need]


@attrs.frozen
class Normalise:
    """Normalised effect (patched - corrupted) / (clean - corrupted): the runs (or prompts) named."""

    clean: str
    corrupted: str

    @staticmethod
    def parse(spec: str | Mapping[str, str] | Normalise | None) -> Normalise | None:
        """`clean=RUN,corrupted=RUN` (the CLI's --normalise), a mapping, or a Normalise."""
        if spec is None or isinstance(spec, Normalise):
            return spec
        if isinstance(spec, str):
            pairs = [p.split("=", 1) for p in spec.split(",") if p.strip()]
            if any(len(p) != 2 for p in pairs):
                raise DeltaSweepError(f"--normalise takes clean=RUN,corrupted=RUN, got {spec!r}")
            spec = {k.strip(): v.strip() for k, v in pairs}
        if set(spec) != {"clean", "corrupted"} or not all(spec.values()):
            raise DeltaSweepError(f"normalise names two runs: clean=RUN,corrupted=RUN, got {dict(spec)}")
        return Normalise(spec["clean"], spec["corrupted"])

    def text(self) -> str:
        return f"clean={self.clean},corrupted={self.corrupted}"


def _reference_run(name: str, resolved: Resolved, support: Support) -> str:
    """The run whose logits stand for `name` (a trace, or a prompt's clean run)."""
    for r in resolved.runs:
        if r.name == name:
            if r.kind != "trace":
                raise DeltaSweepError(f"normalise takes traces or prompts; '{name}' is a {r.kind}")
            return name
    text = resolved.prompts.get(name)
    if isinstance(text, str):
        return support.prompt_run(text)
    options = [r.name for r in resolved.runs if r.kind == "trace"] + [k for k, v in resolved.prompts.items()
                                                                       if isinstance(v, str)]
    raise DeltaSweepError(f"normalise: no trace or prompt named '{name}'; one of: {', '.join(options)}")


# ---------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------


def _decoder(hf: torch.nn.Module) -> Any:
    """The decoder stack (`.layers`, `.norm`, `.config`), wherever the architecture keeps it."""
    inner = getattr(hf, "model", hf)
    return getattr(inner, "language_model", inner)


@attrs.define
class Capture:
    """What one clean forward of the sweep's prompt leaves for the cells."""

    seq_len: int
    inputs: dict[int, torch.Tensor]  # block -> the residual stream entering it [1, s, hidden]
    kwargs: dict[int, dict[str, Any]]  # block -> its call's keyword arguments (cache removed)
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # attention block -> the cache's keys, values
    values: dict[tuple[str, int, int | None], torch.Tensor]  # (value, block, position) -> [1, ...]


def capture_clean(model: DeltaModel, text: str, first_block: int, reads: Mapping[int, set[tuple[str, int | None]]]
                  ) -> Capture:
    """One clean forward of `text`: block inputs, call arguments, keys/values, and the asked values.

    `reads`: DeltaNet block -> {(value, position)} with value one of state_after,
    conv_window_after (a position) or state_output (None). Read through the value
    layer in forward order; block inputs and arguments through forward pre-hooks.
    """
    from transformers import DynamicCache

    hf = model._module
    layers = _decoder(hf).layers
    inputs: dict[int, torch.Tensor] = {}
    kwargs: dict[int, dict[str, Any]] = {}

    def recorder(i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, kw: dict) -> None:
            inputs[i] = args[0] if args else kw["hidden_states"]
            kwargs[i] = {k: v for k, v in kw.items() if k != "hidden_states"}
        return hook

    hooks = [layers[i].register_forward_pre_hook(recorder(i), with_kwargs=True)
             for i in range(first_block, len(layers))]
    cache = DynamicCache(config=hf.config)
    saved: dict[tuple[str, int, int | None], Any] = {}
    order = {"conv_window_after": 0, "state_after": 1, "state_output": 2}
    try:
        with torch.no_grad(), model.trace(text, cache=cache, use_cache=True):
            for i in sorted(reads):
                mixer = model.layers[i].linear_attn
                for value, p in sorted(reads[i], key=lambda vp: (order[vp[0]], vp[1] or 0)):
                    if value == "state_output":
                        saved[(value, i, None)] = mixer.state_output.save()
                    elif value == "state_after":
                        saved[(value, i, p)] = mixer.state_after(p).save()
                    else:
                        saved[(value, i, p)] = mixer.conv_window_after(p).save()
    finally:
        for h in hooks:
            h.remove()
    kv = {}
    for i in range(len(layers)):  # every attention block: masks are sized by the first one's cache
        if model.spec.kind(i) == values.ATTENTION:
            layer: Any = cache.layers[i]
            if getattr(layer, "keys", None) is None:
                raise _Unsupported(f"block {i}'s cache holds no keys ({type(layer).__name__})")
            kv[i] = (layer.keys, layer.values)
    missing = [i for i in range(first_block, len(layers)) if i not in inputs or "cache" not in kwargs[i]]
    if missing:
        raise _Unsupported(f"blocks {missing} were not called with a cache")
    seq_len = int(next(iter(inputs.values())).shape[1])
    return Capture(seq_len, inputs, kwargs, kv, {k: v for k, v in saved.items()})


class _FrozenAttention:
    """Builds an attention block's cache layer holding the clean prefix's keys and values."""

    @staticmethod
    def make(keys: torch.Tensor, vals: torch.Tensor, rows: int) -> Any:
        from transformers.cache_utils import DynamicLayer

        class FrozenAttentionLayer(DynamicLayer):
            """The prefix's keys/values for `rows` rows; a call attends to them and its own, and stores nothing."""

            def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                       **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
                keys: Any = self.keys
                vals: Any = self.values
                return torch.cat([keys, key_states], dim=-2), torch.cat([vals, value_states], dim=-2)

        layer: Any = FrozenAttentionLayer()
        layer.keys = keys.expand(rows, *keys.shape[1:])
        layer.values = vals.expand(rows, *vals.shape[1:])
        layer.is_initialized = True
        layer.device = keys.device
        return layer


class _FrozenLinear:
    """Builds a DeltaNet block's cache layer holding the state and conv window after the prefix."""

    @staticmethod
    def make(window: torch.Tensor | None, state: torch.Tensor | None, width: int, rows: int) -> Any:
        from transformers.cache_utils import LinearAttentionLayer

        class FrozenLinearLayer(LinearAttentionLayer):
            """State and window after the prefix; records the call's final state instead of storing it."""

            final: torch.Tensor | None = None

            def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0,
                                  conv_kernel_size: int | None = None, **kw: Any) -> torch.Tensor:
                if not self.has_previous_state[state_idx]:
                    short = width - conv_states.shape[-1]
                    return torch.nn.functional.pad(conv_states, (short, 0)) if short > 0 else conv_states
                cached: Any = self.conv_states[state_idx]
                return torch.cat([cached, conv_states], dim=-1)

            def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0,
                                       **kw: Any) -> torch.Tensor:
                self.final = recurrent_states
                return recurrent_states

        layer: Any = FrozenLinearLayer()
        layer.conv_kernel_size[0] = width
        if window is not None and state is not None:
            # the cache keeps `width` columns; the first is never read by a continuation
            conv = torch.cat([torch.zeros_like(window[..., :1]), window], dim=-1)
            layer.conv_states[0] = conv.expand(rows, *conv.shape[1:]).clone()  # a decode step updates it in place
            layer.recurrent_states[0] = state.expand(rows, *state.shape[1:])
            layer.has_previous_state[0] = True
            layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
            layer.device, layer.dtype = window.device, window.dtype
        return layer


def _prefix_cache(model: DeltaModel, cap: Capture, start: int) -> Any:
    """A transformers cache of the clean prefix [0, start), one row per block (resized per call)."""
    from transformers.cache_utils import Cache

    layers: list[Any] = []
    width = model.spec.dims.get("conv_width", 4)
    for i in range(model.spec.num_layers):
        if model.spec.kind(i) == values.ATTENTION:
            keys, vals = cap.kv[i]
            layers.append(_FrozenAttention.make(keys[..., :start, :], vals[..., :start, :], 1))
        else:
            layers.append(_prefix_linear(cap, i, start, width, 1))
    return Cache(layers=layers)


def _prefix_linear(cap: Capture, i: int, start: int, width: int, rows: int) -> Any:
    if start == 0 or ("state_after", i, start - 1) not in cap.values:
        return _FrozenLinear.make(None, None, width, rows)
    return _FrozenLinear.make(cap.values[("conv_window_after", i, start - 1)][0:1],
                              cap.values[("state_after", i, start - 1)][0:1], width, rows)


def _resize(model: DeltaModel, cache: Any, cap: Capture, i: int, start: int, rows: int) -> None:
    """Give block i's cache layer `rows` rows."""
    if model.spec.kind(i) == values.ATTENTION:
        keys, vals = cap.kv[i]
        cache.layers[i] = _FrozenAttention.make(keys[..., :start, :], vals[..., :start, :], rows)
    else:
        cache.layers[i] = _prefix_linear(cap, i, start, model.spec.dims.get("conv_width", 4), rows)


def _masks(model: DeltaModel, cap: Capture, cache: Any, start: int) -> dict[str, Any]:
    """The attention masks of a continuation from `start`, per layer type, as the model makes them."""
    from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask

    hf = model._module
    config = _decoder(hf).config
    some = next(iter(cap.inputs.values()))
    dummy = torch.empty(1, cap.seq_len - start, some.shape[-1], dtype=some.dtype, device=some.device)
    positions = torch.arange(start, cap.seq_len, device=some.device)[None]
    out: dict[str, Any] = {}
    for kind in set(model.spec.layer_types):
        if kind == "full_attention":
            out[kind] = create_causal_mask(config=config, inputs_embeds=dummy, attention_mask=None, cache=cache,
                                           position_ids=positions)
        elif kind == "linear_attention":
            out[kind] = create_recurrent_attention_mask(config=config, inputs_embeds=dummy, attention_mask=None,
                                                        cache=cache)
        else:
            raise _Unsupported(f"layer type {kind!r}")
    return out


def _call_kwargs(kw: Mapping[str, Any], start: int, cache: Any, mask: Any) -> dict[str, Any]:
    """A block's clean call arguments, cut to positions start.. of a continuation over `cache`."""
    out = dict(kw)
    out["cache"] = cache
    if "attention_mask" in out:
        out["attention_mask"] = mask
    pe = out.get("position_embeddings")
    if pe is not None:
        out["position_embeddings"] = tuple(x[..., start:, :] for x in pe)
    pid = out.get("position_ids")
    if isinstance(pid, torch.Tensor):
        out["position_ids"] = pid[..., start:]
    return out


@attrs.frozen
class RowsOut:
    """What one forward of rows gives: next-token logits and the state_output of asked blocks."""

    logits: torch.Tensor  # [rows, vocab]
    state_outputs: dict[int, torch.Tensor]  # block -> [rows, heads, key_dim, value_dim]


def run_rows(model: DeltaModel, cap: Capture, rows: Sequence[Row], start: int,
             state_outputs: Iterable[int] = ()) -> RowsOut:
    """Recompute blocks from each row's start block at positions start.., the rows' writes applied.

    `rows` are sorted by start block: at block i the rows starting at or before i
    (a prefix of the batch) are computed; the others still hold the clean stream.
    """
    hf = model._module
    dec = _decoder(hf)
    starts = [r.start_block for r in rows]
    assert starts == sorted(starts), "rows must be sorted by start block"
    cache = _prefix_cache(model, cap, start)
    masks = _masks(model, cap, cache, start)
    want = set(state_outputs)
    finals: dict[int, torch.Tensor] = {}
    h: torch.Tensor | None = None
    for i in range(starts[0], model.spec.num_layers):
        k = bisect.bisect_right(starts, i)
        have = 0 if h is None else h.shape[0]
        if k > have:
            fresh = cap.inputs[i][:, start:].expand(k - have, -1, -1)
            h = fresh if h is None else torch.cat([h, fresh], dim=0)
        assert h is not None
        _resize(model, cache, cap, i, start, k)
        site = _site(model, i)
        if site is not None:
            site.direct = _direct_writes(rows[:k], i, start)
        try:
            out = dec.layers[i](h, **_call_kwargs(cap.kwargs[i], start, cache, masks[model.spec.layer_types[i]]))
        finally:
            if site is not None:
                site.direct = {}
        h = out[0] if isinstance(out, tuple) else out
        final = getattr(cache.layers[i], "final", None) if i in want else None
        if final is not None:
            finals[i] = final
    assert h is not None
    logits = hf.get_output_embeddings()(dec.norm(h[:, -1:]))[:, -1]
    return RowsOut(logits, finals)


def _site(model: DeltaModel, i: int) -> Any:
    if model.spec.kind(i) != values.DELTANET:
        return None
    mixer = getattr(_decoder(model._module).layers[i], model.family.mixer_attr)
    return getattr(mixer, "_deltalang_site", None)


def _direct_writes(rows: Sequence[Row], layer: int, start: int) -> dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]:
    """The writes rows make at `layer`, keyed (value, position in the call) -> (row indices, values)."""
    by_site: dict[tuple[str, int], list[tuple[int, torch.Tensor]]] = {}
    for n, row in enumerate(rows):
        for p in row.patches:
            if p.layer == layer:
                by_site.setdefault((p.value, p.position - start), []).append((n, p.tensor))
    out = {}
    for key, items in by_site.items():
        idx = torch.tensor([n for n, _ in items], dtype=torch.long, device=items[0][1].device)
        out[key] = (idx, torch.stack([t for _, t in items]))
    return out


# ---------------------------------------------------------------------------
# planning one sweep
# ---------------------------------------------------------------------------


@attrs.define
class SweepJob:
    """One sweep of a program: its cells, and how they run."""

    run: ResolvedRun
    cells: list[Cell]
    blocker: str | None  # why the engine cannot serve it (None: the engine runs it)
    reference_keys: dict[str, str] = attrs.Factory(dict)  # run name -> support key of its logits
    donor_keys: dict[int, list[str | list[str]]] = attrs.Factory(dict)  # cell -> per write: key(s)
    normalise: tuple[str, str] | None = None  # support keys of the clean and corrupted logits

    @property
    def fast(self) -> bool:
        return self.blocker is None

    @property
    def name(self) -> str:
        return self.run.name

    def writes(self, cell: Cell) -> list[ResolvedOp]:
        return [op for op in cell.run.ops if op.kind == "write"]


def plan_job(exp: Experiment, run: ResolvedRun, support: Support, normalise: Normalise | None,
             engine: str) -> SweepJob:
    """Decide the path of one sweep and ask `support` for the values it takes from other runs."""
    cells = cells_of(run)
    blocker = fast_path_blocker(exp.resolved, run) if engine != "naive" else "the naive path was asked for"
    job = SweepJob(run, cells, blocker)
    if normalise is not None:
        job.normalise = (support.read(_reference_run(normalise.clean, exp.resolved, support), None, "logits", None,
                                      None),
                         support.read(_reference_run(normalise.corrupted, exp.resolved, support), None, "logits",
                                      None, None))
    if job.fast or normalise is not None:  # kl's reference logits (the naive path needs them to normalise)
        for m in run.measures:
            if m.kind == "kl" and m.against is not None:
                job.reference_keys[m.against] = support.read(m.against, None, "logits", None, None)
    if not job.fast:
        return job
    for cell in cells:
        keys: list[str | list[str]] = []
        for op in job.writes(cell):
            src = op.source
            if isinstance(src, FromRun):
                keys.append(support.read(src.run, src.layer, src.value, src.position, src.step))
            elif isinstance(src, Mean):
                keys.append([support.read(support.prompt_run(text), op.layer,
                                          op.value, src.positions[n] if src.positions is not None else None, None)
                             for n, text in enumerate(src.texts)])
            else:
                keys.append("")
        job.donor_keys[cell.index] = keys
    return job


# ---------------------------------------------------------------------------
# rows of results, the store on disk, tables
# ---------------------------------------------------------------------------


@attrs.frozen
class ResultRow:
    """One value of one cell: a measure (at a position, for per-token measures)."""

    sweep: str
    cell: int
    point: tuple[tuple[str, int], ...]
    measure: str
    position: int | None
    value: float


@attrs.define
class SweepTable:
    """A sweep's results: its axes, tokens and every value, for tables, CSV and plots."""

    name: str
    axes: tuple[SweepAxis, ...]
    tokens: tuple[str, ...]  # the prompt's tokens, as text
    measures: list[str]
    rows: list[ResultRow] = attrs.Factory(list)

    def grid(self, measure: str) -> dict[tuple[int, ...], float]:
        """{axis values: value} of a scalar measure."""
        return {tuple(v for _, v in r.point): r.value for r in self.rows
                if r.measure == measure and r.position is None}

    def curves(self, measure: str) -> dict[tuple[int, ...], list[float]]:
        """{axis values: per-token values} of a per-token measure."""
        out: dict[tuple[int, ...], dict[int, float]] = {}
        for r in self.rows:
            if r.measure == measure and r.position is not None:
                out.setdefault(tuple(v for _, v in r.point), {})[r.position] = r.value
        return {k: [v[p] for p in sorted(v)] for k, v in out.items()}

    def per_token(self, measure: str) -> bool:
        return any(r.measure == measure and r.position is not None for r in self.rows)

    def label(self, axis: SweepAxis, value: int) -> str:
        """`L3` for a block, `5 ␣Tower` for a position."""
        if axis.kind == "block":
            return f"L{value}"
        tok = self.tokens[value] if 0 <= value < len(self.tokens) else "?"
        return f"{value} {tok}"


def token_texts(model: DeltaModel, run: ResolvedRun) -> tuple[str, ...]:
    """Each token of the run's prompt as text, spaces shown as '␣'."""
    tok = model.tokenizer
    return tuple((tok.decode([i]) or "?").replace(" ", "␣").replace("\n", "⏎") for i in run.token_ids)


def _fsync(f: Any) -> None:
    f.flush()
    try:
        os.fsync(f.fileno())
    except OSError:  # pragma: no cover - some filesystems
        pass


class SweepStore:
    """`DIR/sweep.csv` appended as cells finish, `DIR/sweep.json` saying what the sweep is and which cells are done.

    The CSV rows of a chunk are written and synced before the chunk's cells are
    marked done, so after a crash the CSV holds every cell marked done (and maybe
    a torn tail, dropped on resume).
    """

    def __init__(self, directory: Path, meta: dict[str, Any], columns: list[str], resume: bool,
                 locate: Callable[[list[str]], tuple[str, int] | None]) -> None:
        self.dir = directory
        self.locate = locate
        self.csv = directory / CSV_NAME
        self.meta_path = directory / META_NAME
        self.columns = columns
        self.done: dict[str, set[int]] = {}
        self.rows: dict[tuple[str, int], list[list[str]]] = {}  # (sweep, cell) -> CSV rows
        directory.mkdir(parents=True, exist_ok=True)
        old = self.peek(directory)
        if resume:
            self._check_resumable(old, meta)
            assert old is not None
            self.done = {k: set(v) for k, v in old.get("done", {}).items()}
            self._load_rows()
        elif old is not None and not old.get("complete", False):
            n = sum(len(v) for v in old.get("done", {}).values())
            raise DeltaSweepError(f"{directory} holds an unfinished sweep ({n} cell(s) done): rerun with --resume to "
                                  f"continue it, or choose another --out (or delete {directory})")
        self.meta = dict(meta, done={k: sorted(v) for k, v in self.done.items()}, complete=False)
        self._write_meta()
        self._rewrite()

    @staticmethod
    def peek(directory: Path) -> dict[str, Any] | None:
        """The sweep.json in `directory`, if any."""
        path = directory / META_NAME
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            raise DeltaSweepError(f"{path} does not parse; delete {directory} to start over") from None

    def _check_resumable(self, old: dict[str, Any] | None, meta: dict[str, Any]) -> None:
        if old is None:
            raise DeltaSweepError(f"nothing to resume in {self.dir}: it holds no {META_NAME}")
        if old.get("program_sha256") != meta["program_sha256"]:
            raise DeltaSweepError(
                f"{self.dir} holds a sweep of another program (sha256 {str(old.get('program_sha256'))[:12]}..., "
                f"this one {meta['program_sha256'][:12]}...): --resume continues the same program only; "
                f"choose another --out to start this one")
        for key, what in (("model", "model"), ("normalise", "--normalise"), ("prompt", "--prompt")):
            if old.get(key) != meta.get(key):
                raise DeltaSweepError(f"{self.dir} was run with {what} {old.get(key)!r}, this run has "
                                      f"{meta.get(key)!r}: --resume continues the same sweep only")

    def _load_rows(self) -> None:
        if not self.csv.exists():
            return
        text = self.csv.read_text()
        if not text.endswith("\n"):
            text = text[: text.rfind("\n") + 1]  # a torn last line
        reader = csv.reader(io.StringIO(text))
        header = next(reader, None)
        if header != self.columns:
            raise DeltaSweepError(f"{self.csv} has columns {header}, expected {self.columns}")
        for row in reader:
            where = self.locate(row)
            if where is not None and where[1] in self.done.get(where[0], set()):
                self.rows.setdefault(where, []).append(row)
        for sweep, cells in self.done.items():  # a cell marked done must have its rows
            lost = {c for c in cells if (sweep, c) not in self.rows}
            cells -= lost

    def _write_meta(self) -> None:
        tmp = self.meta_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.meta, indent=1))
        os.replace(tmp, self.meta_path)

    def _rewrite(self) -> None:
        """The CSV with every done cell, in cell order (atomically)."""
        tmp = self.csv.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(self.columns)
            for key in sorted(self.rows):
                w.writerows(self.rows[key])
            _fsync(f)
        os.replace(tmp, self.csv)

    def is_done(self, sweep: str, cell: int) -> bool:
        return cell in self.done.get(sweep, set())

    def add(self, sweep: str, cells: dict[int, list[list[str]]]) -> None:
        """Append the rows of finished cells, sync, then mark them done."""
        with open(self.csv, "a", newline="") as f:
            w = csv.writer(f)
            for rows in cells.values():
                w.writerows(rows)
            _fsync(f)
        for cell, rows in cells.items():
            self.rows[(sweep, cell)] = rows
        self.done.setdefault(sweep, set()).update(cells)
        self.meta["done"] = {k: sorted(v) for k, v in self.done.items()}
        self._write_meta()

    def finish(self) -> None:
        """Rewrite the CSV in cell order, each cell once; mark the sweep complete."""
        self._rewrite()
        self.meta["complete"] = True
        self._write_meta()


FIXED_COLUMNS = ("sweep", "measure", "position", "value")


def axis_column(var: str) -> str:
    """The CSV column of a sweep variable (`axis_value` if the variable is called `value`, ...)."""
    return f"axis_{var}" if var in FIXED_COLUMNS else var


def csv_columns(jobs: Sequence[SweepJob]) -> list[str]:
    """`sweep`, every sweep's variables (first seen first), `measure`, `position`, `value`."""
    axes: list[str] = []
    for job in jobs:
        axes.extend(axis_column(a.var) for a in job.run.axes if axis_column(a.var) not in axes)
    return ["sweep", *axes, "measure", "position", "value"]


def csv_rows(rows: Iterable[ResultRow], columns: list[str]) -> dict[int, list[list[str]]]:
    """CSV rows per cell."""
    out: dict[int, list[list[str]]] = {}
    for r in rows:
        point = {axis_column(k): v for k, v in r.point}
        line = [r.sweep] + [str(point[c]) if c in point else "" for c in columns[1:-3]]
        line += [r.measure, "" if r.position is None else str(r.position), repr(float(r.value))]
        out.setdefault(r.cell, []).append(line)
    return out


def rows_from_csv(lines: Iterable[list[str]], columns: list[str], job: SweepJob, cell: int) -> list[ResultRow]:
    """The ResultRows of one cell read back from the CSV."""
    out = []
    axes = [a.var for a in job.run.axes]
    for line in lines:
        rec = dict(zip(columns, line))
        point = tuple((v, int(rec[axis_column(v)])) for v in axes)
        pos = int(rec["position"]) if rec["position"] else None
        out.append(ResultRow(job.name, cell, point, rec["measure"], pos, float(rec["value"])))
    return out


def cell_locator(jobs: Sequence[SweepJob], columns: list[str]) -> Callable[[list[str]], tuple[str, int] | None]:
    """Which (sweep, cell) a CSV row belongs to, by its sweep name and axis values."""
    index: dict[tuple[str, tuple[str, ...]], int] = {}
    for job in jobs:
        for cell in job.cells:
            point = {axis_column(k): v for k, v in cell.point}
            index[(job.name, tuple(str(point[c]) if c in point else "" for c in columns[1:-3]))] = cell.index

    def locate(row: list[str]) -> tuple[str, int] | None:
        if len(row) != len(columns):
            return None
        found = index.get((row[0], tuple(row[1:-3])))
        return None if found is None else (row[0], found)

    return locate


# ---------------------------------------------------------------------------
# batch sizes
# ---------------------------------------------------------------------------

MAX_ROWS = {"cpu": 64, "cuda": 512}  # rows per forward at most, by device type


def memory_budget(device: torch.device) -> int:
    """Bytes a sweep's forwards may use: half the free GPU memory, else a quarter of free RAM (at most 4 GiB)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free // 2)
    available = 8 << 30
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(min(available // 4, 4 << 30))


def row_bytes(model: DeltaModel, positions: int) -> int:
    """A generous estimate of one row's activations through one block at `positions` positions."""
    cfg = _decoder(model._module).config
    d = model.spec.dims
    hidden = int(cfg.hidden_size)
    inter = int(getattr(cfg, "intermediate_size", None) or 4 * hidden)
    size = torch.finfo(model._module.dtype).bits // 8 if model._module.dtype.is_floating_point else 4
    per_token = (12 * hidden + 4 * inter + 3 * d.get("conv_dim", hidden) + 4 * d["heads"] * 64) * max(size, 4)
    state = d["heads"] * d["key_dim"] * d["value_dim"] * 4
    return positions * per_token + 6 * state + int(getattr(cfg, "vocab_size", 0)) * 4


def default_batch_size(model: DeltaModel, positions: int) -> int:
    """Rows per forward that fit the memory budget (at most 64 on a CPU, 512 on a GPU)."""
    device = _device(model)
    cap = MAX_ROWS.get(device.type, MAX_ROWS["cpu"])
    return max(1, min(cap, memory_budget(device) // max(1, row_bytes(model, positions))))


def _chunks(items: Sequence[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield list(items[i:i + size])


# ---------------------------------------------------------------------------
# computing cells
# ---------------------------------------------------------------------------


@attrs.define
class _Context:
    """What the cells of one run of `run_sweeps` share."""

    exp: Experiment
    support: dict[str, Any]
    emit: Callable[[SweepJob, dict[int, list[ResultRow]], dict[str, Any]], None]


def _start(op: ResolvedOp) -> tuple[int, int]:
    assert op.layer is not None and op.position is not None
    return op.layer, op.position


def _fast_rows_plan(job: SweepJob, cells: Sequence[Cell]) -> dict[int, list[Cell]]:
    """Cells by start position, each group sorted by start block (then cell order)."""
    groups: dict[int, list[Cell]] = {}
    for cell in cells:
        starts = [_start(op) for op in job.writes(cell)]
        groups.setdefault(min(p for _, p in starts), []).append(cell)
    for group in groups.values():
        group.sort(key=lambda c: (min(_start(op)[0] for op in job.writes(c)), c.index))
    return dict(sorted(groups.items()))


def _capture_reads(model: DeltaModel, job: SweepJob, groups: Mapping[int, Sequence[Cell]]
                   ) -> tuple[int, dict[int, set[tuple[str, int | None]]]]:
    """The first block any cell recomputes, and the values the clean forward must keep per DeltaNet block."""
    linear = model.spec.linear_layers()
    reads: dict[int, set[tuple[str, int | None]]] = {}
    first = model.spec.num_layers
    for start, group in groups.items():
        lowest = min(min(_start(op)[0] for op in job.writes(c)) for c in group)
        first = min(first, lowest)
        if start > 0:
            for i in linear:
                if i >= lowest:
                    reads.setdefault(i, set()).update({("state_after", start - 1), ("conv_window_after", start - 1)})
        for cell in group:
            for op in job.writes(cell):
                if isinstance(op.source, Scale):
                    assert op.layer is not None
                    reads.setdefault(op.layer, set()).add((op.value, op.position))
    for m in job.run.measures:
        if m.kind == "norm" and m.value == "state_output":
            for cell in job.cells:
                bound = cell.run.measures[job.run.measures.index(m)]
                if bound.layer is not None:
                    reads.setdefault(bound.layer, set()).add(("state_output", None))
    return first, reads


def _patches(ctx: _Context, job: SweepJob, cell: Cell, cap: Capture) -> tuple[Patch, ...]:
    """A cell's writes with the tensors they write (no batch axis)."""
    model = ctx.exp.model
    out = []
    for op, key in zip(job.writes(cell), job.donor_keys[cell.index], strict=True):
        assert op.layer is not None and op.position is not None
        like = cap.values.get((op.value, op.layer, op.position))
        src = op.source
        if isinstance(src, Zeros):
            tensor = torch.zeros(_shape(model, op.value), dtype=_dtype(model, op.value), device=_device(model))
        elif isinstance(src, Scale):
            assert like is not None
            tensor = like[0] * src.factor
        elif isinstance(src, FromRun):
            tensor = ctx.support[str(key)][0]
        elif isinstance(src, Mean):
            tensor = torch.stack([ctx.support[k] for k in key]).mean(dim=0)[0]
        else:  # pragma: no cover - fast_path_blocker refuses the rest
            raise _Unsupported(f"source {src!r}")
        out.append(Patch(op.layer, op.value, op.position, tensor.to(device=_device(model),
                                                                     dtype=_dtype(model, op.value))))
    return tuple(out)


def _device(model: DeltaModel) -> torch.device:
    return next(model._module.parameters()).device


def _dtype(model: DeltaModel, value: str) -> torch.dtype:
    return torch.float32 if value == "state_after" else model._module.dtype


def _shape(model: DeltaModel, value: str) -> tuple[int, ...]:
    d = model.spec.dims
    if value == "state_after":
        return (d["heads"], d["key_dim"], d["value_dim"])
    return (d["conv_dim"], d["conv_width"] - 1)


def _logit_measure(m: ResolvedMeasure, logits: torch.Tensor, support: Mapping[str, Any],
                   references: Mapping[str, str]) -> float:
    """A prob/rank/logit_diff/kl measure of next-token logits `[1, vocab]` (or `[1, s, vocab]`)."""
    if m.kind == "prob":
        return float(measures.prob(logits, m.token_ids[0]))
    if m.kind == "rank":
        return float(measures.rank(logits, m.token_ids[0]))
    if m.kind == "logit_diff":
        return float(measures.logit_diff(logits, m.token_ids[0], m.token_ids[1]))
    assert m.kind == "kl" and m.against is not None
    return float(measures.kl(logits, support[references[m.against]]))


def _normalised_rows(ctx: _Context, job: SweepJob, cell: Cell, values_: Mapping[str, float]) -> list[ResultRow]:
    """(patched - corrupted) / (clean - corrupted) for each logit measure of the cell."""
    if job.normalise is None:
        return []
    clean, corrupted = (ctx.support[k] for k in job.normalise)
    out = []
    for m in job.run.measures:
        if m.kind not in LOGIT_MEASURES:
            continue
        label = measure_label(m)
        refs = dict(job.reference_keys)
        if m.kind == "kl" and m.against not in refs:
            continue
        c, k = _logit_measure(m, clean, ctx.support, refs), _logit_measure(m, corrupted, ctx.support, refs)
        effect = (values_[label] - k) / (c - k) if c != k else math.nan
        out.append(ResultRow(job.name, cell.index, cell.point, f"normalised({label})", None, effect))
    return out


def run_fast(ctx: _Context, job: SweepJob, todo: Sequence[Cell], batch: int) -> None:
    """The engine: one clean capture, then each group of cells recomputed from its start position.

    The capture and the forwards' rows are laid out from all the sweep's cells, and a
    forward runs if one of its cells is in `todo`: a resumed sweep computes every cell
    exactly as an uninterrupted one (same kernel splits, same batches), bit for bit.
    """
    model = ctx.exp.model
    wanted = {c.index for c in todo}
    groups = _fast_rows_plan(job, job.cells)
    with _routed(model, job.run.route):
        for wave in _waves(model, groups):
            if not any(wanted.intersection(c.index for c in wave[start]) for start in wave):
                continue
            first, reads = _capture_reads(model, job, wave)
            cap = capture_clean(model, job.run.prompt_text, first, reads)
            outputs = sorted({i for i in model.spec.linear_layers()
                              if ("state_output", None) in reads.get(i, set())})
            for start, group in wave.items():
                for chunk in _chunks(group, batch):
                    if wanted.intersection(c.index for c in chunk):
                        _run_chunk(ctx, job, cap, chunk, start, outputs, wanted)


PREFIX_BYTES = 1 << 30  # the clean states one capture keeps, at most (a constant: resumed runs split alike)


def _waves(model: DeltaModel, groups: Mapping[int, list[Cell]]) -> list[dict[int, list[Cell]]]:
    """Start positions split into waves whose prefix states fit PREFIX_BYTES: one clean capture each."""
    d = model.spec.dims
    per_start = len(model.spec.linear_layers()) * 4 * (d["heads"] * d["key_dim"] * d["value_dim"]
                                                       + d["conv_dim"] * d["conv_width"])
    size = max(1, PREFIX_BYTES // max(1, per_start))
    starts = list(groups)
    return [{t: groups[t] for t in starts[i:i + size]} for i in range(0, len(starts), size)]


def _run_chunk(ctx: _Context, job: SweepJob, cap: Capture, chunk: Sequence[Cell], start: int,
               outputs: Sequence[int], wanted: set[int]) -> None:
    """One forward of a chunk of cells with the same start position; emits the wanted ones."""
    rows = [Row(c, min(op.layer or 0 for op in job.writes(c)), start, _patches(ctx, job, c, cap)) for c in chunk]
    with torch.no_grad():
        got = run_rows(ctx.exp.model, cap, rows, start, outputs)
    done: dict[int, list[ResultRow]] = {}
    results: dict[str, Any] = {}
    for n, row in enumerate(rows):
        if row.cell.index in wanted:
            done[row.cell.index] = _fast_cell_rows(ctx, job, row, n, got, cap, results)
    ctx.emit(job, done, results)


def _fast_cell_rows(ctx: _Context, job: SweepJob, row: Row, n: int, got: RowsOut, cap: Capture,
                    results: dict[str, Any]) -> list[ResultRow]:
    cell = row.cell
    logits = got.logits[n:n + 1].float()
    out: list[ResultRow] = []
    by_label: dict[str, float] = {}
    for m, bound in zip(job.run.measures, cell.run.measures, strict=True):
        if m.kind in LOGIT_MEASURES:
            value = _logit_measure(bound, logits, ctx.support, job.reference_keys)
        else:
            value = float(measures.norm(_norm_input(bound, row, n, got, cap)[None]))
        label = measure_label(m)
        by_label[label] = value
        results[bound.result_name] = value
        out.append(ResultRow(job.name, cell.index, cell.point, label, None, value))
    for r in _normalised_rows(ctx, job, cell, by_label):
        results[f"{cell.run.name}.{r.measure}"] = r.value
        out.append(r)
    return out


def _norm_input(m: ResolvedMeasure, row: Row, n: int, got: RowsOut, cap: Capture) -> torch.Tensor:
    """The value a served norm measure reads: a written site's value, or a block's state_output."""
    for p in row.patches:
        if (p.layer, p.value, p.position) == (m.layer, m.value, m.position):
            return p.tensor
    assert m.value == "state_output" and m.layer is not None
    final = got.state_outputs.get(m.layer)
    if final is not None and m.layer >= row.start_block:
        return final[n]
    return cap.values[("state_output", m.layer, None)][0]


def _routed(model: DeltaModel, route: str | None) -> Any:
    """Route the model family's prompt kernel for a while (a sweep's `route torch`), then restore it."""
    from contextlib import nullcontext

    from .kernels import routed

    return nullcontext() if route is None else routed(model.family, route)


def run_naive(ctx: _Context, job: SweepJob, cells: Sequence[Cell], batch: int) -> None:
    """The reference path: the `cells` as invokes of full forwards, `batch` per forward."""
    from .run import Experiment

    exp = ctx.exp
    deps = _dependencies(exp.resolved, _referenced_runs([job.run]))
    wanted = {c.index for c in cells}
    for chunk in _chunks(job.cells, batch):  # laid out from all cells, as in run_fast
        if not wanted.intersection(c.index for c in chunk):
            continue
        program = attrs.evolve(exp.resolved, runs=tuple(deps) + tuple(c.run for c in chunk))
        got = Experiment(exp.source, exp.model, filename=exp.filename, resolved=program).run()
        done: dict[int, list[ResultRow]] = {}
        results: dict[str, Any] = {}
        for cell in chunk:
            if cell.index not in wanted:
                continue
            rows: list[ResultRow] = []
            by_label: dict[str, float] = {}
            for m, bound in zip(job.run.measures, cell.run.measures, strict=True):
                value, label = got[bound.result_name], measure_label(m)
                results[bound.result_name] = value
                if isinstance(value, torch.Tensor):
                    flat = value.detach().float().reshape(-1).tolist()
                    rows.extend(ResultRow(job.name, cell.index, cell.point, label, p, v) for p, v in enumerate(flat))
                else:
                    by_label[label] = float(value)
                    rows.append(ResultRow(job.name, cell.index, cell.point, label, None, float(value)))
            for r in _normalised_rows(ctx, job, cell, by_label):
                results[f"{cell.run.name}.{r.measure}"] = r.value
                rows.append(r)
            for op in cell.run.ops:
                if op.kind == "read" and op.result_name in got:
                    results[op.result_name] = got[op.result_name]
            done[cell.index] = rows
        ctx.emit(job, done, results)


# ---------------------------------------------------------------------------
# driving it: run_sweeps, progress, tables, the command
# ---------------------------------------------------------------------------


@attrs.define
class SweepOutcome:
    """What `run_sweeps` returns: every result by name, a table per sweep, the files written."""

    results: Results
    tables: list[SweepTable]
    files: list[Path] = attrs.Factory(list)
    paths: dict[str, str] = attrs.Factory(dict)  # sweep -> "engine" | "naive: why"


class _Progress:
    """A rich progress bar (cells done, rate, time left), or nothing."""

    def __init__(self, console: Console | None, total: int) -> None:
        self.bar: Any = None
        if console is None or total == 0:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        class Rate(ProgressColumn):
            def render(self, task: Any) -> Text:
                speed = task.finished_speed or task.speed
                return Text("" if speed is None else f"{speed:.2f} cells/s", style="progress.data.speed")

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("cells"), Rate(), TimeElapsedColumn(), TextColumn("elapsed,"),
                            TimeRemainingColumn(), TextColumn("left"), console=console, transient=False)
        self.task = self.bar.add_task("sweep", total=total)

    def __enter__(self) -> _Progress:  # noqa: PYI034
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def advance(self, n: int, name: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=n, description=name)


def _work_share(model: DeltaModel, job: SweepJob, cells: Sequence[Cell]) -> float:
    """The engine's work in full forwards: the sum over cells of (blocks from L) x (positions from t) shares."""
    n, s = model.spec.num_layers, len(job.run.token_ids)
    total = 0.0
    for c in cells:
        starts = [_start(op) for op in job.writes(c)]
        total += (n - min(b for b, _ in starts)) / n * (s - min(p for _, p in starts)) / max(1, s)
    return total


def _describe(model: DeltaModel, job: SweepJob, cells: Sequence[Cell], batch: int) -> str:
    axes = " x ".join(f"{a.var}: {len(a.values)} {'blocks' if a.kind == 'block' else 'positions'}"
                      for a in job.run.axes)
    head = f"sweep {job.name}: {len(job.cells)} cells ({axes})"
    if len(cells) < len(job.cells):
        head += f", {len(job.cells) - len(cells)} already done"
    if job.fast:
        return (f"{head}; engine: a cell writing block L at token t recomputes blocks L.. at tokens t.. only, "
                f"up to {batch} cells per forward: {_work_share(model, job, cells):.1f} forwards' work for "
                f"{len(cells)} cells")
    return f"{head}; naive path, a full forward per cell ({batch} per forward), because {job.blocker}"


def run_sweeps(exp: Experiment, *, out: str | Path | None = None, resume: bool = False,
               batch_size: int | None = None, normalise: str | Mapping[str, str] | Normalise | None = None,
               progress: bool | None = None, console: Console | None = None, engine: str = "auto",
               on_chunk: Callable[[int], None] | None = None) -> SweepOutcome:
    """Run a compiled program that has sweeps: its other runs once, each sweep through the engine.

    `out`: write DIR/sweep.csv (as cells finish), sweep.json and the plots there;
    `resume`: continue the sweep in `out` without recomputing its finished cells;
    `batch_size`: rows per forward (default: from a memory budget); `normalise`:
    `clean=RUN,corrupted=RUN`; `progress`: show the bar and which path each sweep
    takes (default: on a terminal); `engine`: "auto" or "naive" (the reference
    path for every cell); `on_chunk(cells_done)`: called after each forward's cells are saved.
    """
    if engine not in ("auto", "naive"):
        raise DeltaSweepError(f"engine is 'auto' or 'naive', got {engine!r}")
    if batch_size is not None and batch_size < 1:
        raise DeltaSweepError(f"--batch-size must be at least 1, got {batch_size}")
    if resume and out is None:
        raise DeltaSweepError("--resume continues the sweep in an --out directory: give --out DIR")
    model = exp.model
    norm = Normalise.parse(normalise)
    support = Support(exp.resolved)
    jobs = [plan_job(exp, r, support, norm, engine) for r in exp.resolved.runs if r.kind == "sweep"]
    console = _console_for(progress, console)
    directory = Path(out) if out is not None else None
    old = SweepStore.peek(directory) if directory is not None and resume else None
    batches = {job.name: _batch_for(model, job, batch_size, old) for job in jobs}
    columns = csv_columns(jobs)
    store = _open_store(exp, jobs, directory, norm, batches, columns, resume) if directory is not None else None
    support_results = support.run(exp)
    values_: dict[str, Any] = {k: v for k, v in support_results.items() if not k.startswith(SUPPORT)}
    tables = {job.name: SweepTable(job.name, job.run.axes, token_texts(model, job.run),
                                   [measure_label(m) for m in job.run.measures]) for job in jobs}
    finished: dict[str, set[int]] = {job.name: set() for job in jobs}
    if store is not None:
        values_.update(_restore(store, jobs, columns, tables, finished))
    todo = {job.name: [c for c in job.cells if c.index not in finished[job.name]] for job in jobs}
    total = sum(len(v) for v in todo.values())
    done_count = [0]
    bar = _Progress(console, total)

    def emit(job: SweepJob, done: dict[int, list[ResultRow]], results: dict[str, Any]) -> None:
        if store is not None:
            store.add(job.name, csv_rows([r for rows in done.values() for r in rows], columns))
        for rows in done.values():
            tables[job.name].rows.extend(rows)
        finished[job.name].update(done)
        values_.update(results)
        done_count[0] += len(done)
        bar.advance(len(done), job.name)
        if on_chunk is not None:
            on_chunk(done_count[0])

    ctx = _Context(exp, support_results, emit)
    if console is not None:
        for job in jobs:
            console.print(_describe(model, job, todo[job.name], batches[job.name]), highlight=False)
    try:
        with bar:
            for job in jobs:
                _run_job(ctx, job, todo[job.name], batches[job.name], finished[job.name], console)
    except KeyboardInterrupt:
        if console is not None:
            where = f"saved in {directory}; rerun with --resume to continue" if directory else "not saved (no --out)"
            console.print(f"interrupted: {done_count[0]} of {total} cell(s) done, {where}")
        raise
    files: list[Path] = []
    if store is not None and directory is not None:
        store.finish()
        files.append(store.csv)
        from .plots import plot_table

        for job in jobs:
            files.extend(plot_table(tables[job.name], directory))
    for t in tables.values():
        t.rows.sort(key=lambda r: r.cell)
    return SweepOutcome(_results(exp, jobs, values_), [tables[j.name] for j in jobs], files,
                        {j.name: "engine" if j.fast else f"naive: {j.blocker}" for j in jobs})


def _console_for(progress: bool | None, console: Console | None) -> Console | None:
    """Where progress goes: the console given, stderr (always, or on a terminal when `progress` is None), or nowhere."""
    from rich.console import Console

    if progress is False:
        return None
    if console is not None:
        return console
    console = Console(stderr=True)
    if progress is None and not (console.is_terminal or console.is_jupyter):
        return None
    return console


def _open_store(exp: Experiment, jobs: Sequence[SweepJob], directory: Path, norm: Normalise | None,
                batches: Mapping[str, int], columns: list[str], resume: bool) -> SweepStore:
    """The store in `directory`, with what identifies this sweep (checked on --resume)."""
    meta = {"program_sha256": hashlib.sha256(exp.source.encode()).hexdigest(), "program": exp.source,
            "model": exp.model.spec.model_id, "normalise": norm.text() if norm else None,
            "prompt": getattr(exp, "prompt", None), "batch_size": dict(batches), "columns": columns,
            "sweeps": {j.name: {"cells": len(j.cells), "path": "engine" if j.fast else f"naive: {j.blocker}"}
                       for j in jobs}}
    return SweepStore(directory, meta, columns, resume, cell_locator(jobs, columns))


def _restore(store: SweepStore, jobs: Sequence[SweepJob], columns: list[str], tables: Mapping[str, SweepTable],
             finished: Mapping[str, set[int]]) -> dict[str, Any]:
    """The cells already on disk: into the tables and `finished`; returns their results by name."""
    out: dict[str, Any] = {}
    for job in jobs:
        for c in job.cells:
            if store.is_done(job.name, c.index):
                rows = rows_from_csv(store.rows[(job.name, c.index)], columns, job, c.index)
                tables[job.name].rows.extend(rows)
                finished[job.name].add(c.index)
                out.update(_results_of(job, c, rows))
    return out


def _run_job(ctx: _Context, job: SweepJob, cells: Sequence[Cell], batch: int, finished: set[int],
             console: Console | None) -> None:
    """One sweep's cells: through the engine, or the naive path when the engine cannot serve them."""
    if not cells:
        return
    if job.fast:
        try:
            run_fast(ctx, job, cells, batch)
            return
        except _Unsupported as e:  # found only once the model ran
            job.blocker = str(e)
            if console is not None:
                console.print(f"sweep {job.name}: the engine cannot serve it ({e}); naive path", highlight=False)
    run_naive(ctx, job, [c for c in cells if c.index not in finished], batch)


def _results(exp: Experiment, jobs: Sequence[SweepJob], values_: dict[str, Any]) -> Results:
    """Every result by name, with what `Results.summary` needs to show them."""
    from .run import Results

    kinds = {op.key: op.value for p in exp.plan.passes for r in p.runs for op in r.ops if op.key}
    kinds.update({m.result_name: m.kind for _, m in exp.plan.measures})
    tokens = {r.name: r.tokens for r in exp.resolved.runs}
    for job in jobs:
        tokens.update({c.run.name: job.run.tokens for c in job.cells})
    labels = {m.result_name: tokens.get(run, ()) for run, m in exp.plan.measures if m.kind == "norm"}
    return Results(values_, model=exp.model, program=exp.source, code=exp.code, kinds=kinds, token_labels=labels,
                   code_file=exp.code_file)


def _batch_for(model: DeltaModel, job: SweepJob, asked: int | None, old: Mapping[str, Any] | None) -> int:
    """Rows per forward: as asked, else what a resumed sweep used, else from the memory budget."""
    if asked is not None:
        return asked
    previous = old.get("batch_size", {}) if old is not None else {}
    if isinstance(previous, dict) and isinstance(previous.get(job.name), int):
        return int(previous[job.name])
    s = len(job.run.token_ids)
    if job.fast:
        first = min(min(_start(op)[1] for op in job.writes(c)) for c in job.cells)
        return default_batch_size(model, max(1, s - first))
    return default_batch_size(model, s)


def _results_of(job: SweepJob, cell: Cell, rows: Sequence[ResultRow]) -> dict[str, Any]:
    """Results by name of a cell read back from disk (per-token measures as a [1, s] tensor)."""
    out: dict[str, Any] = {}
    names = {measure_label(m): b.result_name for m, b in zip(job.run.measures, cell.run.measures, strict=True)}
    curves: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.position is not None:
            curves.setdefault(r.measure, {})[r.position] = r.value
        elif r.measure in names:
            out[names[r.measure]] = r.value
        else:
            out[f"{cell.run.name}.{r.measure}"] = r.value
    for label, pts in curves.items():
        out[names.get(label, f"{cell.run.name}.{label}")] = torch.tensor([[pts[p] for p in sorted(pts)]])
    return out


def run_sweep(source: str, model: Any = None, *, out: str | Path | None = None, resume: bool = False,
              batch_size: int | None = None, normalise: str | Mapping[str, str] | Normalise | None = None,
              progress: bool | None = None, filename: str = "<program>", prompt: str | None = None,
              engine: str = "auto", on_chunk: Callable[[int], None] | None = None) -> SweepOutcome:
    """Compile and run a program with sweeps; see `run_sweeps` for the options.

        outcome = deltalang.run_sweep(text, out="runs/ablate", normalise="clean=clean,corrupted=other")
        outcome.tables[0].grid('prob(" Paris")')
    """
    from .run import compile

    exp = compile(source, model, filename=filename, prompt=prompt)
    return run_sweeps(exp, out=out, resume=resume, batch_size=batch_size, normalise=normalise, progress=progress,
                      engine=engine, on_chunk=on_chunk)


# ---- the terminal table ----------------------------------------------------------


def _fmt(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.3g}"


def render_tables(table: SweepTable, limit: int = 40) -> list[Any]:
    """Rich tables of a sweep: a grid per measure for two axes, one table for one axis, else a long list."""
    from rich.table import Table

    measures_ = list(dict.fromkeys(r.measure for r in table.rows if r.position is None))
    out: list[Any] = []
    axes = table.axes
    if not measures_:
        pass
    elif len(axes) == 2:
        a, b = axes
        if len(b.values) > len(a.values):  # the longer axis down the rows, so the table fits
            a, b = b, a
        ia = [x.var for x in axes].index(a.var)
        for m in measures_:
            grid = table.grid(m)
            t = Table(title=f"{table.name}: {m}", title_justify="left")
            t.add_column(f"{a.var} \\ {b.var}")
            for v in b.values:
                t.add_column(table.label(b, v), justify="right")
            for u in a.values:
                keys = [(u, v) if ia == 0 else (v, u) for v in b.values]
                t.add_row(table.label(a, u), *(_fmt(grid[k]) if k in grid else "" for k in keys))
            out.append(t)
    elif len(axes) == 1:
        (a,) = axes
        t = Table(title=table.name, title_justify="left")
        t.add_column(a.var)
        for m in measures_:
            t.add_column(m, justify="right")
        grids = [table.grid(m) for m in measures_]
        for u in a.values:
            t.add_row(table.label(a, u), *(_fmt(g[(u,)]) if (u,) in g else "" for g in grids))
        out.append(t)
    else:
        t = Table(title=table.name, title_justify="left")
        for a in axes:
            t.add_column(a.var)
        t.add_column("measure")
        t.add_column("value", justify="right")
        shown = [r for r in table.rows if r.position is None]
        for r in shown[:limit]:
            t.add_row(*(table.label(a, v) for a, (_, v) in zip(axes, r.point)), r.measure, _fmt(r.value))
        if len(shown) > limit:
            t.caption = f"first {limit} of {len(shown)} rows; all in {CSV_NAME}"
        out.append(t)
    per_token = list(dict.fromkeys(r.measure for r in table.rows if r.position is not None))
    if per_token:
        out.append(f"{table.name}: per-token measure(s) {', '.join(per_token)}: see {CSV_NAME} and the plots")
    return out


# ---- the command -----------------------------------------------------------------


def sweep_main(args: argparse.Namespace, exp: Experiment | None = None) -> int:
    """`deltalang sweep FILE [--out DIR] [--resume] [--batch-size N] [--normalise clean=A,corrupted=B]`."""
    from rich.console import Console

    from .run import _experiment

    t0 = time.perf_counter()
    if exp is None:
        exp = _experiment(args)
    err = Console(stderr=True)
    stdout = Console() if sys.stdout.isatty() else Console(width=200)  # logs keep whole tables
    if not exp.has_sweeps:
        raise DeltaSweepError("the program has no sweep: run it with `deltalang run`")
    out = getattr(args, "out", None)
    if out is None and getattr(args, "command", "sweep") == "sweep":
        err.print("note: no --out, so nothing is saved as cells finish (give --out DIR to keep a CSV and plots)",
                  highlight=False)
    outcome = run_sweeps(exp, out=out, resume=bool(getattr(args, "resume", False)),
                         batch_size=getattr(args, "batch_size", None), normalise=getattr(args, "normalise", None),
                         progress=True, console=err, engine="naive" if getattr(args, "naive", False) else "auto")
    for table in outcome.tables:
        for item in render_tables(table):
            stdout.print(item)
    cell_prefixes = tuple(f"{t.name}[" for t in outcome.tables)
    others = {k: v for k, v in outcome.results.items() if not k.startswith(cell_prefixes)}
    if others:
        from .run import Results

        print(Results(others, model=exp.model).summary())
    if out is not None:
        outcome.results.save(out)
        shown = ", ".join(str(f.relative_to(out)) if f.is_relative_to(out) else str(f) for f in outcome.files)
        err.print(f"wrote {out}/: {shown}, results.json, results.safetensors, program.dl, "
                  f"{outcome.results.code_file} (the sweeps' reference form)", highlight=False)
    err.print(f"({time.perf_counter() - t0:.1f} s)", highlight=False)
    return 0
