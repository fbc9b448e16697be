"""The resolver: selectors, values, positions, donors, names, steps, sweeps, measures, against tiny models.

The tiny checkpoints have four blocks (DeltaNet L0 L1 L2, attention L3) and a
byte-level tokenizer: one token per byte, so "Tower" in "The Eiffel Tower ..."
ends at position 15 (r).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from deltalang.ground.errors import DeltaError, DeltaErrors, DeltaResolveError
from deltalang.language.check import check
from deltalang.language.ir import FromRun, Mean, Named, Resolved, Scale, Zeros
from deltalang.language.parse import parse
from deltalang.language.resolve import resolve
from deltalang.language.tokens import tokenize
from deltalang.models import values
from deltalang.models.testing import FAMILY_NAMES

CLEAN = "The Eiffel Tower is in the city of"  # 34 tokens
OTHER = "My favourite food is pizza with"  # 31 tokens
HEADER = f'prompt clean = "{CLEAN}"\nprompt other = "{OTHER}"\n'


@pytest.fixture()
def spec(tiny_spec: Callable[[str], Any]) -> Any:
    return tiny_spec("qwen3_5")


def run_ok(spec: Any, body: str, **kw: Any) -> Resolved:
    return check(HEADER + body, spec, **kw)


def errors_of(spec: Any, body: str, **kw: Any) -> list[DeltaError]:
    with pytest.raises(DeltaError) as info:
        check(HEADER + body, spec, **kw)
    e = info.value
    return list(e.errors) if isinstance(e, DeltaErrors) else [e]


def ops(r: Resolved, run: str) -> list[tuple[Any, ...]]:
    return [(op.kind, op.layer, op.value, op.position, op.step) for op in r.run(run).ops]


# ---- selectors and values --------------------------------------------------------------


def test_selector_expansion(spec: Any) -> None:
    r = run_ok(spec, "trace t on clean {\n read L*.states\n read L*.output as o\n read L[attention].output as a\n"
                     " read L[-1].output as last\n read L[1:3].betas\n read L[0,2].state_output\n}")
    layers = [(op.layer, op.value) for op in r.run("t").ops]
    assert layers == [(0, "states"), (1, "states"), (2, "states"),
                      (0, "output"), (1, "output"), (2, "output"), (3, "output"),
                      (3, "output"), (3, "output"), (1, "betas"), (2, "betas"),
                      (0, "state_output"), (2, "state_output")]


def test_linear_and_attention_layers_come_from_the_spec(spec: Any) -> None:
    assert spec.linear_layers() == [0, 1, 2] and spec.attention_layers() == [3]
    r = run_ok(spec, "read L[linear].attention_keys", prompt=CLEAN)
    assert [op.layer for op in r.run("main").ops] == spec.linear_layers()


def test_every_catalogue_value_resolves_where_it_exists(spec: Any) -> None:
    lines = []
    for name, v in values.CATALOGUE.items():
        if all(spec.unavailable(i, name) is not None for i in range(spec.num_layers)):
            continue  # a Mamba-2 value on this DeltaNet model: `L*` of it is an error
        lines.append(f"read L*.{name}" + ("(3)" if v.positional else ""))
    r = run_ok(spec, "\n".join(lines), prompt=CLEAN)
    got = {(op.layer, op.value) for op in r.run("main").ops}
    want = {(i, n) for n in values.CATALOGUE for i in range(spec.num_layers) if spec.unavailable(i, n) is None}
    assert got == want


def test_value_on_attention_block_names_its_kind(spec: Any) -> None:
    (e,) = errors_of(spec, "read L3.states", prompt=CLEAN)
    assert isinstance(e, DeltaResolveError)
    assert e.message == "L3 has no value 'states': no DeltaNet mixer on this block (full_attention)"
    assert (e.span.line, e.span.column) == (3, 6)


def test_all_errors_of_a_file_are_reported(spec: Any) -> None:
    errs = errors_of(spec, "read L3.states\nread L0.nope\nread L0.state_after(99)\nwrite L0.states = zeros",
                     prompt=CLEAN)
    assert [e.span.line for e in errs] == [3, 4, 5, 6]
    assert all(isinstance(e, DeltaResolveError) for e in errs)


# ---- positions -------------------------------------------------------------------------


def test_positions_negative_and_quoted(spec: Any) -> None:
    r = run_ok(spec, 'read L0.state_after(0), L0.state_after(-1), L0.state_after("Tower"), L0.state_after("e")',
               prompt=CLEAN)
    assert [op.position for op in r.run("main").ops] == [0, 33, 15, 2]  # "e": first occurrence, in "The"


def test_quoted_piece_uses_token_offsets(spec: Any) -> None:
    toks = tokenize(spec, "héllo wörld")
    # é is two byte tokens sharing one character: the piece ends at the second
    assert toks.find("hé") == 2
    assert toks.find("wörld") == len(toks) - 1
    assert toks.find("xyz") is None and toks.find("") is None


def test_position_names_follow_resolution(spec: Any) -> None:
    r = run_ok(spec, "trace patched on clean { read L0.state_after(-1) }")
    assert r.run("patched").ops[0].result_name == "patched.L0.state_after(33)"


# ---- donors ----------------------------------------------------------------------------


def test_from_prompt_makes_an_implicit_clean_run(spec: Any) -> None:
    r = run_ok(spec, 'trace p on clean { write L[linear].state_after("Tower") from other }')
    assert [(x.name, x.implicit, x.prompt) for x in r.runs] == [("other", True, "other"), ("p", False, "clean")]
    srcs = [op.source for op in r.run("p").ops]
    assert srcs == [FromRun("other", i, "state_after", 15, None) for i in (0, 1, 2)]


def test_from_named_donor_site(spec: Any) -> None:
    r = run_ok(spec, 'trace d on other { read L0.states }\n'
                     'trace p on clean {\n write L1.state_after("Tower") from other.state_after("pizza")\n'
                     ' write L2.state_input from d.L0.state_output\n'
                     ' write L[0,1].state_output from d.L[1,2].state_output\n}')
    srcs = [op.source for op in r.run("p").ops]
    assert srcs == [FromRun("other", 1, "state_after", 25, None), FromRun("d", 0, "state_output", None, None),
                    FromRun("d", 1, "state_output", None, None), FromRun("d", 2, "state_output", None, None)]


def test_from_counts_negative_positions_from_the_donors_end(spec: Any) -> None:
    r = run_ok(spec, "trace p on clean { write L0.state_after(-1) from other; write L0.state_after(4) from other }")
    srcs = [op.source for op in r.run("p").ops]
    assert [s.position for s in srcs] == [30, 4]
    assert [op.position for op in r.run("p").ops] == [33, 4]


def test_from_same_number_past_the_donor(spec: Any) -> None:
    (e,) = errors_of(spec, "trace p on clean { write L0.state_after(32) from other }")
    assert "position 32 is past the end of 'other'" in e.message


def test_named_sources_map_block_by_block(spec: Any) -> None:
    r = run_ok(spec, "trace d on other { read L[linear].state_output as s; read L1.state_output as one }\n"
                     "trace p on clean { write L[linear].state_input = s; write L[0,2].state_input = one }")
    srcs = [op.source for op in r.run("p").ops]
    assert srcs == [Named("s.L0", "d"), Named("s.L1", "d"), Named("s.L2", "d"), Named("one", "d"), Named("one", "d")]


def test_forward_references_are_allowed(spec: Any) -> None:
    r = run_ok(spec, "trace p on clean { write L0.state_input = later; measure kl(d) }\n"
                     "trace d on other { read L0.state_output as later }")
    assert r.run("p").ops[0].source == Named("later", "d")


def test_other_sources(spec: Any) -> None:
    r = run_ok(spec, 'prompts foods = ["ab", "abc"]\n'
                     "trace p on clean {\n write L0.state_output = zeros\n write L1.state_output *= 0.5\n"
                     " write L2.state_after(-1) = mean(foods, other)\n}")
    srcs = [op.source for op in r.run("p").ops]
    assert srcs == [Zeros(), Scale(0.5), Mean(("foods", "other"), ("ab", "abc", OTHER), (1, 2, 30))]


# ---- the implicit run `main` ------------------------------------------------------------


def test_main_prompt_choice(spec: Any) -> None:
    """`main` runs on --prompt, else on the prompt named `main`, else on the only prompt; never a guess."""
    assert check(f'prompt clean = "{CLEAN}"\nread L0.states', spec).run("main").prompt == "clean"
    (e,) = errors_of(spec, "read L0.states")  # two prompts, neither named main: no guess
    assert "declares 2: clean, other" in e.message and (e.span.line, e.span.column) == (3, 1)
    r = check(HEADER + 'prompt main = "xyz"\nread L0.states', spec)
    assert r.run("main").prompt_text == "xyz"
    r = check(HEADER + "read L0.states", spec, prompt="override")
    assert r.run("main").prompt_text == "override" and r.prompts["main"] == "override"


def test_top_level_route_is_the_default_of_every_run(spec: Any) -> None:
    r = run_ok(spec, "route torch\ntrace a on clean { read L0.states }\ntrace b on clean { route default\n"
                     "read L0.states }")
    assert [x.route for x in r.runs] == ["torch", "default"]


# ---- generate ---------------------------------------------------------------------------


def test_generate_steps_and_names(spec: Any) -> None:
    r = run_ok(spec, "generate g on clean max_new_tokens 3 {\n read L0.state_after(-1)\n step 1: read L0.state_output\n"
                     " step 2: read L0.state_after(-1)\n read tokens\n"
                     " step 1: write L0.state_input from other.state_output\n}")
    g = r.run("g")
    assert [(op.kind, op.step, op.position, op.result_name) for op in g.ops] == [
        ("read", 0, 33, "g.step0.L0.state_after(33)"),
        ("read", 1, None, "g.step1.L0.state_output"),
        ("read", 2, 35, "g.step2.L0.state_after(35)"),  # new token 2 sits at 34 + 2 - 1
        ("read", None, None, "g.tokens"),
        ("write", 1, None, None)]
    assert g.ops[-1].source == FromRun("other", 0, "state_output", None, None)


def test_generate_errors(spec: Any) -> None:
    errs = errors_of(spec, "generate g on clean max_new_tokens 2 {\n step 2: read L0.states\n"
                           " step 1: read L0.state_after(3)\n}")
    assert [e.span.line for e in errs] == [4, 5]
    assert "steps are 0 (the prompt) to 1" in errs[0].message


# ---- sweeps ---------------------------------------------------------------------------


def test_sweep_template_and_points(spec: Any) -> None:
    r = run_ok(spec, "sweep s on clean over L in L[linear], t in -2..0 {\n write L.state_after(t) from other\n"
                     ' measure prob("P"), norm(L.state_after(t))\n read L.state_output as kept\n}')
    s = r.run("s")
    assert [(a.var, a.kind, a.values, a.labels) for a in s.axes] == [
        ("L", "block", (0, 1, 2), (0, 1, 2)), ("t", "position", (32, 33), (-2, -1))]
    (w, rd) = s.ops
    assert (w.layer, w.layer_var, w.position, w.position_var) == (None, "L", None, "t")
    assert w.source.position_map == ((32, 29), (33, 30))  # -2, -1 counted from other's end
    points = list(s.points())
    assert len(points) == 6 and points[0] == {"L": 0, "t": 32}
    p = s.instantiate({"L": 1, "t": 33})
    assert p.name == "s[L=1,t=33]" and p.kind == "trace" and p.axes == ()
    assert p.ops[0].source == FromRun("other", 1, "state_after", 30, None)
    assert (p.ops[0].layer, p.ops[0].position, p.ops[0].written) == (1, 33, "L1.state_after(33)")
    assert p.ops[1].result_name == "s[L=1,t=33].kept"
    assert [m.result_name for m in p.measures] == ['s[L=1,t=33].prob("P")', "s[L=1,t=33].norm(L1.state_after(33))"]


def test_sweep_over_all_blocks_takes_the_blocks_that_have_the_values(spec: Any) -> None:
    r = run_ok(spec, "sweep a on clean over L in L* { write L.state_after(-1) = zeros; read L.output }\n"
                     "sweep b on clean over L in L* { read L.output }")
    assert r.run("a").axes[0].values == (0, 1, 2)  # state_after exists on the DeltaNet blocks only
    assert r.run("b").axes[0].values == (0, 1, 2, 3)


# ---- measures -------------------------------------------------------------------------


def test_measures(spec: Any) -> None:
    r = run_ok(spec, 'trace b on clean { read logits }\ntrace p on clean {\n measure prob("P"), logit_diff("P", "R")\n'
                     " measure kl(b), kl(other)\n measure norm(L[0,1].state_output) as n\n}")
    ms = r.run("p").measures
    ids = spec.token_ids("PR")
    assert [(m.kind, m.token_ids, m.against, m.layer, m.result_name) for m in ms] == [
        ("prob", (ids[0],), None, None, 'p.prob("P")'),
        ("logit_diff", (ids[0], ids[1]), None, None, 'p.logit_diff("P", "R")'),
        ("kl", (), "b", None, "p.kl(b)"),
        ("kl", (), "other", None, "p.kl(other)"),
        ("norm", (), None, 0, "n.L0"), ("norm", (), None, 1, "n.L1")]
    assert r.runs[0].name == "other" and r.runs[0].implicit


# ---- every family -----------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_family(family: str, tiny_spec: Callable[[str], Any]) -> None:
    spec = tiny_spec(family)
    out = "L[attention].output" if spec.family.block_output == "tensor" else "L[linear].attention_output"
    r = check(HEADER + 'trace p on clean {\n write L[linear].state_after("Tower") from other\n'
                       f" read L*.states, {out}, next_token_probs\n}}", spec)
    assert ops(r, "p")[:3] == [("write", i, "state_after", 15, None) for i in (0, 1, 2)]
    assert [op.layer for op in r.run("p").ops if op.value == "states"] == spec.linear_layers()


def test_resolve_takes_a_program_and_spec(spec: Any) -> None:
    prog = parse(f'prompt clean = "{CLEAN}"\nread L0.states')
    r = resolve(prog, spec)
    assert r.run("main").ops[0].result_name == "main.L0.states"
