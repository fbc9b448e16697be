"""`measure top(k)`: the k most likely next tokens, checked against transformers' own logits.

The ground truth is `tests/reference.py` (a plain transformers model over its own cache);
the expected tokens are `torch.topk` of its softmax, never deltalang's own output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference import Reference, Write, zeros
from safetensors.torch import load_file

import deltalang
from deltalang.ground import display
from deltalang.ground.errors import DeltaError
from deltalang.ground.measures import TopK, top
from deltalang.language import ast
from deltalang.language.parse import parse
from deltalang.models.bundled import PATH as BUNDLED
from deltalang.models.bundled import world
from deltalang.runs.results import Results

pytestmark = pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")

CLEAN, OTHER = world.EIFFEL_PROMPT, world.PIZZA_PROMPT
HEADER = f'prompt clean = "{CLEAN}"\nprompt other = "{OTHER}"\n'


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


def _expected(logits: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    p = logits[:, -1].float().softmax(-1)[0]
    vals, ids = p.topk(k)
    return ids.tolist(), vals.tolist()


def test_top_is_transformers_most_likely_tokens(model: deltalang.DeltaModel, ref: Reference,
                                                tmp_path: Path) -> None:
    src = HEADER + """
trace base on clean { measure top(5) }
trace patched on clean {
    write L[linear].state_after(-1) = zeros
    measure top(4) as best
}
generate g on other max_new_tokens 2 { measure top(3) }
"""
    r = deltalang.run(src, model)
    ids = model.tokenizer(CLEAN, return_tensors="pt").input_ids
    n = ids.shape[1]
    base = ref.run(ids)
    patched = ref.run(ids, [Write(i, "state_after", zeros, position=n - 1) for i in ref.linear])
    gen = ref.run(model.tokenizer(OTHER, return_tensors="pt").input_ids, max_new_tokens=2)
    for name, logits, k in [("base.top(5)", base.value(None, "logits"), 5), ("best", patched.value(None, "logits"), 4),
                            ("g.step0.top(3)", gen.value(None, "logits", step=0), 3),
                            ("g.step1.top(3)", gen.value(None, "logits", step=1), 3)]:
        got = r[name]
        assert isinstance(got, TopK) and got.k == k
        want_ids, want_p = _expected(logits, k)
        assert got.ids[0].tolist() == want_ids, name
        torch.testing.assert_close(got.probs[0], torch.tensor(want_p), rtol=1e-4, atol=1e-6)
    # the write moves the distribution, so a run that ignored it could not match `best` above
    top_base, top_patched = _expected(base.value(None, "logits"), 1), _expected(patched.value(None, "logits"), 1)
    assert abs(top_base[1][0] - top_patched[1][0]) > 1e-4
    # the summary line: the decoded tokens and their probabilities, most likely first
    line = next(ln for ln in r.summary().splitlines() if ln.startswith("base.top(5) "))
    first = model.tokenizer.decode([r["base.top(5)"].ids[0, 0].item()])
    assert line.split(None, 1)[1].startswith(display.token(first) + " ") and line.count(", ") == 4
    # saved: ids and probs as tensors, the tokens in results.json
    r.save(tmp_path)
    tensors = load_file(str(tmp_path / "results.safetensors"))
    assert tensors["best.ids"].tolist() == r["best"].ids.tolist()
    assert torch.equal(tensors["best.probs"], r["best"].probs)
    meta = json.loads((tmp_path / "results.json").read_text())
    assert [e["id"] for e in meta["top"]["best"][0]] == r["best"].ids[0].tolist()
    assert meta["top"]["best"][0][0]["token"] == model.tokenizer.decode([r["best"].ids[0, 0].item()])
    assert "best" not in meta["measures"]


def test_top_orders_ties_by_token_id_and_refuses_k_past_the_vocabulary() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0]])
    got = top(logits, 4)
    assert got.ids.tolist() == [[1, 3, 2, 4]]
    p = logits.softmax(-1)[0]
    torch.testing.assert_close(got.probs[0], p[[1, 3, 2, 4]])
    with pytest.raises(DeltaError):
        top(logits, 6)
    r = Results({"t.top(2)": top(logits, 2), "x": 0.5})
    assert r.measures == {"x": 0.5} and list(r.tops) == ["t.top(2)"]
    assert r.summary().splitlines()[0].split(None, 1)[1] == f"1 {float(p[1]):.3g}, 3 {float(p[3]):.3g}"


def test_top_prints_back_and_misuse_is_one_line(model: deltalang.DeltaModel) -> None:
    tree = parse("measure top(5), prob(\" Paris\") as x\n".replace(" as x", ""))
    assert parse(ast.format_program(tree)) == tree and "top(5)" in ast.format_program(tree)
    cases = [
        ("trace t on clean { measure top(0) }", "top takes how many tokens, a whole number >= 1"),
        ('trace t on clean { measure top(" Paris") }', "top takes how many tokens"),
        ("trace t on clean { measure top(100000000) }", "the vocabulary has"),
        ("sweep s on clean over t in 0..2 {\n write L0.state_after(t) = zeros\n measure top(3)\n}",
         "top(3) gives tokens, not a number, and a sweep's cells hold numbers"),
    ]
    for text, message in cases:
        with pytest.raises(DeltaError) as e:
            deltalang.check(HEADER + text, model=model)
        assert message in str(e.value), (text, str(e.value))


def test_top_over_a_dataset_is_refused(model: deltalang.DeltaModel) -> None:
    src = 'dataset facts = "facts.jsonl"\ntrace t on facts { measure top(3) }\n'
    with pytest.raises(DeltaError) as e:
        deltalang.run(src, model, data={"facts": [{"prompt": CLEAN}]})
    assert "a run over a dataset averages numbers" in str(e.value)
