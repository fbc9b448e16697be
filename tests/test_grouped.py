"""A sweep over a dataset grouped by a field (`--by`, `DatasetSweepResults.by`, `sweep.grouped`): head roles.

The grouped means are checked against transformers' own forward with the head's state written by hand in its
cache (`reference.Reference`), each group holding one record; the bookkeeping (groups ordered by number, a
trace as its own row, the CSV and heatmap, the refusals) on rows made here.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from reference import Write
from test_cli import cli

import deltalang
from deltalang.ground.errors import DeltaError
from deltalang.models.bundled import PATH as BUNDLED
from deltalang.models.bundled import world
from deltalang.sweep.dataset import run_dataset_sweep
from deltalang.sweep.grouped import group_by
from deltalang.sweep.plots import curves

bundled = pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")

ROOT = Path(__file__).parents[1]
HEADS = (0, 2)
PROGRAM = """dataset hay = "hay.jsonl"

trace clean on hay {
    measure prob(hay.answer)
}

sweep memory on hay over h in heads[0,2] {
    write L2.state_after(-6).head(h) = zeros
    measure prob(hay.answer)
}
"""


def rows(records: list[tuple[str, str, float]]) -> list[dict[str, object]]:
    """Rows as a dataset sweep keeps them: (distance, head label, value) each, one record per row."""
    return [{"record": i, "line": i + 1, "prompt": "p", "distance": d, "sweep": "s", "h": h, "measure": "prob(x)",
             "value": v} for i, (d, h, v) in enumerate(records)]


def test_groups_are_ordered_by_number_and_hold_their_records_means() -> None:
    got = group_by(rows([("53", "0", 0.25), ("11", "0", 1.0), ("53", "0", 0.75), ("11", "1", 0.5)]), "hay.distance",
                   "hay", ("prompt", "distance"), ("s",))
    assert got.groups == ("11", "53")  # "11" < "53" as numbers; "100" would come last, not between
    labels, grid = got.grid("s", "prob(x)")
    assert labels == ["h=0", "h=1"]
    assert grid[0] == [1.0, 0.5] and grid[1][0] == 0.5 and math.isnan(grid[1][1])
    assert group_by(rows([("9", "0", 1.0), ("100", "0", 1.0)]), "distance", "hay", ("prompt", "distance"),
                    ("s",)).groups == ("9", "100")
    assert group_by(rows([("far", "0", 1.0), ("near", "0", 1.0), ("9", "0", 1.0)]), "distance", "hay",
                    ("prompt", "distance"), ("s",)).groups == ("far", "near", "9")  # not all numbers: as they came


def test_curves_draw_a_line_per_cell_and_each_baseline_dashed(tmp_path: Path) -> None:
    import matplotlib.figure

    seen: dict[str, object] = {}
    original = matplotlib.figure.Figure.savefig

    def spy(fig: matplotlib.figure.Figure, *a: object, **k: object) -> None:
        ax = fig.axes[0]
        seen.update(lines=[(ln.get_label(), list(ln.get_ydata()), ln.get_linestyle()) for ln in ax.get_lines()],
                    ylim=ax.get_ylim(), ticks=[t.get_text() for t in ax.get_xticklabels()])
        original(fig, *a, **k)

    matplotlib.figure.Figure.savefig = spy  # type: ignore[method-assign]
    try:
        path = curves(["11", "53"], {"h=0": [1.0, 0.5], "h=2": [0.25, 0.0]}, "t", "distance", "p",
                      tmp_path / "c.png", baselines={"clean": [1.0, 1.0]}, kind="prob")
    finally:
        matplotlib.figure.Figure.savefig = original  # type: ignore[method-assign]
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert seen["lines"] == [("h=0", [1.0, 0.5], "-"), ("h=2", [0.25, 0.0], "-"), ("clean", [1.0, 1.0], "--")]
    assert seen["ylim"] == (-0.02, 1.02) and seen["ticks"] == ["11", "53"]


def test_a_field_the_records_lack_is_one_error_naming_theirs() -> None:
    with pytest.raises(DeltaError, match=r"--by hay.depth: the records of 'hay' have no field 'depth' \(they have "
                                         r"prompt, distance\)"):
        group_by(rows([("11", "0", 1.0)]), "hay.depth", "hay", ("prompt", "distance"), ("s",))


def test_the_haystack_file_is_the_worlds() -> None:
    """examples/data/haystack.jsonl is `world.haystacks(4)`: 59 tokens each, the needle's value `distance` tokens
    before the question's last token, and no other pair holds the answer."""
    lines = (ROOT / "examples" / "data" / "haystack.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    assert records == world.haystacks(4)
    tok = world.build_tokenizer()
    for r in records:
        ids = tok(r["prompt"]).input_ids
        at = len(ids) - 1 - int(r["distance"])
        assert len(ids) == 59 and tok.decode(ids[at - 3:at + 1]) == f" {r['key']} value:{r['answer']}"
        assert [v for k, v in world.recall_pairs(r["prompt"]) if " " + v == r["answer"]] == \
               [v for k, v in world.recall_pairs(r["prompt"]) if k == r["key"]]


@pytest.fixture
def hay(tmp_path: Path) -> Path:
    """Two haystacks, the needle 53 and 11 tokens before the question: a group of one record each."""
    records = world.haystacks(1)
    (tmp_path / "hay.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (records[0], records[-1])))
    (tmp_path / "roles.dl").write_text(PROGRAM)
    return tmp_path


def head_zeroed(ref, text: str, answer: str, head: int) -> float:
    """P(answer) with block 2's state after token -6 zeroed in head `head` of transformers' cache, continued."""
    tok = world.build_tokenizer()
    ids = tok(text, return_tensors="pt").input_ids

    def zero_head(x: torch.Tensor, i: int) -> torch.Tensor:
        x = x.clone()
        x[:, head] = 0
        return x

    record = ref.run(ids, [Write(2, "state_after", zero_head, ids.shape[1] - 6)])
    logits = record.value(None, "logits")[0, -1].float()
    return float(logits.softmax(-1)[tok(answer, add_special_tokens=False).input_ids[0]])


@bundled
def test_each_groups_mean_is_transformers_with_the_heads_state_zeroed(hay: Path, ref) -> None:
    out = run_dataset_sweep(PROGRAM, deltalang.load_model(), filename=str(hay / "roles.dl"), by="hay.distance",
                            progress=False)
    grouped = out.by("distance")
    assert grouped.groups == ("11", "53")
    labels, grid = grouped.grid("memory", "prob(hay.answer)")
    assert labels == [f"h={h}" for h in HEADS]
    records = {r["distance"]: r for r in world.haystacks(1)}
    for row, h in zip(grid, HEADS):
        for got, d in zip(row, grouped.groups):
            assert got == pytest.approx(head_zeroed(ref, records[d]["prompt"], records[d]["answer"], h), abs=2e-5)
    assert "memory: prob(hay.answer), mean over records by distance" in out.summary()
    assert grouped.grid("clean", "clean.prob(hay.answer)")[0] == ["clean"]


@bundled
def test_the_command_line_prints_and_writes_the_groups(hay: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(hay)
    rc, out, err = cli("sweep", "roles.dl", "--by", "hay.distance", "--out", "out")
    assert rc == 0, err
    assert "memory: prob(hay.answer), mean over records by distance (cells down, distance across; n >= 1)" in out
    assert (hay / "out" / "memory-prob_hay_answer-by-distance.png").stat().st_size > 0
    assert (hay / "out" / "memory-prob_hay_answer-by-distance-curves.png").stat().st_size > 0  # 2 cells: curves
    with open(hay / "out" / "by-distance.csv", newline="") as f:
        saved = list(csv.DictReader(f))
    assert {(r["sweep"], r["h"], r["distance"]) for r in saved} >= {("memory", "0", "11"), ("memory", "2", "53")}
    rc, _, err = cli("sweep", "roles.dl", "--by", "hay.depth")
    assert rc == 1 and "error: --by hay.depth: the records of 'hay' have no field 'depth'" in err
    assert "Traceback" not in err


def test_by_is_refused_where_it_would_be_ignored(hay: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(hay)
    (hay / "trace.dl").write_text('dataset hay = "hay.jsonl"\ntrace t on hay {\n    measure prob(hay.answer)\n}\n')
    rc, _, err = cli("run", "trace.dl", "--by", "hay.distance")
    assert rc == 1 and "--by hay.distance groups the records in a sweep over a dataset; this program runs over a " \
                       "dataset without a sweep: drop it" in err
    rc, _, err = cli("sweep", "-e", 'sweep s on p over h in heads { write L2.state_after(-1).head(h) = zeros; '
                     'measure prob(" one") }\nprompt p = "key: apple value: one key: apple value:"', "--by", "x")
    assert rc == 1 and "--by x groups the records in a sweep over a dataset; this program runs one prompt" in err


def wrote_files(err: str) -> list[str]:
    """The names the closing `wrote DIR/: a, b, ...` line lists."""
    line = next(x for x in err.splitlines() if x.startswith("wrote "))
    return line.split(": ", 1)[1].split(";")[0].split(", ")


@bundled
def test_the_closing_line_names_the_groups_files_and_every_one_is_there(hay: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(hay)
    rc, _, err = cli("sweep", "roles.dl", "--by", "hay.distance", "--out", "out")
    assert rc == 0, err
    named = wrote_files(err)
    assert {"by-distance.csv", "memory-prob_hay_answer-by-distance.png",
            "memory-prob_hay_answer-by-distance-curves.png"} <= set(named), named
    kept = {"progress.json"}  # the --resume bookkeeping (`dataset_store`), not a result
    assert sorted(named) == sorted(p.name for p in (hay / "out").iterdir() if p.name not in kept), named


@bundled
def test_a_merged_sharded_run_keeps_its_groups(hay: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(hay)
    for k in (0, 1):
        rc, _, err = cli("sweep", "roles.dl", "--by", "hay.distance", "--out", "out", "--shard", f"{k}/2")
        assert rc == 0, err
    rc, merged, err = cli("merge", "out")
    assert rc == 0, err
    whole = run_dataset_sweep(PROGRAM, deltalang.load_model(), filename=str(hay / "roles.dl"), by="hay.distance",
                              progress=False)
    assert "mean over records by distance" in merged
    with open(hay / "out" / "by-distance.csv", newline="") as f:
        saved = {(r["sweep"], r["h"], r["distance"]): float(r["mean"]) for r in csv.DictReader(f)}
    grouped = whole.by("distance")
    labels, grid = grouped.grid("memory", "prob(hay.answer)")
    for label, row in zip(labels, grid):
        for d, mean in zip(grouped.groups, row):
            assert saved[("memory", label.removeprefix("h="), d)] == pytest.approx(mean, rel=1e-6)
    assert (hay / "out" / "memory-prob_hay_answer-by-distance.png").stat().st_size > 0


@bundled
def test_shards_grouped_differently_are_one_error_at_merge(hay: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(hay)
    assert cli("sweep", "roles.dl", "--by", "hay.distance", "--out", "out", "--shard", "0/2")[0] == 0
    assert cli("sweep", "roles.dl", "--out", "out", "--shard", "1/2")[0] == 0
    rc, _, err = cli("merge", "out")
    assert rc == 1 and "error: the shards grouped their records differently (shard-0-of-2: --by hay.distance; " \
                       "shard-1-of-2: no --by)" in err, err


@bundled
def test_the_magic_groups_a_dataset_sweep_by_a_field(hay: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`%%deltalang --by hay.distance` ran the sweep ungrouped: the notebook dropped the option."""
    from deltalang.notebook import run_cell

    monkeypatch.chdir(hay)
    value = run_cell("--by hay.distance --out out", PROGRAM, {})
    assert value.grouped_by == "hay.distance"
    assert "memory: prob(hay.answer), mean over records by distance" in value.summary()
    assert "by-distance.csv" in wrote_files(capsys.readouterr().err) and (hay / "out" / "by-distance.csv").is_file()
