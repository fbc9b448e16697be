"""Plots of a sweep's results (matplotlib, Agg, no global backend change): `plot_table()`.

- two axes: a heatmap per measure, oriented like the terminal table (`SweepTable.grid_axes`),
  the prompt's tokens as tick labels, a colour bar labelled with the measure and its unit:
  a diverging map centred on 0 for signed effects (`logit_diff`, normalised effects),
  a sequential one otherwise (probabilities on 0..1);
- one axis: a line plot per measure; several cells over one axis: a curve each (`curves`: a sweep over a
  dataset grouped by a field, `sweep.grouped`);
- a per-token measure (`norm(L0.states)`): one curve per cell over the prompt's tokens
  (a cells x tokens image when there are too many cells for curves).

Each plot is `DIR/<sweep>-<measure>.png`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deltalang.ground import display
from deltalang.runs.results import for_display

if TYPE_CHECKING:
    from .table import SweepTable

MAX_CURVES = 12
SIGNED = ("logit_diff", "normalised")  # measure kinds that take either sign: a diverging map centred on 0
UNITS = {"prob": "probability", "kl": "nats", "logit_diff": "logits", "rank": "tokens preferred",
         "normalised": "(patched − corrupted) / (clean − corrupted)", "norm": "Frobenius norm"}


def colour_label(measure: str, kind: str) -> str:
    """The colour bar's label: the measure and its unit."""
    unit = UNITS.get(kind)
    return f"{measure}\n{unit}" if unit else measure


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def slug(text: str) -> str:
    """A file-name piece for a measure: `prob(" Paris")` -> `prob_Paris`."""
    s = re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")
    return s or "measure"


def heatmap(grid: Sequence[Sequence[float]], xlabels: Sequence[str], ylabels: Sequence[str], title: str,
            xname: str, yname: str, path: Path, *, kind: str = "", label: str = "") -> Path:
    """A heatmap of `grid[y][x]` with a colour bar labelled `label`, annotated with its values when small enough.

    `kind` in SIGNED: a diverging map centred on 0 (blue below, red above); `prob`: sequential on 0..1.
    """
    import numpy as np

    data = np.array(grid, dtype=float)
    finite = data[np.isfinite(data)]
    if kind in SIGNED:
        bound = float(np.abs(finite).max()) if finite.size and np.abs(finite).max() > 0 else 1.0
        cmap, vmin, vmax = "RdBu_r", -bound, bound
    elif kind == "prob":
        cmap, vmin, vmax = "viridis", 0.0, 1.0
    else:
        cmap, vmin, vmax = "viridis", None, None
    fig = _figure(max(4.5, 0.7 * len(xlabels) + 3.0), max(3.0, 0.4 * len(ylabels) + 1.8))
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(data, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    bar = fig.colorbar(image, ax=ax)
    bar.set_label(label, fontsize=8)
    ax.set_xticks(range(len(xlabels)), labels=list(xlabels), rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(ylabels)), labels=list(ylabels), fontsize=8)
    ax.set_xlabel(xname)
    ax.set_ylabel(yname)
    ax.set_title(title, fontsize=10)
    if data.size <= 400:
        for (y, x), v in np.ndenumerate(data):
            if math.isfinite(v):
                r, g, b, _ = image.cmap(image.norm(v))
                ax.text(x, y, display.number(for_display(kind, v), 2), ha="center", va="center", fontsize=6,
                        color="black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white")
    fig.tight_layout()
    fig.savefig(path)
    return path


def line(xlabels: Sequence[str], ys: Sequence[float], title: str, xname: str, yname: str, path: Path) -> Path:
    """A line plot of one measure over one axis."""
    fig = _figure(max(4.0, 0.45 * len(xlabels) + 2.0), 3.2)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(range(len(ys)), ys, marker="o")
    ax.set_xticks(range(len(xlabels)), labels=list(xlabels), rotation=60, ha="right", fontsize=8)
    ax.set_xlabel(xname)
    ax.set_ylabel(yname)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def curves(xlabels: Sequence[str], ys: Mapping[str, Sequence[float]], title: str, xname: str, yname: str,
           path: Path, *, baselines: Mapping[str, Sequence[float]] | None = None, kind: str = "") -> Path:
    """One curve per cell over one axis (recall by a needle's distance, a curve per ablated head), each
    `baselines` curve dashed and black (a clean run); `kind` `prob`: the y axis on 0..1."""
    fig = _figure(max(5.0, 0.45 * len(xlabels) + 3.0), 3.6)
    ax = fig.add_subplot(1, 1, 1)
    for name, values in ys.items():
        ax.plot(range(len(values)), values, marker="o", label=name)
    for name, values in (baselines or {}).items():
        ax.plot(range(len(values)), values, linestyle="--", color="black", label=name)
    if kind == "prob":
        ax.set_ylim(-0.02, 1.02)
    ax.set_xticks(range(len(xlabels)), labels=list(xlabels), rotation=60, ha="right", fontsize=8)
    ax.set_xlabel(xname)
    ax.set_ylabel(yname)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def token_curves(curves: Mapping[str, Sequence[float]], tokens: Sequence[str], title: str, path: Path) -> Path:
    """Per-token values (a state norm after each token): one curve per cell, or an image for many cells."""
    import numpy as np

    n = max((len(v) for v in curves.values()), default=0)
    labels = [f"{i} {tokens[i]}" if i < len(tokens) else str(i) for i in range(n)]
    fig = _figure(max(5.0, 0.35 * n + 2.5), 3.6 if len(curves) <= MAX_CURVES else max(3.0, 0.3 * len(curves) + 1.5))
    ax = fig.add_subplot(1, 1, 1)
    if len(curves) <= MAX_CURVES:
        for name, ys in curves.items():
            ax.plot(range(len(ys)), ys, marker=".", label=name)
        ax.legend(fontsize=7)
        ax.set_ylabel("value")
        ax.grid(alpha=0.3)
    else:
        data = np.array([list(v) + [math.nan] * (n - len(v)) for v in curves.values()], dtype=float)
        image = ax.imshow(data, aspect="auto", cmap="viridis", interpolation="nearest")
        fig.colorbar(image, ax=ax)
        ax.set_yticks(range(len(curves)), labels=list(curves), fontsize=7)
    ax.set_xticks(range(n), labels=labels, rotation=60, ha="right", fontsize=7)
    ax.set_xlabel("token")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_table(table: SweepTable, directory: Path) -> list[Path]:
    """Every plot of one sweep's results into `directory`; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    out: list[Path] = []
    axes = table.axes
    scalar = list(dict.fromkeys(r.measure for r in table.rows if r.position is None))
    per_token = list(dict.fromkeys(r.measure for r in table.rows if r.position is not None))
    for m in scalar:
        grid = table.grid(m)
        path = directory / f"{table.name}-{slug(m)}.png"
        if len(axes) == 2:
            rows, cols = table.grid_axes()
            out.append(heatmap(table.matrix(m), [table.label(cols, v) for v in cols.values],
                               [table.label(rows, u) for u in rows.values], f"{table.name}: {m}", cols.var,
                               rows.var, path, kind=table.kind(m), label=colour_label(m, table.kind(m))))
        elif len(axes) == 1:
            (a,) = axes
            ys = [grid.get((v,), math.nan) for v in a.values]
            out.append(line([table.label(a, v) for v in a.values], ys, f"{table.name}: {m}", a.var,
                            colour_label(m, table.kind(m)), path))
    for m in per_token:
        curves = {", ".join(f"{a.var}={table.label(a, v)}" for a, v in zip(axes, key)): ys
                  for key, ys in table.curves(m).items()}
        out.append(token_curves(curves, table.tokens, f"{table.name}: {m}",
                                directory / f"{table.name}-{slug(m)}.png"))
    return out
