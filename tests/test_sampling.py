"""`generate ... temperature T top_p P seed S`: sampling, checked against transformers' own `generate`.

The ground truth is a plain transformers model (its own instance, the kernels transformers'
modeling module held at import put back around the call) generating with
`do_sample=True, temperature=T, top_p=P, top_k=0` after `torch.manual_seed(S)`: deltalang's
tokens must be exactly those. Greedy stays the default.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import deltalang
from deltalang.ground.errors import DeltaError
from deltalang.language import ast
from deltalang.language.parse import parse
from deltalang.models import families
from deltalang.models.bundled import PATH as BUNDLED
from deltalang.models.bundled import world
from deltalang.runtime import kernels

pytestmark = pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")

PROMPT = world.PIZZA_PROMPT


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


@pytest.fixture(scope="module")
def hf() -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32).eval()


def _hf_tokens(hf: Any, ids: torch.Tensor, n: int, seed: int, temperature: float, top_p: float) -> list[int]:
    torch.manual_seed(seed)
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=temperature,
                          top_p=top_p, top_k=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("seed, temperature, top_p", [(1, 1.5, 0.95), (7, 0.7, 0.9), (3, 2.0, 1.0)])
def test_sampled_tokens_are_transformers_own(model: deltalang.DeltaModel, hf: Any, seed: int, temperature: float,
                                             top_p: float) -> None:
    n = 6
    opts = f"max_new_tokens {n} temperature {temperature} top_p {top_p} seed {seed}"
    src = (f'prompt p = "{PROMPT}"\ngenerate g on p {opts} {{ read tokens }}\n'
           f"generate again on p {opts} {{ read tokens }}\ngenerate greedy on p max_new_tokens {n} {{ read tokens }}\n")
    r = deltalang.run(src, model)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    fam = families.for_config(hf.config)
    assert fam is not None
    names = (fam.chunk_kernel, fam.recurrent_kernel)
    saved = {k: getattr(fam.module, k) for k in names}
    try:
        for k in names:
            setattr(fam.module, k, kernels.original(fam, k))
        want = _hf_tokens(hf, ids, n, seed, temperature, top_p)
        with torch.no_grad():
            greedy = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
    finally:
        for k in names:
            setattr(fam.module, k, saved[k])
    assert r["g.tokens"][0].tolist() == want
    assert r["again.tokens"][0].tolist() == want  # the same seed, the same tokens
    assert r["greedy.tokens"][0].tolist() == greedy  # greedy stays the default


def test_sampling_differs_from_greedy_and_between_seeds(model: deltalang.DeltaModel) -> None:
    """At a high temperature the seed matters: a test that ignored sampling could not pass."""
    runs = "\n".join(f"generate s{k} on p max_new_tokens 6 temperature 3.0 seed {k} {{ read tokens }}"
                     for k in range(6))
    r = deltalang.run(f'prompt p = "{PROMPT}"\n{runs}\ngenerate greedy on p max_new_tokens 6 {{ read tokens }}\n',
                      model)
    got = {tuple(r[f"s{k}.tokens"][0].tolist()) for k in range(6)}
    assert len(got) > 1
    assert got != {tuple(r["greedy.tokens"][0].tolist())}


@pytest.mark.parametrize("header", [
    "generate g on p max_new_tokens 8 temperature 0.7 top_p 0.9 seed 1",
    "generate g on p max_new_tokens 8 top_p 0.5",
    "generate g on p max_new_tokens 2 seed 4 temperature 1.0",
])
def test_sampling_prints_back(header: str) -> None:
    tree = parse(f'prompt p = "a b"\n{header} {{\n    read tokens\n}}\n')
    assert parse(ast.format_program(tree)) == tree
    assert "temperature" in ast.format_program(tree) or "top_p" in ast.format_program(tree)


@pytest.mark.parametrize("options, message", [
    ("temperature 0", "temperature must be > 0"),
    ("temperature -1.0", "temperature must be > 0"),
    ("top_p 1.5", "0 < top_p <= 1"),
    ("top_p 0", "0 < top_p <= 1"),
    ("seed 3", "seed makes sampling reproducible"),
    ("temperature 0.5 seed 1.5", "seed is a whole number >= 0"),
    ("temprature 0.5", "unknown option 'temprature' (did you mean 'temperature'?)"),
    ("temperature 0.5 temperature 0.7", "'temperature' is given twice"),
])
def test_bad_sampling_options_are_one_line_errors(options: str, message: str) -> None:
    with pytest.raises(DeltaError) as e:
        parse(f'prompt p = "a b"\ngenerate g on p max_new_tokens 3 {options} {{ read tokens }}\n')
    first = str(e.value).splitlines()[0]
    assert message in first, first
