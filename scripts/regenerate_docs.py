"""Regenerate every output README.md and the pages of docs/ show, from what deltalang prints now.

    python scripts/regenerate_docs.py            # rewrite the pages in place
    python scripts/regenerate_docs.py --check    # exit 1 and list the outputs that differ (as text)

What a page (`PAGES`) shows, and how it is paired with its program (tests/test_docs.py reads the same pairs):
- a `text` block right after a `dl` block, whose first line is `$ deltalang COMMAND FILE ...`, is what COMMAND
  prints for that program written to FILE, in a fresh directory holding the page's data blocks (info string
  `jsonl FILE`, `csv FILE`, `tsv FILE`); stdout when it succeeds, stderr when it fails;
- any other fenced block whose first line is `$ deltalang ...` is what that command prints, run from the
  repository root (the files it names are the repository's); a block of `== deltalang run examples/FILE.dl`
  parts holds, under each, what that command prints.

Each command runs in this process (`deltalang.cli.main`), on the bundled model. docs/benchmarks.md is not a
page here: its tables are measurements, rerun by the commands it gives.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
README, LANGUAGE = ROOT / "README.md", ROOT / "docs" / "language.md"
# every page but docs/benchmarks.md, whose tables are measurements
PAGES = (README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md"))
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
ERROR_LINE = re.compile(r"^\S+:\d+:\d+: error: ", re.M)


class Shown(NamedTuple):
    """One output a page shows: the command (after `deltalang`), what the page prints, where it stands."""

    line: int  # the line of the page where the shown output's block starts
    command: tuple[str, ...]
    shown: str
    start: int  # the shown text's span in the page (what `regenerate` replaces)
    end: int
    program: str | None = None  # docs/language.md: the program written to the command's FILE

    @property
    def fails(self) -> bool:
        return ERROR_LINE.search(self.shown) is not None


def language_outputs(text: str) -> list[Shown]:
    """A page's outputs of its own programs: each `$ deltalang ...` text block right after a `dl` block."""
    fences = list(FENCE.finditer(text))
    out = []
    for m, nxt in zip(fences, fences[1:]):
        if m[1].strip() != "dl" or nxt[1].strip() != "text" or text[m.end():nxt.start()].strip():
            continue
        first, _, rest = nxt[2].partition("\n")
        if first.startswith("$ deltalang "):
            start = nxt.start(2) + len(first) + 1
            out.append(Shown(text.count("\n", 0, nxt.start()) + 1, tuple(shlex.split(first)[2:]), rest, start,
                             nxt.end(2), m[2]))
    return out


def data_files(text: str) -> dict[str, str]:
    """{file name: text} of a page's data blocks (info string `jsonl FILE`, `csv FILE` or `tsv FILE`)."""
    out = {}
    for m in FENCE.finditer(text):
        words = m[1].split()
        if len(words) == 2 and words[0] in ("jsonl", "csv", "tsv"):
            out[words[1]] = m[2]
    return out


def readme_outputs(text: str) -> list[Shown]:
    """Outputs run from the root: blocks starting `$ deltalang ...`, and each part of an `== deltalang run` block."""
    out = []
    for m in FENCE.finditer(text):
        first, _, rest = m[2].partition("\n")
        line = text.count("\n", 0, m.start()) + 1
        if first.startswith("$ deltalang "):
            out.append(Shown(line, tuple(shlex.split(first)[2:]), rest, m.start(2) + len(first) + 1, m.end(2)))
        elif first.startswith("== deltalang run "):
            for part in re.finditer(r"^== deltalang (run \S+)\n(.*?)(?=^== |\Z)", m[2], re.M | re.S):
                out.append(Shown(line, tuple(shlex.split(part[1])), part[2], m.start(2) + part.start(2),
                                 m.start(2) + part.end(2)))
    return out


def run_command(command: tuple[str, ...], cwd: Path) -> tuple[int, str]:
    """(exit status, what the page shows: stdout on success, stderr on failure) of `deltalang COMMAND` in `cwd`."""
    from deltalang.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(command))
            except SystemExit as e:  # argparse
                rc = e.code if isinstance(e.code, int) else 2
    finally:
        os.chdir(here)
    return rc, (out.getvalue() if rc == 0 else err.getvalue()).rstrip("\n") + "\n"


def printed(page: Path, shown: Shown, data: dict[str, str]) -> tuple[int, str]:
    """What deltalang prints now for one shown output of `page`."""
    if shown.program is None:
        return run_command(shown.command, ROOT)
    with tempfile.TemporaryDirectory(prefix="deltalang-docs-") as tmp:
        for name, body in data.items():
            (Path(tmp) / name).write_text(body, encoding="utf-8")
        (Path(tmp) / shown.command[1]).write_text(shown.program, encoding="utf-8")
        return run_command(shown.command, Path(tmp))


def outputs(page: Path) -> tuple[list[Shown], dict[str, str]]:
    """A page's shown outputs in page order (a program's own, then those run from the root), its data files."""
    text = page.read_text(encoding="utf-8")
    paired = language_outputs(text)
    taken = {s.start for s in paired}
    rooted = [s for s in readme_outputs(text) if s.start not in taken]
    return sorted(paired + rooted, key=lambda s: s.start), data_files(text)


def regenerate(page: Path, check: bool, say: Callable[[str], None] = print) -> int:
    """Rewrite `page`'s outputs from what deltalang prints now (`check`: only say which differ); the count."""
    text = page.read_text(encoding="utf-8")
    shown, data = outputs(page)
    changed = 0
    for s in reversed(shown):  # from the end, so earlier spans stay where they are
        _, got = printed(page, s, data)
        if got.rstrip("\n") != s.shown.rstrip("\n"):
            changed += 1
            say(f"{page.relative_to(ROOT)}:{s.line}: deltalang {shlex.join(s.command)} prints another output")
            text = text[:s.start] + got + text[s.end:]
    if not check and changed:
        page.write_text(text, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="say which outputs differ; change nothing")
    args = parser.parse_args(argv)
    os.environ.setdefault("COLUMNS", "200")
    changed = sum(regenerate(page, args.check) for page in PAGES if page.exists())
    print(f"{changed} output(s) {'differ' if args.check else 'regenerated'}", file=sys.stderr)
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
