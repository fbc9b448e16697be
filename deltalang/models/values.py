"""The value catalogue: every value a block serves, and its facts, in one place.

The front end checks programs against this table (does the value exist on the block kind, does it take a
position, can it be written, its axes there: `axes`, a Mamba-2 state's `head_dim, d_state`), the planner
orders ops by `order`, and the model side (`deltalang.runtime.mixer`) serves the values named here: the user side's
properties and methods (`DeltaNetEnvoy.states`, `.state_after(t)` / `.set_state_after(t, v)`) are generated
from this table, with `doc` (and `write_doc`) as their docstrings. A new value is one entry here.
"""

from __future__ import annotations

import attrs

DELTANET = "deltanet"
SSM = "ssm"  # a Mamba-2 (SSD) block: `L[ssm]`
ATTENTION = "attention"
MLP = "mlp"  # a block with neither a recurrent mixer nor attention (nemotron_h's `mlp` and `moe` blocks)
RECURRENT = (DELTANET, SSM)


@attrs.frozen
class Value:
    """One served value of a block."""

    name: str
    shape: str  # for humans: "[b, s, heads, key_dim]"
    doc: str  # for humans, with the shape: the docstring of its envoy property (or method)
    kinds: tuple[str, ...] = (DELTANET,)
    writable: bool = False
    positional: bool = False  # takes a position: state_after(t)
    order: int = 0  # forward order inside a block; lower runs first
    kernel: bool = True  # served at the DeltaNet kernel (needs the pure-torch kernel)
    per_token: bool = False  # has a sequence axis
    write_doc: str = ""  # a positional value's write: the docstring of the envoy's `set_<name>(t, value)`
    ssm_shape: str = ""  # its shape on a Mamba-2 block, where a DeltaNet one's differs (`shape_on`, `axes`)


# `order` follows the mixer's forward: the convolution runs before the kernel,
# the kernel's inputs before its outputs (the head outputs are served once the
# last segment has run, then the final state), the mixer's output last, the
# block's residual output after that.
CATALOGUE: dict[str, Value] = {
    v.name: v
    for v in (
        Value("conv_window_after", "[b, conv_dim, width-1]",
              "The short-convolution inputs tokens after t still see: [b, conv_dim, width-1] (Mamba-2: x|B|C "
              "channels, before the convolution).", kinds=(DELTANET, SSM), writable=True, positional=True, order=10,
              write_doc="Replace what tokens after t see of the tokens up to t through the convolution."),
        Value("attention_queries", "[b, s, heads, key_dim]",
              "Queries the delta rule receives, before l2-norm and 1/sqrt(key_dim): [b, s, heads, key_dim].",
              writable=True, order=20, per_token=True),
        Value("attention_keys", "[b, s, heads, key_dim]",
              "Keys the delta rule receives, before l2-norm: [b, s, heads, key_dim].", writable=True, order=21,
              per_token=True),
        Value("attention_values", "[b, s, heads, value_dim]",
              "Values the delta rule receives: [b, s, heads, value_dim].", writable=True, order=22,
              per_token=True),
        Value("decays", "[b, s, heads] (Kimi: [b, s, heads, key_dim])",
              "Log of the share of the state each token keeps (<= 0): [b, s, heads] (Kimi: [b, s, heads, key_dim]).",
              writable=True, order=23, per_token=True),
        # in (0,1); (0,2) on OLMo-Hybrid
        Value("betas", "[b, s, heads]", "Write strength of each token: [b, s, heads].", writable=True,
              order=24, per_token=True),
        # the Mamba-2 scan's inputs (`deltalang.runtime.ssd`): h_t = exp(A dt_t) h_{t-1} + (dt_t x_t) ⊗ B_t, y_t = h_t C_t + D x_t
        Value("output_matrices", "[b, s, groups, d_state]",
              "C: what each token reads the state with, after the convolution and SiLU (head j of group "
              "j // (heads / groups)): [b, s, groups, d_state].", kinds=(SSM,), writable=True, order=25, per_token=True),
        Value("input_matrices", "[b, s, groups, d_state]",
              "B: the d_state columns each token writes its scaled inputs to, after the convolution and SiLU: "
              "[b, s, groups, d_state].", kinds=(SSM,), writable=True, order=26, per_token=True),
        Value("scan_inputs", "[b, s, heads, head_dim]",
              "x: what each token writes into each head's state (times its step size), after the convolution "
              "and SiLU: [b, s, heads, head_dim].", kinds=(SSM,), writable=True, order=27, per_token=True),
        Value("step_sizes", "[b, s, heads]",
              "dt: each token's step size, after dt_bias, softplus and the clamp to the time-step limit (> 0; "
              "its log decay is A * dt): [b, s, heads].", kinds=(SSM,), writable=True, order=28, per_token=True),
        Value("decay_rates", "[heads]",
              "A = -exp(A_log) < 0, each head's decay rate (the same at every token): [heads].", kinds=(SSM,),
              writable=True, order=29),
        # a token's write, as its two factors: S_t = a_t S_(t-1) + write_keys_t ⊗ write_values_t (`mixer.writes`)
        Value("write_keys", "[b, s, heads, key_dim]",
              "The keys each token writes the state at, as the delta rule sees them (after its l2-norm): the first "
              "factor of its write, S_t = a_t S_(t-1) + write_keys_t ⊗ write_values_t: [b, s, heads, key_dim] "
              "(Mamba-2: dt_t x_t, [b, s, heads, head_dim]).", kinds=(DELTANET, SSM), writable=True, order=35,
              per_token=True, ssm_shape="[b, s, heads, head_dim]"),
        Value("write_values", "[b, s, heads, value_dim]",
              "What each token writes at its key: beta_t (v_t - (a_t S_(t-1))^T k_t), the second factor of its "
              "write: [b, s, heads, value_dim] (Mamba-2: B_t of the head's group, [b, s, heads, d_state]).",
              kinds=(DELTANET, SSM), writable=True, order=36, per_token=True, ssm_shape="[b, s, heads, d_state]"),
        Value("state_input", "[b, heads, key_dim, value_dim] or None",
              "The state the call starts from: None on a fresh prompt, a copy of the cached state on a decode "
              "step.", kinds=(DELTANET, SSM), writable=True, order=30,
              ssm_shape="[b, heads, head_dim, d_state] or None"),
        Value("states", "[b, s, heads, key_dim, value_dim]",
              "The state after every token of the call: [b, s, heads, key_dim, value_dim] (Mamba-2: [b, s, heads, "
              "head_dim, d_state]; read-only).", kinds=(DELTANET, SSM), order=40, per_token=True,
              ssm_shape="[b, s, heads, head_dim, d_state]"),
        Value("state_after", "[b, heads, key_dim, value_dim]",
              "The state after token t of the call (t may be negative): [b, heads, key_dim, value_dim] (Mamba-2: "
              "[b, heads, head_dim, d_state]).",
              kinds=(DELTANET, SSM), writable=True, positional=True, order=50,
              write_doc="Replace the state after token t: token t's output reads it, tokens t+1.. continue from it.",
              ssm_shape="[b, heads, head_dim, d_state]"),
        Value("attention_head_outputs", "[b, s, heads, value_dim]",
              "Each head's read of the state, before the gated norm and output projection: [b, s, heads, value_dim].",
              writable=True, order=55, per_token=True),
        Value("head_outputs", "[b, s, heads, head_dim]",
              "Each head's read of the state, D * x included, before the gated norm and output projection: "
              "[b, s, heads, head_dim].", kinds=(SSM,), writable=True, order=55, per_token=True),
        Value("state_output", "[b, heads, key_dim, value_dim]",
              "The state after the call's last token: [b, heads, key_dim, value_dim] (Mamba-2: [b, heads, head_dim, "
              "d_state]).", kinds=(DELTANET, SSM),
              writable=True, order=60, ssm_shape="[b, heads, head_dim, d_state]"),
        # Mamba-2's gate reaches the gated norm, not the scan call: served where the norm receives it
        Value("gate", "[b, s, inner]",
              "z: the gate of the gated norm, which multiplies the head outputs (heads x head_dim, flattened) by "
              "silu(z) before the norm and the output projection: [b, s, heads * head_dim].", kinds=(SSM,),
              writable=True, order=70, kernel=False, per_token=True),
        Value("attention_output", "[b, s, hidden]", "What the mixer adds to the residual stream: [b, s, hidden].",
              kinds=(DELTANET, SSM), writable=True, order=80, kernel=False, per_token=True),
        Value("output", "[b, s, hidden]", "The block's output, the residual stream after it: [b, s, hidden].",
              kinds=(DELTANET, SSM, ATTENTION, MLP), writable=True, order=90, kernel=False, per_token=True),
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


def shape_on(name: str, kind: str) -> str:
    """A value's shape on a block of `kind` (`deltanet`, `ssm`, `attention`), as the catalogue writes it."""
    v = CATALOGUE[name]
    return v.ssm_shape if kind == SSM and v.ssm_shape else v.shape


def names() -> list[str]:
    return list(CATALOGUE)


def get(name: str) -> Value | None:
    return CATALOGUE.get(name)


def axes(name: str, per_channel_decay: bool = False, kind: str = DELTANET) -> tuple[str, ...] | None:
    """A value's axes on a block of `kind` as its catalogue shape there names them (`shape_on`: a DeltaNet
    block's `states` `("b", "s", "heads", "key_dim", "value_dim")`, a Mamba-2 block's `("b", "s", "heads",
    "head_dim", "d_state")`), `decays` with `key_dim` on a per-channel family (Kimi); None for a value with no
    tensor shape (`tokens`). A model's recurrent blocks are of one kind (its family's mechanism), so every
    block of a selection names a value's axes alike."""
    if name == "decays" and per_channel_decay:
        return ("b", "s", "heads", "key_dim")
    shape = shape_on(name, kind) if name in CATALOGUE else MODEL_VALUES.get(name)
    if shape is None or name == "tokens":
        return None
    return tuple("window" if a == "width-1" else a for a in shape.split("]")[0].strip("[ ").split(", "))
