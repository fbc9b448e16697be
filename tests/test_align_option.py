"""`align=` through `deltalang.run` and `--align` refused where nothing would use it.

Ground truth for the pass-through: each record run alone in plain transformers (`tests/reference.Reference`)
with the cell's write applied by hand (L4's state after the subject's last token zeroed), the norm of L6's
state after the subject's last token taken from that forward's cache; the subject's tokens found with the
tokenizer's offsets, not deltalang's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from reference import Reference, Write, zeros

import deltalang
from deltalang.cli import main
from deltalang.ground.errors import DeltaError
from deltalang.models.testing import load_hf

RECORDS = [
    {"prompt": "The Eiffel Tower is in the city of", "subject": "Eiffel Tower"},
    {"prompt": "Everyone knows that the Leaning Tower is in the city of", "subject": "Leaning Tower"},
]
SWEEP = """dataset facts = "facts.jsonl"
sweep s on facts over L in L[4] {
    write L.state_after(facts.subject) = zeros
    measure norm(L6.states)
}
"""
MEASURE = "norm(L6.states)"

pytestmark = pytest.mark.usefixtures("one_thread")


def _write(tmp_path: Path, program: str) -> Path:
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    (tmp_path / "x.dl").write_text(program, encoding="utf-8")
    return tmp_path / "x.dl"


def _subject_last(model: Any, r: dict[str, str]) -> int:
    enc = model.tokenizer(r["prompt"], return_offsets_mapping=True)
    start = r["prompt"].index(r["subject"])
    end = start + len(r["subject"])
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a < end and b > start][-1]


def test_run_passes_align_to_the_dataset_sweep(tmp_path: Path) -> None:
    from deltalang.models.bundled import PATH

    model = deltalang.load_model()
    prog = _write(tmp_path, SWEEP)
    out = deltalang.run(prog.read_text(), model, filename=str(prog), align="facts.subject")
    ref = Reference(load_hf(PATH))
    for i, r in enumerate(RECORDS):
        subject = _subject_last(model, r)
        ids = model.tokenizer(r["prompt"], return_tensors="pt").input_ids
        states = ref.run(ids, [Write(4, "state_after", zeros, position=subject)]).value(6, "states")[0].float()
        rows = [x for x in out.rows if x["record"] == i and x["measure"] == MEASURE]
        at = [x for x in rows if x["position"] == "facts.subject"]
        assert len(at) == 1 and at[0]["token"] == subject, rows
        assert at[0]["value"] == pytest.approx(float(states[subject].norm()), rel=1e-4, abs=1e-5)
        assert {x["position"] for x in rows if x["token"] == subject + 1} == {"facts.subject + 1"}


def test_align_outside_a_sweep_over_a_dataset_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    one = 'prompt p = "The Eiffel Tower is in"\ntrace t on p { measure norm(L6.states) }\n'
    with pytest.raises(DeltaError, match="align='facts.subject' counts a per-token measure's positions in a sweep "
                                         "over a dataset; this program runs one prompt"):
        deltalang.run(one, align="facts.subject")
    plain = SWEEP.replace("sweep s on facts over L in L[4] {", "trace t on facts {").replace("L.state_after",
                                                                                           "L4.state_after")
    prog = _write(tmp_path, plain)
    with pytest.raises(DeltaError, match="align= applies to sweeps"):
        deltalang.run(prog.read_text(), filename=str(prog), align="facts.subject")
    for program, what in [(plain, "runs over a dataset without a sweep"), (one, "runs one prompt"),
                          (one.replace("trace t on p { measure", "sweep s on p over L in L[4] { write L.state_output "
                                       "= zeros\nmeasure"), "runs one prompt")]:
        prog = _write(tmp_path, program)
        for cmd in ("run", "sweep"):
            if cmd == "sweep" and "sweep" not in program:
                continue
            code = main([cmd, str(prog), "--align", "facts.subject"])
            err = capsys.readouterr().err
            assert code != 0 and f"--align facts.subject counts a per-token measure's positions in a sweep over a " \
                                  f"dataset; this program {what}: drop it" in err, err
