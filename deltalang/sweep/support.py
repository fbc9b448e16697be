"""Support values: donors, means and reference logits, asked of one ordinary compiled program.

Contract: `Support.read` names a value of another run (`sweep#...` keys); `Support.run`
runs the user's non-sweep runs plus those reads once, through the compiler, the
same code path as every other run. `subprogram` is the one place a sweep rebuilds
a resolved program (a subset of its runs) and compiles it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from deltalang.compiler.plan import donor_key
from deltalang.language.ir import FromRun, Named, Resolved, ResolvedOp, ResolvedRun, site_text
from deltalang.runs.compiled import Experiment

from .errors import DeltaSweepError

SUPPORT = "sweep#"  # results keys of the values the engine asks the compiler for


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

    def program_runs(self) -> list[ResolvedRun]:
        """The user's runs (no sweeps) with the extra reads, and the added runs; empty when none."""
        kept: list[ResolvedRun] = []
        referenced = referenced_runs([r for r in self.resolved.runs if r.kind != "sweep"])
        for r in self.resolved.runs:
            if r.kind == "sweep":
                continue
            extra = tuple(self.reads.get(r.name, ()))
            if r.implicit and not r.ops and not r.measures and not extra and r.name not in referenced:
                continue  # a clean run only the sweeps needed
            kept.append(attrs.evolve(r, ops=r.ops + extra) if extra else r)
        for name, r in self.extra.items():
            kept.append(attrs.evolve(r, ops=tuple(self.reads.get(name, ()))))
        return kept

    def run(self, exp: Experiment) -> dict[str, Any]:
        """Run the program; keep every value, `sweep#` ones included."""
        runs = self.program_runs()
        if not runs:
            return {}
        self.results = dict(subprogram(exp, runs).run())
        return self.results


def subprogram(exp: Experiment, runs: Sequence[ResolvedRun]) -> Experiment:
    """`exp`'s program holding only `runs`, planned and emitted again (no sweeps among them).

    The one place a sweep rebuilds a resolved program around the planner.
    """
    return Experiment(exp.source, exp.model, filename=exp.filename,
                      resolved=attrs.evolve(exp.resolved, runs=tuple(runs)))


def referenced_runs(runs: Iterable[ResolvedRun]) -> set[str]:
    """Runs other runs take values from (`from`, `= NAME`, `kl`)."""
    out: set[str] = set()
    for r in runs:
        for op in r.ops:
            if isinstance(op.source, (FromRun, Named)):
                out.add(op.source.run)
        out.update(m.against for m in r.measures if m.against is not None)
    return out


def dependencies(resolved: Resolved, names: set[str]) -> list[ResolvedRun]:
    """The non-sweep runs `names` need, transitively, in program order."""
    runs = {r.name: r for r in resolved.runs if r.kind != "sweep"}
    need: set[str] = set()
    todo = [n for n in names if n in runs]
    while todo:
        n = todo.pop()
        if n in need:
            continue
        need.add(n)
        todo.extend(x for x in referenced_runs([runs[n]]) if x in runs and x not in need)
    return [r for r in resolved.runs if r.name in need]


def reference_run(name: str, resolved: Resolved, support: Support) -> str:
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
