"""A sweep's results as a table: `SweepTable` (grids, per-token curves, labels) and its terminal rendering.

Contract: `SweepTable` holds a sweep's axes, its prompt's tokens and every
ResultRow, for the terminal tables (`render_tables`), the CSV and the plots.
A two-axis grid has one orientation (`grid_axes`: the longer axis down the rows),
the same in the terminal and the heatmap. Tables show a KL's float noise below 0
as 0 (`results.for_display`); the rows (and the CSV) keep the raw values.
`signed` prints an estimated effect (attribution) with three significant digits, `describe` names an
attribution variant's column, and
`saturation_warnings` says when a `prob` at the clean run is too close to 1 (or 0) for
gradient estimates of its change.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs

from deltalang.ground import display
from deltalang.ground.errors import DeltaWarning, Span, warn
from deltalang.language.ir import ResolvedRun, SweepAxis
from deltalang.language.tokens import decoded
from deltalang.runs.results import for_display
from deltalang.runtime.model import DeltaModel

from .inline import table_html
from .job import ResultRow
from .store import CSV_NAME


@attrs.define
class SweepTable:
    """A sweep's results: its axes, tokens and every value, for tables, CSV and plots."""

    name: str
    axes: tuple[SweepAxis, ...]
    tokens: tuple[str, ...]  # the prompt's tokens, as text
    measures: list[str]
    rows: list[ResultRow] = attrs.Factory(list)
    kinds: dict[str, str] = attrs.Factory(dict)  # measure label -> its kind ("prob", "kl", ...)

    def kind(self, measure: str) -> str:
        """The kind of a measure label: `normalised` for the normalised effects a sweep adds."""
        return "normalised" if measure.startswith("normalised(") else self.kinds.get(measure, "")

    def grid_axes(self) -> tuple[SweepAxis, SweepAxis]:
        """A two-axis sweep's (rows, columns): the longer axis down the rows, so the table fits."""
        a, b = self.axes
        return (b, a) if len(b.values) > len(a.values) else (a, b)

    def matrix(self, measure: str) -> list[list[float]]:
        """A scalar measure of a two-axis sweep as `grid_axes` rows x columns (nan where missing)."""
        rows, cols = self.grid_axes()
        grid, first = self.grid(measure), self.axes[0] is rows
        return [[grid.get((u, v) if first else (v, u), math.nan) for v in cols.values] for u in rows.values]

    def grid(self, measure: str) -> dict[tuple[int, ...], float]:
        """{axis values: value} of a scalar measure."""
        return {tuple(v for _, v in r.point): r.value for r in self.rows
                if r.measure == measure and r.position is None}

    def curves(self, measure: str) -> dict[tuple[int, ...], list[float]]:
        """{axis values: per-token values} of a per-token measure."""
        out: dict[tuple[int, ...], dict[int, float]] = {}
        for r in self.rows:
            if r.measure == measure and r.position is not None:
                out.setdefault(tuple(v for _, v in r.point), {})[r.position] = r.value
        return {k: [v[p] for p in sorted(v)] for k, v in out.items()}

    def per_token(self, measure: str) -> bool:
        return any(r.measure == measure and r.position is not None for r in self.rows)

    def label(self, axis: SweepAxis, value: int) -> str:
        """`L3` for a block, `5 ␣Tower` for a position."""
        if axis.kind == "block":
            return f"L{value}"
        if axis.kind == "head":
            return f"head {value}"
        tok = self.tokens[value] if 0 <= value < len(self.tokens) else "?"
        return f"{value} {tok}"

    def _repr_html_(self) -> str:
        """Notebooks: the tables as HTML, the plots inline (`sweep.inline`)."""
        return table_html(self)


def decoded_tokens(model: DeltaModel, run: ResolvedRun) -> tuple[str, ...]:
    """Each token of the run's prompt decoded (`' the'`), as stored (an attribution's CSV)."""
    return decoded(model.tokenizer, run.token_ids)


def token_texts(model: DeltaModel, run: ResolvedRun) -> tuple[str, ...]:
    """Each token of the run's prompt as every table shows it (`display.token`: `␣the`)."""
    return tuple(display.token(t) for t in decoded_tokens(model, run))


def _fmt(x: float, kind: str = "") -> str:
    return display.cell(for_display(kind, x))


def left_out(shown: int, total: int, what: str, where: str) -> list[str]:
    """The line a table ends with when it shows `shown` of `total` rows: how many and where the rest are."""
    if shown >= total:
        return []
    return [f"(the {shown} of {total} {what} of largest |estimate|; every one in {where} with --out DIR)"]


SATURATED = 0.99  # a prob at or above this (or at or below 1 - this) at the clean run


def saturation_warnings(clean: Mapping[str, float]) -> list[tuple[str, str]]:
    """(measure, why): a `prob` near 1 (or 0) at the clean run makes gradient estimates of its change small."""
    out = []
    for label, p in clean.items():
        if label.startswith("prob(") and not 1 - SATURATED < p < SATURATED:
            out.append((label, f"{label} is {p:.6g} at the clean run: saturated, its gradient is the logits' "
                               f"scaled by p(1 - p) = {p * (1 - p):.2g}, so estimates from gradients at or near the "
                               f"clean run miss a large change; measure logit_diff(\"ANSWER\", \"FOIL\") to rank "
                               f"the cells, or refine them exactly (refine K)"))
    return out


def warn_saturated(clean: Mapping[str, float], spans: Mapping[str, Span], source: str, filename: str) -> None:
    """A DeltaWarning at each saturated measure (`saturation_warnings`)."""
    for label, message in saturation_warnings(clean):
        span = spans.get(label)
        warn(DeltaWarning(message, span if span is not None and span.line > 0 else None, source=source,
                          filename=filename))


def _title(text: str) -> Any:
    """A table's title on its own line, never wrapped (a measure's text, `logit_diff(" Paris", " Rome")`, stays
    whole: Rich wraps a table's own title to the table's width)."""
    from rich.text import Text

    return Text(text, style="italic", no_wrap=True, overflow="ignore")


def render_tables(table: SweepTable, limit: int = 40) -> list[Any]:
    """Rich tables of a sweep: a grid per measure for two axes, one table for one axis, else a long list."""
    from rich.table import Table

    measures_ = list(dict.fromkeys(r.measure for r in table.rows if r.position is None))
    out: list[Any] = []
    axes = table.axes
    if not measures_:
        pass
    elif len(axes) == 2:
        a, b = table.grid_axes()
        for m in measures_:
            t = Table()
            out.append(_title(f"{table.name}: {m}"))
            t.add_column(f"{a.var} \\ {b.var}")
            for v in b.values:
                t.add_column(table.label(b, v), justify="right")
            for u, row in zip(a.values, table.matrix(m)):
                t.add_row(table.label(a, u), *(_fmt(x, table.kind(m)) for x in row))
            out.append(t)
    elif len(axes) == 1:
        (a,) = axes
        t = Table()
        out.append(_title(table.name))
        t.add_column(a.var)
        for m in measures_:
            t.add_column(m, justify="right", no_wrap=True)
        grids = [table.grid(m) for m in measures_]
        for u in a.values:
            t.add_row(table.label(a, u), *(_fmt(g[(u,)], table.kind(m)) if (u,) in g else ""
                                           for m, g in zip(measures_, grids)))
        out.append(t)
    else:
        t = Table()
        out.append(_title(table.name))
        for a in axes:
            t.add_column(a.var)
        t.add_column("measure", no_wrap=True)
        t.add_column("value", justify="right")
        shown = [r for r in table.rows if r.position is None]
        for r in shown[:limit]:
            t.add_row(*(table.label(a, v) for a, (_, v) in zip(axes, r.point)), r.measure,
                      _fmt(r.value, table.kind(r.measure)))
        if len(shown) > limit:
            t.caption = f"first {limit} of {len(shown)} rows; all in {CSV_NAME}"
        out.append(t)
    per_token = list(dict.fromkeys(r.measure for r in table.rows if r.position is not None))
    if per_token:
        out.append(f"{table.name}: per-token measure(s) {', '.join(per_token)}: see {CSV_NAME} and the plots")
    return out


def describe(variant: str) -> str:
    """What a variant's column is."""
    if variant == "plain":
        return "plain (gradient at the clean run)"
    k = variant.lstrip("abcdefghijklmnopqrstuvwxyz")
    moved = {"blk": "each block's own output", "out": "every block's output together",
             "emb": "the input embeddings"}[variant[: len(variant) - len(k)]]
    return (f"{variant} (gradient integrated over {k} points of a path taking {moved} from the clean run's to "
            f"the source's)")
