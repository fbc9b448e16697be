"""Shared fixtures: tiny random-weight checkpoints of every family, built once per session.

`tiny_models` maps each family name to a checkpoint directory (config,
safetensors, byte-level tokenizer) written by `deltalang.models.testing.build_tiny`;
`tiny_spec(family)` gives that checkpoint's `ModelSpec` (config and tokenizer
only), cached. `tiny_path(family)` gives the directory. `ref` is plain transformers on the
bundled model (`reference.Reference`), the truth the bundled-model tests compare with. Building all five takes a
few seconds; nothing reaches a network.
"""

from __future__ import annotations

import os

# OpenMP threads that spin while they wait stall by orders of magnitude when another
# process shares the cores; waiting passively costs little. Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator

import pytest  # noqa: E402

from deltalang.models.spec import ModelSpec, load_spec
from deltalang.models.testing import FAMILY_NAMES, build_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{family: checkpoint directory} for all five families."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {fam: build_tiny(fam, root / fam) for fam in FAMILY_NAMES}


@pytest.fixture(scope="session")
def tiny_path(tiny_models: dict[str, Path]) -> Callable[[str], Path]:
    """`tiny_path("qwen3_5")`: the directory of that family's tiny checkpoint."""

    def get(family: str = "qwen3_5") -> Path:
        if family not in tiny_models:
            raise KeyError(f"no tiny checkpoint of {family!r}; families: {', '.join(tiny_models)}")
        return tiny_models[family]

    return get


@pytest.fixture(scope="session")
def tiny_spec(tiny_models: dict[str, Path]) -> Callable[[str], ModelSpec]:
    """`tiny_spec("qwen3_5")`: the ModelSpec of that family's tiny checkpoint (cached)."""
    cache: dict[str, ModelSpec] = {}

    def get(family: str = "qwen3_5") -> ModelSpec:
        if family not in cache:
            cache[family] = load_spec(tiny_models[family])
        return cache[family]

    return get


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Two threads on a shared 2-core machine make tiny forwards 100x slower (OpenMP waits); a module that
    runs many tiny forwards asks for one: `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def ref() -> Any:
    """Plain transformers on the bundled model, float32 (`reference.Reference`), loaded once."""
    import torch
    from reference import Reference
    from transformers import AutoModelForCausalLM

    from deltalang.models.bundled import PATH

    return Reference(AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32))
