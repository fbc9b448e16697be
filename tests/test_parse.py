"""The front end: grammar, AST, printer, syntax errors, `check`/`fmt`, golden files, error files."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

import attrs
import pytest

from deltalang.compiler.explain import format_resolved
from deltalang.ground.errors import DeltaError, DeltaErrors, DeltaSyntaxError, Span
from deltalang.language import ast
from deltalang.language.check import check
from deltalang.language.ir import Resolved
from deltalang.language.parse import parse

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
ERRORS = HERE / "errors"
UPDATE = os.environ.get("UPDATE_GOLDEN", "") not in ("", "0")

# DESIGN.md section 2, copied verbatim: every example must keep parsing and checking.
DESIGN_TOUR = '''\
# a tour of the language — every statement ends at a newline or ';'
model "Qwen/Qwen3.5-0.8B"          # optional: default is the bundled tiny model; --model overrides
prompt clean = "The Eiffel Tower is in the city of"
prompt other = "My favourite food is pizza with"

trace base on clean {              # one forward pass
    read L0.state_input, L0.state_output
    read next_token_probs as clean_probs
}

trace patched on clean {
    write L[linear].state_after("Tower") from other  # the same site, read from a clean run on `other`
    read L0.state_after(2) as before             # order in the text does not matter:
    read L0.state_after(-1) as after             # the compiler puts every op in forward order
    read next_token_probs
}

generate cont on clean max_new_tokens 4 {      # step 0 is the prompt, step k the k-th new token
    step 1: write L[linear].state_input from other.state_output
    read tokens
}

sweep ablate on clean over L in L[linear], t in 0..9 {
    write L.state_after(t) = zeros
    measure prob(" Paris")
}
'''
DESIGN_ONELINER = ('prompt donor = "My favourite food is pizza with"; read L0.states; '
                   'write L*.state_after(3) from donor')
DESIGN_ONELINER_PROMPT = "The Eiffel Tower is in the city of"

# the other forms section 2 names in prose, each inside a small program
DESIGN_FORMS = '''\
prompt clean = "The Eiffel Tower is in the city of"
prompt other = "My favourite food is pizza with"
prompts foods = ["I like pizza with cheese", "She eats pasta with sauce"]
trace donor on other {
    read L2.state_output as kept
}
trace forms on clean {
    read L3.output
    read L*.states
    read L[linear].state_output
    read L[attention].output
    read L[0:3].betas
    read L[0,2].decays
    write L0.state_after(3) from other
    write L1.state_after("Tower") from other.state_after("pizza")
    write L2.state_output from donor.state_output
    write L0.state_output = zeros
    write L2.state_input = kept
    write L1.state_output *= 0.5
    write L1.state_input = mean(foods)
    measure prob("P"), logit_diff("P", "R"), kl(donor), norm(L0.state_output), rank("P")
}
'''


def _tour_for_bytes(text: str) -> str:
    """The tour on a byte-level tokenizer: ' Paris' is six tokens there, 'P' is one."""
    return text.replace('prob(" Paris")', 'prob("P")')


# ---- DESIGN section 2 -----------------------------------------------------------


def test_design_tour_parses() -> None:
    prog = parse(DESIGN_TOUR)
    kinds = [type(i).__name__ for i in prog.items]
    assert kinds == ["ModelDecl", "PromptDecl", "PromptDecl", "Trace", "Trace", "Generate", "Sweep"]
    gen = prog.items[5]
    assert isinstance(gen, ast.Generate) and gen.max_new_tokens == 4
    step = gen.body[0]
    assert isinstance(step, ast.Step) and step.index == 1
    assert step.body == ast.Write(
        ast.Site(ast.BlockList((ast.SelKind("linear"),)), "state_input"),
        ast.FromSource("other", ast.Site(None, "state_output")))
    sweep = prog.items[6]
    assert isinstance(sweep, ast.Sweep)
    assert sweep.axes == (ast.Axis("L", ast.BlockList((ast.SelKind("linear"),))), ast.Axis("t", ast.Range(0, 9)))
    assert sweep.body[0] == ast.Write(ast.Site(ast.BlockVar("L"), "state_after", ast.VarPos("t")), ast.ZerosSource())


def test_design_named_donor_site() -> None:
    w = parse('write L0.state_after(3) from other.state_after("pizza")').items[0]
    assert w == ast.Write(ast.Site(ast.Block(0), "state_after", ast.IntPos(3)),
                          ast.FromSource("other", ast.Site(None, "state_after", ast.PiecePos("pizza"))))


def test_design_tour_checks_on_tiny(tiny_spec: Callable[[str], Any]) -> None:
    r = check(_tour_for_bytes(DESIGN_TOUR), tiny_spec("qwen3_5"))
    assert [run.name for run in r.runs] == ["other", "base", "patched", "cont", "ablate"]
    assert r.model == "Qwen/Qwen3.5-0.8B"
    patched = r.run("patched")
    writes = [op for op in patched.ops if op.kind == "write"]
    assert [(op.layer, op.position) for op in writes] == [(0, 15), (1, 15), (2, 15)]  # 'r' of "Tower"


def test_design_tour_unchanged_names_the_multi_token_measure(tiny_spec: Callable[[str], Any]) -> None:
    """On a byte-level tokenizer the only error of the verbatim tour is ' Paris' being six tokens."""
    with pytest.raises(DeltaError) as info:
        check(DESIGN_TOUR, tiny_spec("qwen3_5"))
    e = info.value
    assert not isinstance(e, DeltaErrors)
    assert e.span is not None and e.span.line == 25
    assert "6 tokens" in e.message


def test_design_oneliner(tiny_spec: Callable[[str], Any]) -> None:
    r = check(DESIGN_ONELINER, tiny_spec("qwen3_5"), prompt=DESIGN_ONELINER_PROMPT)
    main = r.run("main")
    assert main.implicit and main.prompt_text == DESIGN_ONELINER_PROMPT
    assert [(op.kind, op.layer, op.value, op.position) for op in main.ops] == [
        ("read", 0, "states", None),
        ("write", 0, "state_after", 3), ("write", 1, "state_after", 3), ("write", 2, "state_after", 3)]
    assert r.run("donor").implicit


def test_design_forms(tiny_spec: Callable[[str], Any]) -> None:
    r = check(DESIGN_FORMS, tiny_spec("qwen3_5"))
    forms = r.run("forms")
    assert len(forms.measures) == 5


BUNDLED = Path(__file__).resolve().parents[1] / "deltalang" / "models" / "bundled" / "model" / "config.json"


# The tour sweeps `t in 0..9` over "The Eiffel Tower is in the city of", which the bundled
# word-level tokenizer makes 8 tokens: position 8 is past the prompt, an error by DESIGN's own
# rules. Until DESIGN says `0..8` (proposed), that one error is accepted and the corrected tour
# must check cleanly.
_SWEEP_PAST_END = "t in 0..9 reaches 8: position 8 is past the end of prompt 'clean'"


def _check_tour(spec: Any) -> Resolved:
    try:
        return check(DESIGN_TOUR, spec)
    except DeltaError as e:
        if _SWEEP_PAST_END not in e.message:
            raise
        return check(DESIGN_TOUR.replace("t in 0..9", "t in 0..8"), spec)


@pytest.mark.skipif(not BUNDLED.exists(), reason="the bundled model is not built yet (deltalang/models/bundled/model)")
def test_design_examples_check_on_bundled_model() -> None:
    from deltalang.models.spec import load_spec

    spec = load_spec(None)
    tour = _check_tour(spec)
    assert tour.run("patched").ops[0].position == spec.tokens(tour.prompts["clean"]).index(" Tower")
    check(DESIGN_ONELINER, spec, prompt=DESIGN_ONELINER_PROMPT)


def test_design_tour_on_the_bundled_word_level_tokenizer(tiny_spec: Callable[[str], Any]) -> None:
    """The bundled model's tokenizer (built in-process) on a tiny config: 'Tower' is one token."""
    world = pytest.importorskip("deltalang.models.bundled.world")
    if not hasattr(world, "build_tokenizer"):
        pytest.skip("deltalang.models.bundled.world has no build_tokenizer()")
    spec = attrs.evolve(tiny_spec("qwen3_5"), tokenizer=world.build_tokenizer())
    tour = _check_tour(spec)
    patched = tour.run("patched")
    assert [spec.tokens(tour.prompts["clean"])[op.position] for op in patched.ops[:3]] == [" Tower"] * 3
    assert tour.run("ablate").measures[0].token_ids == tuple(spec.token_ids(" Paris"))


# ---- grammar details ------------------------------------------------------------


def test_separators_and_layout() -> None:
    a = parse('prompt p = "x"; trace t on p { read L0.states; read L1.states }')
    b = parse('prompt p = "x"\n\n# c\ntrace t on p\n{\n    read L0.states\n\n    read L1.states\n}\n')
    assert a == b


def test_lists_span_lines() -> None:
    prog = parse('prompts many = [\n  "one",  # first\n  "two",\n]\n')
    assert prog.items[0] == ast.PromptListDecl("many", ("one", "two"))


def test_string_escapes_round_trip() -> None:
    prog = parse(r'prompt p = "a \"q\" \\ \n \t é"')
    assert prog.items[0].text == 'a "q" \\ \n \t é'
    assert parse(ast.format_program(prog)) == prog


def test_selectors() -> None:
    def sel(text: str) -> Any:
        return parse(f"read {text}.output").items[0].sites[0].block

    assert sel("L3") == ast.Block(3)
    assert sel("L*") == ast.AllBlocks()
    assert sel("L[linear]") == ast.BlockList((ast.SelKind("linear"),))
    assert sel("L[attention]") == ast.BlockList((ast.SelKind("attention"),))
    assert sel("L[0:6]") == ast.BlockList((ast.SelSlice(0, 6),))
    assert sel("L[:2, 3:]") == ast.BlockList((ast.SelSlice(None, 2), ast.SelSlice(3, None)))
    assert sel("L[0,2,4]") == ast.BlockList((ast.SelIndex(0), ast.SelIndex(2), ast.SelIndex(4)))
    assert sel("L[-1]") == ast.BlockList((ast.SelIndex(-1),))


def test_model_level_values_and_positions() -> None:
    read = parse('read logits, next_token_probs, L0.state_after(-2), L1.state_after("a b")').items[0]
    assert read.sites == (ast.Site(None, "logits"), ast.Site(None, "next_token_probs"),
                          ast.Site(ast.Block(0), "state_after", ast.IntPos(-2)),
                          ast.Site(ast.Block(1), "state_after", ast.PiecePos("a b")))


def test_write_sources() -> None:
    def src(text: str) -> Any:
        return parse(f"write L0.state_output {text}").items[0].source

    assert src("from other") == ast.FromSource("other")
    assert src("from other.L2.state_output") == ast.FromSource("other", ast.Site(ast.Block(2), "state_output"))
    assert src("= zeros") == ast.ZerosSource()
    assert src("= kept") == ast.NamedSource("kept")
    assert src("*= 0.5") == ast.ScaleSource(0.5)
    assert src("*= -2") == ast.ScaleSource(-2.0)
    assert src("*= 1e-3") == ast.ScaleSource(0.001)
    assert src("= mean(a, b)") == ast.MeanSource(("a", "b"))


def test_measures() -> None:
    m = parse('measure prob(" a"), rank(" a"), logit_diff(" a", " b"), kl(base), norm(L0.states)').items[0]
    assert m.calls == (ast.Prob(" a"), ast.Rank(" a"), ast.LogitDiff(" a", " b"), ast.KL("base"),
                       ast.Norm(ast.Site(ast.Block(0), "states")))
    assert parse('measure prob("x") as p').items[0].alias == "p"


def test_route_and_keywords_as_values() -> None:
    prog = parse("route torch\ntrace t on p { route default }")
    assert prog.items[0] == ast.Route("torch")
    assert prog.items[1].body == (ast.Route("default"),)


def test_spans() -> None:
    prog = parse('prompt p = "x"\ntrace t on p {\n    read L0.state_after(-1) as last\n}\n')
    trace = prog.items[1]
    read = trace.body[0]
    assert trace.span == Span(2, 1, 4, 2)
    assert read.span == Span(3, 5, 3, 36)
    site = read.sites[0]
    assert site.span == Span(3, 10, 3, 28)
    assert site.block.span == Span(3, 10, 3, 12)
    assert site.position.span == Span(3, 25, 3, 27)


def test_every_node_has_a_span_outside_equality() -> None:
    prog = parse(_tour_for_bytes(DESIGN_TOUR))
    for node in ast.walk(prog):
        if attrs.has(type(node)):
            assert "span" in attrs.fields_dict(type(node))
            field = attrs.fields_dict(type(node))["span"]
            assert field.eq is False
            if not isinstance(node, ast.ZerosSource):
                assert node.span.line >= 1, node
    moved = parse("\n\n" + _tour_for_bytes(DESIGN_TOUR))
    assert moved == prog and hash(moved) == hash(prog)


# ---- printer ----------------------------------------------------------------------


@pytest.mark.parametrize("text", [DESIGN_TOUR, DESIGN_ONELINER, DESIGN_FORMS])
def test_format_round_trips(text: str) -> None:
    prog = parse(text)
    out = ast.format_program(prog)
    assert parse(out) == prog
    assert ast.format_program(parse(out)) == out


def test_fmt_keeps_comments_and_is_idempotent() -> None:
    src = (GOLDEN / "comments.dl").read_text()
    out = ast.format_program(parse(src), src)
    for line in src.splitlines():
        if "#" in line:
            comment = line[line.index("#"):].rstrip() if '"' not in line else re.sub(r'^.*?(#[^"]*)$', r"\1", line)
            assert comment in out, comment
    assert ast.format_program(parse(out), out) == out
    assert parse(out) == parse(src)


# ---- syntax errors ------------------------------------------------------------------

SYNTAX_CASES = [
    ("trace t on p {\n    read L0.states\n", 1, "missing '}'"),
    ('prompt p = "abc\n', 1, "unterminated string"),
    ("raed L0.states\n", 1, "did you mean 'read'"),
    ("read L0.states read L1.states\n", 1, "put a newline or ';'"),
    ("step 1: read L0.states\n", 1, "only works inside a generate block"),
    ('trace t on p { prompt q = "x" }\n', 1, "at the top level"),
    ("trace a on p { trace b on p { read L0.states } }\n", 1, "runs do not nest"),
    ("read L0.states }\n", 1, "unmatched '}'"),
    ("write L0.state_output = 0\n", 1, "to scale write '*= 0'"),
    ("route fast\n", 1, "did you mean 'default'"),
    ("measure probability(\"a\")\n", 1, "did you mean 'prob'"),
    ("read L[lin].states\n", 1, "did you mean L[linear]"),
    ("read L0.state_after('x')\n", 1, "double quotes"),
    ('prompt read = "x"\n', 1, "keyword"),
    ("read L0\n", 1, "names blocks but no value"),
    ("read L0.a.b\n", 1, "too many parts"),
    ("read L0.states as a, L1.states\n", 1, "found ','"),
    ("read L0.states, L1.states as s\n", 1, "'as' names one site"),
    ('read L0.state_after("x\\q")\n', 1, "unknown escape"),
    ("trace t on p\n", 1, "needs a body"),
    ("read L-1.states\n", 1, "L[-1] is the last block"),
    ("read X[0].states\n", 1, "a block selector is L[...]"),
    ("write L0.x = foo(a)\n", 1, "unknown function"),
    ("measure next_token_probs\n", 1, "use 'read'"),
    ("sweep s on p over t in L0.states { }\n", 1, "a sweep axis is"),
    ("read L0.state_after(1, 2)\n", 1, "takes one position"),
    ("generate g on p max_new_tokens 2 { step 1: route torch }\n", 1, "outside 'step'"),
    ('prompts a = []\n', 1, "is empty"),
    ("read L0.states @\n", 1, "unexpected character '@'"),
]


@pytest.mark.parametrize("text,line,message", SYNTAX_CASES)
def test_syntax_errors(text: str, line: int, message: str) -> None:
    with pytest.raises(DeltaError) as info:
        parse(text, "x.dl")
    e = info.value
    errs = e.errors if isinstance(e, DeltaErrors) else [e]
    assert any(message in x.message for x in errs), [x.message for x in errs]
    for x in errs:
        assert isinstance(x, DeltaSyntaxError) and x.span is not None and x.span.line == line
        rendered = x.render()
        assert rendered.startswith(f"x.dl:{x.span.line}:{x.span.column}: error: ")
        assert "^" in rendered


def test_missing_brace_points_at_the_open_brace() -> None:
    with pytest.raises(DeltaSyntaxError) as info:
        parse('prompt p = "x"\ntrace t on p {\n    read L0.states\n\n')
    assert info.value.span == Span(2, 14, 2, 15)


def test_builder_collects_several_errors() -> None:
    with pytest.raises(DeltaErrors) as info:
        parse('trace t on p {\n  prompt q = "x"\n  step 1: read L0.states\n}\nroute nope\n')
    assert [e.span.line for e in info.value.errors] == [2, 3, 5]


# ---- golden files -----------------------------------------------------------------------


def _golden_prompt(text: str) -> str | None:
    m = re.search(r"^# --prompt (.*)$", text, re.M)
    return m.group(1) if m else None


def _compare(path: Path, actual: str) -> None:
    if UPDATE or not path.exists():
        path.write_text(actual, encoding="utf-8")
        if not UPDATE:
            pytest.fail(f"{path.name} did not exist; wrote it (check it in)")
        return
    assert actual == path.read_text(encoding="utf-8"), f"{path.name} differs; rerun with UPDATE_GOLDEN=1 to accept"


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.dl")), ids=lambda p: p.stem)
def test_golden(path: Path, tiny_spec: Callable[[str], Any]) -> None:
    text = path.read_text(encoding="utf-8")
    prog = parse(text, path.name)
    formatted = ast.format_program(prog, text)
    assert parse(formatted) == prog
    _compare(path.with_suffix(".formatted.txt"), formatted)
    spec = attrs.evolve(tiny_spec("qwen3_5"), model_id="tiny/qwen3_5")
    resolved = check(text, spec, filename=path.name, prompt=_golden_prompt(text))
    _compare(path.with_suffix(".resolved.txt"), format_resolved(resolved))


# ---- error files: `# E: message` on the line the error points at --------------------------

_EXPECT = re.compile(r"#\s*E:\s*(.+?)\s*$")


def _expected_errors(text: str) -> list[tuple[int, str]]:
    return [(n, m.group(1)) for n, line in enumerate(text.splitlines(), start=1) if (m := _EXPECT.search(line))]


@pytest.mark.parametrize("path", sorted(ERRORS.glob("*.dl")), ids=lambda p: p.stem)
def test_error_file(path: Path, tiny_spec: Callable[[str], Any]) -> None:
    text = path.read_text(encoding="utf-8")
    expected = _expected_errors(text)
    assert expected, f"{path.name} has no '# E:' line"
    with pytest.raises(DeltaError) as info:
        check(text, tiny_spec("qwen3_5"), filename=path.name, prompt=_golden_prompt(text))
    e = info.value
    errs = e.errors if isinstance(e, DeltaErrors) else [e]
    got = [(x.span.line if x.span else 0, x.message) for x in errs]
    assert len(got) == len(expected), f"expected {expected}, got {got}"
    for (line, want), (gline, gmsg) in zip(expected, got, strict=True):
        assert gline == line and want in gmsg, f"line {line}: expected {want!r}; got line {gline}: {gmsg!r}"
    for x in errs:
        assert x.render().startswith(f"{path.name}:")


# ---- the CLI handlers ------------------------------------------------------------------------


def test_cli_check_prints_positions(tiny_path: Callable[[str], Path], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from deltalang.cli import main

    prog = tmp_path / "p.dl"
    prog.write_text('prompt clean = "The Eiffel Tower"\nread L0.state_after("Tower")\n')
    assert main(["check", str(prog), "--model", str(tiny_path("qwen3_5"))]) == 0
    out = capsys.readouterr().out
    assert "read L0.state_after(\"Tower\") -> position 15 (r) as main.L0.state_after(15)" in out


def test_cli_check_errors_exit_1(tiny_path: Callable[[str], Path], capsys: pytest.CaptureFixture[str]) -> None:
    from deltalang.cli import main

    rc = main(["check", "-e", "read L3.states; read L0.state_after(99)", "--prompt", "abc",
               "--model", str(tiny_path("qwen3_5"))])
    assert rc == 1
    err = capsys.readouterr().err
    assert "<-e>:1:6: error: L3 has no value 'states': no DeltaNet mixer on this block (full_attention)" in err
    assert "<-e>:1:37: error: position 99 is past the end of prompt 'main'" in err
    assert "Traceback" not in err


def test_cli_check_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    from deltalang.cli import main

    assert main(["check", "/nonexistent/x.dl"]) == 1
    assert "no such file" in capsys.readouterr().err


def test_cli_fmt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from deltalang.cli import main

    prog = tmp_path / "p.dl"
    prog.write_text('prompt p = "x";read   L0.states   # keep me\n')
    assert main(["fmt", str(prog)]) == 0
    assert capsys.readouterr().out == 'prompt p = "x"\nread L0.states  # keep me\n'
    assert main(["fmt", "-w", str(prog)]) == 0
    assert prog.read_text() == 'prompt p = "x"\nread L0.states  # keep me\n'
    prog.write_text("read L0.states }\n")
    assert main(["fmt", str(prog)]) == 1
    assert "unmatched '}'" in capsys.readouterr().err


def test_check_accepts_spec_path_and_loaded_model(tiny_spec: Callable[[str], Any],
                                                  tiny_path: Callable[[str], Path]) -> None:
    text = 'prompt p = "abc"\nread L0.state_output'
    spec = tiny_spec("qwen3_5")

    class Loaded:
        def __init__(self, spec: Any) -> None:
            self.spec = spec

    a = check(text, spec)
    b = check(text, str(tiny_path("qwen3_5")))
    c = check(text, Loaded(spec))
    assert a.runs == b.runs == c.runs
