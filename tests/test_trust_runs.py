"""Issue 24's runs a researcher can trust: no internal error, no half-written results, nothing ignored.

- a Kimi-Linear checkpoint with fewer key-value heads than attention heads, whose left-padded forward
  transformers cannot run: runs of different lengths get forwards of their own (said by `emit --plan`),
  every value checked against each run alone in transformers;
- a per-token measure over a dataset is a located error at `check` and `run`, before anything is written;
- `--out` never writes beside another experiment's results, and a failed run leaves nothing that looks
  like results;
- options that do nothing in their context are refused, and a zero denominator of `--normalise` too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference import Reference, Write, set_to
from transformers import AutoModelForCausalLM

import deltalang
from deltalang.cli import main
from deltalang.models.testing import _enlarge_random_weights, byte_tokenizer, tiny_config

LANDMARKS = Path(__file__).resolve().parent.parent / "examples" / "data" / "landmarks.jsonl"


# ---- (b) Kimi-Linear with fewer key-value heads than attention heads ----------------------------


@pytest.fixture(scope="module")
def kimi_gqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config("kimi_linear")
    cfg.num_key_value_heads = cfg.num_attention_heads // 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    _enlarge_random_weights(model)
    path = tmp_path_factory.mktemp("kimi_gqa")
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_transformers_itself_cannot_run_the_padded_batch(kimi_gqa: Path) -> None:
    """Why deltalang must not hand it one: the config this test is about does fail in transformers."""
    tok = byte_tokenizer()
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(kimi_gqa).eval()
    with pytest.raises(RuntimeError):
        model(**tok(["The Eiffel Tower", "Hi"], return_tensors="pt", padding=True))


def test_runs_of_different_lengths_run_apart_and_equal_transformers(kimi_gqa: Path) -> None:
    model = deltalang.load_model(kimi_gqa)
    ref = Reference(AutoModelForCausalLM.from_pretrained(kimi_gqa).eval())
    a, b = model.linear_layers()[0], model.linear_layers()[-1]
    source = f"""prompt long = "The Eiffel Tower is in Paris"
prompt mid = "Tea time"
prompt tiny = "Hi"
trace d on long {{ read L{a}.state_output }}
trace m on mid {{ read logits, L{b}.state_output }}
trace t on tiny {{ read logits }}
trace x on mid {{
    write L{b}.state_after(3) from d.state_after(20)
    read logits
}}
"""
    exp = deltalang.compile(source, model)
    for p in exp.plan.passes:
        assert len({r.n_tokens for r in p.runs}) == 1 and not p.padded
    plan = exp.format_plan()
    assert "transformers' left-padded forward fails on Kimi-Linear" in plan
    got = exp.run()
    ids = lambda text: model.tokenizer(text, return_tensors="pt").input_ids  # noqa: E731
    long_, mid, tiny = (ref.run(ids(t)) for t in ("The Eiffel Tower is in Paris", "Tea time", "Hi"))
    x = ref.run(ids("Tea time"), [Write(b, "state_after", set_to(long_.value(b, "state_after", 20)), position=3)])
    torch.testing.assert_close(got["m.logits"], mid.value(None, "logits"), atol=1e-4, rtol=0)
    torch.testing.assert_close(got[f"m.L{b}.state_output"], mid.value(b, "state_output"), atol=1e-5, rtol=0)
    torch.testing.assert_close(got["t.logits"], tiny.value(None, "logits"), atol=1e-4, rtol=0)
    torch.testing.assert_close(got[f"d.L{a}.state_output"], long_.value(a, "state_output"), atol=1e-5, rtol=0)
    torch.testing.assert_close(got["x.logits"], x.value(None, "logits"), atol=1e-4, rtol=0)


def test_a_dataset_on_such_a_checkpoint_runs(kimi_gqa: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Records of different lengths share forwards in a dataset run: on this model, only those of one length."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hi", "Tea time", "The Eiffel Tower")))
    prog = tmp_path / "p.dl"
    prog.write_text(f'dataset facts = "{data}"\ntrace t on facts {{ measure norm(L0.state_output) }}\n')
    assert main(["run", str(prog), "--model", str(kimi_gqa)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "3 of 3 records" in out and " n 3 " in out, out


# ---- (a) a per-token measure over a dataset; a failed run over a dataset ---------------------------


def _dataset_program(tmp_path: Path, measure: str) -> Path:
    prog = tmp_path / "p.dl"
    prog.write_text(f'dataset facts = "{LANDMARKS}"\ntrace t on facts {{\n    measure {measure}\n}}\n')
    return prog


@pytest.mark.parametrize("command", ["check", "run"])
def test_a_per_token_measure_over_a_dataset_is_a_located_error(command: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    prog = _dataset_program(tmp_path, "norm(L4.states)")
    out = tmp_path / "out"
    assert main([command, str(prog)] + (["--out", str(out)] if command == "run" else [])) == 1
    err = capsys.readouterr().err
    assert f"{prog}:3:13: error: norm(L4.states) is one number per token" in err and "internal error" not in err
    assert "norm(L4.state_output)" in err  # what to measure instead
    assert not out.exists()  # nothing written


def test_a_failed_run_over_a_dataset_leaves_no_results_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture) -> None:
    from deltalang.runs import dataset_run, records

    prog, out = _dataset_program(tmp_path, "norm(L4.state_output)"), tmp_path / "out"
    real = dataset_run._run_group
    calls = []

    def failing(*a: object, **k: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a failure in the second group")
        return real(*a, **k)

    monkeypatch.setattr(records, "MAX_GROUP", 8)
    monkeypatch.setattr(dataset_run, "_run_group", failing)
    assert main(["run", str(prog), "--out", str(out)]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["progress.json", "results.partial.csv"]  # kept for --resume
    assert len(json.loads((out / "progress.json").read_text())["done"]) == 8
    monkeypatch.setattr(dataset_run, "_run_group", real)
    assert main(["run", str(prog), "--out", str(out), "--resume"]) == 0, capsys.readouterr().err
    names = sorted(p.name for p in out.iterdir())
    assert "results.csv" in names and "results.partial.csv" not in names
    assert len((out / "results.csv").read_text().splitlines()) == 1 + 24


def test_a_run_over_a_dataset_failing_at_once_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deltalang.runs import dataset_run

    def failing(*a: object, **k: object) -> object:
        raise RuntimeError("a failure in the first group")

    monkeypatch.setattr(dataset_run, "_run_group", failing)
    out = tmp_path / "out"
    assert main(["run", str(_dataset_program(tmp_path, "norm(L4.state_output)")), "--out", str(out)]) == 2
    assert not out.exists()


# ---- (c) --out never beside another program's results --------------------------------------------

EIFFEL = Path(__file__).resolve().parent.parent / "examples" / "eiffel.dl"


def test_out_holding_another_programs_results_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for name in ("sweep.csv", "reference.py", "program.dl"):
        (out / name).write_text("another experiment\n")
    assert main(["run", str(EIFFEL), "--out", str(out)]) == 1
    assert "holds another program's results" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["program.dl", "reference.py", "sweep.csv"]  # untouched
    assert main(["run", str(EIFFEL), "--out", str(out), "--replace"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert "sweep.csv" not in names and "reference.py" not in names and "results.json" in names
    assert (out / "program.dl").read_text() == EIFFEL.read_text()
    assert main(["run", str(EIFFEL), "--out", str(out)]) == 0  # its own directory: rerun into it


def test_out_holding_files_that_are_not_results_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert main(["run", str(EIFFEL), "--out", str(out), "--replace"]) == 1
    assert "not deltalang's results (notes.txt)" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_failed_run_leaves_nothing_in_a_new_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    from deltalang.runs.results import Results

    def half_save(self: Results, directory: str | Path, **k: object) -> Path:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "results.json").write_text("{}")
        raise RuntimeError("the disk went away")

    monkeypatch.setattr(Results, "save", half_save)
    out = tmp_path / "new" / "out"
    assert main(["run", str(EIFFEL), "--out", str(out)]) == 2
    assert not out.exists()


# ---- (d) options that would be ignored -------------------------------------------------------------

SWEEP = Path(__file__).resolve().parent.parent / "examples" / "sweep_state_ablation.dl"


@pytest.mark.parametrize("argv, message", [
    (["sweep", str(SWEEP), "--naive", "--attribution"], "give one of them"),
    (["run", str(EIFFEL), "--resume"], "--resume is about the run's --out directory"),
    (["run", str(EIFFEL), "--prompt", "Hello"], "--prompt gives the prompt of the statements outside any run"),
    (["check", str(EIFFEL), "--prompt", "Hello"], "--prompt gives the prompt of the statements outside any run"),
    (["sweep", str(SWEEP), "--normalise", "clean=clean,corrupted=clean"], "(clean - corrupted) is 0"),
    (["sweep", str(SWEEP), "--attribution", "--batch-size", "4"], "--batch-size: not an option of a sweep by attr"),
])
def test_an_option_that_would_be_ignored_is_an_error(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_resume_with_nothing_to_resume_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "empty"
    assert main(["sweep", str(SWEEP), "--out", str(out), "--resume"]) == 1
    assert "nothing to resume" in capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "program.dl").write_text(EIFFEL.read_text())
    assert main(["run", str(EIFFEL), "--out", str(tmp_path / "plain"), "--resume"]) == 1
    assert "this program runs at once" in capsys.readouterr().err


def test_normalise_between_two_runs_of_equal_value_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Two runs of one prompt, one with a write nothing reads: clean - corrupted is 0 for every measure, refused
    in one line naming both runs and the value, and nothing is left in --out."""
    program = tmp_path / "same.dl"
    program.write_text('prompt clean = "The Eiffel Tower is in the city of"\n'
                       'trace base on clean {\n    read logits\n}\n'
                       'trace twin on clean {\n    write L4.state_output = zeros\n}\n'
                       'sweep s on clean over L in L[linear], t in 0..2 {\n    write L.state_after(t) = zeros\n'
                       '    measure prob(" Paris")\n}\n')
    out = tmp_path / "out"
    assert main(["sweep", str(program), "--normalise", "clean=base,corrupted=twin", "--out", str(out)]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]  # (the write's warning aside)
    assert len(err) == 1, err
    assert "'base' and 'twin' both give prob(\" Paris\") = " in err[0] and "(clean - corrupted) is 0" in err[0]
    assert not out.exists() or not any(out.iterdir())
