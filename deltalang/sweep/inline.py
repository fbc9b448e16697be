"""A sweep's results in a notebook: the terminal's tables as HTML, with the plots inline.

Contract: `table_html(table)` is what `SweepTable._repr_html_` shows: the same
tables `render_tables` prints (a grid per measure for two axes, oriented by
`SweepTable.grid_axes`; one table for one axis; a long list, first `limit` rows,
for more), values as the terminal shows them (`results.for_display`: a KL's float
noise below 0 as 0), then every plot `plots.plot_table` would save (the heatmaps,
lines and per-token curves) as inline PNGs. `outcome_html(outcome)` is a
`SweepOutcome`'s: each sweep's table, then the program's other results. Nothing
is written outside a temporary directory, removed before returning.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltalang.ground import display, html
from deltalang.runs.results import for_display

from .plots import colour_label, heatmap, plot_table, slug
from .store import CSV_NAME

if TYPE_CHECKING:
    from .table import SweepTable


def _fmt(x: float, kind: str) -> str:
    return display.cell(for_display(kind, x))


def grids_html(table: SweepTable, limit: int = 40) -> str:
    """The tables `render_tables` prints, as HTML."""
    scalar = list(dict.fromkeys(r.measure for r in table.rows if r.position is None))
    out: list[str] = []
    axes = table.axes
    if not scalar:
        pass
    elif len(axes) == 2:
        a, b = table.grid_axes()
        for m in scalar:
            rows = [(table.label(a, u), *(_fmt(x, table.kind(m)) for x in row))
                    for u, row in zip(a.values, table.matrix(m))]
            out.append(html.table([f"{a.var} \\ {b.var}", *(table.label(b, v) for v in b.values)], rows,
                                  title=f"{table.name}: {m}", right=range(1, len(b.values) + 1)))
    elif len(axes) == 1:
        (a,) = axes
        grids = [table.grid(m) for m in scalar]
        rows = [(table.label(a, u), *(_fmt(g[(u,)], table.kind(m)) if (u,) in g else ""
                                      for m, g in zip(scalar, grids))) for u in a.values]
        out.append(html.table([a.var, *scalar], rows, title=table.name, right=range(1, len(scalar) + 1)))
    else:
        shown = [r for r in table.rows if r.position is None]
        rows = [(*(table.label(a, v) for a, (_, v) in zip(axes, r.point)), r.measure,
                 _fmt(r.value, table.kind(r.measure))) for r in shown[:limit]]
        caption = f"first {limit} of {len(shown)} rows; all in {CSV_NAME}" if len(shown) > limit else None
        out.append(html.table([*(a.var for a in axes), "measure", "value"], rows, title=table.name,
                              caption=caption, right=(len(axes) + 1,)))
    per_token = list(dict.fromkeys(r.measure for r in table.rows if r.position is not None))
    if per_token:
        out.append(f"<div>{html.escape(table.name)}: per-token measure(s) {html.escape(', '.join(per_token))}: "
                   "see the plots</div>")
    return "".join(out)


def plots_html(table: SweepTable) -> str:
    """Every plot of the sweep (`plots.plot_table`) as inline PNGs."""
    with tempfile.TemporaryDirectory(prefix="deltalang-plots-") as tmp:
        return "".join(html.image(Path(p).read_bytes(), alt=Path(p).stem) for p in plot_table(table, Path(tmp)))


def table_html(table: SweepTable) -> str:
    """A sweep's tables and plots (the module's contract)."""
    return f"<div>{grids_html(table)}{plots_html(table)}</div>"


def outcome_html(outcome: Any) -> str:
    """A SweepOutcome: each sweep's tables and plots, then the program's other results as a table."""
    parts = [table_html(t) for t in outcome.tables]
    prefixes = tuple(f"{t.name}[" for t in outcome.tables)
    results = outcome.results
    others = [k for k in results if not k.startswith(prefixes)]
    if others:  # their lines of the whole summary (cells are in the tables)
        parts.append(html.summary_table(results.summary(), list(results), title="other results", keep=others))
    return "<div>" + "".join(parts) + "</div>"


def _stats_row(s: Any) -> tuple[str, str, int, str]:
    return html.stats_cells(s)


def dataset_sweep_html(results: Any) -> str:
    """A `DatasetSweepResults` (read through its attributes) as `summary()` prints it, in HTML.

    Per sweep and measure: a two-axis sweep's grid of the mean over the records (the first axis
    down, as the terminal) and its heatmap inline, as `save` writes it; any other sweep's cells
    with mean, std, n and 95% CI; then the program's other traces' statistics and the records left out.
    """
    ds = results.dataset
    n = len(ds.records)
    title = f"{n - len(results.skipped)} of {n} records of '{ds.name}'" + (
        f"; normalised against {results.normalise}" if results.normalise else "")
    parts = [f"<div><b>{html.escape(title)}</b></div>"]
    with tempfile.TemporaryDirectory(prefix="deltalang-plots-") as tmp:
        for sweep, axes in results.axes.items():
            for m in results.measures(sweep):
                kind = "normalised" if m.startswith("normalised(") else m.split("(")[0]
                if len(axes) == 2:
                    rows, cols, grid = results.grid(sweep, m)
                    body = [(r, *(_fmt(x, kind) for x in row)) for r, row in zip(rows, grid)]
                    parts.append(html.table([f"{axes[0][0]} \\ {axes[1][0]}", *cols], body,
                                            title=f"{sweep}: {m}, mean over records", right=range(1, len(cols) + 1)))
                    png = heatmap(grid, cols, rows, f"{sweep}: {m}\nmean over records", axes[1][0], axes[0][0],
                                  Path(tmp) / f"{sweep}-{slug(m)}.png", kind=kind, label=colour_label(m, kind))
                    parts.append(html.image(png.read_bytes(), alt=f"{sweep}: {m}"))
                    continue
                cells = [c for c in results.stats if c.sweep == sweep and c.stats.measure == m]
                body2 = [(", ".join(f"{k}={v}" for k, v in c.point), *_stats_row(c.stats)) for c in cells]
                parts.append(html.table(["cell", "mean", "std", "n", "95% CI"], body2, title=f"{sweep}: {m}",
                                        right=(1, 2, 3, 4)))
    others = [c.stats for c in results.stats if c.sweep not in results.axes]
    if others:
        parts.append(html.table(["measure", "mean", "std", "n", "95% CI"],
                                [(s.measure, *_stats_row(s)) for s in others], title="other runs",
                                right=(1, 2, 3, 4)))
    if results.skipped:
        parts.append(html.table(["record", "why"], [(ds.where(ds.records[i]), why) for i, why in results.skipped],
                                title=f"left out {len(results.skipped)} of {n} records (strict=True stops instead)"))
    return "<div>" + "".join(parts) + "</div>"
