"""A Pygments lexer for deltalang programs (`.dl`), and the terminal highlighting the commands use.

`DeltaLangLexer` is registered under the `pygments.lexers` entry point (see
pyproject.toml), so Pygments, Jupyter, Sphinx and `rich` find it by the name
`deltalang` or the file name `*.dl`. It is strict: a character the language
has no token for is an `Error` token, so the tests can tell it covers every
token of the grammar. `highlight(text)` colours text for a terminal; it also
takes what `deltalang check` prints (program lines with token tables), where
what is not deltalang stays plain.

The word lists here are the lexer's copy of the parser's (`parse.KEYWORDS`,
`parse.MEASURES`), which sits two layers up; tests/test_lexer.py checks they
agree. Value names come from `values`, their one home.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from pygments import format as _format
from pygments.formatters import TerminalFormatter
from pygments.lexer import RegexLexer, words
from pygments.token import (Comment, Error, Keyword, Name, Number, Operator, Punctuation, String, Text, Whitespace,
                            _TokenType)

from deltalang.models import values

# the parser's keywords and measures (tests/test_lexer.py checks these against deltalang.language.parse)
KEYWORDS = ("read", "write", "measure", "route", "step", "trace", "generate", "sweep", "prompt", "prompts",
            "dataset", "model", "on", "over", "in", "max_new_tokens", "as", "from", "at")
MEASURES = ("prob", "logit_diff", "kl", "norm", "rank", "top", "project")
# what a write's source may call or name, and the kernels `route` picks
SOURCES = ("mean", "zeros", "load")
KERNELS = ("torch", "default")
# the values a site reads or writes: the DeltaNet catalogue and the model's own
VALUE_NAMES = tuple(values.CATALOGUE) + tuple(values.MODEL_VALUES)

_WORD_END = r"(?![A-Za-z0-9_])"


class DeltaLangLexer(RegexLexer):
    """deltalang: experiments on the recurrent state of gated-DeltaNet blocks."""

    name = "deltalang"
    aliases = ["deltalang", "dl"]
    filenames = ["*.dl"]
    mimetypes = ["text/x-deltalang"]

    tokens = {
        "root": [
            (r"[ \t\f]+", Whitespace),
            (r"\r?\n", Whitespace),
            (r"#[^\n]*", Comment.Single),
            (r'"', String.Double, "string"),
            (words(KEYWORDS, suffix=_WORD_END), Keyword),
            (words(MEASURES + SOURCES, suffix=_WORD_END), Name.Builtin),
            (words(KERNELS, suffix=_WORD_END), Name.Constant),
            (r"L(?:[0-9]+|\*)" + _WORD_END, Name.Label),  # a block: L3, L*
            (words(VALUE_NAMES, suffix=_WORD_END), Name.Attribute),
            (r"[A-Za-z_][A-Za-z0-9_]*", Name),
            (r"-?[0-9]+(?:\.[0-9]+(?:[eE][-+]?[0-9]+)?|[eE][-+]?[0-9]+)", Number.Float),
            (r"-?[0-9]+", Number.Integer),
            (r"\.\.|[*+\-/]=|[=*+\-/]", Operator),
            (r"[{}()\[\],;:.]", Punctuation),
        ],
        "string": [
            (r"\\.", String.Escape),
            (r'[^"\\\n]+', String.Double),
            (r'"', String.Double, "#pop"),
            (r"\n", Error, "#pop"),  # strings are one line
        ],
    }


def _plain_errors(tokens: Iterable[tuple[_TokenType, str]]) -> Iterator[tuple[_TokenType, str]]:
    """What the lexer cannot place (the token tables of `check`'s output) left uncoloured."""
    for kind, value in tokens:
        yield (Text if kind in Error else kind), value


def highlight(text: str) -> str:
    """`text` with ANSI colours for a terminal; anything that is not deltalang stays plain."""
    tokens = _plain_errors(DeltaLangLexer(stripnl=False, ensurenl=False).get_tokens(text))
    return _format(tokens, TerminalFormatter())
