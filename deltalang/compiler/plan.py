"""From a resolved program to an ordered plan of forward passes: `build_plan()` (printed by `explain`).

1. `collect_runs`: the program's traces and generates, implicit clean runs of prompts named in `from`,
   one run per text of a `mean(...)`, and the donor reads each write needs;
2. `order_runs`: a graph from each donor to the run that uses it; a cycle is an error naming its
   statements; topological generations are the stages;
3. `batch_stage`: a stage's traces of one kernel route share one forward (an invoke each, the shorter
   left-padded; only equal lengths where `batches.padding_refused`, `Pass.apart` says why); each generate
   gets its own.
Invariant: batching never changes a value (every value is the run's own; `tests/test_batching.py`). Under
a generate a statement without `step K:` applies at every step; a value from another generate is its
value at the same step, and a trace matches step 0 only. `sort_ops` orders a run's ops as the forward
reaches them (step, block, `values.CATALOGUE` order, position, a write before a read of the same site).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Callable, Iterable

import attrs
import networkx as nx

from deltalang.ground.errors import DeltaPlanError, Span
from deltalang.language.ast import quote as ast_quote
from deltalang.language.ir import (FromRun, Mean, Named, Resolved, ResolvedMeasure, ResolvedOp, ResolvedRun,
                                   logits_kept, op_result_name, operand_ops, with_donors)
from deltalang.models import values

from .batches import BATCH_TOKENS, batch_stage, padding_refused, steps_bound
from .directions import mean_runs, plan_directions

HIDDEN = "~"  # results whose key starts with this are internal (donor reads, mean inputs)

# model-level values come after every block; `tokens` after everything
_MODEL_ORDER = {"logits": 0, "next_token_probs": 1, "tokens": 2}
# `states` read in a run that also writes positions of the same mixer: served once the
# writes are applied (the forward as it ran), just after the last position
STATES_AS_RUN = "states_as_run"
_ORDER = {name: v.order for name, v in values.CATALOGUE.items()} | {STATES_AS_RUN: 52}


@attrs.frozen
class PlanOp:
    """One read or write inside one run, ready to emit."""

    kind: str  # "read" | "write"
    layer: int | None
    value: str
    position: int | None
    step: int | None
    key: str | None  # reads: the results key
    source: Any = None  # writes: the resolved source, with `donor` keys filled in below
    donor_key: str | None = None  # writes `from`/`= NAME`/`= mean`: where the value is in results
    text: str = ""  # the statement as written, for the comment
    span: Span | None = attrs.field(default=None, eq=False)
    head: int | None = None  # `.head(h)`: the op reads or writes this value head's slice only
    reduce: Any = None  # an `ir.Reduce`: the read is that reduction, computed in the forward

    @property
    def hidden(self) -> bool:
        return self.key is not None and self.key.startswith(HIDDEN)

    def sort_key(self) -> tuple:
        step = math.inf if self.value == "tokens" else (self.step or 0)
        layer = math.inf if self.layer is None else self.layer
        order = _MODEL_ORDER.get(self.value, 0) if self.layer is None else _ORDER.get(self.value, 0)
        if self.reduce is not None and self.value == "states":  # served just before `states`
            order -= 0.5
        pos = -1 if self.position is None else self.position
        return (step, layer, order, pos, 0 if self.kind == "write" else 1)


@attrs.frozen
class RunPlan:
    """One run in a pass: its prompt and its ops in forward order."""

    name: str
    kind: str  # "trace" | "generate"
    prompt: str
    prompt_text: str
    ops: tuple[PlanOp, ...]
    max_new_tokens: int | None = None
    route: str | None = None
    implicit: bool = False
    why: str = ""  # for implicit runs: what needs them
    n_tokens: int = 0  # the prompt's tokens
    token_ids: tuple[int, ...] = ()  # a teacher-forced run's tokens (the prompt and an answer's first tokens)
    answer_len: int = 1  # the last positions whose logits its measures read (a teacher-forced answer's tokens)
    sampling: Any = None  # a generate's `ast.Sampling` (temperature, top_p, seed); None: greedy


@attrs.frozen
class Pass:
    """One forward of the model (or one generate): its runs are its invokes."""

    index: int
    kind: str
    runs: tuple[RunPlan, ...]
    route: str | None = None
    then: tuple["Combine", ...] = ()  # values computed once this pass is done
    apart: str = ""  # why runs of other lengths of its stage run in forwards of their own (`padding_refused`)

    @property
    def padded(self) -> bool:
        """Whether the runs of this forward differ in length (the shorter ones are left-padded)."""
        return len({r.n_tokens for r in self.runs}) > 1


@attrs.frozen
class Combine:
    """A value computed between passes: the mean of several reads."""

    key: str
    inputs: tuple[str, ...]


@attrs.frozen
class Plan:
    passes: tuple[Pass, ...]
    combines: tuple[Combine, ...]
    measures: tuple[tuple[str, ResolvedMeasure], ...]  # (run name, measure); a generate's: one per step
    resolved: Resolved = attrs.field(eq=False, repr=False)
    # measure result name -> the results keys it is computed from (its run's logits or site; kl: then the
    # other run's logits at the matching step)
    inputs: dict[str, tuple[str, ...]] = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def result_keys(self) -> list[str]:
        keys = [op.key for p in self.passes for r in p.runs for op in r.ops
                if op.kind == "read" and op.key is not None and not op.hidden]
        return keys + [m.result_name for _, m in self.measures]


# -- 1. runs and donor reads -----------------------------------------------


def donor_key(run: str, layer: int | None, value: str, position: int | None, step: int | None) -> str:
    """The internal results key of a value one run hands another."""
    site = value if position is None else f"{value}({position})"
    where = f"L{layer}." if layer is not None else ""
    at = f"step{step}." if step is not None else ""
    return f"{HIDDEN}{run}.{at}{where}{site}"


def _span(x: Any) -> Span | None:
    return getattr(x, "span", None)


def expand_steps(run: ResolvedRun) -> list[ResolvedOp]:
    """A generate's ops without a step apply at every step: one op per step."""
    if run.kind != "generate":
        return list(run.ops)
    out: list[ResolvedOp] = []
    for op in run.ops:
        if op.step is not None or op.value == "tokens":
            out.append(op)
            continue
        for k in range(run.max_new_tokens or 1):
            name = op.result_name
            if name is not None and op.alias is None:
                name = op_result_name(run.name, k, op.layer, op.value, op.position, None, False)
            elif name is not None:
                name = f"{name}.step{k}"
            out.append(attrs.evolve(op, step=k, result_name=name))
    return out


def expand_measure_steps(run: ResolvedRun) -> list[ResolvedMeasure]:
    """A generate's measures without a step are taken at every step, as its reads are: one per step."""
    if run.kind != "generate":
        return list(run.measures)
    out: list[ResolvedMeasure] = []
    for m in run.measures:
        if m.step is not None:
            out.append(m)
            continue
        for k in range(run.max_new_tokens or 1):
            if m.alias is None:  # `RUN.CALL` -> `RUN.step<k>.CALL`
                name = f"{run.name}.step{k}.{m.result_name[len(run.name) + 1:]}"
            else:
                name = f"{m.result_name}.step{k}"
            out.append(attrs.evolve(m, step=k, result_name=name))
    return out


def _steps_of(run: ResolvedRun) -> str:
    n = run.max_new_tokens or 1
    return f"'{run.name}' makes {n} new token{'s' if n != 1 else ''} (steps 0 to {n - 1})"


def donor_step(src: FromRun, op: ResolvedOp, target: ResolvedRun, donor: ResolvedRun) -> int | None:
    """The step of `donor` a write takes its value from (None: a trace's one forward).

    The resolver fixes it for a write with a step or a position; a write without
    either is expanded to every step of a generate here, and at step k takes a
    generate donor's step k.
    """
    step = src.step
    if step is None and donor.kind == "generate" and target.kind == "generate":
        step = op.step
    if donor.kind == "generate" and (step or 0) >= (donor.max_new_tokens or 1):
        raise DeltaPlanError(f"{op.written} at step {step} takes its value from step {step} of '{donor.name}', and "
                             f"{_steps_of(donor)}", _span(op))
    info = values.CATALOGUE.get(src.value)
    if donor.kind != "generate" and (op.step or 0) > 0 and info is not None and info.per_token:
        raise DeltaPlanError(f"{op.written} at step {op.step}: '{donor.name}' is a trace, and {src.value} has a "
                             f"row per token of its prompt while a decode step runs one token; name a generate, "
                             f"or write at step 0 only (`step 0: ...`)", _span(op))
    return step


def kl_step(run: ResolvedRun, m: ResolvedMeasure, other: ResolvedRun) -> int | None:
    """The step of `other` that `kl(other)` at `m.step` of `run` compares with (None: a trace's forward).

    A generate's step k compares with another generate's step k. A trace's next
    token follows its prompt, as a generate's step 0 does: a trace and step 0
    compare with each other; a later step has nothing to compare with in a trace.
    """
    step = m.step if run.kind == "generate" else None
    every = " (a measure without `step K:` is taken at every step)" if m not in run.measures else ""
    if other.kind != "generate":
        if step:
            raise DeltaPlanError(f"kl({other.name}) at step {step} of '{run.name}': '{other.name}' is a trace, one "
                                 f"forward over its prompt, so it has no step {step} to compare with{every}; "
                                 f"write `step 0: measure kl({other.name})`, or name a generate", m.span)
        return None
    if (step or 0) >= (other.max_new_tokens or 1):
        raise DeltaPlanError(f"kl({other.name}) at step {step} of '{run.name}': {_steps_of(other)}, so it has no "
                             f"step {step} to compare with{every}", m.span)
    return step


def _expand_runs(resolved: Resolved) -> tuple[list[ResolvedRun], dict[str, list[ResolvedOp]], dict[str, str],
                                               list[tuple[str, ResolvedMeasure]]]:
    """The runs to plan (a sweep's cells instantiated), their ops (a generate's expanded to its steps), the run
    that reads each named result, and the measures (one per result name)."""
    runs = [r for r in resolved.runs if r.kind != "sweep"]
    for r in resolved.runs:
        if r.kind == "sweep":
            runs.extend(r.instantiate(point) for point in r.points())
    expanded: dict[str, list[ResolvedOp]] = {}
    read_keys: dict[str, str] = {}  # result name -> run that reads it
    measures: list[tuple[str, ResolvedMeasure]] = []
    seen: set[str] = set()
    for r in runs:
        expanded[r.name] = expand_steps(r)
        for op in expanded[r.name]:
            if op.kind == "read" and op.result_name is not None:
                read_keys[op.result_name] = r.name
        for m in expand_measure_steps(r):
            if m.result_name not in seen:  # `step 2: measure X` beside `measure X`: one result
                seen.add(m.result_name)
                measures.append((r.name, m))
    return runs, expanded, read_keys, measures


def collect_runs(resolved: Resolved) -> tuple[dict[str, RunPlan], list[tuple[str, str, Any]], list[Combine],
                                              list[tuple[str, ResolvedMeasure]], dict[str, tuple[str, ...]]]:
    """Every run with its ops, the donor edges (from run, to run, the op making it), the means, the
    measures (a generate's expanded to its steps) and the results keys each measure is computed from."""
    runs, expanded, read_keys, measures = _expand_runs(resolved)
    ops: dict[str, list[PlanOp]] = {r.name: [] for r in runs}
    meta: dict[str, ResolvedRun] = {r.name: r for r in runs}
    edges: list[tuple[str, str, Any]] = []
    combines: list[Combine] = []
    implicit_why, donated = dict[str, str](), set[tuple[str, str]]()  # donated: (run, key) of the hidden reads added

    def add_donor(run: str, layer: int | None, value: str, position: int | None, step: int | None,
                  for_run: str, why: Any) -> str:
        key = donor_key(run, layer, value, position, step)
        if _first(donated, (run, key)):  # one look-up, not a scan of the run's ops; `~...` is never a read's own name
            ops[run].append(PlanOp("read", layer, value, position, step, key, text=f"for {for_run}",
                                   span=_span(why)))
        edges.append((run, for_run, why))
        return key

    counter = itertools.count()  # the means' runs, numbered
    def add_mean(src: Mean, layer: Any, value: str, position: Any, for_run: str, why: Any, tag: str = "") -> str:
        """One clean run per text of `src` reading the site there, and the mean of their reads: its key."""
        inputs = []
        for run, pos in mean_runs(resolved, src, counter):
            meta[run.name], ops[run.name] = run, []
            implicit_why[run.name] = f"mean({', '.join(src.prompts)}) for {for_run}"
            inputs.append(add_donor(run.name, layer, value, pos, None, for_run, why))
        key = f"{HIDDEN}mean({','.join(src.prompts)}).L{layer}.{value}" + (
            f"({position})" if position is not None else "") + tag + f".{for_run}"
        combines.append(Combine(key, tuple(inputs)))
        return key

    for r in runs:
        operand_keys: list[str | None] = []  # a write's arithmetic: its operands' keys, found before it
        for op in operand_ops(expanded[r.name]):
            if op.kind == "read":
                ops[r.name].append(PlanOp("read", op.layer, op.value, op.position, op.step, op.result_name,
                                          text=op.written, span=op.span, head=op.head, reduce=op.reduce))
                continue
            src, dkey = op.source, None
            if isinstance(src, FromRun):
                if src.run not in meta:
                    raise DeltaPlanError(f"`from {src.run}` names no run", _span(op))
                step = donor_step(src, op, r, meta[src.run])
                dkey = add_donor(src.run, src.layer, src.value, src.position, step, r.name, op)
            elif isinstance(src, Named):
                target = src.name if src.name in read_keys else f"{src.name}.L{op.layer}"
                if target not in read_keys:
                    every = [k for k in read_keys if k.startswith(f"{src.name}.") and ".step" in k]
                    if every:  # an `as NAME` read without a step in a generate: one value per step
                        raise DeltaPlanError(f"`= {src.name}` takes one value, and '{src.name}' is read at every "
                                             f"step of '{src.run}' ({', '.join(every)}); read it at one step: "
                                             f"`step K: read ... as {src.name}`", _span(op))
                    raise DeltaPlanError(f"`= {src.name}` names no read", _span(op))
                dkey = target
                edges.append((read_keys[target], r.name, op))
            elif isinstance(src, Mean):
                dkey = add_mean(src, op.layer, op.value, op.position, r.name, op)
            if op.kind == "operand":  # one operand of the write after it: its key (None: no value from elsewhere)
                operand_keys.append(dkey)
                continue
            ops[r.name].append(PlanOp("write", op.layer, op.value, op.position, op.step, None, donor_key=dkey,
                                      source=with_donors(src, operand_keys), text=op.written, span=op.span,
                                      head=op.head))
    forced: dict[str, tuple[tuple[int, ...], int]] = {}  # run -> (its tokens, the answer's length)
    measure_inputs = {}
    for run, m in measures:  # a forced measure reads the run's own logits only for an answer of one token
        own = functools.partial(_measure_reads, meta[run], m, meta, ops, add_donor, donated)
        measure_inputs[m.result_name] = _forced_reads(meta, ops, edges, forced, implicit_why, meta[run], m, own) \
            if m.forced else own()
    for name in _hollow(meta, ops, edges, {run for run, m in measures if m.forced}):
        del meta[name], ops[name]
        edges[:] = [e for e in edges if e[1] != name]
    plan_directions(ops, add_mean)
    return _run_plans(meta, ops, forced, implicit_why, measures), edges, combines, measures, measure_inputs


def _run_plans(meta: dict[str, ResolvedRun], ops: dict[str, list[PlanOp]],
               forced: dict[str, tuple[tuple[int, ...], int]], why: dict[str, str],
               measures: list[tuple[str, ResolvedMeasure]]) -> dict[str, RunPlan]:
    """Each run's plan: its ops in forward order, a teacher-forced run's tokens and the logits it keeps."""
    kept = logits_kept(measures, {name: len(r.token_ids) for name, r in meta.items()})
    return {name: RunPlan(name=r.name, kind=r.kind, prompt=r.prompt, prompt_text=r.prompt_text,
                          ops=tuple(sort_ops(mark_states_as_run(ops[name]))), max_new_tokens=r.max_new_tokens,
                          route=r.route, implicit=r.implicit, sampling=r.sampling, why=why.get(name, ""),
                          n_tokens=len(r.token_ids), token_ids=forced[name][0] if name in forced else (),
                          answer_len=max(forced[name][1] if name in forced else 1, kept.get(name, 1)))
            for name, r in meta.items()}


def _forced_reads(meta: dict[str, ResolvedRun], ops: dict[str, list[PlanOp]], edges: list[tuple[str, str, Any]],
                  forced: dict[str, tuple[tuple[int, ...], int]], why: dict[str, str], r: ResolvedRun,
                  m: ResolvedMeasure, own: Callable[[], tuple[str, ...]]) -> tuple[str, ...]:
    """A measure of an answer of several tokens: per such answer, a run of the prompt and the answer's
    tokens but the last (teacher forcing) with the run's writes, whose logits it reads; an answer of one
    token reads the run's own logits (`own` adds that read: the run reads them for nothing else). Returns
    the logits keys, one per answer."""
    keys = []
    for text, answer in zip(m.token_texts, m.answers, strict=True):
        if len(answer) == 1:
            keys.append(own()[0])
            continue
        name = f"{r.name}+{ast_quote(text)}"
        keys.append(donor_key(name, None, "logits", None, None))
        if name in meta:
            continue
        meta[name] = attrs.evolve(r, name=name, prompt=name, prompt_text=r.prompt_text + text,
                                  token_ids=r.token_ids + answer[:-1], implicit=True)
        forced[name] = (r.token_ids + answer[:-1], len(answer))
        why[name] = f"teacher forcing of {ast_quote(text)} for {r.name}"
        ops[name] = [PlanOp("read", None, "logits", None, None, keys[-1], text=m.written, span=m.span)]
        for op in ops[r.name]:
            if op.kind != "write" or op.value == "state_output":  # after the last token: no logit sees it
                continue
            if values.CATALOGUE[op.value].per_token:
                raise DeltaPlanError(f"{ast_quote(text)} is {len(answer)} tokens, measured by teacher forcing over "
                                     f"the prompt and the answer; a write of the per-token value `{op.value}` "
                                     "covers the prompt's tokens only: measure an answer of one token here", m.span)
            ops[name].append(op)
        edges.extend((src, name, why_) for src, to, why_ in list(edges) if to == r.name)
    return tuple(keys)


def _hollow(meta: dict[str, ResolvedRun], ops: dict[str, list[PlanOp]], edges: list[tuple[str, str, Any]],
            measured: set[str]) -> list[str]:
    """The traces whose every measure was moved to teacher-forced runs (with their writes) and that read
    nothing else nor give any run a value: running them would compute nothing."""
    donors = {a for a, _, _ in edges}
    return [n for n in measured if meta[n].kind == "trace" and n not in donors
            and not any(op.kind == "read" for op in ops[n])]


def _measure_reads(r: ResolvedRun, m: ResolvedMeasure, meta: dict[str, ResolvedRun], ops: dict[str, list[PlanOp]],
                   add_donor: Any, donated: set[tuple[str, str]]) -> tuple[str, ...]:
    """The reads a measure needs: the logits of the run (and of the `kl` run), or the site; their keys. `donated`:
    the (run, key) of the hidden reads already added (a generate's measure per step: no scan of its ops each)."""
    step = m.step if r.kind == "generate" else None
    if m.kind in ("norm", "project"):
        key = measure_input_key(r.name, m)
        if _first(donated, (r.name, key)):
            ops[r.name].append(PlanOp("read", m.layer, m.value or "", m.position, step, key, text=m.written,
                                      span=m.span, reduce=m.reduce))
        return (key,)
    key = donor_key(r.name, None, "logits", None, step)
    if _first(donated, (r.name, key)):
        ops[r.name].append(PlanOp("read", None, "logits", None, step, key, text=m.written, span=m.span))
    if m.kind == "kl" and m.against is not None:
        return key, add_donor(m.against, None, "logits", None, kl_step(r, m, meta[m.against]), r.name, m)
    return (key,)


def _first(seen: set[tuple[str, str]], item: tuple[str, str]) -> bool:
    """Whether `item` is new to `seen` (then added)."""
    return item not in seen and not seen.add(item)  # type: ignore[func-returns-value]


def measure_input_key(run: str, m: ResolvedMeasure) -> str:
    if m.reduce is not None:  # the reduction's result, computed in the forward
        return donor_key(run, m.layer, m.value or "", m.position, m.step) + f" -> {m.written}"
    if m.kind == "norm":
        return donor_key(run, m.layer, m.value or "", m.position, m.step)
    return donor_key(run, None, "logits", None, m.step)


def mark_states_as_run(ops: list[PlanOp]) -> list[PlanOp]:
    """A `states` read beside a position write of the same mixer and step sees the written forward."""
    writes = {(o.layer, o.step) for o in ops if o.kind == "write" and o.value == "state_after"}
    return [attrs.evolve(o, value=STATES_AS_RUN) if o.kind == "read" and o.value == "states"
            and (o.layer, o.step) in writes else o for o in ops]


def sort_ops(ops: Iterable[PlanOp]) -> list[PlanOp]:
    """Forward order; stable, so equal keys keep their source order."""
    return sorted(ops, key=PlanOp.sort_key)


# -- 2. order --------------------------------------------------------------


def order_runs(plans: dict[str, RunPlan], edges: list[tuple[str, str, Any]],
               source_order: list[str]) -> list[list[str]]:
    """Stages of runs: each needs only runs of earlier stages. A cycle is a DeltaPlanError."""
    g = nx.DiGraph()
    g.add_nodes_from(plans)
    for a, b, why in edges:
        if a == b:
            raise DeltaPlanError(f"run {a!r} takes a value from itself: a run's reads observe its own writes, "
                                 f"so it cannot feed them; name a clean run of the prompt instead", _span(why))
        g.add_edge(a, b, why=why)
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        names = " -> ".join([c[0] for c in cycle] + [cycle[0][0]])
        first = g.edges[cycle[0][0], cycle[0][1]]["why"]
        notes = []
        for a, b, *_ in cycle:
            why = g.edges[a, b]["why"]
            sp = _span(why)
            notes.append(f"{b} needs {a}" + (f" (line {sp.line}: {getattr(why, 'written', '')})" if sp else ""))
        raise DeltaPlanError(f"runs need each other's values in a cycle: {names}", _span(first), notes=notes)
    rank = {name: i for i, name in enumerate(source_order)}
    return [sorted(stage, key=lambda n: (rank.get(n, len(rank)), n))
            for stage in nx.topological_generations(g)]


# -- 3. passes -------------------------------------------------------------


def build_plan(resolved: Resolved, *, batch: bool = True) -> Plan:
    """The ordered passes of a resolved program."""
    plans, edges, combines, measures, inputs = collect_runs(resolved)
    source_order = [r.name for r in resolved.runs]
    passes: list[Pass] = []
    refused = padding_refused(resolved.spec)
    for stage in order_runs(plans, edges, source_order):
        lengths = {plans[n].n_tokens for n in stage if plans[n].kind == "trace"}
        apart = refused if refused is not None and batch and len(lengths) > 1 else ""
        for group in batch_stage([plans[n] for n in stage], batch, pad=refused is None):
            passes.append(Pass(len(passes) + 1, group[0].kind, tuple(group), group[0].route,
                               apart=apart if group[0].kind == "trace" else ""))
    # a mean is taken as soon as the last of its inputs is read
    produced = {op.key: i for i, p in enumerate(passes) for r in p.runs for op in r.ops if op.key}
    for c in combines:
        i = max(produced[k] for k in c.inputs)
        passes[i] = attrs.evolve(passes[i], then=passes[i].then + (c,))
    return Plan(tuple(passes), tuple(combines), tuple(measures), resolved, inputs)


def checked_plan(resolved: Resolved) -> Plan:
    """The plan `deltalang check` builds to find what `run` would refuse (a cycle, a step a run lacks) in a time
    that does not grow with max_new_tokens: the generates' counts clipped at `steps_bound`."""
    bound = steps_bound(resolved)
    if bound is None:
        return build_plan(resolved)
    runs = tuple(attrs.evolve(r, max_new_tokens=min(r.max_new_tokens or 1, bound)) if r.kind == "generate" else r
                 for r in resolved.runs)
    return build_plan(attrs.evolve(resolved, runs=runs))
