"""The language reference, docs/language.md, runs: its programs check and run, its outputs are deltalang's.

Every fenced `dl` block of the page is a complete program for the bundled model, run in a fresh
directory that holds the page's data files (a block whose info string is `jsonl FILE`, `csv FILE` or
`tsv FILE` is written there as FILE). A `text` block right after a program, whose first line is
`$ deltalang COMMAND FILE ...`, shows what that command prints for it: the test writes the program
to FILE there, runs the command in-process, and compares line by line (text exactly, each
decimal number to one unit of its last printed digit, the only slack: float32 sums differ
between CPUs): stdout when the command succeeds, stderr when it fails, and it must fail
(exit 1) exactly when the shown output has an `error:` line. Every other program must check
without an error or warning and run. README.md's outputs (each block starting `$ deltalang ...`
and `== deltalang run` blocks), and those of the other pages of docs/ (scripts/regenerate_docs.py's
`PAGES`), are compared the same way, run from the repository root; a `dl` block opening with
`# examples/FILE.dl` must be that file. `python scripts/regenerate_docs.py` rewrites every shown
output from what deltalang prints now; its pairing of programs with outputs is the one tested here.

The page's statements about units are checked against transformers itself
(`tests/reference.py`), never against deltalang's own output; and every statement,
keyword, measure, route, block kind and value the code knows must be named on the page.
"""

from __future__ import annotations

import importlib
import re
import shlex
import sys
import warnings
from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F
from reference import Reference, Write, zeros
from test_cli import cli
from test_examples import CELL_ATOL, DECIMAL, number_matches

import deltalang
from deltalang.ground.errors import DeltaWarning
from deltalang.models import values
from deltalang.models.bundled import PATH as BUNDLED
from deltalang.models.bundled import world

parse = importlib.import_module("deltalang.language.parse")  # `deltalang.parse` is also the function

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import regenerate_docs as regen  # noqa: E402 - the script that writes the outputs the pages show

DOC = ROOT / "docs" / "language.md"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
ERROR_LINE = re.compile(r"^\S+:\d+:\d+: error: ", re.M)

bundled = pytest.mark.skipif(not (BUNDLED / "config.json").exists(), reason="the bundled model is not built")


@attrs.frozen
class Example:
    """A `dl` block of the page (`line`: where its text starts), with the output shown after it, if any."""

    line: int
    program: str
    command: tuple[str, ...] = ()  # ("check", "sources.dl"): the shown command, after `deltalang`
    shown: str | None = None  # the output lines under the command
    shown_block: str = ""  # the whole shown block as it stands in the page

    @property
    def fails(self) -> bool:
        """Whether the shown output is a refusal (an `error:` line)."""
        return self.shown is not None and ERROR_LINE.search(self.shown) is not None


def examples(text: str) -> list[Example]:
    """Every `dl` block of `text`, each with the `$ deltalang ...` output block right after it, if any."""
    fences = list(FENCE.finditer(text))
    out: list[Example] = []
    for i, m in enumerate(fences):
        if m[1].strip() != "dl":
            continue
        line = text.count("\n", 0, m.start(2)) + 1
        nxt = fences[i + 1] if i + 1 < len(fences) else None
        if nxt is not None and nxt[1].strip() == "text" and not text[m.end():nxt.start()].strip():
            first, _, rest = nxt[2].partition("\n")
            if first.startswith("$ deltalang "):
                out.append(Example(line, m[2], tuple(shlex.split(first)[2:]), rest, nxt[0]))
                continue
        out.append(Example(line, m[2]))
    return out


EXAMPLES = examples(DOC.read_text(encoding="utf-8"))
DATA = regen.data_files(DOC.read_text(encoding="utf-8"))
SHOWN = [e for e in EXAMPLES if e.shown is not None]
PLAIN = [e for e in EXAMPLES if e.shown is None or (e.command[0] == "check" and not e.fails)]  # SHOWN runs the rest


def assert_line_matches(got: str, want: str, atol: float = 0.0) -> None:
    """The same text, and each decimal number within one unit of its last printed digit, RTOL or `atol`; given
    `atol` (a sweep's grid), the spaces between columns may differ by a sign's width (a cell near 0 changes sign)."""
    layout = (lambda s: " ".join(DECIMAL.sub("#", s).split())) if atol else (lambda s: DECIMAL.sub("#", s).rstrip())
    assert layout(got) == layout(want), f"\n got: {got}\nwant: {want}"
    for g, w in zip(DECIMAL.findall(got), DECIMAL.findall(want), strict=True):
        assert number_matches(g, w, atol), f"{g}, the page: {w}\n got: {got}\nwant: {want}"


def compare(got: str, shown: str, command: tuple[str, ...] = ()) -> None:
    """`got` (what deltalang printed) against `shown` (the page), line by line; a sweep's cells (`command`
    `sweep ...`) are differences of measures, within CELL_ATOL absolute too."""
    atol = CELL_ATOL if command[:1] == ("sweep",) else 0.0
    got_lines, shown_lines = got.rstrip("\n").split("\n"), shown.rstrip("\n").split("\n")
    for g, s in zip(got_lines, shown_lines):
        assert_line_matches(g, s, atol)
    assert len(got_lines) == len(shown_lines), f"deltalang printed:\n{got}\nthe page shows:\n{shown}"


@pytest.fixture(scope="module")
def model() -> deltalang.DeltaModel:
    return deltalang.load_model()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh directory, made current, holding the page's data files."""
    for name, text in DATA.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_page_has_examples_and_outputs() -> None:
    assert len(EXAMPLES) >= 10 and len(SHOWN) >= 6
    assert {e.command[0] for e in SHOWN} == {"check", "run", "sweep"}
    assert any(e.fails for e in SHOWN)
    assert all(len(e.command) >= 2 and e.command[1].endswith(".dl") for e in SHOWN)


def test_the_comparison_can_fail() -> None:
    shown = "p_paris                                          0.999998\nmemory.L0      0.0232752"
    compare(shown, shown)
    for got in ("p_paris                                          0.999998",  # a line missing
                shown + "\nmemory.L1      0.8",  # a line more
                shown.replace("L0", "L1"), shown.replace("0.999998", "0.999950")):
        with pytest.raises(AssertionError):
            compare(got, shown)
    compare(shown.replace("0.999998", "0.999997"), shown)  # the last digit, between CPUs
    compare("patched.prob  0.000334519", "patched.prob  0.000334516")  # 1 and 2 threads: within RTOL
    with pytest.raises(AssertionError):  # beyond RTOL (1e-5) of the number and 100 units of its last digit
        compare("steered.prob  8.05854e-08", "steered.prob  8.05954e-08")
    grid = "L1               0.0001123        -0.0004015         0.0001085         5.500e-05"
    compare(grid.replace("5.500e-05", "5.502e-05"), grid, ("sweep", "x.dl"))  # a cell: float32 rounding of 1
    compare(grid.replace("         5.500e-05", "        -1.000e-08"), grid.replace("5.500e-05", "2.000e-08"),
            ("sweep", "x.dl"))  # a cell near 0 changing sign moves its column's spaces
    with pytest.raises(AssertionError):  # the same outside a sweep's grid
        compare(grid.replace("5.500e-05", "5.502e-05"), grid, ("run", "x.dl"))
    with pytest.raises(AssertionError):  # a cell off by more than a float32 epsilon
        compare(grid.replace("5.500e-05", "5.540e-05"), grid, ("sweep", "x.dl"))
    page = "```dl\nread L0.states\n```\n\n```text\n$ deltalang run x.dl\nmain.L0.states  1\n```\n"
    (ex,) = examples(page)
    assert ex.command == ("run", "x.dl") and ex.shown == "main.L0.states  1\n" and not ex.fails
    assert examples(page.replace("$ deltalang", "$ python"))[0].shown is None
    assert regen.data_files(page + '```jsonl f.jsonl\n{"prompt": "x"}\n```\n') == {"f.jsonl": '{"prompt": "x"}\n'}


@bundled
@pytest.mark.parametrize("ex", PLAIN, ids=lambda e: f"line{e.line}")
def test_every_program_on_the_page_checks_and_runs(ex: Example, model: deltalang.DeltaModel, workdir: Path) -> None:
    with warnings.catch_warnings():
        # no warning the page does not show (or that check's note shown there announces for the run)
        if ex.shown is None or ("warning:" not in ex.shown and "the run warns" not in ex.shown):
            warnings.simplefilter("error", DeltaWarning)
        prompt = ex.command[ex.command.index("--prompt") + 1] if "--prompt" in ex.command else None
        filename = str(workdir / "example.dl")
        deltalang.check(ex.program, model, prompt=prompt, filename=filename)
        results = deltalang.run(ex.program, model=model, prompt=prompt, filename=filename)
    assert len(results) > 0


@bundled
@pytest.mark.parametrize("ex", SHOWN, ids=lambda e: f"line{e.line}-{e.command[0]}")
def test_the_page_shows_what_deltalang_prints(ex: Example, workdir: Path) -> None:
    Path(ex.command[1]).write_text(ex.program, encoding="utf-8")
    rc, out, err = cli(*ex.command)
    got = out if rc == 0 else err
    assert "Traceback" not in err and "internal error" not in err
    assert rc == (1 if ex.fails else 0), got
    assert ex.shown is not None
    compare(got, ex.shown, ex.command)


def test_the_script_pairs_programs_and_outputs_as_the_test_does() -> None:
    page = regen.language_outputs(DOC.read_text(encoding="utf-8"))
    assert [(s.command, s.shown, s.program) for s in page] == [(e.command, e.shown, e.program) for e in SHOWN]


# Every page's outputs run from the repository root (README.md, docs/examples.md, ...), and programs of pages
# other than docs/language.md followed by their output.
PAGES = [p for p in regen.PAGES if p.exists()]
ROOTED = [(p, s) for p in PAGES for s in regen.outputs(p)[0] if s.program is None]
PAIRED = [(p, s) for p in PAGES if p != DOC for s in regen.outputs(p)[0] if s.program is not None]
README_SHOWN = [s for p, s in ROOTED if p.name == "README.md"]


def test_the_readme_and_docs_show_outputs_of_every_kind() -> None:
    assert {"check", "run"} <= {s.command[0] for s in README_SHOWN} and any(s.fails for s in README_SHOWN)
    assert "emit" in {s.command[0] for _, s in ROOTED}
    examples = {s.command[1] for _, s in ROOTED if s.command[0] == "run"}
    assert {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.dl")
            if not p.stem.startswith(("sweep", "causal_trace"))} <= examples


def _page_id(item: tuple[Path, regen.Shown]) -> str:
    return f"{item[0].stem}-line{item[1].line}-{'-'.join(item[1].command[:2])}"


@bundled
@pytest.mark.parametrize("item", ROOTED, ids=_page_id)
def test_every_page_shows_what_deltalang_prints(item: tuple[Path, regen.Shown]) -> None:
    _, shown = item
    rc, got = regen.run_command(shown.command, ROOT)
    assert "Traceback" not in got and "internal error" not in got
    assert rc == (1 if shown.fails else 0), got
    compare(got, shown.shown, tuple(shown.command))


@bundled
@pytest.mark.parametrize("item", PAIRED, ids=_page_id)
def test_every_pages_programs_print_what_it_shows(item: tuple[Path, regen.Shown]) -> None:
    page, shown = item
    rc, got = regen.printed(page, shown, regen.data_files(page.read_text(encoding="utf-8")))
    assert "Traceback" not in got and "internal error" not in got
    assert rc == (1 if shown.fails else 0), got
    compare(got, shown.shown, tuple(shown.command))


SHOWN_FILE = re.compile(r"\A# (examples/\w+\.dl)\n")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_a_shown_example_file_is_that_file(page: Path) -> None:
    """A `dl` block opening `# examples/FILE.dl` shows FILE as it is, less its opening comment."""
    for m in FENCE.finditer(page.read_text(encoding="utf-8")):
        head = SHOWN_FILE.match(m[2])
        if m[1].strip() == "dl" and head:
            body = (ROOT / head[1]).read_text(encoding="utf-8").split("\n")
            while body and (body[0].startswith("#") or not body[0].strip()):
                body.pop(0)
            assert m[2][head.end():] == "\n".join(body), f"{page.name} shows {head[1]} otherwise than the file"


def test_the_shown_file_check_can_fail(tmp_path: Path) -> None:
    fake = tmp_path / "x.md"
    fake.write_text("```dl\n# examples/eiffel.dl\nprompt clean = \"x\"\n```\n", encoding="utf-8")
    with pytest.raises(AssertionError):
        test_a_shown_example_file_is_that_file(fake)


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


@pytest.mark.parametrize("kind, words", [
    ("statement or declaration", parse.STATEMENTS), ("keyword", tuple(parse.KEYWORDS)),
    ("measure", parse.MEASURES), ("route", parse.KERNELS), ("block kind", parse.BLOCK_KINDS),
    ("value", tuple(values.CATALOGUE)), ("model-level value", tuple(values.MODEL_VALUES)),
])
def test_the_page_names_everything_the_language_has(kind: str, words: tuple[str, ...]) -> None:
    spans = backticked(DOC.read_text(encoding="utf-8"))
    missing = [w for w in words if not any(re.search(rf"(?<![\w.]){re.escape(w)}(?!\w)", s) for s in spans)]
    assert not missing, f"docs/language.md does not name the {kind}(s) {missing}"


# ---- the units the page states, against transformers -------------------------------------------

CLEAN = world.EIFFEL_PROMPT
UNITS = f"""prompt clean = "{CLEAN}"
trace base on clean {{
    measure prob(" Paris"), rank(" Paris"), rank(" Rome"), logit_diff(" Paris", " Rome")
    measure norm(L0.state_output), norm(L0.attention_output), norm(L0.states)
}}
trace patched on clean {{
    write L[linear].state_after(-2) = zeros
    measure kl(base)
}}
"""


@bundled
def test_the_measures_have_the_units_the_page_states(model: deltalang.DeltaModel, ref: Reference) -> None:
    """prob: softmax; rank: 0-based count of larger logits; logit_diff: raw logits; kl(base) in patched:
    KL(base || patched) in nats; norm: Frobenius over all but the batch, per token for `states`."""
    ids = model.tokenizer(CLEAN, return_tensors="pt").input_ids
    n = ids.shape[1]
    base = ref.run(ids)
    patched = ref.run(ids, [Write(i, "state_after", zeros, n - 2) for i in ref.linear])
    last = base.value(None, "logits")[0, -1].float()
    p_last = patched.value(None, "logits")[0, -1].float()
    paris, rome = (model.tokenizer(t, add_special_tokens=False).input_ids[0] for t in (" Paris", " Rome"))
    r = deltalang.run(UNITS, model=model)
    assert r['base.prob(" Paris")'] == pytest.approx(float(last.softmax(-1)[paris]), abs=1e-6)
    assert r['base.rank(" Paris")'] == 0 == int((last > last[paris]).sum())
    assert r['base.rank(" Rome")'] == int((last > last[rome]).sum()) > 0
    assert r['base.logit_diff(" Paris", " Rome")'] == pytest.approx(float(last[paris] - last[rome]), rel=1e-4)
    kl_nats = float(F.kl_div(p_last.log_softmax(-1), last.log_softmax(-1), log_target=True, reduction="sum"))
    reverse = float(F.kl_div(last.log_softmax(-1), p_last.log_softmax(-1), log_target=True, reduction="sum"))
    assert abs(kl_nats - reverse) > 0.05 * kl_nats > 0  # the direction is visible on this write
    assert r["patched.kl(base)"] == pytest.approx(kl_nats, rel=1e-3)
    assert r["base.norm(L0.state_output)"] == pytest.approx(float(base.value(0, "state_output").norm()), rel=1e-4)
    assert r["base.norm(L0.attention_output)"] == pytest.approx(float(base.value(0, "attention_output").norm()),
                                                                rel=1e-4)
    per_token = base.value(0, "states")[0].flatten(1).norm(dim=-1)
    assert torch.allclose(torch.as_tensor(r["base.norm(L0.states)"]).flatten(), per_token, rtol=1e-4, atol=1e-7)


def test_the_readme_is_a_front_page_and_its_links_resolve() -> None:
    """Issue 27: the README stays short enough to read in ten minutes, and every relative link it has
    names a file of the repository (the rest of what it once held lives in docs/)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), target


def test_the_readmes_save_comment_names_the_files_it_writes(tmp_path: Path) -> None:
    """README's `results.save("out/")  # FILES` names what saving the results of the program on the line above
    writes (a program that only measures writes no results.safetensors)."""
    import re

    import deltalang

    lines = (ROOT / "README.md").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith('results.save("out/")'))
    program = re.search(r'open\("([^"]+)"\)', lines[at - 1])
    assert program is not None, lines[at - 1]
    comment = lines[at].split("#", 1)[1]
    shown = {f.strip() for f in re.sub(r"\(.*\)", "", comment).split(",")}  # (what a program that reads adds)
    results = deltalang.run((ROOT / program.group(1)).read_text(), model=deltalang.load_model())
    results.save(tmp_path / "out")
    assert shown == {p.name for p in (tmp_path / "out").iterdir()}
