"""Properties of the front end: printing round-trips, and no input ever escapes as a non-DeltaError.

- Random valid programs (built as ASTs by hypothesis): print -> parse gives the
  same AST, and `fmt` of any layout of them is stable.
- Random and mutated text: `parse` (and `resolve`, when it parses) either
  succeeds or raises a DeltaError that points into the text; a Lark exception or
  any other traceback is a bug.
"""

from __future__ import annotations

import os
import random
import string
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltalang.ground.errors import DeltaError, DeltaErrors
from deltalang.language import ast
from deltalang.language.parse import KEYWORDS, parse
from deltalang.language.resolve import resolve

HERE = Path(__file__).resolve().parent
# FUZZ_EXAMPLES=5000 for a long, randomised run; the default is quick and the same every time
_N = int(os.environ.get("FUZZ_EXAMPLES", "0"))
SETTINGS = settings(max_examples=_N or 150, deadline=None, derandomize=not _N,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---- strategies for valid ASTs ------------------------------------------------------------

_first = string.ascii_letters + "_"
_rest = string.ascii_letters + string.digits + "_"


def _ok_name(s: str) -> bool:
    return s not in KEYWORDS and not (s[0] == "L" and s[1:].isdigit() and len(s) > 1)


names = st.builds(lambda a, b: a + b, st.sampled_from(_first), st.text(_rest, max_size=6)).filter(_ok_name)
ref_names = names.filter(lambda s: s != "zeros")  # `= zeros` is the zeros source
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
ints = st.integers(-40, 40)
nat = st.integers(0, 40)

positions = st.one_of(st.builds(ast.IntPos, ints), st.builds(ast.PiecePos, texts), st.builds(ast.VarPos, names))
sel_items = st.one_of(
    st.builds(ast.SelIndex, ints),
    st.builds(ast.SelSlice, st.none() | ints, st.none() | ints),
    st.builds(ast.SelKind, st.sampled_from(["linear", "attention"])),
)
selectors = st.one_of(
    st.builds(ast.Block, nat),
    st.builds(ast.AllBlocks),
    st.builds(ast.BlockList, st.lists(sel_items, min_size=1, max_size=3).map(tuple)),
    st.builds(ast.BlockVar, names),
)
value_names = st.sampled_from(["state_output", "state_after", "states", "betas", "output"]) | names
sites = st.builds(ast.Site, st.none() | selectors, value_names, st.none() | positions)
sources = st.one_of(
    st.builds(ast.FromSource, names, st.none() | sites),
    st.builds(ast.ZerosSource),
    st.builds(ast.NamedSource, ref_names),
    st.builds(ast.ScaleSource, st.floats(allow_nan=False, allow_infinity=False)),
    st.builds(ast.MeanSource, st.lists(names, min_size=1, max_size=3).map(tuple)),
)
calls = st.one_of(
    st.builds(ast.Prob, texts), st.builds(ast.Rank, texts), st.builds(ast.LogitDiff, texts, texts),
    st.builds(ast.KL, names), st.builds(ast.Norm, sites),
)
reads = st.one_of(
    st.builds(ast.Read, st.lists(sites, min_size=1, max_size=3).map(tuple)),
    st.builds(ast.Read, st.tuples(sites), names),
)
measures = st.one_of(
    st.builds(ast.Measure, st.lists(calls, min_size=1, max_size=3).map(tuple)),
    st.builds(ast.Measure, st.tuples(calls), names),
)
writes = st.builds(ast.Write, sites, sources)
routes = st.builds(ast.Route, st.sampled_from(["torch", "default"]))
statements = st.one_of(reads, writes, measures, routes)
step_statements = st.builds(ast.Step, ints, st.one_of(reads, writes, measures))
bodies = st.lists(statements, max_size=4).map(tuple)
axes = st.builds(ast.Axis, names, st.one_of(selectors.filter(lambda s: not isinstance(s, ast.BlockVar)),
                                             st.builds(ast.Range, ints, ints)))
runs = st.one_of(
    st.builds(ast.Trace, names, names, bodies),
    st.builds(ast.Generate, names, names, ints,
              st.lists(st.one_of(statements, step_statements), max_size=4).map(tuple)),
    st.builds(ast.Sweep, names, names, st.lists(axes, min_size=1, max_size=2).map(tuple), bodies),
)
decls = st.one_of(
    st.builds(ast.ModelDecl, texts),
    st.builds(ast.PromptDecl, names, texts),
    st.builds(ast.PromptListDecl, names, st.lists(texts, min_size=1, max_size=3).map(tuple)),
)
programs = st.builds(ast.Program, st.lists(st.one_of(decls, runs, statements), max_size=6).map(tuple))


@SETTINGS
@given(programs)
def test_print_then_parse_is_identity(program: ast.Program) -> None:
    text = ast.format_program(program)
    assert parse(text) == program
    assert ast.format_program(parse(text)) == text


@SETTINGS
@given(programs, st.randoms(use_true_random=False))
def test_fmt_is_stable_under_any_layout(program: ast.Program, rnd: random.Random) -> None:
    """Semicolons for newlines, comments, extra spaces: the same program, and fmt settles at once."""
    lines = ast.format_program(program).split("\n")[:-1]
    text = ""
    for line in lines:
        sep = "; " if rnd.random() < 0.3 and text and not text.endswith("{") else "\n"
        text = (text + sep if text else "") + line
    out_lines = []
    for line in text.split("\n"):
        if rnd.random() < 0.3:
            line += "   # note " + rnd.choice(["a", "b ; }", '"q"'])
        if rnd.random() < 0.2:
            out_lines.append("")
        out_lines.append(("  " if rnd.random() < 0.5 else "") + line)
    messy = "\n".join(out_lines) + "\n"
    assert parse(messy) == program
    once = ast.format_program(parse(messy), messy)
    assert parse(once) == program
    assert ast.format_program(parse(once), once) == once
    assert once.count("# note") == messy.count("# note")


# ---- fuzzing with text ------------------------------------------------------------------------

_PIECES = ["read ", "write ", "measure ", "route ", "step 1: ", "trace t on p ", "generate g on p max_new_tokens 2 ",
           "sweep s on p over L in L[linear] ", "prompt p = ", "prompts q = ", "model ", "from ", "as ", "= ",
           "*= ", "{", "}", "(", ")", "[", "]", ",", ".", ";", "\n", ":", "..", "L0", "L*", "L", "L[", "0", "-1",
           "3", '"', '"Tower"', "'", "\\", "#", "state_after", "state_output", "states", "zeros", "mean(",
           "prob(", "kl(", "norm(", "next_token_probs", "tokens", " ", "x", "é", "\t", "\r\n", "0.5", "@", "1e"]


def _assert_delta_error(text: str, resolve_spec: Any = None) -> None:
    try:
        prog = parse(text, "fuzz.dl")
    except DeltaError as e:
        _assert_located(e, text)
        return
    if resolve_spec is not None:
        try:
            resolve(prog, resolve_spec, prompt_override="The Eiffel Tower", source=text, filename="fuzz.dl")
        except DeltaError as e:
            _assert_located(e.located(text, "fuzz.dl"), text)


def _assert_located(e: DeltaError, text: str) -> None:
    errs = e.errors if isinstance(e, DeltaErrors) else [e]
    assert errs
    n_lines = text.count("\n") + 1
    for x in errs:
        assert x.span is not None, x.message
        assert 1 <= x.span.line <= n_lines, (x.span, x.message)
        assert x.span.column >= 1
        assert x.message and "Token(" not in x.message and "Tree(" not in x.message, x.message
        x.render()
    e.render()


@SETTINGS
@given(st.lists(st.sampled_from(_PIECES), max_size=25).map("".join))
def test_token_soup_only_raises_delta_errors(text: str) -> None:
    _assert_delta_error(text)


@SETTINGS
@given(st.text(max_size=60))
def test_random_text_only_raises_delta_errors(text: str) -> None:
    _assert_delta_error(text)


def _corpus() -> list[str]:
    texts = [p.read_text(encoding="utf-8") for p in sorted((HERE / "golden").glob("*.dl"))]
    texts += [p.read_text(encoding="utf-8") for p in sorted((HERE / "errors").glob("*.dl"))]
    return texts


def _mutate(text: str, rnd: random.Random) -> str:
    for _ in range(rnd.randint(1, 3)):
        i = rnd.randrange(len(text) + 1)
        j = min(len(text), i + rnd.randint(0, 12))
        op = rnd.random()
        if op < 0.35:
            text = text[:i] + text[j:]  # delete a span
        elif op < 0.7:
            text = text[:i] + rnd.choice(_PIECES) + text[i:]  # insert a token
        else:
            k = rnd.randrange(len(text) + 1)
            text = text[:k] + text[i:j] + text[k:]  # copy a span elsewhere
    return text


def test_mutated_programs_only_raise_delta_errors(tiny_spec: Callable[[str], Any]) -> None:
    spec = tiny_spec("qwen3_5")
    rnd = random.Random(1234)
    corpus = _corpus()
    for _ in range(max(600, _N)):
        _assert_delta_error(_mutate(rnd.choice(corpus), rnd), spec)


@pytest.mark.parametrize("cut", range(0, 400, 7))
def test_every_prefix_of_the_tour(cut: int, tiny_spec: Callable[[str], Any]) -> None:
    text = (HERE / "golden" / "tour.dl").read_text(encoding="utf-8")
    _assert_delta_error(text[:cut], tiny_spec("qwen3_5"))


# ---- random WELL-FORMED programs, run on the bundled model: no internal error ---------------------

from deltalang.models import values as _values  # noqa: E402
from deltalang.models.bundled import PATH as _BUNDLED  # noqa: E402

_PROMPTS = ('prompt clean = "The Eiffel Tower is in the city of"\nprompt other = "My favourite food is pizza"\n'
            'prompts many = ["The Tower is in the city of", "My favourite food is pizza with"]\n')
_BLOCKS = ("L0", "L4", "L6", "L[linear]")
_POSITIONS = ("0", "2", "-1", "-2", '"Tower"')
_REDUCTIONS = ("", "", ".norm()", ".mean(positions)", ".head(1)", ".head(0).mean(positions).norm()")


@st.composite
def _site(draw: Any, writable: bool, blocks: tuple[str, ...] = _BLOCKS) -> str:
    names = [v.name for v in _values.CATALOGUE.values() if _values.DELTANET in v.kinds and (v.writable or not writable)]
    value = _values.CATALOGUE[draw(st.sampled_from(sorted(names)))]
    pos = f"({draw(st.sampled_from(_POSITIONS))})" if value.positional else ""
    return f"{draw(st.sampled_from(blocks))}.{value.name}{pos}"


@st.composite
def _statement(draw: Any, kind: str, blocks: tuple[str, ...] = _BLOCKS) -> str:
    what = draw(st.sampled_from(("read", "read", "write", "scale", "measure", "measure")))
    if what == "read":
        return f"read {draw(_site(False, blocks))}{draw(st.sampled_from(_REDUCTIONS))}" + draw(
            st.sampled_from(("", "", " as kept")))
    if what in ("write", "scale"):
        site = draw(_site(True, blocks)) + draw(st.sampled_from(("", "", ".head(0)")))
        if what == "scale":
            by = draw(st.sampled_from(("0.5", "0", "2")))
            return f"write {site} {draw(st.sampled_from(('*=', '+=')))} {by}"
        source = draw(st.sampled_from(("= zeros", "from other", "from other at 2", 'from other at "is"', "= mean(many)",
                                       "= kept", "from other.state_output", "from base")))
        return f"write {site} {source}"
    at = draw(st.sampled_from(("", "", " at -2", ' at "city"')))
    return "measure " + draw(st.sampled_from((
        'prob(" Paris")', 'rank(" Paris")', 'logit_diff(" Paris", " Rome")', "top(3)", "kl(base)",
        'prob(" Paris France")', f"norm({draw(_site(False, blocks))})"))) + at


@st.composite
def _well_formed(draw: Any, blocks: tuple[str, ...] = _BLOCKS) -> str:
    body = draw(st.lists(_statement("trace", blocks), min_size=1, max_size=4))
    kind = draw(st.sampled_from(("trace", "trace", "generate", "sweep")))
    n = draw(st.integers(1, 3))
    sample = draw(st.sampled_from(("", "", " temperature 1.5 top_p 0.9 seed 3")))
    head = {"trace": "trace x on clean", "generate": f"generate x on clean max_new_tokens {n}{sample}",
            "sweep": "sweep x on clean over L in L[linear], t in -3..-1"}[kind]
    if kind == "generate" and draw(st.booleans()):
        body = [f"step {draw(st.integers(0, 3))}: {body[0]}", *body[1:]]
    if kind == "sweep":
        body = [draw(st.sampled_from(("write L.state_after(t) = zeros", "write L.state_after(t) from other",
                                      "write L.conv_window_after(t) *= 0.5"))), *[b for b in body if "kept" not in b]]
    if draw(st.booleans()):
        body = ["route torch", *body]
    return _PROMPTS + 'trace base on clean {\n    measure prob(" Paris")\n}\n' + head + " {\n" + \
        "".join(f"    {s}\n" for s in body) + "}\n"


@pytest.fixture(scope="module")
def bundled_model() -> Any:
    if not (_BUNDLED / "config.json").exists():
        pytest.skip("the bundled model is not built")
    import deltalang

    return deltalang.load_model()


@pytest.mark.parametrize("family", ["bundled", "kimi_linear", "qwen3_next"])
def test_well_formed_programs_run_without_an_internal_error(family: str, bundled_model: Any) -> None:
    """Any program built from the catalogue's values and the statement kinds runs, or is one DeltaError;
    anything else is what `deltalang` prints as an internal error. On the bundled model and tiny checkpoints
    (their first and last DeltaNet blocks, and the last block)."""
    import deltalang
    from deltalang.models.testing import tiny_checkpoint

    model = bundled_model if family == "bundled" else deltalang.load_model(tiny_checkpoint(family))
    lin = model.linear_layers()
    blocks = _BLOCKS if family == "bundled" else (f"L{lin[0]}", f"L{lin[-1]}", "L[linear]",
                                                  f"L{model.spec.num_layers - 1}")

    @settings(max_examples=_N or 25, deadline=None, derandomize=not _N,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(_well_formed(blocks))
    def one(text: str) -> None:
        try:
            deltalang.run(text, model=model)
        except DeltaError:
            pass
        except Exception as e:  # noqa: BLE001 - an internal error: the program that gave it
            raise AssertionError(f"internal error {type(e).__name__}: {e}\n{text}") from e

    one()


# ---- what the well-formed fuzz found, each against transformers -----------------------------------------

_HEAD_WRITES = {  # arithmetic written to one head: its value from the head's own slice (x) and the donor's (d)
    "+= 2": lambda x, d: x + 2.0,
    "= zeros + 1": lambda x, d: torch.ones_like(x),
    "+= other.state_after(-1)": lambda x, d: x + d,
    "= 2 * other.state_after(-1) - zeros": lambda x, d: 2.0 * d,
}


@pytest.mark.parametrize("source", sorted(_HEAD_WRITES))
def test_arithmetic_written_to_one_head_is_that_heads_value(source: str, bundled_model: Any) -> None:
    """`write L4.state_after(-1).head(1) += ...` ended in an internal AssertionError (emit had no arithmetic for one
    head): now the head's slice is the arithmetic over the head's slices, the other heads untouched."""
    from reference import Reference, Write
    from transformers import AutoModelForCausalLM

    import deltalang

    clean, other = "The Eiffel Tower is in the city of", "My favourite food is pizza"
    text = (f'prompt clean = "{clean}"\nprompt other = "{other}"\ntrace t on clean {{\n'
            f"    write L4.state_after(-1).head(1) {source}\n    read logits\n}}\n")
    got = deltalang.run(text, model=bundled_model)["t.logits"]
    ref = Reference(AutoModelForCausalLM.from_pretrained(_BUNDLED, dtype=torch.float32).eval())
    ids = lambda s: bundled_model.tokenizer(s, return_tensors="pt").input_ids  # noqa: E731
    donor = ref.run(ids(other)).value(4, "state_after", ids(other).shape[1] - 1)
    fn = _HEAD_WRITES[source]

    def write(x: torch.Tensor, i: int) -> torch.Tensor:
        out = x.clone()
        out[:, 1] = fn(x[:, 1], donor[:, 1])
        return out

    n = ids(clean).shape[1]
    want = ref.run(ids(clean), [Write(4, "state_after", write, position=n - 1)]).value(None, "logits")
    plain = ref.run(ids(clean)).value(None, "logits")
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), float((got - want).abs().max())
    assert not torch.allclose(got, plain, rtol=1e-4, atol=1e-5)
