"""A generate's progress (issue 24): its steps done of the total and the rate on one line (the command line's
stderr, `html.progress_bar`, the notebook's NotebookProgress through the same helper), the tokens exactly those
transformers generates, the hook gone afterwards; Ctrl-C ends in one line saying how far it got, no traceback."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

import deltalang
from deltalang.cli import main
from deltalang.models import bundled

PROMPT = "The Eiffel Tower is in the city of"
GEN = f'prompt clean = "{PROMPT}"\ngenerate g on clean max_new_tokens {{n}} {{{{\n    read tokens\n}}}}\n'
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> Any:
    return deltalang.load_model()


def test_the_command_line_shows_every_step_and_the_rate(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # what rich draws at under CI=true, or on a terminal of 80 columns
    program = tmp_path / "g.dl"
    program.write_text(GEN.format(n=12))
    assert main(["run", str(program)]) == 0
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if ln.startswith("generate g"))
    assert "12/12 steps" in line and "steps/s" in line and "elapsed" in line


@pytest.mark.parametrize("width", [49, 60, 80, 200])
def test_every_number_of_the_line_shows_whole_at_any_width(width: int) -> None:
    """At 80 columns rich cropped the rate column ('101.41' without 'steps/s'); narrower, it cut every column."""
    from deltalang.ground.html import progress_bar

    clock = iter(i / 1000 for i in range(10_000))  # a step every millisecond: 1000.00 steps/s
    buf = io.StringIO()
    console = Console(file=buf, width=width, get_time=lambda: next(clock))
    bar, task = progress_bar(console, 300, "steps", "generate a_long_name")
    with bar:
        for _ in range(300):
            bar.update(task, advance=1)
    line = buf.getvalue().splitlines()[-1]
    assert line.startswith("generate a_long_name") and " 300/300 steps " in line, line
    assert line.rstrip().endswith(" left") and len(line.rstrip()) <= width, line
    if width >= 80:  # narrower, only the counts and the time left have room beside a name this long
        assert " 1000.00 steps/s " in line, line
    if width >= 200:
        assert " elapsed, " in line and "━" in line, line


def test_a_trace_shows_no_progress(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    program = tmp_path / "t.dl"
    program.write_text(f'prompt clean = "{PROMPT}"\ntrace t on clean {{\n    read logits\n}}\n')
    assert main(["run", str(program)]) == 0
    assert "steps" not in capsys.readouterr().err


def test_counted_tokens_are_transformers_own_and_the_hook_is_removed(model: Any) -> None:
    from transformers import AutoModelForCausalLM

    buf = io.StringIO()
    hooks = dict(model._module._forward_hooks)
    exp = deltalang.compile(GEN.format(n=6), model)
    got = exp.run(progress=Console(file=buf, width=200))["g.tokens"]
    assert "6/6 steps" in buf.getvalue()
    assert dict(model._module._forward_hooks) == hooks
    hf = AutoModelForCausalLM.from_pretrained(bundled.PATH, dtype=torch.float32)
    ids = model.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    want = hf.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)[:, ids.shape[1]:]
    assert torch.equal(got.cpu(), want)


def test_a_notebook_gets_the_same_helpers_line() -> None:
    from deltalang.ground.html import NotebookProgress, progress_bar

    bar, task = progress_bar(Console(force_jupyter=True), 300, "steps", "generate g")
    assert isinstance(bar, NotebookProgress)
    bar.update(task, advance=30)
    assert bar.text().startswith("generate g: 30/300 steps")
    assert progress_bar(None, 300, "steps", "generate g") == (None, None)


def test_ctrl_c_during_a_generate_is_one_line(tmp_path: Path) -> None:
    program = tmp_path / "long.dl"
    program.write_text(GEN.format(n=100_000))
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from deltalang.cli import main; sys.exit(main(['run', sys.argv[1]]))")
    p = subprocess.Popen([sys.executable, "-c", code, str(program)], stderr=subprocess.PIPE, text=True,
                         stdout=subprocess.DEVNULL)
    assert p.stderr is not None
    seen = ""
    while "max_position_embeddings" not in seen:  # the warning `check` prints once the model is loaded
        ch = p.stderr.read(1)
        assert ch, seen
        seen += ch
    time.sleep(4)  # into the generate
    p.send_signal(signal.SIGINT)
    rest = p.communicate(timeout=120)[1]
    assert p.returncode == 130, rest
    assert "Traceback" not in rest
    last = rest.strip().splitlines()[-1]
    assert last.startswith("interrupted at step ") and last.endswith(" of 100000 (generate g)"), last
