"""Which implementation runs behind transformers' kernel globals, chosen per call by device; packed sequences.

No FLA needed: a fake package stands in for it, bound by transformers' own
`use_kernel_func_from_hub_with_fallback` exactly as `import fla` would be. Its
"compiled" kernel records its calls and computes with transformers' torch
reference, so a value served by splitting it must equal transformers' cache.
Ground truth is transformers itself (a plain forward, its cache, or one call per
sequence), never deltalang's own output.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable, Iterator

import pytest
import torch
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

import deltalang
from deltalang.ground.errors import DeltaError
from deltalang.models import families, internals
from deltalang.models.testing import FAMILY_NAMES, load_hf, tiny_checkpoint
from deltalang.runtime import backends, info, kernels

PROMPT = "The Eiffel Tower is in"
FAKE = "deltalang_fake_kernels"


def _fake_package(name: str, impl: Callable[..., Any], internal: str | None) -> None:
    """A package `FAKE` whose `internal.name` is `impl`, importable as transformers imports FLA."""
    root = types.ModuleType(FAKE)
    sys.modules[FAKE] = root
    parent, path = root, FAKE
    for part in (internal or "").split(".") if internal else []:
        path = f"{path}.{part}"
        mod = types.ModuleType(path)
        sys.modules[path] = mod
        setattr(parent, part, mod)
        parent = mod
    setattr(parent, name, impl)


def _fake_wrapper(fam: families.Family, calls: list[torch.device]) -> Callable[..., Any]:
    """transformers' wrapper of `fam`'s prompt kernel, bound to a fake compiled implementation."""
    real = kernels.original(fam, fam.chunk_kernel)
    reference = real.__wrapped__
    name = "chunk_kda" if fam.per_channel_decay else "chunk_gated_delta_rule"

    def compiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 scale: float | None = None, initial_state: torch.Tensor | None = None,
                 output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                 cu_seqlens: torch.Tensor | None = None) -> Any:
        calls.append(q.device)
        assert cu_seqlens is None
        return reference(q, k, v, g=g, beta=beta, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    internal = "ops.kda" if fam.per_channel_decay else "ops.gated_delta_rule"
    _fake_package(name, compiled, internal)
    try:
        return use_kernel_func_from_hub_with_fallback(name, FAKE)(reference)
    finally:
        for key in [k for k in sys.modules if k.startswith(FAKE)]:
            del sys.modules[key]


@pytest.fixture(params=FAMILY_NAMES)
def faked(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[torch.device]]]:
    """A family whose prompt kernel global is bound to the fake compiled implementation."""
    fam = families.by_name(request.param)
    calls: list[torch.device] = []
    kernels.install(fam)
    real = kernels.original(fam, fam.chunk_kernel)
    wrapper = _fake_wrapper(fam, calls)
    kernels.uninstall(fam)
    setattr(fam.module, fam.chunk_kernel, wrapper)
    kernels.install(fam)
    try:
        yield request.param, calls
    finally:
        kernels.uninstall(fam)
        setattr(fam.module, fam.chunk_kernel, real)
        kernels.install(fam)


def test_the_implementation_inside_transformers_wrapper_is_named(faked: tuple) -> None:
    name, _ = faked
    fam = families.by_name(name)
    b = kernels.backend(fam, fam.chunk_kernel)
    op = "chunk_kda" if fam.per_channel_decay else "chunk_gated_delta_rule"
    assert b.name == f"{FAKE} {op}"
    assert b.reference is kernels.original(fam, fam.chunk_kernel).__wrapped__
    assert b.pick(torch.device("cuda")) is b.compiled
    assert b.pick(torch.device("cpu")) is b.reference
    with backends.using("compiled"):
        assert b.pick(torch.device("cpu")) is b.compiled
    with backends.using("reference"):
        assert b.pick("cuda") is b.reference
    spec = deltalang.load_model(tiny_checkpoint(name)).spec
    prompt, _ = info.kernel_names(spec)
    assert f"{FAKE} {op} (compiled) on CUDA" in prompt
    state = spec.linear_layers()[0]
    entry = info.support_table(spec, kernels=True)["linear_attn.state_after"][state]
    assert entry.startswith("available: ") and f"{FAKE} {op}" in entry
    assert info.support_table(spec)["linear_attn.state_after"][state] == "available"
    assert f"{FAKE} {op}" in info.format_info(spec)


def test_other_forms_of_a_kernel_global() -> None:
    fam = families.qwen3_5
    real = kernels.original(fam, fam.chunk_kernel)
    # the package is missing: transformers' wrapper holds the torch function itself
    torch_only = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "deltalang_no_such_package")(
        real.__wrapped__)
    plain = backends.of(torch_only)
    runs = internals.kernel_function(torch_only)  # 5.25 binds a `Func` module calling the wrapper
    assert plain.compiled is None and plain.describe() == "torch reference"
    assert plain.pick("cuda") is runs and plain.pick("cpu") is runs
    bare = backends.of(real.__wrapped__)
    assert bare.compiled is None and bare.reference is real.__wrapped__

    @functools.wraps(real.__wrapped__)
    def later_form(*args: Any, **kwargs: Any) -> Any:  # a wrapper whose closure deltalang does not know
        return real.__wrapped__(*args, **kwargs)

    unknown = backends.of(later_form)
    assert unknown.reference is real.__wrapped__ and unknown.compiled is later_form
    assert "unknown form" in unknown.name

    def compiled(*args: Any) -> Any:
        return args

    compiled.__module__ = "fla.ops.gated_delta_rule"
    none = backends.of(compiled)
    assert none.reference is None and none.pick("cpu") is compiled
    with backends.using("reference"):
        assert none.pick("cpu") is None
    with pytest.raises(DeltaError, match="unknown kernel mode"):
        backends.set_mode("fast")


def test_cpu_calls_run_the_reference_and_compiled_mode_splits_the_implementation(faked: tuple) -> None:
    name, calls = faked
    path = tiny_checkpoint(name)
    model = deltalang.load_model(path)
    hf = load_hf(path).eval()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layer = model.spec.linear_layers()[0]
    mix = model.layers[layer].linear_attn
    t = 6
    with torch.no_grad():
        truth = hf(ids[:, : t + 1], use_cache=True).past_key_values.get_recurrent_state(layer)
        logits = hf(ids).logits
    assert calls == []  # a CPU forward never reaches the compiled kernel
    with torch.no_grad(), model.trace(PROMPT):
        cpu_state = mix.state_after(t).save()
    assert calls == []
    with backends.using("compiled"), torch.no_grad(), model.trace(PROMPT):
        state = mix.state_after(t).save()
        final = mix.state_output.save()
        out = model.logits.save()
    assert len(calls) == len(model.spec.linear_layers()) + 1  # the asked block split in two
    assert backends.mode() == "auto"
    torch.testing.assert_close(state, truth, atol=1e-5, rtol=0)
    torch.testing.assert_close(cpu_state, truth, atol=1e-5, rtol=0)
    with torch.no_grad():
        whole = hf(ids, use_cache=True).past_key_values.get_recurrent_state(layer)
    torch.testing.assert_close(final, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(out, logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_packed_sequences_on_torch_kernels_are_refused_and_a_trace_refuses_them(family: str) -> None:
    """`cu_seq_lens_q` of two sequences through a mixer on the torch kernels is refused, never merged (as
    transformers refuses; tests/test_packed.py: the whole model); one sequence runs as the plain call."""
    model = deltalang.load_model(tiny_checkpoint(family))
    layer = model.spec.linear_layers()[0]
    mixer = getattr(model.layers[layer]._module, model.family.mixer_attr)  # (glm5_next: a composite's text stack)
    torch.manual_seed(0)
    hidden = torch.randn(1, 9 + 13, model.spec.config.get_text_config().hidden_size)
    with torch.no_grad():
        with pytest.raises(kernels.PackedSequencesError, match="packed sequences"):
            mixer(hidden_states=hidden, cu_seq_lens_q=torch.tensor([0, 9, 22], dtype=torch.int32))
        one = mixer(hidden_states=hidden, cu_seq_lens_q=torch.tensor([0, 22], dtype=torch.int32))
        plain = mixer(hidden_states=hidden)
    one = one[0] if isinstance(one, tuple) else one
    plain = plain[0] if isinstance(plain, tuple) else plain
    torch.testing.assert_close(one, plain, atol=1e-5, rtol=0)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    n = ids.shape[1]
    with pytest.raises(DeltaError, match="packed sequences"):
        with torch.no_grad(), model.trace(ids, cu_seq_lens_q=torch.tensor([0, 5, n], dtype=torch.int32)):
            model.layers[layer].linear_attn.state_output.save()
