"""No silent guesses (issue 9): what the resolver cannot take as written, it says, or it refuses.

On the bundled model's word-level tokenizer (546 words and `<unk>`): an answer
it does not know is an error (prob of `<unk>` is not prob of " Zürich"); a
quoted position that cuts a token, or lands on `<unk>`, and a prompt with
unknown words are warnings naming the tokens chosen. An empty program has
nothing to run; statements outside a run need one prompt; a `model` line the
caller's model overrides is a warning. Warnings are `DeltaWarning`s: on
`Resolved.warnings`, in `check`'s output, on stderr for `run`, and through
Python's `warnings` module. The ground truth for every token is the tokenizer
itself, asked directly.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from deltalang.ground.errors import DeltaError, DeltaErrors, DeltaWarning
from deltalang.language.check import check
from deltalang.models.bundled import NAME, PATH

pytestmark = pytest.mark.skipif(not (PATH / "config.json").exists(), reason="the bundled model is not built")

CLEAN = "The Eiffel Tower is in the city of"
HEADER = f'prompt clean = "{CLEAN}"\n'


@pytest.fixture(scope="module")
def spec() -> Any:
    from deltalang.models.spec import load_spec

    return load_spec(None)


def _ids(spec: Any, text: str) -> list[int]:
    return list(spec.tokenizer(text, add_special_tokens=False)["input_ids"])


def _unk(spec: Any) -> int:
    unk = spec.tokenizer.unk_token_id
    assert isinstance(unk, int)
    return unk


def _quiet_check(text: str, spec: Any, **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeltaWarning)
        return check(text, spec, **kw)


def _messages(resolved: Any) -> list[str]:
    return [w.message for w in resolved.warnings]


# ---- answers: an unknown word is an error ----------------------------------------------------


@pytest.mark.parametrize("call", ['prob(" Zürich")', 'rank(" Zürich")', 'logit_diff(" Paris", " Zürich")'])
def test_an_answer_the_tokenizer_does_not_know_is_an_error(spec: Any, call: str) -> None:
    assert _ids(spec, " Zürich") == [_unk(spec)]  # the tokenizer itself: one token, <unk>
    with pytest.raises(DeltaError) as info:
        check(HEADER + f"measure {call}", spec, filename="a.dl")
    e = info.value
    assert not isinstance(e, DeltaErrors)
    assert '" Zürich"' in e.message and "<unk>" in e.message
    assert e.render().startswith("a.dl:2:")


def test_a_known_answer_is_no_error(spec: Any) -> None:
    r = _quiet_check(HEADER + 'measure prob(" Paris")', spec)
    assert r.run("main").measures[0].token_ids == tuple(_ids(spec, " Paris"))
    assert r.warnings == ()


# ---- quoted positions: a cut token or an unknown one is a warning ----------------------------


def _shown(spec: Any, text: str) -> list[str]:
    """Each token as messages show it: decoded alone, a space as ␣ (not the tokenizer's spelling 'ĠEiffel')."""
    return [spec.tokenizer.decode([i]).replace(" ", "␣") for i in _ids(spec, text)]


def _offsets(spec: Any, text: str) -> list[tuple[int, int]]:
    return [tuple(x) for x in spec.tokenizer(text, return_offsets_mapping=True)["offset_mapping"]]


def test_a_piece_inside_a_token_warns_naming_the_token(spec: Any) -> None:
    toks = _shown(spec, CLEAN)
    eiffel = next(i for i, (a, b) in enumerate(_offsets(spec, CLEAN)) if a <= CLEAN.index("Eiff") < b)
    with pytest.warns(DeltaWarning) as record:
        r = check(HEADER + 'read L0.state_after("Eiff")', spec, filename="p.dl")
    assert r.run("main").ops[0].position == eiffel
    (msg,) = _messages(r)
    assert f"token {eiffel} ({toks[eiffel]})" in msg and '"Eiff"' in msg
    assert [str(w.message) for w in record] == [w.render() for w in r.warnings]
    assert r.warnings[0].render().startswith("p.dl:2:21: warning: ")


def test_a_piece_that_ends_inside_the_next_token_warns(spec: Any) -> None:
    toks = _shown(spec, CLEAN)
    end = CLEAN.index("Eiffel ") + len("Eiffel ")
    tower = next(i for i, (a, b) in enumerate(_offsets(spec, CLEAN)) if a < end < b)
    r = _quiet_check(HEADER + 'read L0.state_after("Eiffel ")', spec)
    assert r.run("main").ops[0].position == tower
    (msg,) = _messages(r)
    assert f"token {tower} ({toks[tower]})" in msg


@pytest.mark.parametrize("piece", ["Eiffel", "Tower", " Tower", "The Eiffel", "city of"])
def test_whole_tokens_do_not_warn(spec: Any, piece: str) -> None:
    assert _quiet_check(HEADER + f'read L0.state_after("{piece}")', spec).warnings == ()


def test_a_piece_on_an_unknown_token_warns(spec: Any) -> None:
    text = "The Zürich Tower is in the city of"
    ids = _ids(spec, text)
    at = next(i for i, (a, b) in enumerate(_offsets(spec, text)) if a <= text.index("Zürich") < b)
    assert ids[at] == _unk(spec)
    r = _quiet_check(f'prompt p = "{text}"\nread L0.state_after("Zürich")', spec)
    assert r.run("main").ops[0].position == at
    assert any('"Zürich"' in m and f"token {at}" in m and "<unk>" in m for m in _messages(r)), _messages(r)


def test_a_donor_piece_inside_a_token_warns(spec: Any) -> None:
    r = _quiet_check(HEADER + 'prompt other = "My favourite food is pizza with"\n'
                     'trace p on clean { write L0.state_after(1) from other.state_after("pizz") }', spec)
    (msg,) = _messages(r)
    assert '"pizz"' in msg and "(␣pizza)" in msg


# ---- prompts of unknown words ---------------------------------------------------------------


def test_a_prompt_of_unknown_words_warns_how_many(spec: Any) -> None:
    text = "Die Zürich Bahnhof ist in der"
    ids = _ids(spec, text)
    n_unk = ids.count(_unk(spec))
    assert n_unk > len(ids) / 2  # most of it
    r = _quiet_check(f'prompt p = "{text}"\ntrace t on p {{ read L0.state_output }}', spec, filename="u.dl")
    (w,) = r.warnings
    assert f"{n_unk} of {len(ids)} tokens" in w.message and '"Zürich"' in w.message
    assert w.render().startswith("u.dl:1:1: warning: ")


def test_an_unknown_word_in_a_prompt_list_and_in_prompt_warns(spec: Any) -> None:
    r = _quiet_check('prompts many = ["The Eiffel Tower", "The Zürich Tower"]\nread L0.state_output', spec,
                     prompt="Der Zürich Tower")
    msgs = _messages(r)
    assert len(msgs) == 2, msgs
    assert any('"The Zürich Tower"' in m and "1 of 3 tokens" in m for m in msgs), msgs
    assert any("--prompt" in m and "2 of 3 tokens" in m for m in msgs), msgs


def test_a_prompt_of_known_words_does_not_warn(spec: Any) -> None:
    assert _quiet_check(HEADER + "read L0.state_output", spec).warnings == ()


# ---- nothing to run -------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "# only a comment\n", 'prompt p = "The"\n', "route torch\n",
                                  'model "x"\nprompts ps = ["The"]'])
def test_a_program_with_nothing_to_run_is_an_error(spec: Any, text: str) -> None:
    with pytest.raises(DeltaError) as info:
        _quiet_check(text, spec, filename="e.dl")
    assert "nothing to run" in info.value.message
    assert info.value.render().startswith("e.dl:1:1: error: nothing to run")


def test_run_of_an_empty_program_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    from deltalang.cli import main

    for command in ("run", "emit", "check"):
        assert main([command, "-e", "# nothing here"]) == 1
        out, err = capsys.readouterr()
        assert out == "" and "nothing to run" in err and "Traceback" not in err


# ---- the implicit run `main` needs one prompt ---------------------------------------------


def test_main_with_several_prompts_names_the_choices(spec: Any) -> None:
    text = HEADER + 'prompt other = "My favourite food is pizza with"\nread L0.states'
    with pytest.raises(DeltaError) as info:
        check(text, spec, filename="m.dl")
    e = info.value
    assert "declares 2: clean, other" in e.message and "--prompt" in e.message
    assert e.render().startswith("m.dl:3:1: error: ")
    assert _quiet_check(text, spec, prompt="The city of").run("main").prompt_text == "The city of"
    r = _quiet_check(text + '\nprompt main = "The city of"', spec)
    assert r.run("main").prompt == "main"
    assert _quiet_check(HEADER + "read L0.states", spec).run("main").prompt == "clean"


# ---- the program's model line and the caller's model ----------------------------------------


def test_a_model_line_the_caller_overrides_warns(spec: Any) -> None:
    text = 'model "Qwen/Qwen3.5-0.8B"\n' + HEADER + "read L0.states"
    with pytest.warns(DeltaWarning, match="Qwen/Qwen3.5-0.8B"):
        r = check(text, spec, filename="w.dl")
    (w,) = r.warnings
    assert spec.model_id in w.message and w.render().startswith("w.dl:1:1: warning: ")
    assert _quiet_check(f'model "{spec.model_id}"\n' + HEADER + "read L0.states", spec).warnings == ()
    assert _quiet_check(f'model "{PATH}"\n' + HEADER + "read L0.states", str(PATH)).warnings == ()


def test_cli_check_prints_warnings_in_its_output(capsys: pytest.CaptureFixture[str]) -> None:
    from deltalang.cli import main

    rc = main(["check", "-e", 'model "Qwen/Qwen3.5-0.8B"; read L0.state_after("Eiff")', "--prompt", CLEAN,
               "--model", str(PATH)])
    out, err = capsys.readouterr()
    assert rc == 0 and err == ""
    assert "<-e>:1:1: warning: " in out and "Qwen/Qwen3.5-0.8B" in out
    assert "<-e>:1:48: warning: " in out and "(␣Eiffel)" in out and "Ġ" not in out
    assert out.rstrip().endswith("2 warnings")


def test_cli_run_prints_warnings_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    from deltalang.cli import main

    rc = main(["run", "-e", 'measure prob(" Paris"); read L0.state_after("Eiff") as s', "--prompt", CLEAN])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "<-e>:1:45: warning: " in err and "(␣Eiffel)" in err and "Ġ" not in err and "Traceback" not in err
    assert 'main.prob(" Paris")' in out and "warning" not in out


def test_python_run_with_a_model_warns_about_the_model_line() -> None:
    import deltalang

    model = deltalang.load_model()
    assert model.spec.model_id == NAME
    with pytest.warns(DeltaWarning, match="Qwen/Qwen3.5-0.8B"):
        results = deltalang.run('model "Qwen/Qwen3.5-0.8B"\n' + HEADER + 'measure prob(" Paris")', model)
    assert results['main.prob(" Paris")'] > 0.5


@pytest.mark.parametrize("text", ['prompt p = ""\ntrace t on p { measure prob(" Paris") }\n',
                                  'prompts ps = ["The", ""]\nprompt p = "The"\n'
                                  'trace t on p { write L0.state_after(-1) = mean(ps) }\n'])
def test_an_empty_prompt_is_an_error_not_a_crash(spec: Any, text: str) -> None:
    with pytest.raises(DeltaError) as info:
        _quiet_check(text, spec)
    assert "is empty: a run needs at least one token" in str(info.value)
