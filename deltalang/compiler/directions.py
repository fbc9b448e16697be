"""The clean runs of a `mean(...)`, and a projection's direction from means (`project(SITE, mean(a) - mean(b))`).

`mean_runs()` gives a mean's clean run of each text and the position read there (a write's `= mean(...)`
and a direction's alike). `plan_directions()` rewrites every planned read whose reduction projects onto an `ir.MeanDirection`: each
`mean(...)` becomes the key of a mean the planner computes in earlier passes (clean runs of its prompts
reading the projected site, `plan.collect_runs`'s `add_mean`), so the projecting pass finds the direction in
`results` as arithmetic over those keys (`ir.Donor`), which `emit.direction_expr` writes out.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import attrs

from deltalang.language.ir import Donor, Mean, MeanDirection, Resolved, ResolvedRun, map_atoms


def mean_runs(resolved: Resolved, src: Mean, counter: Iterator[int]) -> list[tuple[ResolvedRun, int | None]]:
    """One clean run per text of a mean (named `mean(a,b)[i]#n`), with the position the mean reads there."""
    out = []
    for i, text in enumerate(src.texts):
        name = f"mean({','.join(src.prompts)})[{i}]#{next(counter)}"
        run = ResolvedRun(name=name, kind="trace", prompt=name, prompt_text=text,
                          token_ids=tuple(resolved.spec.token_ids(text)), tokens=(), implicit=True)
        out.append((run, src.positions[i] if src.positions is not None else None))
    return out


def plan_directions(ops: dict[str, list[Any]], add_mean: Callable[..., str]) -> None:
    """Each projection onto means (`mean(a) - mean(b)`): its means read in clean runs of their prompts
    (earlier passes) and combined, the direction then arithmetic over their keys (`Donor`)."""
    done: dict[tuple[Any, ...], MeanDirection] = {}  # a generate's measure per step: its means once
    for run in list(ops):
        for j, op in enumerate(ops[run]):
            if op.reduce is None or not any(isinstance(a, MeanDirection) for _, a in op.reduce.steps):
                continue
            steps = []
            for kind, d in op.reduce.steps:
                if isinstance(d, MeanDirection):
                    key = (run, op.layer, op.value, op.position, d)
                    if key not in done:
                        done[key] = attrs.evolve(d, expr=map_atoms(d.expr, lambda a: Donor(add_mean(
                            a, op.layer, op.value, op.position, run, op, ".direction")) if isinstance(a, Mean) else a))
                    d = done[key]
                steps.append((kind, d))
            ops[run][j] = attrs.evolve(op, reduce=attrs.evolve(op.reduce, steps=tuple(steps)))
