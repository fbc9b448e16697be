"""One parse per run: every entry point parses the program's text once and passes the syntax tree on.

Every parse of program text runs Lark's parser inside `deltalang.language.parse.parse_partial` (which `parse` calls), so
the test counts the calls of that parser, whatever name the parse entry point was imported under: `run`,
`compile`, `check`, `run_sweep`, the command line's `run`, `check`, `emit` and `sweep` (one prompt and over a
dataset), a run over a dataset from Python and the notebook magic each parse exactly once, and a program with a
mistake once too, its errors those `check` reports.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

import deltalang
from deltalang.cli import main
from deltalang.ground.errors import DeltaError
from deltalang.models.bundled import PATH as BUNDLED
from deltalang.notebook import CellError, run_cell

parse_module = importlib.import_module("deltalang.language.parse")  # `deltalang.parse` is the function
pytestmark = pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")

ROOT = Path(__file__).parents[1]
RECORDS = [json.loads(line) for line in (ROOT / "examples" / "data" / "landmarks.jsonl").read_text().splitlines()][:2]
EIFFEL = "The Eiffel Tower is in the city of"
ONE = f'prompt p = "{EIFFEL}"\ntrace t on p {{\n    read L0.state_output\n    measure prob(" Paris")\n}}\n'
SWEEP = (f'prompt clean = "{EIFFEL}"\n'
         'sweep ablate on clean over t in 0..2 {\n    write L0.state_after(t) = zeros\n    measure prob(" Paris")\n}\n')
OVER = 'dataset facts = "facts.jsonl"\ntrace t on facts {\n    measure prob(facts.answer)\n}\n'
SWEEP_OVER = ('dataset facts = "facts.jsonl"\nsweep s on facts.corrupt over t in facts.subject, -1 {\n'
              '    write L0.state_after(t) from facts\n    measure logit_diff(facts.answer, facts.foil)\n}\n')
GENERATE_OVER = ('dataset facts = "facts.jsonl"\ngenerate g on facts max_new_tokens 2 {\n'
                 '    measure prob(facts.answer)\n}\n')
# a statement that fails to build beside a resolver error of the rest: `check` reports both
MISTAKE = f'prompt p = "{EIFFEL}"\ntrace t on p {{\n    route nope\n    read L99.state_output\n}}\n'


class _Counting:
    """Lark's parser, its `parse` calls counted."""

    def __init__(self, lark: Any) -> None:
        self.lark = lark
        self.calls = 0

    def parse(self, text: str, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.lark.parse(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lark, name)


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> _Counting:
    counting = _Counting(parse_module._lark())
    monkeypatch.setattr(parse_module, "_lark", lambda: counting)
    return counting


def _files(tmp_path: Path, program: str) -> Path:
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    (tmp_path / "x.dl").write_text(program, encoding="utf-8")
    return tmp_path / "x.dl"


def _cli(*argv: str) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(list(argv))


def test_the_counter_sees_a_parse(parses: _Counting) -> None:
    deltalang.parse(ONE)
    assert parses.calls == 1


@pytest.mark.parametrize("given", ["model", "none"])
def test_run_compile_check_run_sweep_parse_once(parses: _Counting, model: deltalang.DeltaModel, given: str) -> None:
    on = model if given == "model" else None  # None: the bundled model, loaded once per process
    for call in (lambda: deltalang.run(ONE, model=on), lambda: deltalang.compile(ONE, model=on),
                 lambda: deltalang.check(ONE, model=on), lambda: deltalang.run(SWEEP, model=on),
                 lambda: deltalang.run_sweep(SWEEP, model=on)):
        parses.calls = 0
        call()
        assert parses.calls == 1


@pytest.mark.parametrize("command", ["run", "check", "emit", "sweep"])
def test_a_command_parses_once(parses: _Counting, model: deltalang.DeltaModel, tmp_path: Path,
                               command: str) -> None:
    assert _cli(command, str(_files(tmp_path, SWEEP if command == "sweep" else ONE))) == 0
    assert parses.calls == 1


@pytest.mark.parametrize(("command", "program"), [("run", OVER), ("check", OVER), ("emit", GENERATE_OVER),
                                                  ("sweep", SWEEP_OVER), ("run", SWEEP_OVER)])
def test_a_command_over_a_dataset_parses_once(parses: _Counting, model: deltalang.DeltaModel, tmp_path: Path,
                                              command: str, program: str) -> None:
    assert _cli(command, str(_files(tmp_path, program))) == 0
    assert parses.calls == 1


@pytest.mark.parametrize("program", [OVER, SWEEP_OVER])
def test_a_run_over_a_dataset_parses_once(parses: _Counting, model: deltalang.DeltaModel, tmp_path: Path,
                                          program: str) -> None:
    deltalang.run(program, model=model, filename=str(_files(tmp_path, program)))
    assert parses.calls == 1
    parses.calls = 0
    deltalang.run(program, data={"facts": RECORDS})
    assert parses.calls == 1


@pytest.mark.parametrize("program", [ONE, SWEEP, OVER])
def test_the_magic_parses_once(parses: _Counting, model: deltalang.DeltaModel, program: str) -> None:
    run_cell("--model m", program.replace('"facts.jsonl"', json.dumps(str(ROOT / "examples/data/landmarks.jsonl"))),
             {"m": model})
    assert parses.calls == 1


def _checked(filename: str, model: deltalang.DeltaModel) -> str:
    with pytest.raises(DeltaError) as checked:
        deltalang.check(MISTAKE, model=model, filename=filename)
    assert len(checked.value.errors) == 2  # the statement's error and L99's
    return checked.value.render()


def test_a_mistake_is_parsed_once_and_reported_as_check_reports_it(parses: _Counting,
                                                                   model: deltalang.DeltaModel) -> None:
    checked = _checked("<program>", model)
    assert parses.calls == 1
    for call in (lambda: deltalang.run(MISTAKE, model=model), lambda: deltalang.run(MISTAKE),
                 lambda: deltalang.compile(MISTAKE, model=model), lambda: deltalang.compile(MISTAKE)):
        parses.calls = 0
        with pytest.raises(DeltaError) as got:
            call()
        assert parses.calls == 1 and got.value.render() == checked


@pytest.mark.parametrize("command", ["run", "check", "emit", "sweep"])
def test_a_command_s_mistake_is_parsed_once(parses: _Counting, model: deltalang.DeltaModel, command: str) -> None:
    checked = _checked("<-e>", model)
    parses.calls = 0
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert main([command, "-e", MISTAKE]) == 1
    assert parses.calls == 1 and err.getvalue() == checked + "\n"


def test_the_magic_s_mistake_is_the_command_line_s(parses: _Counting, model: deltalang.DeltaModel) -> None:
    checked = _checked("<cell>", model)
    parses.calls = 0
    with pytest.raises(CellError) as got:
        run_cell("--model m", MISTAKE, {"m": model})
    assert parses.calls == 1 and got.value._render_traceback_() == checked.splitlines()
