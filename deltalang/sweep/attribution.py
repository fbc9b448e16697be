"""Attribution over the recurrent memory: every cell of a sweep estimated from a few backward passes.

`attribute(exp, steps=k, refine=K, exact=run_sweeps, path=...)` takes a compiled program's first sweep
whose cells write `state_after(t)` and/or `conv_window_after(t)` of their own block and position (from a
donor, zeros, scale or mean) and measure `prob` or `logit_diff`. Each cell's effect M(patched) - M(clean)
is estimated as the sum over its writes of <g, W' - W> (`gradients`, `paths`), per variant: `plain` (g at
the clean run), `blk<k>` (the default: g integrated along block L's own path; k = `default_steps`),
`out<k>`, `emb<k>`; `steps=0`, mean writes or mixed sources give `plain` alone. `refine=K` runs the K
largest |default estimate| cells exactly through `exact` (the engine). Returns an `Attribution` (rows,
the table, `DIR/attribution.csv` with `out`); the model's weights and grads are left as they were.
`method_of` reads a sweep's `method attribution ...`; `refuse_estimated` keeps the exact engine from
running such a sweep. How to read and when to trust the estimates: docs/attribution.md.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import torch

from deltalang.ground import display, html
from deltalang.language.ir import FromRun, Mean, ResolvedMeasure, ResolvedOp, ResolvedRun, Scale, Zeros
from deltalang.runs.compiled import Experiment
from deltalang.runtime import gradients
from deltalang.runtime.model import DeltaModel

from .errors import DeltaSweepError
from .job import measure_label
from .paths import (PATHS, PathEnds, gradient_runs, ids_of, measure_of, path_rule, plain_runs, record_forward,
                    reused_capture, whole_passes)
from .plots import colour_label, heatmap, slug
from .table import decoded_tokens, describe, left_out, warn_saturated

VALUES = ("state_after", "conv_window_after")
MEASURES = ("prob", "logit_diff")
# the default points of a path, from benchmarks/attribution.py's quality table (docs/attribution.md): a donor's value is
# a short path (k = 2 midpoints rank the cells within 0.004 of k = 4 and 8 at half and a quarter of the
# passes); zeros move each block's output all the way to zero, a longer path, where the Gauss-Radau rule
# with the clean end (`paths.path_rule`) at k = 4 ranks better than 8 midpoints did (Spearman 0.892 against
# 0.869); a scale moves it along the same kind of path (not measured)
DONOR_STEPS = 2
FACTOR_STEPS = 4
DEFAULT_PATH = "blocks"


@attrs.frozen
class Target:
    """A sweep as attribution reads it: its cells' writes, its measures, the donor of a path."""

    sweep: ResolvedRun
    cells: tuple[tuple[int, int], ...]  # (block, position) per point, in the sweep's order
    writes: Mapping[tuple[int, int], tuple[ResolvedOp, ...]]
    measures: tuple[ResolvedMeasure, ...]
    donor: str | None  # the text of the one donor prompt of every write, if there is one
    factor: float | None = None  # every write zeros (0) or scales by one factor: the outputs' path goes to factor x


@attrs.define
class AttributionRow:
    """One cell and one measure: the estimates by variant and, once refined, the exact effect."""

    block: int
    position: int
    token: str  # decoded (' the'); tables show it as `display.token` does (`␣the`)
    measure: str
    estimates: dict[str, float]
    exact: float | None = None


@attrs.define
class Attribution:
    """What `attribute` returns: one row per cell and measure; `variants` in column order."""

    sweep: str
    variants: list[str]
    default: str
    rows: list[AttributionRow]
    clean: dict[str, float]  # measure -> its value on the clean prompt
    files: list[Path] = attrs.Factory(list)

    def grid(self, measure: str | None = None, variant: str | None = None) -> dict[tuple[int, int], float]:
        """{(block, position): estimate} of one measure (default: the first) and variant (default: the default)."""
        m = measure or self.rows[0].measure
        v = variant or self.default
        return {(r.block, r.position): r.estimates[v] for r in self.rows if r.measure == m}

    def refined(self) -> list[AttributionRow]:
        return [r for r in self.rows if r.exact is not None]

    def __repr__(self) -> str:
        return (f"<Attribution: sweep {self.sweep}, {len({(r.block, r.position) for r in self.rows})} cells; variants "
                f"{', '.join(self.variants)} (default {self.default}); .table(), .grid(), .heatmaps(DIR)>")

    def _repr_html_(self) -> str:
        """Notebooks: what the command line prints (`table`)."""
        return html.pre(self.table(max(20, len(self.refined()))))

    def table(self, top: int = 20) -> str:
        """The cells of largest |default estimate|, estimates and exact side by side, as text."""
        head = ["block", "pos", "token", "measure", *self.variants, "exact"]
        rows = sorted(self.rows, key=lambda r: -abs(r.estimates[self.default]))[:top]
        body = [[f"L{r.block}", str(r.position), display.token(r.token), r.measure,
                 *(display.signed(r.estimates[v]) for v in self.variants),
                 "" if r.exact is None else display.signed(r.exact)] for r in rows]
        widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
        lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip() for line in [head, *body]]
        note = (f"sweep {self.sweep}: estimated effect M(patched) - M(clean) per cell; {describe(self.default)} "
                f"is the default; exact: the sweep engine's patch (refined cells)")
        return "\n".join([note, *lines, *left_out(len(rows), len(self.rows), "cells", "attribution.csv")])

    def heatmaps(self, directory: str | Path) -> list[Path]:
        """A heatmap per measure of the default estimate, blocks down and positions across (as a dataset
        attribution writes its own): `DIR/SWEEP-MEASURE.png`."""
        blocks, positions = sorted({r.block for r in self.rows}), sorted({r.position for r in self.rows})
        xs = [f"{p} {display.token(t)}" for p, t in sorted({(r.position, r.token) for r in self.rows})]
        out = []
        for m in dict.fromkeys(r.measure for r in self.rows):
            est, kind = self.grid(m), m.split("(")[0]
            grid = [[est.get((b, p), math.nan) for p in positions] for b in blocks]
            out.append(heatmap(grid, xs, [f"L{b}" for b in blocks], f"{self.sweep}: {m}, {self.default} estimate",
                               "t", "L", Path(directory) / f"{self.sweep}-{slug(m)}.png", kind=kind,
                               label=colour_label(m, kind)))
        return out

    def write_csv(self, path: str | Path) -> Path:
        """One line per cell and measure: block, position, token, measure, each variant, exact."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        with p.open("w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["block", "position", "token", "measure", *(f"estimate_{v}" for v in self.variants), "exact"])
            for r in self.rows:
                w.writerow([r.block, r.position, r.token, r.measure, *(repr(r.estimates[v]) for v in self.variants),
                            "" if r.exact is None else repr(r.exact)])
        return p


# -- reading the sweep -------------------------------------------------------------------------


def target_of(exp: Experiment) -> Target:
    """The program's first sweep, checked for what attribution estimates."""
    sweeps = [r for r in exp.resolved.runs if r.kind == "sweep"]
    if not sweeps:
        raise DeltaSweepError("method attribution estimates a sweep: the program has no sweep")
    sw = sweeps[0]
    kinds = {a.kind for a in sw.axes}
    if kinds != {"block", "position"} or len(sw.axes) != 2:
        raise DeltaSweepError(f"sweep {sw.name}: attribution needs one axis over blocks and one over positions")
    for m in sw.measures:
        if m.kind not in MEASURES or m.forced or m.step not in (None, 0):
            raise DeltaSweepError(f"sweep {sw.name}: attribution differentiates {' and '.join(MEASURES)} of "
                                  f"one-token answers at the next token; {m.written or m.kind} is not one")
    cells: list[tuple[int, int]] = []
    writes: dict[tuple[int, int], tuple[ResolvedOp, ...]] = {}
    donors: set[str] = set()
    for point in sw.points():
        run = sw.instantiate(point)
        ops = tuple(op for op in run.ops if op.kind == "write")
        if len(ops) != len(run.ops) or not ops:
            raise DeltaSweepError(f"sweep {sw.name}: attribution estimates writes only (no reads in the body)")
        block, pos = ops[0].layer, ops[0].position
        for op in ops:
            if op.value not in VALUES or op.layer != block or op.position != pos or op.step not in (None, 0) \
                    or op.head is not None:
                raise DeltaSweepError(
                    f"sweep {sw.name}: attribution estimates writes of {' and '.join(VALUES)} at the cell's "
                    f"block and position; {op.written} is not one")
            if isinstance(op.source, FromRun):
                donors.add(_run(exp, op.source.run).prompt_text)
            elif not isinstance(op.source, (Zeros, Scale, Mean)):
                raise DeltaSweepError(f"sweep {sw.name}: attribution takes writes from a run, zeros, scale or "
                                      f"mean; {op.written} is written from something else")
        assert block is not None and pos is not None
        cells.append((block, pos))
        writes[(block, pos)] = ops
    only = [op.source for ops in writes.values() for op in ops]
    donor = next(iter(donors)) if len(donors) == 1 and all(isinstance(s, FromRun) for s in only) else None
    factors = {0.0 if isinstance(s, Zeros) else s.factor if isinstance(s, Scale) else None for s in only}
    factor = next(iter(factors)) if len(factors) == 1 else None
    return Target(sw, tuple(cells), writes, sw.measures, donor, factor)


def _run(exp: Experiment, name: str) -> ResolvedRun:
    for r in exp.resolved.runs:
        if r.name == name:
            return r
    raise DeltaSweepError(f"no run named {name!r}")


def default_steps(model: DeltaModel, target: Target, path: str) -> int:
    """`DONOR_STEPS` for one donor of the clean length, `FACTOR_STEPS` for zeros or one scale, else 0 (no path)."""
    if target.donor is not None and len(model.spec.token_ids(target.donor)) == len(target.sweep.token_ids):
        return DONOR_STEPS
    return FACTOR_STEPS if target.factor is not None and path != "embeddings" else 0


def check_path(model: DeltaModel, target: Target, steps: int, path: str) -> None:
    """Refuse an integrated estimate the prompts cannot give: it needs one donor of the clean length."""
    if steps <= 0:
        return
    if target.donor is None and (target.factor is None or path == "embeddings"):
        raise DeltaSweepError(f"sweep {target.sweep.name}: steps={steps} integrates along a path from the clean run "
                              f"to one donor prompt (or, but for path embeddings, to zeros or one scale); these "
                              f"writes have none (mean or several sources): use steps=0 (plain)")
    if target.donor is None:
        return
    n, d = len(target.sweep.token_ids), len(model.spec.token_ids(target.donor))
    if n != d:
        raise DeltaSweepError(f"sweep {target.sweep.name}: steps={steps} moves the clean run towards the donor's token "
                              f"by token, so the donor must have the clean prompt's length ({d} tokens, not {n}): "
                              f"use steps=0")


def path_start(model: DeltaModel, target: Target) -> int:
    """The first position a donor's path moves (`PathEnds.start`): where the donor's tokens first differ from
    the clean prompt's, or earlier where a cell writes another value than the donor's own at its block and
    position (its W' - W may be nonzero before the prompts differ). 0 for zeros and scales (no donor)."""
    if target.donor is None:
        return 0
    ids, other = target.sweep.token_ids, model.spec.token_ids(target.donor)
    start = next((t for t, (x, y) in enumerate(zip(ids, other)) if x != y), min(len(ids), len(other)))
    for (block, pos), ops in target.writes.items():
        for op in ops:
            src = op.source
            assert isinstance(src, FromRun)
            if src.position != pos or src.layer not in (None, block) or src.value != op.value or src.step:
                start = min(start, pos)
    return min(start, len(ids) - 1)


# -- the estimates ---------------------------------------------------------------------------------


class _Values:
    """The clean and source values of one block (per-token states and windows), computed on first use."""

    def __init__(self, model: DeltaModel, block: int, clean: gradients.Recording,
                 donors: Mapping[str, gradients.Recording]) -> None:
        self.fam = model.family
        self.block = block
        self.clean = clean
        self.donors = donors
        self.cache: dict[tuple[str, str, int], torch.Tensor] = {}

    def all(self, rec_key: str, value: str, layer: int) -> torch.Tensor:
        """Every token's `value` of block `layer` in a recording ("" = clean), `[1, s, ...]`."""
        key = (rec_key, value, layer)
        if key not in self.cache:
            rec = self.clean if rec_key == "" else self.donors[rec_key]
            blk = rec.blocks[layer]
            self.cache[key] = gradients.states(self.fam, blk) if value == "state_after" else gradients.windows(blk)
        return self.cache[key]

    def delta(self, op: ResolvedOp) -> torch.Tensor:
        """W' - W of one write, `[1, ...]` float32."""
        assert op.position is not None and op.layer is not None
        here = self.all("", op.value, op.layer)[:, op.position].float()
        src = op.source
        if isinstance(src, Zeros):
            return -here
        if isinstance(src, Scale):
            return (src.factor - 1.0) * here
        if isinstance(src, FromRun):
            assert src.position is not None
            layer = op.layer if src.layer is None else src.layer
            return self.all(src.run, op.value, layer)[:, src.position].float() - here
        assert isinstance(src, Mean)
        got = [self.all(f"mean:{n}", op.value, op.layer)[:, op.position if src.positions is None else src.positions[n]]
               for n in range(len(src.texts))]
        return torch.stack(got).float().mean(0) - here


def _source_runs(model: DeltaModel, exp: Experiment, target: Target) -> dict[str, gradients.Recording]:
    """Recordings (no gradient) of every donor run and mean prompt the writes take values from."""
    layers: dict[str, set[int]] = {}
    texts: dict[str, str] = {}
    for ops in target.writes.values():
        for op in ops:
            src = op.source
            if isinstance(src, FromRun):
                assert op.layer is not None
                layers.setdefault(src.run, set()).add(op.layer if src.layer is None else src.layer)
                texts[src.run] = _run(exp, src.run).prompt_text
            elif isinstance(src, Mean):
                assert op.layer is not None
                for n, text in enumerate(src.texts):
                    layers.setdefault(f"mean:{n}", set()).add(op.layer)
                    texts[f"mean:{n}"] = text
    return {k: record_forward(model, sorted(v), ids=ids_of(model, texts[k])) for k, v in layers.items()}


def estimates(model: DeltaModel, target: Target, clean: gradients.Recording,
              donors: Mapping[str, gradients.Recording], runs: Mapping[str, Mapping[str, Any]],
              clean_end: bool) -> dict[tuple[str, str], dict[tuple[int, int], float]]:
    """{(measure label, variant): {(block, position): estimate}}, one block at a time.

    Each cell's change propagates through its block's clean transitions (the patch's meaning); the
    gradient at the block's output is the variant's recording's, integrated by `path_rule` (`clean_end`:
    the rule the paths were run with, `PathEnds.clean_end`)."""
    fam = model.family
    blocks = sorted({b for b, _ in target.cells})
    out: dict[tuple[str, str], dict[tuple[int, int], float]] = {}
    for block in blocks:
        vals = _Values(model, block, clean, donors)
        cells = [c for c in target.cells if c[0] == block]
        states = {c[1]: vals.delta(op) for c in cells for op in target.writes[c] if op.value == "state_after"}
        windows = {c[1]: vals.delta(op) for c in cells for op in target.writes[c] if op.value == "conv_window_after"}
        for label, variants in runs.items():
            names = list(variants)
            # each variant's gradient at the output, integrated over its path's points (the estimate is linear
            # in it), one row per variant in one scan
            plain = variants["plain"][0].blocks[block]
            grads = [plain if v == "plain" else
                     _integrated(variants[v][block] if isinstance(variants[v], dict) else variants[v], block, plain,
                                 clean_end)
                     for v in names]
            convs = [g.grad_conv for g in grads]
            blk = attrs.evolve(grads[0], grad_out=torch.cat([g.grad_out for g in grads]),  # type: ignore[misc]
                               grad_conv=None if _absent(convs) else torch.cat(convs))  # type: ignore[arg-type]
            total = torch.zeros(len(names), len(cells), dtype=torch.float64)
            if states:
                zero = torch.zeros_like(next(iter(states.values())))
                dots = gradients.state_dots(fam, clean.blocks[block], lambda t: states.get(t, zero), blk, states)
                for n, c in enumerate(cells):
                    if c[1] in states:
                        total[:, n] += dots[:, c[1]].double()
            if windows:
                wg = gradients.window_gradients(blk)
                for n, c in enumerate(cells):
                    if c[1] in windows:
                        total[:, n] += (wg[:, c[1]] * windows[c[1]]).flatten(1).sum(-1).double()
            for v, name in enumerate(names):
                out.setdefault((label, name), {}).update({c: float(total[v, n]) for n, c in enumerate(cells)})
    return out


def _absent(tensors: Sequence[torch.Tensor | None]) -> bool:
    return any(t is None for t in tensors)


def _integrated(recs: Sequence[gradients.Recording], block: int, clean: gradients.BlockRecord, clean_end: bool
                ) -> gradients.BlockRecord:
    """`block`'s record with its gradients at the output and convolution integrated along the path: the rows
    of `recs`, in order, are `path_rule`'s points, and `clean` (the plain gradient) is its clean end."""
    blks = [r.blocks[block] for r in recs]
    outs = torch.cat([b.grad_out for b in blks])  # type: ignore[misc]
    _, weights, w0 = path_rule(int(outs.shape[0]), clean_end)
    w = torch.tensor(weights, dtype=outs.dtype, device=outs.device)
    assert clean.grad_out is not None
    out = w0 * clean.grad_out + torch.tensordot(w, outs, dims=1)[None]
    convs = [b.grad_conv for b in blks]
    conv = None
    if not _absent(convs):
        conv = torch.tensordot(w, torch.cat(convs), dims=1)[None]  # type: ignore[arg-type]
        if w0:
            conv = None if clean.grad_conv is None else conv + w0 * clean.grad_conv
    return attrs.evolve(blks[0], grad_out=out, grad_conv=conv)


# -- refining and the whole method ---------------------------------------------------------------


def narrowed(exp: Experiment, target: Target, cells: Sequence[tuple[int, int]]) -> Experiment:
    """The program with its sweep replaced by one sweep per block over just `cells`' positions."""
    sw = target.sweep
    block_axis = next(a for a in sw.axes if a.kind == "block")
    pos_axis = next(a for a in sw.axes if a.kind == "position")
    label = dict(zip(pos_axis.values, pos_axis.labels, strict=True))
    runs: list[ResolvedRun] = [r for r in exp.resolved.runs if r is not sw]
    for block in sorted({b for b, _ in cells}):
        ps = tuple(sorted(p for b, p in cells if b == block))
        axes = tuple(attrs.evolve(block_axis, values=(block,), labels=(block,)) if a.kind == "block" else
                     attrs.evolve(pos_axis, values=ps, labels=tuple(label[p] for p in ps)) for a in sw.axes)
        runs.append(attrs.evolve(sw, name=f"{sw.name}_L{block}", axes=axes, method=None))
    resolved = attrs.evolve(exp.resolved, runs=tuple(runs))
    return Experiment(exp.source, exp.model, resolved=resolved)


@attrs.frozen
class Method:
    """How `run_sweep` / `deltalang sweep` run a program's sweep by attribution (see `method_of`)."""

    steps: int | None
    refine: int
    path: str


def method_of(exp: Experiment, method: str | None = None, steps: int | None = None, refine: int | None = None,
              path: str | None = None) -> Method | None:
    """The program's `method attribution ...` with the caller's options over it; None: the exact engine.

    `method` None takes the program's; "exact" against a program's `method attribution` is a conflict;
    `steps`, `refine`, `path` given (not None) replace the program's. A program declaring attribution
    has one sweep (the one estimated)."""
    if method not in (None, "exact", "attribution"):
        raise DeltaSweepError(f"method is 'exact' or 'attribution', got {method!r}")
    sweeps = [r for r in exp.resolved.runs if r.kind == "sweep"]
    said = [r for r in sweeps if r.method is not None and r.method.name == "attribution"]
    if said and method == "exact":
        raise DeltaSweepError(f"sweep {said[0].name} says method attribution, which method='exact' (or no "
                              f"--attribution flag where one is required) contradicts: drop one of them")
    if said and len(sweeps) > 1:
        raise DeltaSweepError(f"sweep {said[0].name} says method attribution, which estimates a program's one sweep; "
                              f"this program has {len(sweeps)}: put the others in another file")
    if method is None and not said:
        if steps is not None or refine is not None or path is not None:
            raise DeltaSweepError("steps, refine and path are options of method attribution; the program's sweeps "
                                  "run exactly (say method attribution)")
        return None
    if method == "exact":
        return None
    own = said[0].method if said else None
    return Method(steps if steps is not None else own.steps if own else None,
                  refine if refine is not None else (own.refine or 0) if own else 0,
                  path if path is not None else (own.path or DEFAULT_PATH) if own else DEFAULT_PATH)


def refuse_estimated(exp: Experiment) -> None:
    """The exact engine's guard: a sweep that says `method attribution` is not run cell by cell."""
    for r in exp.resolved.runs:
        if r.kind == "sweep" and r.method is not None and r.method.name == "attribution":
            raise DeltaSweepError(f"sweep {r.name} says method attribution, which deltalang.run_sweep and "
                                  f"`deltalang sweep` run (here every cell would run exactly)")


def attribute(exp: Experiment, *, steps: int | None = None, refine: int = 0, out: str | Path | None = None,
              exact: Callable[..., Any] | None = None, path: str = DEFAULT_PATH) -> Attribution:
    """Estimate every cell of the program's first sweep; refine the top `refine` exactly (see the module)."""
    if (steps is not None and steps < 0) or refine < 0:
        raise DeltaSweepError(f"steps and refine are counts (0 or more), got steps={steps}, refine={refine}")
    model = exp.model
    target = target_of(exp)
    if steps is None:
        steps = default_steps(model, target, path)
    if path not in PATHS:
        raise DeltaSweepError(f"path is one of {', '.join(PATHS)}, got {path!r}")
    check_path(model, target, steps, path)
    blocks = sorted({b for b, _ in target.cells})
    # the clean capture the blocks' paths run over and the refine's engine reuses; on Mamba-2 blocks the paths
    # run whole forwards and the engine takes its own capture (`paths.whole_passes`)
    from_block = not whole_passes(model) and ((path == "blocks" and steps > 0) or refine)
    plain, capture = plain_runs(model, blocks, target.sweep.prompt_text, target.measures,
                                min(blocks) if from_block else None)
    clean = plain[measure_label(target.measures[0])]
    donors = _source_runs(model, exp, target)
    donor = next(iter(donors.values())) if target.donor is not None else None
    ends = PathEnds(target.sweep.prompt_text, clean, donor, target.donor, target.factor,
                    path_start(model, target))
    runs = gradient_runs(model, blocks, target.measures, steps, path, ends, plain, capture)
    est = estimates(model, target, clean, donors, runs, ends.clean_end)
    variants = list(next(iter(runs.values())).keys())
    default = variants[-1]
    tokens = decoded_tokens(model, target.sweep)
    rows = [AttributionRow(b, p, tokens[p], measure_label(m), {v: est[(measure_label(m), v)][(b, p)] for v in variants})
            for m in target.measures for b, p in target.cells]
    clean_values = {measure_label(m): float(measure_of(m, runs[measure_label(m)]["plain"][0].result)[0])
                    for m in target.measures}
    result = Attribution(target.sweep.name, variants, default, rows, clean_values)
    warn_saturated(clean_values, {measure_label(m): m.span for m in target.measures}, exp.source, exp.filename)
    if refine:
        if exact is None:
            raise DeltaSweepError("refine needs the sweep engine (deltalang.run_sweep passes it)")
        first = measure_label(target.measures[0])
        top = sorted((r for r in rows if r.measure == first), key=lambda r: -abs(r.estimates[default]))[:refine]
        engine = exact if capture is None else partial(exact, capture=reused_capture(capture, clean,
                                                                                     target.sweep.prompt_text))
        refine_cells(exp, target, result, [(r.block, r.position) for r in top], engine)
    if out is not None:
        result.files.append(result.write_csv(Path(out) / "attribution.csv"))
        result.files.extend(result.heatmaps(out))
    return result


def refine_cells(exp: Experiment, target: Target, result: Attribution, cells: Sequence[tuple[int, int]],
                 exact: Callable[..., Any]) -> None:
    """Run `cells` through the engine; fill `exact` with M(patched) - M(clean)."""
    outcome = exact(narrowed(exp, target, cells), progress=False)
    found: dict[tuple[int, int, str], float] = {}
    for table in outcome.tables:
        for r in table.rows:
            point = dict(r.point)
            block = next(v for k, v in point.items() if k == target.sweep.axes[0].var)
            pos = next(v for k, v in point.items() if k == target.sweep.axes[1].var)
            if target.sweep.axes[0].kind == "position":
                block, pos = pos, block
            found[(block, pos, r.measure)] = r.value
    for row in result.rows:
        v = found.get((row.block, row.position, row.measure))
        if v is not None:
            row.exact = v - result.clean[row.measure]
