"""Batching never changes a result: runs of different lengths share forwards, on every family, against transformers.

Each prompt's truth is `tests/reference.py` run on that prompt alone (transformers
over its own cache, token by token), so every value below is compared with the run
alone as transformers computes it, never with deltalang's own output. The programs
mix prompts of several lengths (one shorter than the convolution window) in each
stage, so the shorter runs of a shared forward are left-padded: reads, writes of
per-token values (the block's output, the mixer's output, kernel inputs) and of
positions, from donors of other lengths, must all be each run's own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reference import Record, Reference, Write, set_to
from transformers import AutoModelForCausalLM

import deltalang
from deltalang.models.testing import FAMILY_NAMES, load_hf, tiny_checkpoint

LONG = "The Eiffel Tower is in Paris"
MID = "Tea time"  # MID and SAME have one length
SAME = "Big cats"
TINY = "Hi"  # fewer tokens than the convolution window
HO = "Ho"  # TINY's length: a donor of per-token values for it
HEADER = (f'prompt long = "{LONG}"\nprompt mid = "{MID}"\nprompt same = "{SAME}"\nprompt tiny = "{TINY}"\n'
          f'prompt ho = "{HO}"\n')
PER_TOKEN = ("output", "attention_output", "attention_values", "attention_head_outputs")


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def loaded(request: pytest.FixtureRequest) -> tuple[deltalang.DeltaModel, Reference]:
    path = tiny_checkpoint(request.param)
    return deltalang.load_model(path), Reference(load_hf(path).eval())


def _ids(model: deltalang.DeltaModel, text: str) -> torch.Tensor:
    return model.tokenizer(text, return_tensors="pt").input_ids


def _close(got: Any, want: Any, what: str, atol: float = 1e-5) -> None:
    assert isinstance(got, torch.Tensor) and got.shape == want.shape, (what, getattr(got, "shape", got), want.shape)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")


def _output(model: deltalang.DeltaModel, layer: int) -> str:
    """The block's output where the family serves it (glm5_next's blocks return a tuple), else the mixer's."""
    return "output" if model.spec.unavailable(layer, "output") is None else "attention_output"


def _lengths(model: deltalang.DeltaModel, plan: Any) -> list[set[int]]:
    texts = {"long": LONG, "mid": MID, "same": SAME, "tiny": TINY, "ho": HO}
    return [{_ids(model, texts[r.prompt]).shape[1] for r in p.runs if r.prompt in texts} for p in plan.passes]


def test_reads_of_runs_of_different_lengths_equal_each_run_alone(loaded: tuple) -> None:
    model, ref = loaded
    a, b = model.linear_layers()[0], model.linear_layers()[-1]
    out = _output(model, a)
    reads = (f"L{a}.{out}, L{a}.attention_output, L{a}.attention_values, L{b}.attention_head_outputs, "
             f"L{a}.states, L{b}.state_output, logits, next_token_probs")
    source = HEADER + "".join(
        f"trace t_{p} on {p} {{ read {reads}; read L{a}.state_after({pos}), L{b}.conv_window_after({pos}) }}\n"
        for p, pos in (("long", 20), ("mid", 5), ("same", 5), ("tiny", 0)))
    exp = deltalang.compile(source, model)
    lengths = _lengths(model, exp.plan)
    assert lengths == [{_ids(model, t).shape[1] for t in (LONG, MID, TINY)}], lengths  # one padded forward
    got = exp.run()
    for p, text, pos in (("long", LONG, 20), ("mid", MID, 5), ("same", SAME, 5), ("tiny", TINY, 0)):
        rec = ref.run(_ids(model, text))
        for layer, value in ((a, out), (a, "attention_output"), (a, "attention_values"),
                             (b, "attention_head_outputs"), (a, "states"), (b, "state_output")):
            _close(got[f"t_{p}.L{layer}.{value}"], rec.value(layer, value), f"{p} L{layer}.{value}")
        _close(got[f"t_{p}.logits"], rec.value(None, "logits"), f"{p} logits", atol=1e-4)
        _close(got[f"t_{p}.next_token_probs"], rec.value(None, "next_token_probs"), f"{p} next_token_probs")
        _close(got[f"t_{p}.L{a}.state_after({pos})"], rec.value(a, "state_after", pos), f"{p} state_after")
        _close(got[f"t_{p}.L{b}.conv_window_after({pos})"], rec.value(b, "conv_window_after", pos),
               f"{p} conv_window_after")


def test_writes_from_donors_of_another_length_equal_transformers(loaded: tuple) -> None:
    """Donors run in a stage with a run of another length; the patched runs share a stage with one too."""
    model, ref = loaded
    a, b = model.linear_layers()[0], model.linear_layers()[-1]
    out = _output(model, a)
    source = HEADER + f"""
trace d_long on long {{ read L{a}.{out} }}
trace d_mid on mid {{ read L{a}.{out} }}
trace d_ho on ho {{ read L{a}.{out} }}
trace x on same {{
    write L{a}.attention_values from d_mid
    write L{b}.attention_output from d_mid
    write L{b}.state_after(3) from d_long.state_after(20)
    write L{a}.conv_window_after(2) from d_long.conv_window_after(9)
    read logits, L{b}.states, L{a}.attention_output
}}
trace y on long {{
    write L{a}.attention_output from d_long
    write L{b}.state_after(20) from d_mid.state_after(6)
    read logits, L{b}.states
}}
trace z on tiny {{
    write L{b}.conv_window_after(0) from d_mid.conv_window_after(7)
    write L{a}.{out} from d_ho
    read logits, L{a}.{out}
}}
"""
    exp = deltalang.compile(source, model)
    assert all(len(n) > 1 for n in _lengths(model, exp.plan)), _lengths(model, exp.plan)  # every forward padded
    got = exp.run()
    long_, mid, ho = ref.run(_ids(model, LONG)), ref.run(_ids(model, MID)), ref.run(_ids(model, HO))
    x = ref.run(_ids(model, SAME), [
        Write(a, "attention_values", lambda v, i: mid.value(a, "attention_values")[:, i:i + 1]),
        Write(b, "attention_output", lambda v, i: mid.value(b, "attention_output")[:, i:i + 1]),
        Write(b, "state_after", set_to(long_.value(b, "state_after", 20)), position=3),
        Write(a, "conv_window_after", set_to(long_.value(a, "conv_window_after", 9)), position=2)])
    y = ref.run(_ids(model, LONG), [
        Write(a, "attention_output", lambda v, i: long_.value(a, "attention_output")[:, i:i + 1]),
        Write(b, "state_after", set_to(mid.value(b, "state_after", 6)), position=20)])
    z = ref.run(_ids(model, TINY), [Write(b, "conv_window_after", set_to(mid.value(b, "conv_window_after", 7)),
                                          position=0),
                                    Write(a, out, lambda v, i: ho.value(a, out)[:, i:i + 1])])
    for run, rec in (("x", x), ("y", y), ("z", z)):
        _close(got[f"{run}.logits"], rec.value(None, "logits"), f"{run} logits", atol=1e-4)
    _close(got[f"x.L{b}.states"], x.value(b, "states"), "x states")
    _close(got[f"x.L{a}.attention_output"], x.value(a, "attention_output"), "x attention_output")
    _close(got[f"y.L{b}.states"], y.value(b, "states"), "y states")
    _close(got[f"z.L{a}.{out}"], ho.value(a, out), f"z {out} (written)")
    clean = ref.run(_ids(model, TINY))  # the writes change something, so the comparisons can fail
    assert not torch.allclose(z.value(None, "logits"), clean.value(None, "logits"), atol=1e-4)


def test_state_input_at_a_decode_step_from_a_donor_of_another_length(loaded: tuple) -> None:
    model, ref = loaded
    b = model.linear_layers()[-1]
    source = HEADER + f"""
trace d_long on long {{ read L{b}.state_output }}
trace d_tiny on tiny {{ read logits }}
generate g on mid max_new_tokens 3 {{
    step 1: write L[linear].state_input from d_long.state_output
    step 2: write L{b}.state_input from d_tiny.state_output
    read tokens
    step 2: read logits
}}
"""
    got = deltalang.run(source, model)
    long_, tiny = ref.run(_ids(model, LONG)), ref.run(_ids(model, TINY))
    writes = [Write(i, "state_input", set_to(long_.value(i, "state_output")), step=1) for i in ref.linear]
    writes.append(Write(b, "state_input", set_to(tiny.value(b, "state_output")), step=2))
    rec: Record = ref.run(_ids(model, MID), writes, max_new_tokens=3)
    assert got["g.tokens"].tolist() == rec.new_tokens.tolist()
    _close(got["g.step2.logits"], rec.value(None, "logits", step=2), "g step 2 logits", atol=1e-4)
    _close(got[f"d_long.L{b}.state_output"], long_.value(b, "state_output"), "d_long state_output")
