"""Attribution on Mamba-2 (SSD) hybrids, against plain transformers on tiny checkpoints.

Ground truth is transformers itself. dM/dS_t: one plain forward in which one block's scan is transformers'
own scan run to token t, its state after t swapped for a leaf tensor of the same value (token t's output read
from it, y_t = S C_t + D x_t, as a state written into the cache after t is read by token t), the rest
of the prompt continued from it by the same scan; autograd gives the leaf's gradient. dM/dW_t: the cache of
tokens 0..t, its convolution state's last width-1 columns made a leaf, the rest of the prompt continued from
that cache. An exact patch: tokens 0..t-1, then token t as a one-token step whose state is replaced (token t
reads it), then the rest from that cache. Nothing is compared with deltalang's own output.
"""

from __future__ import annotations

import csv
import functools
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from reference import cache_after, hf_forward, kernel_global, mixer_running

import deltalang
from deltalang.models import families, internals, testing_ssd
from deltalang.runtime import gradients
from deltalang.sweep import paths
from deltalang.sweep.attribution import target_of
from deltalang.sweep.job import measure_label

pytestmark = pytest.mark.usefixtures("one_thread")

SERVED = ("bamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "mamba2", "zamba2")
A, B = 5, 7  # M = logit(A) - logit(B) at the last position
PROMPT_LEN = 13  # crosses the tiny configs' chunk of 8


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    scale = float(want.abs().max())
    err = float((got.float() - want.float()).abs().max())
    assert scale > 0 and err <= tol * scale, f"max |diff| {err:.3g} > {tol:g} * {scale:.3g}"


@functools.lru_cache(maxsize=None)
def _hf(name: str) -> Any:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(testing_ssd.tiny_ssd_checkpoint(name)).eval()
    for p in hf.parameters():
        p.requires_grad_(False)
    return hf


def _ids(n: int = PROMPT_LEN, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 259, (1, n), generator=torch.Generator().manual_seed(seed))


def _m(logits: torch.Tensor, a: int = A, b: int = B) -> torch.Tensor:
    return logits[0, -1, a].float() - logits[0, -1, b].float()


_forward = functools.partial(hf_forward, no_grad=False)  # under the caller's grad mode: autograd goes through it


def _read(leaf: torch.Tensor, x_t: torch.Tensor, C_t: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor:
    """y_t = S C_t + D x_t per head (C's groups repeated over the heads, as transformers' scan does)."""
    Ch = C_t.float().repeat_interleave(leaf.shape[1] // C_t.shape[1], dim=1)
    y = (leaf @ Ch[..., None])[..., 0]
    return y if D is None else y + D.float()[:, None] * x_t.float()


def _state_leaf_grad(name: str, hf: Any, ids: torch.Tensor, layer: int, t: int, a: int = A, b: int = B
                     ) -> torch.Tensor:
    """dM/dS_t of `layer` by autograd through transformers' own scan, cut after t at a leaf (module doc)."""
    leaves: list[torch.Tensor] = []

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def scan(x: torch.Tensor, dt: torch.Tensor, A_: torch.Tensor, B_: torch.Tensor, C_: torch.Tensor,
                 chunk_size: int, **kw: Any) -> Any:
            if current[0] != layer:
                return original(x, dt, A_, B_, C_, chunk_size, **kw)
            want_final = kw.pop("return_final_states", False)
            init = kw.pop("initial_states", None)
            head = slice(0, t + 1)
            y0, state = original(x[:, head], dt[:, head], A_, B_[:, head], C_[:, head], chunk_size,
                                 initial_states=init, return_final_states=True, **kw)
            leaf = state.detach().clone().requires_grad_(True)
            leaves.append(leaf)
            parts = [y0[:, :t], _read(leaf, x[:, t], C_[:, t], kw.get("D"))[:, None].to(y0.dtype)]
            final = leaf
            if t + 1 < x.shape[1]:
                rest = slice(t + 1, None)
                y1, final = original(x[:, rest], dt[:, rest], A_, B_[:, rest], C_[:, rest], chunk_size,
                                     initial_states=leaf, return_final_states=True, **kw)
                parts.append(y1)
            y = torch.cat(parts, dim=1)
            return (y, final) if want_final else y
        return scan

    with mixer_running(hf) as current, kernel_global(name, internals.SCAN_GLOBAL, make), torch.enable_grad():
        m = _m(hf(ids, use_cache=False).logits, a, b)
    assert len(leaves) == 1
    with torch.no_grad():  # the cut scan is the plain forward's
        torch.testing.assert_close(m.detach(), _m(hf(ids, use_cache=False).logits, a, b), atol=1e-4, rtol=1e-4)
    return torch.autograd.grad(m, leaves[0])[0]


def _window_leaf_grad(hf: Any, ids: torch.Tensor, layer: int, t: int) -> torch.Tensor:
    """dM/dW_t of `layer` (the window after t) by autograd through transformers continuing from its cache
    (two tokens or more: a one-token step updates its state in place, which autograd refuses)."""
    assert t + 2 < ids.shape[1]
    with torch.no_grad():
        cache = internals.output_cache(_forward(hf, ids[:, :t + 1]))
    held = cache.layers[layer]
    conv = held.conv_states[0]
    leaf = conv[..., 1:].clone().requires_grad_(True)
    held.conv_states[0] = torch.cat([conv[..., :1], leaf], dim=-1)  # the first column is never read on
    with torch.enable_grad():
        m = _m(_forward(hf, ids[:, t + 1:], cache, start=t + 1).logits)
    return torch.autograd.grad(m, leaf)[0]


def _window_cut_grad(name: str, hf: Any, ids: torch.Tensor, layer: int, t: int) -> torch.Tensor:
    """dM/dW_t by autograd through one plain forward whose `layer` convolution (transformers' own) runs on
    tokens 0..t, then on the window after t (a leaf) followed by tokens t+1.., as a continuation's does."""
    leaves: list[torch.Tensor] = []

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **kw: Any) -> Any:
            if current[0] != layer:
                return original(x, weight, bias, **kw)
            w = weight.shape[-1]
            leaf = torch.nn.functional.pad(x[..., :t + 1], (w - 1, 0))[..., -(w - 1):].clone().requires_grad_(True)
            leaves.append(leaf)
            tail = original(torch.cat([leaf, x[..., t + 1:]], dim=-1), weight, bias, **kw)[..., w - 1:]
            return torch.cat([original(x[..., :t + 1], weight, bias, **kw), tail], dim=-1)
        return conv

    with mixer_running(hf) as current, kernel_global(name, "causal_conv1d_fn", make), torch.enable_grad():
        m = _m(hf(ids, use_cache=False).logits)
    assert len(leaves) == 1
    return torch.autograd.grad(m, leaves[0])[0]


def _recorded(name: str, ids: torch.Tensor, cache: bool = False
              ) -> tuple[families.Family, gradients.Recording, list[int]]:
    """Every Mamba-2 block of a plain forward recorded, M's gradients taken (with `cache`, a fresh cache filled:
    the scan returns its final state, a prompt shorter than the convolution is padded in front)."""
    hf = _hf(name)
    fam = families.for_config(hf.config)
    mixers = dict(testing_ssd.ssd_mixers(hf))
    embeds = hf.get_input_embeddings()(ids).detach().requires_grad_(True)  # the weights take no gradient
    with torch.enable_grad():
        rec = gradients.record(hf, fam, sorted(mixers), mixers.__getitem__,
                               lambda: hf(inputs_embeds=embeds, use_cache=cache).logits)
        rec.backward(_m(rec.result))
    return fam, rec, sorted(mixers)


# -- the gradients ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SERVED)
def test_state_gradients_are_autograd_through_transformers_scan(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """dM/dS_t at every token of every Mamba-2 block (in one chunk, and in chunks of 5: carried across them)."""
    ids = _ids()
    fam, rec, layers = _recorded(name, ids)
    want = {(i, t): _state_leaf_grad(name, _hf(name), ids, i, t) for i in layers for t in range(PROMPT_LEN)}
    for chunk in (gradients.ADJOINT_CHUNK, 5):
        monkeypatch.setattr(gradients, "ADJOINT_CHUNK", chunk)
        for i in layers:
            got = gradients.state_gradients(fam, rec.blocks[i])
            assert got.shape == (1, PROMPT_LEN, *want[i, 0].shape[1:])
            for t in range(PROMPT_LEN):
                _close(got[:, t], want[i, t])
            # the dots the estimates take, at a few tokens only, are the same gradients'
            delta = torch.randn_like(got)
            dots = gradients.state_dots(fam, rec.blocks[i], lambda t: delta[:, t], at=[2, 11])
            full = (got * delta).flatten(2).sum(-1)
            torch.testing.assert_close(dots[:, [2, 11]], full[:, [2, 11]], atol=1e-5, rtol=1e-4)
            assert not dots[:, [0, 5, 12]].any()
    assert float(want[layers[0], 0].abs().max()) > 1e-3  # the first token's state reaches the measure


@pytest.mark.parametrize("name", SERVED)
def test_window_gradients_are_autograd_through_transformers_cache(name: str) -> None:
    ids = _ids(seed=1)
    _, rec, layers = _recorded(name, ids)
    for i in layers:
        got = gradients.window_gradients(rec.blocks[i])
        assert got.shape[:2] == (1, PROMPT_LEN)
        for t in range(PROMPT_LEN - 1):  # the window after the last token reaches no output
            _close(got[:, t], _window_cut_grad(name, _hf(name), ids, i, t))
            if t + 2 < PROMPT_LEN:
                _close(got[:, t], _window_leaf_grad(_hf(name), ids, i, t))
        assert not got[:, -1].any()


@pytest.mark.parametrize("name", SERVED)
def test_the_recorded_states_and_windows_are_the_caches(name: str) -> None:
    """The values a patch's difference is taken from (`states`, `states_at`, `windows`), on a prompt shorter
    than the convolution (the cache pads the convolution's input) and a longer one."""
    for n, cache in ((3, False), (3, True), (PROMPT_LEN, True)):
        ids = _ids(n, seed=2)
        fam, rec, layers = _recorded(name, ids, cache)
        for i in layers:
            blk = rec.blocks[i]
            if cache and n == 3:  # the window's gradients skip the cache's padding too
                assert blk.conv_x is not None and blk.conv_x.shape[-1] > n
                grads = gradients.window_gradients(blk)
                assert grads.shape[1] == n
                for t in range(n - 1):
                    _close(grads[:, t], _window_cut_grad(name, _hf(name), ids, i, t))
            every, some, wins = gradients.states(fam, blk), gradients.states_at(fam, blk, [n - 1, 1]), \
                gradients.windows(blk)
            for t in range(n):
                with torch.no_grad():
                    held = internals.output_cache(_forward(_hf(name), ids[:, :t + 1]))
                _close(every[:, t], held.get_recurrent_state(i), 1e-5)
                if t in some:
                    _close(some[t], held.get_recurrent_state(i), 1e-5)
                # zamba2's prefix forward moves its windows by ~1e-6 relative (its shared attention block)
                _close(wins[:, t], held.get_conv_state(i)[..., 1:], 1e-5 if name == "zamba2" else 1e-6)


# -- the sweep method ------------------------------------------------------------------------------------

CLEAN = "The Eiffel Tower is in"
OTHER = "My favourite food is a"  # the same number of (byte) tokens


def _program(body: str, axes: str = "L in L[ssm], t in 1..22", method: str = "") -> str:
    return (f'prompt clean = "{CLEAN}"\nprompt other = "{OTHER}"\n'
            f'sweep s on clean over {axes}{method} {{\n    {body}\n    measure logit_diff("P", "a")\n}}\n')


@functools.lru_cache(maxsize=None)
def _model(name: str) -> deltalang.DeltaModel:
    return deltalang.load_model(testing_ssd.tiny_ssd_checkpoint(name))


def _tokens(name: str, text: str) -> torch.Tensor:
    return torch.tensor([_model(name).spec.token_ids(text)])


def _answers(name: str) -> tuple[int, int]:
    spec = _model(name).spec
    return spec.token_ids("P")[0], spec.token_ids("a")[0]


def _patched_m(name: str, ids: torch.Tensor, layer: int, t: int, state: torch.Tensor | None = None,
               window: torch.Tensor | None = None) -> float:
    """M with `layer`'s state after t (token t reads it) or its window after t written into transformers'
    cache (the module doc); t >= 1 for a state. Neither: the clean M."""
    return _patched_ab(name, ids, layer, t, state, *_answers(name), window)


def _patched_ab(name: str, ids: torch.Tensor, layer: int, t: int, state: torch.Tensor | None, a: int, b: int,
                window: torch.Tensor | None = None) -> float:
    """`_patched_m` of logit(a) - logit(b)."""
    hf = _hf(name)
    pending: list[torch.Tensor | None] = [state]  # token t's step only (a one-token rest is a step too)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def step(held: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A_: torch.Tensor, B_: torch.Tensor,
                 C_: torch.Tensor, D: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
            out = original(held, x, dt, A_, B_, C_, D, **kw)
            if current[0] != layer or pending[0] is None:
                return out
            new = pending.pop()
            pending.append(None)
            held.copy_(new.to(held.dtype))
            y = _read(new.float(), x, C_, None)
            y = y if D is None else y + D.float() * x.float()  # D [h, P] as the mixer passes a step
            return y.to(out.dtype)
        return step

    with torch.no_grad(), mixer_running(hf) as current, kernel_global(name, internals.STEP_GLOBAL, make):
        if state is not None:  # tokens 0..t-1, then token t a step whose state is replaced
            assert t >= 1
            cache = internals.output_cache(_forward(hf, ids[:, :t]))
            out = _forward(hf, ids[:, t:t + 1], cache, start=t)
        else:
            out = _forward(hf, ids[:, :t + 1])
        cache = internals.output_cache(out)
        if window is not None:
            conv = cache.layers[layer].conv_states[0]
            conv[..., 1:] = window.to(conv.dtype)
        if t + 1 < ids.shape[1]:
            out = _forward(hf, ids[:, t + 1:], cache, start=t + 1)
    assert pending == [None] or state is None
    return float(_m(out.logits, a, b))


def _cache_after(name: str, ids: torch.Tensor, t: int) -> Any:
    return cache_after(_hf(name), ids, t)


@pytest.mark.parametrize("name", ["bamba", "granitemoehybrid"])
def test_refined_cells_are_transformers_exact_patches(name: str, tmp_path: Path) -> None:
    """`refine` runs the cells of largest |default estimate| exactly; each equals transformers' cache written
    with the donor's state (token t reading it), M(patched) - M(clean)."""
    got = deltalang.run_sweep(_program("write L.state_after(t) from other"), _model(name), method="attribution",
                              refine=4, out=tmp_path)
    assert got.variants == ["plain", "blk2"] and got.default == "blk2"
    refined = got.refined()
    assert len(refined) == 4 and len(got.rows) == len(_model(name).spec.ssm_layers()) * 21
    others = [abs(r.estimates["blk2"]) for r in got.rows if r.exact is None]
    assert min(abs(r.estimates["blk2"]) for r in refined) >= max(others)
    ids, donor = _tokens(name, CLEAN), _tokens(name, OTHER)
    clean = _patched_m(name, ids, 0, ids.shape[1] - 1)
    assert got.rows and all(got.grid().values())
    for r in refined:
        new = _cache_after(name, donor, r.position).get_recurrent_state(r.block)
        exact = _patched_m(name, ids, r.block, r.position, state=new) - clean
        assert r.exact == pytest.approx(exact, abs=2e-5 + 1e-3 * abs(exact)), (r.block, r.position)
    assert max(abs(r.exact) for r in refined) > 1e-3  # the refined effects are not all ~0
    assert (tmp_path / "attribution.csv").exists()


@pytest.mark.parametrize(("name", "value"), [("bamba", "state_after"), ("granitemoehybrid", "state_after"),
                                             ("bamba", "conv_window_after"),
                                             ("granitemoehybrid", "conv_window_after")])
def test_estimates_of_a_small_patch_are_its_exact_change(name: str, value: str) -> None:
    """A small write (x 1.02): the plain estimate is the first-order change, which transformers' central difference
    (M(x 1.02) - M(x 0.98)) / 2 gives to O(0.02^3) (the one-sided change differs from it by the second-order term,
    6% at some cells: measured 3.94e-5 against 3.72e-5 one-sided, 3.91e-5 central); the path to 1.02 x the block's
    output is short, so the path estimate is the one-sided change itself."""
    factor = 1.02
    got = deltalang.run_sweep(_program(f"write L.{value}(t) *= {factor}", axes="L in L[ssm], t in 1..21"), _model(name),
                              method="attribution")
    assert got.variants == ["plain", "blk4"]
    plain, path = got.grid(variant="plain"), got.grid()
    ids = _tokens(name, CLEAN)
    clean = _patched_m(name, ids, 0, ids.shape[1] - 1)
    for layer, t in sorted(plain, key=lambda c: -abs(plain[c]))[:4]:
        cache = _cache_after(name, ids, t)
        def change(f: float) -> float:
            if value == "state_after":
                return _patched_m(name, ids, layer, t, state=f * cache.get_recurrent_state(layer)) - clean
            return _patched_m(name, ids, layer, t, window=f * cache.get_conv_state(layer)[..., 1:]) - clean

        exact = change(factor)
        first_order = (exact - change(2 - factor)) / 2
        assert abs(exact) > 1e-5
        assert plain[(layer, t)] == pytest.approx(first_order, rel=0.05, abs=1e-6), (layer, t)
        assert path[(layer, t)] == pytest.approx(exact, rel=0.1, abs=1e-6), (layer, t)


def test_a_blocks_path_integrates_to_the_change_its_end_makes() -> None:
    """Each block's path (`whole_block_paths`): its gradients, integrated along the path (k midpoints), are
    M with that block's scan output replaced by the donor's (transformers' own scan, its output swapped) - M."""
    name, steps = "bamba", 8
    model, hf = _model(name), _hf(name)
    src = _program("write L.state_after(t) from other", axes="L in L[ssm], t in 0..22")
    target = target_of(deltalang.compile(src, model))
    blocks, m = model.spec.ssm_layers(), target.measures[0]
    plain, _ = paths.plain_runs(model, blocks, CLEAN, target.measures)
    clean = plain[measure_label(m)]
    donor = paths.record_forward(model, blocks, ids=paths.ids_of(model, OTHER))
    ends = paths.PathEnds(CLEAN, clean, donor, OTHER, None, 0)
    assert not ends.clean_end
    with paths.frozen_weights(model):
        got = paths.whole_block_paths(model, blocks, m, steps, ends)
    ids, donor_ids = _tokens(name, CLEAN), _tokens(name, OTHER)
    outs: dict[int, torch.Tensor] = {}

    def keep(original: Callable[..., Any]) -> Callable[..., Any]:
        def scan(*args: Any, **kw: Any) -> Any:
            y = original(*args, **kw)
            outs[current[0]] = y.detach()
            return y
        return scan

    def swap(layer: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def scan(*args: Any, **kw: Any) -> Any:
                y = original(*args, **kw)
                return outs[layer].to(y.dtype) if current[0] == layer else y
            return scan
        return make

    a, b = _answers(name)
    with torch.no_grad(), mixer_running(hf) as current:
        with kernel_global(name, internals.SCAN_GLOBAL, keep):
            hf(donor_ids, use_cache=False)
        base = float(_m(hf(ids, use_cache=False).logits, a, b))
        for layer in blocks:
            with kernel_global(name, internals.SCAN_GLOBAL, swap(layer)):
                want = float(_m(hf(ids, use_cache=False).logits, a, b)) - base
            rec = got[layer][0].blocks[layer]
            assert rec.grad_out is not None and rec.grad_out.shape[0] == steps
            integral = float((rec.grad_out * ends.shift(layer)).sum()) / steps
            assert abs(want) > 1e-3
            assert integral == pytest.approx(want, rel=0.02), layer


def test_every_path_runs_on_a_mamba2_model() -> None:
    model = _model("granitemoehybrid")
    src = _program("write L.state_after(t) from other; write L.conv_window_after(t) from other",
                   axes="L in L[ssm], t in 1..21")
    plain = deltalang.run_sweep(src, model, method="attribution", steps=0)
    assert plain.variants == ["plain"]
    for path, name in (("blocks", "blk2"), ("outputs", "out2"), ("embeddings", "emb2")):
        got = deltalang.run_sweep(src, model, method="attribution", steps=2, path=path)
        assert got.variants == ["plain", name]
        assert got.grid(variant="plain") == pytest.approx(plain.grid())
        assert got.grid() != pytest.approx(plain.grid(), rel=1e-3)


@pytest.mark.parametrize("name", ["bamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "mamba2", "zamba2"])
def test_the_command_line_runs_attribution_on_a_mamba2_model(name: str, tmp_path: Path) -> None:
    """`deltalang sweep --attribution` (it had stopped in a TypeError: the recorder took the scan's
    arguments for the delta rule's)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_cli import cli

    f = tmp_path / "attr.dl"
    f.write_text(_program("write L.state_after(t) from other", axes="L in L[ssm], t in 18..22"))
    rc, out, err = cli("sweep", f, "--attribution", "--refine", "2", "--model", testing_ssd.tiny_ssd_checkpoint(name),
                       "--out", tmp_path / "o")
    assert rc == 0 and "Traceback" not in err and "error" not in err, err
    head = out.splitlines()[1].split()
    assert head == ["block", "pos", "token", "measure", "plain", "blk2", "exact"]
    rows = list(csv.DictReader((tmp_path / "o" / "attribution.csv").read_text(encoding="utf-8").splitlines()))
    assert len(rows) == 4 * len(_model(name).spec.ssm_layers())
    assert sum(1 for r in rows if r["exact"]) == 2  # two cells refined


# -- over a dataset -----------------------------------------------------------------------------------------

RECORDS = [  # prompts and corrupt prompts of one length each (byte tokens), one-token answers
    {"prompt": "The Eiffel Tower is in", "corrupt": "My favourite food is a", "answer": "P", "foil": "a",
     "subject": "Eiffel Tower"},
    {"prompt": "A cat sat on the mat", "corrupt": "A dog ran in the sun", "answer": "s", "foil": "e",
     "subject": "cat"},
    {"prompt": "Paris is in France", "corrupt": "Tokyo is in Japan!", "answer": ".", "foil": "s",
     "subject": "Paris"},
]
DATASET_SWEEP = """dataset facts = "facts.jsonl"
sweep s on facts over L in L[ssm], t in facts.subject, -1 method attribution refine 2 {
    write L.state_after(t) from facts.corrupt
    measure logit_diff(facts.answer, facts.foil)
}
"""


def test_attribution_over_a_dataset_equals_transformers() -> None:
    """Each record's `plain` estimate is <dM/dS_t, S' - S> with dM/dS_t by autograd through transformers' scan
    and S' the corrupt prompt's cached state; the refined cells' exact effects are transformers' cache written
    with S' on every record; a cell's estimate is the mean of its records'."""
    from deltalang.sweep.attribution_dataset import DatasetAttribution

    name = "bamba"
    model, hf = _model(name), _hf(name)
    out = deltalang.run(DATASET_SWEEP, model, data={"facts": RECORDS})
    assert isinstance(out, DatasetAttribution) and not out.skipped
    assert out.variants == ("plain", "blk2")
    layers = model.spec.ssm_layers()
    assert out.axes == (("L", tuple(f"L{b}" for b in layers)), ("t", ("facts.subject", "-1")))
    refined = out.refined()
    assert len(refined) == 2 and all(c.exact is not None and c.exact.n == 3 for c in refined)
    runs = []
    for r in RECORDS:
        ids, corrupt = _tokens(name, r["prompt"]), _tokens(name, r["corrupt"])
        a, b = (model.spec.token_ids(r[k])[0] for k in ("answer", "foil"))
        at = {"-1": ids.shape[1] - 1, "facts.subject": r["prompt"].index(r["subject"]) + len(r["subject"]) - 1}
        runs.append((ids, corrupt, a, b, at))
    for layer in layers:
        for label in ("facts.subject", "-1"):
            got = out.values({"L": f"L{layer}", "t": label}, variant="plain")
            for k, (ids, corrupt, a, b, at) in enumerate(runs):
                t = at[label]
                with torch.no_grad():
                    here = internals.output_cache(_forward(hf, ids[:, :t + 1])).get_recurrent_state(layer)
                    there = internals.output_cache(_forward(hf, corrupt[:, :t + 1])).get_recurrent_state(layer)
                grad = _state_leaf_grad(name, hf, ids, layer, t, a, b)
                want = float((grad * (there - here)).sum())
                assert got[k] == pytest.approx(want, rel=1e-3, abs=1e-6), (layer, label, k)
    checked = 0
    for c in refined:
        point = dict(c.point)
        layer = int(point["L"][1:])
        want_exact = []
        for ids, corrupt, a, b, at in runs:
            t = at[point["t"]]
            new = _cache_after(name, corrupt, t).get_recurrent_state(layer)
            clean = float(_m(_forward(hf, ids).logits.detach(), a, b))
            want_exact.append(_patched_ab(name, ids, layer, t, new, a, b) - clean)
        assert out.values(point, variant="exact") == pytest.approx(want_exact, abs=2e-5), point
        checked += max(abs(w) for w in want_exact) > 1e-3
    assert checked >= 1
    for c in out.cells:
        vals = out.values(dict(c.point), variant="blk2")
        assert c.estimates["blk2"].mean == pytest.approx(sum(vals) / len(vals))
