"""Run a program over a dataset: one plain program per record, one row per record and measure, and statistics.

    out = run_dataset(source, model, filename="causal.dl")          # dataset files relative to causal.dl
    out = run_dataset(source, model, data={"facts": records})        # list of dicts or a pandas DataFrame
    out.rows, out.stats, out.skipped; print(out.summary()); out.save("out/")

A record's result is exactly its plain one-prompt program's (`resolve.dataset.expand`); the records that share
a forward (`records.open_records`) run as one program (`merge`: runs renamed `NAME#k`). Records that do not
resolve are left out and reported by data-file line (`strict=True`: the first is the error); the program's or
data's errors are DeltaErrors before anything runs. `DatasetResults`: long-format `rows` and per measure mean, sample std, n and 95% CI
(Student's t, `stats_of`); `save(DIR)` writes results.csv, summary.csv/json and program.dl. A measure's answer
without its leading space whose twin after a space is far likelier is one warning over the records (`SpacedAnswers`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import attrs

from deltalang.ground import html
from deltalang.ground.compat import pandas
from deltalang.ground.datasets import Dataset, Record
from deltalang.ground.errors import DeltaError, DeltaWarning, locating, warn
from deltalang.ground.measures import UnspacedWarning, refuse_per_token
from deltalang.language import ast
from deltalang.language.ir import FromRun, Resolved, ResolvedRun
from deltalang.language.parse import parse
from deltalang.language.resolve import RecordResolution
from deltalang.language.resolve.dataset import measure_label
from deltalang.runtime.model import DeltaModel

from .collect import (SHARD_BYTES, SHARD_SECONDS, Collected, CollectStore, Slot, check_fits, collect_groups, estimate,
                      reads_of, run_group, slots_of)
from .collection import Collection
from .compiled import Experiment
from .dataset_generate import DatasetGeneration, run_generate
from .dataset_store import (RecordProgress, RecordStore, format_stats, open_store, program_meta, write_long_csv,
                            write_summary, write_summary_json)
from .records import close_records, open_records
from .results import save_atomically
from .shards import Part, count_line, finish

if TYPE_CHECKING:
    from rich.console import Console

FILES = ("results.csv", "summary.csv", "summary.json", "program.dl")


@attrs.frozen
class MeasureStats:
    """One measure over the records: mean, sample std, n, and the 95% CI of the mean."""

    measure: str
    mean: float
    std: float
    n: int
    ci_low: float
    ci_high: float


@lru_cache(maxsize=None)
def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (Simpson's rule on the density, bisection;
    0.2 s a call, so kept: a sweep grouped by a field asks for it per cell and group)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf_from_zero(x: float, steps: int = 2000) -> float:
        h = x / steps
        f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(steps + 1)]
        return h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf_from_zero(hi) < 0.475:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf_from_zero(mid) < 0.475 else (lo, mid)
    return (lo + hi) / 2


def stats_of(measure: str, values: list[float]) -> MeasureStats:
    """Mean, sample standard deviation, n and 95% CI (NaN where n is too small for them)."""
    n = len(values)
    mean = sum(values) / n if n else math.nan
    if n < 2:
        return MeasureStats(measure, mean, math.nan, n, math.nan, math.nan)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile_975(n - 1) * std / math.sqrt(n)
    return MeasureStats(measure, mean, std, n, mean - half, mean + half)


def stats_by_measure(rows: list[dict[str, Any]]) -> tuple[MeasureStats, ...]:
    """Each measure's statistics over long-format rows (measures in first-seen order)."""
    labels = list(dict.fromkeys(row["measure"] for row in rows))
    return tuple(stats_of(lab, [row["value"] for row in rows if row["measure"] == lab]) for lab in labels)


@attrs.frozen
class DatasetResults:
    """What a run over a dataset gives: rows, per-measure statistics, the records left out."""

    dataset: Dataset
    rows: tuple[dict[str, Any], ...]
    stats: tuple[MeasureStats, ...]
    skipped: tuple[tuple[int, str], ...]  # (record index, why), in record order
    program: str = ""
    part: Part | None = None  # a shard's run: its share of the records (`shards.count_line`); None: the whole run

    def values(self, measure: str) -> list[float]:
        """A measure's value for each record that ran, in record order."""
        return [r["value"] for r in self.rows if r["measure"] == measure]

    def summary(self) -> str:
        """What `deltalang run` prints: one line per measure, then the records left out."""
        lines = [count_line(self.dataset.name, len(self.dataset.records), len(self.skipped), self.part)]
        for s in self.stats:
            lines.append(f"{s.measure:48} {format_stats(s)}")
        lines.extend(self.dataset.left_out_lines(self.skipped))
        return "\n".join(lines)

    def to_pandas(self) -> Any:
        """The rows as `results.csv` has them: long format, a row per record and measure."""
        pd = pandas()

        return pd.DataFrame(list(self.rows), columns=["record", "line", *self.dataset.fields, "measure", "value"])

    def __repr__(self) -> str:
        lines = self.summary().splitlines()
        return "\n".join([f"<deltalang DatasetResults: {len(self.rows)} rows>", *lines[:10],
                          *([f"... ({len(lines) - 10} more lines: print(results.summary()))"] if len(lines) > 10
                            else [])])

    def save(self, directory: str | Path) -> Path:
        """Write `FILES` into `directory`, each replacing its former version at once."""
        return save_atomically(directory, self._write)

    def _write(self, tmp: Path) -> None:
        fields = list(self.dataset.fields)
        write_long_csv(tmp / "results.csv", ["record", "line", *fields, "measure", "value"], self.rows)
        cols = ["measure", "mean", "std", "n", "ci_low", "ci_high"]
        write_summary(tmp, cols, ([getattr(s, c) for c in cols] for s in self.stats),
                      {"measures": [attrs.asdict(s) for s in self.stats]}, self.dataset, self.skipped, self.program)

    def _repr_html_(self) -> str:
        """Notebooks: the statistics and the records left out as tables (`deltalang.ground.html`)."""
        return html.dataset_table(self)


def run_dataset(source: str, model: DeltaModel, *, filename: str = "<program>",
                data: Mapping[str, Any] | None = None, strict: bool = False, batch: bool = True,
                datasets: Mapping[str, Dataset] | None = None, out: str | Path | None = None, resume: bool = False,
                console: Console | None = None, on_group: Callable[[list[int]], None] | None = None,
                 shard_bytes: int = SHARD_BYTES, shard_seconds: float = SHARD_SECONDS, shard: Any = None,
                 program: ast.Program | None = None
                ) -> DatasetResults | DatasetGeneration | Collection:
    """Run `source` over its dataset on `model` (see the module doc); `datasets`: already `load_datasets`'.
    A program that reads is a collection (`deltalang.runs.collect`; a shard at `shard_bytes` or every `shard_seconds`,
    whichever comes first): its `Collection`; one
    that generates gives each record's continuation and measures per step (`deltalang.runs.dataset_generate`).

    `out`: save each group of records as it finishes and the final files there; `resume`: continue the
    run in `out` (the groups done are not rerun); `console`: show progress there; `on_group(indices)`:
    after each group of records is saved; `shard` (`(K, N)`, "K/N"): run shard K of N of the records only,
    saved in `out/shard-K-of-N` (`deltalang.runs.shards`; `deltalang.merge` joins the parts). `program`: `source`
    already parsed (the entry points parse it once); each record's program is made from this tree.
    """
    if program is None:
        program = parse(source, filename)
    recs = open_records(program, source, model.spec, filename=filename, data=data, datasets=datasets, strict=strict,
                        batch=batch, shard=shard, out=out, resume=resume,
                        vet=lambda resolutions: refuse_per_record_vectors(resolutions, source, filename))
    ds, groups, skipped, out, resume = recs.ds, recs.groups, recs.skipped, recs.out, recs.resume
    resolutions = recs.resolutions
    if recs.kind == "generate":  # each record's continuation and measures per step (`deltalang.runs.dataset_generate`)
        spaced = SpacedAnswers(ds)
        got: Any = run_generate(program, ds, groups, skipped, source, model, filename=filename, batch=batch, out=out,
                                resume=resume, console=console, on_group=on_group, merge=merge, stats=stats_of,
                                taking=spaced.taking)
        spaced.warn()
    elif recs.kind == "collection":
        got = run_collection(program, ds, groups, recs.labels, skipped, source, model, filename=filename, batch=batch,
                             out=out, resume=resume, console=console, on_group=on_group, shard_bytes=shard_bytes,
                             shard_seconds=shard_seconds, part=recs.share)
    if recs.kind != "run":
        finish(out, recs.part)
        return attrs.evolve(got, part=recs.share) if recs.kind == "generate" else got
    columns = ["record", "line", *ds.fields, "measure", "value"]
    store = open_store(out, source, model.spec.model_id, columns, len(ds.records), resume, {"batch": batch})
    done = store.done if store is not None else set()
    todo = [g for g in groups if not all(r.record.index in done for r in g)]  # a group is saved whole
    per: dict[int, list[dict[str, Any]]] = {}
    for g in groups:
        if g not in todo:
            for r in g:
                per[r.record.index] = [{"record": r.record.index, "line": r.record.line, **r.record.fields,
                                        "measure": x["measure"], "value": float(x["value"])}
                                       for x in (store.rows_of(r.record.index) if store is not None else [])]
    n = sum(len(g) for g in todo)
    head = f"'{ds.name}': {n} record(s) to run in {len(todo)} forward group(s)" + (
        f", {len(resolutions) - len(skipped) - n} done before" if n < len(resolutions) - len(skipped) else "")
    spaced = SpacedAnswers(ds)
    try:
        _run_groups(todo, per, store, columns, RecordProgress(console, n, n, "records", head), on_group,
                    lambda group: _run_group(program, ds, group, source, model, filename, batch, spaced))
    except BaseException:
        if store is not None:  # nothing that looks like results: no record done, nothing left
            store.abandon()
        raise
    spaced.warn()
    rows = [row for i in sorted(per) for row in per[i]]
    result = DatasetResults(ds, tuple(rows), stats_by_measure(rows), skipped, source, recs.share)
    close_records(result, store, recs)
    return result


def run_collection(program: ast.Program, ds: Dataset, groups: list[list[RecordResolution]],
                   labels: Mapping[int, Mapping[str, str]], skipped: tuple[tuple[int, str], ...], source: str,
                   model: DeltaModel, *, filename: str, batch: bool, out: str | Path | None, resume: bool,
                   console: Console | None, on_group: Callable[[list[int]], None] | None,
                   shard_bytes: int, shard_seconds: float = SHARD_SECONDS, part: Part | None = None) -> Collection:
    """A collection (`deltalang.runs.collect`) of `groups` (`records.forward_groups`): the records' reads written to `out` as
    they finish; resumed, a group with a record not done runs whole (its records share its forward)."""
    if out is None:
        raise DeltaError("a run over a dataset that reads collects every record's values into files as it goes: "
                         "give --out DIR (out= from Python)")
    meta = program_meta(source, model.spec.model_id, shard_bytes=shard_bytes, records=len(ds.records))
    store = CollectStore(Path(out), meta, resume, shard_bytes, shard_seconds)
    groups = [g for g in groups if not all(r.record.index in store.done for r in g)]

    spaced = SpacedAnswers(ds)

    def run(group: list[RecordResolution]) -> Collected:
        return run_group(group, labels, lambda res: _experiment_run(source, model, filename, res, batch, ds, group,
                                                                    spaced),
                         merge, lambda run_name, m: measure_label(program, run_name, m))

    ready = [run(groups[0])] if groups else []  # handed to collect_groups: held by nothing here once written
    slots: list[Slot] = []
    if ready:
        assert groups[0][0].resolved is not None
        ops = reads_of(groups[0][0].resolved, labels[groups[0][0].record.index])
        slots = slots_of(next(iter(ready[0].values.values())), ops, model.spec.family.block_kind)
        check_fits(Path(out), estimate(ready[0], groups, slots), sum(len(g) for g in groups))
    store.start(slots)
    n = sum(r.record.index not in store.done for g in groups for r in g)
    head = f"'{ds.name}': {n} record(s) to collect in {len(groups)} forward group(s)" + (
        f", {len(store.done)} done before" if store.done else "")
    try:
        measures = collect_groups(program, ds, groups, store, ready, run,
                                  RecordProgress(console, n, n, "records", head), on_group)
        rows = [{"record": i, "line": ds.records[i].line, **ds.records[i].fields, "measure": k, "value": v}
                for i in sorted(measures) for k, v in measures[i].items()]
        result = DatasetResults(ds, tuple(rows), stats_by_measure(rows), skipped, source)
        store.finish({"program": source, "program_sha256": meta["program_sha256"], "model": meta["model"],
                      "dataset": ds.name, "origin": ds.origin, "records": len(ds.records),
                      "left_out": [{"record": i, "line": ds.records[i].line, "why": why} for i, why in skipped],
                      **({} if part is None else {"part": {"k": part.shard.k, "n": part.shard.n,
                                                           "records": part.records}})},
                     lambda d: result._write(d) if rows else write_summary_json(d, {}, ds, skipped, source))
    except BaseException:
        store.abandon()
        raise
    spaced.warn()
    return Collection(out)


class SpacedAnswers:
    """A dataset run's `measures.UnspacedWarning`s (an answer without its leading space, the same word after a space
    far likelier), each measure's said once after the records: the first record's numbers, how many and which."""

    def __init__(self, ds: Dataset) -> None:
        self.ds, self.total = ds, 0  # the records run
        self.found: dict[Any, list[tuple[UnspacedWarning, Record]]] = {}  # the measure's span -> (warning, record)

    @contextmanager
    def taking(self, group: list[RecordResolution]) -> Iterator[None]:
        """While `group`'s merged program runs: its warnings, each named by its record."""
        self.total += len(group)
        k = (lambda r: r.record.index) if len(group) > 1 else (lambda r: None)
        records = {_renamed(run.name, run.name, k(r)): r.record for r in group if r.resolved is not None
                   for run in r.resolved.runs}  # a result is named after its run: `t#3.prob(...)`, `t#3.step0...`

        def take(w: DeltaWarning, file: str, line: int) -> bool:
            run = w.result.split(".", 1)[0] if isinstance(w, UnspacedWarning) else None
            if run not in records:
                return False
            self.found.setdefault(w.span, []).append((w, records[run]))
            return True

        with locating(take):
            yield

    def warn(self) -> None:
        for found in self.found.values():
            w, first = found[0]
            records = list({r.index: r for _, r in found}.values())
            w.notes = (*w.notes, f"in {len(records)} of {self.total} records of '{self.ds.name}' (the numbers are "
                                 f"record {first.index + 1}'s): {self.ds.listed(records)}")
            warn(w)


def _experiment_run(source: str, model: DeltaModel, filename: str, resolved: Resolved, batch: bool, ds: Dataset,
                    group: list[RecordResolution], spaced: SpacedAnswers | None = None) -> Any:
    """The results of a group's merged program (an error names the group's first record; `spaced` takes its
    warnings of answers without their leading space)."""
    try:
        with spaced.taking(group) if spaced is not None else nullcontext():
            return Experiment(source, model, filename=filename, resolved=resolved, batch=batch).run()
    except DeltaError as e:
        e.notes = (*e.notes, f"in record {group[0].record.index + 1} ({ds.where(group[0].record)})"
                   + (f" or one of the {len(group) - 1} run with it" if len(group) > 1 else ""))
        raise


def _run_groups(todo: list[list[RecordResolution]], per: dict[int, list[dict[str, Any]]], store: RecordStore | None,
                columns: list[str], progress: RecordProgress, on_group: Callable[[list[int]], None] | None,
                run: Callable[[list[RecordResolution]], dict[int, list[dict[str, Any]]]]) -> None:
    """Run each group of records, save its rows in `store` as it finishes, and show the progress."""
    with progress as bar:
        for group in todo:
            per.update(run(group))
            if store is not None:
                for r in group:
                    store.add(r.record.index, [{k: row.get(k, "") for k in columns} for row in per[r.record.index]])
            bar.advance(len(group), len(group))
            if on_group is not None:
                on_group([r.record.index for r in group])


def _run_group(program: ast.Program, ds: Dataset, group: list[RecordResolution], source: str, model: DeltaModel,
               filename: str, batch: bool, spaced: SpacedAnswers) -> dict[int, list[dict[str, Any]]]:
    """The rows of a group of records that share forwards, by record."""
    merged = merge([(r.record.index, r.resolved) for r in group if r.resolved is not None])
    results = _experiment_run(source, model, filename, merged, batch, ds, group, spaced)
    out: dict[int, list[dict[str, Any]]] = {}
    for r in group:
        assert r.resolved is not None
        k = r.record.index if len(group) > 1 else None
        out[r.record.index] = [{"record": r.record.index, "line": r.record.line, **r.record.fields,
                                "measure": measure_label(program, run.name, m),
                                "value": float(results[_renamed(m.result_name, run.name, k)])}
                               for run in r.resolved.runs for m in run.measures]
    return out


def refuse_per_record_vectors(resolutions: list[RecordResolution], source: str, filename: str) -> None:
    """A located error at a measure that gives a number per token (`norm(L4.states)`): a record's row is one number."""
    for r in resolutions:
        if r.resolved is not None:
            try:
                refuse_per_token([m for run in r.resolved.runs for m in run.measures], "over a dataset")
            except DeltaError as e:
                raise e.located(source, filename) from None
            return


def _renamed(name: str, run: str, k: int | None) -> str:
    """Record `k`'s name for `name` (a run's name, or a result name starting with it): `t#3`, `t#3.prob(...)`."""
    if k is None:
        return name
    assert name == run or name.startswith(run + ".")
    return f"{run}#{k}{name[len(run):]}"


def merge(parts: list[tuple[int, Resolved]]) -> Resolved:
    """Several records' programs as one (each run renamed `NAME#k`); a single program as it is."""
    if len(parts) == 1:
        return parts[0][1]
    runs: list[ResolvedRun] = []
    prompts: dict[str, Any] = {}
    for k, res in parts:
        for run in res.runs:
            ops = tuple(attrs.evolve(op, result_name=None if op.result_name is None else
                                     _renamed(op.result_name, run.name, k),
                                     source=attrs.evolve(op.source, run=_renamed(op.source.run, op.source.run, k))
                                     if isinstance(op.source, FromRun) else op.source) for op in run.ops)
            measures = tuple(attrs.evolve(m, result_name=_renamed(m.result_name, run.name, k),
                                          against=None if m.against is None else _renamed(m.against, m.against, k))
                             for m in run.measures)
            runs.append(attrs.evolve(run, name=_renamed(run.name, run.name, k), ops=ops, measures=measures,
                                     prompt=_renamed(run.prompt, run.prompt, k)))
        prompts.update({_renamed(n, n, k): t for n, t in res.prompts.items()})
    first = parts[0][1]
    return attrs.evolve(first, prompts=prompts, runs=tuple(runs))
