"""Sharded checkpoints: `device_map` through accelerate, on this CPU with its disk and CPU offload hooks.

Two ways of sharding, both on the tiny checkpoints:
- "disk": `load_model(path, device_map=FILE.json)`, the map in a JSON file (what `--device-map`
  takes), placing the embeddings, the LM head and every other block on "disk" (offloaded to a
  folder, weights on `meta` between calls, loaded by accelerate's hooks) and the rest on "cpu";
  the map's first entry is on disk, which transformers' pipeline (built by nnsight) cannot take
  as its device;
- "cpu_offload": `accelerate.cpu_offload` on an in-memory model, then `wrap_model`: every weight
  on `meta`, moved in by accelerate's hooks for each call.

Ground truth for the value layer is transformers on the unsharded checkpoint (tests/reference.py):
`states`, `state_after(t)`, `conv_window_after(t)`, the logits, and the logits after a
`set_state_after(t)` write. A run with donors and the sweep engine are compared with the same
program on the unsharded model (whose results the other tests hold to transformers).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import accelerate
import pytest
import torch
from reference import Reference, Write, set_to
from transformers import AutoModelForCausalLM

import deltalang
from deltalang.ground.errors import DeltaModelError
from deltalang.models.testing import FAMILY_NAMES, load_hf, tiny_checkpoint
from deltalang.runtime.model import wrap_model
from deltalang.sweep import run_sweep

PROMPT = "The Eiffel Tower is in Paris, and"
PROGRAMS = '''prompt clean = "The Eiffel Tower is in"
prompt other = "My favourite food is pizza"
'''
MEASURES = 'prob("P"), logit_diff("P", "a"), kl(clean)'


def device_map(hf: torch.nn.Module) -> dict[str, str]:
    """Every top-level part of the decoder and every block, alternately on disk and on cpu; disk first."""
    out: dict[str, str] = {}
    for name, child in hf.model.named_children():
        if name == "layers":
            for i in range(len(child)):
                out[f"model.layers.{i}"] = "disk" if i % 2 else "cpu"
        else:
            out[f"model.{name}"] = "disk" if name == "embed_tokens" else "cpu"
    out["lm_head"] = "disk"
    return out


def sharded(family: str, how: str, folder: Path) -> tuple[deltalang.DeltaModel, torch.nn.Module]:
    """(the sharded model, the unsharded transformers model)."""
    path = tiny_checkpoint(family)
    hf = load_hf(path).eval()
    if how == "disk":
        spec = folder / "map.json"
        spec.write_text(json.dumps({"device_map": device_map(hf), "offload_folder": "offload"}))
        model = deltalang.load_model(path, device_map=str(spec))
        assert (folder / "offload").is_dir()
        assert any(p.device.type == "meta" for p in model._module.parameters())
    else:
        offloaded = load_hf(path).eval()
        accelerate.cpu_offload(offloaded, execution_device=torch.device("cpu"))
        assert all(p.device.type == "meta" for p in offloaded.parameters())
        model = wrap_model(offloaded, deltalang.load_model(path).tokenizer)
    return model, hf


@pytest.fixture(scope="module", params=[(f, h) for f in FAMILY_NAMES for h in ("disk", "cpu_offload")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    family, how = request.param
    return sharded(family, how, tmp_path_factory.mktemp(f"{family}-{how}"))


def test_values_of_a_sharded_model_equal_transformers_unsharded(loaded: tuple) -> None:
    model, hf = loaded
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    t = ids.shape[1] - 4
    layers = model.spec.linear_layers()
    truth = Reference(hf).run(ids)
    states, after, windows = {}, {}, {}
    with torch.no_grad(), model.trace(PROMPT):
        for i in layers:
            mix = model.layers[i].linear_attn  # in forward order: the convolution, then the delta rule
            windows[i] = mix.conv_window_after(t).save()
            states[i] = mix.states.save()
            after[i] = mix.state_after(t).save()
        logits = model.logits.save()
    for i in layers:
        torch.testing.assert_close(states[i], truth.value(i, "states"), atol=1e-5, rtol=0)
        torch.testing.assert_close(after[i], truth.value(i, "state_after", t), atol=1e-5, rtol=0)
        torch.testing.assert_close(windows[i], truth.value(i, "conv_window_after", t), atol=1e-5, rtol=0)
        assert states[i].device.type == "cpu" and states[i].dtype == torch.float32
    torch.testing.assert_close(logits, truth.value(None, "logits"), atol=1e-4, rtol=0)
    # a write: the state after t of the last DeltaNet block (on disk or offloaded) replaced
    d = model.spec.dims
    written = torch.randn(1, d["heads"], d["key_dim"], d["value_dim"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[layers[-1]].linear_attn.set_state_after(t, written)
        patched = model.logits.save()
    want = Reference(hf).run(ids, [Write(layers[-1], "state_after", set_to(written), position=t)])
    torch.testing.assert_close(patched, want.value(None, "logits"), atol=1e-4, rtol=0)
    assert (patched - logits).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_a_run_with_donors_and_the_sweep_engine_equal_the_unsharded_model(family: str, tmp_path: Path) -> None:
    model, _ = sharded(family, "disk", tmp_path)
    plain = deltalang.load_model(tiny_checkpoint(family))
    donors = PROGRAMS + ('trace cell on clean {\n    write L1.state_after(10) from other\n'
                         '    write L2.conv_window_after(12) from other\n'
                         f'    measure {MEASURES}, norm(L1.state_after(15))\n}}\n')
    got, want = deltalang.run(donors, model, batch=False), deltalang.run(donors, plain, batch=False)
    assert set(got.keys()) == set(want.keys()) and len(want.keys()) == 4
    for key in want.keys():
        assert abs(got[key] - want[key]) <= 1e-4 * max(1.0, abs(want[key])), key
    sweep = PROGRAMS + ('sweep z on clean over L in L[linear], t in 18..21 {\n'
                        '    write L.state_after(t) from other\n    write L.conv_window_after(t) = zeros\n'
                        f'    measure {MEASURES}\n}}\n')
    fast, ref = run_sweep(sweep, model, progress=False), run_sweep(sweep, plain, progress=False)
    assert fast.paths["z"] == "engine" and ref.paths["z"] == "engine"
    assert set(fast.results) == set(ref.results) and len(ref.results) == 3 * 3 * 3  # blocks, positions 18..20, measures
    for key, value in ref.results.items():
        assert abs(fast.results[key] - value) <= 1e-4 * max(1.0, abs(value)), key


def test_the_command_line_takes_a_device_map_file(tmp_path: Path) -> None:
    path = tiny_checkpoint("qwen3_5")
    hf = load_hf(path)
    spec = tmp_path / "map.json"
    spec.write_text(json.dumps(device_map(hf)))  # a plain map: the disk part goes to a temporary folder
    program = 'prompt p = "The Eiffel Tower is in"\ntrace a on p { measure prob("P") }\n'
    runs = [subprocess.run([sys.executable, "-m", "deltalang.cli", "run", "-e", program, "--model", str(path),
                            *extra], capture_output=True, text=True, timeout=300)
            for extra in ([], ["--device-map", str(spec)])]
    assert [r.returncode for r in runs] == [0, 0], runs[1].stderr[-2000:]
    value = [next(line for line in r.stdout.splitlines() if 'prob("P")' in line) for r in runs]
    assert value[0] == value[1]
    bad = tmp_path / "bad.json"
    bad.write_text('{"model.layers.0": ["cpu"]}')
    r = subprocess.run([sys.executable, "-m", "deltalang.cli", "run", "-e", program, "--model", str(path),
                        "--device-map", str(bad)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "a device map maps module names to devices" in r.stderr.strip().splitlines()[-1]


def test_a_device_map_file_that_cannot_be_read_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(DeltaModelError, match="cannot read the device map"):
        deltalang.load_model(tiny_checkpoint("qwen3_5"), device_map=str(tmp_path / "missing.json"))
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(DeltaModelError, match="cannot read the device map"):
        deltalang.load_model(tiny_checkpoint("qwen3_5"), device_map=str(tmp_path / "x.json"))
