"""Reads of a reduction of `states`, served beside the kernel call: the full states never exist.

The user side (`DeltaNetEnvoy.states_reduced(reduction)`) registers a `measures.Reduction` on the site
under a key and parks on `"{mixer path}.states_reduced.{key}"`. The kernel side (`serve_reduced`, called by
`DeltaRuleCall.kernel` before `states` and its own segments, from the same inputs and initial state the `states`
read sees) serves a norm over `key_dim, value_dim` (and `heads`) from each head's squared state norm
(`deltarule.per_token_sq_norms`: no state per token at all), and runs `deltarule.per_token_reduced` once for
the other reductions waiting on this call, each fed the states a group of chunks at a time; the kernel call itself is left as it is. A
result that keeps positions is `[b, s, ...]` in the call's padded rows, cut past each invoke's padding on
the user side, as `states` is; a mean or norm over positions leaves the padding out.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from .. import deltarule
from ..measures import Reduction

NAME = "states_reduced"
_KEYS = itertools.count()


def _pending(site: Any) -> dict[str, Reduction]:
    """The reductions registered on a site and not yet served, by key."""
    return site.__dict__.setdefault("_reductions", {})


def register(site: Any, reduction: Reduction) -> str:
    """Register `reduction` on `site`; the name of the location its read parks on (after the mixer path)."""
    key = str(next(_KEYS))
    _pending(site)[key] = reduction
    return f"{NAME}.{key}"


def serve_reduced(call: Any, step: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  g: torch.Tensor, beta: torch.Tensor, initial: torch.Tensor | None, l2: bool) -> None:
    """Serve every reduction of `states` a worker waits on in this call (`call`: the `DeltaRuleCall`)."""
    while True:  # a worker asks for its next reduction once the last is served
        names = _waiting(call, step)
        if not names:
            return
        b, s = query.shape[:2]
        pending = _pending(call)
        asked = {n: pending.pop(n.split(".", 1)[1]) for n in names}
        fast = [n for n, red in asked.items() if red.uses_head_norms(call.pads)]
        if fast:  # norms over key_dim, value_dim: from each head's squared norm, without the states
            sq = deltarule.per_token_sq_norms(call.family, query, key, value, g, beta, initial, l2)
            for n in fast:
                call.serve(n, asked.pop(n).from_head_norms(sq), step)
        streams = {n: red.stream(b, s, call.pads) for n, red in asked.items()}
        if streams:
            deltarule.per_token_reduced(call.family, query, key, value, g, beta, initial, l2,
                                        [st.add for st in streams.values()])
        for n, st in streams.items():
            call.serve(n, st.result(), step)


def _waiting(call: Any, step: int) -> list[str]:
    """The locations (after the mixer path) of the registered reductions a worker waits on at this step (a
    worker of a later step may already be parked on its own: it is served at its step)."""
    prefix = f"{call.path}.{NAME}."
    pending = _pending(call)
    out = []
    for m in call._mediators():
        p = m.pending
        if p is None or not p.provider or not p.provider.startswith(prefix) or p.iteration != step:
            continue
        if p.provider[len(prefix):] in pending and p.provider[len(call.path) + 1:] not in out:
            out.append(p.provider[len(call.path) + 1:])
    return out
