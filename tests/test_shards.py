"""Runs over a dataset split across processes (`--shard`, torchrun) and merged, against the one-process run.

The split (`deltalang.runs.shards.split`) is checked against its definition (each unit, the most tokens first,
to the shard with the fewest tokens so far). A dataset run, a collection and a generate over 72 records
(records share forwards in groups of up to 32), a dataset sweep and an attribution with refine (two phases)
run as 2 and 3 processes under `torchrun --nproc_per_node` on this CPU (each process its shard from
RANK/WORLD_SIZE, no collective), merged by `deltalang merge`, must give exactly what the one-process run
gives: the same bytes in every file and every collected tensor `torch.equal`, since a shard runs whole
groups of records, each record sharing its forward with the same records as in one process (a record in
a left-padded forward of others differs from itself alone in float32 rounding). The merge itself is exact:
its rows are the parts' rows, its statistics `stats_of` over them. A killed shard resumes (a collection
too, its group rerun whole); a missing or mismatched shard is one line.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deltalang
from deltalang.cli import main
from deltalang.ground.errors import DeltaError
from deltalang.models.bundled import PATH as BUNDLED
from deltalang.runs.collection import load_results as load_saved
from deltalang.runs.dataset_run import run_dataset, stats_of
from deltalang.runs.shards import Shard, from_env, launch_device, read_rows, shard_of, split

ROOT = Path(__file__).parents[1]
LANDMARKS = [json.loads(line) for line in (ROOT / "examples" / "data" / "landmarks.jsonl").read_text().splitlines()]
RECORDS = LANDMARKS[:5]
# 72 records of several lengths: more than one group of records sharing forwards (`records.MAX_GROUP`, 32)
MANY = [dict(r, prompt=pre + r["prompt"], corrupt=pre + r["corrupt"])
        for pre in ("", "The city: ", "The city of Paris, ") for r in LANDMARKS]
PROGRAMS = {
    "run": """dataset facts = "many.jsonl"
trace t on facts {
    measure logit_diff(facts.answer, facts.foil)
    measure prob(facts.answer)
}
""",
    "collect": """dataset facts = "many.jsonl"
trace t on facts {
    read L[linear].state_after(facts.subject) as s
    read L1.states
    measure prob(facts.answer)
}
""",
    "sweep": """dataset facts = "facts.jsonl"
sweep s on facts.corrupt over L in L[0,4], t in facts.subject, -1 {
    write L.state_after(t) from facts
    measure logit_diff(facts.answer, facts.foil)
}
""",
    "generate": """dataset facts = "many.jsonl"
generate g on facts max_new_tokens 2 {
    measure prob(facts.answer)
}
""",
    "refine": """dataset facts = "facts.jsonl"
sweep s on facts over L in L[linear], t in facts.subject, -1 method attribution steps 2 refine 3 {
    write L.state_after(t) from facts.corrupt
    measure logit_diff(facts.answer, facts.foil)
}
""",
}
COMMAND = {"run": "run", "collect": "run", "sweep": "sweep", "generate": "run", "refine": "sweep"}
FILES = ("results.csv", "summary.csv", "summary.json", "program.dl")
MERGED = {"generate": ("results.csv", "continuations.jsonl", "summary.csv", "summary.json", "program.dl"),
          "collect": (*FILES, "collection.json")}
needs_model = pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")

# each process of a torchrun job: each command line, its shard from RANK/WORLD_SIZE (no --shard given)
WORKER = """import json, sys
from deltalang.cli import main
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    if code:
        sys.exit(code)
"""


# ---- the split -----------------------------------------------------------------------------------


def test_the_split_is_greedy_by_tokens_deterministic_and_balanced() -> None:
    rng = random.Random(7)
    for _ in range(20):
        tokens = [rng.randint(1, 200) for _ in range(rng.randint(1, 60))]
        for n in (1, 2, 3, 5, 8):
            got = split(tokens, n)
            assert got == split(list(tokens), n)  # a function of the tokens and N only
            load = [0] * n
            order = sorted(range(len(tokens)), key=lambda i: (-tokens[i], i))  # the most tokens first
            for i in order:  # the definition: to the least-loaded, lowest on a tie
                k = got[i]
                assert load[k] == min(load) and k == load.index(min(load))
                load[k] += tokens[i]
            assert max(load) - min(load) <= max(tokens)  # within one unit's tokens

    tokens = [100, 1] * 10  # dealt out one by one, shard 0 would get every long unit
    load = [sum(t for t, k in zip(tokens, split(tokens, 2)) if k == j) for j in range(2)]
    assert abs(load[0] - load[1]) <= 1 and sum(load) == sum(tokens)


def test_a_shard_is_named_given_or_from_a_launcher() -> None:
    assert shard_of("1/3") == shard_of((1, 3)) == Shard(1, 3)
    assert Shard(1, 3).name == "shard-1-of-3"
    for bad in ("3/3", "-1/2", "1", "a/b", "0/0"):
        with pytest.raises(DeltaError) as e:
            shard_of(bad)
        assert "\n" not in str(e.value.message)
    assert from_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}) == Shard(2, 4)
    assert from_env({"RANK": "0", "WORLD_SIZE": "1"}) is None and from_env({}) is None
    assert launch_device(8, {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == "cuda:1"
    assert launch_device(2, {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}) == "cuda:1"  # GPUs shared
    assert launch_device(0, {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) is None  # no GPU: the CPU
    assert launch_device(8, {"LOCAL_RANK": "1"}) is None


# ---- torchrun on the CPU, merged, against one process ----------------------------------------------


def _programs(tmp: Path) -> Path:
    base = tmp / "programs"
    base.mkdir(parents=True, exist_ok=True)
    for name, records in (("facts.jsonl", RECORDS), ("many.jsonl", MANY)):
        (base / name).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    for name, text in PROGRAMS.items():
        (base / f"{name}.dl").write_text(text, encoding="utf-8")
    return base


def _torchrun(base: Path, argvs: list[list[str]], n: int) -> None:
    script = base / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    got = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                          str(script), json.dumps(argvs)], capture_output=True, text=True, env=env, timeout=900)
    assert got.returncode == 0, got.stderr[-3000:]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> object:
    """torchrun starts its processes with OMP_NUM_THREADS=1; another thread count sums float32 products in
    another order (values 1e-6 apart on this model), so this process computes with one thread too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The programs' outputs: 1 (one process, no shard), 2 and 3 (torchrun, before merging). The refine runs as 2
    processes only, in two phases: estimates, then `--refine-from` (two torchrun jobs)."""
    tmp = tmp_path_factory.mktemp("shards")
    base = _programs(tmp)
    outs = {1: tmp / "one"}
    for name, command in COMMAND.items():
        assert main([command, str(base / f"{name}.dl"), "--out", str(tmp / "one" / name)]) == 0
    for n in (2, 3):
        outs[n] = tmp / f"torchrun{n}"
        _torchrun(base, [[command, str(base / f"{name}.dl"), "--out", str(outs[n] / name)]
                         for name, command in COMMAND.items() if n == 2 or name != "refine"], n)
    _torchrun(base, [["sweep", str(base / "refine.dl"), "--refine-from", str(outs[2] / "refine")]], 2)
    return outs


def _names(n: int) -> list[str]:
    return [name for name in COMMAND if n == 2 or name != "refine"]


def _merge_is_exact(top: Path, n: int) -> None:
    """The merged rows are the parts' rows in record order; its statistics are `stats_of` over them, exactly."""
    parts = [r for k in range(n) for r in read_rows(top / f"shard-{k}-of-{n}")[1]]
    rows = read_rows(top)[1]
    assert rows == sorted(parts, key=lambda r: int(r["record"]))
    for m in json.loads((top / "summary.json").read_text())["measures"]:  # a generate's: per measure and step
        want = stats_of(m["measure"], [r["value"] for r in rows if r["measure"] == m["measure"]
                                       and str(r.get("step", "")) == str(m.get("step", ""))])
        assert [m[k] for k in ("mean", "std", "n", "ci_low", "ci_high")] == \
            [getattr(want, k) for k in ("mean", "std", "n", "ci_low", "ci_high")]


def _same_collection(a: Path, b: Path) -> None:
    """Every collected tensor equal (`torch.equal`), the index's records and measures the same."""
    one, merged = deltalang.load_results(a), deltalang.load_results(b)
    assert len(one) == len(merged) == len(MANY) and one.labels == merged.labels
    for i in range(len(one)):
        (ra, va), (rb, vb) = one[i], merged[i]
        assert ra == rb and va.keys() == vb.keys()
        for k in va:
            assert torch.equal(va[k], vb[k]), (i, k)
    assert torch.equal(one.stack("s"), merged.stack("s"))
    cols = ["shard", "row"]
    assert one.to_pandas().drop(columns=cols).equals(merged.to_pandas().drop(columns=cols))


@needs_model
@pytest.mark.parametrize("n", [2, 3])
def test_torchrun_processes_merged_equal_one_process(runs: dict[int, Path], n: int,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    for name in _names(n):
        top = runs[n] / name
        parts = sorted(p.name for p in top.iterdir() if p.is_dir())
        assert parts == [f"shard-{k}-of-{n}" for k in range(n)]
        meta = json.loads((top / "shards.json").read_text())
        assert meta["n"] == n and "merged" not in meta
        with pytest.raises(DeltaError, match="not merged"):  # the parts alone are not results
            load_saved(top)
        assert main(["merge", str(top)]) == 0
        for f in MERGED.get(name, FILES):  # every record's forward shared with the same records: the same bytes
            if f != "collection.json":
                assert (top / f).read_bytes() == (runs[1] / name / f).read_bytes(), (name, f)
        if name in ("run", "collect", "generate"):
            _merge_is_exact(top, n)
    _same_collection(runs[1] / "collect", runs[n] / "collect")
    table = deltalang.load_results(runs[n] / "sweep").to_pandas()
    assert sorted(set(table["record"])) == list(range(len(RECORDS)))
    if n == 2:
        exact = deltalang.load_results(runs[n] / "refine").to_pandas()
        assert (exact["variant"] == "exact").sum() >= 3 * len(RECORDS)  # the top 3 cells, on every record


@needs_model
def test_python_runs_the_two_phases_of_a_sharded_refine(runs: dict[int, Path], tmp_path: Path) -> None:
    """`deltalang.run(..., shard=, refine_from=)` as `--refine-from` (run() had no refine_from=): the two phases in
    this process, merged, give the one-process run's files byte for byte; a one-prompt program refuses it."""
    base = runs[1].parent / "programs"
    source, top = (base / "refine.dl").read_text(encoding="utf-8"), tmp_path / "py"
    model = deltalang.load_model()
    here = os.getcwd()
    os.chdir(base)  # the program's dataset line is relative
    try:
        for k in range(2):
            deltalang.run(source, model, filename=str(base / "refine.dl"), shard=(k, 2), out=top)
        for k in range(2):
            deltalang.run(source, model, filename=str(base / "refine.dl"), shard=(k, 2), refine_from=top)
    finally:
        os.chdir(here)
    assert main(["merge", str(top)]) == 0
    for f in FILES:
        assert (top / f).read_bytes() == (runs[1] / "refine" / f).read_bytes(), f
    with pytest.raises(DeltaError) as e:
        deltalang.run('prompt p = "The Eiffel Tower is in"\ntrace t on p { read logits }\n', model,
                      refine_from=top)
    assert "refine_from= applies to a program over a dataset" in str(e.value)


@needs_model
def test_each_shard_ran_only_its_own_records_in_whole_groups(runs: dict[int, Path]) -> None:
    for n in (2, 3):
        for name in ("run", "generate"):
            seen: list[int] = []
            for k in range(n):
                rows = read_rows(runs[n] / name / f"shard-{k}-of-{n}")[1]
                seen.extend(sorted({r["record"] for r in rows}))
                if name == "run":
                    assert rows, (n, k)  # 72 records in three groups: every shard ran some
            assert sorted(seen) == list(range(len(MANY)))  # each record once, in one shard


# ---- a killed shard, missing and mismatched parts ---------------------------------------------------


def _kill(part: Path) -> list[int]:
    """The part as a shard killed half way leaves it: no done marker or final files, half its rows saved."""
    rows = (part / "results.csv").read_text().splitlines()
    records = sorted({int(r.split(",")[0]) for r in rows[1:]})
    kept = records[: len(records) // 2]
    (part / "results.partial.csv").write_text(
        "\n".join([rows[0], *(r for r in rows[1:] if int(r.split(",")[0]) in kept)]) + "\n")
    for f in ("done.json", *FILES):
        (part / f).unlink()
    progress = json.loads((part / "progress.json").read_text())
    (part / "progress.json").write_text(json.dumps(dict(progress, done=kept, complete=False)))
    return records[len(records) // 2:]


@needs_model
@pytest.mark.parametrize("name", ["sweep", "run"])
def test_a_killed_shard_resumes_and_merges_equal(runs: dict[int, Path], tmp_path: Path, name: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    top = tmp_path / name
    shutil.copytree(runs[3] / name, top)
    assert main(["merge", str(top)]) == 0
    unkilled = {f: (top / f).read_bytes() for f in FILES}
    for f in FILES:
        (top / f).unlink()
    left = _kill(top / "shard-0-of-3")
    capsys.readouterr()
    assert main(["merge", str(top)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "shard(s) 0/3 of 3 not complete" in err and "shard-0-of-3" in err
    assert main([COMMAND[name], str(runs[1].parent / "programs" / f"{name}.dl"), "--out", str(top), "--shard",
                 "0/3", "--resume"]) == 0
    err = capsys.readouterr().err
    if name == "sweep":  # saved record by record: only the records not saved before run (a run: whole groups)
        assert f"{len(left)} record(s) to run" in err and "done before" in err
    # the last line says where this shard wrote, and how to merge
    assert f"wrote {top}/shard-0-of-3/ (shard 0/3): " in err and f"all 3 shards done: `deltalang merge {top}`" in err
    assert main(["merge", str(top)]) == 0
    for f in FILES:
        assert (top / f).read_bytes() == unkilled[f] == (runs[1] / name / f).read_bytes(), f


@needs_model
def test_a_resumed_collection_reruns_a_group_whole(tmp_path: Path) -> None:
    """A collection killed with part of a group of records saved resumes by running that group whole, so every
    record shares its forward with the same records as in an uninterrupted run: its values equal bit for bit."""
    base = _programs(tmp_path)
    source, filename = PROGRAMS["collect"], str(base / "collect.dl")
    whole = deltalang.run(source, filename=filename, out=tmp_path / "whole")
    size = sum(v.numel() * v.element_size() for v in whole[0][1].values())

    def kill(records: list[int]) -> None:
        raise KeyboardInterrupt

    model = deltalang.load_model()
    with pytest.raises(KeyboardInterrupt):  # a shard written every 2.5 records or so: the group's last not saved
        run_dataset(source, model, filename=filename, out=tmp_path / "killed", shard_bytes=int(2.5 * size),
                    on_group=kill)
    saved = [json.loads(line)["record"] for line in (tmp_path / "killed" / "index.jsonl").read_text().splitlines()]
    assert 0 < len(saved) < 32  # part of the first group (of 32)
    run_dataset(source, model, filename=filename, out=tmp_path / "killed", shard_bytes=int(2.5 * size), resume=True)
    _same_collection(tmp_path / "whole", tmp_path / "killed")


@needs_model
def test_mismatched_and_missing_shards_are_one_line(runs: dict[int, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    base = runs[1].parent / "programs"
    top = tmp_path / "run"
    shutil.copytree(runs[2] / "run", top)
    other = base / "other.dl"
    other.write_text(PROGRAMS["run"].replace("measure prob(facts.answer)\n", ""), encoding="utf-8")
    cases = [
        (["run", str(other), "--out", str(top), "--shard", "0/2"], "another program"),
        (["run", str(base / "run.dl"), "--out", str(top), "--shard", "0/3"], "another number of shards"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, err
    with pytest.raises(DeltaError, match="another split of the records") as e:  # records run alone: other groups
        deltalang.run(PROGRAMS["run"], filename=str(base / "run.dl"), out=top, shard=(0, 2), batch=False)
    assert "\n" not in str(e.value.message)
    (top / "shard-2-of-3").mkdir()
    assert main(["merge", str(top)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "split in 3" in err
    (top / "shard-2-of-3").rmdir()
    (top / "shard-0-of-2" / "done.json").unlink()
    assert main(["merge", str(top)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "shard(s) 0/2 of 2 not complete" in err
    with pytest.raises(DeltaError, match="0/2 of 2 not complete"):
        deltalang.load_results(top)


@needs_model
def test_python_shards_merge_equal_one_process(runs: dict[int, Path], tmp_path: Path) -> None:
    base = runs[1].parent / "programs"
    source = PROGRAMS["sweep"]
    for k in range(2):
        part = deltalang.run(source, filename=str(base / "sweep.dl"), out=tmp_path / "s", shard=(k, 2))
        assert {r["record"] for r in part.rows} < set(range(len(RECORDS)))
    with pytest.raises(DeltaError, match="not merged"):
        load_saved(tmp_path / "s")
    deltalang.load_results(tmp_path / "s")
    for f in FILES:
        assert (tmp_path / "s" / f).read_bytes() == (runs[1] / "sweep" / f).read_bytes(), f
    source, filename = PROGRAMS["run"].replace("many", "facts"), str(base / "run.dl")  # batch=False: each alone
    deltalang.run(source, filename=filename, out=tmp_path / "r1", batch=False)
    for k in range(3):
        deltalang.run(source, filename=filename, out=tmp_path / "r3", batch=False, shard=f"{k}/3")
    deltalang.load_results(tmp_path / "r3")
    for f in FILES:
        assert (tmp_path / "r3" / f).read_bytes() == (tmp_path / "r1" / f).read_bytes(), f
    with pytest.raises(DeltaError, match="applies to a program over a dataset"):
        deltalang.run("read L0.states", prompt="The Eiffel Tower is in", shard=(0, 2))


ATTRIBUTION = """dataset facts = "facts.jsonl"
sweep s on facts over L in L[linear], t in facts.subject, -1 method attribution steps 2 refine {refine} {{
    write L.state_after(t) from facts.corrupt
    measure logit_diff(facts.answer, facts.foil)
}}
"""


@needs_model
def test_an_attribution_over_a_dataset_sharded_merges_equal(runs: dict[int, Path], tmp_path: Path) -> None:
    base = runs[1].parent / "programs"
    source, filename = ATTRIBUTION.format(refine=0), str(base / "attribution.dl")
    deltalang.run(source, filename=filename, out=tmp_path / "one")
    for k in range(3):
        deltalang.run(source, filename=filename, out=tmp_path / "three", shard=f"{k}/3")
    merged = deltalang.load_results(tmp_path / "three")
    assert merged.kind == "attribution over a dataset"
    for f in FILES:
        assert (tmp_path / "three" / f).read_bytes() == (tmp_path / "one" / f).read_bytes(), f


@needs_model
def test_a_refine_in_two_phases_says_what_is_missing_in_one_line(runs: dict[int, Path], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    base = runs[1].parent / "programs"
    top, program = tmp_path / "r", str(base / "refine.dl")
    capsys.readouterr()
    assert main(["sweep", program, "--out", str(top), "--shard", "0/2"]) == 0  # phase one: the estimates
    err = capsys.readouterr().err
    assert f"wrote {top}/shard-0-of-2/ (shard 0/2): " in err and "1 of 2 shards estimated" in err and \
        f"--refine-from {top}" in err
    for argv, message in ((["sweep", program, "--refine-from", str(top), "--shard", "0/2"],
                           "shard(s) 1/2 of 2 have not estimated"),
                          (["merge", str(top)], "shard(s) 1/2 of 2 not complete"),
                          (["sweep", program, "--refine-from", str(top)], "give --shard K/N"),
                          (["sweep", program, "--refine-from", str(top), "--out", str(tmp_path / "x"), "--shard",
                            "0/2"], "drop --out")):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, err
    assert main(["sweep", program, "--out", str(top), "--shard", "1/2"]) == 0
    capsys.readouterr()
    assert main(["merge", str(top)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "estimated but not refined (phase 1 of 2)" in err, err


@needs_model
def test_a_per_token_sweep_sharded_merges_equal(tmp_path: Path) -> None:
    base = _programs(tmp_path)
    source = PROGRAMS["sweep"].replace("    measure logit_diff", "    measure norm(L6.states)\n    measure logit_diff")
    filename = str(base / "tokens.dl")
    deltalang.run(source, filename=filename, out=tmp_path / "one")
    for k in range(2):
        deltalang.run(source, filename=filename, out=tmp_path / "two", shard=(k, 2))
    deltalang.load_results(tmp_path / "two")
    assert "position" in (tmp_path / "one" / "results.csv").read_text().splitlines()[0]
    for f in FILES:
        assert (tmp_path / "two" / f).read_bytes() == (tmp_path / "one" / f).read_bytes(), f


@pytest.mark.parametrize("line", ["--shard 0/2", "--refine-from out"])
def test_a_notebook_cell_refuses_a_shard_in_one_line(line: str) -> None:
    """A cell is one process: --shard and the second phase's --refine-from (accepted and ignored before) refused."""
    from deltalang.notebook import CellError, run_cell

    with pytest.raises(CellError) as e:
        run_cell(line, 'dataset facts = "facts.jsonl"\ntrace t on facts { measure prob(facts.answer) }\n', {})
    option = line.split()[0]
    assert f"{option} is for a run split across processes" in str(e.value) and str(e.value).count("\n") == 0
