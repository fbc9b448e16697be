"""Which runs of one stage share a forward: `batch_stage()`, the planner's third decision (see `plan`).

Traces of a stage with the same kernel route share forwards of at most `BATCH_TOKENS` padded tokens
(sorted by length, so little is padded); each generate runs alone. Batching never changes a result: the
shorter runs are left-padded and every value is still the run's own (`plan`'s module doc says how).
Works on anything with `kind`, `route` and `n_tokens` (a `plan.RunPlan`).

deltalang never hands transformers a batch it cannot run: `padding_refused(spec)` says why a model's
left-padded forward fails (Kimi-Linear with fewer key-value heads than attention heads: transformers'
attention mask does not broadcast over its heads), and then only runs of one length share a forward
(`batch_stage(pad=False)`), which `emit --plan` says.
"""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

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
