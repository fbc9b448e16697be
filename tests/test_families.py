"""Families are recognised from transformers' code, not from a list.

Checked against transformers itself: the kernel each found mixer really calls in a
plain forward (its dims), and a family deltalang has never seen — a copy of a
modeling module under a new name, registered with transformers' Auto classes —
served with no change to deltalang, against that copy's own cache.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import deltalang
from deltalang.ground.errors import DeltaModelError
from deltalang.models import families
from deltalang.models.testing import FAMILY_NAMES, load_hf, tiny_checkpoint
from deltalang.runtime import kernels
from deltalang.runtime.model import decoder_layers

PROMPT = "The Eiffel Tower is in"


def test_every_module_wrapping_a_delta_rule_kernel_is_found() -> None:
    import transformers

    root = Path(transformers.__file__).parent / "models"
    wrapped = re.compile(r'use_kernel_func_from_hub_with_fallback\(\s*"(chunk_gated_delta_rule|chunk_kda)"')
    expected = {p.parent.name for p in root.glob("*/modeling_*.py") if wrapped.search(p.read_text())}
    assert expected >= {"qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "kimi_linear"}
    assert set(FAMILY_NAMES) == expected
    assert families.unserved() == ()  # every module wrapping a known mechanism's kernel is served


def _tree(name: str) -> Any:
    import ast

    return ast.parse(Path(importlib.import_module(f"transformers.models.{name}.modeling_{name}").__file__).read_text())


def test_the_mixer_paths_and_block_outputs_are_read_from_the_code() -> None:
    """zamba2's hybrid blocks hold the mixer one level down (`mamba_decoder`, a parameter annotated with the class
    holding it); granitemoehybrid's block is annotated `-> tuple` but the model's forward takes a tensor from it
    (`hidden_states = decoder_layer(...)`): the call site decides; falcon_h1's `layer_outputs[0]` is a tuple."""
    from deltalang.models.families import code

    assert families.by_name("zamba2").mixer_paths == ("mamba", "mamba_decoder.mamba")
    assert families.by_name("mamba2").mixer_paths == ("mixer",)
    granite = _tree("granitemoehybrid")
    assert any(code.returns_tuple(granite, c) for c in code.holders(granite, "GraniteMoeHybridMambaLayer"))
    assert code.block_output(granite) == "tensor" == families.by_name("granitemoehybrid").block_output
    for name, want in (("falcon_h1", "tuple"), ("bamba", "tuple"), ("glm5_next", "tuple"), ("qwen3_5", "tensor"),
                       ("zamba2", "tensor"), ("mamba2", "tensor"), ("nemotron_h", "tensor")):
        assert code.block_output(_tree(name)) == want == families.by_name(name).block_output, name


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_dims_are_what_the_kernel_receives_in_transformers(family: str) -> None:
    """The mixer class, its attribute and the dims read off the config, against a plain forward's call."""
    path = tiny_checkpoint(family)
    spec = deltalang.load_spec(path)
    fam = spec.family
    hf = load_hf(path).eval()
    module = importlib.import_module(fam.module_name)
    seen: list[dict[str, tuple[int, ...]]] = []
    original = kernels.original(fam, fam.chunk_kernel)  # installs deltalang's dispatchers first, so that
    bound = getattr(module, fam.chunk_kernel)  # what is put back below is the dispatcher, not what it replaced

    def recorder(query, key, value, g, beta, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append({"q": tuple(query.shape), "v": tuple(value.shape), "g": tuple(g.shape)})
        return original(query, key, value, g, beta, *args, **kwargs)

    setattr(module, fam.chunk_kernel, recorder)
    try:
        with torch.no_grad():
            hf(spec.tokenizer(PROMPT, return_tensors="pt").input_ids, use_cache=False)
    finally:
        setattr(module, fam.chunk_kernel, bound)
    d = spec.dims
    assert len(seen) == len(spec.linear_layers()) > 0
    for call in seen:
        assert call["q"][2:] == (d["key_heads"], d["key_dim"])
        assert call["v"][2:] == (d["heads"], d["value_dim"])
        assert call["g"][2:] == ((d["heads"], d["key_dim"]) if fam.per_channel_decay else (d["heads"],))
    blocks = decoder_layers(hf)
    for i in spec.linear_layers():
        mixer = getattr(blocks[i], fam.mixer_attr)
        assert type(mixer).__name__ == fam.mixer_class
        assert mixer.conv1d.weight.shape[0] == d["conv_dim"] and mixer.conv1d.weight.shape[-1] == d["conv_width"]


def test_a_mamba2_hybrid_is_not_taken_for_a_delta_rule() -> None:
    """granitemoehybrid names its Mamba-2 layers `linear_attention`: they are Mamba-2 (`ssm`) blocks, never DeltaNet."""
    from transformers import GraniteMoeHybridConfig

    from deltalang.models.spec import spec_from_config

    config = GraniteMoeHybridConfig(num_hidden_layers=2, hidden_size=64, mamba_n_heads=8,
                                    layer_types=["linear_attention", "full_attention"])
    spec = spec_from_config("g", config, None)
    assert spec.family.mechanism == "mamba2" and spec.linear_layers() == [] and spec.ssm_layers() == [0]
    assert spec.unavailable(0, "attention_keys") is not None and spec.unavailable(0, "states") is None


def _copy_family(tmp_path: Path, source: str, new: str, drop: str | None = None) -> str:
    """Copy transformers' `source` modeling and configuration modules as package `new`, every name renamed."""
    import transformers

    src = Path(transformers.__file__).parent / "models" / source
    old_cls = {"qwen3_5": "Qwen3_5", "kimi_linear": "KimiLinear"}[source]
    new_cls = "".join(p.capitalize() for p in new.split("_"))
    pkg = tmp_path / new
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for kind in ("configuration", "modeling"):
        text = (src / f"{kind}_{source}.py").read_text()
        text = text.replace("from ... import", "from transformers import").replace("from ...", "from transformers.")
        text = text.replace("from ..auto import", "from transformers.models.auto import")
        text = text.replace(f"from .configuration_{source} import",
                                                                      f"from {new}.configuration_{new} import")
        text = text.replace(old_cls, new_cls).replace(source, new)
        if drop is not None:  # a module that does not show one of its kernels
            decorator = f'@use_kernel_func_from_hub_with_fallback("{drop}", "fla")\n'
            hidden = re.search(re.escape(decorator) + r"def (\w+)", text)
            text = text.replace(decorator, "")
            if hidden is not None:  # 5.25 lists the kernels on the mixer (`use_kernelized_func`), which checks them
                text = re.sub(r"(@use_kernelized_func\(\s*\[[^\]]*?)\s+" + hidden.group(1) + r",", r"\1", text)
        (pkg / f"{kind}_{new}.py").write_text(text)
    sys.path.insert(0, str(tmp_path))
    return new_cls


def _register(new: str, new_cls: str, text: bool) -> tuple[type, type]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config_mod = importlib.import_module(f"{new}.configuration_{new}")
    model_mod = importlib.import_module(f"{new}.modeling_{new}")
    config_cls = getattr(config_mod, f"{new_cls}TextConfig" if text else f"{new_cls}Config")
    model_cls = getattr(model_mod, f"{new_cls}ForCausalLM")
    AutoConfig.register(config_cls.model_type, config_cls)
    AutoModelForCausalLM.register(config_cls, model_cls)
    return config_cls, model_cls


def test_a_family_never_seen_but_built_on_the_same_kernels_works_unchanged(tmp_path: Path) -> None:
    from deltalang.models.testing import _enlarge_random_weights, byte_tokenizer, tiny_config

    new_cls = _copy_family(tmp_path, "qwen3_5", "zeta_hybrid")
    config_cls, model_cls = _register("zeta_hybrid", new_cls, text=True)
    base = tiny_config("qwen3_5").to_dict()
    base.pop("model_type", None)
    base.pop("architectures", None)
    cfg = config_cls(**{k: v for k, v in base.items() if k in config_cls.__annotations__ or k.endswith("_id")})
    torch.manual_seed(0)
    hf = model_cls(cfg).eval()
    _enlarge_random_weights(hf)
    path = tmp_path / "checkpoint"
    hf.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)

    model = deltalang.load_model(path)
    assert model.family.name == "zeta_hybrid_text" and model.family.mixer_class == f"{new_cls}GatedDeltaNet"
    assert model.family.module_name == "zeta_hybrid.modeling_zeta_hybrid"
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    layers = model.spec.linear_layers()
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad(), model.trace(PROMPT):
        for i in layers:
            got[i] = (model.layers[i].linear_attn.states.save(), model.layers[i].linear_attn.state_after(6).save())
    truth = load_hf(path).eval()
    with torch.no_grad():
        cache = truth(ids[:, :7], use_cache=True).past_key_values
    for i in layers:
        torch.testing.assert_close(got[i][1], cache.get_recurrent_state(i), atol=1e-5, rtol=0)
        torch.testing.assert_close(got[i][0][:, 6], cache.get_recurrent_state(i), atol=1e-5, rtol=0)
    # a write reaches the later tokens, as in the family it was copied from
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[layers[0]].linear_attn.set_state_after(6, torch.zeros_like(got[layers[0]][1]))
        patched = model.next_token_probs.save()
    with torch.no_grad(), model.trace(PROMPT):
        clean = model.next_token_probs.save()
    assert not torch.allclose(patched, clean)


def test_a_module_that_hides_a_kernel_is_one_line_saying_what_is_missing(tmp_path: Path) -> None:
    new_cls = _copy_family(tmp_path, "kimi_linear", "hidden_kda", drop="fused_recurrent_kda")
    config_cls, _ = _register("hidden_kda", new_cls, text=False)
    config_cls(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]).save_pretrained(
        tmp_path / "ckpt")
    with pytest.raises(DeltaModelError, match="fused_recurrent_kda") as err:
        deltalang.load_spec(tmp_path / "ckpt")
    assert "cannot serve" in str(err.value) and "\n" not in str(err.value)


RECORDS = [  # byte tokens: one-character answers are one token
    {"prompt": "The Eiffel Tower is in", "corrupt": "My favourite food is pi", "subject": "Tower", "answer": "P",
     "foil": "R"},
    {"prompt": "A big Colosseum is in", "corrupt": "Some pizza is nice wi", "subject": "Colosseum", "answer": "R",
     "foil": "P"},
    {"prompt": "Big Ben is in", "corrupt": "The sky is so", "subject": "Ben", "answer": "L", "foil": "P"},
]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_dataset_run_on_every_family_equals_transformers(family: str) -> None:
    """Records of different lengths share left-padded forwards; each equals its own patch in transformers."""
    from reference import Reference, Write, set_to

    path = tiny_checkpoint(family)
    model = deltalang.load_model(path)
    src = ("trace t on facts {\n    write L[linear].state_after(facts.subject) from facts.corrupt\n"
           "    measure logit_diff(facts.answer, facts.foil)\n}\n")
    out = deltalang.run(src, model, data={"facts": RECORDS})
    got = out.values("t.logit_diff(facts.answer, facts.foil)")
    assert len(got) == len(RECORDS) and not out.skipped
    ref = Reference(load_hf(path).eval())
    tok = model.tokenizer
    for r, value in zip(RECORDS, got):
        end = r["prompt"].index(r["subject"]) + len(r["subject"])
        pos = len(tok(r["prompt"][:end]).input_ids) - 1
        corrupt = ref.run(tok(r["corrupt"], return_tensors="pt").input_ids)
        writes = [Write(i, "state_after", set_to(corrupt.value(i, "state_after", pos)), position=pos)
                  for i in ref.linear]
        logits = ref.run(tok(r["prompt"], return_tensors="pt").input_ids, writes).value(None, "logits")[0, -1]
        a, b = (tok(r[k]).input_ids[0] for k in ("answer", "foil"))
        want = float(logits[a] - logits[b])
        assert value == pytest.approx(want, abs=1e-3 * max(1.0, abs(want))), (family, r["subject"])


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_blocks_output_is_served_with_its_own_width_or_refused_in_one_line(family: str) -> None:
    """qwen4_exp's blocks carry hc_count residual streams flattened; glm5_next's return a tuple: refused."""
    path = tiny_checkpoint(family)
    model = deltalang.load_model(path)
    src = 'prompt p = "The Eiffel Tower is in"\ntrace t on p { read L0.output }\n'
    if model.family.block_output != "tensor":
        with pytest.raises(deltalang.DeltaError, match=r"<program>:2:.*error: .*return a tuple") as err:
            deltalang.check(src, model.spec)
        assert "attention_output" in str(err.value)
        return
    got = deltalang.run(src, model)["t.L0.output"]
    hf = load_hf(path).eval()
    blocks = decoder_layers(hf)
    seen: list[torch.Tensor] = []
    hook = blocks[0].register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        with torch.no_grad():
            hf(model.tokenizer(PROMPT, return_tensors="pt").input_ids, use_cache=False)
    finally:
        hook.remove()
    assert got.shape[-1] == model.family.stream_width(deltalang.models.spec.text_config(model.config))
    torch.testing.assert_close(got, seen[0], atol=1e-5, rtol=0)
