"""Tokens are shown one way in every message (issue 38): `check`'s token lists and position lines, its warnings, the
errors that quote tokens and `emit`'s comments show each token decoded, a space as ␣ (`display.token`, as tables
do: ␣Tower), never the tokenizer's spelling ('ĠTower'). The truth: the bundled tokenizer asked directly.
"""

from __future__ import annotations

from typing import Any

import pytest

from deltalang.models.bundled import PATH

pytestmark = pytest.mark.skipif(not (PATH / "config.json").exists(), reason="the bundled model is not built")

PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture(scope="module")
def tokens() -> list[str]:
    """Each token of PROMPT as the tokenizer decodes it alone, a space written ␣."""
    from deltalang.models.spec import load_spec

    tok = load_spec(None).tokenizer
    return [tok.decode([i]).replace(" ", "␣") for i in tok(PROMPT)["input_ids"]]


def test_check_shows_tokens_as_tables_do(tokens: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from deltalang.cli import main

    assert tokens[2] == "␣Tower"
    program = 'read L0.state_after("Tower"), L1.state_after("Tow")\nmeasure prob(" Paris")'
    assert main(["check", "-e", program, "--prompt", PROMPT]) == 0
    out = capsys.readouterr().out
    assert "    " + "  ".join(f"{i} {t}" for i, t in enumerate(tokens)) in out.splitlines()  # the prompt's tokens
    assert 'read L0.state_after("Tower") -> position 2 (␣Tower) as main.L0.state_after(2)' in out
    assert "warning: \"Tow\" covers only part of token 2 (␣Tower) in prompt 'main': it names position 2 (␣Tower)" in out
    assert 'measure prob(" Paris") -> token' in out and "(␣Paris) as" in out
    assert "Ġ" not in out


def test_an_error_and_emitted_code_quote_tokens_as_tables_do(capsys: pytest.CaptureFixture[str]) -> None:
    from deltalang.cli import main

    assert main(["check", "-e", 'measure rank(" Paris Rome")', "--prompt", PROMPT]) == 1
    err = capsys.readouterr().err
    assert "is 2 tokens for this model's tokenizer (␣Paris ␣Rome)" in err and "Ġ" not in err, err
    assert main(["emit", "-e", 'write L0.state_after("Tower") = zeros\nread logits', "--prompt", PROMPT]) == 0
    code = capsys.readouterr().out
    assert "token 2 = ␣Tower" in code and "Ġ" not in code
