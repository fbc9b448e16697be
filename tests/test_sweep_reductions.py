"""Reductions inside sweeps (`.norm/.mean/.head/.project`, `norm(SITE, over=[...])`, `project(SITE, load(...))`),
against transformers' own forward with the same patch.

Ground truth: `tests/reference.Reference` runs plain transformers token by token with the cell's write applied
by hand (the state after token t scaled in its cache); each cell's reduced value is the same reduction of what
that forward holds, computed here with torch. The engine serves reductions of a written site or of a block's
state_output; any other reduced measure (or a read) runs the cells on the reference path, which `emit --plan`
says under the plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from reference import Reference, Write

import deltalang
from deltalang.cli import main
from deltalang.ground.errors import DeltaError
from deltalang.models.testing import load_hf, tiny_checkpoint

PROMPT = "The Eiffel Tower is in Paris, and the Brandenburg Gate is in Berlin"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup() -> tuple[Any, Reference, torch.Tensor]:
    path = tiny_checkpoint("qwen3_5")
    model = deltalang.load_model(path)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    return model, Reference(load_hf(path)), ids


def _truth(ref: Reference, ids: torch.Tensor, layer: int, t: int) -> Any:
    """Transformers' forward with the state after token t of block `layer` halved (the cell's write)."""
    return ref.run(ids, [Write(layer, "state_after", lambda x, i: x * 0.5, position=t)])


def _close(got: float, want: torch.Tensor, tol: float = 2e-4) -> None:
    want_f = float(want.reshape(()))
    assert abs(got - want_f) <= tol * max(1.0, abs(want_f)), (got, want_f)


def _cells(outcome: Any, measure: str) -> dict[tuple[int, ...], float]:
    return outcome.tables[0].grid(measure)


def _direction(tmp_path: Path, shape: tuple[int, ...]) -> Path:
    torch.manual_seed(3)
    f = tmp_path / "d.safetensors"
    safetensors.torch.save_file({"d": torch.randn(shape)}, str(f))
    return f


def test_engine_cells_reduce_the_written_state_and_state_output_as_transformers(setup: Any, tmp_path: Path) -> None:
    model, ref, ids = setup
    blocks = model.spec.linear_layers()[-2:]
    d = model.spec.dims
    f = _direction(tmp_path, (d["heads"], d["key_dim"], d["value_dim"]))
    source = (f'prompt p = "{PROMPT}"\n'
              f'sweep s on p over L in L[{",".join(map(str, blocks))}], t in -4..-1 {{\n'
              f'    write L.state_after(t) *= 0.5\n'
              f'    measure norm(L.state_after(t).mean(heads))\n'
              f'    measure norm(L.state_output.head(1))\n'
              f'    measure project(L.state_output, load("{f}"))\n'
              f'    measure norm(L.state_output, over=[heads, key_dim, value_dim])\n'
              f'}}\n')
    outcome = deltalang.run_sweep(source, model, progress=False)
    assert outcome.paths == {"s": "engine"}
    direction = safetensors.torch.load_file(str(f))["d"]
    n = ids.shape[1]
    for layer in blocks:
        for t in (n - 4, n - 3, n - 2):
            rec = _truth(ref, ids, layer, t)
            after = rec.value(layer, "state_after", t)[0].float()  # [heads, key_dim, value_dim]: the written state
            final = rec.value(layer, "state_output")[0].float()
            point = (layer, t)
            _close(_cells(outcome, "norm(L.state_after(t).mean(heads))")[point], after.mean(0).norm())
            _close(_cells(outcome, "norm(L.state_output.head(1))")[point], final[1].norm())
            _close(_cells(outcome, f'project(L.state_output, load("{f}"))')[point], (final * direction).sum())
            _close(_cells(outcome, "norm(L.state_output, over=[heads, key_dim, value_dim])")[point], final.norm())


def test_reductions_the_engine_cannot_serve_take_the_reference_path(setup: Any, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    model, ref, ids = setup
    blocks = model.spec.linear_layers()[:2]
    last = model.spec.num_layers - 1
    f = _direction(tmp_path, (model.spec.config.hidden_size,))
    source = (f'prompt p = "{PROMPT}"\n'
              f'sweep s on p over L in L[{",".join(map(str, blocks))}] {{\n'
              f'    write L.state_after(-2) *= 0.5\n'
              f'    measure norm(L{last}.output.mean(positions))\n'
              f'    measure project(L{last}.output.mean(positions), load("{f}"))\n'
              f'    measure norm(L.states)\n'
              f'}}\n')
    outcome = deltalang.run_sweep(source, model, progress=False)
    assert outcome.paths["s"].startswith("naive: measure norm(L")
    direction = safetensors.torch.load_file(str(f))["d"]
    n = ids.shape[1]
    table = outcome.tables[0]
    for layer in blocks:
        rec = _truth(ref, ids, layer, n - 2)
        out = rec.value(last, "output")[0].float().mean(0)  # [hidden]
        _close(table.grid(f"norm(L{last}.output.mean(positions))")[(layer,)], out.norm())
        _close(table.grid(f'project(L{last}.output.mean(positions), load("{f}"))')[(layer,)], (out * direction).sum())
        states = rec.value(layer, "states")[0].float()  # [s, heads, key_dim, value_dim]
        curve = table.curves("norm(L.states)")[(layer,)]
        assert len(curve) == n
        for p in range(n):
            _close(curve[p], states[p].norm())
    prog = tmp_path / "p.dl"
    prog.write_text(source)
    assert main(["emit", "--plan", str(prog), "--model", str(tiny_checkpoint("qwen3_5"))]) == 0
    plan = capsys.readouterr().out
    assert "sweep s: the reference path runs its cells" in plan and "engine cannot serve it: measure norm(L" in plan


def test_a_read_of_a_reduction_in_a_sweep_is_each_cells_own(setup: Any) -> None:
    model, ref, ids = setup
    layer = model.spec.linear_layers()[-1]
    source = (f'prompt p = "{PROMPT}"\n'
              f'sweep s on p over t in -3..-1 {{\n'
              f'    write L{layer}.state_after(t) *= 0.5\n'
              f'    read L{layer}.states.mean(positions)\n'
              f'    measure norm(L{layer}.state_output.head(0))\n'
              f'}}\n')
    outcome = deltalang.run_sweep(source, model, progress=False)
    n = ids.shape[1]
    for t in (n - 3, n - 2):
        got = outcome.results[f"s[t={t}].L{layer}.states.mean(positions)"]
        want = _truth(ref, ids, layer, t).value(layer, "states").float().mean(1)  # [1, heads, key_dim, value_dim]
        assert got.shape == want.shape
        assert float((got.float() - want).abs().max()) <= 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("measure, message", [
    ("norm(L.state_after(-1), over=[key_dim])", "leaves [b=1, heads=4, value_dim=32], and a sweep's cell holds one"),
])
def test_a_reduction_a_sweep_cannot_hold_is_a_located_error(measure: str, message: str) -> None:
    axes = "L in L[linear]"
    source = (f'prompt p = "The Eiffel Tower is in the city of"\nsweep s on p over {axes} {{\n'
              f'    write L.state_after(-1) = zeros\n    measure {measure}\n}}\n')
    with pytest.raises(DeltaError) as e:
        deltalang.compile(source)
    assert message in str(e.value) and e.value.span is not None and e.value.span.line == 4
