"""What `deltalang info` and `support(kernels=True)` say about FLA when it is installed but not bound, or hands
`chunk_gated_delta_rule` to FlashQLA; and that deltalang's calls turn FlashQLA off. No FLA, triton or GPU needed.

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
from deltalang import backends, families, info, kernels
from deltalang.testing import tiny_checkpoint

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
