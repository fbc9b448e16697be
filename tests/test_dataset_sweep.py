"""Sweeps over a dataset: `sweep NAME on facts.corrupt over L in ..., t in facts.subject, -1 { ... }`.

Correctness: a record's value in a cell equals the record's own one-prompt sweep (written here
by hand, its positions found with the tokenizer's offsets, not deltalang's), and one cell equals
plain transformers (`tests/reference.py`: the clean run's cache state written into the corrupt
run). A cell's statistics are those of its records' values; a resumed run equals an
uninterrupted one; bad input is one DeltaError or a record left out with its line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference import Reference, Write, set_to

import deltalang
from deltalang.cli import main
from deltalang.ground.errors import DeltaError
from deltalang.language import ast
from deltalang.language.parse import parse
from deltalang.models.bundled import PATH as BUNDLED
from deltalang.runs.dataset_run import stats_of
from deltalang.sweep.dataset import run_dataset_sweep
from deltalang.sweep.plots import slug

ROOT = Path(__file__).parents[1]
RECORDS = [json.loads(line) for line in (ROOT / "examples" / "data" / "landmarks.jsonl").read_text().splitlines()]
SWEEP = """dataset facts = "facts.jsonl"
sweep s on facts.corrupt over L in L[0,4], t in facts.subject[0], facts.subject, facts.subject + 1, -1 {
    write L.state_after(t) from facts
    measure logit_diff(facts.answer, facts.foil)
}
"""
LABELS = ("facts.subject[0]", "facts.subject", "facts.subject + 1", "-1")
NORM = "clean=facts,corrupted=facts.corrupt"
MEASURE = "logit_diff(facts.answer, facts.foil)"
needs_model = pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


def _data(tmp_path: Path, records: list[dict[str, str]], program: str = SWEEP) -> Path:
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    (tmp_path / "x.dl").write_text(program, encoding="utf-8")
    return tmp_path / "x.dl"


def _subject_tokens(tok: object, r: dict[str, str]) -> list[int]:
    """The tokens of the record's prompt its subject's first occurrence covers, by the tokenizer's offsets."""
    enc = tok(r["prompt"], return_offsets_mapping=True)  # type: ignore[operator]
    start = r["prompt"].index(r["subject"])
    end = start + len(r["subject"])
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a < end and b > start]


# ---- the language -------------------------------------------------------------------------------


def test_the_syntax_parses_and_prints_back() -> None:
    tree = parse(SWEEP)
    sweep = tree.items[1]
    assert sweep.prompt == "facts.corrupt"
    t = sweep.axes[1]
    assert t.var == "t" and isinstance(t.domain, ast.PosList)
    subject = ast.Field("facts", "subject")
    assert t.domain.items == (ast.FieldPos(subject, 0), ast.FieldPos(subject), ast.FieldPos(subject, None, 1),
                              ast.IntPos(-1))
    assert tuple(ast.format_position(p) for p in t.domain.items) == LABELS
    assert parse(ast.format_program(tree)) == tree
    one = parse('prompt p = "a b c"\nsweep s on p over t in 2, "b", -1, L in L[0] {\n}\n').items[1]
    assert [a.var for a in one.axes] == ["t", "L"] and len(one.axes[0].domain.items) == 3


@pytest.mark.parametrize("text, message", [
    ("sweep s on p over t in 2, L3 {\n}", "a sweep axis is"),
    ('sweep s on p over t in "a" + 1 {\n}', "an offset counts from a record's field"),
    ("sweep s on p over t in facts.x[0:2] {\n}", "a field's token is one number"),
])
def test_bad_lists_of_positions_are_syntax_errors(text: str, message: str) -> None:
    with pytest.raises(DeltaError, match=message):
        parse(text)


@needs_model
def test_a_list_of_positions_in_one_prompt(model: deltalang.DeltaModel) -> None:
    src = ('prompt p = "The Eiffel Tower is in the city of"\n'
           'sweep s on p over L in L[0], t in "Tower", 0, -1 {\n    write L.state_after(t) = zeros\n'
           '    measure prob(" Paris")\n}\n')
    run = deltalang.compile(src, model).resolved.run("s")
    tower = _subject_tokens(model.tokenizer, {"prompt": "The Eiffel Tower is in the city of", "subject": "Tower"})
    assert run.axes[1].values == (tower[-1], 0, len(run.token_ids) - 1)
    with pytest.raises(DeltaError, match="names token 0 twice"):
        deltalang.compile(src.replace('"Tower", 0', '"The", 0'), model)


# ---- a record's cells are its own one-prompt sweep's ---------------------------------------------


def _own_sweep(r: dict[str, str], positions: list[int]) -> str:
    """The one-prompt sweep a researcher would write for record `r` alone."""
    return (f"prompt clean = {ast.quote(r['prompt'])}\nprompt corrupt = {ast.quote(r['corrupt'])}\n"
            f"sweep s on corrupt over L in L[0,4], t in {', '.join(map(str, positions))} {{\n"
            f"    write L.state_after(t) from clean\n"
            f"    measure logit_diff({ast.quote(r['answer'])}, {ast.quote(r['foil'])})\n}}\n")


@needs_model
def test_each_records_cells_equal_its_own_sweep_and_the_mean_is_over_records(
        model: deltalang.DeltaModel, tmp_path: Path) -> None:
    records = RECORDS[:3]
    out = run_dataset_sweep(SWEEP, model, filename=str(_data(tmp_path, records)), normalise=NORM)
    assert not out.skipped and out.axes["s"] == (("L", ("L0", "L4")), ("t", LABELS))
    for k, r in enumerate(records):
        subject = _subject_tokens(model.tokenizer, r)
        n = len(model.tokenizer(r["prompt"]).input_ids)
        positions = [subject[0], subject[-1], subject[-1] + 1, n - 1]
        own = deltalang.run_sweep(_own_sweep(r, positions), model, normalise="clean=clean,corrupted=corrupt",
                                  progress=False)
        (table,) = own.tables
        cells = {(dict(row.point)["L"], dict(row.point)["t"], row.measure): row.value for row in table.rows}
        written = f"logit_diff({ast.quote(r['answer'])}, {ast.quote(r['foil'])})"
        for row in out.rows:
            if row["record"] != k:
                continue
            p = positions[LABELS.index(row["t"])]
            name = written if row["measure"] == MEASURE else f"normalised({written})"
            assert row["value"] == cells[(int(row["L"][1:]), p, name)]
    assert len(out.rows) == 3 * 2 * 4 * 2
    for c in out.stats:
        vals = out.values("s", dict(c.point), c.stats.measure)
        assert len(vals) == 3 and c.stats == stats_of(c.stats.measure, vals)
    rows_, cols, grid = out.grid("s", f"normalised({MEASURE})")
    assert rows_ == ("L0", "L4") and cols == LABELS
    assert grid[1][3] == pytest.approx(sum(out.values("s", {"L": "L4", "t": "-1"}, f"normalised({MEASURE})")) / 3)


@needs_model
def test_one_cell_equals_plain_transformers(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    r = RECORDS[5]
    out = run_dataset_sweep(SWEEP, model, filename=str(_data(tmp_path, [r])), normalise=NORM)
    tok = model.tokenizer
    ref = Reference(AutoModelForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32))
    pos = _subject_tokens(tok, r)[-1] + 1  # facts.subject + 1
    clean = ref.run(tok(r["prompt"], return_tensors="pt").input_ids)
    write = Write(4, "state_after", set_to(clean.value(4, "state_after", pos)), position=pos)
    corrupt_ids = tok(r["corrupt"], return_tensors="pt").input_ids
    a, b = (tok(r[k]).input_ids[0] for k in ("answer", "foil"))

    def diff(rec: object) -> float:
        logits = rec.value(None, "logits")[0, -1].float()  # type: ignore[attr-defined]
        return float(logits[a] - logits[b])

    patched, c, k = diff(ref.run(corrupt_ids, [write])), diff(clean), diff(ref.run(corrupt_ids))
    cell = {"L": "L4", "t": "facts.subject + 1"}
    assert out.values("s", cell, MEASURE)[0] == pytest.approx(patched, abs=1e-3)
    assert out.values("s", cell, f"normalised({MEASURE})")[0] == pytest.approx((patched - k) / (c - k), abs=1e-4)


@needs_model
def test_a_one_token_subject_counts_in_both_of_its_cells(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    r = dict(RECORDS[0], subject="Tower")
    assert len(_subject_tokens(model.tokenizer, r)) == 1
    out = run_dataset_sweep(SWEEP, model, filename=str(_data(tmp_path, [r])))
    first, last = (out.values("s", {"L": "L4", "t": t}, MEASURE) for t in LABELS[:2])
    assert len(first) == len(last) == 1 and first == last


# ---- progress, --out and --resume ------------------------------------------------------------------


@needs_model
def test_a_resumed_run_equals_an_uninterrupted_one(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    path = _data(tmp_path, RECORDS[:3])
    whole = run_dataset_sweep(SWEEP, model, filename=str(path), normalise=NORM, out=tmp_path / "whole")

    def stop(i: int) -> None:
        if i == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_dataset_sweep(SWEEP, model, filename=str(path), normalise=NORM, out=tmp_path / "cut", on_record=stop)
    assert json.loads((tmp_path / "cut" / "progress.json").read_text())["done"] == [0, 1]
    with pytest.raises(DeltaError, match="unfinished run .* --resume"):
        run_dataset_sweep(SWEEP, model, filename=str(path), normalise=NORM, out=tmp_path / "cut")
    with pytest.raises(DeltaError, match="another options"):
        run_dataset_sweep(SWEEP, model, filename=str(path), out=tmp_path / "cut", resume=True)
    ran: list[int] = []
    resumed = run_dataset_sweep(SWEEP, model, filename=str(path), normalise=NORM, out=tmp_path / "cut",
                                resume=True, on_record=ran.append)
    assert ran == [2]  # records 0 and 1 are not rerun
    assert resumed.rows == whole.rows and resumed.stats == whole.stats
    for name in ("results.csv", "summary.csv"):
        assert (tmp_path / "cut" / name).read_text() == (tmp_path / "whole" / name).read_text()
    assert (tmp_path / "whole" / f"s-{slug(f'normalised({MEASURE})')}.png").exists()


@needs_model
def test_the_command_line_runs_a_dataset_sweep_with_progress(model: deltalang.DeltaModel, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = _data(tmp_path, RECORDS[:2])
    assert main(["sweep", str(path), "--normalise", NORM, "--out", str(tmp_path / "o")]) == 0
    out, err = capsys.readouterr()
    assert "2 of 2 records of 'facts'" in out and f"s: normalised({MEASURE})" in out
    assert "record 2 of 2" in err and "16/16 cells" in err
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert len(summary["cells"]) == 2 * 4 * 2 and summary["normalise"] == NORM


# ---- bad input ----------------------------------------------------------------------------------------


@needs_model
def test_records_that_do_not_fit_are_left_out_with_their_line(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    away = dict(RECORDS[1], subject="Moon Base")
    longer = dict(RECORDS[2], corrupt="The " + RECORDS[2]["corrupt"])
    out = run_dataset_sweep(SWEEP, model, filename=str(_data(tmp_path, [RECORDS[0], away, longer])))
    assert [i for i, _ in out.skipped] == [1, 2]
    assert "does not occur in the record's prompt" in out.skipped[0][1]
    assert "aligned token for token" in out.skipped[1][1]
    assert "facts.jsonl:2" in out.summary() and {row["record"] for row in out.rows} == {0}
    with pytest.raises(DeltaError, match=r"facts.jsonl:2: record 2 of 'facts' does not resolve \(--strict\)"):
        run_dataset_sweep(SWEEP, model, filename=str(_data(tmp_path, [RECORDS[0], away])), strict=True)


@pytest.mark.parametrize("change, message", [
    (("facts.corrupt over", "facts.corupt over"), "no record of 'facts' has a field 'corupt'"),
    (("facts.corrupt over", "fcts.corrupt over"), "no dataset named 'fcts'"),
    (("facts.subject + 1", '"Tower"'), "a quoted piece is in one prompt only"),
])
def test_bad_dataset_sweeps_are_one_error(model: deltalang.DeltaModel, tmp_path: Path,
                                          change: tuple[str, str], message: str) -> None:
    src = SWEEP.replace(*change)
    with pytest.raises(DeltaError, match=message):
        run_dataset_sweep(src, model, filename=str(_data(tmp_path, RECORDS[:2], src)))


@needs_model
def test_the_causal_trace_example_runs_both_grids(model: deltalang.DeltaModel) -> None:
    path = ROOT / "examples" / "causal_trace.dl"
    out = deltalang.run(path.read_text(), model, filename=str(path), data={"facts": RECORDS[:2]})
    assert isinstance(out, deltalang.DatasetSweepResults)
    linear = tuple(f"L{i}" for i in model.spec.linear_layers())
    for sweep in ("state", "memory"):
        assert out.axes[sweep] == (("L", linear), ("t", LABELS))
    # the window after the last token feeds no later token: there the whole memory is the state
    for lab in linear:
        assert out.values("memory", {"L": lab, "t": "-1"}, MEASURE) == out.values("state", {"L": lab, "t": "-1"},
                                                                                   MEASURE)
    assert any(out.values("memory", {"L": lab, "t": "facts.subject"}, MEASURE)
               != out.values("state", {"L": lab, "t": "facts.subject"}, MEASURE) for lab in linear)


@needs_model
def test_a_resumed_dataset_run_equals_an_uninterrupted_one(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    from deltalang.runs.dataset_run import run_dataset

    src = ('dataset facts = "facts.jsonl"\ntrace t on facts {\n    write L[linear].state_after(facts.subject) '
           'from facts.corrupt\n    measure logit_diff(facts.answer, facts.foil)\n}\n')
    path = str(_data(tmp_path, RECORDS[:3], src))
    whole = run_dataset(src, model, filename=path, batch=False, out=tmp_path / "whole")

    def stop(done: list[int]) -> None:
        if done == [0]:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_dataset(src, model, filename=path, batch=False, out=tmp_path / "cut", on_group=stop)
    ran: list[int] = []
    resumed = run_dataset(src, model, filename=path, batch=False, out=tmp_path / "cut", resume=True,
                          on_group=ran.extend)
    assert ran == [1, 2] and resumed.rows == whole.rows and resumed.stats == whole.stats
    assert (tmp_path / "cut" / "results.csv").read_text() == (tmp_path / "whole" / "results.csv").read_text()
    with pytest.raises(DeltaError, match="another options"):
        run_dataset(src, model, filename=path, out=tmp_path / "cut", resume=True)
