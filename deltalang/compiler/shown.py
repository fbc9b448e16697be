"""How each result of a plan is shown (`shown(plan)`): what `Results.summary` needs beside the values.

`kinds`: the value each result holds (`states`, `next_token_probs`, a measure's kind: `norm`, `kl`), whatever its
name (`as st`); `axes`: the axis names of a result the catalogue's shape does not name, a reduction's
(`.mean(positions)`: `b, heads, key_dim, value_dim`) and one head's (the value's without `heads`);
`token_labels`: the tokens of a per-token `norm(...)` measure of a prompt, its table's rows (a decode step's is
shown as a tensor: its token is made as the program runs). A result `Results` is not told about holds what its
name's last part says (`named_kind`). `compiled.Experiment.results_of` hands them to `Results`, and `emit` writes
them into the script it emits, so that the script prints what `deltalang run` prints, by the same
`Results.summary`.
"""

from __future__ import annotations

from typing import Mapping

import attrs

from deltalang.models import values

from .plan import STATES_AS_RUN, Plan, PlanOp


def named_kind(key: str) -> str:
    """The kind a result's name tells, its last part (`t.L0.states`: `states`): what `Results` assumes of a result
    it is not told about."""
    return key.rsplit(".", 1)[-1]


@attrs.frozen
class Shown:
    kinds: dict[str, str]
    axes: dict[str, tuple[str, ...]]
    token_labels: dict[str, tuple[str, ...]]

    def untold_kinds(self) -> dict[str, str]:
        """The kinds a result's name does not tell (`as st`, `state_after(2)`, `norm(L0.states)`)."""
        return {k: v for k, v in self.kinds.items() if v != named_kind(k)}


def _axes(op: PlanOp | None, reduce: object, value: str | None, block: str, per_channel: bool) -> \
        tuple[str, ...] | None:
    """A reduction's axes, or one head's slice's (the value's axes on `block` without `heads`), else None."""
    if reduce is not None:
        return tuple(a for a, _ in reduce.shape)  # type: ignore[attr-defined]
    if op is None or op.head is None or value is None:
        return None
    names = values.axes(value, per_channel, block)
    return None if names is None or "heads" not in names else tuple(a for a in names if a != "heads")


def shown(plan: Plan, tokens: Mapping[str, tuple[str, ...]] | None = None) -> Shown:
    """The kinds, axes and token labels of `plan`'s visible results (`tokens`: the tokens of runs the resolved
    program does not list, a sweep's cells, by run name)."""
    family = plan.resolved.spec.family
    block, per_channel = family.block_kind, bool(family.per_channel_decay)
    kinds: dict[str, str] = {}
    axes: dict[str, tuple[str, ...]] = {}
    for p in plan.passes:
        for r in p.runs:
            for op in r.ops:
                if op.kind != "read" or op.key is None or op.hidden:
                    continue
                value = "states" if op.value == STATES_AS_RUN else op.value
                kinds[op.key] = value
                names = _axes(op, op.reduce, value, block, per_channel)
                if names is not None:
                    axes[op.key] = names
    run_tokens = {r.name: r.tokens for r in plan.resolved.runs} | dict(tokens or {})
    labels: dict[str, tuple[str, ...]] = {}
    for run, m in plan.measures:
        kinds[m.result_name] = m.kind
        names = _axes(None, m.reduce, m.value, block, per_channel)
        value = values.get(m.value or "")
        per_token = "s" in names if names is not None else value is not None and value.per_token
        if m.kind == "norm" and per_token and not m.step:  # a decode step's one token is not known before it runs
            labels[m.result_name] = run_tokens.get(run, ())
        elif names is not None:
            axes[m.result_name] = names
    return Shown(kinds, axes, labels)
