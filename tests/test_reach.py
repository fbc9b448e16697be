"""Positions by the range and all at once, measures at a position, steering arithmetic and `load(...)`.

Every number is checked against transformers itself (tests/reference.py: the model's own forward over its
own cache, token by token, the writes applied by hand), never against deltalang's own output. The errors a
user can cause are one line each, checked by their words.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from reference import Reference, Write, kl, set_to, zeros
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import deltalang
from deltalang.compiler.explain import format_resolved
from deltalang.ground.errors import DeltaError
from deltalang.language import ast
from deltalang.language.parse import parse
from deltalang.models.testing import tiny_checkpoint
from deltalang.sweep import run_sweep

CLEAN = "The Eiffel Tower is in the city of"
OTHER = "My favourite food is pizza with"
HAPPY = ["I love this", "What a day"]
SAD = ["I hate this", "What a mess!"]
HEAD = (f'prompt clean = "{CLEAN}"\nprompt other = "{OTHER}"\n'
        f'prompts happy = ["{HAPPY[0]}", "{HAPPY[1]}"]\nprompts sad = ["{SAD[0]}", "{SAD[1]}"]\n')
LINEAR = (0, 1, 2)


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model(tiny_checkpoint("qwen3_5"))


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference(AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3_5")))


@pytest.fixture(scope="module")
def ids(model: deltalang.DeltaModel) -> Callable[[str], torch.Tensor]:
    return lambda text: model.tokenizer(text, return_tensors="pt").input_ids


def _run(model: deltalang.DeltaModel, body: str, filename: str = "reach.dl") -> dict[str, Any]:
    return dict(deltalang.compile(HEAD + body, model, filename=filename).run())


def _close(got: Any, want: Any) -> None:
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
        return
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=1e-4)


def _n(ids: Callable[[str], torch.Tensor], text: str) -> int:
    return int(ids(text).shape[1])


def _error(model: deltalang.DeltaModel, body: str, words: str, filename: str = "reach.dl") -> None:
    with pytest.raises(DeltaError) as e:
        deltalang.compile(HEAD + body, model, filename=filename)
    assert words in str(e.value), str(e.value)


# ---- 1. every position, and ranges of positions ------------------------------------------


def test_zeros_at_every_position_is_one_write_per_position(model: deltalang.DeltaModel, ref: Reference,
                                                            ids: Callable[[str], torch.Tensor]) -> None:
    got = _run(model, "trace t on clean {\n    write L[linear].state_after(*) = zeros\n"
                      "    read L2.state_output, next_token_probs\n}\n")
    n = _n(ids, CLEAN)
    want = ref.run(ids(CLEAN), [Write(i, "state_after", zeros, p) for i in LINEAR for p in range(n)])
    _close(got["t.L2.state_output"], want.value(2, "state_output"))
    _close(got["t.next_token_probs"], want.value(None, "next_token_probs"))
    assert not torch.equal(want.value(None, "next_token_probs"), ref.run(ids(CLEAN)).value(None, "next_token_probs"))


def test_reads_over_a_range_keep_one_result_per_position(model: deltalang.DeltaModel, ref: Reference,
                                                         ids: Callable[[str], torch.Tensor]) -> None:
    got = _run(model, "trace t on clean {\n    read L0.state_after(2..6), L1.conv_window_after(-3..0)\n"
                      "    measure norm(L2.state_after(0..2))\n}\n")
    n = _n(ids, CLEAN)
    clean = ref.run(ids(CLEAN))
    for p in range(2, 6):
        _close(got[f"t.L0.state_after({p})"], clean.value(0, "state_after", p))
    for p in range(n - 3, n):
        _close(got[f"t.L1.conv_window_after({p})"], clean.value(1, "conv_window_after", p))
    for p in (0, 1):
        _close(got[f"t.norm(L2.state_after({p}))"], float(clean.value(2, "state_after", p).float().norm()))
    assert "t.L0.state_after(6)" not in got and "t.L0.state_after(1)" not in got  # half-open: 2, 3, 4, 5


def test_a_range_from_a_donor_counts_each_end_by_the_rules_of_one_position(
        model: deltalang.DeltaModel, ref: Reference, ids: Callable[[str], torch.Tensor]) -> None:
    got = _run(model, "trace t on clean {\n    write L1.state_after(-3..0) from other\n"
                      "    write L0.state_after(1..3) from other\n    write L2.state_after(*) *= 0.5\n"
                      "    read L2.state_output\n    measure prob(\"P\")\n}\n")
    n, m = _n(ids, CLEAN), _n(ids, OTHER)
    other = ref.run(ids(OTHER))
    writes = [Write(1, "state_after", set_to(other.value(1, "state_after", m - k)), n - k) for k in (3, 2, 1)]
    writes += [Write(0, "state_after", set_to(other.value(0, "state_after", p)), p) for p in (1, 2)]
    writes += [Write(2, "state_after", lambda x, i: x * 0.5, p) for p in range(n)]
    want = ref.run(ids(CLEAN), writes)
    _close(got["t.L2.state_output"], want.value(2, "state_output"))
    _close(got['t.prob("P")'], float(want.value(None, "logits")[0, -1].float().softmax(-1)[ids("P")[0, 0]]))


def test_mean_at_every_position_reads_each_prompts_own(model: deltalang.DeltaModel, ref: Reference,
                                                       ids: Callable[[str], torch.Tensor]) -> None:
    prog = (f'prompt short = "{CLEAN[:12]}"\nprompts two = ["{CLEAN[:12]}", "{OTHER[:12]}"]\n'
            "trace t on short {\n    write L1.state_after(*) = mean(two)\n    read L1.state_output\n}\n")
    got = dict(deltalang.compile(prog, model, filename="m.dl").run())
    n = _n(ids, CLEAN[:12])
    donors = [ref.run(ids(t)) for t in (CLEAN[:12], OTHER[:12])]
    writes = [Write(1, "state_after", set_to(torch.stack([d.value(1, "state_after", p) for d in donors]).mean(0)), p)
              for p in range(n)]
    _close(got["t.L1.state_output"], ref.run(ids(CLEAN[:12]), writes).value(1, "state_output"))


def test_check_prints_each_position_of_a_range(model: deltalang.DeltaModel) -> None:
    resolved = deltalang.check(HEAD + "trace t on clean {\n    write L0.state_after(-2..0) = zeros\n}\n", model)
    text = format_resolved(resolved)
    n = len(model.tokenizer(CLEAN).input_ids)
    assert f"write L0.state_after(-2) -> position {n - 2} (o)" in text
    assert f"write L0.state_after(-1) -> position {n - 1} (f)" in text


# ---- 2. measures at a position other than the last -----------------------------------------


def test_measures_at_a_position_are_that_positions_next_token(model: deltalang.DeltaModel, ref: Reference,
                                                               ids: Callable[[str], torch.Tensor]) -> None:
    got = _run(model, 'trace base on clean {\n    measure prob("P"), rank("P"), logit_diff("P", "R") at -2\n'
                      '    measure kl(other) at -3\n    measure prob("P") at "Tower" as tower\n'
                      '    measure prob("P")\n}\n')
    n, m = _n(ids, CLEAN), _n(ids, OTHER)
    logits = ref.run(ids(CLEAN)).value(None, "logits")[0].float()
    other = ref.run(ids(OTHER)).value(None, "logits")[0].float()
    p_id, r_id = int(ids("P")[0, 0]), int(ids("R")[0, 0])
    at = logits[n - 2]
    _close(got[f'base.prob("P") at {n - 2}'], float(at.softmax(-1)[p_id]))
    assert got[f'base.rank("P") at {n - 2}'] == float((at > at[p_id]).sum())
    # a difference of two logits: float32 noise scales with the logits, not with their (small) difference
    diff = float(at[p_id] - at[r_id])
    assert got[f'base.logit_diff("P", "R") at {n - 2}'] == pytest.approx(diff, abs=1e-6 * float(at.abs().max()))
    _close(got[f"base.kl(other) at {n - 3}"], kl(other[m - 3][None], logits[n - 3][None]))
    tower = CLEAN.index("Tower") + len("Tower") - 1
    _close(got["tower"], float(logits[tower].softmax(-1)[p_id]))
    _close(got['base.prob("P")'], float(logits[n - 1].softmax(-1)[p_id]))


def test_a_measure_at_a_position_sees_the_runs_writes(model: deltalang.DeltaModel, ref: Reference,
                                                      ids: Callable[[str], torch.Tensor]) -> None:
    got = _run(model, 'trace t on clean {\n    write L[linear].state_after(3) = zeros\n'
                      '    measure prob("P") at 5\n}\n')
    want = ref.run(ids(CLEAN), [Write(i, "state_after", zeros, 3) for i in LINEAR]).value(None, "logits")[0, 5]
    _close(got['t.prob("P") at 5'], float(want.float().softmax(-1)[int(ids("P")[0, 0])]))


# ---- 4. steering: additive writes, arithmetic on sources -----------------------------------------


def test_steering_by_the_difference_of_two_means(model: deltalang.DeltaModel, ref: Reference,
                                                 ids: Callable[[str], torch.Tensor]) -> None:
    got = _run(model, "trace t on clean {\n    write L1.state_after(-1) += 4 * (mean(happy) - mean(sad))\n"
                      "    read L1.state_output, next_token_probs\n}\n")
    n = _n(ids, CLEAN)

    def mean(texts: list[str]) -> torch.Tensor:
        return torch.stack([ref.run(ids(t)).value(1, "state_after", _n(ids, t) - 1) for t in texts]).mean(0)

    direction = 4 * (mean(HAPPY) - mean(SAD))
    want = ref.run(ids(CLEAN), [Write(1, "state_after", lambda x, i: x + direction, n - 1)])
    _close(got["t.L1.state_output"], want.value(1, "state_output"))
    _close(got["t.next_token_probs"], want.value(None, "next_token_probs"))


def test_arithmetic_over_donors_names_and_zeros(model: deltalang.DeltaModel, ref: Reference,
                                                ids: Callable[[str], torch.Tensor]) -> None:
    got = _run(model, "trace donor on other {\n    read L0.state_output as kept\n}\n"
                      "trace t on clean {\n    write L2.state_output = other.L2.state_output * 0.5 + kept - zeros\n"
                      "    write L0.state_after(4) = 2 * other - (kept - other.L1.state_after(3))\n"
                      "    write L1.state_after(-2) += -1.5 * other\n    read L2.state_output\n"
                      "    measure prob(\"P\")\n}\n")
    n, m = _n(ids, CLEAN), _n(ids, OTHER)
    o = ref.run(ids(OTHER))
    kept = o.value(0, "state_output")
    writes = [Write(0, "state_after", set_to(2 * o.value(0, "state_after", 4)
                                             - (kept - o.value(1, "state_after", 3))), 4),
              Write(1, "state_after", lambda x, i: x + -1.5 * o.value(1, "state_after", m - 2), n - 2)]
    mid = ref.run(ids(CLEAN), writes)  # state_output is written after the last token: the logits do not see it
    _close(got['t.prob("P")'], float(mid.value(None, "logits")[0, -1].float().softmax(-1)[int(ids("P")[0, 0])]))
    _close(got["t.L2.state_output"], o.value(2, "state_output") * 0.5 + kept)


def test_emitted_steering_is_readable_nnsight(model: deltalang.DeltaModel) -> None:
    code = deltalang.compile(HEAD + "trace t on clean {\n    write L1.state_after(-1) += 4 * (mean(happy) - "
                             "mean(sad))\n}\n", model).code
    line = next(ln for ln in code.splitlines() if "set_state_after" in ln)
    assert "model.layers[1].linear_attn.state_after(33) + (4.0 * (results['~mean(happy)" in line


# ---- 5. load(...) -----------------------------------------------------------------------------------


def test_load_adds_a_direction_from_a_file_next_to_the_program(model: deltalang.DeltaModel, ref: Reference,
                                                               ids: Callable[[str], torch.Tensor],
                                                               tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    direction = torch.randn(4, 16, 8, generator=gen, dtype=torch.float64)  # not the model's dtype: cast at run
    save_file({"dir": direction, "other": torch.ones(3)}, str(tmp_path / "direction.safetensors"))
    save_file({"only": direction[None].float()}, str(tmp_path / "batched.safetensors"))
    source = HEAD + ('trace t on clean {\n    write L1.state_after(-1) += 2 * load("direction.safetensors", "dir")\n'
                     '    write L2.state_after(5) = load("batched.safetensors")\n'
                     '    read L1.state_output, L2.state_output\n}\n')
    (tmp_path / "steer.dl").write_text(source)
    exp = deltalang.compile(source, model, filename=str(tmp_path / "steer.dl"))
    assert "safetensors.torch.load_file(" in exp.code
    got = exp.run()
    n = _n(ids, CLEAN)
    d = direction.float()[None]
    want = ref.run(ids(CLEAN), [Write(1, "state_after", lambda x, i: x + 2 * d, n - 1),
                                Write(2, "state_after", set_to(d), 5)])
    _close(got["t.L1.state_output"], want.value(1, "state_output"))
    _close(got["t.L2.state_output"], want.value(2, "state_output"))


def test_load_is_cast_to_the_values_dtype(ref: Reference, ids: Callable[[str], torch.Tensor],
                                          tmp_path: Path) -> None:
    """float64 files steering a bfloat16 model: each cast at run time to its value's dtype (the state stays
    float32 there, the mixer's output is bfloat16); the results are the float32 truth's to bf16's precision,
    and the steered values move far from the clean ones, so the comparison is not vacuous."""
    half = deltalang.load_model(tiny_checkpoint("qwen3_5"), dtype=torch.bfloat16)
    n = _n(ids, CLEAN)
    state = torch.full((4, 16, 8), 0.25, dtype=torch.float64)
    hidden = torch.linspace(-1, 1, n * 64, dtype=torch.float64).reshape(n, 64)
    save_file({"s": state, "h": hidden}, str(tmp_path / "d.safetensors"))
    source = HEAD + ('trace t on clean {\n    write L1.state_after(-1) += load("d.safetensors", "s")\n'
                     '    write L2.attention_output += 2 * load("d.safetensors", "h")\n'
                     '    read L1.state_output, L2.output\n}\ntrace c on clean {\n    read L1.state_output, L2.output\n}\n')
    got = deltalang.compile(source, half, filename=str(tmp_path / "p.dl")).run()
    want = ref.run(ids(CLEAN), [Write(1, "state_after", lambda x, i: x + state.float()[None], n - 1),
                                Write(2, "attention_output", lambda x, i: x + 2 * hidden.float()[i][None, None])])
    clean = ref.run(ids(CLEAN))
    for layer, value, key in ((1, "state_output", "L1.state_output"), (2, "output", "L2.output")):
        assert got[f"t.{key}"].dtype == got[f"c.{key}"].dtype
        truth = want.value(layer, value).float()
        assert float((got[f"t.{key}"].float() - truth).norm()) < 0.05 * float(truth.norm()), key
        assert float((truth - clean.value(layer, value).float()).norm()) > 0.2 * float(truth.norm()), key
    assert got["t.L2.output"].dtype == torch.bfloat16


def test_load_refuses_what_it_cannot_take(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    save_file({"a": torch.zeros(4, 16, 8), "b": torch.zeros(2, 2)}, str(tmp_path / "two.safetensors"))
    where = str(tmp_path / "x.dl")
    body = "trace t on clean {{\n    write L1.state_after(-1) += {}\n}}\n"
    _error(model, body.format('load("d.pt")'), "load reads safetensors files only", where)
    _error(model, body.format('load("two.safetensors")'), "names no tensor", where)
    _error(model, body.format('load("two.safetensors", "c")'), 'has no tensor "c"', where)
    _error(model, body.format('load("two.safetensors", "b")'), "the shapes do not fit", where)
    _error(model, body.format('load("missing.safetensors")'), "cannot load", where)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    _error(model, body.format('load("bad.safetensors")'), "cannot load", where)


def test_a_measure_at_a_position_over_a_dataset_is_each_records_own(model: deltalang.DeltaModel, ref: Reference,
                                                                    ids: Callable[[str], torch.Tensor]) -> None:
    records = [{"prompt": CLEAN}, {"prompt": OTHER}]
    src = 'trace t on facts.prompt {\n    measure prob("P") at -2\n    measure prob("P")\n}\n'
    out = deltalang.run(src, model, data={"facts": records})
    p_id = int(ids("P")[0, 0])
    for i, rec in enumerate(records):
        logits = ref.run(ids(rec["prompt"])).value(None, "logits")[0].float()
        rows = {row["measure"]: row["value"] for row in out.rows if row["record"] == i}
        _close(rows['t.prob("P") at -2'], float(logits[-2].softmax(-1)[p_id]))
        _close(rows['t.prob("P")'], float(logits[-1].softmax(-1)[p_id]))


# ---- 3. mean(...) at a swept position ----------------------------------------------------------------


def test_mean_at_a_swept_position_through_the_engine(model: deltalang.DeltaModel, ref: Reference,
                                                    ids: Callable[[str], torch.Tensor]) -> None:
    src = HEAD + ('sweep s on clean over L in L[linear], t in -3..0, u in 2, 5 {\n'
                  '    write L.state_after(t) = mean(happy)\n    write L.conv_window_after(u) = mean(sad)\n'
                  '    measure prob("P"), kl(other)\n}\n')
    outcome = run_sweep(src, model, progress=False)
    assert outcome.paths["s"] == "engine"
    n, m = _n(ids, CLEAN), _n(ids, OTHER)
    p_id = int(ids("P")[0, 0])
    other = ref.run(ids(OTHER)).value(None, "logits")[:, m - 1]
    donors = {t: ref.run(ids(t)) for t in HAPPY + SAD}
    for layer, k, u in ((1, 2, 5), (0, 3, 2), (2, 1, 2)):  # t = -k: each prompt's own k-th token from its end
        mean_h = torch.stack([donors[t].value(layer, "state_after", _n(ids, t) - k) for t in HAPPY]).mean(0)
        mean_s = torch.stack([donors[t].value(layer, "conv_window_after", u) for t in SAD]).mean(0)
        logits = ref.run(ids(CLEAN), [Write(layer, "state_after", set_to(mean_h), n - k),
                                      Write(layer, "conv_window_after", set_to(mean_s), u)]).value(None, "logits")
        cell = f"s[L={layer},t={n - k},u={u}]"
        _close(outcome.results[f'{cell}.prob("P")'], float(logits[0, -1].float().softmax(-1)[p_id]))
        _close(outcome.results[f"{cell}.kl(other)"], kl(other, logits[:, -1]))
    naive = run_sweep(src, model, progress=False, engine="naive")
    for key, value in naive.results.items():
        assert outcome.results[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_steering_in_a_sweep_takes_the_reference_path(model: deltalang.DeltaModel, ref: Reference,
                                                      ids: Callable[[str], torch.Tensor]) -> None:
    src = HEAD + ('sweep s on clean over L in L[linear], t in 4, -1 {\n'
                  '    write L.state_after(t) += 3 * (mean(happy) - mean(sad))\n    measure prob("P")\n}\n')
    outcome = run_sweep(src, model, progress=False)
    assert outcome.paths["s"].startswith("naive: ") and "arithmetic" in outcome.paths["s"]
    n = _n(ids, CLEAN)
    direction = 3 * (torch.stack([ref.run(ids(t)).value(2, "state_after", 4) for t in HAPPY]).mean(0)
                     - torch.stack([ref.run(ids(t)).value(2, "state_after", 4) for t in SAD]).mean(0))
    logits = ref.run(ids(CLEAN), [Write(2, "state_after", lambda x, i: x + direction, 4)]).value(None, "logits")
    _close(outcome.results['s[L=2,t=4].prob("P")'], float(logits[0, -1].float().softmax(-1)[int(ids("P")[0, 0])]))
    assert len(outcome.results) == 6  # 3 blocks x 2 positions
    assert f's[L=0,t={n - 1}].prob("P")' in outcome.results


# ---- errors and printing ------------------------------------------------------------------------------


@pytest.mark.parametrize("body, words", [
    ('trace t on clean {\n    measure norm(L0.state_output) at -2\n}\n', "'at' applies to prob, rank"),
    ('generate g on clean max_new_tokens 2 {\n    measure prob("P") at -2\n}\n', "not in a generate"),
    ('sweep s on clean over t in 0..2 {\n    write L0.state_after(t) = zeros\n    measure prob("P") at -2\n}\n',
     "not in a sweep"),
    ('trace t on clean {\n    measure prob("Pa") at -2\n}\n', "'at' takes answers of one token"),
    ('trace t on clean {\n    measure prob("P") at 99\n}\n', "position 99 is past the end"),
    ('trace t on clean {\n    read L0.state_after(2..6) as x\n}\n', "'as' names one position"),
    ('trace t on clean {\n    read L0.state_after(6..2)\n}\n', "the range 6..2 is empty"),
    ('trace t on clean {\n    read L0.state_after(30..40)\n}\n', "30..40 reaches 34"),
    ('trace t on clean {\n    read L0.state_after(-40..-30)\n}\n', "reaches -40"),
    ('trace t on clean {\n    write L0.state_after(-34..1) = zeros\n}\n', "twice"),
    ('trace t on clean {\n    write L0.state_output = 2 * 3\n}\n', "needs a value among its operands"),
    ('trace t on clean {\n    write L0.state_after(1) from other.state_after(*)\n}\n', "a donor site names one"),
    ('trace t on clean {\n    write L0.state_output += other.L0.attention_output\n}\n', "the shapes do not fit"),
    ('generate g on clean max_new_tokens 2 {\n    step 1: write L0.state_after(*) = zeros\n}\n',
     "at step 1 the model runs one token"),
])
def test_misuse_is_one_line(model: deltalang.DeltaModel, body: str, words: str) -> None:
    with pytest.raises(DeltaError) as e:
        deltalang.compile(HEAD + body, model)
    assert words in e.value.message, e.value.message
    assert "\n" not in e.value.message


@pytest.mark.parametrize("text", [
    "write L0.state_after(*) = zeros", "read L0.state_after(2..6), L1.conv_window_after(-3..0)",
    'measure prob(" Paris"), kl(base) at -2', 'measure kl(base) at -2 as x', 'measure rank(" a") at "Tower"',
    "write L5.state_after(-1) += 4 * (mean(happy) - mean(sad))",
    'write L1.state_output = a.L0.state_output - (b - 2.5) * load("d.safetensors", "k")',
    "write L1.state_output = a - (b - c) - d * (e * f)", 'write L2.state_after(3) = load("x.safetensors")',
    "write L2.state_output += 0.5", "write L2.state_output += zeros * -2",
])
def test_new_syntax_prints_back_to_the_same_tree(text: str) -> None:
    tree = parse(text)
    printed = ast.format_program(tree)
    assert parse(printed) == tree
    assert ast.format_program(parse(printed)) == printed


def test_steering_is_parsed_as_arithmetic_over_sources() -> None:
    (w,) = parse("write L5.state_after(-1) += 4 * (mean(happy) - other.L2.state_output)").items
    assert isinstance(w, ast.Write) and isinstance(w.source, ast.ExprSource) and w.source.add
    e = w.source.expr
    assert isinstance(e, ast.BinOp) and e.op == "*" and e.left == ast.Number(4.0)
    assert isinstance(e.right, ast.BinOp) and e.right.op == "-"
    assert e.right.left == ast.MeanSource(("happy",))
    assert isinstance(e.right.right, ast.FromSource) and e.right.right.run == "other"
