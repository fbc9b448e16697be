"""Several wrappers in one process, and the value layer's process-wide state restored exactly.

Every wrapper of a model works, in any order: two `wrap_model` of one in-memory
transformers model (a re-run notebook cell), two `load_model` of one checkpoint,
models of two families side by side. The process-wide state (the kernel
globals in transformers' modules, the route table, the stack of running
mixers) is left as it was found. Ground truth is transformers' own cache.
"""

from __future__ import annotations

import gc
import importlib.util
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

import deltalang
from deltalang.models.internals import cache_kwargs
from deltalang.models.spec import load_tokenizer
from deltalang.models.testing import load_hf, tiny_checkpoint
from deltalang.runtime import kernels, mixer
from deltalang.runtime.model import wrap_model

PROMPT = "The Eiffel Tower is in"
OTHER = "My favourite food is pizza"


def _ids(model: deltalang.DeltaModel, text: str) -> torch.Tensor:
    return model.tokenizer(text, return_tensors="pt").input_ids


def _cache_after(hf: torch.nn.Module, ids: torch.Tensor) -> object:
    with torch.no_grad():
        return hf(ids, use_cache=True).past_key_values


def _check_reads(model: deltalang.DeltaModel, truth: torch.nn.Module, positions: tuple[int, ...] = (3, 9)) -> None:
    """`state_after(t)` of every DeltaNet block equals transformers' cache after t+1 tokens."""
    ids = _ids(model, PROMPT)
    layers = model.spec.linear_layers()
    got: dict[tuple[int, int], torch.Tensor] = {}
    with torch.no_grad(), model.trace(PROMPT):
        for i in layers:
            for t in positions:
                got[i, t] = model.layers[i].linear_attn.state_after(t).save()
    for t in positions:
        cache = _cache_after(truth, ids[:, : t + 1])
        for i in layers:
            torch.testing.assert_close(got[i, t], cache.get_recurrent_state(i), atol=1e-5, rtol=0)


def _check_write(model: deltalang.DeltaModel, truth: torch.nn.Module, t: int = 8) -> None:
    """A convolution-window write gives the logits of transformers' cache patched by hand."""
    ids, other = _ids(model, PROMPT), _ids(model, OTHER)
    layers = model.spec.linear_layers()
    donor = _cache_after(truth, other[:, : t + 1])
    with torch.no_grad(), model.trace(PROMPT):
        for i in layers:
            model.layers[i].linear_attn.set_conv_window_after(t, donor.get_conv_state(i)[:, :, 1:])
        patched = model.logits[:, -1].save()
    cache = _cache_after(truth, ids[:, : t + 1])
    with torch.no_grad():
        for i in layers:
            cache.get_conv_state(i).copy_(donor.get_conv_state(i))
        ref = truth(ids[:, t + 1:], **cache_kwargs(cache, truth), use_cache=True).logits[:, -1]
        clean = truth(ids).logits[:, -1]
    torch.testing.assert_close(patched, ref, atol=1e-4, rtol=0)
    assert (patched - clean).abs().max() > 1e-3


@pytest.fixture(scope="module")
def truth() -> dict[str, torch.nn.Module]:
    """Plain transformers models, never wrapped: the ground truth."""
    return {fam: load_hf(tiny_checkpoint(fam)).eval()
            for fam in ("qwen3_5", "kimi_linear")}


# ---------------------------------------------------------------------------
# several wrappers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])  # kimi: the mixer is renamed
def test_two_wrappers_of_one_model_both_work_in_any_order(family: str, truth: dict) -> None:
    path = tiny_checkpoint(family)
    hf = load_hf(path).eval()
    first = wrap_model(hf, load_tokenizer(path, False))
    second = wrap_model(hf, load_tokenizer(path, False))  # the notebook cell, run again
    for model in (second, first, first, second, first):
        _check_reads(model, truth[family])
    _check_write(first, truth[family])
    _check_write(second, truth[family])
    _check_write(first, truth[family])


def test_a_dropped_wrapper_is_not_kept_alive_and_the_others_still_work(truth: dict) -> None:
    path = tiny_checkpoint("qwen3_5")
    hf = load_hf(path).eval()
    kept = wrap_model(hf, load_tokenizer(path, False))
    dropped = wrap_model(hf, load_tokenizer(path, False))
    _check_reads(dropped, truth["qwen3_5"])
    gone = weakref.ref(dropped.interleaver)
    del dropped
    gc.collect()
    assert gone() is None, "the model's mixers keep a dropped wrapper alive"
    _check_reads(kept, truth["qwen3_5"])
    again = wrap_model(hf, load_tokenizer(path, False))
    _check_reads(again, truth["qwen3_5"])
    _check_reads(kept, truth["qwen3_5"])


def test_two_loads_of_one_checkpoint_interleaved(truth: dict) -> None:
    path = tiny_checkpoint("qwen3_5")
    a, b = deltalang.load_model(path), deltalang.load_model(path)
    for model in (a, b, a):
        _check_reads(model, truth["qwen3_5"])
    _check_write(b, truth["qwen3_5"])
    _check_write(a, truth["qwen3_5"])


def test_two_families_side_by_side(truth: dict) -> None:
    qwen = deltalang.load_model(tiny_checkpoint("qwen3_5"))
    kimi = deltalang.load_model(tiny_checkpoint("kimi_linear"))
    for model, fam in ((qwen, "qwen3_5"), (kimi, "kimi_linear"), (qwen, "qwen3_5"), (kimi, "kimi_linear")):
        _check_reads(model, truth[fam])
        _check_write(model, truth[fam])
    # routing one family leaves the other's kernels as they are
    with deltalang.routed(kimi.family, "torch"):
        assert kernels.current_route(qwen.family) == "default"
        _check_reads(qwen, truth["qwen3_5"])
        _check_reads(kimi, truth["kimi_linear"])


# ---------------------------------------------------------------------------
# the route table
# ---------------------------------------------------------------------------


PROGRAM = 'prompt p = "The Eiffel Tower is in"\ntrace t on p {\n    route ROUTE\n    read L0.state_output\n}\n'


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model(tiny_checkpoint("qwen3_5"))


@pytest.fixture()
def token_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts prompts run through the token-by-token kernel (the `torch` route)."""
    calls: list[int] = []
    real = kernels.token_by_token

    def counting(fam: deltalang.models.families.Family):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(fam)

    monkeypatch.setattr(kernels, "token_by_token", counting)
    return calls


@pytest.mark.parametrize("before,program", [("torch", "torch"), ("torch", "default"), ("default", "torch")])
def test_a_programs_route_restores_the_route_in_force_before_it(model: deltalang.DeltaModel, before: str,
                                                                program: str, token_calls: list[int],
                                                                truth: dict) -> None:
    fam = model.family
    deltalang.route_kernels(fam, before)
    try:
        results = deltalang.run(PROGRAM.replace("ROUTE", program), model=model)
        assert bool(token_calls) == (program == "torch")  # the program's route was in force while it ran
        assert kernels.current_route(fam) == before
        token_calls.clear()
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[0].linear_attn.state_output.save()
        assert bool(token_calls) == (before == "torch")  # and the user's is in force after it
    finally:
        deltalang.route_kernels(fam, "default")
    final = _cache_after(truth["qwen3_5"], _ids(model, PROMPT)).get_recurrent_state(0)
    torch.testing.assert_close(results["t.L0.state_output"], final, atol=1e-5, rtol=0)


@pytest.mark.parametrize("engine", ["auto", "naive"])
def test_a_sweeps_route_restores_the_route_in_force_before_it(model: deltalang.DeltaModel, engine: str) -> None:
    text = deltalang.sweep('route default; write L0.state_after(t) = zeros; measure prob("P")', t=range(2),
                           prompt=PROMPT)
    deltalang.route_kernels(model.family, "torch")
    try:
        deltalang.run_sweep(text, model, progress=False, engine=engine)
        assert kernels.current_route(model.family) == "torch"
    finally:
        deltalang.route_kernels(model.family, "default")


def test_routed_nests_and_restores_on_error(model: deltalang.DeltaModel) -> None:
    fam = model.family
    assert kernels.current_route(fam) == "default"
    with pytest.raises(RuntimeError, match="inside"):
        with deltalang.routed(fam, "torch"):
            with deltalang.routed(fam, "default"):
                assert kernels.current_route(fam) == "default"
            assert kernels.current_route(fam) == "torch"
            raise RuntimeError("inside")
    assert kernels.current_route(fam) == "default"
    with pytest.raises(deltalang.DeltaError, match="unknown route"):
        with deltalang.routed(fam, "fast"):
            pass
    assert kernels.current_route(fam) == "default"


def test_emitted_code_scopes_the_route(model: deltalang.DeltaModel) -> None:
    code = deltalang.compile(PROGRAM.replace("ROUTE", "torch"), model).code
    assert "with deltalang.routed(model.family, 'torch'):" in code
    assert "route_kernels" not in code


# ---------------------------------------------------------------------------
# the stack of running mixers
# ---------------------------------------------------------------------------


class _Interrupt(BaseException):
    """Stands in for KeyboardInterrupt: a BaseException, which torch's always-call hooks do not see."""


@pytest.mark.parametrize("raised", [RuntimeError, _Interrupt])
def test_a_traced_forward_that_raises_leaves_the_stack_as_it_was(model: deltalang.DeltaModel, truth: dict,
                                                                 raised: type[BaseException]) -> None:
    assert mixer._STACK == []
    mix = model.layers[1].linear_attn
    out_proj = mix._module.out_proj  # runs inside the mixer's forward, after the kernel

    def boom(*_: object) -> None:
        raise raised("stop")

    handle = out_proj.register_forward_hook(boom)
    try:
        with pytest.raises(raised):
            with torch.no_grad(), model.trace(PROMPT):
                mix.state_after(3).save()
    finally:
        handle.remove()
    assert mixer._STACK == []
    assert not mix.site.running
    _check_reads(model, truth["qwen3_5"])  # the next trace works
    assert mixer._STACK == []


def test_a_nested_call_that_never_exits_is_unwound_with_its_caller(model: deltalang.DeltaModel) -> None:
    """A mixer's forward calls another mixer, whose forward ends in a BaseException (no exit hook)."""
    outer, inner = (model.layers[i].linear_attn._module for i in model.spec.linear_layers()[:2])
    seen: list[list[object]] = []

    armed: list[bool] = []

    def interrupt(*_: object) -> None:
        if armed:
            armed.clear()
            seen.append(list(mixer._STACK))
            raise _Interrupt("stop")

    hidden: list[torch.Tensor] = []

    def keep(_: object, args: tuple, kwargs: dict) -> None:
        hidden.append(kwargs.get("hidden_states", args[0] if args else None))

    def call_inner(*_: object) -> None:
        armed.append(True)
        try:
            inner(hidden[-1])
        except _Interrupt:
            pass

    hooks = [inner.out_proj.register_forward_hook(interrupt), outer.out_proj.register_forward_pre_hook(call_inner),
             outer.register_forward_pre_hook(keep, with_kwargs=True)]
    try:
        with torch.no_grad():  # a plain forward, outside any trace
            model._module(_ids(model, PROMPT))
    finally:
        for h in hooks:
            h.remove()
    assert seen == [[outer._deltalang_site, inner._deltalang_site]]
    assert mixer._STACK == []
    assert not outer._deltalang_site.running and not inner._deltalang_site.running


# ---------------------------------------------------------------------------
# the kernel globals
# ---------------------------------------------------------------------------


def _kernel_globals(fam: deltalang.models.families.Family) -> dict[str, object]:
    return {n: getattr(fam.module, n) for n in (fam.chunk_kernel, fam.recurrent_kernel, fam.conv_fn, fam.conv_update)}


def test_uninstall_restores_what_transformers_bound_and_leaves_other_families_alone() -> None:
    qwen, kimi = deltalang.models.families.qwen3_5, deltalang.models.families.kimi_linear
    kernels.install(qwen)
    kernels.install(kimi)
    bound = {n: kernels.bound(qwen, n) for n in _kernel_globals(qwen)}
    kimi_before = _kernel_globals(kimi)
    kernels.uninstall(qwen)
    try:
        assert all(_kernel_globals(qwen)[n] is fn for n, fn in bound.items())
        # (5.25 binds `Func` modules whose class lives in the modeling module too)
        assert all(getattr(fn, "__module__", "") == qwen.module_name for fn in bound.values())
        assert all(_kernel_globals(kimi)[n] is fn for n, fn in kimi_before.items())
    finally:
        kernels.install(qwen)
    assert all(kernels.bound(qwen, n) is fn for n, fn in bound.items())


def test_a_second_copy_of_the_kernels_module_finds_transformers_functions() -> None:
    """A reloaded deltalang.runtime.kernels (autoreload) installs over dispatchers: it must unwrap them."""
    fam = deltalang.models.families.qwen3_5
    kernels.install(fam)
    bound = {n: kernels.bound(fam, n) for n in _kernel_globals(fam)}
    functions = {n: kernels.original(fam, n) for n in _kernel_globals(fam)}
    dispatchers = _kernel_globals(fam)
    spec = importlib.util.spec_from_file_location(f"{kernels.__package__}._kernels_reloaded", kernels.__file__)
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    copy.install(fam)
    try:
        assert all(copy.original(fam, n) is fn for n, fn in functions.items())
        assert all(copy.bound(fam, n) is fn for n, fn in bound.items())
    finally:
        copy.uninstall(fam)
    assert all(_kernel_globals(fam)[n] is fn for n, fn in bound.items())
    for name, fn in dispatchers.items():  # put this module's dispatchers back
        setattr(fam.module, name, fn)


def test_python_source_is_judged_by_function_not_by_address() -> None:
    """A kernel freed and another allocated at its address must not inherit its answer."""

    def make(module: str):  # type: ignore[no-untyped-def]
        def chunk(*args: object) -> object:
            return args

        chunk.__module__ = module
        return chunk

    compiled = make("fla.ops.gated_delta_rule")
    address = id(compiled)
    assert not kernels.has_python_source(compiled)
    del compiled
    kept = []
    for _ in range(1000):
        fn = make("transformers.models.qwen3_5.modeling_qwen3_5")
        if id(fn) == address:
            break
        kept.append(fn)
    else:
        pytest.fail("no function was allocated at the freed address")
    assert kernels.has_python_source(fn)
