"""What `deltalang info` and `support(kernels=True)` say about FLA when it is installed but not bound, or hands
`chunk_gated_delta_rule` to FlashQLA; and that deltalang's calls turn FlashQLA off. No FLA, triton or GPU needed.
The same for mamba_ssm behind a Mamba-2 family's scan and step globals: recognised, chosen by device (the compiled
kernel for CUDA tensors, transformers' torch reference elsewhere), run with `initial_states` and
`return_final_states` in compiled mode, and named when installed but not importable.

transformers binds a family's kernel globals with `use_kernel_func_from_hub_with_fallback` when the modeling module
is imported; the tests call that very decorator with `importlib.import_module` standing in for the import of `fla`
(failing as FLA 0.5.2 fails under triton 3.9, or returning a fake FLA whose kernel computes with transformers' torch
reference and records `FLA_FLASH_QLA` at each call), and `importlib.metadata` / `find_spec` saying what is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import types
from typing import Any, Callable, Iterator

import pytest
import torch
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

import deltalang
from deltalang.models import families, internals, testing_ssd
from deltalang.models.testing import tiny_checkpoint
from deltalang.runtime import backends, info, kernels

FAMILY = "qwen3_5"
BROKEN = "key contains names that are not kernel arguments: BT"
NOT_BOUND = (f"flash-linear-attention 0.5.2 is installed but not bound: ValueError: {BROKEN} (triton 3.9.0); "
             f"transformers runs its torch kernels")


def _import_module(fla: Callable[[str], Any]) -> Callable[..., Any]:
    """`importlib.import_module` with `fla` (and its submodules) answered by `fla(name)`."""
    real = importlib.import_module

    def fake(name: str, package: str | None = None) -> Any:
        return fla(name) if name == "fla" or name.startswith("fla.") else real(name, package)

    return fake


def _versions(monkeypatch: pytest.MonkeyPatch, **installed: str) -> None:
    """`backends.installed_version` answering from `installed` (names with `_` for `-`), None for the rest."""
    table = {k.replace("_", "-"): v for k, v in installed.items()}
    monkeypatch.setattr(backends, "installed_version", lambda dist: table.get(dist))


@pytest.fixture
def bind(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Callable[[str], Any]], deltalang.DeltaModel]]:
    """Bind the family's prompt kernel as transformers would with `fla` imported by the given function."""
    fam = families.by_name(FAMILY)
    kernels.install(fam)
    real = kernels.original(fam, fam.chunk_kernel)
    monkeypatch.setattr(backends, "_PROBES", {})

    def run(fla: Callable[[str], Any]) -> deltalang.DeltaModel:
        with monkeypatch.context() as m:
            m.setattr(importlib, "import_module", _import_module(fla))
            wrapper = use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")(real.__wrapped__)
        kernels.uninstall(fam)
        setattr(fam.module, fam.chunk_kernel, wrapper)
        kernels.install(fam)
        return deltalang.load_model(tiny_checkpoint(FAMILY))

    try:
        yield run
    finally:
        kernels.uninstall(fam)
        setattr(fam.module, fam.chunk_kernel, real)
        kernels.install(fam)


def _broken(name: str) -> Any:
    raise ValueError(BROKEN)


def test_fla_installed_but_failing_to_import_is_said_with_its_error(bind: Callable, monkeypatch: pytest.MonkeyPatch
                                                                    ) -> None:
    model = bind(_broken)
    _versions(monkeypatch, flash_linear_attention="0.5.2", triton="3.9.0")
    monkeypatch.setattr(importlib, "import_module", _import_module(_broken))  # the probe's import fails as well
    fam = model.family
    b = kernels.backend(fam, fam.chunk_kernel)
    assert b.compiled is None and b.tried == ("fla", "chunk_gated_delta_rule")
    assert backends.not_bound(b) == NOT_BOUND
    assert f"kernels: {NOT_BOUND}\n" in info.format_info(model.spec)
    block = model.spec.linear_layers()[0]
    entry = model.support(kernels=True)["linear_attn.state_after"][block]
    assert entry.startswith("available: prompt: torch reference") or entry.startswith("available: torch reference")
    assert NOT_BOUND in entry
    assert model.support()["linear_attn.state_after"][block] == "available"  # plain statuses unchanged


def test_nothing_is_said_where_fla_is_not_installed(bind: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> Any:
        raise ModuleNotFoundError(f"No module named {name!r}")

    model = bind(missing)
    _versions(monkeypatch, triton="3.9.0")
    assert info.kernel_notes(model.spec) == []
    assert "not bound" not in info.format_info(model.spec)


def test_fla_importing_only_now_is_said(bind: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    model = bind(_broken)  # failed when transformers imported the modeling module; imports at the probe
    _versions(monkeypatch, flash_linear_attention="0.6.0")
    fla = types.SimpleNamespace(chunk_gated_delta_rule=print, fused_recurrent_gated_delta_rule=print)
    monkeypatch.setattr(importlib, "import_module", _import_module(lambda name: fla))
    notes = info.kernel_notes(model.spec)
    assert notes == ["flash-linear-attention 0.6.0 is installed but not bound: fla.ops.gated_delta_rule imports now, "
                     "but did not when transformers imported the model's code (restart the process); transformers "
                     "runs its torch kernels"]


@pytest.fixture
def flash_qla(bind: Callable, monkeypatch: pytest.MonkeyPatch) -> tuple[deltalang.DeltaModel, list[str | None]]:
    """FLA bound (a fake whose kernel records FLA_FLASH_QLA per call) and FlashQLA installed."""
    seen: list[str | None] = []
    fam = families.by_name(FAMILY)
    reference = kernels.original(fam, fam.chunk_kernel).__wrapped__

    def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, scale: float | None = None,
                               initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Any = None) -> Any:
        seen.append(os.environ.get(backends.FLASH_QLA_ENV))
        return reference(q, k, v, g=g, beta=beta, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    fla = types.ModuleType("fla")
    fla.chunk_gated_delta_rule = chunk_gated_delta_rule  # type: ignore[attr-defined]
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: (
        types.SimpleNamespace(name=name) if name == "flash_qla" else real_find(name, package)))
    _versions(monkeypatch, flash_qla="0.1.3")
    monkeypatch.delenv(backends.FLASH_QLA_ENV, raising=False)
    monkeypatch.delenv("FLA_DISABLE_BACKEND_DISPATCH", raising=False)
    return bind(lambda name: fla), seen


def _split_read(model: deltalang.DeltaModel) -> torch.Tensor:
    with backends.using("compiled"), torch.no_grad(), model.trace("The Eiffel Tower is in"):
        state = model.layers[model.spec.linear_layers()[0]].linear_attn.state_after(3).save()
    return state


def test_flash_qla_is_named_and_turned_off_for_deltalangs_calls(flash_qla: tuple) -> None:
    model, seen = flash_qla
    fam = model.family
    b = kernels.backend(fam, fam.chunk_kernel)
    assert b.name == "fla chunk_gated_delta_rule" and b.handoff == backends.FLASH_QLA
    assert b.pick("cuda") is b.compiled and b.compiled is not b.fn
    line = info.kernel_notes(model.spec)
    assert len(line) == 1 and line[0].startswith("FlashQLA 0.1.3 is installed: FLA hands chunk_gated_delta_rule")
    assert f"kernels: {line[0]}\n" in info.format_info(model.spec)
    assert line[0] in model.support(kernels=True)["linear_attn.state_after"][model.spec.linear_layers()[0]]
    _split_read(model)
    assert len(seen) >= 2 and set(seen) == {"0"}  # split at 3: every call with FlashQLA off
    assert backends.FLASH_QLA_ENV not in os.environ  # and the variable put back as it was (unset)


def test_a_users_flash_qla_setting_is_kept(flash_qla: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    model, seen = flash_qla
    monkeypatch.setenv(backends.FLASH_QLA_ENV, "0")  # FLA would not hand anything to FlashQLA: nothing to say
    assert info.kernel_notes(model.spec) == []
    monkeypatch.setenv(backends.FLASH_QLA_ENV, "1")
    assert info.kernel_notes(model.spec)[0].startswith("FlashQLA 0.1.3")
    _split_read(model)
    assert seen and set(seen) == {"0"} and os.environ[backends.FLASH_QLA_ENV] == "1"


# -- mamba_ssm behind a Mamba-2 family's scan globals ---------------------------------------------------------

SSD_FAMILY = "bamba"
MAMBA_SSM = (("mamba_chunk_scan_combined", internals.SCAN_GLOBAL), ("selective_state_update", internals.STEP_GLOBAL))
_TORCH: dict[tuple[str, str], Callable[..., Any]] = {}


def _fake_mamba_ssm(seen: list[tuple[str, dict]]) -> types.ModuleType:
    """A `mamba_ssm` whose two kernels (mamba_ssm 2.x's signatures) record each call's keywords and compute with
    transformers' torch reference."""
    fam = families.by_name(SSD_FAMILY)
    scan_ref, step_ref = (_TORCH[(fam.name, name)] for name in (internals.SCAN_GLOBAL, internals.STEP_GLOBAL))

    def mamba_chunk_scan_combined(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                                  C: torch.Tensor, chunk_size: int, D: Any = None, z: Any = None, dt_bias: Any = None,
                                  initial_states: Any = None, seq_idx: Any = None, cu_seqlens: Any = None,
                                  dt_softplus: bool = False, dt_limit: tuple = (0.0, float("inf")),
                                  return_final_states: bool = False, return_varlen_states: bool = False) -> Any:
        seen.append(("scan", {"tokens": x.shape[1], "initial_states": initial_states is not None,
                              "return_final_states": return_final_states}))
        return scan_ref(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, initial_states=initial_states,
                        dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states)

    def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                               B: torch.Tensor, C: torch.Tensor, D: Any = None, z: Any = None, dt_bias: Any = None,
                               dt_softplus: bool = False, state_batch_indices: Any = None) -> torch.Tensor:
        seen.append(("step", {}))
        return step_ref(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus)

    module = types.ModuleType("mamba_ssm")
    module.mamba_chunk_scan_combined = mamba_chunk_scan_combined  # type: ignore[attr-defined]
    module.selective_state_update = selective_state_update  # type: ignore[attr-defined]
    return module


@pytest.fixture
def bind_ssm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Callable[[str], Any]], deltalang.DeltaModel]]:
    """Bind a Mamba-2 family's scan and step globals as transformers would with `mamba_ssm` imported by the given
    function (its `use_kernel_func_from_hub_with_fallback` decorator, called on the torch functions)."""
    fam = families.by_name(SSD_FAMILY)
    kernels.install(fam)
    real = {name: kernels.original(fam, name) for _, name in MAMBA_SSM}
    for name, fn in real.items():  # transformers' torch functions, for the fake kernels to compute with
        _TORCH[(fam.name, name)] = fn.__wrapped__
    monkeypatch.setattr(backends, "_PROBES", {})

    def run(mamba_ssm: Callable[[str], Any]) -> deltalang.DeltaModel:
        real_import = importlib.import_module

        def fake(name: str, package: str | None = None) -> Any:
            return mamba_ssm(name) if name.split(".")[0] == "mamba_ssm" else real_import(name, package)
        kernels.uninstall(fam)
        module = fam.module
        with monkeypatch.context() as m:
            m.setattr(importlib, "import_module", fake)
            for hub, name in MAMBA_SSM:
                setattr(module, name, use_kernel_func_from_hub_with_fallback(hub, "mamba_ssm")(real[name].__wrapped__))
        kernels.install(fam)
        return deltalang.load_model(testing_ssd.tiny_ssd_checkpoint(SSD_FAMILY))

    try:
        yield run
    finally:
        kernels.uninstall(fam)
        for name, fn in real.items():
            setattr(fam.module, name, fn)
        kernels.install(fam)


def test_a_bound_mamba_ssm_kernel_is_recognised_and_chosen_by_device(bind_ssm: Callable) -> None:
    model = bind_ssm(lambda name: _fake_mamba_ssm([]))
    fam = model.family
    for hub, name in MAMBA_SSM:
        b = kernels.backend(fam, name)
        assert b.name == f"mamba_ssm {hub}" and b.compiled is not None and b.reference is not None
        assert b.pick("cuda") is b.compiled and b.pick("cpu") is b.reference
        assert b.reference.__module__ == fam.module_name  # transformers' own torch function
    prompt, decode = info.kernel_names(model.spec)
    assert prompt == "mamba_ssm mamba_chunk_scan_combined (compiled) on CUDA, pure-torch chunked elsewhere"
    assert decode == "mamba_ssm selective_state_update (compiled) on CUDA, pure-torch token-by-token elsewhere"
    text = " ".join(info.format_info(model.spec).split())  # the table wraps its cells
    assert "mamba_ssm mamba_chunk_scan_combined (compiled) on CUDA," in text
    assert info.served_by(model.spec, "state_after") == (
        "prompt: mamba_ssm mamba_chunk_scan_combined (compiled) on CUDA, torch reference elsewhere; decode step: "
        "mamba_ssm selective_state_update (compiled) on CUDA, torch reference elsewhere")


def _trace(model: deltalang.DeltaModel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A read after token 3 and a write after token 6 on a Mamba-2 block, a read after 9; the logits."""
    block = model.layers[model.spec.ssm_layers()[0]].mamba
    d = model.spec.dims
    with torch.no_grad(), model.trace("The Eiffel Tower is in"):
        early = block.state_after(3).save()
        block.set_state_after(6, torch.zeros(1, d["heads"], d["key_dim"], d["value_dim"]))
        late = block.state_after(9).save()
        logits = model.logits.save()
    return early, late, logits


def test_on_a_cpu_the_torch_reference_serves_and_compiled_mode_runs_the_kernel(bind_ssm: Callable) -> None:
    """auto (the default): CPU tensors never reach the compiled kernel; `backends.using("compiled")`: the forward's
    scan and a read's side call run through it (with `initial_states` where the call continues a state, and
    `return_final_states`), and the values are those of the torch reference."""
    seen: list[tuple[str, dict]] = []
    model = bind_ssm(lambda name: _fake_mamba_ssm(seen))
    want = _trace(model)
    assert seen == []
    with backends.using("compiled"):
        got = _trace(model)
    scans = [kw for kind, kw in seen if kind == "scan"]
    assert scans and all(kw["return_final_states"] for kw in scans)
    assert {"tokens": 4, "initial_states": False, "return_final_states": True} in scans  # the read after 3
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-5)


def test_a_decode_step_runs_the_compiled_step_in_compiled_mode(bind_ssm: Callable) -> None:
    seen: list[tuple[str, dict]] = []
    model = bind_ssm(lambda name: _fake_mamba_ssm(seen))
    block = model.layers[model.spec.ssm_layers()[0]].mamba
    with backends.using("compiled"), torch.no_grad(), model.generate("The Eiffel", max_new_tokens=2) as tr:
        with tr.iter[1]:
            state = block.state_input.save()
    assert ("step", {}) in seen and state.shape[0] == 1


def test_mamba_ssm_installed_but_failing_to_import_is_said(bind_ssm: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str) -> Any:
        raise ImportError("libcudart.so.12: cannot open shared object file")

    model = bind_ssm(broken)
    _versions(monkeypatch, mamba_ssm="2.2.4", triton="3.9.0")
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, package=None: (
        broken(name) if name.split(".")[0] == "mamba_ssm" else real(name, package)))  # the probe's import fails too
    b = kernels.backend(model.family, internals.SCAN_GLOBAL)
    assert b.compiled is None and b.tried == ("mamba_ssm", "mamba_chunk_scan_combined")
    line = ("mamba-ssm 2.2.4 is installed but not bound: ImportError: libcudart.so.12: cannot open shared object "
            "file (triton 3.9.0); transformers runs its torch kernels")
    assert line in info.kernel_notes(model.spec)
    assert info.kernel_names(model.spec)[0] == "pure-torch chunked"
