"""Which runs of one stage share a forward: `batch_stage()`, the planner's third decision (see `plan`).

Traces of a stage with the same kernel route share forwards of at most `BATCH_TOKENS` padded tokens
(sorted by length, so little is padded); each generate runs alone. Batching never changes a result: the
shorter runs are left-padded and every value is still the run's own (`plan`'s module doc says how).
Works on anything with `kind`, `route` and `n_tokens` (a `plan.RunPlan`).

deltalang never hands transformers a batch it cannot run: `padding_refused(spec)` says why a model's
left-padded forward fails (Kimi-Linear with fewer key-value heads than attention heads: transformers'
attention mask does not broadcast over its heads), and then only runs of one length share a forward
(`batch_stage(pad=False)`), which `emit --plan` says. `steps_bound`: the step count past which a plan's
decisions do not depend on a generate's max_new_tokens (`plan.checked_plan`, what `check` builds).
"""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

from deltalang.language.ir import FromRun, Resolved

R = TypeVar("R", bound=Any)


BATCH_TOKENS = 16384  # at most this many (padded) tokens in one shared forward


def padding_refused(spec: Any) -> str | None:
    """Why runs of different lengths cannot share a forward of this model (`spec.ModelSpec`), or None."""
    cfg = getattr(spec, "config", None)
    family = getattr(getattr(spec, "family", None), "name", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None)
    if family == "kimi_linear" and heads is not None and kv is not None and kv < heads:
        return (f"runs of different lengths run apart: transformers' left-padded forward fails on Kimi-Linear "
                f"with fewer key-value heads ({kv}) than attention heads ({heads})")
    return None


def batch_stage(stage: Sequence[R], batch: bool = True, max_tokens: int = BATCH_TOKENS,
                pad: bool = True) -> list[list[R]]:
    """Traces of one stage with one route share forwards; each generate runs alone.

    A shared forward holds runs of similar length (sorted by length, so little is padded) up to
    `max_tokens` padded tokens. Runs of different lengths are left-padded in it; every value is still
    the run's own (see the module doc and `Pass.padded`). `pad=False`: only runs of one length share one.
    """
    groups: list[list[R]] = []
    traces: dict[Any, list[R]] = {}
    for run in stage:
        if run.kind == "generate" or not batch:
            groups.append([run])
        else:
            traces.setdefault(run.route if pad else (run.route, run.n_tokens), []).append(run)
    shared: list[list[R]] = []
    for runs in traces.values():
        current: list[R] = []
        for run in sorted(runs, key=lambda r: r.n_tokens):  # stable: source order within a length
            if current and (len(current) + 1) * run.n_tokens > max_tokens:
                shared.append(current)
                current = []
            current.append(run)
        shared.append(current)
    return shared + groups


def steps_bound(resolved: Resolved) -> int | None:
    """The generates' step count past which nothing a plan decides depends on it (None: no generate is longer).

    A generate's ops and measures without `step K:` are one per step, and every error the plan finds compares a
    step written (or every step of one generate) with another generate's count. Counts clipped to one past every
    written step and every count but the largest keep each of those comparisons: the largest count is the only one
    clipped, and stays above every other count and every written step.
    """
    gens = [r for r in resolved.runs if r.kind == "generate"]
    counts = sorted({r.max_new_tokens or 1 for r in gens})
    written = [x.step for r in gens for x in (*r.ops, *r.measures) if x.step is not None]
    written += [s.step for r in resolved.runs for op in r.ops if isinstance(s := op.source, FromRun)
                and s.step is not None]
    bound = max([*written, *counts[:-1]], default=0) + 2
    return bound if counts and counts[-1] > bound else None

