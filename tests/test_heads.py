"""Per-head sites (`SITE.head(h)`) and sweeps over heads, checked against transformers.

The ground truth is `tests/reference.py`: the bundled model as a plain transformers
model over its own cache, with a write of one head applied by hand (the whole value
with that head's slice replaced). Values read are compared with the reference's
slices, never with deltalang's own output.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from reference import Record, Reference, Write

import deltalang
from deltalang.ground.errors import DeltaError
from deltalang.language import ast
from deltalang.language.parse import parse
from deltalang.models.bundled import PATH as BUNDLED
from deltalang.models.bundled import world

pytestmark = pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")

CLEAN, OTHER = world.EIFFEL_PROMPT, world.PIZZA_PROMPT
PASTA = "My favourite food is pasta with"
HEADER = f'prompt clean = "{CLEAN}"\nprompt other = "{OTHER}"\nprompt pasta = "{PASTA}"\n'


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


def _ids(model: deltalang.DeltaModel, text: str) -> torch.Tensor:
    return model.tokenizer(text, return_tensors="pt").input_ids


def _prob(rec: Record, model: deltalang.DeltaModel, word: str = " Paris") -> float:
    tok = model.tokenizer(word, add_special_tokens=False).input_ids[0]
    return float(rec.value(None, "logits")[:, -1].float().softmax(-1)[0, tok])


def _put(axis: int, head: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Any, int], Any]:
    """A reference write of one head: the whole value, the head's slice replaced by `fn(slice)`."""
    def write(x: torch.Tensor, i: int) -> torch.Tensor:
        out = x.clone()
        idx = (slice(None),) * axis + (head,)
        out[idx] = fn(x[idx])
        return out

    return write


def _close(a: Any, b: Any) -> None:
    torch.testing.assert_close(torch.as_tensor(a).float(), torch.as_tensor(b).float(), rtol=1e-4, atol=1e-5)


def test_reading_one_head_is_that_heads_slice(model: deltalang.DeltaModel, ref: Reference) -> None:
    heads = model.spec.dims["heads"]
    last = heads - 1
    src = HEADER + f"""
trace t on clean {{
    read L1.state_after(2).head(3), L1.states.head(1), L4.betas.head(0), L0.attention_keys.head(2)
    read L5.state_output.head(-1), L2.attention_head_outputs.head(1), L6.decays.head(0)
}}
"""
    r = deltalang.run(src, model)
    rec = ref.run(_ids(model, CLEAN))
    _close(r["t.L1.state_after(2).head(3)"], rec.value(1, "state_after", 2)[:, 3])
    _close(r["t.L1.states.head(1)"], rec.value(1, "states")[:, :, 1])
    _close(r["t.L4.betas.head(0)"], rec.value(4, "betas")[:, :, 0])
    _close(r["t.L0.attention_keys.head(2)"], rec.value(0, "attention_keys")[:, :, 2])
    _close(r[f"t.L5.state_output.head({last})"], rec.value(5, "state_output")[:, last])
    _close(r["t.L2.attention_head_outputs.head(1)"], rec.value(2, "attention_head_outputs")[:, :, 1])
    _close(r["t.L6.decays.head(0)"], rec.value(6, "decays")[:, :, 0])
    kd, vd = model.spec.dims["key_dim"], model.spec.dims["value_dim"]
    assert tuple(r["t.L1.state_after(2).head(3)"].shape) == (1, kd, vd)
    lines = r.summary().splitlines()  # a head's shape is named without the heads axis
    assert f"[b=1, key_dim={kd}, value_dim={vd}]" in next(ln for ln in lines if ln.startswith("t.L1.state_after(2)."))
    assert "[b=1, s=8]" in next(ln for ln in lines if ln.startswith("t.L4.betas.head(0) "))


def test_a_write_of_one_head_changes_that_head_only(model: deltalang.DeltaModel, ref: Reference) -> None:
    src = HEADER + """
trace base on clean { read L1.state_after(2) as before; measure prob(" Paris") }
trace t on clean {
    write L1.state_after(2).head(3) = zeros
    read L1.state_after(2) as after
    read L1.state_output, L4.state_after(-1)
    measure prob(" Paris")
}
"""
    r = deltalang.run(src, model)
    ids = _ids(model, CLEAN)
    rec = ref.run(ids, [Write(1, "state_after", _put(1, 3, torch.zeros_like), position=2)])
    before, after = r["before"], r["after"]
    assert float(after[:, 3].abs().max()) == 0.0 and float(before[:, 3].abs().max()) > 0
    others = [h for h in range(model.spec.dims["heads"]) if h != 3]
    assert torch.equal(after[:, others], before[:, others])  # the other heads are untouched
    _close(r["t.L1.state_output"], rec.value(1, "state_output"))
    _close(r["t.L4.state_after(7)"], rec.value(4, "state_after", 7))
    assert r['t.prob(" Paris")'] == pytest.approx(_prob(rec, model), rel=1e-4, abs=1e-7)
    # the write changed the forward: a comparison of clean with clean could not pass above by accident
    clean = ref.run(ids).value(1, "state_output")
    assert float((r["t.L1.state_output"] - clean)[:, 3].abs().max()) > 1e-3
    _close(r["t.L1.state_output"][:, others], clean[:, others])  # a block's heads run apart: the rest as clean


def test_head_writes_from_donors_scale_and_mean(model: deltalang.DeltaModel, ref: Reference) -> None:
    src = HEADER + """
prompts foods = ["My favourite food is pizza with", "My favourite food is pasta with"]
trace t on clean {
    write L2.state_after(4).head(1) from other
    write L4.state_after(-1).head(2) from other.L5.state_after(3).head(0)
    write L5.betas.head(0) *= 0.25
    write L6.state_after(-1).head(1) = mean(foods)
    write L0.attention_values.head(3) = zeros
    read L4.state_output, L6.state_output
    measure prob(" Paris")
}
"""
    r = deltalang.run(src, model)
    donor = ref.run(_ids(model, OTHER))
    pasta = ref.run(_ids(model, PASTA))
    mean = (donor.value(6, "state_after", 5) + pasta.value(6, "state_after", 5)) / 2
    writes = [
        Write(2, "state_after", _put(1, 1, lambda x: donor.value(2, "state_after", 4)[:, 1]), position=4),
        Write(4, "state_after", _put(1, 2, lambda x: donor.value(5, "state_after", 3)[:, 0]), position=7),
        Write(5, "betas", _put(2, 0, lambda x: x * 0.25)),
        Write(6, "state_after", _put(1, 1, lambda x: mean[:, 1]), position=7),
        Write(0, "attention_values", _put(2, 3, torch.zeros_like)),
    ]
    rec = ref.run(_ids(model, CLEAN), writes)
    _close(r["t.L4.state_output"], rec.value(4, "state_output"))
    _close(r["t.L6.state_output"], rec.value(6, "state_output"))
    assert r['t.prob(" Paris")'] == pytest.approx(_prob(rec, model), rel=1e-4, abs=1e-7)


def test_sweep_over_heads_matches_transformers(model: deltalang.DeltaModel, ref: Reference) -> None:
    src = HEADER + """
sweep s on clean over h in heads, t in -2..0 {
    write L4.state_after(t).head(h) = zeros
    measure prob(" Paris")
}
sweep part on clean over h in heads[1:3] {
    write L2.state_after(-1).head(h) from other
    measure prob(" Paris")
}
"""
    r = deltalang.run(src, model)
    ids = _ids(model, CLEAN)
    n = ids.shape[1]
    donor = ref.run(_ids(model, OTHER))
    for h in range(model.spec.dims["heads"]):
        for t in (n - 2, n - 1):
            rec = ref.run(ids, [Write(4, "state_after", _put(1, h, torch.zeros_like), position=t)])
            assert r[f's[h={h},t={t}].prob(" Paris")'] == pytest.approx(_prob(rec, model), rel=1e-4, abs=1e-7)
    got = sorted(k for k in r if k.startswith("part["))
    assert got == ['part[h=1].prob(" Paris")', 'part[h=2].prob(" Paris")']
    for h in (1, 2):
        put = _put(1, h, lambda x, h=h: donor.value(2, "state_after", 5)[:, h])
        rec = ref.run(ids, [Write(2, "state_after", put, position=n - 1)])
        assert r[f'part[h={h}].prob(" Paris")'] == pytest.approx(_prob(rec, model), rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("text", [
    "read L1.state_after(2).head(3)",
    "write L1.state_output.head(1) from other.L2.state_after(3).head(2)",
    'sweep s on clean over h in heads[0:2], t in 0..3 {\n    write L4.state_after(t).head(h) = zeros\n}',
    "sweep s on clean over h in heads, L in L[linear] {\n    write L.betas.head(h) *= 0.5\n}",
    "sweep s on clean over h in heads[0,2] {\n    read L1.states.head(h)\n}",
])
def test_head_syntax_prints_back(text: str) -> None:
    tree = parse(text)
    assert parse(ast.format_program(tree)) == tree
    assert ast.format_program(tree).strip() == text


@pytest.mark.parametrize("body, message", [
    ("read L1.state_after(2).head(4)", "no head 4: this model's DeltaNet blocks have 4 value heads"),
    ("read L1.conv_window_after(2).head(0)", "'conv_window_after' has no head axis"),
    ("read L1.output.head(0)", "'output' has no head axis"),
    ("read logits.head(0)", "'logits' has no head axis"),
    ("read L1.state_input.head(0)", "state_input is none on a fresh prompt"),
    ("measure norm(L1.state_output.head(0))", None),  # a reduction (tests/test_reductions.py checks its value)
    ("write L1.state_after(2).head(0) from other.L1.state_after(2)", None),  # the donor's same head: fine
    ("write L1.state_after(2) from other.L1.state_after(2).head(0)", "is one head, the write takes the whole"),
    ("read L1.state_after(2).head(\"x\")", "head(...) takes one head number"),
])
def test_head_mistakes_are_one_line_errors(model: deltalang.DeltaModel, body: str, message: str | None) -> None:
    src = HEADER + f"trace t on clean {{\n    {body}\n}}\n"
    if message is None:
        deltalang.check(src, model=model)
        return
    with pytest.raises(DeltaError) as e:
        deltalang.check(src, model=model)
    assert message in str(e.value)


def test_head_variables_and_named_sources_are_checked(model: deltalang.DeltaModel) -> None:
    cases = [
        ("sweep s on clean over h in heads, t in 0..2 {\n write L1.state_after(h).head(t) = zeros\n}",
         "'h' ranges over heads, not positions"),
        ("sweep s on clean over h in heads[5:9] {\n write L1.state_after(1).head(h) = zeros\n}",
         "selects no heads of 4"),
        ("sweep s on clean over h in heads {\n write L1.state_after(1) = zeros\n}", "'h'"),
        ("trace d on other { read L1.state_after(2).head(0) as x }\n"
         "trace t on clean { write L1.state_after(2).head(0) = x }", "'= NAME' is not supported there"),
        ("trace d on other { read L1.state_after(2).head(0) as x }\n"
         "trace t on clean { write L1.state_after(2) = x }", "'x' holds one head of state_after"),
    ]
    for text, message in cases:
        with pytest.raises(DeltaError) as e:
            deltalang.check(HEADER + text, model=model)
        assert message in str(e.value), (text, str(e.value))


def test_shared_key_heads_refuse_a_write_of_one_value_head(tiny_spec: Any) -> None:
    """Where query/key heads are shared by several value heads, one value head's keys cannot change alone."""
    spec = tiny_spec("qwen3_5")
    assert spec.dims["heads"] > spec.dims["key_heads"], spec.dims
    src = 'prompt p = "a b c d"\ntrace t on p {\n    write L0.attention_keys.head(1) = zeros\n}\n'
    with pytest.raises(DeltaError) as e:
        deltalang.check(src, model=spec)
    assert "query/key heads, each shared by" in str(e.value)
    deltalang.check(src.replace("attention_keys", "attention_values"), model=spec)
    deltalang.check(src.replace("write L0.attention_keys.head(1) = zeros", "read L0.attention_keys.head(1)"),
                    model=spec)
