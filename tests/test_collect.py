"""Collections (`read` in a trace over a dataset) against transformers' cache, and reading any saved run back.

Ground truth: the recurrent state in plain transformers' cache after a record's first t+1 tokens
(`deltalang.models.testing.load_hf` of the bundled checkpoint); the subject's last token is found from the
tokenizer's own offsets, not from deltalang. Records of different lengths share left-padded
forwards; every record's values must still be its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

import deltalang
import deltalang.models.bundled
from deltalang.cli import main
from deltalang.ground.errors import DeltaError
from deltalang.models.internals import output_cache
from deltalang.models.testing import load_hf
from deltalang.runs import collect
from deltalang.runs.dataset_run import run_dataset

RECORDS = [
    {"prompt": "The Eiffel Tower is in the city of", "subject": "Eiffel Tower", "answer": " Paris"},
    {"prompt": "The Blue Mosque is in the city of Istanbul the Leaning Tower is in the city of",
     "subject": "Leaning Tower",
     "answer": " Pisa"},
    {"prompt": "The Blue Mosque is in", "subject": "Blue Mosque", "answer": " Istanbul"},
    {"prompt": "The Space Needle is in the city of Seattle the Eiffel Tower is in the city of Paris the "
               "Brandenburg Gate is in the city of",
     "subject": "Brandenburg Gate", "answer": " Berlin"},
    {"prompt": "The Space Needle is in the city of", "subject": "Space Needle", "answer": " Seattle"},
]
PROGRAM = """dataset facts = "facts.jsonl"
trace t on facts {
    read L[linear].state_after(facts.subject) as s
    read L1.states
    measure prob(facts.answer)
}
"""


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


@pytest.fixture(scope="module")
def hf() -> Any:
    return load_hf(deltalang.models.bundled.PATH, dtype=torch.float32).eval()


def _program(tmp: Path, records: list[dict[str, str]] = RECORDS) -> tuple[str, str]:
    (tmp / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    (tmp / "p.dl").write_text(PROGRAM, encoding="utf-8")
    return PROGRAM, str(tmp / "p.dl")


def _truth(model: deltalang.DeltaModel, hf: Any, record: dict[str, str], layer: int) -> tuple[int, list[torch.Tensor]]:
    """(the subject's last token, the state in transformers' cache after each prefix) of a record."""
    enc = model.tokenizer(record["prompt"], return_offsets_mapping=True)
    start = record["prompt"].index(record["subject"])
    end = start + len(record["subject"])
    last = max(i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a < end and b > start)
    ids = torch.tensor([enc["input_ids"]])
    states = []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            states.append(output_cache(hf(ids[:, : t + 1], use_cache=True)).get_recurrent_state(layer)[0].clone())
    return last, states


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).norm() / b.norm().clamp_min(1e-12)) < 1e-4


def test_every_collected_value_is_transformers_cache(tmp_path: Path, model: Any, hf: Any) -> None:
    source, filename = _program(tmp_path)
    col = run_dataset(source, model, filename=filename, out=tmp_path / "out")
    assert isinstance(col, deltalang.Collection) and len(col) == len(RECORDS)
    linear = model.spec.linear_layers()
    assert col.labels == [f"s.L{i}" for i in linear] + ["t.L1.states"]
    stacked = col.stack("s")
    assert stacked.shape[:2] == (len(RECORDS), len(linear))
    for n, rec in enumerate(RECORDS):
        record, values = col[n]
        assert record["record"] == n and record["subject"] == rec["subject"]
        for j, layer in enumerate(linear):
            last, states = _truth(model, hf, rec, layer)
            assert _close(values[f"s.L{layer}"], states[last]), (n, layer)
            assert torch.equal(stacked[n, j], values[f"s.L{layer}"])
            if layer == 1:  # every token's state, stored per record: the record's own length, no padding
                got = values["t.L1.states"]
                assert got.shape[0] == len(states)
                assert all(_close(got[t], states[t]) for t in range(len(states))), n
    record, x = col.dataset("s")[2]
    assert record["line"] == 3 and torch.equal(x, stacked[2])
    with pytest.raises(DeltaError, match="length of each record's own"):
        col.stack("t.L1.states")
    df = col.to_pandas()
    assert list(df.columns[:5]) == ["record", "line", "prompt", "subject", "answer"]
    assert {"shard", "row", "tokens", "t.prob(facts.answer)"} <= set(df.columns)
    manifest = json.loads((tmp_path / "out" / "collection.json").read_text())
    assert manifest["reads"][0]["axes"] == ["record", "heads", "key_dim", "value_dim"]


def test_shards_split_at_the_shard_size(tmp_path: Path, model: Any) -> None:
    from safetensors import safe_open

    source, filename = _program(tmp_path)
    one = 4 * 32 * 32 * 4 * len(model.spec.linear_layers())  # one record's `s`, in bytes
    col = run_dataset(source, model, filename=filename, out=tmp_path / "out", shard_bytes=2 * one, batch=False)
    shards = sorted(p.name for p in (tmp_path / "out").glob("shard-*.safetensors"))
    assert shards == col.manifest["shards"] and len(shards) >= 3
    seen = []
    for name in shards:
        rows = [e for e in col.records if e["shard"] == name]
        with safe_open(str(tmp_path / "out" / name), "pt") as f:
            assert f.get_slice("s.L0").get_shape()[0] == len(rows)  # the record axis first
            assert {f"t.L1.states@{e['record']}" for e in rows} <= set(f.keys())
        seen += [e["record"] for e in rows]
    assert sorted(seen) == list(range(len(RECORDS)))
    whole = run_dataset(source, model, filename=filename, out=tmp_path / "whole")
    assert len(whole.manifest["shards"]) == 1  # records alone or sharing forwards: the same values (to float noise)
    assert _close(whole.stack("s"), col.stack("s"))


class Killed(Exception):
    pass


def test_resume_continues_a_killed_collection(tmp_path: Path, model: Any) -> None:
    source, filename = _program(tmp_path)
    out = tmp_path / "out"
    done: list[int] = []

    def kill_after_two(indices: list[int]) -> None:
        done.extend(indices)
        if len(done) >= 2:
            raise Killed

    with pytest.raises(Killed):
        run_dataset(source, model, filename=filename, out=out, shard_bytes=1, batch=False, on_group=kill_after_two)
    assert not (out / "collection.json").exists()  # nothing looks complete
    with pytest.raises(DeltaError, match="unfinished collection"):
        deltalang.load_results(out)
    with pytest.raises(DeltaError, match="unfinished collection.*--resume"):
        run_dataset(source, model, filename=filename, out=out, shard_bytes=1, batch=False)
    with (out / "index.jsonl").open("a") as f:
        f.write('{"record": 4, "line": 5, "fie')  # a torn line: dropped
    (out / "shard-00009.safetensors").write_bytes(b"junk")  # written, never indexed: removed
    rerun: list[int] = []
    col = run_dataset(source, model, filename=filename, out=out, shard_bytes=1, batch=False, resume=True,
                      on_group=rerun.extend)
    assert sorted(rerun) == sorted(set(range(len(RECORDS))) - set(done))
    assert not (out / "shard-00009.safetensors").exists()
    fresh = run_dataset(source, model, filename=filename, out=tmp_path / "fresh")
    assert len(col) == len(RECORDS) and _close(col.stack("s"), fresh.stack("s"))
    with pytest.raises(DeltaError, match="another program"):
        run_dataset(source.replace("L1.states", "L2.states"), model, filename=filename, out=out, resume=True)


def test_a_collection_that_would_not_fit_is_refused_with_the_figure(tmp_path: Path, model: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    source, filename = _program(tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(collect.shutil, "disk_usage", lambda _: usage(10_000, 9_000, 1_000))
    with pytest.raises(DeltaError, match=r"needs about [\d.]+ (KiB|MiB) in .*has 1000 B free"):
        run_dataset(source, model, filename=filename, out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_failure_before_any_record_is_done_leaves_nothing(tmp_path: Path, model: Any) -> None:
    source, filename = _program(tmp_path)

    def kill(_: list[int]) -> None:
        raise Killed

    with pytest.raises(Killed):
        run_dataset(source, model, filename=filename, out=tmp_path / "out", on_group=kill)
    assert not (tmp_path / "out").exists()
    with pytest.raises(DeltaError, match="give --out DIR"):
        run_dataset(source, model, filename=filename)


def test_load_results_round_trips(tmp_path: Path, model: Any, capsys: pytest.CaptureFixture[str]) -> None:
    source, filename = _program(tmp_path)
    one = deltalang.run('prompt p = "The Eiffel Tower is in the city of"\ntrace t on p {\n    read L1.state_output\n'
                        '    measure prob(" Paris")\n}\n', model)
    one.save(tmp_path / "one")
    back = deltalang.load_results(tmp_path / "one")
    assert isinstance(back, deltalang.Results)
    assert torch.equal(back["t.L1.state_output"], one["t.L1.state_output"])
    assert back['t.prob(" Paris")'] == one['t.prob(" Paris")']
    assert list(back.to_pandas().columns) == ["result", "value"]
    assert back.to_pandas()["value"].tolist() == [one['t.prob(" Paris")']]

    measures = PROGRAM.replace("    read L[linear].state_after(facts.subject) as s\n    read L1.states\n", "")
    (tmp_path / "m.dl").write_text(measures)
    ran = run_dataset(measures, model, filename=str(tmp_path / "m.dl"), out=tmp_path / "ds")
    header = (tmp_path / "ds" / "results.csv").read_text().splitlines()[0].split(",")
    saved = deltalang.load_results(tmp_path / "ds")
    assert list(saved.to_pandas().columns) == header == list(ran.to_pandas().columns)
    assert saved.to_pandas()["value"].tolist() == ran.to_pandas()["value"].tolist()

    (tmp_path / "sw.dl").write_text('prompt clean = "The Eiffel Tower is in the city of"\nsweep ablate on clean over '
                                    'L in L[linear], t in 0..2 {\n    write L.state_after(t) = zeros\n'
                                    '    measure prob(" Paris")\n}\n')
    assert main(["sweep", str(tmp_path / "sw.dl"), "--out", str(tmp_path / "sw")]) == 0
    sweep = deltalang.load_results(tmp_path / "sw")
    header = (tmp_path / "sw" / "sweep.csv").read_text().splitlines()[0].split(",")
    assert list(sweep.to_pandas().columns) == header and len(sweep.to_pandas()) == len(sweep)

    assert main(["run", filename, "--out", str(tmp_path / "col")]) == 0
    col = deltalang.load_results(tmp_path / "col")
    assert isinstance(col, deltalang.Collection) and len(col) == len(RECORDS)
    assert "collected 5 of 5 records" in capsys.readouterr().out
    for obj in (back, saved, sweep, col, ran):  # a few lines each, not a dump of fields
        assert 1 < len(repr(obj).splitlines()) <= 14, repr(obj)
    with pytest.raises(DeltaError, match="no deltalang results"):
        deltalang.load_results(tmp_path)


def test_the_package_face_and_load_model_are_quiet() -> None:
    names = dir(deltalang)
    assert not {"Any", "sys", "importlib", "types", "TYPE_CHECKING", "annotations"} & set(names)
    assert {"load_results", "Collection", "load_model"} <= set(names)
    code = ("import deltalang\nm = deltalang.load_model()\n"
            "deltalang.run('prompt p = \"The Eiffel Tower\"\\ntrace t on p { measure prob(\" is\") }', m)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert got.returncode == 0, got.stderr
    assert got.stderr == "" and got.stdout == "", got.stderr
    loud = subprocess.run([sys.executable, "-c", code.replace("load_model()", "load_model(verbose=True)")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert "Loading weights" in loud.stderr  # asked for: transformers as it is


def test_the_probe_notebook_runs_and_prints_its_accuracies() -> None:
    """examples/probe_states.ipynb in a fresh kernel: nothing on stderr, a held-out accuracy per block for the
    state and the residual stream, the majority baseline, and its plot."""
    import re

    import nbformat
    from nbclient import NotebookClient

    root = Path(__file__).resolve().parent.parent
    nb = nbformat.read(root / "examples" / "probe_states.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(root)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o.text for o in outputs if o.output_type == "stream" and o.name == "stderr"]
    text = "".join(o.text for o in outputs if o.output_type == "stream")
    linear = deltalang.load_spec(None).linear_layers()
    accs = re.findall(r"L(\d+): held-out accuracy  state ([\d.]+)   residual stream ([\d.]+)", text)
    assert [int(a[0]) for a in accs] == linear and all(0 <= float(a[1]) <= 1 for a in accs)
    assert re.search(r"majority class: [\d.]+", text)
    assert re.search(rf"\(450, {len(linear)}, \d+, \d+, \d+\) from \d+ shard", text)
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert any("collected 450 of 450 records" in o.get("data", {}).get("text/plain", "") for o in outputs)


REDUCED = {  # a reduced read of one shape in every record, on a delta-rule and a Mamba-2 model: (model, kind, axes)
    "gated_deltanet": (deltalang.models.bundled.NAME, "linear", ("key_dim", "value_dim"), ["heads"]),
    "mamba2": (deltalang.models.bundled.MAMBA2_NAME, "ssm", ("head_dim", "d_state"), ["heads"]),
}


@pytest.mark.parametrize("family", list(REDUCED))
def test_a_reduced_read_of_one_shape_is_stacked_with_its_axes(tmp_path: Path, family: str) -> None:
    """`.norm(...)` of the state after the subject and `.mean(positions)` of every token's state have one shape in
    every record: one tensor per shard (record axis first), axes in the manifest, `stack()` gives them; each
    record's value is the reduction of transformers' cached states (after each prefix)."""
    from safetensors import safe_open

    from deltalang.models.testing_ssd import ssd_mixers

    name, kind, pair, left = REDUCED[family]
    model = deltalang.load_model(name)
    hf = load_hf(deltalang.models.bundled.MODELS[name], dtype=torch.float32).eval()
    layers = [i for i, _ in ssd_mixers(hf)] if kind == "ssm" else model.spec.linear_layers()
    records = RECORDS[:3]
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    source = (f'dataset facts = "facts.jsonl"\ntrace t on facts {{\n'
              f'    read L[{kind}].state_after(facts.subject).norm({", ".join(pair)}) as n\n'
              f'    read L{layers[0]}.states.mean(positions) as m\n'
              f'    read L{layers[0]}.state_after(facts.subject).head(1) as h\n}}\n')
    (tmp_path / "p.dl").write_text(source, encoding="utf-8")
    col = run_dataset(source, model, filename=str(tmp_path / "p.dl"), out=tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "collection.json").read_text())
    reads = {r["label"]: r for r in manifest["reads"]}
    assert reads[f"n.L{layers[0]}"]["axes"] == ["record", *left] and not reads[f"n.L{layers[0]}"]["per_record"]
    assert reads["m"]["axes"] == ["record", "heads", *pair] and not reads["m"]["per_record"]
    assert reads["h"]["axes"] == ["record", *pair] and not reads["h"]["per_record"]
    with safe_open(str(tmp_path / "out" / manifest["shards"][0]), "pt") as f:
        assert f"n.L{layers[0]}" in f.keys() and "m" in f.keys() and not any("@" in k for k in f.keys())
    n, m = col.stack("n"), col.stack("m")
    assert n.shape[:2] == (len(records), len(layers)) and m.shape[0] == len(records)
    for r, rec in enumerate(records):
        enc = model.tokenizer(rec["prompt"], return_offsets_mapping=True)
        start = rec["prompt"].index(rec["subject"])
        end = start + len(rec["subject"])
        last = max(i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a < end and b > start)
        ids = torch.tensor([enc["input_ids"]])
        with torch.no_grad():
            caches = [output_cache(hf(ids[:, : t + 1], use_cache=True)) for t in range(ids.shape[1])]
        got = col[r][1]
        for j, layer in enumerate(layers):
            want = caches[last].get_recurrent_state(layer)[0].float().flatten(-2).norm(dim=-1)
            assert _close(n[r, j], want) and torch.equal(n[r, j], got[f"n.L{layer}"]), (r, layer)
        head = caches[last].get_recurrent_state(layers[0])[0, 1].float()
        assert _close(col.stack("h")[r], head) and torch.equal(col.stack("h")[r], got["h"]), r
        mean = torch.stack([c.get_recurrent_state(layers[0])[0].float() for c in caches]).mean(0)
        assert _close(m[r], mean) and torch.equal(m[r], got["m"]), r


def test_a_record_left_out_is_in_summary_json_with_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A collection (reads only, no measure) that leaves a record out writes the summary.json it names, and
    its summary prints the record's data-file line and why."""
    records = [RECORDS[0], dict(RECORDS[2], subject="Moon Base"), RECORDS[4]]
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    source = 'dataset facts = "facts.jsonl"\ntrace t on facts {\n    read L1.state_after(facts.subject) as s\n}\n'
    (tmp_path / "p.dl").write_text(source, encoding="utf-8")
    assert main(["run", str(tmp_path / "p.dl"), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(e["record"], e["line"]) for e in summary["left_out"]] == [(1, 2)] and "Moon Base" in \
        summary["left_out"][0]["why"]
    assert "left out 1 of 3 records" in out and f"{tmp_path / 'facts.jsonl'}:2: " in out and "Moon Base" in out


def test_a_collection_with_a_measure_prints_its_statistics_and_every_file(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`read ... as s` with `measure prob(facts.answer)`: the statistics a measure-only run prints, and the
    closing `wrote` line names every file the run wrote."""
    source, filename = _program(tmp_path)
    measures = PROGRAM.replace("    read L[linear].state_after(facts.subject) as s\n    read L1.states\n", "")
    (tmp_path / "m.dl").write_text(measures, encoding="utf-8")
    assert main(["run", str(tmp_path / "m.dl")]) == 0
    alone = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("t.prob(facts.answer)"))
    assert main(["run", filename, "--out", str(tmp_path / "out")]) == 0
    got = capsys.readouterr()
    assert alone in got.out.splitlines(), got.out
    wrote = next(line for line in got.err.splitlines() if line.startswith("wrote "))
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert {"results.csv", "summary.csv", "summary.json", "program.dl", "collection.json"} <= set(written)
    assert all(name in wrote for name in written if not name.startswith("shard-")), (wrote, written)
    assert all(name in wrote or "shard-*.safetensors" in wrote for name in written), (wrote, written)


def test_to_pandas_without_pandas_says_what_to_install(tmp_path: Path, model: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    source, filename = _program(tmp_path, RECORDS[:2])
    col = run_dataset(source, model, filename=filename, out=tmp_path / "out")
    saved = deltalang.load_results(tmp_path / "out")
    one = deltalang.run('prompt p = "The Eiffel Tower is in"\ntrace t on p {\n    measure prob(" Paris")\n}\n', model)
    measures = PROGRAM.replace("    read L[linear].state_after(facts.subject) as s\n    read L1.states\n", "")
    ran = run_dataset(measures, model, filename=filename, out=tmp_path / "ds")
    table = deltalang.load_results(tmp_path / "ds")
    monkeypatch.setitem(sys.modules, "pandas", None)  # pandas not importable
    for obj in (col, saved, one, ran, table):
        with pytest.raises(DeltaError, match=r"^to_pandas\(\) needs pandas.*pip install pandas"):
            obj.to_pandas()
