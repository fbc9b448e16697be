"""A donor's own position: `from RUN at POS`, and over a dataset `from facts.corrupt at facts.foil_subject`.

Without `at`, a donor reads the target's token number. Over a dataset whose
corrupt prompts are phrased differently that is an unrelated token of the donor;
`at FIELD` names the donor's position by a field of the same record, found in
the donor's own prompt. Checked against transformers' cache (tests/reference.py):
the state written is the donor's cache state after its own prefix up to that
field's last token. A plain `from` whose donor has another number of tokens and
is read at another token than the clean record's is one warning over the
records; a field or position the donor lacks is a located error at check.

The tiny checkpoints' tokenizer is byte-level: a token per character, so a
prompt phrased with one more word moves every later position.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from reference import Reference, Write, set_to

import deltalang
from deltalang.cli import main
from deltalang.ground.datasets import dataset_from_python
from deltalang.ground.errors import DeltaError, DeltaWarning, RecordsWarning
from deltalang.language import ast
from deltalang.language.parse import parse
from deltalang.language.resolve import resolve_records
from deltalang.models.spec import load_spec
from deltalang.models.testing import load_hf, tiny_checkpoint

MOVED = {"prompt": "The Eiffel Tower is in", "corrupt": "So the Leaning Tower is in", "subject": "Eiffel Tower",
         "foil_subject": "Leaning Tower", "answer": "P", "foil": "R"}  # one more word before the subject
ALIGNED = {"prompt": "The Big Ben is in", "corrupt": "The Old Ben is in", "subject": "Big Ben",
           "foil_subject": "Old Ben", "answer": "P", "foil": "R"}  # token for token
AGREES = {"prompt": "The Big Ben is in", "corrupt": "The Tin Man is in town", "subject": "Big Ben",
          "foil_subject": "Tin Man", "answer": "P", "foil": "R"}  # longer, but the same token at the subject
RECORDS = [MOVED, ALIGNED, AGREES]
PATCH = """dataset facts = "facts.jsonl"
trace t on facts {
    write L[linear].state_after(facts.subject) from facts.corrupt{at}
    measure logit_diff(facts.answer, facts.foil)
}
"""


@pytest.fixture(scope="module")
def path() -> Path:
    return tiny_checkpoint("qwen3_5")


@pytest.fixture(scope="module")
def model(path: Path) -> deltalang.DeltaModel:
    return deltalang.load_model(path)


def _program(at: str = "") -> str:
    return PATCH.replace("{at}", at)


def _last_token(tok: object, text: str, piece: str) -> int:
    """The last token of `piece`'s first occurrence in `text`, by transformers' tokenizer alone."""
    end = text.index(piece) + len(piece)
    return len(tok(text[:end]).input_ids) - 1  # type: ignore[operator]


def _write_data(tmp_path: Path, records: list[dict[str, str]], program: str) -> Path:
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    (tmp_path / "p.dl").write_text(program, encoding="utf-8")
    return tmp_path / "p.dl"


# ---- the language ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", [
    "from facts.corrupt at facts.foil_subject", 'from other at "Tower"', "from other at -1", "from other at 3",
    "from other.L2.state_after at 4"])
def test_at_parses_and_prints_back(source: str) -> None:
    text = f"trace t on p {{\n    write L0.state_after(2) {source}\n}}\n"
    tree = parse(text)
    src = tree.items[0].body[0].source
    assert isinstance(src, ast.FromSource) and src.at is not None
    assert ast.format_source(src) == source
    assert parse(ast.format_program(tree)) == tree


def test_a_donor_position_named_twice_is_a_located_syntax_error() -> None:
    line = "    write L0.state_after(2) from other.state_after(1) at 3"
    with pytest.raises(DeltaError, match=r"named twice") as err:
        parse(f"trace t on p {{\n{line}\n}}\n", "x.dl")
    assert err.value.span is not None and (err.value.span.line, err.value.span.column) == (2, len(line))


# ---- against transformers --------------------------------------------------------------------------------


def test_at_a_field_writes_the_donors_state_after_its_own_fields_token(model: deltalang.DeltaModel, path: Path,
                                                                       tmp_path: Path) -> None:
    """Each record's written state is transformers' cache state of its corrupt prompt after the donor's own
    foil_subject; the logit difference is that of the clean run with those states written after its subject."""
    tok = model.tokenizer
    program = _program(" at facts.foil_subject").replace(
        "    measure", "    read L[linear].state_after(facts.subject) as s\n    measure")
    program = program.replace("    measure logit_diff(facts.answer, facts.foil)\n", "")
    got = deltalang.run(program, model, data={"facts": RECORDS}, out=tmp_path / "states")
    measured = deltalang.run(_program(" at facts.foil_subject"), model, data={"facts": RECORDS})
    diffs = measured.values("t.logit_diff(facts.answer, facts.foil)")
    ref = Reference(load_hf(path).eval())
    linear = model.spec.linear_layers()
    assert len(got) == len(diffs) == len(RECORDS)
    for n, r in enumerate(RECORDS):
        p, q = _last_token(tok, r["prompt"], r["subject"]), _last_token(tok, r["corrupt"], r["foil_subject"])
        donor = ref.run(tok(r["corrupt"], return_tensors="pt").input_ids)
        fields, values = got[n]
        assert fields["foil_subject"] == r["foil_subject"]
        states = [v for k, v in sorted(values.items())]
        assert len(states) == len(linear)
        for i, state in zip(linear, states):
            want = donor.value(i, "state_after", q)[0].float()  # a record's value has no batch axis
            torch.testing.assert_close(state.float(), want, atol=1e-5, rtol=1e-4)
        if r is MOVED:  # the same token number is another state of the donor: the test tells them apart
            assert not torch.allclose(donor.value(linear[0], "state_after", p), donor.value(linear[0], "state_after", q))
        writes = [Write(i, "state_after", set_to(donor.value(i, "state_after", q)), position=p) for i in linear]
        logits = ref.run(tok(r["prompt"], return_tensors="pt").input_ids, writes).value(None, "logits")[0, -1]
        a, b = (tok(r[k]).input_ids[0] for k in ("answer", "foil"))
        assert diffs[n] == pytest.approx(float(logits[a] - logits[b]), abs=1e-4)


@pytest.mark.parametrize("at", ['"Tower"', "-1", "4"])
def test_at_in_one_prompt_reads_the_donor_there(model: deltalang.DeltaModel, path: Path, at: str) -> None:
    """`from other at POS` outside a dataset: the donor's piece, its own last token, or its token number."""
    tok = model.tokenizer
    clean, other = MOVED["prompt"], MOVED["corrupt"]
    i = model.spec.linear_layers()[-1]
    src = (f"prompt a = {ast.quote(clean)}\nprompt b = {ast.quote(other)}\ntrace t on a {{\n"
           f'    write L{i}.state_after("Eiffel") from b at {at}\n    read L{i}.state_after("Eiffel") as s\n}}\n')
    n = len(tok(other).input_ids)
    q = {'"Tower"': _last_token(tok, other, "Tower"), "-1": n - 1, "4": 4}[at]
    assert f"state_after({q})" in deltalang.compile(src, model).code  # the emitted code reads the donor there
    donor = Reference(load_hf(path).eval()).run(tok(other, return_tensors="pt").input_ids)
    torch.testing.assert_close(deltalang.run(src, model)["s"].float(), donor.value(i, "state_after", q).float(),
                               atol=1e-5, rtol=1e-4)


# ---- the warning -----------------------------------------------------------------------------------------


def _donor_warnings(path: Path, records: list[dict[str, str]], program: str) -> list[DeltaWarning]:
    spec = load_spec(str(path))  # the model's shape alone: no weights
    _, out = resolve_records(parse(program, "p.dl"), {"facts": dataset_from_python("facts", records)}, spec,
                             source=program, filename="p.dl")
    return [w for r in out if r.resolved is not None for w in r.resolved.warnings if isinstance(w, RecordsWarning)]


def test_a_donor_read_at_another_token_is_one_warning_over_the_records(path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    got = _donor_warnings(path, [ALIGNED, MOVED, AGREES, MOVED], _program())
    assert len(got) == 1
    w = got[0]
    p = _last_token(tok, MOVED["prompt"], MOVED["subject"])
    # each token as tables show it (decoded, a space as ␣), never the tokenizer's spelling ('Ġ...')
    clean, donor = (tok.decode([tok(MOVED[k]).input_ids[p]]).replace(" ", "␣") for k in ("prompt", "corrupt"))
    assert clean != donor and "Ġ" not in w.message
    assert "in 2 of 4 records of 'facts'" in w.message and "record 2 (data 'facts' row 2)" in w.message
    assert f"has {clean} at {p} " in w.message and f"its donor {donor} at {p} " in w.message
    assert w.message.endswith("from facts.corrupt at facts.FIELD")
    assert w.notes == ("records that differ: 2 (data 'facts' row 2), 4 (data 'facts' row 4)",)
    line = "    write L[linear].state_after(facts.subject) from facts.corrupt"
    assert w.render().splitlines()[0].startswith(f"p.dl:3:{line.index('from') + 1}: warning: ")
    assert w.render().splitlines()[2].strip() == "^" * len("from facts.corrupt")
    # aligned token for token, or the same token at the subject: no warning; nor with `at`
    assert _donor_warnings(path, [ALIGNED, AGREES], _program()) == []
    assert _donor_warnings(path, RECORDS, _program(" at facts.foil_subject")) == []


def test_the_warning_shows_at_check_and_once_at_run(model: deltalang.DeltaModel, path: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    file = _write_data(tmp_path, [MOVED, ALIGNED], _program())
    assert main(["check", str(file), "--model", str(path)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"p\.dl:3:\d+: warning: in 1 of 2 records of 'facts' the donor facts\.corrupt", printed)
    with pytest.warns(DeltaWarning) as caught:
        deltalang.run(_program(), model, data={"facts": [MOVED, ALIGNED]})
    ours = [w.message for w in caught.list if isinstance(w.message, RecordsWarning)]
    assert len(ours) == 1 and not any(n.startswith("in record") for n in ours[0].notes)


# ---- errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("at, message", [
    (" at facts.foil_subjct", r"no record of 'facts' has a field 'foil_subjct': did you mean 'foil_subject'\?"),
    (" at facts.subject", r"\"Eiffel Tower\" does not occur in prompt 'facts_corrupt'"),
    (" at 99", r"position 99 is past the end of prompt 'facts_corrupt'"),
])
def test_a_donor_position_the_donor_lacks_is_a_located_error_at_check(path: Path, tmp_path: Path, at: str,
                                                                      message: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    file = _write_data(tmp_path, [MOVED], _program(at))
    assert main(["check", str(file), "--model", str(path)]) == 1
    err = capsys.readouterr().err
    line = "    write L[linear].state_after(facts.subject) from facts.corrupt" + at
    col = line.rindex(at.split()[1]) + 1
    assert re.search(rf"p\.dl:3:{col}: error: {message}", err), err
    assert f"\n    {line}\n    {' ' * (col - 1)}^" in err


def test_at_on_a_value_without_positions_is_a_located_error(model: deltalang.DeltaModel) -> None:
    src = 'prompt a = "The Eiffel Tower"\nprompt b = "The Leaning Tower"\ntrace t on a {\n' \
          "    write L0.state_output from b at -1\n}\n"
    with pytest.raises(DeltaError, match=r"'state_output' takes no position, so the donor has none to name") as err:
        deltalang.check(src, model, filename="x.dl")
    col = "    write L0.state_output from b at -1".index("-1") + 1
    assert err.value.span is not None and (err.value.span.line, err.value.span.column) == (4, col)
