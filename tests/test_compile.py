"""The compiler and runner: plans, emitted code, order independence, batching, errors.

Results are checked against transformers itself (`tests/reference.py`: the
model's own forward over its own cache, token by token, with the writes applied
by hand): each golden program, and random programs (hypothesis). The golden
`.plan` / `.py` files are readable examples of plans and emitted code; a change
to them is accepted with UPDATE_GOLDEN=1, and a missing one fails.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import Record, Reference, Write, kl, set_to, zeros
from transformers import AutoModelForCausalLM

import deltalang
from deltalang.ground.errors import DeltaError
from deltalang.models.testing import tiny_checkpoint

HERE = Path(__file__).parent
GOLDEN = HERE / "golden_plans"
EXAMPLES = HERE.parent / "examples"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"

CLEAN = "The Eiffel Tower is in"
OTHER = "My pizza with cheese"


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model(tiny_checkpoint("qwen3_5"))


def _same(a: object, b: object, atol: float = 0.0, rtol: float = 0.0) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and (torch.equal(a, b) if atol == 0 and rtol == 0
                                       else torch.allclose(a, b, atol=atol, rtol=rtol))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= atol
    return a == b


def _normalise(text: str, model: deltalang.DeltaModel) -> str:
    return text.replace(repr(str(tiny_checkpoint("qwen3_5"))), "'<tiny qwen3_5>'")


# ---------------------------------------------------------------------------
# golden plans and code
# ---------------------------------------------------------------------------


def _check_golden(path: Path, model: deltalang.DeltaModel, update: bool) -> None:
    """The plan and the emitted code of `path` equal its `.plan` and `.py` files (written only when `update`)."""
    exp = deltalang.compile(path.read_text(), model, filename=path.name)
    for suffix, text in ((".plan", exp.format_plan()), (".py", _normalise(exp.code, model))):
        expected = path.with_suffix(suffix)
        if update:
            expected.write_text(text)
        assert expected.exists(), f"{expected.name} is missing; UPDATE_GOLDEN=1 writes it"
        assert text == expected.read_text(), f"{expected.name} differs; UPDATE_GOLDEN=1 to accept"


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.dl")), ids=lambda p: p.stem)
def test_golden_plan_and_code(path: Path, model: deltalang.DeltaModel) -> None:
    """The golden files are readable examples of plans and code; their numbers are checked below."""
    _check_golden(path, model, UPDATE)


def test_a_missing_golden_file_fails(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    path = tmp_path / "new.dl"
    path.write_text((GOLDEN / "order.dl").read_text())
    with pytest.raises(AssertionError, match="new.plan is missing"):
        _check_golden(path, model, update=False)
    assert not path.with_suffix(".plan").exists()
    _check_golden(path, model, update=True)
    _check_golden(path, model, update=False)


def test_golden_cases_exist() -> None:
    assert len(list(GOLDEN.glob("*.dl"))) >= 4
    assert set(GOLDEN_TRUTH) == {p.stem for p in GOLDEN.glob("*.dl")}, "each golden program needs its truth"


# ---------------------------------------------------------------------------
# golden programs against transformers: what each result must be, from tests/reference.py
# ---------------------------------------------------------------------------

G_CLEAN = "The Eiffel Tower is in the city of"
G_OTHER = "My favourite food is pizza with"


def _truth_chain(ref: Reference, ids: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    a = ref.run(ids(G_CLEAN), [Write(0, "state_after", lambda x, i: x * 0.5, 2)])
    b = ref.run(ids(G_OTHER), [Write(1, "state_after", set_to(a.value(1, "state_after", 4)), 4)])
    c = ref.run(ids(G_CLEAN), [Write(2, "state_after", set_to(b.value(2, "state_after", 4)), 4)])
    return {"a.L0.state_output": a.value(0, "state_output"), "b_state": b.value(1, "state_output"),
            "c.next_token_probs": c.value(None, "next_token_probs"), "d.L0.state_input": None}


def _truth_mean(ref: Reference, ids: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    corpus = ["The cat sat", "A dog ran far", "Rain fell"]
    mean = torch.stack([ref.run(ids(t)).value(1, "state_after", 2) for t in corpus]).mean(0)
    avg = ref.run(ids(G_CLEAN), [Write(1, "state_after", set_to(mean), 2)])
    kept = avg.value(0, "state_after", 1)
    reuse = ref.run(ids(G_CLEAN), [Write(0, "state_after", set_to(kept), 1)])
    return {"kept": kept, "avg.next_token_probs": avg.value(None, "next_token_probs"),
            "reuse.kl(avg)": kl(avg.value(None, "logits")[:, -1], reuse.value(None, "logits")[:, -1]),
            "reuse.norm(L1.state_output)": float(reuse.value(1, "state_output").norm())}


def _truth_order(ref: Reference, ids: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    t = ref.run(ids(G_CLEAN), [Write(1, "state_after", zeros, 3)])
    reads = [(None, "next_token_probs", None), (2, "output", None), (1, "state_output", None),
             (1, "state_after", 7), (1, "state_after", 3), (1, "states", None), (0, "attention_output", None),
             (0, "decays", None), (0, "conv_window_after", 5)]
    out = {}
    for layer, value, pos in reads:
        site = value if pos is None else f"{value}({pos})"
        out["t." + (site if layer is None else f"L{layer}.{site}")] = t.value(layer, value, pos)
    return out


def _truth_steps(ref: Reference, ids: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    plain = ref.run(ids(G_CLEAN), max_new_tokens=3)
    g = ref.run(ids(G_CLEAN), [Write(1, "state_input", zeros, step=2)], max_new_tokens=3)
    out: dict[str, Any] = {"plain.tokens": plain.new_tokens, "s1": g.value(1, "state_input", step=1),
                           "g.tokens": g.new_tokens}
    for k in range(3):  # kl(plain) at step k compares with plain's step k
        out[f"g.step{k}.L0.state_output"] = g.value(0, "state_output", step=k)
        last = [run.value(None, "logits", step=k)[:, -1] for run in (plain, g)]
        out[f"g.step{k}.kl(plain)"] = kl(*last)
    return out


def _truth_tour(ref: Reference, ids: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    tower = ids("The Eiffel Tower").shape[1] - 1  # "Tower" is the last token of its first occurrence
    other = ref.run(ids(G_OTHER))
    base = ref.run(ids(G_CLEAN))
    patched = ref.run(ids(G_CLEAN), [Write(i, "state_after", set_to(other.value(i, "state_after", tower)), tower)
                                     for i in ref.linear])
    cont = ref.run(ids(G_CLEAN), [Write(i, "state_input", set_to(other.value(i, "state_output")), step=1)
                                  for i in ref.linear], max_new_tokens=4)
    return {"base.L0.state_input": None, "base.L0.state_output": base.value(0, "state_output"),
            "clean_probs": base.value(None, "next_token_probs"), "before": patched.value(0, "state_after", 2),
            "after": patched.value(0, "state_after", ids(G_CLEAN).shape[1] - 1),
            "patched.next_token_probs": patched.value(None, "next_token_probs"), "cont.tokens": cont.new_tokens}


GOLDEN_TRUTH = {"chain": _truth_chain, "mean": _truth_mean, "order": _truth_order, "steps": _truth_steps,
                "tour": _truth_tour}


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference(AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3_5")))


def _tokenizer_ids(model: deltalang.DeltaModel) -> Callable[[str], torch.Tensor]:
    return lambda text: model.tokenizer(text, return_tensors="pt").input_ids


def _assert_truth(results: Any, truth: dict[str, Any], where: str) -> None:
    assert set(results) == set(truth), where
    for key, want in truth.items():
        got = results[key]
        if want is None:
            assert got is None, (where, key)
        elif isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-4, abs=1e-6), (where, key)
        elif want.dtype == torch.long:
            assert got.tolist() == want.tolist(), (where, key)
        else:
            assert got.shape == want.shape, (where, key)
            torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=1e-4, msg=f"{where}: {key}")


@pytest.mark.parametrize("name", sorted(GOLDEN_TRUTH))
def test_golden_programs_give_what_transformers_gives(name: str, model: deltalang.DeltaModel,
                                                      ref: Reference) -> None:
    """Each golden program's emitted code, run, against its values computed with transformers' cache."""
    exp = deltalang.compile((GOLDEN / f"{name}.dl").read_text(), model, filename=f"{name}.dl")
    _assert_truth(exp.run(), GOLDEN_TRUTH[name](ref, _tokenizer_ids(model)), name)


# ---------------------------------------------------------------------------
# emitted code runs on its own
# ---------------------------------------------------------------------------


def test_saved_code_gives_the_same_results(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    source = (EXAMPLES / "decode_patch.dl").read_text() + "\n" + (EXAMPLES / "values_tour.dl").read_text()
    source = source.replace('prompt clean = "The Eiffel Tower is in the city of"\n', "", 1)
    exp = deltalang.compile(source, model, filename="both.dl")
    results = exp.run()
    file = tmp_path / "emitted.py"
    file.write_text(exp.code)
    spec = importlib.util.spec_from_file_location("emitted_copy", file)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    again = module.experiment(model)
    assert list(again) == list(results)
    for key in results:
        assert _same(results[key], again[key]), key
    proc = subprocess.run([sys.executable, str(file)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all.tokens" in proc.stdout


# ---------------------------------------------------------------------------
# statement order never matters
# ---------------------------------------------------------------------------


def _permute_blocks(source: str, seed: int) -> str:
    """Shuffle the statements inside each `{ ... }` block and the top-level declarations' runs."""
    rng = random.Random(seed)

    def shuffle(match: re.Match[str]) -> str:
        body = [line for line in match.group(2).split("\n") if line.strip() and not line.strip().startswith("#")]
        rng.shuffle(body)
        return match.group(1) + "\n" + "\n".join(body) + "\n}"

    return re.sub(r"(\{)\n(.*?)\n\}", shuffle, source, flags=re.S)


@pytest.mark.parametrize("name", ["decode_patch", "patch_after_token", "values_tour", "whole_memory"])
def test_permuting_statements_gives_identical_results(model: deltalang.DeltaModel, name: str) -> None:
    source = (EXAMPLES / f"{name}.dl").read_text()
    source = re.sub(r"\s*measure prob\(\" Paris\"\)", "\n    read next_token_probs", source)  # byte tokenizer
    base = deltalang.run(source, model)
    for seed in (1, 2):
        permuted = _permute_blocks(source, seed)
        assert permuted != source or seed > 1
        again = deltalang.run(permuted, model)
        assert set(again) == set(base)
        for key in base:
            assert _same(base[key], again[key]), (seed, key)


# ---------------------------------------------------------------------------
# batching
# ---------------------------------------------------------------------------


def test_batched_runs_of_any_length_share_a_forward_and_equal_transformers(model: deltalang.DeltaModel,
                                                                           ref: Reference) -> None:
    """Traces of one stage share a forward whatever their lengths (the shorter left-padded), and every value
    equals transformers on the prompt alone. (tests/test_batching.py: all families, writes.)"""
    same = "The Eiffel Tower is at"  # as many tokens as CLEAN
    source = f'''
prompt a = "{CLEAN}"
prompt b = "{OTHER}"
prompt c = "Tea"
prompt d = "{same}"
trace ta on a {{ read L0.state_after(3), L1.attention_values, L2.states, L0.output; read logits }}
trace tb on b {{ read L0.state_after(3), L1.attention_values, L2.states, L0.output; read logits }}
trace tc on c {{ read L0.state_after(1), L1.attention_values, L2.states, L0.output; read logits }}
trace td on d {{ read L0.state_after(3), L1.attention_values, L2.states, L0.output; read logits }}
'''
    exp = deltalang.compile(source, model)
    assert [sorted(r.name for r in p.runs) for p in exp.plan.passes] == [["ta", "tb", "tc", "td"]]
    assert exp.plan.passes[0].padded
    got = exp.run()
    for run, text, pos in (("ta", CLEAN, 3), ("tb", OTHER, 3), ("tc", "Tea", 1), ("td", same, 3)):
        rec = ref.run(model.tokenizer(text, return_tensors="pt").input_ids)
        want = {f"L0.state_after({pos})": rec.value(0, "state_after", pos),
                "L1.attention_values": rec.value(1, "attention_values"), "L2.states": rec.value(2, "states"),
                "L0.output": rec.value(0, "output"), "logits": rec.value(None, "logits")}
        for key, value in want.items():
            assert _same(got[f"{run}.{key}"], value, atol=1e-4), (run, key)


def test_a_shared_forward_holds_runs_of_similar_length_up_to_a_token_budget(model: deltalang.DeltaModel) -> None:
    from deltalang.compiler.plan import batch_stage
    texts = ["a b c d e f g h", "a", "a b c", "a b c d e f g h i j", "a b"]
    source = "".join(f'prompt p{i} = "{t}"\ntrace t{i} on p{i} {{ read logits }}\n' for i, t in enumerate(texts))
    runs = list(deltalang.compile(source, model).plan.passes[0].runs)
    n = {r.name: r.n_tokens for r in runs}
    budget = 2 * max(n.values())
    groups = batch_stage(runs, max_tokens=budget)
    assert [r.name for g in groups for r in g] == sorted(n, key=lambda k: n[k])  # every run once, shortest first
    assert all(len(g) * max(n[r.name] for r in g) <= budget for g in groups if len(g) > 1)
    assert len(groups) > 1


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


def test_a_cycle_names_both_statements(model: deltalang.DeltaModel) -> None:
    source = f'''prompt a = "{CLEAN}"
trace x on a {{ write L0.state_after(2) from y }}
trace y on a {{ write L1.state_after(2) from x }}
'''
    with pytest.raises(DeltaError) as info:
        deltalang.compile(source, model, filename="cycle.dl")
    text = info.value.render()
    assert "cycle" in text and "x" in text and "y" in text
    assert "cycle.dl:2" in text or "cycle.dl:3" in text


def test_a_runtime_error_points_at_its_program_line(model: deltalang.DeltaModel) -> None:
    source = f'''prompt a = "{CLEAN}"
prompt b = "{OTHER}"
trace x on a {{
    read L0.state_output
    write L1.attention_values from b
}}
'''
    with pytest.raises(DeltaError) as info:
        deltalang.run(source, model, filename="shape.dl")
    assert info.value.span is not None and info.value.span.line == 5, info.value.render()
    assert "shape.dl:5" in info.value.render()


# ---------------------------------------------------------------------------
# random programs: no OutOfOrderError, and each read is what transformers' cache holds
# ---------------------------------------------------------------------------

READS = ["state_after({p})", "state_output", "states", "attention_output", "output", "attention_head_outputs",
         "decays", "conv_window_after({p})", "state_input", "attention_queries"]
WRITES = ["state_after({p}) from b", "state_after({p}) = zeros", "state_after({p}) *= 0.5",
          "conv_window_after({p}) from b", "attention_values *= 2.0", "state_input from b.state_output",
          "attention_output *= 0.5", "decays = zeros"]


@pytest.fixture(scope="module")
def b_run(ref: Reference, model: deltalang.DeltaModel) -> Record:
    """The reference run of the random programs' donor prompt b."""
    return ref.run(_tokenizer_ids(model)(CLEAN.upper()))


def _reference_write(text: str, b: Record) -> Write:
    """The reference's form of one drawn write, `write L<i>.SITE SOURCE`."""
    m = re.fullmatch(r"write L(\d)\.(\w+)(?:\((\d+)\))? (.*)", text)
    assert m is not None, text
    layer, value, pos, source = int(m[1]), m[2], None if m[3] is None else int(m[3]), m[4]
    if source.startswith("from b"):
        donor = b.value(layer, "state_output") if source == "from b.state_output" else b.value(layer, value, pos)
        return Write(layer, value, set_to(donor), pos)
    if source == "= zeros":
        return Write(layer, value, zeros, pos)
    factor = float(source.removeprefix("*= "))
    return Write(layer, value, lambda x, i: x * factor, pos)


@st.composite
def programs(draw: st.DrawFn) -> tuple[str, list[str], list[str]]:
    n_reads = draw(st.integers(1, 4))
    n_writes = draw(st.integers(0, 3))
    layers = st.sampled_from([0, 1, 2])
    pos = st.integers(0, 10)
    reads = [f"read L{draw(layers)}." + draw(st.sampled_from(READS)).format(p=draw(pos)) for _ in range(n_reads)]
    if draw(st.booleans()):
        reads.append("read next_token_probs")
    writes = []
    for _ in range(n_writes):
        writes.append(f"write L{draw(layers)}." + draw(st.sampled_from(WRITES)).format(p=draw(pos)))
    # no two writes to one site: which one wins would be a matter of text order
    seen, unique = set(), []
    for w in writes:
        site = w.split()[1]
        if site not in seen:
            seen.add(site)
            unique.append(w)
    reads = list(dict.fromkeys(reads))
    stmts = reads + unique
    draw(st.randoms()).shuffle(stmts)
    return "\n".join(stmts), reads, unique


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(programs())
def test_random_programs_read_what_transformers_holds(model: deltalang.DeltaModel, ref: Reference, b_run: Record,
                                                      prog: tuple[str, list[str], list[str]]) -> None:
    """Every read of a random program of reads and writes equals the value transformers' own forward
    gives with those writes applied to its cache and kernel by hand (tests/reference.py)."""
    body, reads, writes = prog
    header = f'prompt a = "{CLEAN}"\nprompt b = "{CLEAN.upper()}"\n'
    source = header + "trace t on a {\n" + body + "\n}\n"
    exp = deltalang.compile(source, model)
    results = exp.run()
    rec = ref.run(_tokenizer_ids(model)(CLEAN), [_reference_write(w, b_run) for w in writes])
    truth = {op.key: rec.value(op.layer, op.value, op.position) for p in exp.plan.passes for r in p.runs
             if r.name == "t" for op in r.ops if op.kind == "read" and not op.hidden}
    assert len(truth) == len(reads), source
    _assert_truth(results, truth, source)


# ---------------------------------------------------------------------------
# past one machine: device maps (remote execution is refused: tests/test_cli.py)
# ---------------------------------------------------------------------------


def test_device_map_without_accelerate_is_a_clear_error() -> None:
    pytest.importorskip("transformers")
    try:
        import accelerate  # noqa: F401
    except ImportError:
        with pytest.raises(DeltaError, match="needs accelerate"):
            deltalang.load_model(tiny_checkpoint("qwen3_5"), device_map="auto")
    else:
        m = deltalang.load_model(tiny_checkpoint("qwen3_5"), device_map="auto")
        assert deltalang.run("read L0.state_output", m, prompt="hello")["main.L0.state_output"].shape[0] == 1
