"""An answer written without its leading space (issue 38): `prob("Paris")` after "... the city of" measures the token
'Paris', not the word after a space (' Paris'), and printed 1.7e-10 without a word. `check` notes each answer whose
spaced twin is one other token of the tokenizer; a run warns, located at the measure, naming both probabilities,
where the twin is `measures.UNSPACED_FACTOR` (100) or more times as likely at the position measured; the measured
number is the token's own, as transformers gives it. The truth: the tokenizer asked directly, transformers' logits.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from deltalang import measures
from deltalang.compiler.explain import format_resolved
from deltalang.ground.errors import DeltaWarning
from deltalang.language.check import check
from deltalang.models.bundled import PATH

pytestmark = pytest.mark.skipif(not (PATH / "config.json").exists(), reason="the bundled model is not built")

PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture(scope="module")
def spec() -> Any:
    from deltalang.models.spec import load_spec

    return load_spec(None)


def _one(tok: Any, text: str) -> int:
    (i,) = tok(text, add_special_tokens=False)["input_ids"]
    return int(i)


def _quiet_check(text: str, spec: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check(text, spec, prompt=PROMPT)


def test_check_notes_an_answer_without_its_leading_space(spec: Any) -> None:
    paris, spaced = _one(spec.tokenizer, "Paris"), _one(spec.tokenizer, " Paris")
    assert paris != spaced  # the bundled tokenizer knows both, as two tokens
    r = _quiet_check('measure prob("Paris"), prob(" Paris"), logit_diff(" Rome", "Paris")', spec)
    lines = format_resolved(r).splitlines()
    at = {ln.split(" -> ")[0].strip(): i for i, ln in enumerate(lines) if ln.strip().startswith("measure ")}
    note = lines[at['measure prob("Paris")'] + 1].strip()
    assert note.startswith('note: "Paris" has no leading space') and f"token {spaced} (␣Paris)" in note, note
    assert "100 times as likely" in note
    assert not lines[at['measure prob(" Paris")'] + 1].strip().startswith("note:")
    assert lines[at['measure logit_diff(" Rome", "Paris")'] + 1].strip() == note  # the second answer's twin
    assert sum(ln.strip().startswith("note:") for ln in lines) == 2


def test_no_note_where_the_word_after_a_space_is_not_one_token(spec: Any) -> None:
    from deltalang.models.testing import byte_tokenizer

    tok = byte_tokenizer()  # one token a byte: " P" is two tokens, 'Ġ' and 'P'
    assert len(tok(" P", add_special_tokens=False)["input_ids"]) == 2
    r = _quiet_check('measure prob("P"), rank("P")', attrs.evolve(spec, tokenizer=tok))
    assert all(m.spaced == () for m in r.run("main").measures)
    assert "note:" not in format_resolved(r)


def test_unspaced_warns_from_a_hundredfold_gap_and_changes_nothing() -> None:
    """The factor, on logits whose probabilities are known: twin / token = 99 is quiet, 101 warns."""
    for ratio, warned in ((99.0, False), (101.0, True)):
        logits = torch.zeros(1, 3, 10)
        logits[0, -1, 7] = float(torch.tensor(ratio).log())  # the twin, `ratio` times the token 4's probability
        before = logits.clone()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            measures.unspaced(logits, "Paris", 4, 7)
        assert torch.equal(logits, before)
        assert [isinstance(w.message, DeltaWarning) for w in got] == ([True] if warned else [])
    (w,) = got
    p = 1 / (9 + 101.0)  # token 4 (and every other but 7): e^0 / (9 e^0 + 101)
    assert f"{p:.6g}" in str(w.message) and f"{101 * p:.6g}" in str(w.message)


@pytest.fixture(scope="module")
def truth(spec: Any) -> torch.Tensor:
    """transformers' next-token probabilities after PROMPT on the bundled model (float32)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(**spec.tokenizer(PROMPT, return_tensors="pt")).logits
    return logits[0, -1].softmax(-1)


def test_a_run_warns_at_each_measure_of_the_bare_token_naming_both_probabilities(
        spec: Any, truth: torch.Tensor, capsys: pytest.CaptureFixture[str]) -> None:
    from deltalang.cli import main

    paris, spaced = _one(spec.tokenizer, "Paris"), _one(spec.tokenizer, " Paris")
    p_bare, p_spaced = float(truth[paris]), float(truth[spaced])
    assert p_spaced > 100 * p_bare  # the model's own answer is the word after a space
    program = 'measure prob("Paris"), logit_diff("Paris", " Rome"), rank("Paris")\nmeasure prob(" Paris")'
    assert main(["run", "-e", program, "--prompt", PROMPT]) == 0
    out, err = capsys.readouterr()
    heads = [ln for ln in err.splitlines() if ": warning: " in ln]
    first = program.splitlines()[0]
    columns = [first.index(s) + 1 for s in ('prob("Paris")', 'logit_diff("Paris"', 'rank("Paris")')]
    assert [h.split(": warning: ")[0] for h in heads] == [f"<-e>:1:{c}" for c in columns], err
    for h in heads:
        assert '"Paris" has no leading space' in h and "(␣Paris, token" in h and 'measure " Paris"' in h
        shown = [float(x) for x in re.findall(r"probability (\S+) where .* token \d+\) (\S+),", h)[0]]
        assert shown == pytest.approx([p_bare, p_spaced], rel=1e-4)
    # the measured number is the bare token's own probability, unchanged by the warning
    (value,) = [float(ln.split()[-1]) for ln in out.splitlines() if ln.startswith('main.prob("Paris")')]
    assert value == pytest.approx(p_bare, rel=1e-4)


def test_a_run_of_the_spaced_answer_is_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    from deltalang.cli import main

    assert main(["run", "-e", 'measure prob(" Paris"), logit_diff(" Paris", " Rome")', "--prompt", PROMPT]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.fixture(scope="module")
def records(spec: Any) -> list[dict[str, str]]:
    """Three landmark records, the first and third answers without their leading space, the second with it."""
    import json

    from transformers import AutoModelForCausalLM

    data = Path(__file__).resolve().parents[1] / "examples" / "data" / "landmarks.jsonl"
    rows = [json.loads(ln) for ln in data.read_text(encoding="utf-8").splitlines()[:3]]
    for i in (0, 2):
        rows[i]["answer"] = rows[i]["answer"].lstrip()
    hf = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
    tok = spec.tokenizer
    for r in rows:  # the truth: the word after a space is the likelier, by far
        with torch.no_grad():
            p = hf(**tok(r["prompt"], return_tensors="pt")).logits[0, -1].softmax(-1)
        assert p[_one(tok, " " + r["answer"].lstrip())] > 100 * p[_one(tok, r["answer"].lstrip())]
    return rows


@pytest.mark.parametrize("run", ["trace t on facts {\n    measure prob(facts.answer), prob(facts.foil)\n}\n",
                                 "generate t on facts max_new_tokens 1 {\n    measure prob(facts.answer)\n}\n"],
                         ids=["trace", "generate"])
def test_a_dataset_run_warns_once_per_measure_naming_the_records(records: list[dict[str, str]], run: str) -> None:
    """Over a dataset the warning is one per measure, with how many records gave it and which (not one a record)."""
    from deltalang.runs.compiled import get_model
    from deltalang.runs.dataset_run import run_dataset

    rows = records
    source = 'dataset facts = "facts.jsonl"\n' + run
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        out = run_dataset(source, get_model(None), filename="p.dl", data={"facts": rows})
    said = [w.message for w in got if isinstance(w.message, measures.UnspacedWarning)]
    assert len(said) == 1, [str(w) for w in said]
    (w,) = said
    assert w.render().startswith("p.dl:3:13: warning: ") and w.message.startswith(f'"{rows[0]["answer"]}" has no')
    assert w.notes[-1].startswith("in 2 of 3 records of 'facts' (the numbers are record 1's): 1 (")
    assert ", 3 (" in w.notes[-1] and "2 (" not in w.notes[-1]
    assert len(out.rows) >= 3  # every record measured
