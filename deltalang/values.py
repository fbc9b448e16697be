"""The value catalogue: every value a block serves, and its facts, in one place.

The front end checks programs against this table (does the value exist on the
block kind, does it take a position, can it be written), the planner orders ops
by `order`, and the model side (`deltalang.mixer`) serves the values named here.
"""

from __future__ import annotations

import attrs

DELTANET = "deltanet"
ATTENTION = "attention"


@attrs.frozen
class Value:
    """One served value of a block."""

    name: str
    shape: str  # for humans: "[b, s, heads, key_dim]"
    doc: str
    kinds: tuple[str, ...] = (DELTANET,)
    writable: bool = False
    positional: bool = False  # takes a position: state_after(t)
    order: int = 0  # forward order inside a block; lower runs first
    kernel: bool = True  # served at the DeltaNet kernel (needs the pure-torch kernel)
    per_token: bool = False  # has a sequence axis


# `order` follows the mixer's forward: the convolution runs before the kernel,
# the kernel's inputs before its outputs (the head outputs are served once the
# last segment has run, then the final state), the mixer's output last, the
# block's residual output after that.
CATALOGUE: dict[str, Value] = {
    v.name: v
    for v in (
        Value("conv_window_after", "[b, conv_dim, width-1]",
              "the short-convolution inputs that tokens after t still see", writable=True,
              positional=True, order=10),
        Value("attention_queries", "[b, s, heads, key_dim]",
              "queries the delta rule receives, before l2-norm and scale", writable=True, order=20,
              per_token=True),
        Value("attention_keys", "[b, s, heads, key_dim]",
              "keys the delta rule receives, before l2-norm", writable=True, order=21, per_token=True),
        Value("attention_values", "[b, s, heads, value_dim]", "values the delta rule receives",
              writable=True, order=22, per_token=True),
        Value("decays", "[b, s, heads] (Kimi: [b, s, heads, key_dim])",
              "log of the share of the state each token keeps, <= 0", writable=True, order=23,
              per_token=True),
        Value("betas", "[b, s, heads]", "write strength, (0,1); (0,2) on OLMo-Hybrid", writable=True,
              order=24, per_token=True),
        Value("state_input", "[b, heads, key_dim, value_dim] or None",
              "the state the call starts from", writable=True, order=30),
        Value("states", "[b, s, heads, key_dim, value_dim]", "the state after every token (read-only)",
              order=40, per_token=True),
        Value("state_after", "[b, heads, key_dim, value_dim]", "the state after token t",
              writable=True, positional=True, order=50),
        Value("attention_head_outputs", "[b, s, heads, value_dim]",
              "each head's read of the state, before the gated norm and output projection",
              writable=True, order=55, per_token=True),
        Value("state_output", "[b, heads, key_dim, value_dim]", "the state after the call's last token",
              writable=True, order=60),
        Value("attention_output", "[b, s, hidden]", "what the mixer adds to the residual stream",
              writable=True, order=80, kernel=False, per_token=True),
        Value("output", "[b, s, hidden]", "the block's output: the residual stream after it",
              kinds=(DELTANET, ATTENTION), writable=True, order=90, kernel=False, per_token=True),
    )
}

# values of the whole model, not of a block
MODEL_VALUES: dict[str, str] = {
    "logits": "[b, s, vocab]",
    "next_token_probs": "[b, vocab]",
    "tokens": "[b, new_tokens] (generate only)",
}

# `state` is the recipes' per-token spelling of state_after under tracer.iter;
# it is part of the Python API, not the language.
PYTHON_ONLY = ("state",)


def names() -> list[str]:
    return list(CATALOGUE)


def get(name: str) -> Value | None:
    return CATALOGUE.get(name)
