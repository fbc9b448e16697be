"""What deltalang prints (issue 38): numbers with significant digits and never a negative zero in every table,
tokens shown one way, titles never wrapped inside a measure, the emitted script printing what `run` prints,
a one-prompt attribution sweep's heatmap and its table saying what it left out."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltalang.runs.dataset_run import MeasureStats
from deltalang.runs.dataset_store import format_stats
from deltalang.runs.results import Results

ROOT = Path(__file__).parents[1]
NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def _close(shown: str, value: float) -> bool:
    return abs(float(shown) - value) <= 1e-3 * abs(value)


def test_a_small_norm_is_shown_with_significant_digits() -> None:
    value = torch.full((1, 2, 4, 4), 4.18e-06 / 8)  # a Frobenius norm of 4.18e-06
    line = Results({"s4": value}).summary().splitlines()[0]
    (shown, *_) = NUMBER.findall(line.split("‖·‖F", 1)[1])
    assert _close(shown, float(value.norm())), line


def test_a_small_std_is_shown_with_significant_digits() -> None:
    text = format_stats(MeasureStats("m", 1.0, 6.1e-06, 24, 1.0 - 2.6e-06, 1.0 + 2.6e-06))
    std = re.search(r"std (\S+)", text)[1]  # type: ignore[index]
    assert _close(std, 6.1e-06), text


def test_no_table_prints_a_negative_zero() -> None:
    text = format_stats(MeasureStats("m", -0.0, 0.0, 2, -0.0, 0.0))
    per_token = Results({"n": torch.tensor([[-0.0, 1.0]])}, kinds={"n": "norm"},
                        token_labels={"n": ("a", "b")}).summary()
    assert "-0" not in text and "-0" not in per_token, text + per_token


def test_no_module_formats_a_table_number_with_fixed_decimals() -> None:
    """Every table's numbers go through deltalang.ground.display: no `:.4f`-like format outside it (times and
    sizes excepted: they are not measured values)."""
    fixed = re.compile(r"\{[^{}]*:[<>^]?\d*\.\d+f\}")
    allowed = {"cli.py", "collect.py", "html.py", "driver.py"}  # seconds, bytes, cells/s
    found = [f"{p.relative_to(ROOT)}: {m[0]}" for p in (ROOT / "deltalang").rglob("*.py") if p.name not in allowed
             for m in fixed.finditer(p.read_text(encoding="utf-8"))]
    assert not found, found


def _rendered(items: list[object], width: int) -> str:
    from rich.console import Console

    console = Console(width=width, record=True)
    for item in items:
        console.print(item)
    return console.export_text()


def test_a_title_never_wraps_inside_a_measure() -> None:
    from deltalang.language.ir import SweepAxis
    from deltalang.sweep.job import ResultRow
    from deltalang.sweep.table import SweepTable, render_tables

    m = 'logit_diff(" Paris", " Rome")'
    two = (SweepAxis("L", "block", (0, 1), (0, 1)), SweepAxis("h", "head", (0, 1), (0, 1)))
    rows = [ResultRow("heads", i, (("L", L), ("h", h)), m, None, 0.5) for i, (L, h) in
            enumerate((L, h) for L in (0, 1) for h in (0, 1))]
    one = (SweepAxis("L", "block", (0, 1), (0, 1)),)
    rows1 = [ResultRow("heads", i, (("L", L),), m, None, 0.5) for i, L in enumerate((0, 1))]
    for width in (80, 200):
        for table in (SweepTable("heads", two, ("a", "b"), [m], rows, kinds={m: "logit_diff"}),
                      SweepTable("heads", one, ("a", "b"), [m], rows1, kinds={m: "logit_diff"})):
            text = _rendered(render_tables(table), width)
            assert m in text, text


def test_tables_show_tokens_one_way() -> None:
    """A per-token read and an attribution table show a token as the sweep tables do: `␣the`."""
    from deltalang.sweep.attribution import Attribution, AttributionRow

    table = Attribution("s", ["plain"], "plain", [AttributionRow(0, 1, " the", "m", {"plain": 0.5})], {}).table()
    assert "␣the" in table and "'" not in table.splitlines()[-1], table


ATTR = """prompt clean = "The Eiffel Tower is in the city of"
prompt other = "The Leaning Tower is in the city of"
sweep s on clean over L in L[linear], t in 1..8 method attribution steps 0 {
    write L.state_after(t) from other
    measure logit_diff(" Paris", " Pisa")
}
"""


def test_a_one_prompt_attribution_sweep_writes_its_heatmap_and_says_what_it_left_out(tmp_path: Path) -> None:
    from test_cli import cli

    (tmp_path / "attr.dl").write_text(ATTR, encoding="utf-8")
    rc, out, err = cli("sweep", tmp_path / "attr.dl", "--out", tmp_path / "d")
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "d").glob("*.png")) == ["s-logit_diff_Paris_Pisa.png"], err
    body = [line for line in out.splitlines() if line.startswith("L")]
    cells = len((tmp_path / "d" / "attribution.csv").read_text(encoding="utf-8").splitlines()) - 1
    assert cells > 20
    assert len(body) == 20 and f"20 of {cells} cells" in out and "attribution.csv" in out, out
    assert "␣the" in out and "'Ġthe'" not in out, out


def test_a_grid_cells_width_does_not_hang_on_its_last_digit() -> None:
    """1 thread printed -0.000186 where 2 printed -0.0001861 in a sweep grid (the same number within float32
    rounding), which moved the grid's columns in docs/examples.md: a cell keeps its trailing zeros."""
    from deltalang.ground import display

    assert display.cell(-0.00018600001) == "-0.0001860" and display.cell(-0.00018606) == "-0.0001861"
    assert display.cell(1.0) == "1.000" and display.cell(-1e-12 * 0) == "0.000" and display.cell(4.18e-06) == "4.180e-06"


EMITTED = {  # programs whose emitted script must print what `deltalang run` prints (issue 38)
    "reads": """prompt clean = "The Eiffel Tower is in the city of"
prompt other = "The Leaning Tower is in the city of"
trace t on clean {
    read L0.states as st
    read L1.states.head(1)
    read L1.state_after("Tower").head(2) as h
    read L[linear].states.mean(positions) as m
    read L2.states.norm(key_dim, value_dim) as n
    measure norm(L0.states)
}
trace w on other {
    write L1.state_after(3) from t
    read L1.states
    read L2.state_after(-1)
}
""",
    "measures": """prompt clean = "The Eiffel Tower is in the city of"
prompt other = "The Leaning Tower is in the city of"
trace a on clean {
    read next_token_probs as p
    measure prob(" Paris")
    measure logit_diff(" Paris", " Pisa")
    measure kl(b)
    measure norm(L4.states) as curve
}
trace b on other {
    read next_token_probs
}
generate g on clean max_new_tokens 3 {
    read tokens
    step 1: read L0.state_output
    step 2: read next_token_probs
}
""",
    "mamba2": """model "deltalang/bundled-tiny-mamba2-hybrid"
prompt clean = "The Eiffel Tower is in the city of"
trace t on clean {
    read L0.states
    read L0.state_after("Tower") as s
    read L1.states.norm(head_dim, d_state) as n
    read L1.states.mean(positions)
    read L[ssm].state_output
    measure norm(L0.states)
    measure prob(" Paris")
}
generate g on clean max_new_tokens 2 {
    read tokens
    step 1: read L0.state_output
}
""",
}
UNNAMED_SHAPE = re.compile(r"\[\d+(?:, \d+)*\]")  # `[1, 4, 32, 32]`: a shape that lost its axis names


@pytest.mark.parametrize("name", sorted(EMITTED))
def test_the_emitted_script_prints_what_run_prints(name: str, tmp_path: Path) -> None:
    """`python script.py` of `deltalang emit`'s script prints `deltalang run`'s lines: per-token norms as a table
    of tokens, shapes with their axis names (`as` names, reductions and one head's slices too), on DeltaNet and
    Mamba-2 blocks; its numbers within the docs tests' tolerance. The script printed one norm of the per-token
    norms and `[1, 8, 32, 16]`."""
    from test_cli import cli
    from test_examples import DECIMAL, number_matches

    program = tmp_path / f"{name}.dl"
    program.write_text(EMITTED[name], encoding="utf-8")
    rc, ran, err = cli("run", program)
    assert rc == 0, err
    rc, code, err = cli("emit", program)
    assert rc == 0, err
    script = tmp_path / f"{name}.py"
    script.write_text(code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = ran.splitlines(), proc.stdout.splitlines()
    assert [" ".join(DECIMAL.sub("#", line).split()) for line in got] == \
        [" ".join(DECIMAL.sub("#", line).split()) for line in want], f"script:\n{proc.stdout}\nrun:\n{ran}"
    for g, w in zip(DECIMAL.findall(proc.stdout), DECIMAL.findall(ran), strict=True):
        assert number_matches(g, w), f"{g} vs run's {w}\nscript:\n{proc.stdout}\nrun:\n{ran}"
    assert "per token" in ran and not UNNAMED_SHAPE.search(ran), ran


def test_a_sweep_programs_other_results_print_as_run_prints_them(tmp_path: Path) -> None:
    """A program with a sweep prints its traces' results as one without: `norm(L0.states)` per token, a reduction's
    axes named (it printed one norm of the per-token norms and `[1, 4, 32, 32]`)."""
    from test_cli import cli

    program = tmp_path / "s.dl"
    program.write_text('prompt clean = "The Eiffel Tower is in the city of"\n'
                       'trace t on clean {\n    measure norm(L0.states)\n    read L1.states.mean(positions) as m\n}\n'
                       'sweep s on clean over t in 0..2 {\n    write L0.state_after(t) = zeros\n'
                       '    measure prob(" Paris")\n}\n', encoding="utf-8")
    rc, out, err = cli("run", program)
    assert rc == 0, err
    assert "t.norm(L0.states)" in out and "per token" in out and "␣Tower" in out, out
    assert "[b=1, heads=4, key_dim=32, value_dim=32]" in out and not UNNAMED_SHAPE.search(out), out


def test_a_decode_steps_norm_is_not_labelled_with_the_prompts_first_token(tmp_path: Path) -> None:
    """`step 1: measure norm(L0.states)` is the norm of the one new token's state, a token made as the program runs:
    it printed as a per-token table of one row labelled with the prompt's first token (`The`)."""
    from test_cli import cli

    program = tmp_path / "g.dl"
    program.write_text('prompt clean = "The Eiffel Tower is in the city of"\n'
                       'generate g on clean max_new_tokens 2 {\n    step 0: measure norm(L0.states)\n'
                       '    step 1: measure norm(L0.states)\n}\n', encoding="utf-8")
    rc, out, err = cli("run", program)
    assert rc == 0, err
    step0 = out.split("g.step0.norm(L0.states)", 1)[1].split("g.step1", 1)[0]
    assert "per token" in step0 and len(re.findall(r"^    \S", step0, re.M)) == 8, out
    step1 = [line for line in out.splitlines() if line.startswith("g.step1.norm(L0.states)")]
    assert len(step1) == 1 and "per token" not in step1[0] and step1[0].endswith("[b=1, s=1]"), out
