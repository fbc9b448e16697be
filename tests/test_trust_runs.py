"""Issue 24's runs a researcher can trust: no internal error, no half-written results, nothing ignored.

- a Kimi-Linear checkpoint with fewer key-value heads than attention heads, whose left-padded forward
  transformers cannot run: runs of different lengths get forwards of their own (said by `emit --plan`),
  every value checked against each run alone in transformers;
- a per-token measure over a dataset is a located error at `check` and `run`, before anything is written;
- `--out` never writes beside another experiment's results, and a failed run leaves nothing that looks
  like results;
- options that do nothing in their context are refused, and a zero denominator of `--normalise` too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference import Reference, Write, set_to
from transformers import AutoModelForCausalLM

import deltalang
from deltalang.cli import main
from deltalang.testing import _enlarge_random_weights, byte_tokenizer, tiny_config

LANDMARKS = Path(__file__).resolve().parent.parent / "examples" / "data" / "landmarks.jsonl"


# ---- (b) Kimi-Linear with fewer key-value heads than attention heads ----------------------------


@pytest.fixture(scope="module")
def kimi_gqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config("kimi_linear")
    cfg.num_key_value_heads = cfg.num_attention_heads // 2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    _enlarge_random_weights(model)
    path = tmp_path_factory.mktemp("kimi_gqa")
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_transformers_itself_cannot_run_the_padded_batch(kimi_gqa: Path) -> None:
    """Why deltalang must not hand it one: the config this test is about does fail in transformers."""
    tok = byte_tokenizer()
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(kimi_gqa).eval()
    with pytest.raises(RuntimeError):
        model(**tok(["The Eiffel Tower", "Hi"], return_tensors="pt", padding=True))


def test_runs_of_different_lengths_run_apart_and_equal_transformers(kimi_gqa: Path) -> None:
    model = deltalang.load_model(kimi_gqa)
    ref = Reference(AutoModelForCausalLM.from_pretrained(kimi_gqa).eval())
    a, b = model.linear_layers()[0], model.linear_layers()[-1]
    source = f"""prompt long = "The Eiffel Tower is in Paris"
prompt mid = "Tea time"
prompt tiny = "Hi"
trace d on long {{ read L{a}.state_output }}
trace m on mid {{ read logits, L{b}.state_output }}
trace t on tiny {{ read logits }}
trace x on mid {{
    write L{b}.state_after(3) from d.state_after(20)
    read logits
}}
"""
    exp = deltalang.compile(source, model)
    for p in exp.plan.passes:
        assert len({r.n_tokens for r in p.runs}) == 1 and not p.padded
    plan = exp.format_plan()
    assert "transformers' left-padded forward fails on Kimi-Linear" in plan
    got = exp.run()
    ids = lambda text: model.tokenizer(text, return_tensors="pt").input_ids  # noqa: E731
    long_, mid, tiny = (ref.run(ids(t)) for t in ("The Eiffel Tower is in Paris", "Tea time", "Hi"))
    x = ref.run(ids("Tea time"), [Write(b, "state_after", set_to(long_.value(b, "state_after", 20)), position=3)])
    torch.testing.assert_close(got["m.logits"], mid.value(None, "logits"), atol=1e-4, rtol=0)
    torch.testing.assert_close(got[f"m.L{b}.state_output"], mid.value(b, "state_output"), atol=1e-5, rtol=0)
    torch.testing.assert_close(got["t.logits"], tiny.value(None, "logits"), atol=1e-4, rtol=0)
    torch.testing.assert_close(got[f"d.L{a}.state_output"], long_.value(a, "state_output"), atol=1e-5, rtol=0)
    torch.testing.assert_close(got["x.logits"], x.value(None, "logits"), atol=1e-4, rtol=0)


def test_a_dataset_on_such_a_checkpoint_runs(kimi_gqa: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Records of different lengths share forwards in a dataset run: on this model, only those of one length."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hi", "Tea time", "The Eiffel Tower")))
    prog = tmp_path / "p.dl"
    prog.write_text(f'dataset facts = "{data}"\ntrace t on facts {{ measure norm(L0.state_output) }}\n')
    assert main(["run", str(prog), "--model", str(kimi_gqa)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "3 of 3 records" in out and " n 3 " in out, out
