"""Program text -> `deltalang.language.ast.Program`, with every slip reported as a DeltaSyntaxError.

Lark (LALR, contextual lexer) turns the text into a parse tree; the functions
below turn that tree into AST nodes with spans. The grammar is generous on
purpose (sites, sources and measures are all dotted paths, every statement is
allowed everywhere), so that the messages for the common slips are written
here, in words a researcher knows, rather than by Lark. A Lark exception or a
Python traceback reaching the user is a bug.
"""

from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Sequence

import attrs
from lark import Lark, Token
from lark import Tree as _LarkTree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken
from lark.lark import PostLex

from deltalang.ground.errors import DeltaError, DeltaErrors, DeltaSyntaxError, Span

from . import ast

GRAMMAR_PATH = Path(__file__).resolve().parent / "grammar" / "deltalang.lark"

# statement keywords, in the order a message lists them
_PATHS = ("blocks", "outputs", "embeddings")  # method attribution's paths (sweep/paths.py)
STATEMENTS = ("read", "write", "measure", "route", "step", "trace", "generate", "sweep",
              "prompt", "prompts", "dataset", "model")
KEYWORDS = frozenset(STATEMENTS + ("on", "over", "in", "max_new_tokens", "as", "from", "at"))
MEASURES = ("prob", "logit_diff", "kl", "norm", "rank", "top", "project")
REDUCTIONS = ("head", "norm", "mean", "project", "svd", "rank", "erank")  # `SITE.norm(...)` etc.: reductions after a site
KERNELS = ("torch", "default")
BLOCK_KINDS = ("linear", "ssm", "attention")  # delta-rule, Mamba-2 and attention blocks


# ---- the Lark parser -------------------------------------------------------


class _Layout(PostLex):
    """Drop statement separators inside (...) and [...], so that lists may span lines."""

    always_accept = ("_SEP",)

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        depth = 0
        for tok in stream:
            if tok.type in ("LPAR", "LSQB"):
                depth += 1
            elif tok.type in ("RPAR", "RSQB"):
                depth = max(0, depth - 1)
            elif tok.type == "_SEP" and depth:
                continue
            yield tok


@functools.cache
def _lark() -> Lark:
    """The parser, built once per process; its tables are cached in the temp directory (keyed by the grammar's
    hash), which makes `deltalang fmt` start at once."""
    return Lark(GRAMMAR_PATH.read_text(encoding="utf-8"), parser="lalr", lexer="contextual",
                propagate_positions=True, maybe_placeholders=True, postlex=_Layout(), cache=True)


# ---- entry point -------------------------------------------------------------


def parse(text: str, filename: str = "<program>") -> ast.Program:
    """Parse a program. Raises DeltaSyntaxError (or DeltaErrors) located in `text`."""
    return parse_partial(text, filename).complete()


@attrs.frozen
class Partial:
    """A program parsed as far as it goes: what was built, each statement's error (located), and what was left out.
    Parsed once, it is what the entry points pass on: `check` reports its errors beside the resolver's.

    `program` lacks the items and statements that failed (`dropped`: their source text); `statements_only`:
    every one of them is a statement (read, write, measure, route, step), no declaration or run, so the
    rest of the program can be checked beside their errors.
    """

    program: ast.Program
    errors: tuple[DeltaError, ...]
    dropped: tuple[str, ...]
    statements_only: bool

    def complete(self) -> ast.Program:
        """The program when every statement built, else its errors (located) raised as `parse` raises them."""
        if self.errors:
            raise self.errors[0] if len(self.errors) == 1 else DeltaErrors(list(self.errors))
        return self.program


_STATEMENT_RULES = ("read", "write", "measure", "route", "step")


def parse_partial(text: str, filename: str = "<program>") -> Partial:
    """Parse a program, keeping what builds when some statements fail. A text Lark cannot parse at all raises."""
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as e:
        raise _from_lark(e, text).located(text, filename) from None
    builder = _Builder(text)
    program = builder.program(tree)
    errs: list[DeltaError] = sorted(builder.errors, key=_err_key)
    for e in errs:
        e.located(text, filename)
    dropped = tuple(_source_of(text, builder.span(n)) for n in builder.dropped)
    return Partial(program, tuple(errs), dropped, all(n.data in _STATEMENT_RULES for n in builder.dropped))


def _source_of(text: str, span: Span) -> str:
    lines = text.split("\n")[span.line - 1:span.end_line]
    if not lines:
        return ""
    if len(lines) == 1:
        return lines[0][span.column - 1:span.end_column - 1]
    return "\n".join([lines[0][span.column - 1:], *lines[1:-1], lines[-1][:span.end_column - 1]])


def _err_key(e: DeltaError) -> tuple[int, int]:
    return (e.span.line, e.span.column) if e.span is not None else (0, 0)


# ---- Lark errors -> DeltaSyntaxError -------------------------------------------

_DESCRIBE = {
    "NAME": "a name", "STRING": "a quoted string", "INT": "a whole number", "FLOAT": "a number",
    "LAYER": "a block like L3", "LSTAR": "L*", "_SEP": "a newline or ';'", "$END": "the end of the program",
    "_DOTDOT": "'..'", "_SCALE": "'*='",
}


def _describe_expected(name: str) -> str:
    if name in _DESCRIBE:
        return _DESCRIBE[name]
    for t in _lark().terminals:
        if t.name == name:
            return f"'{t.pattern.value}'"
    return name.lower()


def _describe_token(tok: Token) -> str:
    if tok.type == "$END":
        return "the end of the program"
    if tok.type == "_SEP":
        return "';'" if tok.value.startswith(";") else "the end of the line"
    if tok.type == "STRING":
        return f"the string {tok.value}"
    return f"'{tok.value}'"


def _or_list(items: Sequence[str]) -> str:
    items = list(dict.fromkeys(items))
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " or " + items[-1]


def _end_span(text: str) -> Span:
    lines = text.split("\n")
    line = len(lines)
    col = len(lines[-1]) + 1
    # point at the last non-empty line rather than after a trailing newline
    while line > 1 and not lines[line - 1].strip():
        line -= 1
        col = len(lines[line - 1].rstrip()) + 1
    return Span(line, col, line, col + 1)


def _token_span(tok: Token, text: str) -> Span:
    if tok.type == "$END" or tok.line is None or tok.column is None:
        return _end_span(text)
    if tok.type == "_SEP":
        return Span(tok.line, tok.column, tok.line, tok.column + 1)
    end_line = tok.end_line or tok.line
    end_col = tok.end_column or tok.column + max(1, len(tok.value))
    return Span(tok.line, tok.column, end_line, end_col)


def _line_of(text: str, line: int) -> str:
    lines = text.split("\n")
    return lines[line - 1] if 1 <= line <= len(lines) else ""


def _unclosed_brace(text: str) -> Span | None:
    """The `{` left open at the end of `text`, skipping strings and comments."""
    stack: list[Span] = []
    for n, line in enumerate(text.split("\n"), start=1):
        i, in_str = 0, False
        while i < len(line):
            c = line[i]
            if in_str:
                if c == "\\":
                    i += 1
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c == "#":
                break
            elif c == "{":
                stack.append(Span(n, i + 1, n, i + 2))
            elif c == "}" and stack:
                stack.pop()
            i += 1
    return stack[-1] if stack else None


def _from_lark(e: UnexpectedInput, text: str) -> DeltaSyntaxError:
    """A friendly DeltaSyntaxError for a Lark error."""
    if isinstance(e, UnexpectedCharacters):
        return _bad_character(e, text)
    if isinstance(e, UnexpectedEOF):
        tok = Token("$END", "")
        return _unexpected_token(tok, set(e.expected), text, None)
    if isinstance(e, UnexpectedToken):
        prev, expected = None, set(e.expected)
        if e.interactive_parser is not None:
            prev = _previous_token(e.interactive_parser)
            try:  # what the parser truly accepts (the lexer's set includes _SEP everywhere)
                ip: Any = e.interactive_parser
                expected = set(ip.accepts()) or expected
            except Exception:  # noqa: BLE001 - only a better message is at stake
                pass
        return _unexpected_token(e.token, expected, text, prev)
    return DeltaSyntaxError("the program does not parse", _end_span(text))


def _previous_token(ip: Any) -> Token | None:
    """The token Lark shifted last before an error, when it kept one."""
    try:
        stack = ip.parser_state.value_stack
    except AttributeError:
        return None
    for v in reversed(stack):
        if isinstance(v, Token):
            return v
        if isinstance(v, _LarkTree):
            toks: list[Token] = list(v.scan_values(lambda x: isinstance(x, Token)))
            if toks:
                return toks[-1]
            return None
    return None


def _bad_character(e: UnexpectedCharacters, text: str) -> DeltaSyntaxError:
    """A character no token starts with: most often an unterminated string."""
    line, col = e.line, e.column
    src = _line_of(text, line)
    char = e.char
    if char == '"':
        return DeltaSyntaxError(
            "unterminated string: a string needs its closing '\"' on the same line",
            Span(line, col, line, len(src) + 1),
            notes=['write \\" for a quote inside a string and \\n for a newline'])
    if char == "'":
        return DeltaSyntaxError("strings use double quotes: \"...\"", Span(line, col, line, col + 1))
    if char == "\\":
        return DeltaSyntaxError("a backslash only appears inside a string", Span(line, col, line, col + 1))
    if char == "\r":
        return DeltaSyntaxError("a carriage return without a newline", Span(line, col, line, col + 1))
    shown = char if char.isprintable() else repr(char)
    return DeltaSyntaxError(f"unexpected character '{shown}'", Span(line, col, line, col + 1))


_STMT_TERMS = {k.upper() for k in STATEMENTS}


def _unexpected_token(tok: Token, expected: set[str], text: str, prev: Token | None) -> DeltaSyntaxError:
    """The message for a token the parser cannot take here: the common slips first, then a plain one."""
    span = _token_span(tok, text)
    exp = {x for x in expected if x != "COMMENT"}
    if tok.type == "$END":
        return _unexpected_end(exp, text, span)
    if tok.type == "RBRACE" and "RBRACE" not in exp:
        if _unclosed_brace(text[: _offset(text, span)]) is None:
            return DeltaSyntaxError("unmatched '}': no block is open here", span)
        return DeltaSyntaxError(f"the statement is not finished before '}}': expected {_expected_words(exp)}", span)
    if exp & _STMT_TERMS:
        return _not_a_statement(tok, text, span)
    if tok.type.upper() in _STMT_TERMS and "_SEP" in exp:
        return DeltaSyntaxError(f"'{tok.value}' starts a new statement: put a newline or ';' before it", span)
    slip = _common_slip(tok, exp, prev)
    if slip is not None:
        return DeltaSyntaxError(slip, span)
    if len(exp) > 6:
        return DeltaSyntaxError(f"unexpected {_describe_token(tok)}", span)
    return DeltaSyntaxError(f"expected {_expected_words(exp)}, found {_describe_token(tok)}", span)


def _unexpected_end(exp: set[str], text: str, span: Span) -> DeltaSyntaxError:
    """The program stops too early: a run without a body, an unclosed block, half a statement."""
    if "LBRACE" in exp:
        return DeltaSyntaxError("a run needs a body: '{', the statements it runs, then '}'", span)
    if "RBRACE" in exp:
        brace = _unclosed_brace(text)
        return DeltaSyntaxError("missing '}': the block opened here is never closed", brace or span)
    return DeltaSyntaxError(f"the program ends in the middle of a statement: expected {_expected_words(exp)}", span)


def _not_a_statement(tok: Token, text: str, span: Span) -> DeltaSyntaxError:
    """Where a statement must start: a misspelt keyword, a bare site, a stray brace."""
    if tok.type == "NAME":
        guess = difflib.get_close_matches(tok.value, STATEMENTS, n=1, cutoff=0.6)
        if guess:
            return DeltaSyntaxError(f"unknown statement '{tok.value}'; did you mean '{guess[0]}'?", span)
        return DeltaSyntaxError(
            f"unknown statement '{tok.value}': a statement starts with {_or_list(STATEMENTS)}", span)
    if tok.type in ("LAYER", "LSTAR"):
        rest = _line_of(text, span.line)[span.column - 1:].split("#")[0].split(";")[0].strip()
        return DeltaSyntaxError(f"a statement starts with a keyword; did you mean 'read {rest}'?", span)
    if tok.type == "LBRACE":
        return DeltaSyntaxError("a block needs a run header first: trace NAME on PROMPT { ... }", span)
    return DeltaSyntaxError(
        f"unexpected {_describe_token(tok)}: a statement starts with {_or_list(STATEMENTS)}", span)


def _common_slip(tok: Token, exp: set[str], prev: Token | None) -> str | None:
    """A message for a slip inside a statement that Lark would only call an unexpected token."""
    prev_type = prev.type if prev is not None else None
    if prev is not None and prev_type == "NAME" and prev.value == "L" and tok.type in ("INT", "MINUS"):
        return "a block is L3, L*, L[linear], L[attention], L[0:6] or L[0,2,4]; L[-1] is the last block"
    if prev_type == "INT" and tok.type == "DOT":
        return "expected a whole number here (a position or a block number)"
    if prev_type == "DOT":
        return f"expected a value after '.', found {_describe_token(tok)}"
    if tok.type in ("INT", "FLOAT") and prev_type == "EQUAL" and "NAME" in exp:
        return f"after '=' comes zeros, the name of a read, or mean(PROMPTS); to scale write '*= {tok.value}'"
    if tok.type == "FLOAT" and "INT" in exp:
        return f"expected a whole number, found '{tok.value}'"
    if tok.type == "_SEP" and exp == {"LBRACE"}:
        return "a run needs a body: '{' and the statements it runs, then '}'"
    return None


def _offset(text: str, span: Span) -> int:
    lines = text.split("\n")
    return sum(len(x) + 1 for x in lines[: span.line - 1]) + span.column - 1


def _expected_words(exp: set[str]) -> str:
    if "FLOAT" in exp:
        exp = exp - {"INT"}
    words = sorted(_describe_expected(x) for x in exp)
    if len(words) > 6:
        return "a statement" if exp & _STMT_TERMS else "something else here"
    return _or_list(words)


# ---- parse tree -> AST ------------------------------------------------------

# Lark's trees hold Tokens and Trees side by side; the builder reads them by shape
Node = Any

_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t", "r": "\r"}


class _Builder:
    """Turns Lark's parse tree into AST nodes, collecting every error it meets."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.errors: list[DeltaError] = []
        self.dropped: list[Node] = []  # the items and statements left out for their errors

    # -- helpers --

    def fail(self, message: str, span: Span, notes: Sequence[str] = ()) -> NoReturn:
        raise _Abandon(DeltaSyntaxError(message, span, notes=notes))

    def collect(self, fn: Callable[[], Any]) -> Any:
        """Run `fn`; on an error, record it and return None (the node is dropped)."""
        try:
            return fn()
        except _Abandon as a:
            self.errors.append(a.error)
            return None

    def span(self, node: Node | Token) -> Span:
        if isinstance(node, Token):
            return Span(node.line or 0, node.column or 0, node.end_line or node.line or 0,
                        node.end_column or (node.column or 0) + len(node.value))
        m = node.meta
        if getattr(m, "empty", True):
            return ast.NOSPAN
        return Span(m.line, m.column, m.end_line, m.end_column)

    def string(self, tok: Token) -> str:
        """The text of a STRING token, escapes decoded."""
        body = tok.value[1:-1]
        out: list[str] = []
        i = 0
        while i < len(body):
            c = body[i]
            if c == "\\":
                nxt = body[i + 1]
                if nxt not in _ESCAPES:
                    col = (tok.column or 0) + 1 + i
                    self.fail(f"unknown escape '\\{nxt}' in a string: the escapes are \\\" \\\\ \\n \\t \\r",
                              Span(tok.line or 0, col, tok.line or 0, col + 2))
                out.append(_ESCAPES[nxt])
                i += 2
            else:
                out.append(c)
                i += 1
        return "".join(out)

    def name(self, tok: Token, what: str) -> str:
        """A NAME token that defines something: not a keyword."""
        if tok.value in KEYWORDS:
            self.fail(f"'{tok.value}' is a keyword and cannot name {what}", self.span(tok))
        return str(tok.value)

    # -- program and items --

    def program(self, tree: Node) -> ast.Program:
        items: list[ast.Item] = []
        for child in tree.children:
            if child is None:
                continue
            node = self.collect(functools.partial(self.item, child, None))
            if node is not None:
                items.append(node)
            else:
                self.dropped.append(child)
        return ast.Program(tuple(items), comments=tuple(_comments(self.text)), span=self.span(tree))

    def item(self, tree: Node, context: Node | None, in_step: bool = False) -> Any:
        """One item: a declaration, a run, or a statement, checked against where it stands."""
        kind = tree.data
        sp = self.span(tree)
        where = self.describe_run(context) if context is not None else ""
        if kind in ("model_decl", "prompt_decl", "prompts_decl", "dataset_decl"):
            word = {"model_decl": "model", "prompt_decl": "prompt", "prompts_decl": "prompts",
                    "dataset_decl": "dataset"}[kind]
            if context is not None:
                self.fail(f"'{word}' is a declaration: put it at the top level, outside {where}", sp)
            return getattr(self, kind)(tree)
        if kind in ("trace", "generate", "sweep"):
            if context is not None:
                self.fail(f"runs do not nest: close {where} with '}}' before starting '{kind}'", sp)
            return getattr(self, kind)(tree)
        if kind == "step":
            if in_step:
                self.fail("one 'step' per statement: 'step 1: step 2: ...' is not allowed", sp)
            if context is None or context.data != "generate":
                inside = f"; {where} runs one forward pass" if context is not None and context.data == "trace" else ""
                if context is not None and context.data == "sweep":
                    inside = f"; {where} is a sweep of traces"
                self.fail(f"'step' only works inside a generate block{inside}", sp,
                          notes=["generate NAME on PROMPT max_new_tokens N { step 1: ... }"])
            return self.step(tree, context)
        if kind == "route" and in_step:
            self.fail("'route' applies to the whole run: put it outside 'step'", sp)
        return getattr(self, kind)(tree)

    def describe_run(self, tree: Node) -> str:
        return f"'{tree.data} {tree.children[0]}'"

    def model_decl(self, tree: Node) -> ast.ModelDecl:
        return ast.ModelDecl(self.string(tree.children[0]), span=self.span(tree))

    def prompt_decl(self, tree: Node) -> ast.PromptDecl:
        name, text = tree.children
        return ast.PromptDecl(self.name(name, "a prompt"), self.string(text), span=self.span(tree))

    def prompts_decl(self, tree: Node) -> ast.PromptListDecl:
        name, *texts = tree.children
        strings = tuple(self.string(t) for t in texts if t is not None)
        if not strings:
            self.fail(f"the prompt list '{name}' is empty", self.span(tree))
        return ast.PromptListDecl(self.name(name, "a prompt list"), strings, span=self.span(tree))

    def dataset_decl(self, tree: Node) -> ast.DatasetDecl:
        name, path = tree.children
        text = self.string(path)
        if not text:
            self.fail(f"the dataset '{name}' names no file", self.span(path))
        return ast.DatasetDecl(self.name(name, "a dataset"), text, span=self.span(tree))

    def body(self, block: Node, run: Node) -> tuple[ast.Statement, ...]:
        out: list[ast.Statement] = []
        for child in block.children:
            if child is None:
                continue
            node = self.collect(functools.partial(self.item, child, run))
            if node is not None:
                out.append(node)
            else:
                self.dropped.append(child)
        return tuple(out)

    def trace(self, tree: Node) -> ast.Trace:
        name, prompt, block = tree.children
        return ast.Trace(self.name(name, "a run"), self.on_prompt(prompt), self.body(block, tree),
                         span=self.span(tree))

    def generate(self, tree: Node) -> ast.Generate:
        name, prompt, n, *opts, block = tree.children
        return ast.Generate(self.name(name, "a run"), self.on_prompt(prompt), int(n), self.body(block, tree),
                            self.sampling(opts), span=self.span(tree))

    def sampling(self, opts: list[Node]) -> ast.Sampling | None:
        """`temperature T`, `top_p P`, `seed S` (each once, any order); none: greedy."""
        if not opts:
            return None
        got: dict[str, Any] = {}
        usage = "after max_new_tokens a generate takes temperature T (> 0), top_p P (0 < P <= 1) and seed S"
        for opt in opts:
            key, num = opt.children
            tok = num.children[0]
            k = str(key)
            if k not in ("temperature", "top_p", "seed"):
                guess = difflib.get_close_matches(k, ["temperature", "top_p", "seed"], n=1)
                self.fail(f"unknown option '{k}'{f' (did you mean {guess[0]!r}?)' if guess else ''}: {usage}",
                          self.span(key))
            if k in got:
                self.fail(f"'{k}' is given twice", self.span(opt))
            value = float(tok.value)
            if k == "seed" and (tok.type != "INT" or value < 0):
                self.fail("seed is a whole number >= 0: seed 1", self.span(opt))
            if k == "temperature" and not value > 0:
                self.fail("temperature must be > 0 (greedy is the default: leave sampling options out)",
                          self.span(opt))
            if k == "top_p" and not 0 < value <= 1:
                self.fail("top_p is a share of the probability, 0 < top_p <= 1", self.span(opt))
            got[k] = int(tok.value) if k == "seed" else value
        if set(got) == {"seed"}:
            self.fail("seed makes sampling reproducible: give temperature and/or top_p too (greedy needs no seed)",
                      self.span(opts[0]))
        sp = _cover(self.span(opts[0]), self.span(opts[-1]))
        return ast.Sampling(got.get("temperature"), got.get("top_p"), got.get("seed"), span=sp)

    def on_prompt(self, tree: Node) -> str:
        """`on clean`, or a dataset's field `on facts.corrupt` (kept as the text `facts.corrupt`)."""
        return ".".join(str(t) for t in tree.children)

    def sweep(self, tree: Node) -> ast.Sweep:
        name, prompt, *parts, method, block = tree.children
        groups: list[tuple[Node, list[Node]]] = []
        for part in parts:  # a part without `VAR in` continues the list of positions before it
            if part.data == "axis":
                groups.append((part, [part.children[1]]))
            elif not groups:
                self.fail("a sweep axis names its variable: over L in L[linear], t in 0..9", self.span(part))
            else:
                groups[-1][1].append(part.children[0])
        built = tuple(self.axis(head, items) for head, items in groups)
        return ast.Sweep(self.name(name, "a run"), self.on_prompt(prompt), built, self.body(block, tree),
                         span=self.span(tree), method=None if method is None else self.sweep_method(method))

    def sweep_method(self, tree: Node) -> ast.SweepMethod:
        """`method exact` or `method attribution [steps K] [refine K] [path blocks|outputs|embeddings]`."""
        name, *opts = tree.children
        if str(name) not in ("exact", "attribution"):
            self.fail(f"a sweep's method is exact or attribution, not '{name}'", self.span(name))
        got: dict[str, Any] = {}
        for opt in opts:
            key, value = (str(x) for x in opt.children)
            want_int = key in ("steps", "refine")
            if str(name) != "attribution" or key not in ("steps", "refine", "path") or key in got:
                self.fail(f"'{key}' is not an option of method {name} here (method attribution takes steps K, "
                          f"refine K and path blocks|outputs|embeddings, each once)", self.span(opt))
            if want_int != (opt.children[1].type == "INT") or (key == "path" and value not in _PATHS):
                self.fail(f"{key} takes {'a count (steps 4, refine 20)' if want_int else 'blocks, outputs or embeddings'}"
                          f", not '{value}'", self.span(opt.children[1]))
            got[key] = int(value) if want_int else value
        return ast.SweepMethod(str(name), **got, span=self.span(tree))

    def axis(self, tree: Node, items: list[Node]) -> ast.Axis:
        var = tree.children[0]
        usage = ("a sweep axis is a block selector (L[linear], L[0:6], L*), a range (0..9) or a list of positions "
                 "(2, \"Tower\", -1; over a dataset facts.subject, facts.subject[0], facts.subject + 1)")
        if len(items) > 1 or self.axis_position(items[0]) is not None:
            positions = [self.axis_position(i) for i in items]
            for i, p in zip(items, positions):
                if p is None:
                    self.fail(usage, self.span(i))
            domain: Any = ast.PosList(tuple(p for p in positions if p is not None),
                                      span=_cover(self.span(items[0]), self.span(items[-1])))
            return ast.Axis(self.name(var, "a sweep variable"), domain, span=self.span(tree))
        dom = items[0].children[0]
        if isinstance(dom, _LarkTree) and dom.data == "range":
            start, stop = (int(str(x)) for x in dom.children)
            domain = ast.Range(start, stop, span=self.span(dom))
        else:
            segs = dom.children
            if len(segs) != 1 or segs[0].data not in ("layer_seg", "star_seg", "bracket_seg"):
                if len(segs) == 1 and segs[0].data == "name_seg" and str(segs[0].children[0]) == "heads":
                    return ast.Axis(self.name(var, "a sweep variable"), ast.Heads(span=self.span(dom)),
                                    span=self.span(tree))
                self.fail(usage, self.span(dom))
            if segs[0].data == "bracket_seg" and str(segs[0].children[0]) == "heads":  # heads[0:4]
                items = tuple(self.sel_item(i) for i in segs[0].children[1].children)
                if any(isinstance(i, ast.SelKind) for i in items):
                    self.fail("heads[...] takes head numbers and slices: heads[0:4], heads[0,2]", self.span(dom))
                return ast.Axis(self.name(var, "a sweep variable"), ast.Heads(items, span=self.span(dom)),
                                span=self.span(tree))
            domain = self.selector(segs[0])
        return ast.Axis(self.name(var, "a sweep variable"), domain, span=self.span(tree))

    def axis_position(self, item: Node) -> ast.AxisPos | None:
        """One position of a list: a number, a quoted piece, or a field (with its token index and offset)."""
        x = item.children[0]
        sp = self.span(item)
        if isinstance(x, Token):
            return ast.IntPos(int(x.value), span=sp) if x.type == "INT" else ast.PiecePos(self.string(x), span=sp)
        offset = 0
        if x.data == "offset":
            base, sign, n = x.children
            offset = int(n) if sign.type == "PLUS" else -int(n)
            if int(n) < 0:
                self.fail(f"write an offset as {'+' if offset < 0 else '-'} {abs(int(n))}", sp)
            if isinstance(base, Token):
                self.fail("an offset counts from a record's field (facts.subject + 1); in one prompt name the "
                          "token's number instead", sp)
            x = base
        if x.data != "path":
            return None
        segs = x.children
        if len(segs) != 2 or segs[0].data != "name_seg" or segs[1].data not in ("name_seg", "bracket_seg"):
            return None if not offset else self.fail("an offset counts from a record's field: facts.subject + 1",
                                                     sp)
        index = None
        if segs[1].data == "bracket_seg":
            head, sel = segs[1].children
            if len(sel.children) != 1 or sel.children[0].data != "sel_index":
                self.fail("a field's token is one number: facts.subject[0] (its first), facts.subject[-1] "
                          "(its last)", self.span(segs[1]))
            field_name, index = str(head), int(sel.children[0].children[0])
        else:
            field_name = str(segs[1].children[0])
        field = ast.Field(str(segs[0].children[0]), field_name, span=self.span(x))
        return ast.FieldPos(field, index, offset, span=sp)

    # -- statements --

    def read(self, tree: Node) -> ast.Read:
        *paths, alias = tree.children
        for p in paths:
            head = p.children[0]
            if len(p.children) == 1 and head.data == "call_seg" and str(head.children[0]) in ("norm", "project"):
                self.fail(f"{head.children[0]}(...) is a measure; a read reduces a site after it: "
                          f"read L0.states.norm(key_dim, value_dim), read L0.states.project(load(\"d.safetensors\"))",
                          self.span(p))
        sites = tuple(self.site(p) for p in paths)
        if alias is not None and len(sites) > 1:
            self.fail("'as' names one site; read the others in a statement of their own", self.span(alias))
        return ast.Read(sites, None if alias is None else self.name(alias, "a read"), span=self.span(tree))

    def write(self, tree: Node) -> ast.Write:
        path, src = tree.children
        return ast.Write(self.site(path), self.source(src), span=self.span(tree))

    def measure(self, tree: Node) -> ast.Measure:
        *paths, at, alias = tree.children
        calls = tuple(self.measure_call(p) for p in paths)
        if alias is not None and len(calls) > 1:
            self.fail("'as' names one measure; measure the others in a statement of their own",
                      self.span(alias))
        pos = None if at is None else self.position(at.children[0])
        return ast.Measure(calls, None if alias is None else self.name(alias, "a measure"),
                           pos, span=self.span(tree))  # type: ignore[arg-type]

    def route(self, tree: Node) -> ast.Route:
        tok = tree.children[0]
        if tok.value not in KERNELS:
            guess = difflib.get_close_matches(tok.value, KERNELS, n=1, cutoff=0.5)
            hint = f"; did you mean '{guess[0]}'?" if guess else ""
            self.fail(f"unknown route '{tok.value}': route torch (token-by-token kernel) or route default{hint}",
                      self.span(tok))
        return ast.Route(str(tok.value), span=self.span(tree))

    def step(self, tree: Node, context: Node) -> ast.Step:
        k, body = tree.children
        return ast.Step(int(k), self.item(body, context, in_step=True), span=self.span(tree))

    # -- sources --

    def source(self, tree: Node) -> ast.Source:
        sp = self.span(tree)
        if tree.data == "scale_source":
            tok = tree.children[0].children[0]
            return ast.ScaleSource(float(tok.value), span=sp)
        if tree.data == "add_source":
            return ast.ExprSource(self.expr(tree.children[0]), True, span=sp)
        if tree.children[0].data in ("binop", "number"):
            node = tree.children[0]
            if node.data == "number":
                tok = node.children[0]
                self.fail(f"after '=' comes zeros, the name of a read, mean(PROMPTS) or load(FILE); to scale write "
                          f"'*= {tok.value}', to add '+= {tok.value}'", self.span(tok))
            return ast.ExprSource(self.expr(node), False, span=sp)
        path = tree.children[0]
        segs = path.children
        if tree.data == "from_source":
            head = segs[0]
            if head.data != "name_seg":
                self.fail("'from' takes the name of a run or a prompt: 'from RUN' or 'from RUN.VALUE'",
                          self.span(head))
            rest = segs[1:]
            site = self.site_from_segments(rest, _cover(self.span(rest[0]), self.span(rest[-1]))) if rest else None
            at = None if tree.children[1] is None else self.position(tree.children[1].children[0])
            if at is not None and site is not None and site.position is not None:
                self.fail(f"the donor's position is named twice: drop '({ast.format_position(site.position)})' "
                          f"or 'at {ast.format_position(at)}'", at.span)
            return ast.FromSource(str(head.children[0]), site, span=sp, at=at)
        # assign_source: zeros | NAME | mean(...)
        hint = "after '=' comes zeros, the name of a read, or mean(PROMPTS)"
        if len(segs) != 1:
            self.fail(hint + "; to take a site from another run write 'from RUN.VALUE'", self.span(path))
        seg = segs[0]
        if seg.data == "name_seg":
            name = str(seg.children[0])
            return ast.ZerosSource(span=sp) if name == "zeros" else ast.NamedSource(name, span=sp)
        if seg.data == "call_seg" and seg.children[0].value == "load":
            return self.load(seg, sp)
        if seg.data == "call_seg":
            fn, args = seg.children
            if fn.value != "mean":
                guess = " (did you mean 'mean'?)" if difflib.get_close_matches(fn.value, ["mean"]) else ""
                self.fail(f"unknown function '{fn.value}'{guess}: {hint}", self.span(fn))
            names = self.name_args(args, seg, "mean takes prompt names: mean(foods) or mean(a, b)")
            return ast.MeanSource(names, span=sp)
        self.fail(hint, self.span(seg))

    def load(self, seg: Node, sp: Span) -> ast.LoadSource:
        """`load("file.safetensors")` or `load("file.safetensors", "key")`."""
        args = seg.children[1]
        arglist = [] if args is None else list(args.children)
        if not 1 <= len(arglist) <= 2 or not all(isinstance(a, Token) and a.type == "STRING" for a in arglist):
            self.fail('load takes a quoted file and optionally a quoted key: load("direction.safetensors") or '
                      'load("file.safetensors", "key")', self.span(seg))
        texts = [self.string(a) for a in arglist]
        return ast.LoadSource(texts[0], texts[1] if len(texts) > 1 else None, span=sp)

    def expr(self, node: Node) -> ast.Expr:
        """An operand of `= EXPR` / `+= EXPR`: a source, a number, or `LEFT OP RIGHT`."""
        sp = self.span(node)
        if node.data == "binop":
            left, op, right = node.children
            return ast.BinOp(str(op.value), self.expr(left), self.expr(right), span=sp)
        if node.data == "number":
            return ast.Number(float(node.children[0].value), span=sp)
        segs = node.children
        if len(segs) > 1:  # RUN.SITE: a donor, as in `from`
            if segs[0].data != "name_seg":
                self.fail("a value from another run is RUN.SITE (other.L2.state_output), as after 'from'", sp)
            rest = segs[1:]
            return ast.FromSource(str(segs[0].children[0]),
                                  self.site_from_segments(rest, _cover(self.span(rest[0]), self.span(rest[-1]))),
                                  span=sp)
        src = self.source(_LarkTree("assign_source", [node], node.meta))
        if isinstance(src, ast.ExprSource):
            raise AssertionError("a lone path is a plain source")
        return attrs.evolve(src, span=sp)  # type: ignore[return-value]

    def name_args(self, args: Node | None, seg: Node, message: str) -> tuple[str, ...]:
        out: list[str] = []
        for a in (args.children if args is not None else []):
            if isinstance(a, _LarkTree) and len(a.children) == 1 and a.children[0].data == "name_seg":
                out.append(str(a.children[0].children[0]))
            else:
                self.fail(message, self.span(a))
        if not out:
            self.fail(message, self.span(seg))
        return tuple(out)

    # -- measures --

    def measure_call(self, path: Node) -> ast.MeasureCall:
        segs = path.children
        sp = self.span(path)
        usage = ("a measure is prob(\" tok\"), logit_diff(\" a\", \" b\"), kl(RUN), norm(SITE), rank(\" tok\"), "
                 "top(5) or project(SITE, load(FILE))")
        if len(segs) != 1 or segs[0].data != "call_seg":
            self.fail(usage + "; to keep a value use 'read'", sp)
        fn, args = segs[0].children
        name = str(fn.value)
        if name not in MEASURES:
            guess = difflib.get_close_matches(name, MEASURES, n=1, cutoff=0.5)
            hint = f"did you mean '{guess[0]}'? " if guess else ""
            self.fail(f"unknown measure '{name}': {hint}{usage}", self.span(fn))
        arglist = [] if args is None else list(args.children)
        if name in ("prob", "rank"):
            (tok,) = self.string_args(arglist, 1, name, sp)
            return (ast.Prob if name == "prob" else ast.Rank)(tok, span=sp)
        if name == "logit_diff":
            a, b = self.string_args(arglist, 2, name, sp)
            return ast.LogitDiff(a, b, span=sp)
        if name == "top":
            if len(arglist) != 1 or not isinstance(arglist[0], Token) or arglist[0].type != "INT" \
                    or int(arglist[0].value) < 1:
                self.fail("top takes how many tokens, a whole number >= 1: top(5)", sp)
            return ast.Top(int(arglist[0].value), span=sp)
        if name == "kl":
            (run,) = self.name_args(args, segs[0], "kl takes the name of a run: kl(base)")
            if len(arglist) != 1:
                self.fail("kl takes the name of one run: kl(base)", sp)
            return ast.KL(run, span=sp)
        if name == "project":
            return self.project_call(arglist, sp)
        over = None
        if len(arglist) == 2 and isinstance(arglist[1], _LarkTree) and arglist[1].data == "kwarg":
            over = self.over(arglist.pop())
        if len(arglist) != 1 or not isinstance(arglist[0], _LarkTree) or arglist[0].data == "kwarg":
            self.fail("norm takes one site, and optionally the axes: norm(L0.state_output), "
                      "norm(L0.states, over=[key_dim, value_dim])", sp)
        return ast.Norm(self.site(arglist[0]), span=sp, over=over)

    def over(self, kw: Node) -> tuple[str, ...]:
        """`over=[key_dim, value_dim]`: the axes of a norm."""
        name, *items = kw.children
        if str(name) != "over":
            self.fail(f"unknown argument '{name}': norm takes over=[AXES] (norm(L0.states, over=[key_dim]))",
                      self.span(name))
        return self.axis_names([i for i in items if i is not None], kw, "norm")

    def axis_names(self, items: list[Any], where: Node, fn: str) -> tuple[str, ...]:
        out = []
        for a in items:
            if not (isinstance(a, _LarkTree) and len(a.children) == 1 and a.children[0].data == "name_seg"):
                self.fail(f"{fn} takes the names of axes (positions, heads, key_dim, value_dim, ...)", self.span(a))
            out.append(str(a.children[0].children[0]))
        if not out:
            self.fail(f"{fn} takes the axes it reduces: {fn}(positions), {fn}(key_dim, value_dim)", self.span(where))
        return tuple(out)

    def project_call(self, arglist: list[Any], sp: Span) -> ast.Project:
        """`project(SITE, load("direction.safetensors"))` or `project(SITE, mean(a) - mean(b))`."""
        if len(arglist) != 2 or not all(isinstance(a, _LarkTree) and a.data in ("path", "arg_binop") for a in arglist) \
                or arglist[0].data != "path":
            self.fail('project takes a site and a direction: project(L4.state_output, load("dir.safetensors"))', sp)
        return ast.Project(self.site(arglist[0]), self.direction(arglist[1]), span=sp)

    def direction(self, path: Node) -> ast.LoadSource | ast.Expr:
        """A projection's direction: `load(FILE)`, or means of the projected site and arithmetic over them
        (`mean(a) - mean(b)`, `2 * mean(a)`)."""
        usage = ('a direction is a tensor from a file, load("direction.safetensors") or load("file.safetensors", '
                 '"key"), or a difference of means of the site over prompts: mean(happy) - mean(sad)')
        if path.data == "arg_binop":
            left, op, right = path.children
            return ast.BinOp(str(op.value), self.direction_operand(left, usage),
                             self.direction_operand(right, usage), span=self.span(path))
        segs = path.children
        if len(segs) == 1 and segs[0].data == "call_seg" and str(segs[0].children[0]) == "mean":
            return self.direction_operand(path, usage)
        if len(segs) != 1 or segs[0].data != "call_seg" or str(segs[0].children[0]) != "load":
            self.fail(usage, self.span(path))
        return self.load(segs[0], self.span(path))

    def direction_operand(self, node: Node, usage: str) -> ast.Expr:
        """An operand of a direction's arithmetic: mean(PROMPTS), a number, or arithmetic over them."""
        e = self.expr(node if node.data != "arg_binop" else _LarkTree("binop", node.children, node.meta))
        for a in ast.expr_operands(e):
            if not isinstance(a, (ast.MeanSource, ast.Number)):
                self.fail(usage, a.span)
        return e

    def reduction(self, seg: Node) -> ast.Reduce:
        """`.norm(AXES)`, `.mean(AXES)`, `.head(K)` (after another reduction), `.project(load(FILE))`."""
        fn, args = seg.children
        kind, sp = str(fn), self.span(seg)
        arglist = [] if args is None else list(args.children)
        if kind == "project":
            if len(arglist) != 1 or not isinstance(arglist[0], _LarkTree) or arglist[0].data not in ("path",
                                                                                                    "arg_binop"):
                self.fail('project takes a direction: .project(load("direction.safetensors")) or '
                          '.project(mean(happy) - mean(sad))', sp)
            return ast.Reduce("project", direction=self.direction(arglist[0]), span=sp)
        if kind == "head":
            head = self.head_index(seg)
            if not isinstance(head, ast.IntPos):
                self.fail("head(...) after another reduction takes a head number", sp)
            return ast.Reduce("head", index=head.value, span=sp)
        if kind in ("svd", "rank", "erank"):
            return self.spectrum(kind, arglist, sp)
        if kind == "mean" or arglist:
            return ast.Reduce(kind, self.axis_names(arglist, seg, kind), span=sp)
        return ast.Reduce(kind, span=sp)

    def spectrum(self, kind: str, arglist: list[Any], sp: Span) -> ast.Reduce:
        """`.svd(K)` (K >= 1), `.rank(TOL)` (a number >= 0, relative to the largest singular value), `.erank()`."""
        usage = {"svd": "svd(k) takes how many singular values, a whole number from 1: L1.state_output.svd(4)",
                 "rank": "rank(tol) takes a tolerance relative to the largest singular value: L1.state_output.rank(0.01)",
                 "erank": "erank() takes nothing: L1.state_output.erank(), the effective rank"}[kind]
        if kind == "erank":
            if arglist:
                self.fail(usage, sp)
            return ast.Reduce(kind, span=sp)
        tok = arglist[0] if len(arglist) == 1 else None
        if not isinstance(tok, Token) or tok.type not in (("INT",) if kind == "svd" else ("INT", "FLOAT")):
            self.fail(usage, sp)
        if kind == "svd":
            if int(tok.value) < 1:
                self.fail(usage, self.span(tok))
            return ast.Reduce(kind, index=int(tok.value), span=sp)
        if float(tok.value) < 0:
            self.fail(usage, self.span(tok))
        return ast.Reduce(kind, tol=float(tok.value), span=sp)

    def string_args(self, args: list[Any], n: int, fn: str, sp: Span) -> list[ast.Text]:
        shape = {"prob": 'prob(" Paris")', "rank": 'rank(" Paris")', "logit_diff": 'logit_diff(" Paris", " Rome")'}
        fields = [self.field(a) if isinstance(a, _LarkTree) else None for a in args]
        if len(args) != n or not all((isinstance(a, Token) and a.type == "STRING") or f is not None
                                     for a, f in zip(args, fields)):
            self.fail(f"{fn} takes {'one quoted token' if n == 1 else f'{n} quoted tokens'} (or a dataset's "
                      f"fields, facts.answer): {shape[fn]}", sp)
        return [f if f is not None else self.string(a) for a, f in zip(args, fields)]

    def field(self, path: Node) -> ast.Field | None:
        """`facts.subject`: a path of two plain names is a dataset's field; anything else is not."""
        segs = path.children
        if len(segs) == 2 and all(s.data == "name_seg" for s in segs):
            return ast.Field(str(segs[0].children[0]), str(segs[1].children[0]), span=self.span(path))
        return None

    # -- sites, selectors, positions --

    def site(self, path: Node) -> ast.Site:
        return self.site_from_segments(path.children, self.span(path))

    def site_from_segments(self, segs: list[Node], sp: Span) -> ast.Site:
        usage = "a site is BLOCK.VALUE (L0.state_output, L[linear].state_after(3)) or a model-level value (logits)"
        chain: list[Node] = []  # trailing reductions: `.mean(positions).norm()`
        while len(segs) > 1 and segs[-1].data == "call_seg" and str(segs[-1].children[0]) in REDUCTIONS:
            chain.insert(0, segs[-1])
            segs = segs[:-1]
        if chain and str(chain[0].children[0]) == "head":  # right after the value: the head's slice
            segs = [*segs, chain.pop(0)]
        if chain:
            inner = self.site_from_segments(segs, sp)
            return attrs.evolve(inner, reduce=tuple(self.reduction(r) for r in chain))
        if len(segs) > 1 and segs[-1].data == "call_seg" and str(segs[-1].children[0]) == "head":
            head = self.head_index(segs[-1])  # `SITE.head(3)`: one value head's slice of the site
            inner = self.site_from_segments(segs[:-1], sp)
            return ast.Site(inner.block, inner.value, inner.position, head, span=sp)
        if len(segs) > 2:
            self.fail(f"too many parts: {usage}", sp)
        if len(segs) == 1:
            seg = segs[0]
            if seg.data in ("layer_seg", "star_seg", "bracket_seg"):
                sel = ast.format_selector(self.selector(seg))
                self.fail(f"{sel} names blocks but no value: write e.g. {sel}.state_output", sp)
            value, pos = self.value_part(seg)
            return ast.Site(None, value, pos, span=sp)
        head, tail = segs
        if head.data == "call_seg":
            self.fail(f"{usage}; a value comes after the block", self.span(head))
        if tail.data not in ("name_seg", "call_seg"):
            self.fail(f"expected a value name after the block: {usage}", self.span(tail))
        block = self.selector(head)
        value, pos = self.value_part(tail)
        return ast.Site(block, value, pos, span=sp)

    def head_index(self, seg: Node) -> ast.IntPos | ast.VarPos:
        """The argument of `.head(3)` or `.head(h)` (a sweep variable over heads)."""
        args = seg.children[1]
        arglist = [] if args is None else list(args.children)
        if len(arglist) == 1 and isinstance(arglist[0], Token) and arglist[0].type == "INT":
            return ast.IntPos(int(arglist[0].value), span=self.span(arglist[0]))
        if len(arglist) == 1 and isinstance(arglist[0], _LarkTree) and len(arglist[0].children) == 1 \
                and arglist[0].children[0].data == "name_seg":
            return ast.VarPos(str(arglist[0].children[0].children[0]), span=self.span(arglist[0]))
        self.fail("head(...) takes one head number (counting value heads from 0) or a sweep variable: "
                  "L1.state_after(2).head(3)", self.span(seg))

    def value_part(self, seg: Node) -> tuple[str, ast.Position | None]:
        if seg.data == "name_seg":
            return str(seg.children[0]), None
        if seg.data != "call_seg":
            self.fail("expected a value name", self.span(seg))
        fn, args = seg.children
        arglist = [] if args is None else list(args.children)
        if len(arglist) != 1:
            self.fail(f"{fn}(...) takes one position: {fn}(3), {fn}(-1) or {fn}(\"word\")", self.span(seg))
        return str(fn), self.position(arglist[0])

    def position(self, arg: Node | Token) -> ast.Position:
        usage = "a position is a number (3, -1), a quoted piece of the prompt (\"Tower\"), or a sweep variable"
        if isinstance(arg, _LarkTree) and arg.data == "kwarg":
            self.fail("a named argument (over=[...]) belongs to norm(SITE, over=[AXES])", self.span(arg))
        if isinstance(arg, _LarkTree) and arg.data == "all_pos":
            return ast.AllPos(span=self.span(arg))
        if isinstance(arg, _LarkTree) and arg.data == "range":
            start, stop = (int(str(x)) for x in arg.children)
            return ast.RangePos(start, stop, span=self.span(arg))
        if isinstance(arg, Token):
            if arg.type == "INT":
                return ast.IntPos(int(arg.value), span=self.span(arg))
            if arg.type == "STRING":
                return ast.PiecePos(self.string(arg), span=self.span(arg))
            self.fail(usage, self.span(arg))
        if len(arg.children) == 1 and arg.children[0].data == "name_seg":
            return ast.VarPos(str(arg.children[0].children[0]), span=self.span(arg))
        field = self.field(arg)
        if field is not None:
            return field
        self.fail(usage + ", or a dataset's field (facts.subject)", self.span(arg))

    def selector(self, seg: Node) -> ast.Selector:
        sp = self.span(seg)
        if seg.data == "layer_seg":
            return ast.Block(int(seg.children[0].value[1:]), span=sp)
        if seg.data == "star_seg":
            return ast.AllBlocks(span=sp)
        if seg.data == "name_seg":
            return ast.BlockVar(str(seg.children[0]), span=sp)
        if seg.data == "bracket_seg":
            head, items = seg.children
            if head.value != "L":
                self.fail(f"a block selector is L[...], not {head.value}[...]", self.span(head))
            return ast.BlockList(tuple(self.sel_item(i) for i in items.children), span=sp)
        self.fail("expected a block: L3, L*, L[linear], L[0:6] or L[0,2,4]", sp)

    def sel_item(self, tree: Node) -> ast.SelItem:
        sp = self.span(tree)
        if tree.data == "sel_index":
            return ast.SelIndex(int(tree.children[0]), span=sp)
        if tree.data == "sel_slice":
            a, b = tree.children
            return ast.SelSlice(None if a is None else int(a), None if b is None else int(b), span=sp)
        kind = str(tree.children[0])
        if kind not in BLOCK_KINDS:
            aliases = {"deltanet": "linear", "linear_attention": "linear", "full_attention": "attention",
                       "attn": "attention", "delta": "linear", "mamba": "ssm", "mamba2": "ssm"}
            guess = aliases.get(kind) or next(iter(difflib.get_close_matches(kind, BLOCK_KINDS, n=1)), None)
            hint = f"; did you mean L[{guess}]?" if guess else ""
            self.fail(f"unknown kind of block '{kind}': L[linear] (DeltaNet blocks), L[ssm] (Mamba-2) or L[attention]{hint}", sp)
        return ast.SelKind(kind, span=sp)


def _cover(first: Span, last: Span) -> Span:
    """The span from the start of `first` to the end of `last`."""
    return Span(first.line, first.column, last.end_line, last.end_column)


class _Abandon(Exception):
    """Internal: carries a DeltaSyntaxError out of a node being built."""

    def __init__(self, error: DeltaSyntaxError) -> None:
        super().__init__(error.message)
        self.error = error


_COMMENT_RE = re.compile(r'"(?:\\.|[^"\\\n])*"|(#[^\n]*)')


def _comments(text: str) -> Iterator[ast.Comment]:
    """Every `# ...` comment of a program that parsed (strings skipped)."""
    for n, line in enumerate(text.split("\n"), start=1):
        if "#" not in line:
            continue
        for m in _COMMENT_RE.finditer(line):
            if m.group(1) is not None:
                col = m.start(1) + 1
                body = m.group(1).rstrip()
                yield ast.Comment(body, span=Span(n, col, n, col + len(body)))
                break
