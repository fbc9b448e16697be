"""`generate g on facts max_new_tokens N { ... }`: a generate over a dataset (`deltalang.runs.dataset_generate`).

Ground truth: each record's greedy tokens equal transformers' own `model.generate(do_sample=False)` on that
record's prompt alone (the kernels transformers' modeling module held at import put back around the call), and
with a write at a step, `tests/reference.py` (plain transformers, the write applied by hand) gives the tokens and
each step's logits. Records of one prompt length share a `model.generate` (an invoke each); a record's tokens and
measures must be those of its plain one-prompt program run alone, whichever records share its forward.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import Reference, Write, zeros

import deltalang
from deltalang.cli import main
from deltalang.ground.datasets import dataset_from_python
from deltalang.ground.errors import DeltaError
from deltalang.language import ast
from deltalang.language.parse import parse
from deltalang.language.resolve import resolve_records
from deltalang.language.resolve.dataset import expand
from deltalang.models import families
from deltalang.models.bundled import PATH as BUNDLED
from deltalang.models.testing import load_hf, tiny_checkpoint
from deltalang.runs.dataset_generate import DatasetGeneration
from deltalang.runs.dataset_run import run_dataset
from deltalang.runtime import kernels

ROOT = Path(__file__).parents[1]
LANDMARKS = [json.loads(x) for x in (ROOT / "examples/data/landmarks.jsonl").read_text(encoding="utf-8").splitlines()]
PIZZA = {"prompt": "My favourite food is pizza with", "answer": " cheese", "foil": " Paris",
         "corrupt": "My favourite food is pasta with", "subject": "pizza"}
BUNDLED_RECORDS = [*LANDMARKS[:5], PIZZA]  # five of 8 tokens share a generate, one of 6 runs alone
# the tiny checkpoints' byte tokenizer: a token per byte; two lengths, two records each, one alone
TINY_RECORDS = [{"prompt": p, "answer": a} for p, a in [("abcdefgh", "a"), ("hgfedcba", "b"), ("the cat sat", "c"),
                                                        ("a dog ran!!", "d"), ("xyz", "e")]]
PLAIN = "generate g on facts max_new_tokens {n} {{\n    measure prob(facts.answer)\n}}\n"
WRITES = """generate g on facts max_new_tokens 4 {
    step 1: write L[linear].state_input = zeros
    step 2: write L0.state_input *= 0.5
    measure prob(facts.answer), norm(L0.state_output)
    read tokens
}
"""


@pytest.fixture(scope="module", params=["bundled", "qwen3_5", "kimi_linear"])
def setup(request: pytest.FixtureRequest) -> tuple[deltalang.DeltaModel, Any, list[dict[str, str]]]:
    if request.param == "bundled":
        if not (BUNDLED / "config.json").exists():
            pytest.skip("the bundled model is not built")
        path = BUNDLED
        records = BUNDLED_RECORDS
    else:
        path = tiny_checkpoint(request.param)
        records = TINY_RECORDS
    return deltalang.load_model(path), load_hf(path, dtype=torch.float32).eval(), records


def _groups(source: str, model: deltalang.DeltaModel, records: list[dict[str, str]], **kw: Any) -> tuple[Any, list]:
    sizes: list[list[int]] = []
    out = run_dataset(source, model, data={"facts": records}, on_group=sizes.append, **kw)
    return out, sizes


def _hf_greedy(hf: Any, ids: torch.Tensor, n: int) -> list[int]:
    """transformers' own greedy generate, under the kernels its modeling module held at import."""
    fam = families.for_config(hf.config)
    assert fam is not None
    names = (fam.chunk_kernel, fam.recurrent_kernel)
    saved = {k: getattr(fam.module, k) for k in names}
    try:
        for k in names:
            setattr(fam.module, k, kernels.original(fam, k))
        with torch.no_grad():
            return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
    finally:
        for k in names:
            setattr(fam.module, k, saved[k])


def test_greedy_tokens_are_transformers_own_per_record(setup: Any) -> None:
    model, hf, records = setup
    n = 5
    out, groups = _groups(PLAIN.format(n=n), model, records)
    assert isinstance(out, DatasetGeneration)
    assert max(len(g) for g in groups) > 1  # records of one length shared a generate
    got = {c["record"]: c["token_ids"] for c in out.continuations}
    assert sorted(got) == list(range(len(records)))
    for i, rec in enumerate(records):
        ids = model.tokenizer(rec["prompt"], return_tensors="pt").input_ids
        want = _hf_greedy(hf, ids, n)
        assert got[i] == want, (i, rec["prompt"])
        assert out.continuations[i]["text"] == model.tokenizer.decode(want)
        assert [r["value"] for r in out.rows if r["record"] == i and r["measure"] == "g.tokens"] == want


def _alone(source: str, model: deltalang.DeltaModel, records: list[dict[str, str]], i: int) -> Any:
    """Record i's plain one-prompt program, run alone."""
    program = parse(source)
    ds, _ = resolve_records(program, {"facts": dataset_from_python("facts", records)}, model.spec)
    text = ast.format_program(expand(program, ds, ds.records[i], model.spec))
    return deltalang.run(text, model)


def test_a_record_is_the_same_whichever_records_share_its_forward(setup: Any) -> None:
    model, _, records = setup
    out, groups = _groups(WRITES, model, records)
    assert max(len(g) for g in groups) > 1
    for i in range(len(records)):
        alone = _alone(WRITES, model, records, i)
        assert [c["token_ids"] for c in out.continuations if c["record"] == i] == [alone["g.tokens"][0].tolist()]
        rows = [r for r in out.rows if r["record"] == i and r["measure"] != "g.tokens"]
        assert len(rows) == 8  # two measures at each of four steps
        for r in rows:
            call = r["measure"].split(".", 1)[1].replace("facts.answer", repr(records[i]["answer"]).replace("'", '"'))
            assert abs(r["value"] - float(alone[f"g.step{r['step']}.{call}"])) < 1e-5, (i, r["measure"], r["step"])
    # and batched off: every record alone through the same path
    apart, groups = _groups(WRITES, model, records, batch=False)
    assert max(len(g) for g in groups) == 1
    assert [c["token_ids"] for c in apart.continuations] == [c["token_ids"] for c in out.continuations]
    for a, b in zip(apart.rows, out.rows, strict=True):
        assert (a["record"], a["measure"], a["step"]) == (b["record"], b["measure"], b["step"])
        assert abs(a["value"] - b["value"]) < 1e-5


def test_a_write_at_a_step_against_transformers(setup: Any) -> None:
    """`step 1: write L[linear].state_input = zeros`: the tokens and each step's P(answer) as plain transformers
    gives them with the state zeroed before new token 1, per record."""
    model, hf, records = setup
    src = PLAIN.format(n=4).replace("{\n", "{\n    step 1: write L[linear].state_input = zeros\n", 1)
    out, _ = _groups(src, model, records)
    ref = Reference(hf)
    moved = 0
    for i, rec in enumerate(records):
        ids = model.tokenizer(rec["prompt"], return_tensors="pt").input_ids
        zeroed = [Write(layer, "state_input", zeros, step=1) for layer in ref.linear]
        want = ref.run(ids, zeroed, max_new_tokens=4)
        plain = ref.run(ids, max_new_tokens=4)
        assert [c["token_ids"] for c in out.continuations if c["record"] == i] == [want.new_tokens[0].tolist()]
        answer = model.tokenizer(rec["answer"]).input_ids[-1]
        for r in (r for r in out.rows if r["record"] == i and r["measure"] == "g.prob(facts.answer)"):
            p = want.steps[r["step"]].logits[-1][0, -1].float().softmax(-1)[answer].item()
            assert abs(r["value"] - p) < 1e-5, (i, r["step"])
        moved += want.new_tokens[0].tolist() != plain.new_tokens[0].tolist() or \
            not torch.allclose(want.steps[1].logits[-1], plain.steps[1].logits[-1])
    assert moved  # the write changed what the model does


def test_saved_resumed_and_loaded_back(setup: Any, tmp_path: Path) -> None:
    model, _, records = setup
    if model.spec.family.name != "qwen3_5" or "bundled" in model.spec.model_id:
        pytest.skip("once is enough: the tiny qwen3_5")
    whole = run_dataset(WRITES, model, data={"facts": records}, out=tmp_path / "whole")
    files = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert files == sorted(["results.csv", "continuations.jsonl", "summary.csv", "summary.json", "program.dl",
                            "progress.json"])

    class Stop(Exception):
        pass

    def stop(_: list[int]) -> None:
        raise Stop

    with pytest.raises(Stop):
        run_dataset(WRITES, model, data={"facts": records}, out=tmp_path / "part", on_group=stop)
    assert not (tmp_path / "part" / "results.csv").exists()
    with pytest.raises(DeltaError, match="--resume"):
        run_dataset(WRITES, model, data={"facts": records}, out=tmp_path / "part")
    ran: list[list[int]] = []
    resumed = run_dataset(WRITES, model, data={"facts": records}, out=tmp_path / "part", resume=True,
                          on_group=ran.append)
    assert sum(len(g) for g in ran) < len(records)  # the first group was not rerun
    assert resumed.continuations == whole.continuations
    assert [(r["record"], r["measure"], r["step"]) for r in resumed.rows] == \
        [(r["record"], r["measure"], r["step"]) for r in whole.rows]
    assert [r["value"] for r in resumed.rows] == pytest.approx([r["value"] for r in whole.rows], abs=1e-6)
    loaded = deltalang.load_results(tmp_path / "part")
    assert repr(loaded).startswith("<deltalang saved generate over a dataset: 60 rows")  # 5 x (8 measures + 4 tokens)
    df, mine = loaded.to_pandas(), resumed.to_pandas()
    assert list(df.columns) == list(mine.columns) == ["record", "line", "prompt", "answer", "measure", "step",
                                                      "value"]
    assert df["value"].tolist() == mine["value"].tolist()
    assert df["step"].tolist() == mine["step"].tolist()
    conts = [json.loads(x) for x in (tmp_path / "part" / "continuations.jsonl").read_text().splitlines()]
    assert conts == list(resumed.continuations)
    summary = (tmp_path / "part" / "summary.csv").read_text().splitlines()
    assert summary[0] == "measure,step,mean,std,n,ci_low,ci_high" and len(summary) == 1 + 2 * 4
    shown = repr(resumed)
    assert shown.startswith("<deltalang DatasetGeneration: 5 continuations") and len(shown.splitlines()) <= 12


def test_read_under_a_dataset_generate_is_refused_in_one_line() -> None:
    src = "dataset facts = \"f.jsonl\"\ngenerate g on facts max_new_tokens 2 {\n    step 1: read L0.state_output\n}\n"
    with pytest.raises(DeltaError) as e:
        resolve_records(parse(src), {"facts": dataset_from_python("facts", TINY_RECORDS)},
                        None)  # type: ignore[arg-type]
    assert "a generate over a dataset keeps each record's continuation and measures" in str(e.value)
    assert e.value.span is not None and e.value.span.line == 3


@pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")
def test_check_and_emit_plan_describe_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "facts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in BUNDLED_RECORDS), encoding="utf-8")
    (tmp_path / "g.dl").write_text('dataset facts = "facts.jsonl"\n' + WRITES, encoding="utf-8")
    assert main(["check", str(tmp_path / "g.dl")]) == 0
    got = capsys.readouterr().out
    assert "generate g on facts (8 tokens), max_new_tokens 4" in got and "# 6 of 6 records resolve" in got
    assert "# a generate over a dataset ('g' 4 new tokens): each record's continuation and every measure at every " \
        "step; records of one prompt length share a generate: 2 forward group(s)" in got
    assert main(["emit", "--plan", str(tmp_path / "g.dl")]) == 0
    plan = capsys.readouterr().out
    assert "records 1-5 of 6 of 'facts' share these forwards (2 groups in all;" in plan
    assert "one generate, 5 invoke(s)" in plan and "g#4 on" in plan
    assert main(["emit", str(tmp_path / "g.dl")]) == 0
    code = capsys.readouterr().out
    assert code.count("with tracer.invoke(") == 6  # an invoke per record, then one for every row's tokens


def test_python_side_a_trace_beside_a_generate(setup: Any, tmp_path: Path) -> None:
    """`deltalang.run(..., data=...)` gives a DatasetGeneration; a trace's measure has no step (NaN read back);
    `kl(G)` and `from G` between generates pair steps as in one prompt, record by record."""
    model, _, records = setup
    if model.spec.family.name != "qwen3_5" or "bundled" in model.spec.model_id:
        pytest.skip("once is enough: the tiny qwen3_5")
    src = """trace t on facts {
    measure prob(facts.answer)
}
generate plain on facts max_new_tokens 3 {
    read tokens
}
generate g on facts max_new_tokens 3 {
    step 1: write L[linear].state_input = zeros
    step 2: write L[linear].state_input from plain
    measure kl(plain)
    step 0: measure kl(t)
}
"""
    out = deltalang.run(src, model, data={"facts": records}, out=tmp_path / "o")
    assert isinstance(out, DatasetGeneration)
    assert {c["run"] for c in out.continuations} == {"plain", "g"}
    for i in range(len(records)):
        alone = _alone(src, model, records, i)
        mine = {(r["measure"], r["step"]): r["value"] for r in out.rows if r["record"] == i}
        assert mine[("t.prob(facts.answer)", "")] == pytest.approx(float(alone[f't.prob("{records[i]["answer"]}")']),
                                                                   abs=1e-5)
        for k in range(3):
            assert mine[("g.kl(plain)", k)] == pytest.approx(float(alone[f"g.step{k}.kl(plain)"]), abs=1e-5)
        assert mine[("g.kl(t)", 0)] == pytest.approx(0.0, abs=1e-5)  # step 0 predicts what the trace does
        assert [c["token_ids"] for c in out.continuations if c["record"] == i and c["run"] == "plain"] == \
            [alone["plain.tokens"][0].tolist()]
    assert out.values("g.kl(plain)", 0) == pytest.approx([0.0] * len(records), abs=1e-5)  # nothing written yet
    assert max(out.values("g.kl(plain)", 1)) > 1e-3  # the zeroed state moved the distribution
    df, back = out.to_pandas(), deltalang.load_results(tmp_path / "o").to_pandas()
    assert list(df.columns) == list(back.columns)
    assert df["step"].isna().tolist() == back["step"].isna().tolist() and df["step"].isna().any()
    assert df["value"].tolist() == back["value"].tolist()
    assert "g.kl(plain)" in repr(out) and len(repr(out).splitlines()) <= 12


def test_a_sampled_generate_runs_each_record_alone_with_its_seed(setup: Any) -> None:
    """Sampling draws from torch's random state: a record sharing a batch would draw other numbers, so a sampled
    generate runs alone, and each record's tokens are those of its one-prompt program with the same seed."""
    model, _, records = setup
    if model.spec.family.name != "qwen3_5" or "bundled" in model.spec.model_id:
        pytest.skip("once is enough: the tiny qwen3_5")
    src = "generate g on facts max_new_tokens 5 temperature 2.0 seed 4 {\n    measure prob(facts.answer)\n}\n"
    out, groups = _groups(src, model, records)
    assert max(len(g) for g in groups) == 1
    greedy, _ = _groups(PLAIN.format(n=5), model, records)
    for i in range(len(records)):
        alone = _alone(src.replace("{\n", "{\n    read tokens\n", 1), model, records, i)
        assert [c["token_ids"] for c in out.continuations if c["record"] == i] == [alone["g.tokens"][0].tolist()]
    assert [c["token_ids"] for c in out.continuations] != [c["token_ids"] for c in greedy.continuations]


def test_groups_hold_one_prompt_length_and_a_bounded_number_of_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from deltalang.runs import dataset_generate

    spec = deltalang.load_spec(None)
    records = [*LANDMARKS[:7], PIZZA]
    _, recs = resolve_records(parse(PLAIN.format(n=2)), {"facts": dataset_from_python("facts", records)}, spec)
    assert [[r.record.index for r in g] for g in dataset_generate.generate_groups(recs, True)] == \
        [[7], list(range(7))]
    monkeypatch.setattr(dataset_generate, "BATCH_TOKENS", 24)  # three prompts of 8 tokens a generate
    assert [len(g) for g in dataset_generate.generate_groups(recs, True)] == [1, 3, 3, 1]
    assert [len(g) for g in dataset_generate.generate_groups(recs, False)] == [1] * 8


DONOR_STATE = """generate g on facts max_new_tokens 3 {
    step 1: write L[linear].state_input from facts.corrupt.state_output
    measure prob(facts.answer)
}
"""


def test_a_decode_step_takes_each_records_donor_state(setup: Any) -> None:
    """`step 1: write L[linear].state_input from facts.corrupt.state_output`: per record, the state the donor
    field's prompt leaves after its last token (transformers' cache after that prompt) starts new token 1's step
    in every linear block, the clean prompt's cache otherwise kept (its convolution windows, its attention);
    each step's P(answer) and the tokens as transformers gives them from that cache."""
    from reference import hf_forward, output_cache

    from deltalang.models.internals import cache as hf_cache

    model, hf, records = setup
    records = [{**r, "corrupt": r.get("corrupt", r["prompt"][::-1] + "zz")} for r in records]
    out, _ = _groups(DONOR_STATE, model, records)
    fam = families.for_config(hf.config)
    assert fam is not None
    names = (fam.chunk_kernel, fam.recurrent_kernel)
    saved = {k: getattr(fam.module, k) for k in names}
    linear = model.spec.layers_of("linear")
    assert linear
    moved = 0
    try:
        for k in names:  # transformers' own kernels, as its modeling module held them at import
            setattr(fam.module, k, kernels.original(fam, k))
        for i, rec in enumerate(records):
            ids = model.tokenizer(rec["prompt"], return_tensors="pt").input_ids
            donor = output_cache(hf_forward(hf, model.tokenizer(rec["corrupt"], return_tensors="pt").input_ids))
            first = hf_forward(hf, ids)
            cache = output_cache(first)
            logits = [first.logits[0, -1].float()]
            tokens = [int(logits[0].argmax())]
            plain = hf_forward(hf, torch.tensor([tokens[:1]]), output_cache(hf_forward(hf, ids)), start=ids.shape[1])
            for layer in linear:
                state = hf_cache.recurrent_state(cache, layer)
                assert state is not None
                state.copy_(hf_cache.recurrent_state(donor, layer))
            for k in (1, 2):
                step = hf_forward(hf, torch.tensor([tokens[-1:]]), cache, start=ids.shape[1] + k - 1)
                cache = output_cache(step)
                logits.append(step.logits[0, -1].float())
                tokens.append(int(logits[-1].argmax()))
            assert [c["token_ids"] for c in out.continuations if c["record"] == i] == [tokens]
            answer = model.tokenizer(rec["answer"]).input_ids[-1]
            got = {r["step"]: r["value"] for r in out.rows
                   if r["record"] == i and r["measure"] == "g.prob(facts.answer)"}
            assert sorted(got) == [0, 1, 2]
            for k, v in got.items():
                assert v == pytest.approx(logits[k].softmax(-1)[answer].item(), abs=1e-5), (i, k)
            moved += not torch.allclose(plain.logits[0, -1].float(), logits[1], atol=1e-4)
    finally:
        for k in names:
            setattr(fam.module, k, saved[k])
    assert moved  # the donor's state changed what the model does at step 1
