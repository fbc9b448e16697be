"""Measures and donor reads under `generate` address the step they name, checked against transformers.

The ground truth is `tests/reference.py`: the bundled model as a plain
transformers model, run over its own cache token by token and decoded greedily,
with the writes applied to the cache and kernel by hand. The KL divergence is
`reference.kl` (`torch.nn.functional.kl_div`), not `deltalang.ground.measures`.
"""

from __future__ import annotations

import pytest
import torch
from reference import Record, Reference, Write, kl, set_to

import deltalang
from deltalang.ground.errors import DeltaError
from deltalang.models.bundled import PATH as BUNDLED
from deltalang.models.bundled import world

pytestmark = pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")

CLEAN, OTHER = world.EIFFEL_PROMPT, world.PIZZA_PROMPT
GATE = "The Brandenburg Gate is in the city of"  # as many tokens as CLEAN
HEADER = f'prompt clean = "{CLEAN}"\nprompt other = "{OTHER}"\nprompt gate = "{GATE}"\n'


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


def _ids(model: deltalang.DeltaModel, text: str) -> torch.Tensor:
    return model.tokenizer(text, return_tensors="pt").input_ids


def _last(rec: Record, step: int) -> torch.Tensor:
    return rec.value(None, "logits", step=step)[:, -1].float()


def test_kl_and_prob_under_generate_compare_step_k_with_step_k(model: deltalang.DeltaModel, ref: Reference) -> None:
    """`measure kl(plain)` in a generate compares its step k with plain's step k (it took plain's step 0),
    and a measure without `step K:` is taken at every step, as a read is."""
    source = HEADER + """
generate plain on clean max_new_tokens 3 { read tokens }
trace base on clean { read next_token_probs }
generate patched on clean max_new_tokens 3 {
    step 1: write L[linear].state_input from other.state_output
    step 2: measure kl(plain) as at_two
    step 0: measure kl(base)
    measure kl(plain)
    measure prob(" Paris")
    read tokens
}
"""
    r = deltalang.run(source, model)
    ids, other = _ids(model, CLEAN), _ids(model, OTHER)
    donor = ref.run(other)
    writes = [Write(i, "state_input", set_to(donor.value(i, "state_output")), step=1)
              for i in ref.linear]
    plain, patched = ref.run(ids, max_new_tokens=3), ref.run(ids, writes, max_new_tokens=3)
    kls = [kl(_last(plain, k), _last(patched, k)) for k in range(3)]
    assert r["at_two"] == pytest.approx(kls[2], rel=1e-3, abs=1e-5)
    assert kls[0] < 1e-6 < kls[2]  # the patch moves step 2, so a comparison with step 0 would show
    assert r["plain.tokens"].tolist() == plain.new_tokens.tolist()
    assert r["patched.tokens"].tolist() == patched.new_tokens.tolist()
    paris = model.tokenizer(" Paris", add_special_tokens=False).input_ids[0]
    for k in range(3):
        assert r[f"patched.step{k}.kl(plain)"] == pytest.approx(kls[k], rel=1e-3, abs=1e-5), k
        p = float(_last(patched, k).softmax(-1)[0, paris])
        assert r[f'patched.step{k}.prob(" Paris")'] == pytest.approx(p, rel=1e-3, abs=1e-6), k
    base = ref.run(ids)
    assert r["patched.step0.kl(base)"] == pytest.approx(kl(_last(base, 0), _last(patched, 0)), abs=1e-5)
    assert "patched.kl(plain)" not in r and 'patched.prob(" Paris")' not in r


def test_a_trace_measures_kl_against_a_generates_prompt_step(model: deltalang.DeltaModel, ref: Reference) -> None:
    """A trace's next token follows its prompt, as a generate's step 0 does: kl(G) in a trace is step 0 of G."""
    source = HEADER + """
generate g on gate max_new_tokens 2 { read tokens }
trace t on clean { measure kl(g) }
"""
    r = deltalang.run(source, model)
    g, t = ref.run(_ids(model, GATE), max_new_tokens=2), ref.run(_ids(model, CLEAN))
    assert r["t.kl(g)"] == pytest.approx(kl(_last(g, 0), _last(t, 0)), rel=1e-3)


@pytest.mark.parametrize("body, match", [
    ("step 1: measure kl(base)", r"'base' is a trace.*no step 1 to compare with;"),
    ("measure kl(base)", r"'base' is a trace.*no step 1 to compare with \(a measure without"),
    ("step 2: measure kl(short)", r"'short' makes 2 new tokens \(steps 0 to 1\), so it has no step 2"),
    ("measure kl(short)", r"'short' makes 2 new tokens.*no step 2 to compare with \(a measure without"),
])
def test_kl_against_a_step_the_other_run_lacks_is_an_error(model: deltalang.DeltaModel, body: str, match: str) -> None:
    source = HEADER + f"""trace base on clean {{ read next_token_probs }}
generate short on clean max_new_tokens 2 {{ read tokens }}
generate long on clean max_new_tokens 3 {{
    {body}
}}
"""
    with pytest.raises(DeltaError, match=match) as info:
        deltalang.compile(source, model, filename="kl.dl")
    assert info.value.span is not None and info.value.span.line == 7, info.value.render()


def test_a_write_from_a_generate_at_every_step_takes_the_donors_same_step(model: deltalang.DeltaModel,
                                                                         ref: Reference) -> None:
    """`write L4.attention_output from donor` without a step, donor a generate: step k takes donor's step k
    (it took donor's step 0 at every step)."""
    source = HEADER + """
generate donor on gate max_new_tokens 3 { read tokens }
generate c on clean max_new_tokens 3 {
    write L4.attention_output from donor
    step 0: measure prob(" Berlin") as p0
    step 1: measure prob(" Berlin") as p1
    step 2: measure prob(" Berlin") as p2
    read tokens
}
"""
    r = deltalang.run(source, model)
    donor = ref.run(_ids(model, GATE), max_new_tokens=3)
    outs = [donor.value(4, "attention_output", step=k) for k in range(3)]
    writes = [Write(4, "attention_output", (lambda x, i, k=k: outs[k][:, i:i + 1]), step=k) for k in range(3)]
    c = ref.run(_ids(model, CLEAN), writes, max_new_tokens=3)
    assert r["c.tokens"].tolist() == c.new_tokens.tolist()
    berlin = model.tokenizer(" Berlin", add_special_tokens=False).input_ids[0]
    for k in range(3):
        p = float(_last(c, k).softmax(-1)[0, berlin])
        assert r[f"p{k}"] == pytest.approx(p, rel=1e-3, abs=1e-6), k


@pytest.mark.parametrize("body, match", [
    ("step 2: write L0.state_input from short", r"takes its value from step 2 of 'short', and 'short' makes 2 new"),
    ("write L4.attention_output from short", r"at step 2 takes its value from step 2 of 'short'"),
    ("step 1: write L4.attention_output from base", r"'base' is a trace, and attention_output has a row per token"),
    ("write L4.attention_output from base", r"at step 1: 'base' is a trace"),
])
def test_a_write_from_a_step_the_donor_lacks_is_an_error(model: deltalang.DeltaModel, body: str, match: str) -> None:
    """It was an internal KeyError shown as the program's error, or silently took the donor's step 0."""
    source = HEADER + f"""trace base on gate {{ read next_token_probs }}
generate short on gate max_new_tokens 2 {{ read tokens }}
generate long on clean max_new_tokens 3 {{
    {body}
}}
"""
    with pytest.raises(DeltaError, match=match) as info:
        deltalang.compile(source, model, filename="from.dl")
    assert info.value.span is not None and info.value.span.line == 7, info.value.render()


def test_states_beside_a_write_show_the_written_state_at_its_position(model: deltalang.DeltaModel,
                                                                       ref: Reference) -> None:
    """`states` in a run that writes `state_after(t)` of the same block is the forward as it ran: its row t
    is the written state (it was the state the kernel had computed there), as `state_after(t)` reads."""
    source = HEADER + """
trace t on clean {
    write L1.state_after(3) from other
    write L4.state_after(5) *= 0.5
    read L1.states, L4.states, L1.state_after(3), L5.states
    read next_token_probs
}
"""
    r = deltalang.run(source, model)
    other = ref.run(_ids(model, OTHER))
    rec = ref.run(_ids(model, CLEAN), [Write(1, "state_after", set_to(other.value(1, "state_after", 3)), 3),
                                       Write(4, "state_after", lambda x, i: x * 0.5, 5)])
    assert torch.equal(r["t.L1.states"][:, 3], r["t.L1.state_after(3)"])
    for layer in (1, 4, 5):
        torch.testing.assert_close(r[f"t.L{layer}.states"], rec.value(layer, "states"), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(r["t.next_token_probs"], rec.value(None, "next_token_probs"), atol=1e-5, rtol=1e-4)


def test_a_named_value_read_at_every_step_is_an_error_that_says_so(model: deltalang.DeltaModel) -> None:
    """It said "`= kept` names no read" of a read the program has."""
    source = HEADER + """generate g on other max_new_tokens 2 { read L0.state_output as kept }
trace t on clean {
    write L0.state_after(2) = kept
    read next_token_probs
}
"""
    with pytest.raises(DeltaError, match=r"'kept' is read at every step of 'g' \(kept.step0, kept.step1\)"):
        deltalang.compile(source, model)
