"""Model loading, `deltalang info`, `support()`, and the errors a wrong model gives."""

from __future__ import annotations

from pathlib import Path

import pytest

import deltalang
from deltalang import cli
from deltalang.ground.errors import DeltaModelError
from deltalang.models import families
from deltalang.models.testing import FAMILY_NAMES, tiny_checkpoint


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_info_for_every_family(family: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", "--model", str(tiny_checkpoint(family))]) == 0
    out = capsys.readouterr().out
    assert family in out and "DeltaNet" in out and "attention" in out
    attention = deltalang.load_spec(tiny_checkpoint(family)).attention_layers()[0]
    kind = deltalang.load_spec(tiny_checkpoint(family)).layer_types[attention]
    assert "pure-torch chunked" in out and f"no DeltaNet mixer on this block ({kind})" in out


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_family_presents_its_mixer_as_linear_attn(family: str) -> None:
    model = deltalang.load_model(tiny_checkpoint(family))
    assert model.family.name == family
    for i in range(model.spec.num_layers):
        has = getattr(model.layers[i], "linear_attn", None) is not None
        assert has == (i in model.spec.linear_layers())


def test_support_reports_availability_and_reasons() -> None:
    model = deltalang.load_model(tiny_checkpoint("qwen3_5"))
    table = model.support()
    assert set(table) >= {"linear_attn.states", "linear_attn.state_after", "linear_attn.attention_output"}
    assert table["linear_attn.states"][0] == "available"
    attention = model.spec.attention_layers()[0]
    assert model.support(layer=attention)["linear_attn.states"] == "no DeltaNet mixer on this block (full_attention)"
    with pytest.raises(DeltaModelError):
        model.support(layer=99)


def test_a_missing_model_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["info", "--model", str(tmp_path / "nothing-here")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cannot load model" in err


def test_a_non_hybrid_model_names_the_supported_families(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=32, n_head=2).save_pretrained(tmp_path)
    assert cli.main(["info", "--model", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "gpt2" in err and families.supported_names() in err and "qwen4_exp" in err


def test_the_grammar_and_bundled_model_are_package_data() -> None:
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]["deltalang"]
    assert "language/grammar/*.lark" in data and "models/bundled/model/*" in data
    assert (Path(deltalang.__file__).parent / "language" / "grammar" / "deltalang.lark").is_file()


@pytest.mark.parametrize("family", ["kimi_linear", "qwen3_5"])
def test_a_directory_without_tokenizer_files_says_so(family: str, capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path) -> None:
    """A saved model whose tokenizer files were left behind: one line saying the directory has none (kimi_linear's
    read "Couldn't instantiate the backend tokenizer from one of: " and stopped; qwen3_5's loaded an empty
    tokenizer of one token and went on)."""
    import shutil

    src = tiny_checkpoint(family)
    for f in src.iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, tmp_path / f.name)
    capsys.readouterr()  # building the checkpoint's own lines
    assert cli.main(["info", "--model", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert f"cannot load the tokenizer of '{tmp_path}': the directory has no tokenizer files" in err, err
    assert "tokenizer.json" in err
    with pytest.raises(DeltaModelError, match="has no tokenizer files"):
        deltalang.load_spec(tmp_path)
