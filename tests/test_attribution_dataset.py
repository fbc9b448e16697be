"""Attribution sweeps over a dataset, and attribution with a mean source, against plain transformers.

Ground truth (`tests/reference.py`, the bundled model in float32): a record's exact effect in a cell
is its corrupt run's cache state after token t written into its clean run's cache, M(patched) -
M(clean), with t found by the tokenizer's offsets (not by deltalang); a record's `plain` estimate
is <dM/dS, S' - S> with dM/dS taken by torch autograd through that same transformers run (the
written state a leaf). Refined cells' exact means must be those effects averaged over the records;
a cell's estimate is the mean of its records' estimates; what the dataset cannot give is one line
or `plain` alone, as over one prompt.
"""

from __future__ import annotations

import csv
import json
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import reference
import torch
from reference import Reference, Write, set_to
from test_cli import cli, one_error_line

import deltalang
from deltalang.ground.errors import DeltaError
from deltalang.models.bundled import PATH as BUNDLED
from deltalang.runs.dataset_run import stats_of
from deltalang.sweep.attribution_dataset import DatasetAttribution

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")]

ROOT = Path(__file__).parents[1]
RECORDS = [json.loads(line) for line in (ROOT / "examples" / "data" / "landmarks.jsonl").read_text().splitlines()]
SWEEP = """dataset facts = "facts.jsonl"
sweep s on facts over L in L[linear], t in facts.subject, -1 method attribution{options} {{
    write L.state_after(t) from facts.corrupt
    measure logit_diff(facts.answer, facts.foil)
}}
"""
MEASURE = "logit_diff(facts.answer, facts.foil)"


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


def _program(tmp_path: Path, records: list[dict[str, str]], options: str = " steps 2 refine 3") -> Path:
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    f = tmp_path / "x.dl"
    f.write_text(SWEEP.format(options=options), encoding="utf-8")
    return f


def _token(tok: Any, r: dict[str, str], label: str) -> int:
    """The token of `r`'s prompt a position label names, by the tokenizer's offsets."""
    enc = tok(r["prompt"], return_offsets_mapping=True)
    if label == "-1":
        return len(enc["input_ids"]) - 1
    assert label == "facts.subject"
    end = r["prompt"].index(r["subject"]) + len(r["subject"])
    return max(i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a < end)


def _ids(tok: Any, text: str) -> torch.Tensor:
    return tok(text, return_tensors="pt").input_ids


def _diff(rec: Any, a: int, b: int) -> torch.Tensor:
    logits = rec.value(None, "logits")[0, -1].float()
    return logits[a] - logits[b]


@contextmanager
def _differentiable(ref: Reference) -> Iterator[None]:
    """The reference's run with autograd on. transformers' cache copies each new state into one buffer in
    place (static addresses for CUDA graphs), which autograd cannot go back through; storing it by
    assignment holds the same values."""
    from transformers import cache_utils

    class Torch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    grad_torch = Torch("torch")
    grad_torch.no_grad = torch.enable_grad  # type: ignore[attr-defined]
    layer = cache_utils.LinearAttentionLayer
    copy = layer.update_recurrent_state

    def assign(self: Any, states: torch.Tensor, state_idx: int = 0, **kw: Any) -> torch.Tensor:
        if not self.is_recurrent_states_initialized[state_idx]:
            self.lazy_initialization(recurrent_states=states, state_idx=state_idx)
        self.recurrent_states[state_idx] = states
        return states

    reference.torch, layer.update_recurrent_state = grad_torch, assign  # type: ignore[attr-defined,method-assign]
    try:
        yield
    finally:
        reference.torch, layer.update_recurrent_state = torch, copy  # type: ignore[attr-defined,method-assign]


def _autograd_estimate(ref: Reference, ids: torch.Tensor, layer: int, pos: int, here: torch.Tensor,
                       delta: torch.Tensor, a: int, b: int) -> float:
    """<dM/dS, delta>, S the state after token `pos` of block `layer` (at its clean value `here`)."""
    s = here.detach().clone().float().requires_grad_(True)
    with _differentiable(ref):
        rec = ref.run(ids, [Write(layer, "state_after", set_to(s), position=pos)])
    (g,) = torch.autograd.grad(_diff(rec, a, b), s)
    return float((g * delta.float()).sum())


def test_refined_cells_and_estimates_over_a_dataset_equal_transformers(
        model: deltalang.DeltaModel, ref: Reference, tmp_path: Path) -> None:
    records = RECORDS[:3]
    out = deltalang.run(SWEEP.format(options=" steps 2 refine 3"), model, data={"facts": records},
                        out=tmp_path / "out")
    assert isinstance(out, DatasetAttribution)
    assert out.variants == ("plain", "blk2") and out.default == "blk2" and not out.skipped
    tok = model.tokenizer
    linear = model.spec.linear_layers()
    assert out.axes == (("L", tuple(f"L{b}" for b in linear)), ("t", ("facts.subject", "-1")))
    refined = out.refined()
    assert len(refined) == 3 and all(c.exact is not None and c.exact.n == 3 for c in refined)
    # the refined cells are the 3 of largest |mean default estimate|
    others = [abs(c.estimates["blk2"].mean) for c in out.cells if c.exact is None]
    assert min(abs(c.estimates["blk2"].mean) for c in refined) >= max(others)
    runs = []
    for r in records:
        a, b = (tok(r[k]).input_ids[0] for k in ("answer", "foil"))
        ids = _ids(tok, r["prompt"])
        runs.append((r, a, b, ids, ref.run(ids), ref.run(_ids(tok, r["corrupt"]))))
    checked = 0
    for c in refined:
        point = dict(c.point)
        block = int(point["L"][1:])
        want = []
        for r, a, b, ids, clean, corrupt in runs:
            pos = _token(tok, r, point["t"])
            patch = Write(block, "state_after", set_to(corrupt.value(block, "state_after", pos)), position=pos)
            want.append(float(_diff(ref.run(ids, [patch]), a, b) - _diff(clean, a, b)))
        got = out.values(point, variant="exact")
        assert got == pytest.approx(want, abs=2e-3), (point, got, want)
        assert c.exact is not None and c.exact.mean == pytest.approx(sum(want) / len(want), abs=2e-3)
        checked += max(abs(w) for w in want) > 1.0
    assert checked >= 1  # the refined effects are not all ~0
    # each record's plain estimate is <dM/dS, S' - S> by autograd on transformers
    for block in (linear[1], 4, 5):
        for label in ("facts.subject", "-1"):
            got = out.values({"L": f"L{block}", "t": label}, variant="plain")
            for k, (r, a, b, ids, clean, corrupt) in enumerate(runs):
                pos = _token(tok, r, label)
                here = clean.value(block, "state_after", pos)
                delta = corrupt.value(block, "state_after", pos).float() - here.float()
                want_plain = _autograd_estimate(ref, ids, block, pos, here, delta, a, b)
                assert got[k] == pytest.approx(want_plain, rel=1e-3, abs=1e-4), (block, label, k)
    # a cell's estimate is the mean of its records' (with their spread)
    for c in out.cells:
        for v in out.variants:
            vals = out.values(dict(c.point), variant=v)
            assert len(vals) == 3 and c.estimates[v] == stats_of(MEASURE, vals)
    assert out.grid()[("L4", "-1")] == pytest.approx(sum(out.values({"L": "L4", "t": "-1"})) / 3)
    # results.csv keeps every record's estimates and exact effects, a column saying which
    rows = list(csv.DictReader((tmp_path / "out" / "results.csv").open(encoding="utf-8")))
    assert len(rows) == 3 * len(linear) * 2 * 2 + 3 * 3
    assert {r["variant"] for r in rows} == {"plain", "blk2", "exact"}
    assert {"record", "line", "prompt", "subject", "L", "t", "measure", "variant", "value"} <= set(rows[0])
    summary = list(csv.DictReader((tmp_path / "out" / "summary.csv").open(encoding="utf-8")))
    assert len(summary) == len(linear) * 2 * 2 + 3
    assert (tmp_path / "out" / "summary.json").exists() and (tmp_path / "out" / "program.dl").exists()
    text = out.summary()
    assert text.startswith("3 of 3 records of 'facts'") and "exact" in text and "blk2" in text


def test_the_command_line_runs_it_and_refuses_what_it_cannot(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    """`deltalang run` and `deltalang sweep` (this replaces the refusal of attribution over a dataset)."""
    f = _program(tmp_path, RECORDS[:2], options=" steps 0 refine 1")
    rc, out, err = cli("run", f)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "2 of 2 records of 'facts'"
    assert lines[2].split() == ["L", "t", "measure", "plain", "exact", "n"]
    assert sum(1 for x in lines[3:] if len(x.split()) == 7) == 1  # one refined cell: its exact column filled
    # --attribution on an exact program, the flags over it; --out
    (tmp_path / "x.dl").write_text(SWEEP.format(options="").replace(" method attribution", ""), encoding="utf-8")
    rc, out, err = cli("sweep", f, "--attribution", "--steps", "1", "--refine", "2", "--out", tmp_path / "o")
    assert rc == 0, err
    assert out.splitlines()[2].split() == ["L", "t", "measure", "plain", "blk1", "exact", "n"]
    assert (tmp_path / "o" / "results.csv").exists()
    for flags, message in ((["--resume", "--out", tmp_path / "o"], "--resume: not an option of a sweep by attribution"),
                           (["--normalise", "clean=facts,corrupted=facts.corrupt"],
                            "--normalise: not an option of a sweep by attribution")):
        rc, _, err = cli("sweep", f, "--attribution", *flags)
        assert rc == 1 and message in one_error_line(err)


def test_records_left_out_and_donors_of_another_length(model: deltalang.DeltaModel) -> None:
    bad = dict(RECORDS[1], subject="Moon Base")  # not in its prompt: left out, counted
    longer = dict(RECORDS[2], corrupt="The Big " + RECORDS[2]["corrupt"][4:])  # a donor of another length
    tok = model.tokenizer
    assert len(tok(longer["corrupt"]).input_ids) != len(tok(longer["prompt"]).input_ids)
    out = deltalang.run(SWEEP.format(options=" steps 0"), model, data={"facts": [RECORDS[0], bad, RECORDS[3]]})
    assert isinstance(out, DatasetAttribution)
    assert [i for i, _ in out.skipped] == [1] and "Moon Base" in out.skipped[0][1]
    assert {r["record"] for r in out.rows} == {0, 2} and all(c.estimates["plain"].n == 2 for c in out.cells)
    assert "left out 1 of 3 records" in out.summary()
    with pytest.raises(DeltaError, match=r"row 2: record 2 of 'facts' does not resolve \(--strict\)"):
        deltalang.run(SWEEP.format(options=" steps 0"), model, data={"facts": [RECORDS[0], bad]}, strict=True)
    # steps asked for: a donor of another length is one line naming its record, before anything runs
    data = {"facts": [RECORDS[0], longer]}
    with pytest.raises(DeltaError) as e:
        deltalang.run(SWEEP.format(options=" steps 2"), model, data=data)
    assert "record 2" in str(e.value) and "the clean prompt's length" in str(e.value) and "\n" not in str(e.value)
    # steps not said: plain for every record (as one prompt without a path), and a note says why
    out = deltalang.run(SWEEP.format(options=""), model, data=data)
    assert isinstance(out, DatasetAttribution) and out.variants == ("plain",) and "record 2" in out.note
    assert out.note in out.summary()
    alone = deltalang.run(SWEEP.format(options=" steps 0"), model, data={"facts": [RECORDS[0]]})
    assert isinstance(alone, DatasetAttribution)
    first = [r["value"] for r in out.rows if r["record"] == 0]
    assert first == pytest.approx([r["value"] for r in alone.rows], rel=1e-5, abs=1e-6)  # its own program's
    # the same records, all with a path, take the default steps
    out = deltalang.run(SWEEP.format(options=""), model, data={"facts": RECORDS[:2]})
    assert isinstance(out, DatasetAttribution) and out.variants == ("plain", "blk2") and not out.note  # a donor: k = 2


def test_a_mean_source_refines_to_mean_patching_in_transformers(model: deltalang.DeltaModel, ref: Reference) -> None:
    """One prompt, `= mean(foods)` at positions from the end: each food prompt's state at its own n - k."""
    clean = "The Eiffel Tower is in the city of"
    foods = ["My favourite food is pizza with", "My favourite food in the whole world is a"]
    src = (f'prompt clean = "{clean}"\nprompts foods = [{", ".join(json.dumps(x) for x in foods)}]\n'
           "sweep s on clean over L in L[linear], t in -3..0 method attribution refine 3 {\n"
           "    write L.state_after(t) = mean(foods)\n"
           '    measure logit_diff(" Paris", " Pisa")\n}\n')
    got = deltalang.run_sweep(src, model)
    assert got.variants == ["plain"]  # a mean has no path: plain, as documented
    tok = model.tokenizer
    ids = _ids(tok, clean)
    n = ids.shape[1]
    lengths = [len(tok(x).input_ids) for x in foods]
    assert lengths[0] != lengths[1]
    a, b = tok(" Paris").input_ids[0], tok(" Pisa").input_ids[0]
    base = ref.run(ids)
    runs = [ref.run(_ids(tok, x)) for x in foods]
    refined = got.refined()
    assert len(refined) == 3
    for r in refined:
        back = n - r.position  # the position counted from the end, in each food prompt
        mean = torch.stack([f.value(r.block, "state_after", m - back).float() for f, m in zip(runs, lengths)]).mean(0)
        here = base.value(r.block, "state_after", r.position)
        patch = Write(r.block, "state_after", set_to(mean.to(here.dtype)), position=r.position)
        exact = float(_diff(ref.run(ids, [patch]), a, b) - _diff(base, a, b))
        assert r.exact == pytest.approx(exact, abs=2e-3), (r.block, r.position, r.exact, exact)
        plain = _autograd_estimate(ref, ids, r.block, r.position, here, mean - here.float(), a, b)
        assert r.estimates["plain"] == pytest.approx(plain, rel=1e-3, abs=1e-4)
    assert max(abs(r.exact or 0.0) for r in refined) > 0.1  # the patches do something
