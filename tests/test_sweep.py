"""Sweeps: the engine against the reference path, resuming, files, the text builder, the command.

The reference for every cell is the reference path itself: a one-trace program
holding that cell's writes, run alone through `deltalang.run` (unbatched), or
the sweep run with `engine="naive"` (every cell a full forward). Never the
engine against itself.
"""

from __future__ import annotations

import csv
import importlib
import io
import json
from pathlib import Path

import pytest
import torch

import deltalang
from deltalang.cli import main as cli_main
from deltalang.models.testing import FAMILY_NAMES, tiny_checkpoint
from deltalang.sweep import DeltaSweepError, run_sweep, sweep

CLEAN = "The Eiffel Tower is in"  # 22 byte tokens
PROMPTS = '''prompt clean = "The Eiffel Tower is in"
prompt other = "My favourite food is pizza"
prompts corpus = ["A cat sat on the warm mat", "Rain falls on the old town", "We ate bread"]
'''
MEASURES = 'prob("P"), logit_diff("P", "a"), kl(clean)'
ATOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


_MODELS: dict[str, deltalang.DeltaModel] = {}


def model_of(family: str) -> deltalang.DeltaModel:
    if family not in _MODELS:
        _MODELS[family] = deltalang.load_model(tiny_checkpoint(family))
    return _MODELS[family]


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return model_of("qwen3_5")


# ---------------------------------------------------------------------------
# every ablation kind, cell by cell, against one-cell programs
# ---------------------------------------------------------------------------

# (sweep, statements of the body with {L} {t} {label} for the single-cell program, axes, extra measures)
KINDS = {
    "zero": ("write L.state_after(t) = zeros", "write L{L}.state_after({t}) = zeros", "t in 19..22", ""),
    "zero_first": ("write L.state_after(0) = zeros", "write L{L}.state_after(0) = zeros", "", ""),
    "scale": ("write L.state_after(t) *= 0.5; write L.conv_window_after(t) *= 0.5",
              "write L{L}.state_after({t}) *= 0.5; write L{L}.conv_window_after({t}) *= 0.5", "t in 16..18",
              ", norm(L.state_after(t)), norm(L2.state_output)"),
    "resample": ("write L.state_after(t) from other", "write L{L}.state_after({label}) from other", "t in -3..0", ""),
    "mean": ("write L.state_after(5) = mean(corpus); write L.conv_window_after(5) = mean(corpus)",
             "write L{L}.state_after(5) = mean(corpus); write L{L}.conv_window_after(5) = mean(corpus)", "", ""),
    # two sites: the cell starts at the earlier block and position, the other write lands later
    "two_sites": ("write L.state_after(t) = zeros; write L2.conv_window_after(20) = zeros",
                  "write L{L}.state_after({t}) = zeros; write L2.conv_window_after(20) = zeros", "t in 19..22", ""),
}


def kind_program(kind: str) -> str:
    body, _, t_axis, extra = KINDS[kind]
    axes = "L in L[linear]" + (f", {t_axis}" if t_axis else "")
    return PROMPTS + f"sweep {kind} on clean over {axes} {{\n    {body}\n    measure {MEASURES}{extra}\n}}\n"


def single_cell(model: deltalang.DeltaModel, kind: str, layer: int, t: int | None, label: int | None
                ) -> deltalang.Results:
    """The reference: a program of one trace holding the cell's writes, run alone."""
    _, body, _, extra = KINDS[kind]
    extra = extra.replace("L.state_after(t)", f"L{layer}.state_after({t})")
    body = body.format(L=layer, t=t, label=label)
    src = PROMPTS + f"trace cell on clean {{\n    {body}\n    measure {MEASURES}{extra}\n}}\n"
    return deltalang.run(src, model, batch=False)


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_cell_equals_its_one_cell_program(family: str, kind: str) -> None:
    model = model_of(family)
    outcome = run_sweep(kind_program(kind), model, batch_size=2, progress=False)  # groups of 3 split in 2 forwards
    assert outcome.paths[kind] == "engine"
    run = next(r for r in deltalang.compile(kind_program(kind), model).resolved.runs if r.kind == "sweep")
    labels = dict(zip(run.axes[-1].values, run.axes[-1].labels))
    points = list(run.points())
    for point in points:
        cell = run.instantiate(point)
        t = point.get("t")
        ref = single_cell(model, kind, point["L"], t, labels.get(t))
        for m in cell.measures:
            measure = m.result_name[len(cell.name) + 1:]  # prob("P"), norm(L0.state_after(16)), ...
            got, expected = outcome.results[m.result_name], ref[f"cell.{measure}"]
            assert abs(got - expected) <= ATOL * max(1.0, abs(expected)), (family, kind, point, measure, got, expected)
    assert len(outcome.results) == len(points) * len(run.measures)


@pytest.mark.parametrize("family", [f for f in FAMILY_NAMES if f not in ("qwen3_5", "kimi_linear")])
def test_engine_equals_the_naive_path_on_the_other_families(family: str) -> None:
    model = model_of(family)
    src = PROMPTS + ('sweep z on clean over L in L[linear], t in 20..22 {\n'
                     '    write L.state_after(t) from other\n    write L.conv_window_after(t) = zeros\n'
                     f'    measure {MEASURES}\n}}\n')
    fast = run_sweep(src, model, progress=False)
    naive = run_sweep(src, model, progress=False, engine="naive")
    assert fast.paths["z"] == "engine" and naive.paths["z"].startswith("naive")
    assert set(fast.results) == set(naive.results)
    for key, value in naive.results.items():
        assert abs(fast.results[key] - value) <= ATOL * max(1.0, abs(value)), (family, key)


def _glm5_selecting(path: Path) -> Path:
    """A tiny glm5_next whose indexer drops tokens (index_topk 8 of 22, pools of 4) and whose second indexed
    block reuses the first one's top-k (`prev_topk_indices`, handed on in the block's output tuple)."""
    from deltalang.models import families, testing

    cfg = testing.tiny_config("glm5_next")
    text = cfg.text_config
    text.layer_types = ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"]
    text.indexer_types = ["full", "full", "shared", "full"]
    text.index_topk, text.index_kpool = 8, 4
    torch.manual_seed(0)
    hf = families.auto_class(cfg).from_config(cfg).eval()
    testing._enlarge_random_weights(hf)
    hf.save_pretrained(path)
    testing.byte_tokenizer().save_pretrained(path)
    return path


def test_the_engine_follows_a_sparse_indexer_and_a_shared_top_k(tmp_path: Path) -> None:
    """The engine continues to the full run's length, so the indexer scores the same pools as the naive run
    (its ties broken over an array as long), and a shared block gets the top-k its predecessor recomputed."""
    model = deltalang.load_model(_glm5_selecting(tmp_path / "glm5"))
    src = PROMPTS + ('sweep z on clean over L in L[linear], t in 10..21 {\n'
                     '    write L.state_after(t) from other\n'
                     f'    measure {MEASURES}\n}}\n')
    fast = run_sweep(src, model, progress=False)
    naive = run_sweep(src, model, progress=False, engine="naive")
    assert fast.paths["z"] == "engine" and set(fast.results) == set(naive.results)
    assert max(naive.results.values()) - min(naive.results.values()) > 0.1  # the cells move the measures
    for key, value in naive.results.items():
        assert abs(fast.results[key] - value) <= ATOL * max(1.0, abs(value)), key


def test_a_prefix_shorter_than_a_cached_token_window_takes_the_naive_path() -> None:
    """qwen4_exp's n-gram embedding caches the last ngram_size - 1 token ids; after a shorter prefix its own
    code pads them with a token of its choosing, which the cache cannot tell: the engine says so and the
    naive path serves the cells; from a longer prefix the engine serves them."""
    model = model_of("qwen4_exp")
    src = PROMPTS + ('sweep z on clean over L in L[linear], t in 1..2 {\n'
                     f'    write L.state_after(t) from other\n    measure {MEASURES}\n}}\n')
    fast = run_sweep(src, model, progress=False)
    assert fast.paths["z"] == "naive: a cache state of token ids 2 wide after only 1 tokens: the model's own " \
                              "code pads so short a prefix itself"
    assert run_sweep(src.replace("1..2", "2..3"), model, progress=False).paths["z"] == "engine"


def test_cells_at_nearby_starts_share_a_forward(model: deltalang.DeltaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later start joins an earlier start's forward while its rows x the positions between cost little (a
    forward's fixed cost): a sparse set of cells, like attribution's refined ones, is not one forward each.
    The values stay the reference path's."""
    engine = importlib.import_module("deltalang.sweep.engine")
    real, calls = engine.run_rows, []

    def counted(m: deltalang.DeltaModel, cap: object, rows: list, start: int, *rest: object) -> object:
        calls.append((start, len(rows)))
        return real(m, cap, rows, start, *rest)

    monkeypatch.setattr(engine, "run_rows", counted)
    src = PROMPTS + ('sweep z on clean over L in L[linear], t in 3, 4, 6, 20 {\n'
                     f'    write L.state_after(t) from other\n    measure {MEASURES}\n}}\n')
    fast = run_sweep(src, model, progress=False)
    blocks = len(model.spec.linear_layers())
    assert fast.paths["z"] == "engine" and calls == [(3, 3 * blocks), (20, blocks)]  # 20: 17 positions x blocks
    naive = run_sweep(src, model, progress=False, engine="naive")
    assert set(fast.results) == set(naive.results)
    for key, value in naive.results.items():
        assert abs(fast.results[key] - value) <= ATOL * max(1.0, abs(value)), key


def test_donors_from_a_trace_with_writes_and_several_captures(model: deltalang.DeltaModel,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`from RUN` takes RUN's intervened value; start positions split over several clean captures agree."""
    engine = importlib.import_module("deltalang.sweep.memory")  # where the captures are sized
    monkeypatch.setattr(engine, "PREFIX_BYTES", 1)  # one start position per capture
    src = PROMPTS + ('trace patched on other {\n    write L1.state_after(10) = zeros\n}\n'
                     'sweep s on clean over L in L[linear], t in 19..22 {\n    write L.state_after(t) from patched\n'
                     f'    measure {MEASURES}\n}}\n')
    fast = run_sweep(src, model, progress=False)
    assert fast.paths["s"] == "engine"
    for L in (0, 1, 2):
        for t in (19, 20, 21):
            one = PROMPTS + ('trace patched on other {\n    write L1.state_after(10) = zeros\n}\n'
                             f'trace cell on clean {{\n    write L{L}.state_after({t}) from patched\n'
                             f'    measure {MEASURES}\n}}\n')
            ref = deltalang.run(one, model, batch=False)
            for m in ('prob("P")', 'logit_diff("P", "a")', "kl(clean)"):
                assert abs(fast.results[f"s[L={L},t={t}].{m}"] - ref[f"cell.{m}"]) <= ATOL, (L, t, m)


def test_blocks_before_the_first_recomputed_one_keep_their_cache() -> None:
    """An attention block before every DeltaNet block sizes the masks: its prefix must be in the cache."""
    from transformers import AutoModelForCausalLM

    from deltalang.models.testing import _enlarge_random_weights, byte_tokenizer, tiny_config
    from deltalang.runtime.model import wrap_model

    cfg = tiny_config("qwen3_5")
    cfg.layer_types = ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    _enlarge_random_weights(hf)
    model = wrap_model(hf, byte_tokenizer(), "tiny attention-first qwen3_5")
    src = PROMPTS + ('sweep z on clean over L in L[linear], t in 18..22 {\n    write L.state_after(t) from other\n'
                     f'    measure {MEASURES}\n}}\n')
    fast = run_sweep(src, model, progress=False, batch_size=3)
    naive = run_sweep(src, model, progress=False, engine="naive")
    assert fast.paths["z"] == "engine"
    for key, value in naive.results.items():
        assert abs(fast.results[key] - value) <= ATOL * max(1.0, abs(value)), key


def test_the_zero_ablation_moves_the_answer(model: deltalang.DeltaModel) -> None:
    """Not a no-op: ablating the last token's memory changes the prediction in some block."""
    outcome = run_sweep(kind_program("zero"), model, progress=False)
    kls = [v for k, v in outcome.results.items() if k.endswith("kl(clean)")]
    assert max(kls) > 1e-4


# ---------------------------------------------------------------------------
# what the engine cannot serve runs the reference path, and says why
# ---------------------------------------------------------------------------


def test_a_body_with_reads_takes_the_naive_path(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    src = PROMPTS + '''trace base on clean { measure prob("P") }
sweep curve on clean over t in 19..22 {
    write L0.state_after(t) = zeros
    read L1.state_output as s
    measure norm(L1.states), prob("P")
}
'''
    outcome = run_sweep(src, model, out=tmp_path, progress=False)
    assert outcome.paths["curve"].startswith("naive: it reads L1.state_output")
    assert 'base.prob("P")' in outcome.results  # the program's other runs run too
    assert outcome.results["curve[t=19].s"].shape == (1, 4, 16, 8)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "sweep.csv").read_text())))
    per_token = [r for r in rows if r["measure"] == "norm(L1.states)"]
    assert len(per_token) == 3 * 22 and {r["position"] for r in per_token} == {str(p) for p in range(22)}
    assert (tmp_path / "curve-norm_L1_states.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "curve-prob_P.png").exists()


# ---------------------------------------------------------------------------
# files, resuming
# ---------------------------------------------------------------------------

RESUMABLE = PROMPTS + '''sweep grid on clean over L in L[linear], t in 16..20 {
    write L.state_after(t) = zeros
    measure prob("P"), kl(clean)
}
'''


class Stop(KeyboardInterrupt):
    pass


def test_csv_json_and_heatmap(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    outcome = run_sweep(RESUMABLE, model, out=tmp_path, progress=False,
                        normalise="clean=clean,corrupted=other")
    rows = list(csv.reader(io.StringIO((tmp_path / "sweep.csv").read_text())))
    assert rows[0] == ["sweep", "L", "t", "measure", "position", "value"]
    assert len(rows) - 1 == 12 * 4  # cells x (2 measures + 2 normalised)
    assert rows[1][:4] == ["grid", "0", "16", 'prob("P")']
    meta = json.loads((tmp_path / "sweep.json").read_text())
    assert meta["complete"] and meta["done"]["grid"] == list(range(12))
    for name in ('grid-prob_P.png', 'grid-kl_clean.png', 'grid-normalised_prob_P.png'):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG", name
    # normalised = (patched - corrupted) / (clean - corrupted), from the reference runs
    ref = deltalang.run(PROMPTS + 'trace a on clean { measure prob("P") }\ntrace b on other { measure prob("P") }',
                        model)
    clean, corrupted = ref['a.prob("P")'], ref['b.prob("P")']
    patched = outcome.results['grid[L=1,t=17].prob("P")']
    assert abs(outcome.results['grid[L=1,t=17].normalised(prob("P"))']
               - (patched - corrupted) / (clean - corrupted)) < 1e-4


def test_an_interrupted_sweep_resumes_to_the_same_csv(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_sweep(RESUMABLE, model, out=whole, batch_size=2, progress=False)

    def stop_after_five(done: int) -> None:
        if done >= 5:
            raise Stop

    with pytest.raises(Stop):
        run_sweep(RESUMABLE, model, out=cut, batch_size=2, progress=False,
                  on_chunk=stop_after_five)  # type: ignore[arg-type]
    meta = json.loads((cut / "sweep.json").read_text())
    saved = len(meta["done"]["grid"])
    assert not meta["complete"] and 5 <= saved < 12
    with open(cut / "sweep.csv", "a") as f:
        f.write("grid,2,19,prob(")  # a crash mid-write leaves a torn line
    with pytest.raises(DeltaSweepError, match="unfinished sweep"):
        run_sweep(RESUMABLE, model, out=cut, progress=False)
    computed: list[int] = []
    resumed = run_sweep(RESUMABLE, model, out=cut, resume=True, progress=False, on_chunk=computed.append)
    assert computed[-1] == 12 - saved  # only the cells not on disk
    assert (cut / "sweep.csv").read_text() == (whole / "sweep.csv").read_text()
    assert json.loads((cut / "sweep.json").read_text())["complete"]
    assert len([k for k in resumed.results if k.endswith('prob("P")')]) == 12


def test_resume_refuses_another_program(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    run_sweep(RESUMABLE, model, out=tmp_path, progress=False)
    with pytest.raises(DeltaSweepError, match="another program"):
        run_sweep(RESUMABLE.replace("16..20", "16..19"), model, out=tmp_path, resume=True, progress=False)
    with pytest.raises(DeltaSweepError, match="nothing to resume"):
        run_sweep(RESUMABLE, model, out=tmp_path / "empty", resume=True, progress=False)
    with pytest.raises(DeltaSweepError, match="no trace or prompt named 'nope'"):
        run_sweep(RESUMABLE, model, progress=False, normalise="clean=clean,corrupted=nope")


# ---------------------------------------------------------------------------
# deltalang.sweep(): the program text
# ---------------------------------------------------------------------------


def test_sweep_builds_a_program_that_runs(model: deltalang.DeltaModel) -> None:
    text = sweep('write L.state_after(t) = zeros; measure prob("P")', L="L[linear]", t=range(19, 22),
                 prompt=CLEAN, name="ablate")
    assert "sweep ablate on clean over L in L[linear], t in 19..22 {" in text
    results = deltalang.run(text, model)  # deltalang.run takes the engine for sweeps
    assert len([k for k in results if k.startswith("ablate[")]) == 9
    listed = sweep("write B.state_after(-1) from other\nmeasure kl(clean)", B=[0, 2], prompt=CLEAN,
                   prompts={"other": "My favourite food is pizza"})
    assert "over B in L[0, 2] {" in listed and 'prompt other = "My favourite food is pizza"' in listed
    assert len(deltalang.run(listed, model)) == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"t": [1, 3]}, "contiguous"),
    ({"u": range(3)}, "not used in the template"),
    ({}, "at least one axis"),
])
def test_sweep_refuses_what_the_language_cannot_say(kwargs: dict, message: str) -> None:
    with pytest.raises(DeltaSweepError, match=message):
        sweep("write L0.state_after(t) = zeros", prompt=CLEAN, **kwargs)


# ---------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------


def test_the_sweep_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = tmp_path / "grid.dl"
    program.write_text(RESUMABLE)
    ckpt = str(tiny_checkpoint("qwen3_5"))
    out = tmp_path / "out"
    assert cli_main(["sweep", str(program), "--model", ckpt, "--out", str(out), "--batch-size", "4"]) == 0
    captured = capsys.readouterr()
    assert "grid: prob(\"P\")" in captured.out and "L0" in captured.out
    assert "engine" in captured.err and "12/12" in captured.err
    assert (out / "sweep.csv").exists() and (out / "results.json").exists()
    assert cli_main(["sweep", str(program), "--model", ckpt, "--out", str(out), "--resume"]) == 0
    assert cli_main(["run", str(program), "--model", ckpt]) == 0  # `run` takes the engine too
    assert "grid: kl(clean)" in capsys.readouterr().out
    assert cli_main(["sweep", str(program), "--model", ckpt, "--resume"]) == 1
    assert "--resume is about the run's --out directory: give --out DIR" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# the examples, on the bundled model
# ---------------------------------------------------------------------------


@pytest.mark.skipif(not (Path(deltalang.__file__).parent / "models" / "bundled" / "model" / "config.json").exists(),
                    reason="the bundled model is not built")
@pytest.mark.parametrize("name", ["sweep_state_ablation", "sweep_resample"])
def test_the_sweep_examples_on_the_bundled_model(name: str) -> None:
    text = (Path(__file__).parents[1] / "examples" / f"{name}.dl").read_text()
    bundled = deltalang.load_model()
    normalise = "clean=clean,corrupted=other" if name == "sweep_resample" else None
    fast = run_sweep(text, bundled, progress=False, normalise=normalise)
    naive = run_sweep(text, bundled, progress=False, normalise=normalise, engine="naive")
    assert set(fast.paths.values()) == {"engine"} and len(fast.results) == len(naive.results) > 0
    for key, value in naive.results.items():
        assert abs(fast.results[key] - value) <= ATOL * max(1.0, abs(value)), key
    probs = [v for k, v in fast.results.items() if k.endswith('.prob(" Paris")')]
    assert max(probs) > 0.5 and min(probs) < 0.1  # some memories carry the answer, most do not
