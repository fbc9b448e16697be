"""Readable output: named norms and axes in summaries, KL noise in tables, heatmaps, sweep.json's baselines, files.

The numbers printed are checked against torch and transformers computed here (a
plain forward of the tiny checkpoint), never against deltalang's own output.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import stat
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import deltalang
from deltalang.ground import display
from deltalang.language.ir import SweepAxis
from deltalang.models.testing import tiny_checkpoint
from deltalang.runs.results import Results, named_shape
from deltalang.sweep import run_sweep
from deltalang.sweep.job import ResultRow
from deltalang.sweep.plots import heatmap, plot_table
from deltalang.sweep.table import SweepTable, render_tables

CLEAN, OTHER = "The Eiffel Tower is in", "My favourite food is pizza"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model(tiny_checkpoint("qwen3_5"))


# ---- the printed summary ----------------------------------------------------------------------


def test_summary_names_axes_and_the_norm(model: deltalang.DeltaModel) -> None:
    r = deltalang.run(f'prompt p = "{CLEAN}"\ntrace t on p {{ read L0.state_output, L0.states, L0.betas\n'
                      f'  measure norm(L0.states) }}', model)
    lines = r.summary().splitlines()
    state = r["t.L0.state_output"]
    b, h, k, v = state.shape
    line = next(x for x in lines if x.startswith("t.L0.state_output "))
    assert f"[b={b}, heads={h}, key_dim={k}, value_dim={v}]" in line
    assert f"‖·‖F {display.number(float(state.float().norm()))}" in line  # the Frobenius norm over every axis
    assert f"[b={b}, s=" in next(x for x in lines if x.startswith("t.L0.states "))
    assert "heads=" in next(x for x in lines if x.startswith("t.L0.betas "))
    assert "per token, ‖·‖F over heads, key_dim, value_dim:" in next(x for x in lines if "norm(L0.states)" in x)
    assert lines[-1] == "(‖·‖F: the Frobenius norm over every axis of the tensor)"


def test_shapes_without_catalogue_names_stay_plain() -> None:
    assert named_shape("decays", (1, 8, 4)) == "[b=1, s=8, heads=4]"
    assert named_shape("decays", (1, 8, 4, 32)) == "[b=1, s=8, heads=4, key_dim=32]"  # Kimi's alternative
    assert named_shape("state_after", (4, 32)) == "[4, 32]"  # a rank the catalogue does not give
    assert named_shape("no_such_value", (2, 3)) == "[2, 3]"


def test_kl_noise_below_zero_shows_as_zero_but_stays_raw(tmp_path: Path) -> None:
    r = Results({"a.kl(clean)": -3e-9, "a.logit_diff": -3e-9},
                kinds={"a.kl(clean)": "kl", "a.logit_diff": "logit_diff"})
    lines = r.summary().splitlines()
    assert lines[0].split()[-1] == "0" and lines[1].split()[-1] == "-3e-09"
    r.save(tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["measures"]["a.kl(clean)"] == -3e-9


# ---- sweep tables and heatmaps ----------------------------------------------------------------


def _table(kind: str, values: dict[tuple[int, int], float]) -> SweepTable:
    axes = (SweepAxis("L", "block", (0, 1), (0, 1)), SweepAxis("t", "position", (0, 1, 2), (0, 1, 2)))
    rows = [ResultRow("g", i, (("L", L), ("t", t)), "m", None, x) for i, ((L, t), x) in enumerate(values.items())]
    return SweepTable("g", axes, ("a", "b", "c"), ["m"], rows, kinds={"m": kind})


def _cells(item: object) -> list[list[str]]:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(item)
    text = console.export_text()
    return [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]


def test_sweep_tables_show_kl_noise_as_zero() -> None:
    grid = {(L, t): (-2e-9 if (L, t) == (1, 2) else 0.5) for L in (0, 1) for t in (0, 1, 2)}
    kl = _cells(render_tables(_table("kl", grid))[1])
    diff = _cells(render_tables(_table("logit_diff", grid))[1])
    # the longer axis (t: 3 positions) down the rows
    assert [r[0] for r in kl] == ["0 a", "1 b", "2 c"]
    assert kl[2][2] == "0.000" and diff[2][2] == "-2.000e-09"  # grid cells keep their trailing zeros (display.cell)


def test_heatmap_is_oriented_like_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    grid = {(L, t): 10 * L + t for L in (0, 1) for t in (0, 1, 2)}
    table = _table("prob", {k: float(v) for k, v in grid.items()})
    shown = _cells(render_tables(table)[1])
    # the table: positions (the longer axis) down, blocks across
    assert [r[0] for r in shown] == ["0 a", "1 b", "2 c"]
    assert [[float(x) for x in r[1:]] for r in shown] == [[float(grid[(L, t)]) for L in (0, 1)] for t in (0, 1, 2)]
    drawn: dict[str, object] = {}

    def spy(data: list[list[float]], xlabels: list[str], ylabels: list[str], *a: object, **k: object) -> Path:
        drawn.update(data=data, x=list(xlabels), y=list(ylabels))
        return heatmap(data, xlabels, ylabels, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.import_module("deltalang.sweep.plots"), "heatmap", spy)
    assert plot_table(table, tmp_path)[0].read_bytes()[:4] == b"\x89PNG"
    assert drawn["y"] == [r[0] for r in shown] and drawn["x"] == ["L0", "L1"]
    assert drawn["data"] == [[float(x) for x in r[1:]] for r in shown]


def _colour_bar(kind: str, data: list[list[float]], tmp_path: Path) -> tuple[str, tuple[float, float], str]:
    import matplotlib.figure

    seen: dict[str, object] = {}
    original = matplotlib.figure.Figure.savefig

    def spy(fig: matplotlib.figure.Figure, *a: object, **k: object) -> None:
        image = fig.axes[0].images[0]
        seen.update(cmap=image.cmap.name, clim=image.get_clim(), label=fig.axes[1].get_ylabel())
        original(fig, *a, **k)

    matplotlib.figure.Figure.savefig = spy  # type: ignore[method-assign]
    try:
        heatmap(data, ["x0", "x1"], ["y0", "y1"], "t", "x", "y", tmp_path / f"{kind}.png", kind=kind,
                label=f"m {kind}")
    finally:
        matplotlib.figure.Figure.savefig = original  # type: ignore[method-assign]
    return seen["cmap"], seen["clim"], seen["label"]  # type: ignore[return-value]


def test_signed_effects_diverge_around_zero_and_probabilities_are_sequential(tmp_path: Path) -> None:
    cmap, (lo, hi), label = _colour_bar("logit_diff", [[-1.0, 3.0], [0.5, 2.0]], tmp_path)
    assert cmap == "RdBu_r" and (lo, hi) == (-3.0, 3.0) and label == "m logit_diff"
    cmap, (lo, hi), _ = _colour_bar("normalised", [[0.2, 1.0], [0.5, 0.9]], tmp_path)
    assert cmap == "RdBu_r" and (lo, hi) == (-1.0, 1.0)
    cmap, (lo, hi), _ = _colour_bar("prob", [[0.2, 0.3], [0.25, 0.4]], tmp_path)
    assert cmap == "viridis" and (lo, hi) == (0.0, 1.0)


# ---- files ------------------------------------------------------------------------------------


def _hf_prob(text: str, token: str, model: deltalang.DeltaModel) -> float:
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3_5")).eval()
    ids = model.tokenizer(text, return_tensors="pt").input_ids
    (tid,) = model.tokenizer(token, add_special_tokens=False).input_ids
    with torch.no_grad():
        return float(hf(ids).logits[0, -1].float().softmax(-1)[tid])


def test_sweep_json_keeps_the_normalise_baselines(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    program = (f'prompt clean = "{CLEAN}"\nprompt other = "{OTHER}"\n'
               'sweep g on clean over L in L[linear], t in 16..18 {\n  write L.state_after(t) = zeros\n'
               '  measure prob("P")\n}\n')
    run_sweep(program, model, out=tmp_path, progress=False, normalise="clean=clean,corrupted=other")
    base = json.loads((tmp_path / "sweep.json").read_text())["baselines"]["g"]['prob("P")']
    assert base["clean"] == pytest.approx(_hf_prob(CLEAN, "P", model), rel=1e-4, abs=1e-7)
    assert base["corrupted"] == pytest.approx(_hf_prob(OTHER, "P", model), rel=1e-4, abs=1e-7)
    assert not math.isclose(base["clean"], base["corrupted"])
    run_sweep(program.replace("t in 16..18", "t in 16..17"), model, out=tmp_path / "plain", progress=False)
    assert "baselines" not in json.loads((tmp_path / "plain" / "sweep.json").read_text())


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_saved_files_share_the_umask_mode(tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        Results({"x": torch.ones(2, 3), "m": 0.5}, program="p").save(tmp_path / "out")
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "out").iterdir()}
    assert set(modes) == {"results.safetensors", "results.json", "program.dl"}
    assert set(modes.values()) == {0o666 & ~mask}, modes


def test_measures_only_write_no_tensor_file(tmp_path: Path) -> None:
    Results({"x": torch.ones(2)}).save(tmp_path)
    assert (tmp_path / "results.safetensors").exists()
    r = Results({"m": 0.25}, program="p")
    assert r.files() == ["results.json", "program.dl"]
    r.save(tmp_path)  # a former run's tensors do not stay beside these results
    assert sorted(f.name for f in tmp_path.iterdir()) == ["program.dl", "results.json"]
