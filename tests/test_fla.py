"""The value layer through flash-linear-attention's kernels, on this CPU, under Triton's interpreter.

Needs the `fla` extra (`pip install ".[fla]"`: flash-linear-attention and fla-core 0.6, the triton
the installed torch needs); skipped, with the reason, where `fla` is not installed, and failing, with
the reason (`backends.note`), where it is installed but transformers did not bind it. Run it in its own
process (`python -m pytest tests/test_fla.py`): FLA's kernels are interpreted only when
`TRITON_INTERPRET=1` is set before `fla` is imported, and transformers imports `fla` with a
family's modeling module; this file sets it on import, and skips if `fla` came in before.

Triton's interpreter needs two set-up adjustments (measured, FINDINGS.md): it has no benchmarker,
so an autotuner is given one that times every config at zero (the first config is kept, as with
a single config); and FLA calls `.to(tl.int64)` on a `for` loop variable, which the interpreter
leaves a Python int, so the loop variable is wrapped as a tensor the way the interpreter already
wraps assignments. Interpreted FLA is only right in float32, so everything here is float32.

Each family's tiny checkpoint runs deltalang's reads and writes with every delta-rule call on FLA's
kernels (`deltalang.runtime.backends.using("compiled")`; a call is counted to show FLA ran), split at the
positions asked for. Ground truth is `tests/reference.py` (a plain transformers model run token by
token) with transformers' own torch kernels, and transformers' cache: never deltalang's output.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from typing import Any, Callable, Iterator

import pytest

_HAVE_FLA = importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None
_LATE = "fla" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if _HAVE_FLA and not _LATE:
    os.environ["TRITON_INTERPRET"] = "1"

pytestmark = [
    pytest.mark.skipif(not _HAVE_FLA, reason="flash-linear-attention is not installed (pip install '.[fla]')"),
    pytest.mark.skipif(_LATE, reason="fla was imported before TRITON_INTERPRET=1 was set: run tests/test_fla.py "
                                     "in its own process"),
]

import torch  # noqa: E402
from reference import Reference, Write, set_to  # noqa: E402

import deltalang  # noqa: E402
from deltalang.models import families  # noqa: E402
from deltalang.models.spec import text_config  # noqa: E402
from deltalang.models.testing import FAMILY_NAMES, load_hf, tiny_checkpoint  # noqa: E402
from deltalang.runtime import backends, info, kernels  # noqa: E402
from deltalang.runtime.model import decoder_layers  # noqa: E402

PROMPT = "Paris is in"  # 11 byte tokens: the interpreter is slow
OTHER = "I like pizz"


def _interpreter_setup() -> None:
    """The two adjustments to Triton's interpreter (see the module docstring)."""
    from triton.runtime import autotuner, interpreter

    def bench(self: Any) -> Callable[..., list[float]]:
        return lambda fn, quantiles=None, **kw: [0.0] * (len(quantiles) if quantiles else 1)

    autotuner.Autotuner.do_bench = property(bench)  # type: ignore[assignment]

    def visit_For(self: ast.NodeTransformer, node: ast.For) -> ast.For:  # noqa: N802
        self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            name = node.target.id
            to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                      ctx=ast.Load())
            wrap = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                              value=ast.Call(func=to_tensor, args=[ast.Name(id=name, ctx=ast.Load()),
                                                                   ast.Constant(value=False)], keywords=[]))
            node.body.insert(0, wrap)
        return node

    interpreter.ASTTransformer.visit_For = visit_For  # type: ignore[attr-defined]


if _HAVE_FLA and not _LATE:
    _interpreter_setup()


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def loaded(request: pytest.FixtureRequest) -> Iterator[tuple[deltalang.DeltaModel, Reference, dict[str, int]]]:
    """A family's tiny model on deltalang, its plain transformers twin, and FLA's calls counted."""
    path = tiny_checkpoint(request.param)
    model = deltalang.load_model(path)
    hf = load_hf(path).eval()
    fam = model.family
    calls = {"chunk": 0, "recurrent": 0}
    cells = []
    for which, name in (("chunk", fam.chunk_kernel), ("recurrent", fam.recurrent_kernel)):
        b = kernels.backend(fam, name)
        assert b.name.startswith("fla "), f"transformers did not bind FLA for {name}: {b.describe()} {backends.note(b)}"
        fn = b.fn  # transformers' wrapper (`b.compiled` wraps it where FlashQLA is installed)
        cell = fn.__closure__[fn.__code__.co_freevars.index("implementation")]  # type: ignore[union-attr]
        impl = cell.cell_contents

        def counted(*args: Any, _impl: Any = impl, _which: str = which, **kw: Any) -> Any:
            calls[_which] += 1
            return _impl(*args, **kw)

        cell.cell_contents = counted
        cells.append((cell, impl))
    try:
        yield model, Reference(hf), calls
    finally:
        for cell, impl in cells:
            cell.cell_contents = impl


@pytest.fixture
def torch_truth(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Reference` runs transformers' torch kernels (the globals hold FLA's wrapper here)."""
    real = kernels.original

    def torch_kernel(fam: families.Family, name: str) -> Callable[..., Any]:
        return kernels.backend(fam, name).reference or real(fam, name)

    monkeypatch.setattr(kernels, "original", torch_kernel)


def _ids(model: deltalang.DeltaModel, text: str) -> torch.Tensor:
    return model.tokenizer(text, return_tensors="pt").input_ids


def test_a_cpu_run_takes_the_torch_reference_even_with_fla_installed(loaded: tuple) -> None:
    model, _, calls = loaded
    before = dict(calls)
    with torch.no_grad(), model.trace(PROMPT):
        state = model.layers[model.spec.linear_layers()[0]].linear_attn.state_after(3).save()
    assert calls == before and state.shape[0] == 1
    assert "fla " in model.support(kernels=True)["linear_attn.state_after"][model.spec.linear_layers()[0]]


def test_reads_through_fla_equal_transformers(loaded: tuple, torch_truth: None) -> None:
    model, ref, calls = loaded
    ids = _ids(model, PROMPT)
    n = ids.shape[1]
    layers = model.spec.linear_layers()
    positions = (2, n - 1)  # the forward's call, and [0, 2] beside it (n - 1: the call's final state)
    got: dict[tuple[int, str, int], torch.Tensor] = {}
    before = calls["chunk"]
    with backends.using("compiled"), torch.no_grad(), model.trace(PROMPT):
        for i in layers:
            mix = model.layers[i].linear_attn  # in forward order: the convolution first
            got[i, "conv_window_after", 4] = mix.conv_window_after(4).save()
            for t in positions:
                got[i, "state_after", t] = mix.state_after(t).save()
            got[i, "attention_head_outputs", -1] = mix.attention_head_outputs.save()
            got[i, "state_output", -1] = mix.state_output.save()
        logits = model.logits.save()
    assert calls["chunk"] - before == len(layers) * len(positions)
    truth = ref.run(ids)
    for (i, name, t), value in got.items():
        want = truth.value(i, name, position=t if t >= 0 else None)
        torch.testing.assert_close(value, want, atol=2e-5, rtol=0, msg=f"L{i}.{name} {t}")
    torch.testing.assert_close(logits, truth.value(None, "logits"), atol=1e-4, rtol=0)


def test_reads_through_fla_leave_the_forward_bitwise_unchanged(loaded: tuple) -> None:
    """A read changes nothing on FLA's kernels either: logits and every block's output bit for bit."""
    model, _, calls = loaded
    layers = model.spec.linear_layers()

    def trace(read: bool) -> tuple[torch.Tensor, list[Any]]:
        outs: list[Any] = []
        before = calls["chunk"]
        with backends.using("compiled"), torch.no_grad(), model.trace(PROMPT):
            for i in range(len(model.layers)):
                if read and i in layers:
                    mix = model.layers[i].linear_attn
                    mix.states.save()
                    mix.state_after(3).save()
                    mix.state_after(-2).save()
                outs.append(model.layers[i].output.save())
            logits = model.logits.save()
        assert calls["chunk"] > before  # FLA ran
        return logits, outs

    (plain, plain_outs), (read, read_outs) = trace(False), trace(True)
    assert torch.equal(plain, read), float((plain - read).abs().max())
    for x, y in zip(plain_outs, read_outs):
        assert torch.equal(x[0] if isinstance(x, tuple) else x, y[0] if isinstance(y, tuple) else y)


def test_writes_at_positions_through_fla_equal_transformers(loaded: tuple, torch_truth: None) -> None:
    model, ref, calls = loaded
    ids = _ids(model, PROMPT)
    layers = model.spec.linear_layers()
    d = model.spec.dims
    t = 5
    gen = torch.Generator().manual_seed(0)
    written = {i: torch.randn(1, d["heads"], d["key_dim"], d["value_dim"], generator=gen) * 0.5 for i in layers}
    donor = ref.run(_ids(model, OTHER))
    window = {i: donor.value(i, "conv_window_after", position=t - 2) for i in layers}
    before = calls["chunk"]
    with backends.using("compiled"), torch.no_grad(), model.trace(PROMPT):
        for i in layers:
            mix = model.layers[i].linear_attn
            mix.set_conv_window_after(t - 2, window[i])
            mix.set_state_after(t, written[i])
            after = mix.state_after(t + 1).save() if i == layers[-1] else None
        logits = model.logits.save()
    assert calls["chunk"] - before == 2 * len(layers) + 1  # [0, t] and the rest; [t+1, t+1] at the last block
    writes = [Write(i, "state_after", set_to(written[i]), position=t) for i in layers]
    writes += [Write(i, "conv_window_after", set_to(window[i]), position=t - 2) for i in layers]
    truth = ref.run(ids, writes)
    torch.testing.assert_close(logits, truth.value(None, "logits"), atol=1e-4, rtol=0)
    torch.testing.assert_close(after, truth.value(layers[-1], "state_after", position=t + 1), atol=2e-5, rtol=0)
    assert (logits - ref.run(ids).value(None, "logits")).abs().max() > 1e-3  # the writes changed the run


def test_decode_step_state_writes_through_fla_equal_transformers(loaded: tuple, torch_truth: None) -> None:
    model, ref, calls = loaded
    layers = model.spec.linear_layers()
    donor = ref.run(_ids(model, OTHER))
    states = {i: donor.value(i, "state_output") for i in layers}
    before = calls["recurrent"]
    mixes = [model.layers[i].linear_attn for i in layers]
    with backends.using("compiled"):
        with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, do_sample=False) as tracer:
            for step in tracer.iter[:2]:
                if step == 1:  # in forward order: block 0's write, its read, then the later blocks
                    mixes[0].state_input = states[layers[0]]
                    leaving = mixes[0].state_output.save()
                    for mix, i in zip(mixes[1:], layers[1:]):
                        mix.state_input = states[i]
                    last = model.logits[:, -1].save()
            tokens = tracer.result.save()
    assert calls["recurrent"] - before == len(layers)  # the decode step, on FLA's fused_recurrent kernel
    writes = [Write(i, "state_input", set_to(states[i]), step=1) for i in layers]
    truth = ref.run(_ids(model, PROMPT), writes, max_new_tokens=2)
    clean = ref.run(_ids(model, PROMPT), max_new_tokens=2)
    n = _ids(model, PROMPT).shape[1]
    assert tokens[:, n:].tolist() == truth.new_tokens.tolist()
    torch.testing.assert_close(leaving, truth.value(layers[0], "state_output", step=1), atol=2e-5, rtol=0)
    torch.testing.assert_close(last, truth.value(None, "logits", step=1)[:, -1], atol=1e-4, rtol=0)
    assert (last - clean.value(None, "logits", step=1)[:, -1]).abs().max() > 1e-3  # the write changed the step


def test_packed_sequences_through_fla_equal_one_call_each(loaded: tuple) -> None:
    """FLA's own `cu_seqlens` (a plain forward passes it through) against one torch call per sequence."""
    model, _, calls = loaded
    fam = model.family
    layer = model.spec.linear_layers()[0]
    mixer = getattr(decoder_layers(model._module)[layer], fam.mixer_attr)
    torch.manual_seed(0)
    hidden = torch.randn(1, 5 + 7, text_config(model.spec.config).hidden_size)
    before = calls["chunk"]
    with torch.no_grad():
        with backends.using("compiled"):
            packed = mixer(hidden_states=hidden, cu_seq_lens_q=torch.tensor([0, 5, 12], dtype=torch.int32))
        apart = torch.cat([mixer(hidden_states=hidden[:, :5]), mixer(hidden_states=hidden[:, 5:])], dim=1)
    assert calls["chunk"] - before == 1
    torch.testing.assert_close(packed, apart, atol=2e-5, rtol=0)


class _Reached(Exception):
    pass


def test_flash_qla_is_not_reached_through_deltalang(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLA 0.6's own dispatch, made to accept FlashQLA here (its verifier wants an SM90+ GPU, bf16, K = V = 128).

    A direct call of FLA's kernel reaches FlashQLA; the same kernel through deltalang (split at a position) does
    not: deltalang sets FLA_FLASH_QLA=0 for its calls where FlashQLA is installed (`backends`, docs/gpu.md).
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.gated_delta_rule.backends.flash_qla import FlashQLABackend

    def handoff(self: Any, q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise _Reached(tuple(q.shape))

    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, package=None: object() if name == "flash_qla" else real_find(name, package))
    monkeypatch.setattr(FlashQLABackend, "is_available", classmethod(lambda cls: True))
    monkeypatch.setattr(FlashQLABackend, "chunk_gated_delta_rule_verifier", lambda self, *a, **k: (True, None))
    monkeypatch.setattr(FlashQLABackend, "chunk_gated_delta_rule", handoff)
    monkeypatch.delenv(backends.FLASH_QLA_ENV, raising=False)
    fam = families.by_name("qwen3_5")
    x = torch.randn(1, 8, 2, 16)
    with pytest.raises(_Reached):  # the control: FLA alone hands the call to FlashQLA
        chunk_gated_delta_rule(x, x, x, torch.zeros(1, 8, 2), torch.ones(1, 8, 2))
    kernels.uninstall(fam)  # read the kernels again, FlashQLA installed
    kernels.install(fam)
    try:
        assert kernels.backend(fam, fam.chunk_kernel).handoff == backends.FLASH_QLA
        model = deltalang.load_model(tiny_checkpoint("qwen3_5"))
        assert any(line.startswith("FlashQLA") for line in info.kernel_notes(model.spec))
        with backends.using("compiled"), torch.no_grad(), model.trace(PROMPT):
            state = model.layers[model.spec.linear_layers()[0]].linear_attn.state_after(3).save()
        assert state.shape[0] == 1 and backends.FLASH_QLA_ENV not in os.environ
    finally:
        monkeypatch.undo()
        kernels.uninstall(fam)
        kernels.install(fam)
