"""Issue 24, the front end's part: no write is silently a no-op, no state that does not exist is written, every
error of one pass at once, attribution's small numbers shown, the bundled model's own name, a run past the context.

Numbers are checked against plain transformers on the bundled model (`ref`, `tests/reference.py`): a write the
front end warns of leaves the logits exactly as transformers computes them without it, and every write it does
not warn of changes them.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import deltalang
from deltalang.ground.errors import DeltaError, DeltaErrors, DeltaWarning
from deltalang.language.check import check
from deltalang.models import bundled, values

PROMPT = "The Eiffel Tower is in the city of"
HEAD = f'prompt clean = "{PROMPT}"\n'
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> Any:
    return deltalang.load_model()


@pytest.fixture(scope="module")
def plain(model: Any) -> torch.Tensor:
    """Plain transformers' logits over the prompt: the model deltalang wraps, called without nnsight."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(bundled.PATH, dtype=torch.float32)
    ids = model.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return hf(ids).logits


def _warnings(text: str, **kw: Any) -> list[DeltaWarning]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        check(text, **kw)
    return [w.message for w in got if isinstance(w.message, DeltaWarning)]


def _errors(text: str, **kw: Any) -> list[DeltaError]:
    with pytest.raises(DeltaError) as info:
        check(text, **kw)
    e = info.value
    return list(e.errors) if isinstance(e, DeltaErrors) else [e]


# ---- (a) writes that nothing reads -------------------------------------------------------------------

WRITES = [f"{v}{p}" for v, info in values.CATALOGUE.items() if info.writable and v != "state_input"
          and values.DELTANET in info.kinds
          for p in (("(-1)", "(-2)", "(0)") if info.positional else ("",))]


@pytest.mark.parametrize("site", WRITES)
def test_a_warned_write_changes_nothing_and_an_unwarned_one_does(site: str, model: Any,
                                                                   plain: torch.Tensor) -> None:
    """Every writable value: warned at `check` exactly when the logits equal transformers' without the write."""
    text = HEAD + f"trace t on clean {{\n    write L4.{site} = zeros\n    read logits\n}}\n"
    warned = [w for w in _warnings(text) if "nothing in this trace reads what the write changes" in w.message]
    with warnings.catch_warnings(record=True) as at_run:
        warnings.simplefilter("always")
        logits = deltalang.run(text, model)["t.logits"]
    unchanged = torch.equal(logits, plain)
    assert bool(warned) == unchanged, f"{site}: warned {bool(warned)}, logits unchanged {unchanged}"
    if warned:
        assert warned[0].render().startswith("<program>:3:5: warning: nothing in this trace reads")
        assert "^^^^" in warned[0].render()
        assert any(isinstance(w.message, DeltaWarning) and "nothing in this trace" in w.message.message
                   for w in at_run), "run does not warn"
    else:
        assert (logits - plain).abs().max() > 1e-3


def test_a_the_issue_program_warns_twice_and_its_kl_is_zero(model: Any) -> None:
    text = HEAD + ("trace t on clean {\n    write L[linear].state_output = zeros\n"
                   "    write L[linear].conv_window_after(-1) = zeros\n    measure kl(clean)\n}\n")
    got = [w for w in _warnings(text) if "reads what the write changes" in w.message]
    assert [w.span.line for w in got] == [3, 4]
    assert abs(deltalang.run(text, model)["t.kl(clean)"]) < 1e-9


def test_a_a_read_of_the_written_value_is_a_reader() -> None:
    text = HEAD + ("trace t on clean {\n    write L[linear].state_output = zeros\n    read L4.state_output\n}\n"
                   "trace u on clean {\n    write L0.conv_window_after(-1) = zeros\n}\n"
                   "trace v on clean {\n    write L1.conv_window_after(2) from u.L0.conv_window_after(-1)\n}\n")
    got = [w for w in _warnings(text) if "reads what the write changes" in w.message]
    assert len(got) == 1 and got[0].span.line == 3
    assert "on L0, L1, L2, L5, L6 " in got[0].message  # L4's written state is read


def test_a_generate_carries_into_the_next_step(ref: Any, model: Any) -> None:
    """Under generate a written state_output is the next step's start: warned only at the last step."""
    text = HEAD + ("generate g on clean max_new_tokens 3 {\n    step 1: write L4.state_output = zeros\n"
                   "    step 2: write L5.state_output = zeros\n"
                   "    step 0: write L6.conv_window_after(-1) = zeros\n    read logits\n}\n")
    got = [w for w in _warnings(text) if "reads what the write changes" in w.message]
    assert [w.span.line for w in got] == [4]
    assert "step 2 is the last of 'g'" in got[0].message
    last = HEAD + "generate g on clean max_new_tokens 2 {\n    step 1: write L5.conv_window_after(-1) = zeros\n}\n"
    assert [w.span.line for w in _warnings(last) if "reads what the write changes" in w.message] == [3]
    from reference import Write, zeros

    ids = model.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    n = ids.shape[1]
    r = deltalang.run(text, model)
    # transformers with the unwarned writes only: step 1's state_output is what step 2 starts from, step 0's
    # window after the last token what step 1 sees; the warned step-2 writes add nothing to it
    want = ref.run(ids, [Write(4, "state_input", zeros, step=2), Write(6, "conv_window_after", zeros, n - 1, 0)],
                   max_new_tokens=3)
    clean = ref.run(ids, [], max_new_tokens=3)
    for k in range(3):
        assert torch.allclose(r[f"g.step{k}.logits"][:, -1], want.value(None, "logits", step=k)[:, -1], atol=1e-4), k
    assert not torch.allclose(r["g.step2.logits"][:, -1], clean.value(None, "logits", step=2)[:, -1], atol=1e-2)


def test_a_sweep_cells_at_the_last_token_are_named() -> None:
    text = HEAD + "sweep s on clean over L in L[linear], t in 0..8 {\n    write L.conv_window_after(t) = zeros\n" \
                  "    measure prob(\" Paris\")\n}\n"
    got = [w for w in _warnings(text) if "reads what the write changes" in w.message]
    assert len(got) == 1 and "at t = 7 (the last token)" in got[0].message


# ---- (b) state_input on a fresh prompt -------------------------------------------------------------


@pytest.mark.parametrize("source", ["= zeros", "*= 0.5", "+= zeros"])
def test_b_state_input_of_a_fresh_prompt_is_an_error_at_check(source: str) -> None:
    for text in (HEAD + f"trace t on clean {{\n    write L4.state_input {source}\n}}\n",
                 HEAD + f"generate g on clean max_new_tokens 2 {{\n    write L4.state_input {source}\n}}\n",
                 HEAD + f"generate g on clean max_new_tokens 2 {{\n    step 0: write L4.state_input {source}\n}}\n"):
        (e,) = _errors(text)
        assert e.span is not None and e.span.line == 3 and "state_input is none" in e.message


def test_b_at_a_decode_step_it_is_valid_and_matches_transformers(ref: Any, model: Any) -> None:
    from reference import Write

    text = HEAD + "generate g on clean max_new_tokens 2 {\n    step 1: write L4.state_input *= 0.5\n    read logits\n}\n"
    r = deltalang.run(text, model)
    ids = model.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    want = ref.run(ids, [Write(4, "state_input", lambda x, i: x * 0.5, step=1)], max_new_tokens=2)
    got = r["g.step1.logits"][:, -1]
    assert torch.allclose(got, want.value(None, "logits", step=1)[:, -1], atol=1e-4)
    assert not torch.allclose(got, ref.run(ids, [], max_new_tokens=2).value(None, "logits", step=1)[:, -1], atol=1e-3)


def test_b_a_donor_without_state_input_is_an_error() -> None:
    text = HEAD + 'prompt other = "My favourite food"\n' + \
        "generate g on clean max_new_tokens 2 {\n    step 1: write L4.state_input from other\n}\n"
    (e,) = _errors(text)
    assert e.span is not None and e.span.line == 4 and "'other' has no state_input" in e.message


# ---- (c) every error of one pass at once -----------------------------------------------------------------


def test_c_syntax_and_resolve_errors_together() -> None:
    text = HEAD + ('trace t on clean {\n    read L[lineer].state_output as gone\n    measure prbo(" Paris")\n'
                   '    read L0.state_after(99)\n    write L1.state_output = gone\n}\n')
    errs = _errors(text)
    assert [e.span.line for e in errs if e.span] == [3, 4, 5]  # not line 6: 'gone' is the dropped read's
    assert "lineer" in errs[0].message and "prbo" in errs[1].message and "position 99" in errs[2].message


def test_c_every_missing_dataset_field(tmp_path: Path, model: Any) -> None:
    (tmp_path / "d.jsonl").write_text('{"prompt": "The Eiffel Tower is in the city of", "answer": " Paris", '
                                      '"foil": " Pisa", "subject": "Eiffel"}\n', encoding="utf-8")
    prog = tmp_path / "p.dl"
    prog.write_text('dataset facts = "d.jsonl"\ntrace t on facts {\n    write L4.state_after(facts.subjct) = zeros\n'
                    '    measure logit_diff(facts.answr, facts.fol)\n}\n', encoding="utf-8")
    with pytest.raises(DeltaErrors) as info:
        deltalang.run(prog.read_text(), model, filename=str(prog))
    assert [(e.span.line, e.message.split("'")[3]) for e in info.value.errors] == [
        (3, "subjct"), (4, "answr"), (4, "fol")]


# ---- (d) attribution of a saturated prob -------------------------------------------------------------------


def test_d_small_estimates_keep_their_digits_and_saturation_is_said(model: Any) -> None:
    from deltalang.ground.display import signed

    assert signed(-0.000419) == "-0.000419" and signed(6.7e-08) == "+6.7e-08" and signed(-0.975) == "-0.975"
    text = HEAD + "sweep s on clean over L in L[4,5], t in 5..8 method attribution {\n" \
                  "    write L.state_after(t) = zeros\n    measure prob(\" Paris\")\n}\n"
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        res = deltalang.run_sweep(text, model)
    table = res.table()
    assert "+0.0000" not in table and "-0.0000" not in table
    said = [w.message for w in got if isinstance(w.message, DeltaWarning) and "saturated" in w.message.message]
    assert said and "logit_diff" in said[0].message and said[0].span is not None and said[0].span.line == 4
    p = res.clean['prob(" Paris")']
    assert p > 0.99 and not math.isnan(p)


# ---- (e) the bundled model's own name ------------------------------------------------------------------------


def test_e_the_bundled_name_is_the_bundled_model() -> None:
    r = check(HEAD + "read L0.state_output\n", bundled.NAME, prompt=None)
    assert r.spec.model_id == bundled.NAME and r.spec.num_layers == check(HEAD + "read L0.state_output\n").spec.num_layers


# ---- (f) past the model's context ------------------------------------------------------------------------


def test_f_a_generate_past_the_context_warns() -> None:
    limit = check(HEAD + "read logits\n").spec.config.max_position_embeddings
    n = 8  # the prompt's tokens
    over = HEAD + f'generate g on clean max_new_tokens {limit - n + 1} {{\n    measure prob(" Paris")\n}}\n'
    fits = HEAD + f'generate g on clean max_new_tokens {limit - n} {{\n    measure prob(" Paris")\n}}\n'
    got = [w for w in _warnings(over) if "context" in w.message]
    assert len(got) == 1 and f"of {limit}" in got[0].message and got[0].span.line == 2
    assert not [w for w in _warnings(fits) if "context" in w.message]


# ---- (g) a long generate at check --------------------------------------------------------------------------

LONG = HEAD + ("generate a on clean max_new_tokens 3 {{\n    read L4.state_after(-1)\n}}\n"
               "generate g on clean max_new_tokens {n} {{\n    read L4.state_output\n    measure prob(\" Paris\")\n"
               "{body}}}\n")


def _check_seconds(text: str, capsys: pytest.CaptureFixture) -> tuple[float, int, str]:
    import time

    from deltalang.cli import main

    t0 = time.perf_counter()
    rc = main(["check", "-e", text])
    seconds, got = time.perf_counter() - t0, capsys.readouterr()
    return seconds, rc, got.out + got.err


def test_g_check_of_a_hundred_million_new_tokens_answers_at_once(capsys: pytest.CaptureFixture) -> None:
    """`check` plans a generate in a time that does not grow with max_new_tokens (it enumerated every step)."""
    _check_seconds(LONG.format(n=4, body=""), capsys)  # the spec and tokenizer loaded once
    small, rc_small, _ = _check_seconds(LONG.format(n=4, body=""), capsys)
    big, rc_big, err = _check_seconds(LONG.format(n=100_000_000, body=""), capsys)
    assert rc_small == 0 and rc_big == 0, err
    assert big < small + 0.5, f"check took {big:.2f} s for 10^8 new tokens, {small:.2f} s for 4"
    assert "past this model's context" in err


@pytest.mark.parametrize("body", ["    measure kl(a)\n", "    step 2: measure kl(a)\n    step 5: read logits\n",
                                  "    write L4.state_output from a\n", "    step 7: write L0.state_after(-1) from a\n",
                                  "    step 1: write L0.state_after(-1) from a\n"])
def test_g_check_finds_what_the_whole_plan_finds(body: str, capsys: pytest.CaptureFixture) -> None:
    """The plan `check` builds refuses exactly what the full plan refuses, with the same words, and still does
    past the steps it enumerates."""
    from deltalang.compiler.plan import build_plan, checked_plan
    from deltalang.ground.errors import DeltaPlanError

    def outcome(make: Any, n: int) -> str:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                resolved = check(LONG.format(n=n, body=body))
            except DeltaError:
                return "refused before the plan"
        try:
            make(resolved)
        except DeltaPlanError as e:
            return e.message
        return "ok"

    for n in (2, 3, 4, 40):
        assert outcome(checked_plan, n) == outcome(build_plan, n), n
    assert outcome(checked_plan, 100_000_000) == outcome(build_plan, 40)
    _, rc, err = _check_seconds(LONG.format(n=100_000_000, body=body), capsys)
    assert (rc == 0) == (outcome(build_plan, 40) == "ok"), err
