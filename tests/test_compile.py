"""The compiler and runner: plans, emitted code, order independence, batching, errors.

Random programs (hypothesis) are checked against the value layer itself: every
read equals what a program holding that run's writes and that one read alone
gives.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltalang
from deltalang.errors import DeltaError
from deltalang.testing import tiny_checkpoint

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


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.dl")), ids=lambda p: p.stem)
def test_golden_plan_and_code(path: Path, model: deltalang.DeltaModel) -> None:
    exp = deltalang.compile(path.read_text(), model, filename=path.name)
    for suffix, text in ((".plan", exp.format_plan()), (".py", _normalise(exp.code, model))):
        expected = path.with_suffix(suffix)
        if UPDATE or not expected.exists():
            expected.write_text(text)
        assert text == expected.read_text(), f"{expected.name} differs; UPDATE_GOLDEN=1 to accept"


def test_golden_cases_exist() -> None:
    assert len(list(GOLDEN.glob("*.dl"))) >= 4


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


def test_batched_runs_equal_unbatched(model: deltalang.DeltaModel) -> None:
    source = f'''
prompt a = "{CLEAN}"
prompt b = "{OTHER}"
prompt c = "Tea"
trace ta on a {{ read L0.state_after(3), L1.attention_values, L2.states; read next_token_probs }}
trace tb on b {{ read L0.state_after(3), L1.attention_values, L2.states; read next_token_probs }}
trace tc on c {{ read L0.state_after(1), L1.attention_values, L2.states; read next_token_probs }}
'''
    batched = deltalang.compile(source, model)
    assert len(batched.plan.passes) == 1 and len(batched.plan.passes[0].runs) == 3
    one, many = batched.run(), deltalang.run(source, model, batch=False)
    for key in one:
        assert _same(one[key], many[key], atol=1e-5), key


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
# random programs: no OutOfOrderError, and each read equals it read alone
# ---------------------------------------------------------------------------

READS = ["state_after({p})", "state_output", "states", "attention_output", "output", "attention_head_outputs",
         "decays", "conv_window_after({p})", "state_input", "attention_queries"]
WRITES = ["state_after({p}) from b", "state_after({p}) = zeros", "state_after({p}) *= 0.5",
          "conv_window_after({p}) from b", "attention_values *= 2.0", "state_input from b.state_output",
          "attention_output *= 0.5", "decays = zeros"]


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
def test_random_programs_read_what_they_would_read_alone(model: deltalang.DeltaModel,
                                                         prog: tuple[str, list[str], list[str]]) -> None:
    body, reads, writes = prog
    header = f'prompt a = "{CLEAN}"\nprompt b = "{CLEAN.upper()}"\n'
    source = header + "trace t on a {\n" + body + "\n}\n"
    results = deltalang.run(source, model)
    for read in reads:
        alone = header + "trace t on a {\n" + "\n".join(writes + [read]) + "\n}\n"
        single = deltalang.run(alone, model)
        for key, value in single.items():
            assert key in results, (key, source)
            if value is None:
                assert results[key] is None
            else:
                # splitting the chunked kernel at other positions is exact up to float rounding
                assert _same(results[key], value, atol=1e-5, rtol=1e-4), (key, source)


# ---------------------------------------------------------------------------
# past one machine: nnsight's remote path (simulated here) and device maps
# ---------------------------------------------------------------------------


def test_remote_local_simulation_gives_the_same_results(model: deltalang.DeltaModel) -> None:
    source = (EXAMPLES / "decode_patch.dl").read_text()
    here = deltalang.run(source, model)
    exp = deltalang.compile(source, model, remote="local")
    assert "remote=remote" in exp.code and "def experiment(model, remote=True)" in exp.code
    there = exp.run()
    for key in here:
        assert _same(here[key], there[key]), key


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
