"""The command line: one line per error, never a traceback, results never lost.

Every command is called in-process (`deltalang.cli.main(argv)`) on the bundled
model, which loads once per process. A user's mistake is `error: ...` and exit 1;
a bug in deltalang is `error: internal error in deltalang ...` and exit 2 (the
traceback only under `--debug`); argparse's own usage errors exit 2.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import runpy
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import deltalang
from deltalang.cli import main
from deltalang.ground.errors import DeltaError

run_module = importlib.import_module("deltalang.runs.compiled")

EIFFEL = "The Eiffel Tower is in the city of"
OK = f'prompt p = "{EIFFEL}"\ntrace t on p {{\n    measure prob(" Paris")\n}}\n'
SWEEP = (f'prompt clean = "{EIFFEL}"\n'
         'sweep ablate on clean over t in 0..3 {\n    write L0.state_after(t) = zeros\n    measure prob(" Paris")\n}\n')
COMMANDS = ("run", "emit", "sweep")


def cli(*argv: str | Path) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `deltalang ARGV`, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


def one_error_line(err: str) -> str:
    """The single `error: ...` line of a failed command, maybe with notes (anything else fails the test)."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("  note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "ok.dl").write_text(OK)
    (tmp_path / "sweep.dl").write_text(SWEEP)
    (tmp_path / "binary.dl").write_bytes(b'prompt \xe8\xff = "x"\n')
    (tmp_path / "taken").write_text("")
    (tmp_path / "adir").mkdir()
    return {p.name: p for p in tmp_path.iterdir()}


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a command loads a model: its error must come before that."""

    def boom(*a: Any, **k: Any) -> Any:
        raise AssertionError("the model was loaded before the error was found")

    monkeypatch.setattr(run_module, "get_model", boom)


# ---- 1. --out never loses results ---------------------------------------------------------


def test_save_writes_results_that_share_storage(tmp_path: Path) -> None:
    base = torch.randn(1, 5, 2, 3, 3)
    values = {"t.states": base, "t.state_output": base[:, -1], "t.state_after(2)": base[:, 2], "t.prob": 0.5}
    deltalang.Results(values).save(tmp_path)
    saved = load_file(str(tmp_path / "results.safetensors"))
    assert set(saved) == {"t.states", "t.state_output", "t.state_after(2)"}
    for key, v in saved.items():
        assert torch.equal(v, values[key]), key
    assert json.loads((tmp_path / "results.json").read_text())["measures"] == {"t.prob": 0.5}


@pytest.mark.parametrize("reads", ["read L0.states, L0.state_output", "read L1.states, L1.state_after(2)"])
def test_run_out_saves_reads_that_share_storage(tmp_path: Path, reads: str) -> None:
    rc, out, err = cli("run", "-e", reads, "--prompt", EIFFEL, "--out", tmp_path / "out")
    assert rc == 0 and "Traceback" not in err, err
    saved = load_file(str(tmp_path / "out" / "results.safetensors"))
    assert len(saved) == 2
    # the saved values are the run's: the whole-sequence states hold the other one
    states = next(v for k, v in saved.items() if k.endswith(".states"))
    other = next(v for k, v in saved.items() if not k.endswith(".states"))
    if "state_output" in reads:  # the last state is the call's own final state
        assert torch.equal(states[:, -1], other)
    else:  # state_after(2) comes from the kernel over the prefix beside the call: the same state, not its bits
        torch.testing.assert_close(states[:, 2], other, atol=1e-6, rtol=0)
    assert not list((tmp_path / "out").glob(".deltalang-*")), "a temporary directory was left behind"


@pytest.mark.parametrize("command, program", [("run", "ok.dl"), ("sweep", "sweep.dl"), ("run", "sweep.dl")])
@pytest.mark.parametrize("where", ["taken", "taken/sub", "/sys/deltalang-cannot-write-here"])
def test_out_that_cannot_be_written_is_refused_before_the_model_loads(
        files: dict[str, Path], no_model_load: None, command: str, program: str, where: str) -> None:
    if where.startswith("/sys"):
        try:
            tempfile.TemporaryDirectory(dir="/sys").cleanup()
        except OSError:
            pass
        else:
            pytest.skip("/sys is writable here")
    out = where if where.startswith("/") else str(files["ok.dl"].parent / where)
    rc, _, err = cli(command, files[program], "--out", out)
    assert rc == 1
    assert "cannot save results in" in one_error_line(err)


def test_save_to_a_file_is_a_delta_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(DeltaError, match="is a file"):
        deltalang.Results({"x": torch.zeros(1)}).save(tmp_path / "f")


# ---- 2. one line, never a traceback -------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_program_file_errors_are_one_line(files: dict[str, Path], no_model_load: None, command: str) -> None:
    rc, _, err = cli(command, files["binary.dl"])
    assert rc == 1 and "is not UTF-8 text" in one_error_line(err)
    rc, _, err = cli(command, files["adir"])
    assert rc == 1 and "is a directory" in one_error_line(err)
    rc, _, err = cli(command, files["ok.dl"].parent / "missing.dl")
    assert rc == 1 and "no such file" in one_error_line(err)
    rc, _, err = cli(command, "-e", "read L0.states", files["ok.dl"])
    assert rc == 1 and "not both" in one_error_line(err)


@pytest.mark.parametrize("command", ["check", "fmt"])
def test_check_and_fmt_read_files_the_same_way(files: dict[str, Path], command: str) -> None:
    for name, says in (("binary.dl", "is not UTF-8 text"), ("adir", "is a directory")):
        rc, _, err = cli(command, files[name])
        assert rc == 1 and says in one_error_line(err)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("device, says", [("banana", "not a device"), ("meta", "not a device"),
                                          ("cuda", "not available"), ("mps", "not available"),
                                          ("cuda:99", "not available")])
def test_bad_device_is_refused_before_the_model_loads(files: dict[str, Path], no_model_load: None,
                                                      command: str, device: str, says: str) -> None:
    if device == "cuda" and torch.cuda.is_available() or device == "cuda:99" and torch.cuda.device_count() > 99:
        pytest.skip("this machine has that device")
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has mps")
    rc, _, err = cli(command, files["ok.dl"], "--device", device)
    assert rc == 1 and says in one_error_line(err)


@pytest.mark.parametrize("command", [*COMMANDS, "check"])
def test_empty_prompt_is_refused(no_model_load: None, command: str) -> None:
    rc, _, err = cli(command, "-e", "read L0.states", "--prompt", "")
    assert rc == 1 and "--prompt is empty" in one_error_line(err)


@pytest.mark.parametrize(("flags", "says"), [
    (["--attribution"], "--attribution: an option of a sweep; this program runs one prompt and has no sweep: drop it"),
    (["--steps", "0", "--refine", "2"], "--steps, --refine: options of a sweep; this program runs one prompt and has "
                                        "no sweep: drop them"),
    (["--path", "blocks"], "--path: an option of a sweep"),
])
def test_a_sweeps_options_without_a_sweep_are_refused_before_the_model_loads(
        files: dict[str, Path], no_model_load: None, flags: list[str], says: str) -> None:
    rc, _, err = cli("run", files["ok.dl"], *flags)
    assert rc == 1 and says in one_error_line(err)


def test_a_sweeps_options_over_a_dataset_without_a_sweep_are_refused(tmp_path: Path, no_model_load: None) -> None:
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": EIFFEL}) + "\n")
    (tmp_path / "t.dl").write_text('dataset d = "d.jsonl"\ntrace t on d {\n    measure prob(" Paris")\n}\n')
    for command, flags in (("run", ["--attribution"]), ("sweep", ["--normalise", "clean=t,corrupted=t", "--naive"])):
        rc, _, err = cli(command, tmp_path / "t.dl", *flags)
        assert rc == 1 and f"{', '.join(f for f in flags if f.startswith('--'))}: " in one_error_line(err), err
        assert "this program runs over a dataset and has no sweep: drop" in err


# ---- 3. a bug in deltalang says so, and never blames the program --------------------------


def _bug(*a: Any, **k: Any) -> Any:
    raise ZeroDivisionError("a planted bug")


def test_internal_error_in_a_run_is_reported_as_a_bug(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deltalang.ground.measures, "prob", _bug)
    rc, out, err = cli("run", files["ok.dl"])
    assert rc == 2
    assert one_error_line(err) == ("error: internal error in deltalang (a bug, please report it): "
                                   "ZeroDivisionError: a planted bug")
    assert "--debug" in err
    rc, out, err = cli("--debug", "run", files["ok.dl"])
    assert rc == 2 and "Traceback" in err and "ZeroDivisionError: a planted bug" in err
    rc, out, err = cli("run", files["ok.dl"], "--debug")
    assert rc == 2 and "Traceback" in err


def test_running_out_of_memory_is_not_called_a_bug(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    def oom(*a: Any, **k: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(deltalang.ground.measures, "prob", oom)
    rc, _, err = cli("run", files["ok.dl"])
    assert rc == 1 and one_error_line(err) == "error: out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_internal_error_in_any_command_is_reported_as_a_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.import_module("deltalang.compiler.explain"), "format_resolved", _bug)
    rc, _, err = cli("check", "-e", "read L0.states", "--prompt", EIFFEL)
    assert rc == 2 and "internal error in deltalang" in one_error_line(err)


def test_errors_of_the_program_still_point_at_its_line(files: dict[str, Path]) -> None:
    rc, _, err = cli("run", "-e", "read L3.states", "--prompt", EIFFEL)
    assert rc == 1 and err.startswith("<-e>:1:6: error:") and "Traceback" not in err


# ---- 4. remote execution is refused, with the reason ---------------------------------------


@pytest.mark.parametrize("remote", [True, "local", "ndif"])
def test_python_remote_is_refused(remote: Any) -> None:
    with pytest.raises(DeltaError, match="remote execution is not supported"):
        deltalang.compile(OK, remote=remote)
    with pytest.raises(DeltaError, match="remote execution is not supported"):
        deltalang.run(OK, remote=remote)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag", [["--remote"], ["--remote", "local"]])
def test_cli_remote_is_refused(files: dict[str, Path], no_model_load: None, command: str, flag: list[str]) -> None:
    rc, _, err = cli(command, files["ok.dl"], *flag)
    assert rc == 1 and "remote execution is not supported" in one_error_line(err)


# ---- 5. emit of a sweep says what it is ----------------------------------------------------


def test_emit_of_a_sweep_is_labelled_the_reference_form(files: dict[str, Path]) -> None:
    rc, code, err = cli("emit", files["sweep.dl"])
    assert rc == 0, err
    doc = code.split('"""')[1]
    assert "reference form" in doc and "--naive" in doc and "engine" in doc
    rc, code, _ = cli("emit", files["ok.dl"])
    assert rc == 0 and "reference form" not in code


def test_the_reference_code_computes_what_naive_runs(tmp_path: Path) -> None:
    from deltalang.sweep import run_sweeps

    exp = deltalang.compile(SWEEP)
    (tmp_path / "reference.py").write_text(exp.code)  # nnsight reads the `with` blocks back from the file
    reference = runpy.run_path(str(tmp_path / "reference.py"))["experiment"](exp.model)
    naive = run_sweeps(exp, engine="naive", progress=False).results
    keys = [k for k in naive if k.startswith("ablate[")]
    assert len(keys) == 3 and set(keys) <= set(reference)
    for k in keys:
        assert abs(reference[k] - naive[k]) < 1e-6, k


@pytest.mark.parametrize("command", ["sweep", "run"])
def test_sweep_out_saves_the_reference_under_its_name(files: dict[str, Path], tmp_path: Path, command: str) -> None:
    rc, _, err = cli(command, files["sweep.dl"], "--out", tmp_path / "out")
    assert rc == 0, err
    saved = {p.name for p in (tmp_path / "out").iterdir()}
    assert "reference.py" in saved and "emitted.py" not in saved
    assert "reference form" in (tmp_path / "out" / "reference.py").read_text().split('"""')[1]
    assert "reference.py" in err


# ---- 6. fuzz: random command lines and random bytes as programs ----------------------------

_N = int(os.environ.get("FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_N or 40, deadline=None, derandomize=not _N,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
COMMANDS_ALL = ["run", "emit", "sweep", "check", "fmt", "info"]
PROGRAMS = [["@/ok.dl"], ["@/sweep.dl"], ["@/binary.dl"], ["@/taken"], ["@/adir"], ["@/missing.dl"], ["-"], [],
            ["-e", "read L0.states, L0.state_output"], ["-e", "read L3.states"], ["-e", ""], ["-e", "\x00"],
            ["-e", 'sweep s on main over t in 0..2 { write L0.state_after(t) = zeros; measure prob(" Paris") }'],
            ["-e", "read L0.states", "@/ok.dl"]]
OPTIONS = [["--prompt", EIFFEL], ["--prompt", ""], ["--prompt", " "], ["--out", "@/out"], ["--out", "@/taken"],
           ["--out", "@/taken/x"], ["--out", ""], ["--device", "banana"], ["--device", "cuda"], ["--device", "meta"],
           ["--device", "cpu"], ["--dtype", "float16"], ["--dtype", "int8"], ["--remote"], ["--remote", "local"],
           ["--device-map", "auto"], ["--naive"], ["--plan"], ["--resume"], ["--batch-size", "0"],
           ["--batch-size", "2"], ["--normalise", "clean=t,corrupted=t"], ["--normalise", "clean="], ["--debug"],
           ["-w"], ["--model", "@/adir"], ["--model", "@/ok.dl"], ["--trust-remote-code"]]
FLAGS = sorted({o[0] for o in OPTIONS} | {"-e"})
_word = st.sampled_from([w for o in OPTIONS + PROGRAMS for w in o]) | st.text(max_size=6)
# a command, a program, options, and sometimes stray words
command_lines = st.tuples(
    st.sampled_from(COMMANDS_ALL), st.sampled_from(PROGRAMS),
    st.lists(st.sampled_from(OPTIONS) | st.tuples(st.sampled_from(FLAGS), _word).map(list), max_size=3),
    st.lists(_word, max_size=1),
).map(lambda t: [t[0], *t[1], *(w for option in t[2] for w in option), *t[3]])


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Files the fuzzed command lines name (`@/NAME`)."""
    root = tmp_path_factory.mktemp("cli_fuzz")
    for name, data in (("ok.dl", OK.encode()), ("sweep.dl", SWEEP.encode()), ("binary.dl", b"\xe8\xff\x00 read"),
                       ("taken", b"")):
        (root / name).write_bytes(data)
    (root / "adir").mkdir()
    return root


def _no_traceback(argv: list[str]) -> None:
    rc, out, err = cli(*argv)
    assert "Traceback" not in out + err, (argv, err)
    assert rc in (0, 1, 2), (argv, rc, err)


@FUZZ
@given(words=command_lines)
def test_fuzz_command_lines(fuzz_root: Path, words: list[str]) -> None:
    argv = [str(fuzz_root) + a[1:] if a.startswith("@/") else a for a in words]
    for i, word in enumerate(argv[:-1]):  # --model only names a local path: a hub id would go to the network
        if word == "--model" and not argv[i + 1].startswith(str(fuzz_root)):
            argv[i + 1] = str(fuzz_root / "adir")
    if argv[-1] == "--model":
        argv.pop()
    _no_traceback(argv)


@FUZZ
@given(command=st.sampled_from(["run", "emit", "sweep", "check", "fmt"]), data=st.binary(max_size=64))
def test_fuzz_program_bytes(fuzz_root: Path, command: str, data: bytes) -> None:
    program = fuzz_root / "random.dl"
    program.write_bytes(data)
    _no_traceback([command, str(program)] + (["--prompt", EIFFEL] if command != "fmt" else []))


def test_check_refuses_what_the_planner_refuses(tmp_path: Path) -> None:
    """`check` says ok only when `run` can order the runs: a cycle is an error at check time too."""
    program = tmp_path / "cycle.dl"
    program.write_text('prompt p = "The Eiffel Tower is in the city of"\n'
                       "trace a on p { write L0.state_after(2) from b }\n"
                       "trace b on p { write L0.state_after(2) from a }\n")
    code, out, err = cli("check", program)
    assert code == 1 and "ok:" not in out
    assert "cycle.dl:3:16: error: runs need each other's values in a cycle" in err


def test_norm_of_a_value_the_call_does_not_have_is_the_programs_error() -> None:
    """`state_input` of a fresh prompt is None: its norm is an error at the program line, not a bug."""
    code, out, err = cli("run", "-e", "measure norm(L0.state_input)", "--prompt", "The Eiffel Tower")
    assert code == 1 and "internal error" not in err
    assert err.startswith("<-e>:1:9: error: norm of a value this call does not have: state_input is None")
