"""The state's spectrum: `.svd(k)`, `.rank(tol)`, `.erank()` of every recurrent family's state, against
`torch.linalg` on transformers' cache.

Ground truth: a plain transformers model of the same tiny checkpoint; its cache after the first t + 1 tokens holds
the state after token t (`get_recurrent_state(i)`: `[1, heads, key_dim, value_dim]` on a delta-rule or KDA block,
`[1, heads, head_dim, d_state]` on a Mamba-2 one), and `torch.linalg.svdvals` / `matrix_rank` of those states in
float64 is what deltalang's reductions must give. A sweep's cell is checked against the cache with the written
state set in it by hand and the prompt's rest continued from it.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from reference import cache_after, hf_forward

import deltalang
from deltalang.ground.errors import DeltaError
from deltalang.models import testing_ssd
from deltalang.models.internals import output_cache
from deltalang.models.testing import FAMILY_NAMES, load_hf, tiny_checkpoint

PROMPT = "The Eiffel Tower is in Paris, and the Gate is in Berlin."  # 56 byte tokens
ALL = (*FAMILY_NAMES, *testing_ssd.MAMBA2_FAMILY_NAMES)


def _path(family: str) -> Any:
    return testing_ssd.tiny_ssd_checkpoint(family) if family in testing_ssd.MAMBA2_FAMILY_NAMES \
        else tiny_checkpoint(family)


@functools.lru_cache(maxsize=None)
def _truth(family: str) -> tuple[Any, Any, torch.Tensor, int, torch.Tensor]:
    """(deltalang's model, plain transformers, the prompt's ids, the first recurrent block, the cache's state of
    that block after every token `[1, s, heads, M, N]` float64)."""
    path = _path(family)
    model, hf = deltalang.load_model(path), load_hf(path).eval()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    block = model.spec.recurrent_layers()[0]
    per = [cache_after(hf, ids, t).get_recurrent_state(block).double() for t in range(ids.shape[1])]
    return model, hf, ids, block, torch.stack(per, dim=1)


def _tolerance(sv: torch.Tensor) -> float:
    """A `.rank(tol)` tolerance far from every ratio of a singular value to its matrix's largest (the middle of the
    widest gap between the ratios in (0.05, 0.95)), so the rank is not decided by rounding."""
    ratio = (sv / sv[..., :1]).flatten()
    inside = torch.sort(ratio[(ratio > 0.05) & (ratio < 0.95)]).values
    edges = torch.cat([torch.tensor([0.05], dtype=inside.dtype), inside, torch.tensor([0.95], dtype=inside.dtype)])
    gaps = edges[1:] - edges[:-1]
    k = int(gaps.argmax())
    assert float(gaps[k]) > 1e-3, "no tolerance far from every ratio"
    return round(float(edges[k] + edges[k + 1]) / 2, 6)


def _erank(sv: torch.Tensor) -> torch.Tensor:
    p = sv / sv.sum(-1, keepdim=True)
    return torch.exp(-(p * torch.log(p)).nansum(-1))


def _close(got: Any, want: torch.Tensor, tol: float = 2e-5) -> None:
    got = torch.as_tensor(got).double()
    assert tuple(got.shape) == tuple(want.shape), (got.shape, want.shape)
    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
    assert err < tol, err


def _run(model: Any, body: str) -> Any:
    return deltalang.run(f'prompt p = "{PROMPT}"\ntrace t on p {{\n{body}\n}}\n', model=model)


@pytest.mark.parametrize("family", ALL)
def test_singular_values_ranks_and_effective_ranks_equal_torch_linalg_on_the_cache(family: str) -> None:
    model, _, _, i, states = _truth(family)
    sv = torch.linalg.svdvals(states)  # [1, s, heads, min(M, N)]
    TOL = _tolerance(sv)
    r = _run(model, f"read L{i}.states.svd(3) as sv\nread L{i}.states.rank({TOL}) as rk\n"
                    f"read L{i}.states.erank() as er\nread L{i}.state_after(5).svd(2) as sa\n"
                    f"read L{i}.state_output.rank({TOL}) as ro\n"
                    f"read L{i}.states.head(1).erank().mean(positions) as em")
    ratio = sv / sv[..., :1]
    assert (ratio > TOL).any() and (ratio < TOL).any(), "TOL separates nothing on this model"
    _close(r["sv"], sv[..., :3])
    _close(r["sa"], sv[:, 5, :, :2])
    want_rank = torch.linalg.matrix_rank(states, rtol=TOL).double()
    assert torch.equal(torch.as_tensor(r["rk"]).double(), want_rank)
    assert torch.equal(torch.as_tensor(r["ro"]).double(), want_rank[:, -1])
    _close(r["er"], _erank(sv))
    _close(r["em"], _erank(sv[:, :, 1]).mean(dim=1))


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_a_sweep_measures_a_blocks_effective_rank_after_each_write_as_the_cache_gives_it(family: str) -> None:
    """Each cell `write L.state_after(t) *= 0.5`: the cache after t + 1 tokens with that block's state halved by
    hand, the rest of the prompt continued from it; the cell's effective rank (mean over heads) of the block's
    final state and its largest singular value of head 0 are those of the cache's state at the end."""
    model, hf, ids, i, _ = _truth(family)
    positions = (3, 20, 40)
    src = (f'prompt p = "{PROMPT}"\nsweep s on p over t in {", ".join(map(str, positions))} {{\n'
           f"    write L{i}.state_after(t) *= 0.5\n"
           f"    measure norm(L{i}.state_output.erank().mean(heads)) as er\n"
           f"    measure norm(L{i}.state_output.head(0).svd(1)) as s1\n}}\n")
    r = deltalang.run(src, model=model)
    for t in positions:
        cache = cache_after(hf, ids, t)
        cache.get_recurrent_state(i).mul_(0.5)  # the cache's own tensor, the next token's starting state
        end = output_cache(hf_forward(hf, ids[:, t + 1:], cache, start=t + 1)).get_recurrent_state(i).double()
        sv = torch.linalg.svdvals(end)
        _close(r[f"s[t={t}].er"], _erank(sv).mean(dim=-1)[0])  # one prompt: a number per cell
        _close(r[f"s[t={t}].s1"], sv[0, 0, 0])


@pytest.mark.parametrize("family", ALL)
def test_a_sweep_over_heads_reduces_each_cells_own_head_as_the_cache_gives_it(family: str) -> None:
    """`.head(h)` of the sweep's head variable inside a reduction: each cell's effective rank and largest singular
    value are those of head h of the cache's state after token t (a measure, and a read)."""
    model, _, ids, i, states = _truth(family)
    t, heads = 20, states.shape[2]
    src = (f'prompt p = "{PROMPT}"\nsweep s on p over h in heads {{\n'
           f"    measure norm(L{i}.state_after({t}).head(h).erank()) as er\n"
           f"    read L{i}.state_after({t}).head(h).svd(2) as sv\n}}\n")
    r = deltalang.run(src, model=model)
    sv = torch.linalg.svdvals(states[:, t])  # [1, heads, min(M, N)]
    for h in range(heads):
        _close(r[f"s[h={h}].er"], _erank(sv[:, h])[0])
        _close(r[f"s[h={h}].sv"], sv[:, h, :2])


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_the_engine_reduces_each_cells_head_of_the_written_blocks_final_state(family: str) -> None:
    """`write L.state_after(t) *= 0.5` (the engine's cells) measured by `.head(h).svd(1)` of the block's final
    state: the cache after t + 1 tokens with the state halved by hand, continued, its head h."""
    model, hf, ids, i, _ = _truth(family)
    src = (f'prompt p = "{PROMPT}"\nsweep s on p over t in 3, 40, h in heads[0,1] {{\n'
           f"    write L{i}.state_after(t) *= 0.5\n"
           f"    measure norm(L{i}.state_output.head(h).svd(1)) as s1\n}}\n")
    r = deltalang.run(src, model=model)
    for t in (3, 40):
        cache = cache_after(hf, ids, t)
        cache.get_recurrent_state(i).mul_(0.5)
        end = output_cache(hf_forward(hf, ids[:, t + 1:], cache, start=t + 1)).get_recurrent_state(i).double()
        sv = torch.linalg.svdvals(end)
        for h in (0, 1):
            _close(r[f"s[t={t},h={h}].s1"], sv[0, h, 0])


@pytest.mark.parametrize("body, message", [
    ("read L0.output.svd(2)", "svd takes a state's matrix"),
    ("read L0.states.svd(9)", "svd(9): a state matrix [key_dim=16, value_dim=8] has 8 singular values"),
    ("read L0.states.svd(0)", "svd(k) takes how many singular values, a whole number from 1"),
    ("read L0.states.rank(-1)", "rank(tol) takes a tolerance"),
    ("read L0.states.erank(2)", "erank() takes nothing"),
    ("read L0.states.norm(key_dim).svd(2)", "svd takes a state's matrix"),
])
def test_a_spectrum_of_something_without_a_state_matrix_is_a_located_error(body: str, message: str) -> None:
    with pytest.raises(DeltaError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        deltalang.run(f'prompt p = "The Eiffel Tower"\ntrace t on p {{\n{body}\n}}\n',
                      model=deltalang.load_model(tiny_checkpoint("qwen3_5")))
