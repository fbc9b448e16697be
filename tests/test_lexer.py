"""The highlighting: the Pygments lexer for `.dl` and the TextMate grammar in editors/.

The lexer must cover every token of the grammar (no Error token on any
example or golden program, nor on any literal or terminal of the Lark grammar),
stay strict (what is not deltalang is an Error token, so these tests can fail),
agree with the parser on its word lists, and be found by Pygments through its
entry point. The TextMate grammar must be valid JSON naming the parser's keywords.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pygments.token import Error, Keyword, Name, Number, Operator, Punctuation, String, Token

from deltalang import parse as _parse_fn  # noqa: F401 - the package face stays importable
from deltalang.language import lexer
from deltalang.language.lexer import DeltaLangLexer, highlight
from deltalang.language.parse import GRAMMAR_PATH, KERNELS, KEYWORDS, MEASURES

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = sorted((ROOT / "examples").glob("*.dl")) + sorted((ROOT / "tests" / "golden").glob("*.dl"))
TMLANGUAGE = ROOT / "editors" / "deltalang.tmLanguage.json"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def tokens(text: str) -> list[tuple[object, str]]:
    return [(k, v) for k, v in DeltaLangLexer(stripnl=False, ensurenl=False).get_tokens(text) if v]


def test_there_are_programs_to_lex() -> None:
    assert len(PROGRAMS) >= 10


@pytest.mark.parametrize("path", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_every_program_lexes_without_errors(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    toks = tokens(text)
    errors = [v for k, v in toks if k in Error]
    assert not errors, f"{path.name}: Error tokens {errors[:10]}"
    assert "".join(v for _, v in toks) == text  # nothing dropped or added


def _grammar_literals() -> set[str]:
    """Every quoted literal of the Lark grammar (keywords and punctuation alike)."""
    text = GRAMMAR_PATH.read_text(encoding="utf-8")
    code = "\n".join(line.split("//", 1)[0] for line in text.splitlines())
    code = re.sub(r"/(?:\\.|[^/\n])+/[imslux]*", "", code)  # regular-expression terminals are not literals
    return set(re.findall(r'"((?:\\.|[^"\\])+)"', code))


def test_every_literal_of_the_grammar_lexes() -> None:
    literals = _grammar_literals()
    assert {"read", "{", "=", "max_new_tokens"} <= literals  # the reader sees the grammar
    for lit in sorted(literals):
        toks = tokens(lit)
        assert not [v for k, v in toks if k in Error], f"grammar literal {lit!r} lexes as {toks}"
        if lit in KEYWORDS:
            assert toks == [(Keyword, lit)], f"keyword {lit!r} lexes as {toks}"


@pytest.mark.parametrize("text, kinds", [
    ("L3", [Name.Label]), ("L*", [Name.Label]), ("L12x", [Name]), ("L", [Name]),
    ("-1.5e3", [Number.Float]), ("2e-3", [Number.Float]), ("0.25", [Number.Float]), ("-1", [Number.Integer]),
    ("2..6", [Number.Integer, Operator, Number.Integer]), ("*=", [Operator]),
    ('"a\\"b\\\\c\\n"', [String.Double, String.Double, String.Escape, String.Double, String.Escape,
                         String.Double, String.Escape, String.Double]),
    ("# note", [Token.Comment.Single]), (";", [Punctuation]),
    ("prob", [Name.Builtin]), ("mean", [Name.Builtin]), ("zeros", [Name.Builtin]), ("torch", [Name.Constant]),
    ("state_after", [Name.Attribute]), ("next_token_probs", [Name.Attribute]), ("clean", [Name]),
])
def test_each_terminal_lexes_as_its_kind(text: str, kinds: list[object]) -> None:
    assert [k for k, _ in tokens(text)] == kinds


@pytest.mark.parametrize("text", ["read L0.states @", "prompt p = 'single quotes'", 'prompt p = "unterminated\n'])
def test_what_is_not_deltalang_is_an_error(text: str) -> None:
    assert any(k in Error for k, _ in tokens(text))


def test_word_lists_agree_with_the_parser() -> None:
    assert set(lexer.KEYWORDS) == set(KEYWORDS)
    assert set(lexer.MEASURES) == set(MEASURES)
    assert set(lexer.KERNELS) == set(KERNELS)


def test_highlight_colours_and_keeps_the_text() -> None:
    text = (ROOT / "examples" / "eiffel.dl").read_text(encoding="utf-8") + "    0 The  1 ␣Eiffel -> x\n"
    out = highlight(text)
    assert "\x1b[" in out
    assert ANSI.sub("", out) == text  # check's token tables stay plain, nothing lost


def test_pygments_finds_the_lexer_by_its_entry_point(tmp_path: Path) -> None:
    code = ("from pygments.lexers import get_lexer_by_name, get_lexer_for_filename\n"
            "print(type(get_lexer_by_name('deltalang')).__module__, type(get_lexer_for_filename('x.dl')).__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["deltalang.language.lexer", "DeltaLangLexer"]


def _tm_words(node: object, scope_prefix: str) -> set[str]:
    """The words of every `\\b(a|b|c)\\b` pattern under a scope starting with `scope_prefix`."""
    found: set[str] = set()
    if isinstance(node, dict):
        if str(node.get("name", "")).startswith(scope_prefix) and "match" in node:
            m = re.fullmatch(r"\\b\(([A-Za-z_|]+)\)\\b", node["match"])
            assert m, f"{node['name']}: not a word list: {node['match']}"
            found |= set(m.group(1).split("|"))
        for v in node.values():
            found |= _tm_words(v, scope_prefix)
    elif isinstance(node, list):
        for v in node:
            found |= _tm_words(v, scope_prefix)
    return found


def test_textmate_grammar_is_json_with_the_parsers_keywords() -> None:
    grammar = json.loads(TMLANGUAGE.read_text(encoding="utf-8"))
    assert grammar["scopeName"] == "source.deltalang" and "dl" in grammar["fileTypes"]
    words = _tm_words(grammar["repository"]["keyword"], "")
    assert words == set(KEYWORDS)
    assert _tm_words(grammar["repository"]["builtin"], "support.function.measure") == set(MEASURES)
    includes = {p["include"].lstrip("#") for p in grammar["patterns"]}
    assert includes == set(grammar["repository"])  # every rule is used, none is missing


def test_textmate_patterns_compile_and_match() -> None:
    grammar = json.loads(TMLANGUAGE.read_text(encoding="utf-8"))
    patterns: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            patterns.extend(node[k] for k in ("match", "begin", "end") if k in node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(grammar)
    assert len(patterns) >= 10
    for p in patterns:
        re.compile(p)  # the simple subset Oniguruma and Python agree on
    block = re.compile(grammar["repository"]["block"]["match"])
    assert block.search("L3.state_output") and block.search("L*.output") and not block.search("L3x")
