"""Datasets in the language: `dataset NAME = "FILE"`, fields of a record, results per record and their statistics.

Correctness: each record's measure equals the plain one-prompt program written for
that record alone, and the measure computed with plain transformers (`tests/reference.py`:
the corrupt run's cache state after the subject written into the clean run's cache).
Bad input (data files, fields, records) is one DeltaError, exit 1, nothing written.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from reference import Reference, Write, set_to

import deltalang
from deltalang.cli import main
from deltalang.ground.datasets import dataset_from_python, load_dataset
from deltalang.ground.errors import DeltaError, DeltaWarning
from deltalang.language import ast
from deltalang.language.parse import parse
from deltalang.language.resolve import resolve_records
from deltalang.models.bundled import PATH as BUNDLED
from deltalang.models.bundled import world
from deltalang.runs.dataset_run import run_dataset, stats_of, t_quantile_975

ROOT = Path(__file__).parents[1]
LANDMARKS = ROOT / "examples" / "data" / "landmarks.jsonl"
RECORDS = [json.loads(line) for line in LANDMARKS.read_text(encoding="utf-8").splitlines()]
PATCH = """dataset facts = "facts.jsonl"
trace t on facts {
    write L[linear].state_after(facts.subject) from facts.corrupt
    measure logit_diff(facts.answer, facts.foil), prob(facts.answer)
}
"""
needs_model = pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# ---- the language ------------------------------------------------------------------------


def test_a_dataset_and_its_fields_parse_and_print_back() -> None:
    tree = parse(PATCH)
    decl, trace = tree.items
    assert decl == ast.DatasetDecl("facts", "facts.jsonl")
    write, measure = trace.body
    assert write.site.position == ast.Field("facts", "subject")
    assert write.source == ast.FromSource("facts", ast.Site(None, "corrupt"))
    assert measure.calls[0] == ast.LogitDiff(ast.Field("facts", "answer"), ast.Field("facts", "foil"))
    assert parse(ast.format_program(tree)) == tree
    with pytest.raises(DeltaError, match="'dataset' is a keyword"):
        parse('prompt dataset = "x"')


def test_the_landmarks_file_holds_the_bundled_worlds_facts() -> None:
    truth = world.landmarks()
    assert len(RECORDS) >= 20
    for r in RECORDS:
        assert r["answer"] == " " + truth[r["subject"]] and r["foil"] != r["answer"]
        assert r["subject"] in r["prompt"] and r["foil"] == " " + truth[r["corrupt"][4:].split(" is ")[0]]


# ---- loading data ----------------------------------------------------------------------------


def test_jsonl_csv_and_tsv_give_the_same_records_with_their_lines(tmp_path: Path) -> None:
    rows = [{"prompt": "a, \"b\"", "subject": "x"}, {"prompt": "c", "subject": "y"}]
    j = load_dataset("d", _write_jsonl(tmp_path / "d.jsonl", rows))
    (tmp_path / "d.csv").write_text('prompt,subject\n"a, ""b""",x\n\nc,y\n', encoding="utf-8")
    (tmp_path / "d.tsv").write_text('prompt\tsubject\na, "b"\tx\nc\ty\n', encoding="utf-8")
    c, t = load_dataset("d", tmp_path / "d.csv"), load_dataset("d", tmp_path / "d.tsv")
    for ds in (j, c, t):
        assert [dict(r.fields) for r in ds.records] == rows
    assert [r.line for r in c.records] == [2, 4]  # the blank line is skipped, the lines are the file's
    assert dataset_from_python("d", rows).records[1].fields == rows[1]


def test_a_pandas_dataframe_gives_its_rows_and_an_empty_cell_is_a_missing_field() -> None:
    pd = pytest.importorskip("pandas")
    ds = dataset_from_python("d", pd.DataFrame([{"prompt": "a", "subject": "x"}, {"prompt": "c"}]))
    assert [dict(r.fields) for r in ds.records] == [{"prompt": "a", "subject": "x"}, {"prompt": "c"}]
    assert [r.line for r in ds.records] == [1, 2] and ds.where(ds.records[1]) == "data 'd' row 2"


@pytest.mark.parametrize("name, content, message", [
    ("d.jsonl", b'{"prompt": "a"}\n{"prompt": \n', r"d.jsonl:2:1: error: malformed JSON line"),
    ("d.jsonl", b'{"prompt": "a"}\n\n{"prompt": "\xff"}\n', r"d.jsonl:3:1: error: not UTF-8"),
    ("d.jsonl", b'\n\n', r"has no records"),
    ("d.jsonl", b'{"prompt": ["a"]}\n', r"d.jsonl:1:1: error: field 'prompt' is list"),
    ("d.csv", b'prompt,subject\na,b\nc\n', r"d.csv:3:1: error: 1 cells where the header has 2"),
    ("d.txt", b'x', r"must be a .jsonl, .csv or .tsv file"),
])
def test_bad_data_is_one_error_naming_the_line(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DeltaError) as e:
        load_dataset("d", tmp_path / name)
    assert len(e.value.render().splitlines()) == 1
    assert re.search(message, e.value.render()), e.value.render()


def test_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DeltaError, match="no such file"):
        load_dataset("d", tmp_path / "nope.jsonl")


# ---- checking a program over a dataset -------------------------------------------------------------


@pytest.mark.parametrize("program, message", [
    (PATCH.replace("facts.foil", "facts.fiol"), "no record of 'facts' has a field 'fiol': did you mean 'foil'"),
    ('dataset facts = "facts.jsonl"\nsweep s on facts over L in L[linear] {\n    read L.state_output\n'
     '    measure prob(facts.answer)\n}', "a sweep over a dataset keeps measures.*use 'measure'"),  # a trace collects
    (PATCH.replace("facts.corrupt", "facts.corupt"), "no record of 'facts' has a field 'corupt': did you mean"),
    (PATCH + "measure prob(facts.answer)\n", "used inside a run on it"),
    (PATCH.replace("trace t on facts", "generate t on facts max_new_tokens 2").replace("    measure", "    step 1: read "
     "L0.state_output\n    measure"), "a generate over a dataset keeps each record's continuation and measures"),
    ('dataset facts = "facts.jsonl"\nprompt p = "a b"\ntrace t on p { measure prob(" a") }', "no run is on it"),
])
def test_what_holds_for_every_record_is_checked_first(program: str, message: str) -> None:
    ds = dataset_from_python("facts", RECORDS[:2])
    with pytest.raises(DeltaError, match=message):
        resolve_records(parse(program), {"facts": ds}, deltalang.load_spec(None))


def test_a_record_lacking_a_used_field_is_named_by_its_line(tmp_path: Path) -> None:
    rows = [dict(RECORDS[0]), {k: v for k, v in RECORDS[1].items() if k != "foil"}]
    ds = load_dataset("facts", _write_jsonl(tmp_path / "facts.jsonl", rows))
    with pytest.raises(DeltaError, match=r"record 2 of 'facts' \(.*facts.jsonl:2\) has no field 'foil'"):
        resolve_records(parse(PATCH), {"facts": ds}, deltalang.load_spec(None))


# ---- statistics -------------------------------------------------------------------------------


def test_the_t_quantile_is_the_published_one() -> None:
    for df, published in ((1, 12.706), (4, 2.776), (10, 2.228), (30, 2.042)):
        assert t_quantile_975(df) == pytest.approx(published, abs=5e-4)
    s = stats_of("m", [1.0, 2.0, 3.0, 4.0])
    assert (s.mean, s.n) == (2.5, 4) and s.std == pytest.approx(math.sqrt(5 / 3))
    assert s.ci_high - s.mean == pytest.approx(3.182446 * s.std / 2, rel=1e-4)


# ---- running: against the plain program and against transformers ------------------------------------


def _plain(r: dict) -> str:
    q = ast.quote
    return (f"prompt clean = {q(r['prompt'])}\nprompt corrupt = {q(r['corrupt'])}\n"
            f"trace t on clean {{\n    write L[linear].state_after({q(r['subject'])}) from corrupt\n"
            f"    measure logit_diff({q(r['answer'])}, {q(r['foil'])}), prob({q(r['answer'])})\n}}\n")


def _transformers_patch(ref: Reference, tok: object, r: dict[str, str]) -> tuple[float, float]:
    """logit_diff and prob of `r`'s answer in plain transformers: the corrupt run's cache state after the
    subject's last token, written into the clean run."""
    ids = tok(r["prompt"], return_tensors="pt").input_ids  # type: ignore[operator]
    end = r["prompt"].index(r["subject"]) + len(r["subject"])
    pos = len(tok(r["prompt"][:end]).input_ids) - 1  # type: ignore[operator]
    corrupt = ref.run(tok(r["corrupt"], return_tensors="pt").input_ids)  # type: ignore[operator]
    writes = [Write(i, "state_after", set_to(corrupt.value(i, "state_after", pos)), position=pos)
              for i in ref.linear]
    logits = ref.run(ids, writes).value(None, "logits")[0, -1].float()
    a, b = (tok(r[k]).input_ids[0] for k in ("answer", "foil"))  # type: ignore[operator]
    return float(logits[a] - logits[b]), float(logits.softmax(-1)[a])


@needs_model
def test_each_record_equals_its_plain_program_and_transformers(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    records = RECORDS[:4]
    out = run_dataset(PATCH, model, filename=str(_write_jsonl(tmp_path / "facts.jsonl", records).with_name("x.dl")))
    diffs = out.values("t.logit_diff(facts.answer, facts.foil)")
    probs = out.values("t.prob(facts.answer)")
    assert len(diffs) == len(probs) == 4 and not out.skipped
    ref = Reference(AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32))
    for r, diff, prob in zip(records, diffs, probs):
        plain = deltalang.run(_plain(r), model)
        assert diff == pytest.approx(plain[f't.logit_diff({ast.quote(r["answer"])}, {ast.quote(r["foil"])})'],
                                     abs=1e-4)
        assert prob == pytest.approx(plain[f't.prob({ast.quote(r["answer"])})'], abs=1e-5)
        want_diff, want_prob = _transformers_patch(ref, model.tokenizer, r)
        assert diff == pytest.approx(want_diff, abs=1e-3)
        assert prob == pytest.approx(want_prob, abs=1e-4)


@needs_model
def test_records_of_different_lengths_share_forwards_and_each_equals_transformers(
        model: deltalang.DeltaModel, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from deltalang.runs.records import record_groups

    # k leading "The"s in both prompts: records of 8 to 11 tokens, each donor as long as its prompt
    records = [dict(r, prompt="The " * k + r["prompt"], corrupt="The " * k + r["corrupt"])
               for k, r in zip((3, 0, 2, 1, 3), RECORDS[4:9])]
    path = _write_jsonl(tmp_path / "facts.jsonl", records).with_name("x.dl")
    ds, resolutions = resolve_records(parse(PATCH, str(path)), {"facts": dataset_from_python("facts", records)},
                                      model.spec)
    groups = record_groups(resolutions, batch=True)
    assert len(groups) == 1 and len({len(r.resolved.runs[0].token_ids) for r in groups[0]}) == 4  # one padded forward
    out = run_dataset(PATCH, model, filename=str(path))
    ref = Reference(AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32))
    diffs = out.values("t.logit_diff(facts.answer, facts.foil)")
    probs = out.values("t.prob(facts.answer)")
    assert len(diffs) == 5
    for r, diff, prob in zip(records, diffs, probs):
        want_diff, want_prob = _transformers_patch(ref, model.tokenizer, r)
        assert diff == pytest.approx(want_diff, abs=1e-3)
        assert prob == pytest.approx(want_prob, abs=1e-4)


@needs_model
def test_from_python_a_list_of_dicts_and_records_left_out(model: deltalang.DeltaModel) -> None:
    bad = dict(RECORDS[1], subject="Moon Base")  # not in its prompt
    src = 'trace t on facts { measure logit_diff(facts.answer, facts.foil) }\n' \
          'trace p on facts { write L[linear].state_after(facts.subject) = zeros; measure prob(facts.answer) }'
    out = deltalang.run(src, model, data={"facts": [RECORDS[0], bad, RECORDS[2]]})
    assert isinstance(out, deltalang.DatasetResults)
    assert [row["record"] for row in out.rows if row["measure"].startswith("t.")] == [0, 2]
    assert out.skipped[0][0] == 1 and "Moon Base" in out.skipped[0][1]
    assert "left out 1 of 3 records" in out.summary() and "data 'facts' row 2" in out.summary()
    assert [s.n for s in out.stats] == [2, 2]
    with pytest.raises(DeltaError, match=r"row 2: record 2 of 'facts' does not resolve \(--strict\)"):
        deltalang.run(src, model, data={"facts": [RECORDS[0], bad]}, strict=True)


@needs_model
def test_a_dataset_without_a_prompt_field_runs_on_another_field(model: deltalang.DeltaModel,
                                                                ref: Reference) -> None:
    """`trace t on facts.text` needs no `prompt` field; a position from a field does (token numbers of the prompt)."""
    records = [{"text": r["prompt"], "answer": r["answer"]} for r in RECORDS[:2]]
    out = deltalang.run("trace t on facts.text { measure prob(facts.answer) }", model, data={"facts": records})
    for r, got in zip(records, out.values("t.prob(facts.answer)")):
        with torch.no_grad():
            probs = ref.hf(model.tokenizer(r["text"], return_tensors="pt").input_ids).logits[0, -1].softmax(-1)
        assert got == pytest.approx(float(probs[model.tokenizer(r["answer"]).input_ids[0]]), abs=1e-5)
    with pytest.raises(DeltaError, match="has a field 'prompt'") as err:
        deltalang.run("trace t on facts.text { write L0.state_after(facts.answer) = zeros; measure prob(facts.answer) }",
                      model, data={"facts": records})
    assert "position from a field" in str(err.value)


def test_run_with_data_saves_resumes_and_refuses_what_does_not_apply(model: deltalang.DeltaModel,
                                                                     tmp_path: Path) -> None:
    src = 'trace t on facts { write L[linear].state_after(facts.subject) from facts.corrupt; ' \
          'measure logit_diff(facts.answer, facts.foil) }'
    data = {"facts": RECORDS[:3]}
    whole = deltalang.run(src, model, data=data, out=tmp_path / "whole")
    assert (tmp_path / "whole" / "results.csv").read_text(encoding="utf-8").count("\n") == 1 + 3
    # a finished run resumed reruns nothing and gives the same rows
    again = deltalang.run(src, model, data=data, out=tmp_path / "whole", resume=True)
    assert again.rows == whole.rows
    with pytest.raises(DeltaError, match="normalise= applies to sweeps"):
        deltalang.run(src, model, data=data, normalise="clean=a,corrupted=b")
    with pytest.raises(DeltaError, match="out= applies to a program over a dataset"):
        deltalang.run("read L0.state_output", model, prompt="The Eiffel Tower", out=tmp_path / "x")
    sweep = 'sweep s on facts.corrupt over L in L[0,1], t in facts.subject, -1 {\n' \
            '    write L.state_after(t) from facts\n    measure logit_diff(facts.answer, facts.foil)\n}\n'
    norm = deltalang.run(sweep, model, data=data, normalise={"clean": "facts", "corrupted": "facts.corrupt"},
                         out=tmp_path / "sweep")
    raw = deltalang.run(sweep, model, data=data)
    assert (tmp_path / "sweep" / "results.csv").exists()
    assert any(r["measure"].startswith("normalised(") for r in norm.rows)
    assert not any(r["measure"].startswith("normalised(") for r in raw.rows)


@needs_model
def test_a_records_warning_is_shown_once_naming_the_record(model: deltalang.DeltaModel) -> None:
    cut = dict(RECORDS[0], subject=RECORDS[0]["subject"][:-2])  # "Eiffel Tow": part of a token
    with pytest.warns(DeltaWarning, match="covers only part of token") as got:
        out = deltalang.run(PATCH, model, data={"facts": [cut, cut]})
    notes = [n for w in got.list if isinstance(w.message, DeltaWarning) for n in w.message.notes]
    assert notes.count("in record 1 (data 'facts' row 1)") == 1 and len(out.rows) == 4


# ---- the command line -------------------------------------------------------------------------------


@needs_model
def test_run_writes_long_results_and_statistics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_jsonl(tmp_path / "facts.jsonl", RECORDS[:3])
    (tmp_path / "p.dl").write_text(PATCH, encoding="utf-8")
    assert main(["run", str(tmp_path / "p.dl"), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "t.logit_diff(facts.answer, facts.foil)" in printed and "n 3  95% CI [" in printed
    lines = (tmp_path / "out" / "results.csv").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "record,line,prompt,answer,foil,corrupt,subject,measure,value" and len(lines) == 1 + 3 * 2
    summary = json.loads((tmp_path / "out" / "summary.json").read_text(encoding="utf-8"))
    assert [m["n"] for m in summary["measures"]] == [3, 3]


@pytest.mark.parametrize("data, message", [
    (None, "no such file"),
    (b'{"prompt": "x"}\n{oops\n', "facts.jsonl:2:1: error: malformed JSON line"),
    (b'\xfe\xff', "not UTF-8"),
    (b'', "has no records"),
])
def test_bad_input_exits_1_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              data: bytes | None, message: str) -> None:
    if data is not None:
        (tmp_path / "facts.jsonl").write_bytes(data)
    (tmp_path / "p.dl").write_text(PATCH, encoding="utf-8")
    assert main(["run", str(tmp_path / "p.dl"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "out").exists()


@needs_model
def test_strict_stops_at_an_unresolvable_record_and_writes_nothing(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _write_jsonl(tmp_path / "facts.jsonl", [RECORDS[0], dict(RECORDS[1], subject="Moon Base")])
    (tmp_path / "p.dl").write_text(PATCH, encoding="utf-8")
    assert main(["run", str(tmp_path / "p.dl"), "--strict", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "facts.jsonl:2: record 2 of 'facts' does not resolve (--strict)" in err[0]
    assert not (tmp_path / "out").exists()
    assert main(["run", str(tmp_path / "p.dl"), "--out", str(tmp_path / "out")]) == 0
    assert "left out 1 of 2 records" in capsys.readouterr().out
    assert len((tmp_path / "out" / "results.csv").read_text(encoding="utf-8").splitlines()) == 1 + 2


def test_check_shows_the_first_records_program_and_lists_the_records_left_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_jsonl(tmp_path / "facts.jsonl", [dict(RECORDS[1], subject="Moon Base"), RECORDS[2]])
    (tmp_path / "p.dl").write_text(PATCH, encoding="utf-8")
    assert main(["check", str(tmp_path / "p.dl")]) == 0
    out = capsys.readouterr().out
    assert f"# record 2 of 'facts' ({tmp_path / 'facts.jsonl'}:2), as its plain program:" in out
    assert f'prompt facts_corrupt = {ast.quote(RECORDS[2]["corrupt"])}' in out
    assert "# 1 of 2 records resolve; left out:" in out and "facts.jsonl:1: \"Moon Base\" does not occur" in out
