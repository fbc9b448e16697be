"""What a shard's command prints and accepts: its count line (its share of the records), its last line (where it
wrote, how many shards are done, how to merge) for run and sweep alike, a resume of a part that never started,
`--shard -1/2` as one line, and merge's refusals naming what merge accepts (docs/shards.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltalang.cli import main
from deltalang.models.bundled import PATH as BUNDLED
from deltalang.runs.shards import read_rows

ROOT = Path(__file__).parents[1]
LANDMARKS = [json.loads(line) for line in (ROOT / "examples" / "data" / "landmarks.jsonl").read_text().splitlines()]
# 72 records of three lengths: groups of records sharing forwards that split between two shards
MANY = [dict(r, prompt=pre + r["prompt"], corrupt=pre + r["corrupt"])
        for pre in ("", "The city: ", "The city of Paris, ") for r in LANDMARKS]
GENERATE = """dataset facts = "many.jsonl"
generate g on facts max_new_tokens 1 {
    measure prob(facts.answer)
}
"""
COLLECT = """dataset facts = "many.jsonl"
trace t on facts {
    read L1.state_after(-1) as s
}
"""
RUN = """dataset facts = "{data}"
trace t on facts {{
    measure prob(facts.answer)
}}
"""
SWEEP = """dataset facts = "few.jsonl"
sweep s on facts.corrupt over L in L[0,4], t in -1 {
    write L.state_after(t) from facts
    measure logit_diff(facts.answer, facts.foil)
}
"""
pytestmark = pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")


@pytest.fixture()
def base(tmp_path: Path) -> Path:
    for name, records in (("few.jsonl", LANDMARKS[:5]), ("many.jsonl", MANY)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    (tmp_path / "many.dl").write_text(RUN.format(data="many.jsonl"), encoding="utf-8")
    (tmp_path / "few.dl").write_text(RUN.format(data="few.jsonl"), encoding="utf-8")
    (tmp_path / "sweep.dl").write_text(SWEEP, encoding="utf-8")
    (tmp_path / "generate.dl").write_text(GENERATE, encoding="utf-8")
    (tmp_path / "collect.dl").write_text(COLLECT, encoding="utf-8")
    return tmp_path


def _last(err: str) -> str:
    return [line for line in err.splitlines() if line.strip()][-1]


def test_a_shards_count_line_says_its_share(base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = base / "out"
    shares = []
    for k in range(2):
        assert main(["run", str(base / "many.dl"), "--out", str(top), "--shard", f"{k}/2"]) == 0
        out = capsys.readouterr().out.splitlines()
        _, rows = read_rows(top / f"shard-{k}-of-2")
        share = len({r["record"] for r in rows})
        assert 0 < share < len(MANY)  # both shards ran records (whole groups)
        assert out[0] == f"{share} of {len(MANY)} records of 'facts' (shard {k}/2)", out[0]
        assert f" n {share} " in out[1]
        shares.append(share)
    assert sum(shares) == len(MANY)
    assert main(["merge", str(top)]) == 0  # the merged run is the whole run's
    assert capsys.readouterr().out.splitlines()[0] == f"{len(MANY)} of {len(MANY)} records of 'facts'"
    # five records of one length are one group: shard 1/2 takes none, and says so
    assert main(["run", str(base / "few.dl"), "--out", str(base / "few"), "--shard", "1/2"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("shard 1/2 has no records of 'facts' (its 5 records went to the other shards") and \
        out.endswith("nothing ran") and "\n" not in out, out


@pytest.mark.parametrize("program", ["generate", "collect"])
def test_a_generate_or_collection_shard_says_its_share(base: Path, program: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    top = base / "out"
    for k in range(2):
        assert main(["run", str(base / f"{program}.dl"), "--out", str(top), "--shard", f"{k}/2"]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        part = top / f"shard-{k}-of-2"
        index = part / "index.jsonl"
        share = len({r["record"] for r in read_rows(part)[1]}) if program == "generate" else \
            len(index.read_text().splitlines())
        assert 0 < share < len(MANY)
        assert first.startswith(f"{share} of {len(MANY)} records of 'facts' (shard {k}/2)"), first
    assert main(["merge", str(top)]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(
        f"collected {len(MANY)} of {len(MANY)} records" if program == "collect" else f"{len(MANY)} of {len(MANY)}")


def test_run_and_sweep_shards_end_with_where_they_wrote(base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command, program in (("run", "few.dl"), ("sweep", "sweep.dl")):
        top = base / command
        assert main([command, str(base / program), "--out", str(top), "--shard", "0/2"]) == 0
        captured = capsys.readouterr()
        last = _last(captured.err)
        assert last.startswith(f"wrote {top}/shard-0-of-2/ (shard 0/2): results.csv, "), (command, last)
        assert last.endswith(f"1 of 2 shards done; once all are, `deltalang merge {top}`"), (command, last)
        share = len({r["record"] for r in read_rows(top / "shard-0-of-2")[1]})  # a run: one group; a sweep: 3
        assert captured.out.splitlines()[0] == f"{share} of 5 records of 'facts' (shard 0/2)", captured.out


@pytest.mark.parametrize("command,program,k", [("run", "few.dl", 1), ("run", "many.dl", 0), ("sweep", "sweep.dl", 1)])
def test_a_resume_of_a_part_never_started_is_its_start(base: Path, command: str, program: str, k: int,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A job array's failed task is rerun alone with the same --shard and --resume, wherever it failed: also
    before its part started (here in a directory no shard wrote yet)."""
    top = base / "out"
    assert main([command, str(base / program), "--out", str(top), "--shard", f"{k}/2", "--resume"]) == 0, \
        capsys.readouterr().err
    assert (top / f"shard-{k}-of-2" / "done.json").is_file()
    assert main([command, str(base / program), "--out", str(top), "--shard", f"{1 - k}/2"]) == 0
    assert main(["merge", str(top)]) == 0
    # a part that started is still continued, not restarted, and a plain --resume of nothing stays an error
    assert main([command, str(base / program), "--out", str(top), "--shard", f"{k}/2", "--resume"]) == 0
    capsys.readouterr()
    assert main([command, str(base / program), "--out", str(base / "none"), "--resume"]) == 1
    assert "nothing to resume" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--shard", "-1/2"], ["--shard=-1/2"], ["--shard", "-1"]])
def test_a_negative_shard_is_one_line_either_way(base: Path, argv: list[str],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("run", "sweep"):
        assert main([command, str(base / "few.dl"), *argv]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --shard ") and "\n" not in err and "usage" not in err, err


def test_a_merge_refusal_names_what_merge_accepts(base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = base / "out"
    for k in range(2):
        assert main(["run", str(base / "many.dl"), "--out", str(top), "--shard", f"{k}/2"]) == 0
    done = top / "shard-0-of-2" / "done.json"
    done.write_text(json.dumps(dict(json.loads(done.read_text()), program_sha256="0" * 64)))  # another program's
    capsys.readouterr()
    assert main(["merge", str(top)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "another program" in err, err
    assert "give another --out" not in err  # merge has no --out: it takes DIR
    assert "`deltalang merge DIR`" in err and "rerun shard 0/2" in err and "move shard-0-of-2 out" in err, err
