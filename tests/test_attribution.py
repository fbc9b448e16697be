"""Attribution over the memory: gradients against transformers, estimates against exact patches.

Ground truth is plain transformers (`tests/reference.py`): its cache holds the true state and
convolution window after any prefix, and a write there is the exact patch. The gradients of
`deltalang.runtime.gradients` (the adjoint scan over the delta rule, the window's taps) must match central
finite differences of patches made that way, for every family (Kimi's decay per key channel,
OLMo-Hybrid's betas in (0, 2)); `run_sweep(method="attribution")` estimates must match exact
small patches (where first order is exact to O(h^2)); its refined cells must equal the exact
patch's effect; what it cannot estimate is a one-line DeltaSweepError.
"""

from __future__ import annotations

import contextlib
import csv
import io
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import deltalang
from deltalang.language.ast import format_program
from deltalang.models import families
from deltalang.models.testing import FAMILY_NAMES, load_hf, tiny_checkpoint
from deltalang.runtime import gradients
from deltalang.runtime.model import decoder_layers
from deltalang.sweep import DeltaSweepError, attribution, paths
from deltalang.sweep.attribution import path_start, target_of
from deltalang.sweep.job import measure_label
from deltalang.sweep.recompute import capture_clean, prefix_reads

sys.path.insert(0, str(Path(__file__).parent))
from reference import Reference, Write, set_to  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

A, B = 5, 7  # M = logit(A) - logit(B) at the last position


def _m(record) -> float:
    lg = record.steps[0].logits[-1][0, -1].float()
    return float(lg[A] - lg[B])


def _hf(family: str) -> torch.nn.Module:
    return load_hf(tiny_checkpoint(family)).eval()


def _recorded(family: str, seed: int) -> tuple[Reference, families.Family, torch.Tensor, gradients.Recording]:
    """A random 12-token prompt's forward of the family's tiny checkpoint, every DeltaNet block recorded (with a
    graph), and plain transformers on a copy of the model."""
    torch.manual_seed(seed)
    hf, ref = _hf(family), Reference(_hf(family))
    fam = families.for_config(hf.config)
    ids = torch.randint(3, 250, (1, 12))
    rec = gradients.record(hf, fam, ref.linear, lambda i: getattr(decoder_layers(hf)[i], fam.mixer_attr),
                           lambda: hf(ids, use_cache=False).logits)
    return ref, fam, ids, rec


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gradients_equal_finite_differences_of_exact_patches(family: str) -> None:
    ref, fam, ids, rec = _recorded(family, 1)
    rec.backward(rec.result[0, -1, A] - rec.result[0, -1, B])
    base = ref.run(ids)
    checked = 0
    for layer in (ref.linear[0], ref.linear[-1]):
        lam = gradients.state_gradients(fam, rec.blocks[layer])
        win = gradients.window_gradients(rec.blocks[layer])
        # the recorded windows are the cache's (the values the gradients are taken at)
        want = torch.stack([w[0] for w in base.steps[0].conv[layer]])
        torch.testing.assert_close(gradients.windows(rec.blocks[layer])[0], want.float(), atol=1e-5, rtol=1e-4)
        for t in (3, 9):
            for value, grad, here in (("state_after", lam, base.steps[0].states[layer][t]),
                                      ("conv_window_after", win, base.steps[0].conv[layer][t])):
                u = torch.randn_like(here.float())
                h = 2e-2 * float(here.float().norm() / u.norm())

                def at(x: float) -> float:
                    return _m(ref.run(ids, [Write(layer, value, set_to((here + x * u).to(here.dtype)), position=t)]))

                # central differences with Richardson's step (error O(h^4)), float32 noise / h aside
                fd = (8 * (at(h) - at(-h)) - (at(2 * h) - at(-2 * h))) / (12 * h)
                got = float((grad[0, t] * u[0]).sum())
                bound = float(grad[0, t].norm() * u[0].norm())  # the largest a directional derivative can be
                assert abs(got - fd) <= 0.05 * abs(fd) + 0.01 * bound, (layer, t, value, got, fd, bound)
                checked += abs(fd) > 1e-2
    assert checked >= 4  # the directional derivatives compared are not all ~0


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_states_at_a_few_tokens_are_the_caches(family: str) -> None:
    """`gradients.states_at`, each state continuing from the one before, is the state transformers' cache
    holds after that token."""
    ref, fam, ids, rec = _recorded(family, 2)
    base = ref.run(ids)
    for layer in ref.linear:
        got = gradients.states_at(fam, rec.blocks[layer], [9, 2, 5, 11])
        assert sorted(got) == [2, 5, 9, 11]
        for t, state in got.items():
            torch.testing.assert_close(state, base.steps[0].states[layer][t].float(), atol=1e-5, rtol=1e-4)


def test_state_gradients_are_the_scan_state_dots_sums() -> None:
    hf = _hf("kimi_linear")
    fam = families.for_config(hf.config)
    layers = [i for i, t in enumerate(hf.config.layer_types) if t == "linear_attention"]
    ids = torch.randint(3, 250, (1, 10))
    rec = gradients.record(hf, fam, layers, lambda i: getattr(decoder_layers(hf)[i], fam.mixer_attr),
                           lambda: hf(ids, use_cache=False).logits)
    rec.backward(rec.result[0, -1].float().logsumexp(-1))
    blk = rec.blocks[layers[0]]
    lam = gradients.state_gradients(fam, blk)
    delta = torch.randn_like(lam)
    dots = gradients.state_dots(fam, blk, lambda t: delta[:, t])
    torch.testing.assert_close(dots, (lam * delta).flatten(2).sum(-1))


# -- the sweep method ------------------------------------------------------------------------------

CLEAN = "The Eiffel Tower is in"
OTHER = "My favourite food is a"  # the same byte length
PREFIXED = "The Eiffel Hotel is in"  # the same length, the clean prompt's first 11 tokens


def _program(body: str, measure: str = 'logit_diff("P", "a")', axes: str = "L in L[linear], t in 14..22",
             other: str = OTHER) -> str:
    return (f'prompt clean = "{CLEAN}"\nprompt other = "{other}"\n'
            f"sweep s on clean over {axes} {{\n    {body}\n    measure {measure}\n}}\n")


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model(tiny_checkpoint("qwen3_5"))


def _exact(model: deltalang.DeltaModel, writes: list[Write]) -> float:
    ref = Reference(load_hf(tiny_checkpoint("qwen3_5")).eval())
    ids = torch.tensor([model.spec.token_ids(CLEAN)])
    a, b = model.spec.token_ids("P")[0], model.spec.token_ids("a")[0]

    def m(r) -> float:
        lg = r.steps[0].logits[-1][0, -1].float()
        return float(lg[a] - lg[b])

    return m(ref.run(ids, writes)) - m(ref.run(ids))


@pytest.mark.parametrize("value", ["state_after", "conv_window_after"])
def test_plain_estimates_equal_small_exact_patches(model: deltalang.DeltaModel, value: str) -> None:
    factor = 1.02  # a small write: first order is exact to O(0.02^2)
    got = deltalang.run_sweep(_program(f"write L.{value}(t) *= {factor}"), model, method="attribution")
    assert got.variants == ["plain", "blk4"] and got.default == "blk4"  # a scale has a path: outputs x factor
    grid = got.grid(variant="plain")
    path = got.grid()
    assert len(grid) == len(model.spec.linear_layers()) * 8
    top = sorted(grid, key=lambda c: -abs(grid[c]))[:3]
    for layer, t in top:
        exact = _exact(model, [Write(layer, value, lambda x, i: x * factor, position=t)])
        assert abs(grid[(layer, t)] - exact) <= 0.05 * abs(exact) + 1e-5, (layer, t, grid[(layer, t)], exact)
        assert abs(path[(layer, t)] - exact) <= 0.1 * abs(exact) + 1e-5, (layer, t, path[(layer, t)], exact)
        assert abs(exact) > 1e-4


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_the_path_rule_integrates_polynomials_of_degree_2k(k: int) -> None:
    """The clean end and k points integrate a^d over [0, 1] exactly up to d = 2k, and not d = 2k + 1; k
    midpoints (no clean end) up to d = 1."""
    mid, even, none = paths.path_rule(k, clean_end=False)
    assert none == 0 and sum(even) == pytest.approx(1) and sum(w * a for a, w in zip(mid, even)) == pytest.approx(0.5)
    points, weights, clean = paths.path_rule(k, clean_end=True)
    assert len(points) == len(weights) == k and all(0 < a < 1 for a in points)

    def integral(d: int) -> float:
        return clean * (1.0 if d == 0 else 0.0) + sum(w * a**d for a, w in zip(points, weights))
    for d in range(2 * k + 1):
        assert integral(d) == pytest.approx(1 / (d + 1), abs=1e-13), d
    assert abs(integral(2 * k + 1) - 1 / (2 * k + 2)) > 1e-11


def test_the_default_points_follow_the_source(model: deltalang.DeltaModel) -> None:
    """k = 2 for a donor's value, 4 for zeros (a longer path: docs/attribution.md's quality table)."""
    donor = deltalang.run_sweep(_program("write L.state_after(t) from other"), model, method="attribution")
    zeros = deltalang.run_sweep(_program("write L.state_after(t) = zeros"), model, method="attribution")
    assert (donor.default, zeros.default) == ("blk2", "blk4")


def test_refined_cells_are_the_exact_patches(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    src = _program("write L.state_after(t) from other; write L.conv_window_after(t) from other")
    got = deltalang.run_sweep(src, model, method="attribution", steps=2, refine=3, out=tmp_path)
    assert got.variants == ["plain", "blk2"] and got.default == "blk2"
    refined = got.refined()
    assert len(refined) == 3
    ref = Reference(load_hf(tiny_checkpoint("qwen3_5")).eval())
    donor = ref.run(torch.tensor([model.spec.token_ids(OTHER)]))
    for r in refined:
        state = donor.steps[0].states[r.block][r.position]
        window = donor.steps[0].conv[r.block][r.position]
        exact = _exact(model, [Write(r.block, "state_after", set_to(state), position=r.position),
                               Write(r.block, "conv_window_after", set_to(window), position=r.position)])
        assert r.exact == pytest.approx(exact, abs=1e-4)
    # they are the cells of largest |default estimate|
    others = [abs(r.estimates["blk2"]) for r in got.rows if r.exact is None]
    assert min(abs(r.estimates["blk2"]) for r in refined) >= max(others)
    rows = list(csv.DictReader((tmp_path / "attribution.csv").open()))
    assert len(rows) == len(got.rows)
    assert set(rows[0]) == {"block", "position", "token", "measure", "estimate_plain", "estimate_blk2", "exact"}
    assert sum(1 for x in rows if x["exact"]) == 3
    assert "exact" in got.table() and "blk2" in got.table()


def test_the_paths_integrate_towards_the_donor(model: deltalang.DeltaModel) -> None:
    src = _program("write L.state_after(t) from other")
    plain = deltalang.run_sweep(src, model, method="attribution", steps=0)
    for path in ("blocks", "outputs", "embeddings"):
        got = deltalang.run_sweep(src, model, method="attribution", steps=3, path=path)
        name = {"blocks": "blk3", "outputs": "out3", "embeddings": "emb3"}[path]
        assert got.variants == ["plain", name]
        # the plain column is the same estimate whatever the path; the integrated one differs from it
        assert got.grid(variant="plain") == pytest.approx(plain.grid())
        assert got.grid() != pytest.approx(plain.grid(), rel=1e-3)


def test_on_a_cpu_blocks_share_a_pass_up_to_512_tokens(model: deltalang.DeltaModel) -> None:
    """k rows a block of `positions` tokens each: as many consecutive blocks a pass as 512 tokens hold."""
    blocks = [0, 1, 2, 4, 5, 6]
    assert paths.path_groups(model, blocks, 1, 128) == [[0, 1, 2, 4], [5, 6]]
    assert paths.path_groups(model, blocks, 2, 64) == [[0, 1, 2, 4], [5, 6]]
    assert paths.path_groups(model, blocks, 4, 64) == [[0, 1], [2, 4], [5, 6]]
    assert paths.path_groups(model, blocks, 2, 512) == paths.path_groups(model, blocks, 8, 100) == [[b] for b in blocks]


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize(("shared", "other"), [(False, OTHER), (True, OTHER), (False, PREFIXED), (True, PREFIXED)])
def test_block_paths_from_their_block_equal_whole_model_passes(family: str, shared: bool, other: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block's path run from that block on (the clean stream below it, several blocks' rows in one pass)
    gives the gradients of a whole-model forward with that block's output alone shifted; with a donor that
    begins as the clean prompt, from the first position they differ (zeros before it)."""
    model = deltalang.load_model(tiny_checkpoint(family))
    blocks = model.spec.linear_layers()
    src = _program("write L.state_after(t) from other", axes="L in L[linear], t in 0..4", other=other)
    target = target_of(deltalang.compile(src, model))
    start = path_start(model, target)
    assert start == (0 if other == OTHER else 11)
    plain, cap = paths.plain_runs(model, blocks, CLEAN, target.measures, min(blocks))
    clean = plain[measure_label(target.measures[0])]
    donor = paths.record_forward(model, blocks, ids=paths.ids_of(model, other))
    ends = paths.PathEnds(CLEAN, clean, donor, other, None, start)
    steps, m = 3, target.measures[0]
    cap = paths.with_prefix(model, cap, clean, start)  # the clean prefix's states and windows, from the recording
    with paths.frozen_weights(model), torch.no_grad():  # the same as the engine's capture of them
        engine = capture_clean(model, CLEAN, min(blocks), prefix_reads(model, min(blocks), start))
    assert set(cap.values) == set(engine.values) and set(cap.inputs) == set(engine.inputs)
    for key, x in engine.values.items():
        torch.testing.assert_close(cap.values[key], x, atol=1e-5, rtol=1e-4)
    for i, x in engine.inputs.items():
        torch.testing.assert_close(cap.inputs[i], x)
    assert set(cap.kv) == set(engine.kv)
    for i, (keys, vals) in engine.kv.items():
        torch.testing.assert_close(cap.kv[i][0], keys)
        torch.testing.assert_close(cap.kv[i][1], vals)
    if shared:  # every block's rows in one pass (what a GPU's memory budget allows)
        monkeypatch.setattr(paths, "path_groups", lambda model, blocks, steps, positions: [sorted(blocks)])
    with paths.frozen_weights(model):
        got = paths.block_paths(model, cap, blocks, m, steps, ends)
        x0 = model._module.get_input_embeddings()(paths.ids_of(model, CLEAN)).detach()
        a = torch.tensor(paths.path_rule(steps, ends.clean_end)[0], dtype=torch.float32)
        for b in blocks:
            whole = paths.record_forward(model, [b], embeds=x0.expand(steps, -1, -1).clone().requires_grad_(True),
                                         measure=m, shifts={b: a[:, None, None, None] * ends.shift(b)})
            mine, want = got[b][0].blocks[b], whole.blocks[b]
            assert want.grad_out.abs().max() > 1e-4  # the measure depends on the block
            assert mine.grad_out.shape == want.grad_out.shape and mine.grad_conv.shape == want.grad_conv.shape
            assert not mine.grad_out[:, :start].any() and not mine.grad_conv[..., :start].any()
            for x, y in ((mine.grad_out[:, start:], want.grad_out[:, start:]),
                         (mine.grad_conv[..., start:], want.grad_conv[..., start:]),
                         (got[b][0].result[:, -1], whole.result[:, -1])):
                assert x.shape == y.shape
                assert float((x - y).abs().max()) <= 3e-4 * float(y.abs().max()), (b, float((x - y).abs().max()))


def test_a_donor_that_begins_as_the_clean_prompt_moves_the_paths_from_where_they_differ(
        model: deltalang.DeltaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The paths' passes run from the first differing position: the gradients they leave zero before it
    change no estimate (every cell before it writes the clean value back; the window's taps and the adjoint
    scan read later outputs only)."""
    src = _program("write L.state_after(t) from other; write L.conv_window_after(t) from other",
                   axes="L in L[linear], t in 0..22", other=PREFIXED)
    assert path_start(model, target_of(deltalang.compile(src, model))) == 11
    got = deltalang.run_sweep(src, model, method="attribution", steps=2)
    monkeypatch.setattr(attribution, "path_start", lambda model, target: 0)
    whole = deltalang.run_sweep(src, model, method="attribution", steps=2)
    late = {c: v for c, v in whole.grid().items() if c[1] >= 11}
    assert all(v == 0 for c, v in got.grid().items() if c[1] < 11)
    assert max(abs(v) for v in late.values()) > 1e-2
    for c, v in late.items():
        assert got.grid()[c] == pytest.approx(v, rel=1e-4, abs=1e-5 * max(abs(x) for x in late.values())), c
    # a cell writing another position's value may differ from the clean one before the prompts do
    moved = _program("write L.state_after(t) from other.state_after(2)", axes="L in L[linear], t in 4..22",
                     other=PREFIXED)
    assert path_start(model, target_of(deltalang.compile(moved, model))) == 4


@pytest.mark.parametrize(("src", "kw", "message"), [
    (_program("write L.state_after(t) = zeros", measure="kl(other)"), {}, "differentiates"),
    (_program("write L.state_after(t) = zeros"), {"steps": 4, "path": "embeddings"}, "integrates along a path"),
    (_program("write L.state_after(t) = zeros; write L.conv_window_after(t) from other"), {"steps": 4},
     "integrates along a path"),
    (_program("write L.state_after(t) = zeros; write L.attention_output = zeros"), {}, "estimates writes of"),
    (_program("read L.state_after(t)"), {}, "writes only"),
    (_program("write L.state_after(t) from other").replace(OTHER, OTHER + " and more"), {"steps": 2},
     "the clean prompt's length"),
    (_program("write L.state_after(t) from other"), {"path": "straight"}, "path is one of"),
])
def test_what_attribution_cannot_estimate_is_one_line(model: deltalang.DeltaModel, src: str, kw: dict,
                                                      message: str) -> None:
    with pytest.raises(DeltaSweepError) as e:
        deltalang.run_sweep(src, model, method="attribution", **kw)
    assert message in str(e.value) and "\n" not in str(e.value)


# -- the method in the language ----------------------------------------------------------------------

def _declared(method: str, body: str = "write L.state_after(t) from other") -> str:
    return _program(body).replace("t in 14..22 {", f"t in 14..22 {method} {{")


def test_the_sweeps_method_is_honoured_and_prints_back(model: deltalang.DeltaModel, tmp_path: Path) -> None:
    src = _declared("method attribution steps 2 refine 3")
    prog = deltalang.parse(src)
    assert deltalang.parse(format_program(prog)) == prog
    assert "method attribution steps 2 refine 3 {" in format_program(prog)
    got = deltalang.run_sweep(src, model)
    want = deltalang.run_sweep(_program("write L.state_after(t) from other"), model, method="attribution", steps=2,
                               refine=3)
    assert got.variants == want.variants == ["plain", "blk2"]
    assert got.grid() == pytest.approx(want.grid(), rel=1e-5, abs=1e-7)
    assert [(r.block, r.position) for r in got.refined()] == [(r.block, r.position) for r in want.refined()]
    assert [r.exact for r in got.refined()] == pytest.approx([r.exact for r in want.refined()], abs=1e-6)
    # arguments replace the program's options
    plain = deltalang.run_sweep(src, model, steps=0, refine=0)
    assert plain.variants == ["plain"] and not plain.refined()
    assert plain.grid() == pytest.approx(want.grid(variant="plain"), rel=1e-5, abs=1e-7)
    # the command line: the program's method, flags over it
    from deltalang.cli import main

    f = tmp_path / "attr.dl"
    f.write_text(src)
    for flags, columns in (([], "blk2"), (["--steps", "1", "--refine", "1"], "blk1")):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            assert main(["sweep", str(f), "--model", str(tiny_checkpoint("qwen3_5")), *flags]) == 0
        head = buf.getvalue().splitlines()[1].split()
        assert head == ["block", "pos", "token", "measure", "plain", columns, "exact"]


@pytest.mark.parametrize(("src", "kw", "message"), [
    (_declared("method attribution"), {"method": "exact"}, "contradicts"),
    (_declared("method attribution") + _program("write L.state_after(t) = zeros").split("\n", 2)[2]
     .replace("sweep s ", "sweep s2 "), {}, "put the others in another file"),
    (_program("write L.state_after(t) from other"), {"steps": 2}, "options of method attribution"),
])
def test_method_conflicts_are_one_line(model: deltalang.DeltaModel, src: str, kw: dict, message: str) -> None:
    with pytest.raises(DeltaSweepError) as e:
        deltalang.run_sweep(src, model, **kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_exact_engine_refuses_a_sweep_that_says_attribution(model: deltalang.DeltaModel) -> None:
    with pytest.raises(deltalang.DeltaError) as e:
        deltalang.run(_declared("method attribution"), model)
    assert "says method attribution" in str(e.value) and "\n" not in str(e.value)
