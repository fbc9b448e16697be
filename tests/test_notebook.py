"""Notebooks: examples/tour.ipynb executed by a real kernel, the `%%deltalang` magic, the HTML of results.

The tour runs in a fresh ipykernel through nbclient, as Jupyter would run it; its
printed values are checked against plain transformers (`tests/reference.py`: the
state after a token, a probability with the memories zeroed) and against the same
programs run in this process, so the notebook can neither go stale nor print
something other than what it says. Nothing in it may print to stderr (progress bars,
warnings) or show a traceback; its one mistake shows as the command line's lines.
The magic's options, errors and variables, and the HTML renderers, are tested
in-process.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import nbformat
import pytest
import torch
from nbclient import NotebookClient
from reference import Reference, Write, zeros

import deltalang
import deltalang.models.bundled
from deltalang.ground import html
from deltalang.notebook import CellError, parse_line, run_cell

ROOT = Path(__file__).resolve().parent.parent
TOUR = ROOT / "examples" / "tour.ipynb"
PROMPT = "The Eiffel Tower is in the city of"
PARIS = 'prob(" Paris")'


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


@pytest.fixture(scope="module")
def reference() -> Reference:
    from transformers import AutoModelForCausalLM

    return Reference(AutoModelForCausalLM.from_pretrained(deltalang.models.bundled.PATH, dtype=torch.float32))


@pytest.fixture(scope="module")
def tour() -> Any:
    """The tour, executed by a real kernel (the one cell tagged raises-exception may fail)."""
    nb = nbformat.read(TOUR, as_version=4)
    NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    return nb


def _cell(nb: Any, first_line: str) -> Any:
    """The code cell whose first line starts with `first_line` (exactly one)."""
    found = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(first_line)]
    assert len(found) == 1, first_line
    return found[0]


def _after(nb: Any, cell: Any) -> Any:
    return nb.cells[nb.cells.index(cell) + 1]


def _stdout(cell: Any) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in {text!r}"
    return float(m.group(1))


def _program(cell: Any) -> str:
    """A `%%deltalang` cell's program: the cell less its magic line."""
    return cell.source.split("\n", 1)[1]


def test_the_stored_tour_has_no_outputs() -> None:
    nb = nbformat.read(TOUR, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


def test_the_tour_prints_nothing_but_its_outputs(tour: Any) -> None:
    """No progress bar, warning, traceback or terminal escape anywhere: only what each cell means to show."""
    for cell in tour.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.outputs:
            assert not (out.output_type == "stream" and out.name == "stderr"), (cell.source, out.text)
            text = str(out.get("text", "")) + str(out.get("data", {}).get("text/plain", "")) + \
                "\n".join(out.get("traceback", []))
            assert "\x1b[" not in text and "Traceback" not in text and "Warning" not in text, text
        if "raises-exception" not in cell.metadata.get("tags", []):
            assert not any(o.output_type == "error" for o in cell.outputs), cell.source


def test_the_python_trace_is_transformers_state(tour: Any, model: deltalang.DeltaModel,
                                                 reference: Reference) -> None:
    cell = _cell(tour, "mix = model.layers[1]")
    shown = _number(r"Frobenius norm ([0-9.]+)", _stdout(cell))
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    truth = reference.run(ids).value(1, "state_after", 2).float().norm().item()
    assert shown == pytest.approx(truth, abs=2e-6)


def test_the_magic_gives_what_deltalang_run_gives(tour: Any, model: deltalang.DeltaModel,
                                                  reference: Reference) -> None:
    cell = _cell(tour, "%%deltalang --model model -o res")
    page = next(o for o in cell.outputs if o.output_type == "execute_result").data["text/html"]
    assert "<table>" in page and "ablated.prob(&quot; Paris&quot;)" in page
    printed = _stdout(_after(tour, cell))
    here = deltalang.run(_program(cell), model=model)
    assert _number(r"([0-9.]+) clean", printed) == pytest.approx(here[f"base.{PARIS}"], abs=6e-7)
    assert _number(r"([0-9.]+) with every memory", printed) == pytest.approx(here[f"ablated.{PARIS}"], abs=6e-7)
    assert _number(r"at most ([0-9.e+-]+)", printed) < 1e-5
    # the ablation against transformers: every DeltaNet block's state after ' Tower' (token 2) zeroed
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    paris = model.tokenizer(" Paris").input_ids[0]
    rec = reference.run(ids, [Write(b, "state_after", zeros, position=2) for b in model.spec.linear_layers()])
    truth = rec.value(None, "next_token_probs")[0, paris].item()
    assert _number(r"([0-9.]+) with every memory", printed) == pytest.approx(truth, abs=2e-6)


def test_the_sweep_shows_progress_table_and_heatmap(tour: Any, model: deltalang.DeltaModel,
                                                    reference: Reference) -> None:
    cell = _cell(tour, "%%deltalang --model model -o ablation")
    texts = [o.data.get("text/plain", "") for o in cell.outputs if o.output_type == "display_data"]
    assert any(re.fullmatch(r"ablate: 48/48 cells, .* elapsed", t) for t in texts), texts
    result = next(o for o in cell.outputs if o.output_type == "execute_result").data
    assert "t \\ L" in result["text/plain"] and "ResultRow(" not in result["text/plain"]  # a text front end's tables
    page = result["text/html"]
    pngs = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(pngs) == 1 and base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")
    assert "t \\ L" in page and "5 ␣the" in page  # tokens down, blocks across, as the terminal table
    printed = _stdout(_after(tour, cell))
    shown = _number(r"lowest P\(' Paris'\): ([0-9.]+)", printed)
    block, token = (int(x) for x in re.search(r"zeroing L(\d+)'s memory after token (\d+)", printed).groups())
    grid = deltalang.run_sweep(_program(cell), model, progress=False).tables[0].grid(PARIS)
    assert (block, token) == min(grid, key=lambda k: grid[k])
    assert shown == pytest.approx(grid[(block, token)], abs=6e-7)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    paris = model.tokenizer(" Paris").input_ids[0]
    rec = reference.run(ids, [Write(block, "state_after", zeros, position=token)])
    assert shown == pytest.approx(rec.value(None, "next_token_probs")[0, paris].item(), abs=2e-6)


def test_a_mistake_in_the_tour_is_the_command_line_s_lines(tour: Any) -> None:
    cell = next(c for c in tour.cells if "raises-exception" in c.metadata.get("tags", []))
    (error,) = [o for o in cell.outputs if o.output_type == "error"]
    head, source, caret = error.traceback  # the message, the program's line, the caret: nothing else
    assert re.match(r"<cell>:\d+:\d+: error: \S", head)
    assert source.strip() in _program(cell).splitlines()
    assert set(caret.strip()) == {"^"}


# ---- the magic in this process ------------------------------------------------------------


def test_the_magic_stores_results_in_the_named_variable(model: deltalang.DeltaModel) -> None:
    ns: dict[str, Any] = {"m": model}
    value = run_cell(f'--model m --prompt "{PROMPT}" -o out', f"measure {PARIS}\n", ns)
    assert ns["out"] is value
    assert value[f"main.{PARIS}"] == deltalang.run(f"measure {PARIS}", model=model, prompt=PROMPT)[f"main.{PARIS}"]


def test_a_warning_is_rendered_and_the_cell_runs(model: deltalang.DeltaModel,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    value = run_cell(f'--model m --prompt "{PROMPT}"', 'read L0.state_after("Eiff") as e\n', {"m": model})
    err = capsys.readouterr().err.splitlines()
    assert re.match(r'<cell>:1:\d+: warning: .*"Eiff"', err[0]) and set(err[2].strip()) == {"^"}, err
    assert "e" in value and not any("Warning" in line for line in err)


@pytest.mark.parametrize(("line", "said"), [
    ("--no-such-option", "error: %%deltalang: unrecognized arguments: --no-such-option"),
    ("-o 1x", "error: %%deltalang: -o '1x' is not a Python name"),
    ("program.dl", "error: %%deltalang: the cell is the program"),
    ('--prompt "unclosed', "error: %%deltalang: cannot read the options"),
    ('--prompt ""', "error: --prompt is empty"),
    ("--remote", "error: remote execution is not supported"),
])
def test_a_bad_option_is_one_line(line: str, said: str) -> None:
    with pytest.raises(CellError) as e:
        run_cell(line, f"measure {PARIS}\n", {})
    lines = e.value._render_traceback_()
    assert len(lines) == 1 and lines[0].startswith(said), lines


ONE_SWEEP = f"""prompt clean = "{PROMPT}"
prompt other = "The Leaning Tower is in the city of"
sweep s on clean over L in L[linear], t in 1..4 {{
    write L.state_after(t) from other
    measure logit_diff(" Paris", " Pisa")
}}
"""


@pytest.mark.parametrize(("line", "cell", "said"), [
    ("--by x", ONE_SWEEP, "error: --by x groups the records in a sweep over a dataset; this program runs one prompt"),
    ("--align -1", ONE_SWEEP, "error: --align -1 counts a per-token measure's positions in a sweep over a dataset"),
    (f'--prompt "{PROMPT}" --attribution', f"measure {PARIS}\n",
     "error: --attribution: an option of a sweep; this program runs one prompt and has no sweep: drop it"),
    (f'--prompt "{PROMPT}" --normalise clean=a,corrupted=b --batch-size 2', f"measure {PARIS}\n",
     "error: --normalise, --batch-size: options of a sweep; this program runs one prompt"),
])
def test_an_option_the_cell_would_ignore_is_refused(model: deltalang.DeltaModel, line: str, cell: str,
                                                    said: str) -> None:
    """The magic took every option of `deltalang sweep` and dropped those its own paths did not pass on."""
    with pytest.raises(CellError) as e:
        run_cell(f"--model m {line}", cell, {"m": model})
    lines = e.value._render_traceback_()
    assert len(lines) == 1 and lines[0].startswith(said), lines


def test_the_magic_claims_its_out_directory_as_the_command_line(model: deltalang.DeltaModel,
                                                                tmp_path: Path) -> None:
    """--out DIR holding another program's results is refused, --replace deletes them first, --resume of a
    program that runs at once is refused: the notebook wrote beside them and ignored both flags."""
    other = tmp_path / "d"
    deltalang.run(f"measure {PARIS}", model=model, prompt=PROMPT).save(other)
    before = sorted(p.name for p in other.iterdir())
    line = f'--model m --prompt "{PROMPT}" --out {other}'
    with pytest.raises(CellError) as e:
        run_cell(line, f"read L0.state_after(-1) as s\nmeasure {PARIS}\n", {"m": model})
    assert f"error: --out {other} holds another program's results" in e.value._render_traceback_()[0]
    assert sorted(p.name for p in other.iterdir()) == before
    value = run_cell(line + " --replace", f"read L0.state_after(-1) as s\nmeasure {PARIS}\n", {"m": model})
    assert "s" in value and (other / "program.dl").read_text().startswith("read L0.state_after(-1) as s")
    with pytest.raises(CellError) as e:
        run_cell(line + " --resume", f"read L0.state_after(-1) as s\nmeasure {PARIS}\n", {"m": model})
    assert e.value._render_traceback_()[0].startswith("error: --resume continues a run over a dataset or a sweep")


def test_the_magic_runs_attribution_as_the_command_line(model: deltalang.DeltaModel, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`--attribution --steps 0` ran the exact sweep in a notebook; it is the command line's attribution."""
    from html import unescape

    from test_cli import cli

    from deltalang.sweep.attribution import Attribution

    value = run_cell(f"--model m --attribution --steps 0 --out {tmp_path / 'nb'}", ONE_SWEEP, {"m": model})
    assert isinstance(value, Attribution), type(value)
    assert "wrote " in capsys.readouterr().err and (tmp_path / "nb" / "attribution.csv").is_file()
    (tmp_path / "s.dl").write_text(ONE_SWEEP, encoding="utf-8")
    rc, out, err = cli("sweep", tmp_path / "s.dl", "--attribution", "--steps", "0")
    assert rc == 0, err
    assert value.table() in out and value.table() in unescape(value._repr_html_())
    cells = len({(r.block, r.position) for r in value.rows})
    assert repr(value).startswith(f"<Attribution: sweep s, {cells} cells; variants plain"), repr(value)


def test_help_prints_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cell("--help", "", {}) is None
    shown = capsys.readouterr().out
    assert shown.startswith("usage: %%deltalang") and "-o NAME" in shown and "--normalise" in shown
    assert "-e EXPR" not in shown and "[file]" not in shown  # the cell is the program
    assert parse_line("--naive -o x").naive


def test_an_internal_error_is_one_line_and_debug_shows_it(model: deltalang.DeltaModel,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from deltalang.runs.compiled import Experiment

    def broken(self: Any, **kw: Any) -> Any:  # Experiment.run(progress=...)
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(Experiment, "run", broken)
    ns = {"m": model}
    with pytest.raises(CellError) as e:
        run_cell(f'--model m --prompt "{PROMPT}"', f"measure {PARIS}\n", ns)
    assert e.value._render_traceback_() == [
        "error: internal error in deltalang (a bug, please report it): RuntimeError: boom",
        "  note: rerun with --debug to see the traceback"]
    with pytest.raises(RuntimeError, match="boom"):
        run_cell(f'--model m --prompt "{PROMPT}" --debug', f"measure {PARIS}\n", ns)


def test_ipython_loads_the_extension_and_shows_errors_without_a_traceback(
        model: deltalang.DeltaModel, capsys: pytest.CaptureFixture[str]) -> None:
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        shell.user_ns["m"] = model
        shell.run_line_magic("load_ext", "deltalang")
        ok = shell.run_cell(f'%%deltalang --model m --prompt "{PROMPT}" -o r\nmeasure {PARIS}\n')
        assert ok.success and shell.user_ns["r"] is ok.result
        capsys.readouterr()
        bad = shell.run_cell(f'%%deltalang --model m --prompt "{PROMPT}"\nmeasure prob(" Paris"\n')
        assert not bad.success and isinstance(bad.error_in_exec, CellError)
        shown = capsys.readouterr()
        assert "Traceback" not in shown.out + shown.err
        assert re.search(r"^<cell>:\d+:\d+: error: ", shown.out + shown.err, re.M)
    finally:
        InteractiveShell.clear_instance()


# ---- HTML ----------------------------------------------------------------------------------


def test_results_html_has_a_row_per_result_with_the_summary_s_text() -> None:
    from deltalang.runs.results import Results

    values = {'main.prob(" Paris")': 0.25, "a b": 1.5, "s": torch.ones(1, 4, 2, 2), "per": torch.ones(1, 3)}
    r = Results(values, kinds={"per": "norm"}, token_labels={"per": ("x", "<y>", "z")})
    rows, notes = html.summary_rows(r.summary(), list(r))
    assert [n for n, _ in rows] == list(values)
    assert rows[0][1] == "0.25" and rows[1][1] == "1.5" and "[1, 4, 2, 2]" in rows[2][1]
    assert rows[3][1].count("\n") == 3  # the per-token norm keeps a line per token
    assert notes and notes[0].startswith("(‖·‖F")
    page = r._repr_html_()
    assert page.count("<tr>") == 1 + len(values) and "&lt;y&gt;" in page and "<y>" not in page


def test_dataset_results_html() -> None:
    from deltalang.ground.datasets import Dataset, Record
    from deltalang.runs.dataset_run import DatasetResults, MeasureStats

    ds = Dataset("facts", "<data>", (Record(0, 1, {"q": "a"}), Record(1, 2, {"q": "<b>"})))
    out = DatasetResults(ds, (), (MeasureStats(PARIS, 0.5, 0.125, 1, 0.25, 0.75),), ((1, "no <token>"),))
    page = out._repr_html_()
    assert "1 of 2 records of &#x27;facts&#x27;" in page and ">0.5<" in page and "[0.25, 0.75]" in page
    assert "no &lt;token&gt;" in page and "row 2" in page


def test_notebook_progress_counts_cells(capsys: pytest.CaptureFixture[str]) -> None:
    with html.NotebookProgress(4) as bar:
        bar.update(0, advance=1, description="s")
        bar.update(0, advance=3)
    assert bar.text().startswith("s: 4/4 cells") and "left" not in bar.text()
    assert '<progress value="4" max="4">' in bar.line()._repr_html_()


def test_dataset_sweep_results_html_is_its_summary_with_heatmaps() -> None:
    from deltalang.ground.datasets import Dataset, Record
    from deltalang.runs.dataset_run import MeasureStats
    from deltalang.sweep.dataset import CellStats, DatasetSweepResults

    ds = Dataset("facts", "<data>", (Record(0, 1, {"q": "a"}), Record(1, 2, {"q": "<b>"})))
    ld = "logit_diff(facts.answer, facts.foil)"
    grid = [("L4", "facts.subject", -1.5), ("L4", "-1", 2.0), ("L6", "facts.subject", 0.25), ("L6", "-1", 3.0)]
    stats = [CellStats("restore", (("L", b), ("t", t)), MeasureStats(ld, m, 0.5, 1, m - 1, m + 1))
             for b, t, m in grid]
    stats.append(CellStats("one", (("h", "head 1"),), MeasureStats(ld, 7.0, 0.0, 1, 7.0, 7.0)))
    stats.append(CellStats("clean", (), MeasureStats("clean." + ld, 9.5, 0.0, 1, 9.5, 9.5)))
    axes = {"restore": (("L", ("L4", "L6")), ("t", ("facts.subject", "-1"))), "one": (("h", ("head 1",)),)}
    out = DatasetSweepResults(ds, (), tuple(stats), ((1, "no <token>"),), axes)
    page = out._repr_html_()
    assert "1 of 2 records of &#x27;facts&#x27;" in page
    assert page.count("<img src=\"data:image/png;base64,") == 1  # the one two-axis grid's heatmap
    assert "L \\ t" in page and "-1.5" in page and "0.25" in page and "facts.subject" in page
    assert "h=head 1" in page and ">7<" in page and "[7, 7]" in page  # a one-axis sweep's cells
    assert "clean." + ld in page.replace("&quot;", '"') and ">9.5<" in page
    assert "no &lt;token&gt;" in page and "<token>" not in page and "row 2" in page
    assert page.count("<tr>") == 3 + 2 + 2 + 2  # grid (header + 2 rows), one, others, left out
