"""Commands that answer at once: what `deltalang --help | --version | fmt | check` import, and their texts.

Each command runs in a fresh interpreter (the one running the tests), which reports
`sys.modules` as it exits: `--help`, `--version` and `fmt` import none of torch,
transformers or nnsight; `check` imports no nnsight (it needs transformers' config
and tokenizer, and transformers' config classes import torch whenever torch is
installed, so torch is not avoidable there). `import deltalang` imports none of the
three, yet every public name is there. Times are measured by benchmarks/startup.py,
not asserted here (the test machine is shared).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import deltalang
from deltalang.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "eiffel.dl")
HEAVY = ("torch", "transformers", "nnsight")
PROBE = ("import sys, atexit\n"
         "atexit.register(lambda: sys.stderr.write('\\nIMPORTED ' + ' '.join(sorted(m for m in "
         "('torch', 'transformers', 'nnsight', 'matplotlib', 'pygments') if m in sys.modules)) + '\\n'))\n"
         "from deltalang.cli import main\n"
         "sys.exit(main(sys.argv[1:]))\n")


def deltalang_cmd(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """`deltalang ARGS` in a fresh interpreter, and the heavy modules it had imported at exit."""
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT)
    imported = set(proc.stderr.rsplit("IMPORTED", 1)[-1].split()) if "IMPORTED" in proc.stderr else None
    assert imported is not None, proc.stderr
    return proc, imported


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["fmt", EXAMPLE], ["fmt", "--help"],
                                  ["run", "--help"], ["check", "--help"]])
def test_commands_without_a_model_import_no_torch_transformers_or_nnsight(args: list[str]) -> None:
    proc, imported = deltalang_cmd(*args)
    assert proc.returncode == 0, proc.stderr
    assert not imported & set(HEAVY), f"deltalang {' '.join(args)} imported {imported}"
    assert "pygments" not in imported  # colour only on a terminal


def test_check_imports_no_nnsight() -> None:
    proc, imported = deltalang_cmd("check", EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    assert "ok:" in proc.stdout
    assert "nnsight" not in imported and "matplotlib" not in imported


def test_fmt_output_is_the_formatter_s() -> None:
    proc, _ = deltalang_cmd("fmt", EXAMPLE)
    text = Path(EXAMPLE).read_text(encoding="utf-8")
    from deltalang.language.ast import format_program

    assert proc.stdout == format_program(deltalang.parse(text, EXAMPLE), text)


def test_version() -> None:
    from deltalang.ground.version import __version__

    proc, _ = deltalang_cmd("--version")
    assert proc.stdout.strip() == f"deltalang {__version__}"
    assert deltalang.__version__ == __version__


def _actions(parser: argparse.ArgumentParser, where: str = "deltalang") -> list[tuple[str, argparse.Action]]:
    out = [(where, a) for a in parser._actions]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                out += _actions(sub, f"{where} {name}")
    return out


def test_every_option_has_help_without_backticks() -> None:
    parser = build_parser()
    assert "`" not in (parser.description or "")
    missing, ticks = [], []
    for where, action in _actions(parser):
        if isinstance(action, argparse._SubParsersAction):
            texts = [c.help for c in action._choices_actions]
        else:
            texts = [action.help]
            if action.help is None:
                missing.append(f"{where} {'/'.join(action.option_strings) or action.dest}")
        ticks += [f"{where}: {t}" for t in texts if t and "`" in t]
    assert not missing, f"options without help: {missing}"
    assert not ticks, f"help with literal backticks: {ticks}"


def test_import_deltalang_is_light_and_keeps_its_names() -> None:
    code = ("import sys, deltalang\n"
            "print(' '.join(m for m in ('torch', 'transformers', 'nnsight') if m in sys.modules) or '-')\n"
            "import deltalang.run, deltalang.language.check, deltalang.language.parse, deltalang.sweep\n"  # the submodules...
            "print(all(callable(getattr(deltalang, n)) and not isinstance(getattr(deltalang, n), type(sys))\n"
            "          for n in ('run', 'check', 'parse', 'sweep')))\n")  # ...never shadow the public functions
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["-", "True"]


def test_the_public_names_are_their_homes() -> None:
    import deltalang.language.check  # noqa: F401 - importing the submodules must not rebind the functions
    import deltalang.run  # noqa: F401
    from deltalang.models import spec
    from deltalang.runs import compiled, results
    from deltalang.runtime import model

    assert deltalang.Experiment is compiled.Experiment
    assert deltalang.load_model is model.load_model and deltalang.Results is results.Results
    assert deltalang.ModelSpec is spec.ModelSpec
    assert deltalang.check is sys.modules["deltalang.language.check"].check
    assert deltalang.run is sys.modules["deltalang.run"].run
    assert deltalang.sweep is sys.modules["deltalang.run"].sweep
    assert set(deltalang.__all__) <= set(dir(deltalang))
    namespace: dict[str, object] = {}
    exec("from deltalang import *", namespace)
    assert set(deltalang.__all__) <= set(namespace)
    with pytest.raises(AttributeError):
        deltalang.no_such_name  # noqa: B018


def _on_a_terminal(*args: str) -> str:
    """`deltalang ARGS` with standard output on a pseudo-terminal: what a user sees."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "deltalang.cli", *args], stdout=slave,
                            stderr=subprocess.PIPE, cwd=ROOT)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=120)
    os.close(master)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    return b"".join(chunks).decode("utf-8").replace("\r\n", "\n")


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
@pytest.mark.parametrize("command", ["fmt", "check"])
def test_program_text_is_coloured_on_a_terminal_only(command: str) -> None:
    piped = subprocess.run([sys.executable, "-m", "deltalang.cli", command, EXAMPLE], capture_output=True,
                           text=True, cwd=ROOT)
    assert piped.returncode == 0 and "\x1b[" not in piped.stdout  # tests and golden files see plain text
    shown = _on_a_terminal(command, EXAMPLE)
    assert "\x1b[" in shown
    assert re.sub(r"\x1b\[[0-9;]*m", "", shown) == piped.stdout


def test_the_old_testing_paths_are_the_modules_themselves() -> None:
    """`deltalang.testing` and `deltalang.testing_ssd`, which users import, are the modules that moved to models/."""
    import deltalang.models.testing
    import deltalang.models.testing_ssd
    import deltalang.testing
    import deltalang.testing_ssd
    from deltalang.testing import tiny_checkpoint

    assert deltalang.testing is deltalang.models.testing and deltalang.testing_ssd is deltalang.models.testing_ssd
    assert tiny_checkpoint is deltalang.models.testing.tiny_checkpoint
