"""One sweep planned: its cells, whether the engine can serve it, the support values it needs.

Contract: `cells_of(run)` gives every point of a sweep with its concrete trace
(`ResolvedRun.instantiate(point)`: the reference meaning of a cell);
`fast_path_blocker` says why the engine cannot serve a sweep (None: it can);
`plan_job` makes the SweepJob and asks `Support` for donors, means and
reference logits. `ResultRow` is one value of one cell, as every later stage
(store, table, plots) sees it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from deltalang.language.ir import (FromRun, Load, Mean, Named, Resolved, ResolvedMeasure, ResolvedOp, ResolvedRun,
                                   Scale, Steer, measure_result_name)
from deltalang.models import values
from deltalang.runs.compiled import Experiment

from .errors import DeltaSweepError
from .support import Support, reference_run

FAST_VALUES = ("state_after", "conv_window_after")
# the Mamba-2 families whose cells the engine is checked on against transformers: all six of transformers'
# (tests/test_ssd_sweep.py, over `testing_ssd.MAMBA2_FAMILY_NAMES`); one found later takes the reference path
# until it is (a family's own way of passing masks can mislead the continuation without an error)
ENGINE_SSM_FAMILIES = ("granitemoehybrid", "nemotron_h", "falcon_h1", "bamba", "zamba2", "mamba2")


@attrs.frozen
class Cell:
    """One point of a sweep and its concrete trace (the reference meaning of the cell)."""

    index: int
    point: tuple[tuple[str, int], ...]
    run: ResolvedRun


@attrs.frozen
class ResultRow:
    """One value of one cell: a measure (at a position, for per-token measures)."""

    sweep: str
    cell: int
    point: tuple[tuple[str, int], ...]
    measure: str
    position: int | None
    value: float


def cells_of(run: ResolvedRun) -> list[Cell]:
    """Every cell of a sweep, in the order of `ResolvedRun.points()`."""
    return [Cell(i, tuple(point.items()), run.instantiate(point)) for i, point in enumerate(run.points())]


def measure_label(m: ResolvedMeasure) -> str:
    """How a template measure is named in tables and the CSV: `prob(" Paris")`, or its `as` name."""
    if m.alias is None:
        return m.written
    return measure_result_name("", None, m.written, m.alias, m.layer, m.result_name != m.alias)


def added_result_name(cell: Cell, label: str) -> str:
    """The result name of a value a sweep adds to a cell (`normalised(...)`): `CELL.LABEL`, as a measure's."""
    return measure_result_name(cell.run.name, None, label, None, None, False)


def fast_path_blocker(resolved: Resolved, run: ResolvedRun) -> str | None:
    """Why the engine cannot serve this sweep (the naive path then runs it), or None."""
    if not run.ops or all(op.kind != "write" for op in run.ops):
        return "the body writes nothing"
    family = resolved.spec.family
    if family.block_kind == values.SSM and family.name not in ENGINE_SSM_FAMILIES:
        return (f"the engine is checked on the Mamba-2 families {', '.join(ENGINE_SSM_FAMILIES)} "
                f"(tests/test_ssd_sweep.py), not yet on {family.name}")
    writes = [op for op in run.ops if op.kind == "write"]
    for op in run.ops:
        if op.kind == "read":
            return f"it reads {op.written}: reads give a tensor per cell, which only full forwards serve"
        if op.head is not None or op.head_var is not None:
            return f"it writes {op.written}: the engine recomputes whole values, not one head"
        if op.value not in FAST_VALUES:
            return f"it writes {op.written}: the engine recomputes writes of state_after(t) and conv_window_after(t)"
        if op.step is not None:
            return f"it writes {op.written} at a step"
        if isinstance(op.source, Named):
            return f"'{op.written} = NAME' takes a value read in another run"
        if isinstance(op.source, (Steer, Load)):
            return f"'{op.written}' is written by arithmetic over sources or load(...)"
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
        if m.kind in ("norm", "project") and not _norm_is_served(m, writes):
            return (f"measure {m.written}: the engine serves norms (and reductions) of a written site or of a "
                    f"block's state_output only")
    return None


def path_lines(resolved: Resolved) -> list[str]:
    """What `emit --plan` says under the plan of each sweep: the engine serves its cells, or the reference path
    (the passes printed) runs them, and why."""
    out = []
    for run in resolved.runs:
        if run.kind == "sweep":
            why = fast_path_blocker(resolved, run)
            out.append(f"sweep {run.name}: " + (
                "the sweep engine serves its cells (the passes above are their reference form)" if why is None
                else f"the reference path runs its cells, as the passes above (several cells per forward): the "
                     f"engine cannot serve it: {why}"))
    return out


def _norm_is_served(m: ResolvedMeasure, writes: Sequence[ResolvedOp]) -> bool:
    if m.value == "state_output" and m.position is None and m.position_var is None:
        return True
    return any((w.layer, w.layer_var, w.value, w.position, w.position_var)
               == (m.layer, m.layer_var, m.value, m.position, m.position_var) for w in writes)


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

    @property
    def path(self) -> str:
        """How its cells run: "engine", or "naive: WHY"."""
        return "engine" if self.fast else f"naive: {self.blocker}"

    def writes(self, cell: Cell) -> list[ResolvedOp]:
        return [op for op in cell.run.ops if op.kind == "write"]


def plan_job(exp: Experiment, run: ResolvedRun, support: Support, normalise: Normalise | None,
             engine: str) -> SweepJob:
    """Decide the path of one sweep and ask `support` for the values it takes from other runs."""
    cells = cells_of(run)
    blocker = fast_path_blocker(exp.resolved, run) if engine != "naive" else "the naive path was asked for"
    job = SweepJob(run, cells, blocker)
    if normalise is not None:
        job.normalise = (support.read(reference_run(normalise.clean, exp.resolved, support), None, "logits", None,
                                      None),
                         support.read(reference_run(normalise.corrupted, exp.resolved, support), None, "logits",
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


def start_of(op: ResolvedOp) -> tuple[int, int]:
    """The block and position of an engine-served write (concrete in a cell)."""
    assert op.layer is not None and op.position is not None
    return op.layer, op.position
