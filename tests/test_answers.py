"""Answers of several tokens: `prob` and `logit_diff` by teacher forcing, against plain transformers.

The truth is computed here with the plain transformers model: log P(answer | prompt) is the
sum over the answer's tokens of the log-softmax of the logits of the prompt followed by the
answer's earlier tokens (with a write, through `tests/reference.py`, which writes the donor's
cache state into the run). The tiny checkpoints' byte-level tokenizers split every word, so
every answer below is several tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
from reference import Reference, Write, set_to
from transformers import AutoModelForCausalLM

import deltalang
from deltalang.ground.errors import DeltaError
from deltalang.models.testing import tiny_checkpoint

PROMPT = "The Eiffel Tower is in"
DONOR = "A big cat sat on the mat"


@pytest.fixture(scope="module", params=["qwen3_5", "kimi_linear"])
def loaded(request: pytest.FixtureRequest) -> tuple[deltalang.DeltaModel, Reference]:
    path = tiny_checkpoint(request.param)
    return deltalang.load_model(path), Reference(AutoModelForCausalLM.from_pretrained(path).eval())


def _logprob(model: deltalang.DeltaModel, ref: Reference, answer: str, writes: list[Write] | None = None,
             prompt: str = PROMPT) -> float:
    """log P(answer | prompt) in plain transformers, token by token over the prompt and the answer."""
    tok = model.tokenizer
    ids, a = tok(prompt).input_ids, tok(answer).input_ids
    logits = ref.run(torch.tensor([ids + a[:-1]]), writes or []).value(None, "logits")[0].float()
    lp = logits.log_softmax(-1)
    return sum(float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(a))


def test_prob_and_logit_diff_of_answers_of_several_tokens_equal_transformers(loaded: tuple) -> None:
    model, ref = loaded
    assert len(model.tokenizer(" Paris").input_ids) > 1 and len(model.tokenizer("x").input_ids) == 1
    source = f'''prompt p = "{PROMPT}"
trace t {{}}
'''.replace("trace t {}", f'trace t on p {{ measure prob(" Paris"), logit_diff(" Paris", " Rome"), '
                           f'logit_diff("x", " Rome") }}')
    got = deltalang.run(source, model)
    paris, rome = _logprob(model, ref, " Paris"), _logprob(model, ref, " Rome")
    x = float(ref.run(model.tokenizer(PROMPT, return_tensors="pt").input_ids).value(None, "logits")[0, -1]
              .float().log_softmax(-1)[model.tokenizer("x").input_ids[0]])
    assert math.log(got['t.prob(" Paris")']) == pytest.approx(paris, abs=1e-3)  # log: P is tiny here
    assert got['t.logit_diff(" Paris", " Rome")'] == pytest.approx(paris - rome, abs=1e-3)
    assert got['t.logit_diff("x", " Rome")'] == pytest.approx(x - rome, abs=1e-3)


def test_an_answer_of_several_tokens_after_a_write_sees_the_write_at_every_token(loaded: tuple) -> None:
    model, ref = loaded
    b = model.linear_layers()[-1]
    source = f'''prompt p = "{PROMPT}"
prompt q = "{DONOR}"
trace t on p {{ write L[linear].state_after(4) from q; write L{b}.conv_window_after(-1) = zeros
               measure prob(" Paris") }}
trace clean on p {{ measure prob(" Paris") }}
'''
    got = deltalang.run(source, model)
    tok = model.tokenizer
    donor = ref.run(tok(DONOR, return_tensors="pt").input_ids)
    n = len(tok(PROMPT).input_ids)
    writes = [Write(i, "state_after", set_to(donor.value(i, "state_after", 4)), position=4) for i in ref.linear]
    writes.append(Write(b, "conv_window_after", lambda v, i: torch.zeros_like(v), position=n - 1))
    want = _logprob(model, ref, " Paris", writes)
    assert math.log(got['t.prob(" Paris")']) == pytest.approx(want, abs=1e-3)
    assert abs(math.log(got['clean.prob(" Paris")']) - want) > 1e-2  # the writes change the answer


def test_a_run_measured_only_by_teacher_forcing_is_not_run_beside_it(loaded: tuple) -> None:
    """The forced run carries the measure (and the run's writes): the run itself computes nothing and is not run;
    an answer of one token beside it still reads the run's own logits. Rows counted at the embedding."""
    model, ref = loaded
    rows: list[int] = []
    hook = model._module.get_input_embeddings().register_forward_hook(lambda _m, a, _o: rows.append(a[0].shape[0]))
    try:
        records = [{"prompt": PROMPT}, {"prompt": DONOR}]
        got = deltalang.run('trace t on facts { measure prob(" Paris") }', model, data={"facts": records})
        assert sum(rows) == 2  # one teacher-forced row a record (was 4: each record's own run beside it)
        for r, p in zip(records, got.values('t.prob(" Paris")'), strict=True):
            assert math.log(p) == pytest.approx(_logprob(model, ref, " Paris", prompt=r["prompt"]), abs=1e-3)
        rows.clear()
        got1 = deltalang.run(f'prompt p = "{PROMPT}"\ntrace t on p {{ measure logit_diff("x", " Paris") }}\n', model)
        assert sum(rows) == 2  # the run (for "x") and the teacher-forced " Paris"
        x = float(ref.run(model.tokenizer(PROMPT, return_tensors="pt").input_ids).value(None, "logits")[0, -1]
                  .float().log_softmax(-1)[model.tokenizer("x").input_ids[0]])
        assert got1['t.logit_diff("x", " Paris")'] == pytest.approx(x - _logprob(model, ref, " Paris"), abs=1e-3)
    finally:
        hook.remove()


@pytest.mark.parametrize("body, message", [
    ('measure rank(" Paris")', r'" Paris" is \d+ tokens .*`rank` takes one token'),
    ('write L0.attention_values from q; measure prob(" Paris")', "per-token value `attention_values`"),
])
def test_where_one_token_is_needed_an_answer_of_several_is_one_error(body: str, message: str) -> None:
    model = deltalang.load_model(tiny_checkpoint("qwen3_5"))
    source = f'prompt p = "{PROMPT}"\nprompt q = "The Eiffel Tower is at"\ntrace t on p {{ {body} }}\n'
    with pytest.raises(DeltaError, match=message):
        deltalang.run(source, model)


def test_a_generate_and_a_sweep_take_answers_of_one_token() -> None:
    model = deltalang.load_model(tiny_checkpoint("qwen3_5"))
    for run in ('generate g on p max_new_tokens 2 { measure prob(" Paris") }',
                'sweep s on p over L in L[linear] { write L.state_after(1) = zeros; measure prob(" Paris") }'):
        with pytest.raises(DeltaError, match="takes one token") as info:
            deltalang.check(f'prompt p = "{PROMPT}"\n{run}\n', model)
        assert "teacher forcing" in info.value.render()
