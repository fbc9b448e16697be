"""Per-token measures in a sweep over a dataset, their positions named from each record's own fields.

Ground truth: each record run alone in plain transformers (`tests/reference.Reference`) with the cell's write
applied by hand (the state after the subject's last token zeroed), its per-token value (the norm of block L6's
state after every token) taken from that forward's cache; the subject's tokens found with the tokenizer's
offsets, not deltalang's. A cell's statistics at an aligned position are those of the records that have it.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from reference import Reference, Write, zeros

import deltalang
from deltalang.cli import main
from deltalang.ground.errors import DeltaError
from deltalang.models.testing import load_hf
from deltalang.runs.dataset_run import stats_of
from deltalang.sweep.dataset import run_dataset_sweep

RECORDS = [  # three lengths, the subject at three places
    {"prompt": "The Eiffel Tower is in the city of", "subject": "Eiffel Tower"},
    {"prompt": "Everyone knows that the Leaning Tower is in the city of", "subject": "Leaning Tower"},
    {"prompt": "The Brandenburg Gate is in", "subject": "Brandenburg Gate"},
]
PROGRAM = """dataset facts = "facts.jsonl"
sweep s on facts over L in L[4,5] {
    write L.state_after(facts.subject) = zeros
    measure norm(L6.states)
    measure prob(" Paris")
}
"""
MEASURE = "norm(L6.states)"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


@pytest.fixture(scope="module")
def truth(model: deltalang.DeltaModel) -> dict[tuple[int, int], list[float]]:
    """{(record, block): the norm of L6's state after each token, the record run alone with its write}."""
    from deltalang.models.bundled import PATH

    ref = Reference(load_hf(PATH))
    out = {}
    for i, r in enumerate(RECORDS):
        ids = model.tokenizer(r["prompt"], return_tensors="pt").input_ids
        subject = _subject_last(model, r)
        for layer in (4, 5):
            rec = ref.run(ids, [Write(layer, "state_after", zeros, position=subject)])
            states = rec.value(6, "states")[0].float()  # [s, heads, key_dim, value_dim]
            out[(i, layer)] = [float(states[p].norm()) for p in range(states.shape[0])]
    return out


def _subject_last(model: deltalang.DeltaModel, r: dict[str, str]) -> int:
    enc = model.tokenizer(r["prompt"], return_offsets_mapping=True)
    start, end = r["prompt"].index(r["subject"]), r["prompt"].index(r["subject"]) + len(r["subject"])
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a < end and b > start][-1]


def _write(tmp_path: Path, records: list[dict[str, str]] = RECORDS, program: str = PROGRAM) -> Path:
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    (tmp_path / "x.dl").write_text(program, encoding="utf-8")
    return tmp_path / "x.dl"


def _run(model: Any, prog: Path, **kw: Any) -> Any:
    return run_dataset_sweep(prog.read_text(), model, filename=str(prog), progress=False, **kw)


def _label(d: int) -> str:
    return "facts.subject" + ("" if d == 0 else f" {'+' if d > 0 else '-'} {abs(d)}")


def test_rows_aligned_at_the_subject_equal_each_record_alone_in_transformers(model: Any, truth: Any,
                                                                             tmp_path: Path) -> None:
    out = _run(model, _write(tmp_path), align="facts.subject")
    lengths = {len(v) for v in truth.values()}
    assert len(lengths) == 3  # the records differ in length
    want: dict[tuple[str, str], list[float]] = {}
    for i, r in enumerate(RECORDS):
        anchor = _subject_last(model, r)
        for layer in (4, 5):
            rows = [x for x in out.rows if x["record"] == i and x["L"] == f"L{layer}" and x["measure"] == MEASURE]
            assert [x["token"] for x in rows] == list(range(len(truth[(i, layer)])))
            for x in rows:
                assert x["position"] == _label(x["token"] - anchor)
                assert x["value"] == pytest.approx(truth[(i, layer)][x["token"]], rel=1e-4, abs=1e-5)
                want.setdefault((f"L{layer}", x["position"]), []).append(truth[(i, layer)][x["token"]])
    for (block, at), values in want.items():
        got = out.stat("s", {"L": block}, MEASURE, position=at)
        ref = stats_of(MEASURE, values)
        assert got.n == ref.n and got.mean == pytest.approx(ref.mean, rel=1e-4, abs=1e-6)
    # at the subject every record counts; 4 before it only the longest (its subject 4 tokens later than others')
    assert out.stat("s", {"L": "L4"}, MEASURE, position="facts.subject").n == 3
    assert out.positions("s", MEASURE)[0] == _label(min(-_subject_last(model, r) for r in RECORDS))
    assert out.stat("s", {"L": "L4"}, 'prob(" Paris")').n == 3  # a measure of one number: no position


def test_by_default_positions_count_from_each_records_end_and_save_long_format(model: Any, truth: Any,
                                                                                tmp_path: Path) -> None:
    prog = _write(tmp_path)
    out = _run(model, prog, out=tmp_path / "out")
    last = [x for x in out.rows if x.get("position") == "-1" and x["L"] == "L5"]
    assert [x["value"] for x in last] == pytest.approx([truth[(i, 5)][-1] for i in range(3)], rel=1e-4)
    with (tmp_path / "out" / "results.csv").open() as f:
        header = next(csv.reader(f))
    assert header == ["record", "line", "prompt", "subject", "sweep", "L", "measure", "position", "token", "value"]
    frame = out.to_pandas()
    assert list(frame.columns) == header and len(frame) == len(out.rows)
    with (tmp_path / "out" / "summary.csv").open() as f:
        summary = list(csv.DictReader(f))
    row = next(r for r in summary if r["L"] == "L5" and r["position"] == "-1")
    assert float(row["mean"]) == pytest.approx(sum(truth[(i, 5)][-1] for i in range(3)) / 3, rel=1e-4)
    assert int(row["n"]) == 3
    text = repr(out)
    assert text.startswith("<DatasetSweepResults: 3 of 3 records of 'facts'") and len(text.splitlines()) <= 4
    # --resume on a finished run reads every row back, positions included
    again = _run(model, prog, out=tmp_path / "out", resume=True)
    assert [(r.get("position"), r.get("token"), r["value"]) for r in again.rows] == [
        (r.get("position"), r.get("token"), r["value"]) for r in out.rows]


def test_a_record_without_the_anchor_is_left_out_and_bad_anchors_are_errors(model: Any, tmp_path: Path) -> None:
    records = [*RECORDS, {"prompt": "The Eiffel Tower is in the city of", "subject": ""}]
    program = PROGRAM.replace("write L.state_after(facts.subject) = zeros", "write L.state_after(-1) = zeros")
    prog = _write(tmp_path, records, program)
    out = _run(model, prog, align="facts.subject")
    assert [i for i, _ in out.skipped] == [3] and "align=facts.subject" in out.skipped[0][1]
    with pytest.raises(DeltaError, match="align=facts.subject"):
        _run(model, prog, align="facts.subject", strict=True)
    with pytest.raises(DeltaError, match="have no field 'object'"):
        _run(model, prog, align="facts.object")
    with pytest.raises(DeltaError, match="no sweep of the program measures one number per token"):
        _run(model, _write(tmp_path, RECORDS, program.replace("    measure norm(L6.states)\n", "")),
             align="facts.subject")


def test_the_command_line_checks_and_runs_a_per_token_dataset_sweep(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    prog = _write(tmp_path)
    assert main(["check", str(prog)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["run", str(prog), "--align", "facts.subject[0]"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "s[L=L4] norm(L6.states), per token from facts.subject[0]" in printed
    assert "  facts.subject[0] + 1 " in printed


def test_results_objects_show_a_few_lines_and_give_the_csvs_rows_as_a_frame(model: Any, tmp_path: Path) -> None:
    program = ('dataset facts = "facts.jsonl"\nsweep a on facts over L in L[4,5], t in facts.subject, -1 method '
               'attribution steps 0 refine 1 {\n    write L.state_after(t) = zeros\n    measure prob(" Paris")\n}\n')
    prog = _write(tmp_path, RECORDS, program)
    got = _run(model, prog, out=tmp_path / "a")
    text = repr(got)
    assert text.startswith("<DatasetAttribution: sweep a (L: 2 x t: 2) over 3 of 3 records of 'facts'")
    assert len(text.splitlines()) <= 4
    with (tmp_path / "a" / "results.csv").open() as f:
        reader = csv.reader(f)
        header, lines = next(reader), list(reader)
    frame = got.to_pandas()
    assert list(frame.columns) == header and len(frame) == len(lines)
    assert [float(x) for x in frame["value"]] == pytest.approx([float(line[-1]) for line in lines])
