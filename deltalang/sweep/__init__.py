"""Sweeps: ablation grids built from a template, run doing only the work each cell changes.

    text = deltalang.sweep('write L.state_after(t) = zeros; measure prob(" Paris")',
                           L="L[linear]", t=range(0, 8), prompt="The Eiffel Tower is in the city of")
    results = deltalang.run(text)                      # or: deltalang sweep FILE --out DIR

A sweep is one cell per point of its axes; a cell's reference meaning is the trace
`ResolvedRun.instantiate(point)`, one full forward with its writes, which the engine must equal. The
modules, in the order data flows: `template`, `support`, `job`, `recompute` (with `continuation`),
`memory`, `engine`, `store`, `table`/`plots`/`inline`, `driver`; `dataset`, `attribution`,
`attribution_dataset`, `paths` on top (ARCHITECTURE.md). The command `deltalang sweep` lives in `cli`.
"""

from __future__ import annotations

from .driver import SweepOutcome, run_sweep, run_sweeps
from .errors import DeltaSweepError
from .job import Normalise
from .table import SweepTable, render_tables
from .template import sweep

__all__ = ["DeltaSweepError", "Normalise", "SweepOutcome", "SweepTable", "render_tables", "run_sweep", "run_sweeps",
           "sweep"]
