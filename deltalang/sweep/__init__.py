"""Sweeps: ablation grids built from a template, run doing only the work each cell changes.

    text = deltalang.sweep('write L.state_after(t) = zeros; measure prob(" Paris")',
                           L="L[linear]", t=range(0, 8), prompt="The Eiffel Tower is in the city of")
    results = deltalang.run(text)                      # or: deltalang sweep FILE --out DIR

A sweep `sweep NAME on PROMPT over L in ..., t in ... { ... }` is one cell per
point of its axes. The reference meaning of a cell is the trace
`ResolvedRun.instantiate(point)`: one full forward with the cell's writes.

The package, in the order data flows (each module imports only those above it):

- `errors`: DeltaSweepError, and the engine's internal Unsupported;
- `template`: `sweep()`, the program text of a sweep (the Python API);
- `support`: donors, means and reference logits, from one ordinary compiled program;
- `job`: cells, the eligibility check (`fast_path_blocker`), SweepJob and `plan_job`;
- `recompute`: the clean capture and the transformers cache subclasses (`run_rows`);
- `memory`: rows per forward and the capture waves;
- `engine`: the fast path and the naive (reference) path, cell rows of results;
- `store`: `DIR/sweep.csv` and `DIR/sweep.json`, resume;
- `table`, `plots`, `inline`: SweepTable, the terminal tables, the PNGs, both as notebook HTML;
- `driver`: `run_sweeps(exp)`, `run_sweep(source)`.

The command `deltalang sweep` lives in `deltalang.cli`.
"""

from __future__ import annotations

from .driver import SweepOutcome, run_sweep, run_sweeps
from .errors import DeltaSweepError
from .job import Normalise
from .table import SweepTable, render_tables
from .template import sweep

__all__ = ["DeltaSweepError", "Normalise", "SweepOutcome", "SweepTable", "render_tables", "run_sweep", "run_sweeps",
           "sweep"]
