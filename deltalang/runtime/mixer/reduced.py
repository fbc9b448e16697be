"""Reads of a reduction of `states`, served beside the kernel call: the full states never exist.

The user side (`DeltaNetEnvoy.states_reduced(reduction)`) registers a `measures.Reduction` on the site
under a key and parks on `"{mixer path}.states_reduced.{key}"`. The kernel side (`serve_reduced`, called by
`DeltaRuleCall.kernel` before `states` and its own segments, from the same inputs and initial state the `states`
read sees; the kernel call itself is left as it is) runs a reduction that starts with `.head(k)` on that value
head's inputs alone (its key head where keys are grouped), then serves a norm over `key_dim, value_dim` (and
`heads`) from each head's squared state norm (`deltarule.per_token_sq_norms`: no state per token at all), a
projection from each head's dot products (`deltarule.per_token_projections`, the same), and the other
reductions from one `deltarule.per_token_reduced`, fed the states a group of chunks at a time. A result
that keeps positions is `[b, s, ...]` in the call's padded rows, cut past each invoke's padding on the
user side, as `states` is; a mean or norm over positions leaves the padding out.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from deltalang.ground.measures import Reduction

from .. import deltarule

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
    inputs = (query, key, value, g, beta, initial)
    while True:  # a worker asks for its next reduction once the last is served
        names = _waiting(call, step)
        if not names:
            return
        pending = _pending(call)
        by_head: dict[int | None, dict[str, Reduction]] = {}  # a reduction of one head runs on that head alone
        for n in names:
            red = pending.pop(n.split(".", 1)[1])
            first = red.steps[0] if red.steps else None
            if first is not None and first[0] == "head":
                by_head.setdefault(int(first[1]), {})[n] = Reduction(red.axes, [("head", 0), *red.steps[1:]])
            else:
                by_head.setdefault(None, {})[n] = red
        for head, asked in by_head.items():
            _serve(call, step, asked, inputs if head is None else _one_head(inputs, head), l2)


def _one_head(inputs: tuple[Any, ...], head: int) -> tuple[Any, ...]:
    """The call's inputs for value head `head` alone (its key head where keys are grouped), as one head."""
    query, key, value, g, beta, initial = inputs
    kh = head // (value.shape[2] // key.shape[2])  # the kernel repeats each key head over consecutive value heads
    one = slice(head, head + 1)
    return (query[:, :, kh:kh + 1], key[:, :, kh:kh + 1], value[:, :, one], g[:, :, one], beta[:, :, one],
            None if initial is None else initial[:, one])


def _serve(call: Any, step: int, asked: dict[str, Reduction], inputs: tuple[Any, ...], l2: bool) -> None:
    """Serve `asked` from `inputs`: a norm over key_dim, value_dim (heads) from each head's squared norm, a
    projection from each head's dot products, the others from the states a group of chunks at a time."""
    query, key, value, g, beta, initial = inputs
    b, s = query.shape[:2]
    norms = {n: f for n, red in asked.items() if (f := _head_norms(red, call.pads)) is not None}
    if norms:  # without the states
        sq = deltarule.per_token_sq_norms(call.family, query, key, value, g, beta, initial, l2)
        for n, f in norms.items():
            call.serve(n, f(sq), step)
    done = set(norms)
    for n, red in asked.items():  # a projection first: from the dot products, without the states
        plan = _projection(red, call.pads) if n not in done else None
        if plan is not None:
            per_head = deltarule.per_token_projections(call.family, query, key, value, g, beta, initial, l2, plan[0])
            call.serve(n, plan[1](per_head.sum(-1)), step)
            done.add(n)
    streams = {n: red.stream(b, s, call.pads) for n, red in asked.items() if n not in done}
    if streams:
        deltarule.per_token_reduced(call.family, query, key, value, g, beta, initial, l2,
                                    [st.add for st in streams.values()])
    for n, st in streams.items():
        call.serve(n, st.result(), step)


def _projection(red: Reduction, pads: list[int] | None) -> tuple[torch.Tensor, Reduction] | None:
    """A reduction that starts with a projection of `states` (of one head, inputs cut to it): its direction
    `[heads, key_dim, value_dim]` and the steps after it (on `[b, s]`), or None."""
    steps = red.steps
    if red.axes != ("b", "s", "heads", "key_dim", "value_dim") or not steps:
        return None
    if steps[0][0] == "project":
        direction, after = steps[0][1], steps[1:]
    elif len(steps) >= 2 and steps[0][0] == "head" and steps[0][1] == 0 and steps[1][0] == "project":
        direction, after = steps[1][1][None], steps[2:]
    else:
        return None
    if any(pads or ()) and not red.keeps_positions:  # a later step over positions would count the padding
        return None
    return direction, Reduction(("b", "s"), after)


def _head_norms(red: Reduction, pads: list[int] | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How `red` follows from each head's squared state norm `sq` `[b, s, heads]` (a function of it), or None:
    a norm over key_dim, value_dim (and heads) first, or, of one head (inputs cut to it), a norm after it."""
    if red.uses_head_norms(pads):
        return red.from_head_norms
    steps = red.steps
    if len(steps) < 2 or steps[0][0] != "head" or steps[0][1] != 0 or steps[1][0] != "norm":
        return None
    if set(steps[1][1] or ("key_dim", "value_dim")) != {"key_dim", "value_dim"}:
        return None
    if any(pads or ()) and not red.keeps_positions:  # a later step over positions would count the padding
        return None
    rest = Reduction(("b", "s"), steps[2:])
    return lambda sq: rest(sq[..., 0].sqrt())


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
