"""The sweep engine, datasets and steering on Mamba-2 (SSD) hybrids, against transformers and the reference path.

Ground truth is a plain transformers model of the same tiny checkpoint (its own instance, no deltalang site).
A write of the state after token t of block L is transformers run on tokens 0..t-2 (its cache), then the rest
of the prompt continued from that cache, block L's prompt scan (transformers' own `mamba2_chunk_scan`) cut
after token t, the state there replaced (a donor's, zeros, or the state plus a direction) and token t's output
re-read from it (y = h C + D x: a written state changes token t's own output, docs/mamba2.md), the scan
continued from it with `initial_states`. The continuation holds two tokens or more, so transformers runs its
prompt scan there as one full forward does (a one-token continuation would take the decode step). A write of
the window after t is transformers run on 0..t, the cache's `conv_states` edited, the rest continued. A donor's
state or window is transformers' cache after the donor's first t + 1 tokens.

Every cell of a sweep is checked three ways: the engine's value, the reference path's (`engine="naive"`: full
forwards, several cells as invokes) and transformers'. Nothing is compared with the engine's own output, except
a cell computed alone against the same cell computed beside others (equal to float noise).
"""

from __future__ import annotations

import functools
import importlib
import json
import shutil
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import cache_after as _cache_after
from reference import hf_forward as _forward
from reference import kernel_patched

import deltalang
from deltalang.models import internals, testing, testing_ssd
from deltalang.sweep import run_sweep

SERVED = testing_ssd.MAMBA2_FAMILY_NAMES  # all six, zamba2 too (sweep/job.py's ENGINE_SSM_FAMILIES)
CLEAN = "The Eiffel Tower is in"  # 22 byte tokens
MIDDLE = 10  # a write in the middle of the prompt: 11 later tokens continue from it
STATE_AT, WINDOW_AT = f"{MIDDLE}, 17, 18, 19, 20, 21", f"{MIDDLE}, 17, 18, 19, 20"  # and the last positions
OTHER = "A green frog sat on it"  # 22 too: the donor's token t is its own token t
TOL = 2e-5  # relative to max(1, |value|), a logit_diff's to the logits' size (`_scale`): float32 noise
Fn = Callable[[torch.Tensor], torch.Tensor]  # the state the scan reached -> the state written

pytestmark = pytest.mark.usefixtures("one_thread")


# zamba2 with its shared block's optional rotary positions and per-use attention adapters (each use of the shared
# block picks its adapter by the layer index its call passes: the one the clean capture binds; transformers' adapters
# take as many key/value heads as query heads)
VARIANTS = {"zamba2+options": ("zamba2", {"use_mem_rope": True, "use_shared_attention_adapter": True,
                                          "num_key_value_heads": 4})}


@functools.lru_cache(maxsize=None)
def _models(name: str) -> tuple[deltalang.DeltaModel, Any]:
    """(deltalang's model, a plain transformers model of the same checkpoint)."""
    from transformers import AutoModelForCausalLM

    if name in VARIANTS:
        family, fields = VARIANTS[name]
        path = testing.built_once(name, lambda n, p: testing_ssd.build_tiny_ssd(family, p, **fields),
                                  prefix="deltalang-ssd-")
    else:
        path = testing_ssd.tiny_ssd_checkpoint(name)
    return deltalang.load_model(path), AutoModelForCausalLM.from_pretrained(path).eval()


def _ids(model: deltalang.DeltaModel, text: str) -> torch.Tensor:
    return torch.tensor([model.spec.token_ids(text)])


def _close(got: float, want: float, what: Any, scale: float = 1.0) -> None:
    assert abs(got - want) <= TOL * max(scale, abs(want)), (what, got, want)


@functools.lru_cache(maxsize=None)
def _logit_scale(name: str) -> float:
    """The clean run's largest last-token logit in magnitude (at least 1)."""
    model, hf = _models(name)
    return max(1.0, float(_forward(hf, _ids(model, CLEAN)).logits[0, -1].abs().max()))


def _scale(name: str, measure: str) -> float:
    """What a measure's tolerance is relative to, at least: a logit_diff's float noise follows the size of the
    logits, not of their difference (zamba2's tiny checkpoint ties its enlarged embeddings to its head: its
    logits reach ~24, the other families' ~3), the other measures' 1."""
    return _logit_scale(name) if measure.startswith("logit_diff") else 1.0


def _scan_written(name: str, hf: Any, writes: Mapping[int, Fn], cut: int) -> AbstractContextManager[None]:
    """Inside: each written layer's prompt scan is cut after its call's token `cut`, the state there replaced by
    `writes[layer](state)`, token `cut` re-read from it and the rest continued from it (`initial_states`)."""
    def scan(layer: int, original: Callable[..., Any], a: tuple, kw: dict) -> Any:
        if layer not in writes:
            return original(*a, **kw)
        x, dt, A, B, C = a
        assert kw.get("z") is None, "a gated prompt scan: the re-read would need the gate"
        final = kw.pop("return_final_states", False)
        start = kw.pop("initial_states", None)
        e = cut + 1
        y, state = original(x[:, :e], dt[:, :e], A, B[:, :e], C[:, :e], initial_states=start,
                            return_final_states=True, **kw)
        state = writes[layer](state)
        heads = state.shape[1]
        c = C[:, cut].float().repeat_interleave(heads // C.shape[2], dim=1)  # [b, h, N]
        y = y.clone()
        y[:, cut] = ((state.float() @ c[..., None])[..., 0] + kw["D"].float()[:, None] * x[:, cut].float()).to(y.dtype)
        if e < x.shape[1]:
            rest, state = original(x[:, e:], dt[:, e:], A, B[:, e:], C[:, e:], initial_states=state,
                                   return_final_states=True, **kw)
            y = torch.cat([y, rest], dim=1)
        return (y, state) if final else y
    return kernel_patched(name.split("+")[0], hf, internals.SCAN_GLOBAL, scan)


def _state_written(name: str, hf: Any, ids: torch.Tensor, t: int, writes: Mapping[int, Fn]) -> tuple[Any, Any]:
    """transformers' last logits `[1, vocab]` and cache with the state after t of each layer of `writes` written."""
    p = max(0, t - 1)  # two tokens or more continue from the cache: the prompt scan
    cache = internals.output_cache(_forward(hf, ids[:, :p])) if p > 0 else None
    with _scan_written(name, hf, writes, t - p):
        out = _forward(hf, ids[:, p:], cache, start=p)
    return out.logits[:, -1], internals.output_cache(out)


def _window_written(hf: Any, ids: torch.Tensor, t: int, layer: int, window: torch.Tensor) -> tuple[Any, Any]:
    """transformers' last logits and cache with the convolution window after t of `layer` written."""
    cache = _cache_after(hf, ids, t)
    cache.get_conv_state(layer)[:, :, 1:] = window
    out = _forward(hf, ids[:, t + 1:], cache, start=t + 1)
    return out.logits[:, -1], internals.output_cache(out)


def _measures(model: deltalang.DeltaModel, logits: torch.Tensor, cache: Any, last: int) -> dict[str, float]:
    """prob("P"), logit_diff("P", "a") and norm(L{last}.state_output) of transformers' run, by hand."""
    p, a = model.spec.token_ids("P")[0], model.spec.token_ids("a")[0]
    x = logits[0].float()
    return {'prob("P")': float(x.softmax(-1)[p]), 'logit_diff("P", "a")': float(x[p] - x[a]),
            f"norm(L{last}.state_output)": float(cache.get_recurrent_state(last).float().norm())}


def _program(model: deltalang.DeltaModel) -> str:
    last = model.spec.ssm_layers()[-1]
    measures = f'prob("P"), logit_diff("P", "a"), norm(L{last}.state_output)'
    return (f'prompt clean = "{CLEAN}"\nprompt other = "{OTHER}"\n'
            f'sweep donor on clean over L in L[ssm], t in {STATE_AT} {{\n'
            f'    write L.state_after(t) from other\n    measure {measures}\n}}\n'
            f'sweep zero on clean over L in L[ssm], t in {STATE_AT} {{\n'
            f'    write L.state_after(t) = zeros\n    measure {measures}\n}}\n'
            f'sweep window on clean over L in L[ssm], t in {WINDOW_AT} {{\n'
            f'    write L.conv_window_after(t) = zeros\n    measure {measures}\n}}\n')


def _truth(name: str, sweep: str, layer: int, t: int) -> dict[str, float]:
    """transformers' measures of one cell of `_program`."""
    model, hf = _models(name)
    ids, last = _ids(model, CLEAN), model.spec.ssm_layers()[-1]
    if sweep == "window":
        shape = _cache_after(hf, ids, t).get_conv_state(layer)[:, :, 1:].shape
        return _measures(model, *_window_written(hf, ids, t, layer, torch.zeros(shape)), last)
    donor = _cache_after(hf, _ids(model, OTHER), t).get_recurrent_state(layer).clone()
    fn: Fn = (lambda s: donor) if sweep == "donor" else torch.zeros_like
    return _measures(model, *_state_written(name, hf, ids, t, {layer: fn}), last)


def _engine_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference path fails the test if a sweep falls back to it."""
    engine = importlib.import_module("deltalang.sweep.engine")

    def refuse(*args: Any, **kw: Any) -> None:
        raise AssertionError("the sweep fell back to the reference path")
    monkeypatch.setattr(engine, "run_naive", refuse)


def _cells(outcome: Any) -> dict[tuple[str, int, int, str], float]:
    """{(sweep, L, t, measure): value} from a sweep's results (`donor[L=0,t=17].prob("P")`)."""
    out = {}
    for key, value in outcome.results.items():
        head, measure = key.split("].", 1)
        sweep, point = head.split("[", 1)
        axes = dict(p.split("=") for p in point.split(","))
        out[sweep, int(axes["L"]), int(axes["t"]), measure] = value
    return out


# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", SERVED + tuple(VARIANTS))
def test_causal_tracing_cells_equal_the_reference_path_and_transformers(name: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Donor, zeros and window writes over every Mamba-2 block x a middle position (the later tokens continue
    from the write) and the last positions (the last token too): the engine's cells equal the reference path's
    and transformers' with the value written by hand."""
    model, _ = _models(name)
    src = _program(model)
    naive = _cells(run_sweep(src, model, progress=False, engine="naive"))
    _engine_only(monkeypatch)
    outcome = run_sweep(src, model, progress=False)
    assert outcome.paths == {"donor": "engine", "zero": "engine", "window": "engine"}
    fast = _cells(outcome)
    assert set(fast) == set(naive) and len(fast) == (6 + 6 + 5) * len(model.spec.ssm_layers()) * 3
    truths: dict[tuple[str, int, int], dict[str, float]] = {}
    for (sweep, layer, t, measure), value in naive.items():
        truth = truths.setdefault((sweep, layer, t), _truth(name, sweep, layer, t))
        scale = _scale(name, measure)
        _close(fast[sweep, layer, t, measure], value, (sweep, layer, t, measure), scale)
        _close(value, truth[measure], (sweep, layer, t, measure, "transformers"), scale)
    last = model.spec.ssm_layers()[-1]
    norms = [v for k, v in fast.items() if k[0] == "zero" and k[3].startswith("norm")]
    assert max(norms) - min(norms) > 1000 * TOL * max(norms)  # the writes show
    if name != "falcon_h1":  # its tiny Mamba-2 blocks move the logits by ~1e-5 only (test_ssd_values)
        diffs = [v for k, v in fast.items() if k[0] == "donor" and k[3].startswith("logit_diff")]
        assert max(diffs) - min(diffs) > 20 * TOL * max(1.0, max(abs(d) for d in diffs))
    assert any(k == ("zero", last, 21, f"norm(L{last}.state_output)") for k in fast)


@pytest.mark.parametrize("name", SERVED)
def test_a_cell_does_not_depend_on_the_cells_beside_it(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cell computed alone (one row a forward, the sweep cut to a few cells) equals the same cell computed
    with every other cell of its start in the same forward, to float noise."""
    model, _ = _models(name)
    _engine_only(monkeypatch)
    src = _program(model)
    together = _cells(run_sweep(src, model, progress=False))
    alone = _cells(run_sweep(src, model, progress=False, batch_size=1))
    few = _cells(run_sweep(src.replace(f"t in {STATE_AT}", "t in 20..22").replace(f"t in {WINDOW_AT}", "t in 19..21"),
                           model, progress=False, batch_size=2))
    assert set(alone) == set(together) and set(few) < set(together)
    for key, value in together.items():
        _close(alone[key], value, key, _scale(name, key[3]))
        if key in few:
            _close(few[key], value, key, _scale(name, key[3]))


def _clamping_nemotron_h(path: Path) -> Path:
    """The tiny nemotron_h whose prompt scan clamps small step sizes to 0.5, its decode step not: `time_step_min`
    sets the scan's limit before 5.25, `time_step_limit` from 5.25 on (a config field of its own there)."""
    shutil.copytree(testing_ssd.tiny_ssd_checkpoint("nemotron_h"), path)
    config = json.loads((path / "config.json").read_text())
    config["time_step_min"] = 0.5
    config["time_step_limit"] = [0.5, 1e30]
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_write_at_the_last_token_runs_the_prompt_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cell writing after the last token is one full forward's prompt scan, not transformers' decode step of
    that token from the cache (nemotron_h's step does not clamp the step sizes as its scan does, and it updates
    the cached state in place): the engine continues from a token earlier."""
    from transformers import AutoModelForCausalLM

    path = _clamping_nemotron_h(tmp_path / "nemotron_h")
    model, hf = deltalang.load_model(path), AutoModelForCausalLM.from_pretrained(path).eval()
    ids = _ids(model, CLEAN)
    s = ids.shape[1]
    last = model.spec.ssm_layers()[-1]
    step = internals.output_cache(_forward(hf, ids[:, -1:], _cache_after(hf, ids, s - 2), start=s - 1))
    whole = _cache_after(hf, ids, s - 1)
    gap = float((step.get_recurrent_state(last) - whole.get_recurrent_state(last)).norm())
    assert gap > 100 * TOL * float(whole.get_recurrent_state(last).norm())  # the decode step is not the scan here
    src = (f'prompt clean = "{CLEAN}"\nsweep zero on clean over L in L[ssm], t in -1..0 {{\n'
           f'    write L.state_after(t) = zeros\n'
           f'    measure prob("P"), logit_diff("P", "a"), norm(L{last}.state_output)\n}}\n')
    naive = _cells(run_sweep(src, model, progress=False, engine="naive"))
    _engine_only(monkeypatch)
    fast = _cells(run_sweep(src, model, progress=False))
    assert set(fast) == set(naive)
    for (sweep, layer, t, measure), value in naive.items():
        truth = _measures(model, *_state_written("nemotron_h", hf, ids, t, {layer: torch.zeros_like}), last)
        _close(fast[sweep, layer, t, measure], value, (layer, t, measure))
        _close(value, truth[measure], (layer, t, measure, "transformers"))


# --------------------------------------------------------------------------
# datasets and steering
# --------------------------------------------------------------------------

RECORDS = [  # different lengths (left-padded together); each corrupt prompt aligned token for token
    {"prompt": "A cat sat on the mat", "corrupt": "A dog sat on the rug", "subject": "mat", "answer": "P",
     "foil": "a"},
    {"prompt": "Rain falls on the old town", "corrupt": "Snow falls on the new town", "subject": "tow",
     "answer": "x", "foil": "y"},
    {"prompt": "We ate bread", "corrupt": "We ate toast", "subject": "bread", "answer": "e", "foil": "o"},
]
HAPPY, SAD = ["I love this", "What a joy it is"], ["I hate this", "What a pain"]


def _dataset_program(last: int) -> str:
    measures = f"logit_diff(facts.answer, facts.foil), norm(L{last}.state_output)"
    return (f'dataset facts = "facts.jsonl"\nprompts happy = {json.dumps(HAPPY)}\nprompts sad = {json.dumps(SAD)}\n'
            f'trace clean on facts {{\n    measure {measures}\n}}\n'
            f'trace patched on facts {{\n    write L[ssm].state_after(facts.subject) from facts.corrupt\n'
            f'    measure {measures}\n}}\n'
            f'trace steered on facts {{\n    write L[ssm].state_after(-1) += 2 * (mean(happy) - mean(sad))\n'
            f'    measure {measures}\n}}\n')


def _record_truth(name: str, record: Mapping[str, str], run: str) -> tuple[float, float]:
    """transformers' logit_diff(answer, foil) and norm of the last Mamba-2 block's final state for one record."""
    model, hf = _models(name)
    layers, last = model.spec.ssm_layers(), model.spec.ssm_layers()[-1]
    ids = _ids(model, record["prompt"])
    s = ids.shape[1]
    if run == "clean":
        out = _forward(hf, ids)
        logits, cache = out.logits[:, -1], internals.output_cache(out)
    elif run == "patched":
        t = record["prompt"].index(record["subject"]) + len(record["subject"]) - 1  # one token a byte
        donor = _cache_after(hf, _ids(model, record["corrupt"]), t)
        donors = {i: donor.get_recurrent_state(i).clone() for i in layers}
        logits, cache = _state_written(name, hf, ids, t, {i: (lambda _s, i=i: donors[i]) for i in layers})
    else:
        def mean(texts: list[str], i: int) -> torch.Tensor:  # each prompt's state after its own last token
            return torch.stack([_cache_after(hf, _ids(model, x), len(x) - 1).get_recurrent_state(i).clone()
                                for x in texts]).mean(dim=0)
        direction = {i: 2 * (mean(HAPPY, i) - mean(SAD, i)) for i in layers}
        logits, cache = _state_written(name, hf, ids, s - 1, {i: (lambda x, i=i: x + direction[i]) for i in layers})
    a, b = model.spec.token_ids(record["answer"])[0], model.spec.token_ids(record["foil"])[0]
    return float(logits[0, a] - logits[0, b]), float(cache.get_recurrent_state(last).float().norm())


@pytest.mark.parametrize("name", ["bamba", "granitemoehybrid"])
def test_a_dataset_with_donors_and_steering_equals_transformers_per_record(name: str) -> None:
    """Records of different lengths share left-padded forwards; a donor's state after the subject and a
    steering direction added to the state after the last token, on every Mamba-2 block, equal transformers'
    record by record."""
    model, _ = _models(name)
    last = model.spec.ssm_layers()[-1]
    res = deltalang.run(_dataset_program(last), model=model, data={"facts": RECORDS})
    assert not res.skipped
    got = {(r["record"], r["measure"].split(".", 1)[0], r["measure"].split(".", 1)[1].split("(")[0]): r["value"]
           for r in res.rows}
    assert len(got) == len(RECORDS) * 3 * 2
    for n, record in enumerate(RECORDS):
        for run in ("clean", "patched", "steered"):
            diff, norm = _record_truth(name, record, run)
            _close(got[n, run, "logit_diff"], diff, (n, run, "logit_diff"))
            _close(got[n, run, "norm"], norm, (n, run, "norm"))
        for run in ("patched", "steered"):  # the writes show, far beyond the tolerance
            assert abs(got[n, run, "norm"] - got[n, "clean", "norm"]) > 100 * TOL * got[n, "clean", "norm"], (n, run)


def test_a_one_token_continuation_copies_the_prefix_state_and_keeps_its_final_state() -> None:
    """`recompute.run_rows` from the last token runs transformers' decode step, which updates the cached state
    in place: each row continues from its own copy (the capture is left as it was), and the step's state is
    the call's final state."""
    from deltalang.sweep.recompute import Row, capture_clean, prefix_reads, run_rows

    model, hf = _models("bamba")
    ids = _ids(model, CLEAN)
    s, layers = ids.shape[1], model.spec.ssm_layers()
    cap = capture_clean(model, CLEAN, layers[0], prefix_reads(model, layers[0], s - 1))
    before = {k: v.clone() for k, v in cap.values.items()}
    rows = [Row(None, layers[0], s - 1, ()) for _ in range(2)]  # type: ignore[arg-type]
    with torch.no_grad():
        got = run_rows(model, cap, rows, s - 1, layers)
    step = _forward(hf, ids[:, -1:], _cache_after(hf, ids, s - 2), start=s - 1)
    for r in range(2):
        assert float((got.logits[r] - step.logits[0, -1]).abs().max()) <= TOL * float(step.logits.abs().max())
        for i in layers:
            want = internals.output_cache(step).get_recurrent_state(i)[0]
            assert float((got.state_outputs[i][r] - want).abs().max()) <= TOL * float(want.abs().max()), (r, i)
    assert all(torch.equal(before[k], cap.values[k]) for k in before)


def test_the_plan_says_which_path_each_sweep_takes() -> None:
    """`emit --plan`'s line per sweep: the engine on every Mamba-2 family of transformers (zamba2 too); the
    reference path, with its one reason, for a write the engine does not recompute and for a Mamba-2 family it
    is not checked on."""
    import attrs

    from deltalang.sweep.job import ENGINE_SSM_FAMILIES, path_lines

    src = (f'prompt clean = "{CLEAN}"\nprompt other = "{OTHER}"\n'
           'sweep a on clean over L in L[ssm], t in 17..22 {\n    write L.state_after(t) from other\n'
           '    measure prob("P")\n}\n'
           'sweep b on clean over L in L[ssm] {\n    write L.step_sizes = zeros\n    measure prob("P")\n}\n')
    for name in SERVED:
        spec = deltalang.load_spec(testing_ssd.tiny_ssd_checkpoint(name))
        assert spec.family.name == name
        assert path_lines(deltalang.check(src, spec)) == [
            "sweep a: the sweep engine serves its cells (the passes above are their reference form)",
            "sweep b: the reference path runs its cells, as the passes above (several cells per forward): the "
            "engine cannot serve it: it writes L.step_sizes: the engine recomputes writes of state_after(t) and "
            "conv_window_after(t)"], name
    other = attrs.evolve(spec, family=attrs.evolve(spec.family, name="mamba3"))
    line = path_lines(deltalang.check(src, other))[0]
    assert line.endswith("the engine cannot serve it: the engine is checked on the Mamba-2 families "
                         f"{', '.join(ENGINE_SSM_FAMILIES)} (tests/test_ssd_sweep.py), not yet on mamba3")


def test_a_sweep_over_a_dataset_equals_transformers_per_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dataset sweep (each record's one-prompt sweep through the engine): every Mamba-2 block x the subject and
    the last token, the corrupt prompt's state written, equals transformers record by record and cell by cell."""
    model, hf = _models("bamba")
    last = model.spec.ssm_layers()[-1]
    src = ('dataset facts = "facts.jsonl"\nsweep s on facts over L in L[ssm], t in facts.subject, -1 {\n'
           f'    write L.state_after(t) from facts.corrupt\n'
           f'    measure logit_diff(facts.answer, facts.foil), norm(L{last}.state_output)\n}}\n')
    _engine_only(monkeypatch)
    res = deltalang.run(src, model=model, data={"facts": RECORDS})
    assert not res.skipped and len(res.rows) == len(RECORDS) * len(model.spec.ssm_layers()) * 2 * 2
    for row in res.rows:
        record = RECORDS[row["record"]]
        ids, layer = _ids(model, record["prompt"]), int(row["L"][1:])
        subject = record["prompt"].index(record["subject"]) + len(record["subject"]) - 1
        t = subject if row["t"] == "facts.subject" else ids.shape[1] - 1
        donor = _cache_after(hf, _ids(model, record["corrupt"]), t).get_recurrent_state(layer).clone()
        logits, cache = _state_written("bamba", hf, ids, t, {layer: lambda _s: donor})
        a, b = model.spec.token_ids(record["answer"])[0], model.spec.token_ids(record["foil"])[0]
        want = (float(logits[0, a] - logits[0, b]) if row["measure"].startswith("logit_diff")
                else float(cache.get_recurrent_state(last).float().norm()))
        _close(row["value"], want, (row["record"], row["L"], row["t"], row["measure"]))


def test_the_capture_names_the_arguments_a_block_takes_positionally() -> None:
    """zamba2's decoder passes each block the embeddings, its layer index and two masks positionally: the clean
    capture records them under the names of the block's parameters (the embeddings are transformers' own), and a
    block call with more positional arguments than its forward names is refused with its reason."""
    from deltalang.sweep import continuation
    from deltalang.sweep.errors import Unsupported
    from deltalang.sweep.recompute import capture_clean

    model, hf = _models("zamba2")
    cap = capture_clean(model, CLEAN, 0, {})
    embeddings = hf.get_input_embeddings()(_ids(model, CLEAN))
    for i in range(model.spec.num_layers):
        assert cap.kwargs[i]["layer_idx"] == i
        assert torch.equal(cap.kwargs[i]["original_hidden_states"], embeddings)
        assert {"attention_mask", "causal_mask"} <= set(cap.kwargs[i])
    assert torch.equal(cap.inputs[0], embeddings)

    class Block(torch.nn.Module):
        def forward(self, hidden_states: torch.Tensor, *rest: Any) -> torch.Tensor:
            return hidden_states

    x = torch.zeros(1, 2, 3)
    assert continuation.named(Block(), (x,), {"cache": None}) == (x, {"cache": None})
    with pytest.raises(Unsupported, match="takes 2 arguments positionally"):
        continuation.named(Block(), (x, x), {})
