"""Positions at a decode step: the program names the token's own position (n+k-1, or -1); the kernel call
at that step runs that one token, so the emitted code asks the call for its last (-1).

Checked against transformers' cache after each decode step (tests/reference.py).
"""

from __future__ import annotations

import torch
from reference import Reference

import deltalang
from deltalang.models.testing import load_hf, tiny_checkpoint

PROMPT = "The Eiffel Tower is in"


def test_state_after_at_a_decode_step_is_the_cache_after_that_token() -> None:
    path = tiny_checkpoint("qwen3_5")
    model = deltalang.load_model(path)
    n = len(model.tokenizer(PROMPT).input_ids)
    i = model.spec.linear_layers()[-1]
    src = (f'prompt p = "{PROMPT}"\ngenerate g on p max_new_tokens 3 {{\n'
           f'    step 1: read L{i}.state_after(-1) as one\n    step 2: read L{i}.state_after({n + 1}) as two\n'
           f'    read tokens\n}}\n')
    code = deltalang.compile(src, model).code
    assert "state_after(-1)" in code and f"state_after({n + 1})" not in code
    got = deltalang.run(src, model)
    rec = Reference(load_hf(path).eval()).run(model.tokenizer(PROMPT, return_tensors="pt").input_ids,
                                              max_new_tokens=3)
    assert got["g.tokens"].tolist() == rec.new_tokens.tolist()
    torch.testing.assert_close(got["one"], rec.value(i, "state_output", step=1), atol=1e-5, rtol=0)
    torch.testing.assert_close(got["two"], rec.value(i, "state_output", step=2), atol=1e-5, rtol=0)


def test_a_write_of_the_state_after_a_decode_token_reaches_that_tokens_output() -> None:
    model = deltalang.load_model(tiny_checkpoint("qwen3_5"))
    base = f'prompt p = "{PROMPT}"\ngenerate g on p max_new_tokens 2 {{\n    step 1: read logits\n'
    clean = deltalang.run(base + "}\n", model)["g.step1.logits"]
    patched = deltalang.run(base + "    step 1: write L[linear].state_after(-1) = zeros\n}\n", model)
    assert not torch.allclose(patched["g.step1.logits"], clean, atol=1e-4)
