"""What deltalang shows in a notebook: HTML pieces and a progress line updated in place.

Pure rendering, no model and no torch: every function returns a self-contained HTML fragment (no script,
no external file; images as `data:` PNG URIs), every text escaped, the same in JupyterLab, classic
Jupyter, VS Code and GitHub's `.ipynb` view. `summary_table` renders a `Results.summary()` text as rows
of (result, value), its closing note as the caption; `dataset_table` a `DatasetResults`' statistics and
records left out; `NotebookProgress(total)` one output updated in place (no ipywidgets; IPython imported
only when used); `progress_bar` the one progress line of the command line (rich) and notebooks. The `_repr_html_` of `Results`, `DatasetResults` and sweep tables call these.
"""

from __future__ import annotations

import base64
import html as _html
import time
from collections.abc import Container, Iterable, Sequence
from typing import Any, Self

from . import display

# the few styles a table needs, inline so that a sanitised renderer keeps them
_CELL = "text-align:{align};vertical-align:top"
_PROGRESS_EVERY_S = 0.25  # at most this often an update of the progress output (the last one always)


def escape(text: object) -> str:
    return _html.escape(str(text), quote=True)


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], *, title: str | None = None,
          caption: str | None = None, right: Iterable[int] = ()) -> str:
    """An HTML table: `headers`, `rows` of cells (escaped; a cell's lines kept), columns in `right` right-aligned."""
    right_ = set(right)

    def cell(tag: str, i: int, value: object) -> str:
        style = _CELL.format(align="right" if i in right_ else "left")
        return f'<{tag} style="{style}">{escape(value).replace(chr(10), "<br/>")}</{tag}>'

    head = "".join(cell("th", i, h) for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>" for row in rows)
    out = [f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"]
    if title:
        out.insert(0, f"<div><b>{escape(title)}</b></div>")
    if caption:
        out.append(f"<div><small>{escape(caption)}</small></div>")
    return "<div>" + "".join(out) + "</div>"


def image(png: bytes, alt: str) -> str:
    """An inline PNG (a `data:` URI)."""
    data = base64.b64encode(png).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{escape(alt)}"/>'


def pre(text: str) -> str:
    return f"<pre>{escape(text)}</pre>"


def summary_rows(summary: str, names: Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """(rows of (name, value text), closing notes) of a summary whose lines each start with a result name.

    A line belongs to the next name when it starts with that name and a space, else it
    continues the current row (a per-token norm's token lines, a second prompt's line);
    lines before the first name or after the last row's own lines that start with '('
    are notes.
    """
    rows: list[tuple[str, list[str]]] = []
    notes: list[str] = []
    i = 0
    for line in summary.splitlines():
        if i < len(names) and line.startswith(names[i] + " "):
            rows.append((names[i], [line[len(names[i]):].strip()]))
            i += 1
        elif rows and line.startswith(rows[-1][0] + " "):
            rows[-1][1].append(line[len(rows[-1][0]):].strip())
        elif rows and line.startswith(" "):
            rows[-1][1].append(line.strip())
        elif line.strip():
            notes.append(line.strip())
    return [(name, "\n".join(parts)) for name, parts in rows], notes


def summary_table(summary: str, names: Sequence[str], *, title: str | None = None,
                  keep: Container[str] | None = None) -> str:
    """A `Results.summary()` as an HTML table of (result, value) (see `summary_rows`); `keep`: only these rows."""
    rows, notes = summary_rows(summary, names)
    if keep is not None:
        rows = [r for r in rows if r[0] in keep]
    return table(["result", "value"], rows, title=title, caption=" ".join(notes) or None)


def stats_cells(s: Any) -> tuple[str, str, int, str]:
    """mean, std, n, 95% CI of a `MeasureStats` (or anything with its fields) as table cells (`display.number`)."""
    n = display.number
    return n(s.mean), n(s.std), s.n, f"[{n(s.ci_low)}, {n(s.ci_high)}]"


def dataset_table(results: Any) -> str:
    """A `DatasetResults` as HTML: per-measure statistics, then the records left out (if any)."""
    ds = results.dataset
    n = len(ds.records)
    ran = n - len(results.skipped)
    stats = table(["measure", "mean", "std", "n", "95% CI"],
                  [(s.measure, *stats_cells(s))
                   for s in results.stats],
                  title=f"{ran} of {n} records of '{ds.name}'", right=(1, 2, 3, 4))
    if not results.skipped:
        return stats
    left = table(["record", "why"], [(ds.where(ds.records[i]), why) for i, why in results.skipped],
                 title=f"left out {len(results.skipped)} of {n} records (strict=True stops instead)")
    return stats + left


class NotebookProgress:
    """A sweep's progress in a notebook: one output (text and `<progress>`) updated in place.

    The interface `sweep.driver` uses of rich's `Progress`: a context manager and
    `update(task, advance=, description=)`.
    """

    def __init__(self, total: int, unit: str = "cells") -> None:
        self.total = total
        self.unit = unit
        self.done = 0
        self.description = "sweep"
        self.handle: Any = None
        self.start = self.last = 0.0

    def __enter__(self) -> NotebookProgress:
        from IPython.display import display

        self.start = time.perf_counter()
        self.handle = display(self.line(), display_id=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._show(force=True)

    def update(self, task: object, *, advance: int = 0, description: str | None = None) -> None:
        self.done += advance
        if description is not None:
            self.description = description
        self._show(force=self.done >= self.total)

    def _show(self, force: bool) -> None:
        now = time.perf_counter()
        if self.handle is None or (not force and now - self.last < _PROGRESS_EVERY_S):
            return
        self.last = now
        self.handle.update(self.line())

    def line(self) -> _Line:
        return _Line(self.text(), self.done, self.total)

    def text(self) -> str:
        """`ablate: 24/48 cells, 3.10 cells/s, 0:07 elapsed, 0:08 left`."""
        elapsed = max(0.0, time.perf_counter() - self.start) if self.start else 0.0
        rate = self.done / elapsed if elapsed > 0 and self.done else None
        out = f"{self.description}: {self.done}/{self.total} {self.unit}"
        if rate is not None:
            out += f", {rate:.2f} {self.unit}/s"
        out += f", {_clock(elapsed)} elapsed"
        if rate is not None and self.done < self.total:
            out += f", {_clock((self.total - self.done) / rate)} left"
        return out


class _Line:
    """One progress output: plain text for text front ends, and a `<progress>` bar with it in HTML."""

    def __init__(self, text: str, done: int, total: int) -> None:
        self.text, self.done, self.total = text, done, total

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return f'<progress value="{self.done}" max="{self.total}"></progress> <code>{escape(self.text)}</code>'


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class ProgressDisplay:
    """What the progress displays of sweeps and dataset runs share: `bar` (a rich `Progress`, a
    `NotebookProgress`, or None when nothing is shown), entered and left with the display."""

    bar: Any = None

    def __enter__(self) -> Self:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def progress_bar(console: Any, total: int, unit: str, description: str) -> tuple[Any, Any]:
    """`(bar, task)`: the one progress line of the command line and notebooks (rich's `Progress` on a console's
    stream, updated in place: done/total, rate, elapsed, left; in a notebook a `NotebookProgress`), or
    `(None, None)` without a console or with nothing to count. `bar.update(task, advance=N)` moves it."""
    if console is None or total <= 0:
        return None, None
    if console.is_jupyter:  # rich's live display needs ipywidgets there, and warns without it
        bar = NotebookProgress(total, unit)
        bar.description = description
        return bar, 0
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)
    from rich.table import Column
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("" if speed is None else f"{speed:.2f} {unit}/s", style="progress.data.speed")

    def whole(column: type, *args: Any) -> Any:  # never cropped nor wrapped: a number cut short misleads
        return column(*args, table_column=Column(no_wrap=True, overflow="ignore"))

    # Room for the text at its widest (rate up to 99999.99/s, times up to 9:59:59): the bar takes what is left, at
    # most 20 cells, and is dropped below 4; narrower, the time elapsed goes, then the rate, so what shows is whole.
    counts = f"{total}/{total}"
    room = console.width - sum(len(w) + 1 for w in [description, counts, unit, "9:59:59", "left"])
    rate, elapsed = len(f"99999.99 {unit}/s") + 1, len("9:59:59 elapsed,") + 1
    columns: list[Any] = [whole(TextColumn, "{task.description}")]
    if room - rate - elapsed >= 4:
        columns.append(BarColumn(bar_width=min(20, room - rate - elapsed - 1)))
    columns += [whole(MofNCompleteColumn), whole(TextColumn, unit)]
    if room >= rate:
        columns.append(whole(Rate))
    if room >= rate + elapsed:
        columns += [whole(TimeElapsedColumn), whole(TextColumn, "elapsed,")]
    columns += [whole(TimeRemainingColumn), whole(TextColumn, "left")]
    bar = Progress(*columns, console=console, transient=False)
    return bar, bar.add_task(description, total=total)
