"""An observation does not change what it observes: reads leave the forward bit for bit as it was.

For every family, a trace with a set of reads and no write gives logits and every block's output
`torch.equal` to the same trace without the reads (the delta-rule call the forward uses is never split
for a read), and each read's value is transformers' own: its cache after running the first t+1 tokens
holds the state after token t (within 2e-5 relative: the prefix forward's own float noise upstream).
A read followed by a write of the same state (`*= 0.5`) still changes the forward, as transformers does.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import Reference, Write

import deltalang
from deltalang.models import families, testing
from deltalang.models.testing import FAMILY_NAMES, load_hf, tiny_checkpoint
from deltalang.runtime import deltarule, kernels
from deltalang.runtime.mixer import reads as mixer_reads

LONG = "The Eiffel Tower is in Paris, and the Brandenburg Gate is in Berlin, o"  # 70 byte tokens: two chunks
SHORT = "The Brandenburg Gate is in Berlin"  # left-padded beside LONG
READS: dict[str, tuple[str, ...]] = {
    "state_after(3)": ("state_after:3",),
    "states": ("states",),
    "state_after(-2)": ("state_after:-2",),
    "states + state_after(-3)": ("states", "state_after:-3"),
    "state_after(3) + state_after(66)": ("state_after:3", "state_after:66"),
    "conv_window_after(2)": ("conv_window_after:2",),
}
REL = 2e-5


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _block(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, tuple) else x


def _reads(model: deltalang.DeltaModel, reads: tuple[str, ...], got: dict, outs: list, tag: str) -> None:
    """Inside a trace or invoke: each block's reads (DeltaNet blocks), then its output, saved in forward order."""
    linear = model.spec.linear_layers()
    for i in range(len(model.layers)):
        if i in linear:
            mixer = model.layers[i].linear_attn
            for r in reads:
                name, _, at = r.partition(":")
                got[(tag, i, r)] = (getattr(mixer, name)(int(at)) if at else getattr(mixer, name)).save()
        outs.append(model.layers[i].output.save())


def _trace(model: deltalang.DeltaModel, runs: list[tuple[str, tuple[str, ...]]]) -> tuple[list, list, dict]:
    """One trace, an invoke per (prompt, reads): each invoke's logits and block outputs, and the reads."""
    got: dict = {}
    outs: list[list] = [[] for _ in runs]
    logits: list = []
    with torch.no_grad(), model.trace() as tracer:
        for n, (prompt, reads) in enumerate(runs):
            with tracer.invoke(prompt):
                _reads(model, reads, got, outs[n], str(n))
                logits.append(model.logits.save())
    return logits, outs, got


class Truth:
    """transformers' cache after the first t+1 tokens of a prompt, each prefix run once."""

    def __init__(self, hf: Any, model: deltalang.DeltaModel) -> None:
        self.hf, self.model, self.caches = hf, model, {}

    def ids(self, prompt: str) -> torch.Tensor:
        return self.model.tokenizer(prompt, return_tensors="pt").input_ids

    def cache(self, prompt: str, t: int) -> Any:
        ids = self.ids(prompt)
        t = t + ids.shape[1] if t < 0 else t
        if (prompt, t) not in self.caches:
            with torch.no_grad():
                self.caches[(prompt, t)] = self.hf(ids[:, : t + 1], use_cache=True).past_key_values
        return self.caches[(prompt, t)]

    def worst(self, prompt: str, got: dict, tag: str) -> float:
        """The largest relative distance of the invoke's state reads from the cache."""
        n, worst = self.ids(prompt).shape[1], 0.0
        for (where, i, r), value in got.items():
            name, _, at = r.partition(":")
            if where != tag or name == "conv_window_after":
                continue
            if name == "states":
                assert value.shape[1] == n
                for t in sorted({t for t in (0, 3, 63, 64, n - 3, n - 1) if t < n}):
                    worst = max(worst, _rel(value[:, t], self.cache(prompt, t).get_recurrent_state(i)))
            else:
                worst = max(worst, _rel(value, self.cache(prompt, int(at)).get_recurrent_state(i)))
        return worst


def _assert_unchanged(plain: tuple, read: tuple, what: str) -> None:
    for n, (a, b) in enumerate(zip(plain[0], read[0])):
        assert torch.equal(a, b), f"{what}: invoke {n}'s logits moved by {float((a - b).abs().max()):.3g}"
    for n, (xs, ys) in enumerate(zip(plain[1], read[1])):
        for i, (x, y) in enumerate(zip(xs, ys)):
            assert torch.equal(_block(x), _block(y)), f"{what}: invoke {n}'s block {i} output moved"


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def loaded(request: pytest.FixtureRequest) -> tuple[deltalang.DeltaModel, Truth]:
    path = tiny_checkpoint(request.param)
    model = deltalang.load_model(path)
    return model, Truth(load_hf(path).eval(), model)


@pytest.mark.parametrize("case", list(READS))
def test_reads_leave_the_forward_bitwise_unchanged(loaded: tuple, case: str) -> None:
    model, truth = loaded
    plain = _trace(model, [(LONG, ())])
    read = _trace(model, [(LONG, READS[case])])
    _assert_unchanged(plain, read, case)
    assert truth.worst(LONG, read[2], "0") < REL


def test_invokes_of_different_lengths_reading_at_different_positions(loaded: tuple) -> None:
    model, truth = loaded
    runs = [(LONG, ("state_after:5", "state_after:-2")), (SHORT, ("states", "state_after:20")), (LONG, ())]
    plain = _trace(model, [(p, ()) for p, _ in runs])
    read = _trace(model, runs)
    _assert_unchanged(plain, read, "invokes")
    assert truth.worst(LONG, read[2], "0") < REL
    assert truth.worst(SHORT, read[2], "1") < REL


def test_a_read_does_not_move_another_read(loaded: tuple) -> None:
    """`state_after(t)` is the same bits whatever else the trace reads (`states`, other positions)."""
    model, _ = loaded
    reads = ("states", "state_after:3", "state_after:9", "state_after:-3", "state_after:-1")
    beside = _trace(model, [(LONG, reads), (SHORT, ("state_after:9",))])[2]
    for r in reads:
        for (tag, i, _), value in _trace(model, [(LONG, (r,)), (SHORT, ())])[2].items():  # the same batch
            assert torch.equal(value, beside[(tag, i, r)]), (i, r)


@pytest.mark.parametrize("other", ["state_after:9", "state_after:20"])
def test_a_read_is_the_same_bits_whatever_the_other_invoke_reads(loaded: tuple, other: str) -> None:
    """The state after 63 read alone is a side call over one row; with the other invoke reading a position of the
    same chunk, one call over both rows (`reads._masked`). Its bits are the row's own either way: on some CPUs
    (AMD EPYC) a product of one chunk's matrices gave other bits for a batch of one than of two."""
    model, _ = loaded
    for second in (SHORT, OTHER):
        alone = _trace(model, [(LONG, ("state_after:63",)), (second, ())])[2]
        beside = _trace(model, [(LONG, ("state_after:63",)), (second, (other,))])[2]
        for key, value in alone.items():
            assert torch.equal(value, beside[key]), (second, key)


def test_a_read_then_write_of_the_same_state_still_changes_the_forward(loaded: tuple) -> None:
    model, truth = loaded
    layer = model.spec.linear_layers()[0]
    with torch.no_grad(), model.trace(LONG):
        mixer = model.layers[layer].linear_attn
        mixer.set_state_after(3, mixer.state_after(3) * 0.5)
        later = mixer.state_after(-2).save()
        logits = model.logits.save()
    want = Reference(truth.hf).run(truth.ids(LONG), [Write(layer, "state_after", lambda x, i: x * 0.5, 3)])
    plain = _trace(model, [(LONG, ())])[0][0]
    assert not torch.equal(logits, plain)
    assert _rel(logits, want.value(None, "logits")) < 1e-4
    assert _rel(later, want.value(layer, "state_after", truth.ids(LONG).shape[1] - 2)) < 1e-4


OTHER = "The Eiffel Tower is in Rome!, and the Brandenburg Gate is in Berlin, o"  # LONG's length, its own tokens


@pytest.mark.parametrize("t", [3, 63, 66, -1])
def test_a_read_then_written_invoke_splits_alone_and_the_other_runs_on_unchanged(loaded: tuple, t: int) -> None:
    """A read then written (what `= zeros` and `*= 0.5` emit) splits its own rows at t: they run from where the
    forward's call had got to (behind a torch kernel, the chunk boundary before t) to t and on from the written
    state, as transformers runs them; the other invoke's forward goes on bitwise as in a trace without reads, and
    its read at t is transformers' cache. Positions in the first chunk, at its end, past it, the last token."""
    model, truth = loaded
    layer = model.spec.linear_layers()[0]
    n = truth.ids(LONG).shape[1]
    assert truth.ids(OTHER).shape[1] == n
    p, got = t % n, {}
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(LONG):
            mixer = model.layers[layer].linear_attn
            mixer.set_state_after(t, mixer.state_after(t) * 0.5)
            if p < n - 2:
                got["later"] = mixer.state_after(n - 2).save()
            written = model.logits.save()
        with tracer.invoke(OTHER):
            read = model.layers[layer].linear_attn.state_after(t).save()
            other = model.logits.save()
    want = Reference(truth.hf).run(truth.ids(LONG), [Write(layer, "state_after", lambda x, i: x * 0.5, p)])
    assert _rel(written, want.value(None, "logits")) < 1e-4
    if p < n - 2:
        assert _rel(got["later"], want.value(layer, "state_after", n - 2)) < 1e-4
    assert torch.equal(other, _trace(model, [(LONG, ()), (OTHER, ())])[0][1])
    assert _rel(read, truth.cache(OTHER, p).get_recurrent_state(layer)) < REL


def test_the_forwards_call_runs_whole_beside_a_read_then_written_invoke(loaded: tuple,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward's delta-rule call runs once over every row and token, as without the trace, never in pieces
    at chunk boundaries: on some CPUs (AMD EPYC) transformers' torch kernel over [0, 64) then [64, 70) gives other
    bits for the same rows than over [0, 70) (its matrix products laid out by the number of chunks), which moved
    the other invoke's logits above. Each kernel call `reads._run` makes is recorded: (rows, start, end)."""
    model, truth = loaded
    layer = model.spec.linear_layers()[0]
    n = truth.ids(LONG).shape[1]
    calls: list[tuple[Any, int, int]] = []
    real = mixer_reads._run

    def spy(fn: Any, inputs: Any, rows: list[int], a: int, e: int, state: Any, l2: bool) -> Any:
        calls.append((list(rows), a, e))
        return real(fn, inputs, rows, a, e, state, l2)

    monkeypatch.setattr(mixer_reads, "_run", spy)
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(LONG):
            mixer = model.layers[layer].linear_attn
            mixer.set_state_after(63, mixer.state_after(63) * 0.5)
        with tracer.invoke(OTHER):
            model.logits.save()
    if not calls:  # a family whose state_after reads are not served by `reads` (Mamba-2, KDA's own paths)
        assert model.spec.family.block_kind != "deltanet" or model.spec.family.per_channel_decay
        return
    assert calls[0] == ([0, 1], 0, n)  # the forward's own call, whole
    assert calls[1:] == [([0], 64, n)]  # the written row on from token 64, after its write at 63


def _qwen3_next_16(root: Path) -> Path:
    """A Qwen3-Next checkpoint with 16-dim value heads (the issue's case)."""
    torch.manual_seed(0)
    cfg = testing.tiny_config("qwen3_next")
    cfg.linear_value_head_dim = 16
    hf = families.auto_class(cfg).from_config(cfg).eval()
    testing._enlarge_random_weights(hf)
    hf.save_pretrained(root)
    testing.byte_tokenizer().save_pretrained(root)
    return root


@pytest.mark.skipif("qwen3_next" not in FAMILY_NAMES, reason="no qwen3_next in this transformers")
def test_states_beside_state_after_on_16_dim_value_heads(tmp_path: Path) -> None:
    path = _qwen3_next_16(tmp_path / "qwen3_next_16")
    model = deltalang.load_model(path)
    truth = Truth(load_hf(path).eval(), model)
    both = _trace(model, [(LONG, ("states", "state_after:-3"))])
    alone = _trace(model, [(LONG, ("state_after:-3",))])
    _assert_unchanged(_trace(model, [(LONG, ())]), both, "states + state_after(-3)")
    assert truth.worst(LONG, both[2], "0") < REL
    for key, value in alone[2].items():
        assert torch.equal(value, both[2][key])


GATED = [n for n in FAMILY_NAMES if not getattr(families, n).per_channel_decay]


@pytest.mark.parametrize("name", GATED)
@pytest.mark.parametrize("length", [5, 64, 70, 131])
def test_a_side_calls_state_is_the_kernels_final_state_and_each_rows_own(name: str, length: int) -> None:
    """`deltarule.final_state` (a read's side call behind a torch kernel: the kernel's state half only) is the
    final state of the family's own chunked kernel in transformers within float32 rounding, and each row's bits
    are its own, alone or among others: grouped key heads, from zeros and from a given state, one chunk and
    several. (Not the kernel's bits: on some CPUs, AMD EPYC here, the kernel itself gives a row other bits alone
    than in a batch of 3, its products laid out by the batch's shape.)"""
    fam = getattr(families, name)
    kernel = kernels.backend(fam, fam.chunk_kernel).reference  # transformers' torch function itself
    gen = torch.Generator().manual_seed(length)
    # grouped key heads where the kernel repeats them itself (transformers >= 5.24; before, the mixer did)
    b, h, dk, dv = 3, 4, 16, 8
    kh = 2 if "repeat_interleave" in inspect.getsource(kernel) else h
    q, k = (torch.randn(b, length, kh, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, length, h, dv, generator=gen)
    g, beta = -torch.rand(b, length, h, generator=gen), torch.rand(b, length, h, generator=gen)
    for start in (None, torch.randn(b, h, dk, dv, generator=gen) * 0.1):
        want = kernel(q, k, v, g=g, beta=beta, initial_state=start, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)[1]
        got = deltarule.final_state(fam, q, k, v, g, beta, start, True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for rows in ([1], [0, 2], [2, 1]):
            part = deltarule.final_state(fam, q[rows], k[rows], v[rows], g[rows], beta[rows],
                                         None if start is None else start[rows], True)
            assert torch.equal(part, got[rows]), rows


@pytest.mark.parametrize("name", GATED)
def test_no_op_tokens_after_a_prefix_leave_its_side_call_state_bit_for_bit(name: str) -> None:
    """A read's side call over rows of one start ending at different tokens runs them in place with each row's
    later tokens made no-ops (beta 0, decay 0: `mixer.reads._masked`): each row's state equals, bit for bit,
    `final_state` over its prefix followed by zeros (the layout it replaced), and the kernel over the prefix alone
    within float32 rounding; one chunk and two, a given start state."""
    fam = getattr(families, name)
    kernel = kernels.backend(fam, fam.chunk_kernel).reference  # transformers' torch function itself
    gen = torch.Generator().manual_seed(7)
    b, s, h, dk, dv = 4, 120, 4, 16, 8
    q, k = (torch.randn(b, s, h, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, s, h, dv, generator=gen)
    g, beta = -torch.rand(b, s, h, generator=gen), torch.rand(b, s, h, generator=gen)
    start = torch.randn(b, h, dk, dv, generator=gen) * 0.1
    ends = torch.tensor([70, 100, 120, 66])
    after = torch.arange(s)[None, :] >= ends[:, None]
    got = deltarule.final_state(fam, q, k, v, g.masked_fill(after[..., None], 0), beta.masked_fill(after[..., None], 0),
                                start, True)
    zeros = [x.masked_fill(after.view(b, s, *[1] * (x.dim() - 2)), 0) for x in (q, k, v, g, beta)]
    assert torch.equal(got, deltarule.final_state(fam, *zeros, start, True)), name
    for r, e in enumerate(ends.tolist()):
        alone = kernel(q[r:r + 1, :e], k[r:r + 1, :e], v[r:r + 1, :e], g=g[r:r + 1, :e], beta=beta[r:r + 1, :e],
                       initial_state=start[r:r + 1], output_final_state=True, use_qk_l2norm_in_kernel=True)[1]
        torch.testing.assert_close(got[r], alone[0], rtol=1e-5, atol=1e-6)
