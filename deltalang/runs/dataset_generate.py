"""A generate over a dataset: each record's continuation and every measure at every step (`run_generate`).

Each record runs its plain one-prompt program (`resolve.dataset.expand`); records whose prompts have one
length share one `model.generate` with an invoke per record (`merge`, runs renamed `NAME#k`), never
padded, so a record's tokens and measures are those of its program run alone (a sampled generate, or
runs that cannot be renamed apart, run alone). Returns `DatasetGeneration`: long-format `rows` (record,
line, fields, measure, step, value; new tokens as `g.tokens` rows), `continuations`, statistics per
measure and step; `save(DIR)` writes results.csv, continuations.jsonl, summary.csv/json, program.dl.
`out`/`resume` save and continue group by group (`dataset_store.RecordStore`); a shard runs whole groups
(`records.forward_groups`), `continuations_of` reads a part back for `merge`. `describe` is what
`deltalang emit [--plan]` prints. `dataset_run` passes in `merge` and `stats_of` (no upward import).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping

import attrs

from deltalang.compiler.emit import emit
from deltalang.compiler.explain import format_plan
from deltalang.compiler.plan import BATCH_TOKENS, Plan, build_plan, expand_measure_steps
from deltalang.ground import html
from deltalang.ground.compat import pandas
from deltalang.ground.datasets import Dataset
from deltalang.ground.errors import DeltaError
from deltalang.language import ast
from deltalang.language.ir import Mean, Named, Resolved, ResolvedMeasure, ResolvedOp, ResolvedRun
from deltalang.language.resolve import RecordResolution, resolve_records
from deltalang.language.resolve.dataset import measure_label
from deltalang.models.bundled import NAME
from deltalang.models.spec import ModelSpec
from deltalang.runtime.model import DeltaModel

from .compiled import Experiment
from .dataset_store import RecordProgress, format_stats, open_store, write_long_csv, write_summary
from .results import save_atomically
from .shards import Part, count_line

if TYPE_CHECKING:
    from rich.console import Console

MAX_RECORDS = 32  # records per shared generate
FILES = ("results.csv", "continuations.jsonl", "summary.csv", "summary.json", "program.dl")
Rows = dict[int, list[dict[str, Any]]]


@attrs.frozen
class StepStats:
    """One measure at one step over the records (`step` "" for a trace's): mean, sample std, n, 95% CI."""

    measure: str
    step: int | str
    mean: float
    std: float
    n: int
    ci_low: float
    ci_high: float


@attrs.frozen
class DatasetGeneration:
    """What a generate over a dataset gives: rows, continuations, statistics per measure and step, left out."""

    dataset: Dataset
    rows: tuple[dict[str, Any], ...]
    continuations: tuple[dict[str, Any], ...]  # record, line, run, text, token_ids
    stats: tuple[StepStats, ...]
    skipped: tuple[tuple[int, str], ...]
    program: str = ""
    part: Part | None = None  # a shard's run: its share of the records (`shards.count_line`); None: the whole run

    @property
    def columns(self) -> list[str]:
        return ["record", "line", *self.dataset.fields, "measure", "step", "value"]

    def values(self, measure: str, step: int | str = "") -> list[float]:
        """A measure's value at a step for each record that ran, in record order."""
        return [r["value"] for r in self.rows if r["measure"] == measure and r["step"] == step]

    def summary(self, shown: int = 5) -> str:
        """What `deltalang run` prints: the first continuations, a line per measure and step, the left out."""
        lines = [count_line(self.dataset.name, len(self.dataset.records), len(self.skipped), self.part)]
        for c in self.continuations[:shown]:
            lines.append(f"{c['run'] + '.tokens':24} {self.dataset.where(self.dataset.records[c['record']]):20} "
                         f"{c['text']!r}")
        if len(self.continuations) > shown:
            lines.append(f"... {len(self.continuations) - shown} more continuations (results.continuations)")
        for s in self.stats:
            step = f"step {s.step}" if s.step != "" else ""
            lines.append(f"{s.measure:40} {step:8} {format_stats(s)}")
        lines.extend(self.dataset.left_out_lines(self.skipped))
        return "\n".join(lines)

    def to_pandas(self) -> Any:
        """The rows as `results.csv` has them: long format, a row per record, measure and step."""
        pd = pandas()

        df = pd.DataFrame(list(self.rows), columns=self.columns)
        df["step"] = pd.to_numeric(df["step"].replace("", None))  # a trace's empty step: NaN, as read back
        return df

    def files(self) -> tuple[str, ...]:
        """The files `save` writes."""
        return FILES

    def __repr__(self) -> str:
        lines = self.summary().splitlines()
        return "\n".join([f"<deltalang DatasetGeneration: {len(self.continuations)} continuations, "
                          f"{len(self.rows)} rows>", *lines[:10],
                          *([f"... ({len(lines) - 10} more lines: print(results.summary()))"] if len(lines) > 10
                            else [])])

    def save(self, directory: str | Path) -> Path:
        """Write `FILES` into `directory`, each replacing its former version at once."""
        return save_atomically(directory, self._write)

    def _write(self, tmp: Path) -> None:
        write_long_csv(tmp / "results.csv", self.columns, self.rows)
        with open(tmp / "continuations.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(c) + "\n" for c in self.continuations)
        cols = ["measure", "step", "mean", "std", "n", "ci_low", "ci_high"]
        write_summary(tmp, cols, ([getattr(s, c) for c in cols] for s in self.stats),
                      {"measures": [attrs.asdict(s) for s in self.stats]}, self.dataset, self.skipped, self.program)

    def _repr_html_(self) -> str:
        """Notebooks: the first continuations and the statistics per measure and step."""
        conts = html.table(["record", "run", "continuation"],
                           [(self.dataset.where(self.dataset.records[c["record"]]), c["run"], repr(c["text"]))
                            for c in self.continuations[:20]], title=f"'{self.dataset.name}': continuations")
        stats = html.table(["measure", "step", "mean", "std", "n", "95% CI"],
                           [(s.measure, s.step, *html.stats_cells(s)) for s in self.stats], right=(2, 3, 4, 5))
        return conts + stats


def generates(resolutions: list[RecordResolution]) -> bool:
    """Whether a program over a dataset generates: its first resolved record's runs."""
    first = next((r.resolved for r in resolutions if r.resolved is not None), None)
    return first is not None and any(run.kind == "generate" for run in first.runs)


def with_tokens(resolved: Resolved) -> Resolved:
    """Every generate keeps its new tokens: `read tokens` added where the program does not write it."""
    runs = []
    for run in resolved.runs:
        if run.kind == "generate" and tokens_op(run) is None:
            op = ResolvedOp("read", None, "tokens", None, None, f"{run.name}.tokens", written="tokens")
            run = attrs.evolve(run, ops=(*run.ops, op))
        runs.append(run)
    return attrs.evolve(resolved, runs=tuple(runs))


def tokens_op(run: ResolvedRun) -> ResolvedOp | None:
    return next((op for op in run.ops if op.kind == "read" and op.value == "tokens"), None)


def shareable(resolved: Resolved) -> bool:
    """Whether a record's program can share forwards: greedy generates, runs that can be renamed apart."""
    for run in resolved.runs:
        if run.sampling is not None or any(m.alias is not None for m in run.measures):
            return False
        if any(op.alias is not None or isinstance(op.source, (Named, Mean)) for op in run.ops):
            return False
    return True


def generate_groups(resolutions: list[RecordResolution], batch: bool) -> list[list[RecordResolution]]:
    """Records whose generates' prompts have the same lengths, at most `MAX_RECORDS` and `BATCH_TOKENS` prompt
    tokens a generate (shortest first); a record whose program cannot share (`shareable`) runs alone."""
    alone: list[list[RecordResolution]] = []
    by_length: dict[tuple[int, ...], list[RecordResolution]] = {}
    for r in resolutions:
        assert r.resolved is not None
        if not batch or not shareable(r.resolved):
            alone.append([r])
            continue
        key = tuple(len(run.token_ids) for run in r.resolved.runs if run.kind == "generate")
        by_length.setdefault(key, []).append(r)
    out = []
    for key in sorted(by_length):
        rs, size = by_length[key], max(1, min(MAX_RECORDS, BATCH_TOKENS // max(key, default=1)))
        out.extend(rs[i:i + size] for i in range(0, len(rs), size))
    return out + alone


def shared_generates(plan: Plan) -> Plan:
    """The generates of one template run (`g#0`, `g#1`, ...; one stage, one prompt length) as one pass."""
    passes: list[Any] = []
    at: dict[tuple[Any, ...], int] = {}
    for p in plan.passes:
        r = p.runs[0]
        if p.kind == "generate" and len(p.runs) == 1 and "#" in r.name and r.sampling is None:
            key = (r.name.split("#", 1)[0], r.n_tokens, r.max_new_tokens, p.route)
            if key in at:
                i = at[key]
                passes[i] = attrs.evolve(passes[i], runs=(*passes[i].runs, r), then=passes[i].then + p.then)
                continue
            at[key] = len(passes)
        passes.append(p)
    return attrs.evolve(plan, passes=tuple(attrs.evolve(p, index=i + 1) for i, p in enumerate(passes)))


def check_note(resolutions: list[RecordResolution]) -> str | None:
    """What `deltalang check` adds for a generate over a dataset: what each record keeps, which share forwards."""
    if not generates(resolutions):
        return None
    first = next(r.resolved for r in resolutions if r.resolved is not None)
    gens = ", ".join(f"'{run.name}' {run.max_new_tokens} new tokens" for run in first.runs if run.kind == "generate")
    groups = generate_groups([r for r in resolutions if r.resolved is not None], True)
    return (f"# a generate over a dataset ({gens}): each record's continuation and every measure at every step; "
            f"records of one prompt length share a generate: {len(groups)} forward group(s) (deltalang emit --plan)")


def describe(program: ast.Program, source: str, filename: str, spec: ModelSpec, datasets: Mapping[str, Dataset],
             merge: Callable[[list[tuple[int, Resolved]]], Resolved], *, plan: bool) -> str:
    """`deltalang emit [--plan]` of a generate over a dataset (`program`: `source` parsed): the plan (or code) of its
    largest group of records sharing forwards, after a line naming them; nothing is loaded but the model's config
    and tokenizer."""
    ds, recs = resolve_records(program, datasets, spec, source=source, filename=filename)
    if not generates(recs):
        raise DeltaError("a program over a dataset resolves once per record: `deltalang check` shows a record's "
                         "program, `deltalang emit` a generate's shared forwards; run it with `deltalang run`")
    groups = generate_groups([attrs.evolve(r, resolved=with_tokens(r.resolved)) for r in recs
                              if r.resolved is not None], True)
    group = max(groups, key=len)
    merged = merge([(r.record.index, r.resolved) for r in group if r.resolved is not None])
    try:
        shared = shared_generates(build_plan(merged))
    except DeltaError as e:
        raise e.located(source, filename) from None
    numbers = [r.record.index + 1 for r in group]
    which = f"{numbers[0]}-{numbers[-1]}" if numbers == list(range(numbers[0], numbers[-1] + 1)) and \
        len(numbers) > 1 else ", ".join(map(str, numbers))
    head = (f"# records {which} of {len(ds.records)} of '{ds.name}' share these forwards ({len(groups)} group"
            f"{'s' if len(groups) != 1 else ''} in all; records of one prompt length share a generate)\n")
    if plan:
        return head + format_plan(shared)
    return head + emit(shared, filename=filename, model_id=None if spec.model_id == NAME else spec.model_id).code


class GroupExperiment(Experiment):
    """A group of records' merged program, its generates of one template run sharing one `model.generate`."""

    def __init__(self, source: str, model: DeltaModel, *, filename: str, resolved: Resolved, batch: bool) -> None:
        super().__init__(source, model, filename=filename, resolved=resolved, batch=batch)
        self.plan = shared_generates(self.plan)
        self.emitted = emit(self.plan, filename=filename,
                            model_id=None if model.spec.model_id == NAME else model.spec.model_id)


def renamed(name: str, run: str, k: int | None) -> str:
    """Record `k`'s name for a result of `run` (`g.step0.prob(...)` -> `g#3.step0.prob(...)`)."""
    return name if k is None else f"{run}#{k}{name[len(run):]}"


def step_label(program: ast.Program, run: ResolvedRun, m: ResolvedMeasure) -> str:
    """A measure named as the template writes it, without its step: `g.prob(facts.answer)`."""
    if m.alias is not None:
        suffix = f".step{m.step}"
        return m.result_name[:-len(suffix)] if m.result_name.endswith(suffix) else m.result_name
    return measure_label(program, run.name, attrs.evolve(m, step=None))


def record_rows(program: ast.Program, r: RecordResolution, results: Any, k: int | None) -> list[dict[str, Any]]:
    """A record's rows: each measure at each step, then each generate's new tokens (`g.tokens`, the id)."""
    assert r.resolved is not None
    base = {"record": r.record.index, "line": r.record.line, **r.record.fields}
    rows: list[dict[str, Any]] = []
    for run in r.resolved.runs:
        seen: set[str] = set()
        for m in expand_measure_steps(run):
            if m.result_name not in seen:  # `step 2: measure X` beside `measure X`: one result
                seen.add(m.result_name)
                rows.append({**base, "measure": step_label(program, run, m),
                             "step": m.step if run.kind == "generate" else "",
                             "value": float(results[renamed(m.result_name, run.name, k)])})
        op = tokens_op(run) if run.kind == "generate" else None
        if op is not None and op.result_name is not None:
            ids = results[renamed(op.result_name, run.name, k)].reshape(-1).tolist()
            rows.extend({**base, "measure": f"{run.name}.tokens", "step": s, "value": float(t)}
                        for s, t in enumerate(ids))
    return rows


def continuations(ds: Dataset, rows: list[dict[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    """Each record's continuation per generate, from its `g.tokens` rows (record order, then run order)."""
    got: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for row in rows:
        if str(row["measure"]).endswith(".tokens") and row["step"] != "":
            run = str(row["measure"])[:-len(".tokens")]
            got.setdefault((int(row["record"]), run), []).append((int(row["step"]), int(row["value"])))
    out = []
    for (i, run), steps in got.items():
        ids = [t for _, t in sorted(steps)]
        out.append({"record": i, "line": ds.records[i].line, "run": run, "text": tokenizer.decode(ids),
                    "token_ids": ids})
    return out


def continuations_of(directory: Path) -> list[dict[str, Any]]:
    """The continuations a saved generate wrote in `directory` (`continuations.jsonl`), in its order."""
    text = (directory / "continuations.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def step_stats(rows: list[dict[str, Any]], stats: Callable[[str, list[float]], Any]) -> tuple[StepStats, ...]:
    """Per measure and step (in the rows' order), `stats`' mean, std, n and CI; token ids are not measures."""
    groups: dict[tuple[str, Any], list[float]] = {}
    for row in rows:
        if not str(row["measure"]).endswith(".tokens"):
            groups.setdefault((row["measure"], row["step"]), []).append(row["value"])
    return tuple(StepStats(m, step, *attrs.astuple(stats(m, v))[1:]) for (m, step), v in groups.items())


def _as_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row read back from the store's CSV: its step a number (or ""), its value a float."""
    step = row["step"]
    return dict(row, record=int(row["record"]), line=int(row["line"]), step=int(step) if step != "" else "",
                value=float(row["value"]))


def run_generate(program: ast.Program, ds: Dataset, groups: list[list[RecordResolution]],
                 skipped: tuple[tuple[int, str], ...], source: str, model: DeltaModel, *, filename: str, batch: bool,
                 out: str | Path | None, resume: bool, console: Console | None,
                 on_group: Callable[[list[int]], None] | None, merge: Callable[[list[tuple[int, Resolved]]], Resolved],
                 stats: Callable[[str, list[float]], Any],
                 taking: Callable[[list[RecordResolution]], ContextManager[None]] = lambda _: nullcontext()
                 ) -> DatasetGeneration:
    """The generates of `groups` (`generate_groups` of the records run; see the module doc);
    `out`/`resume`/`console`/`on_group` as `run_dataset`'s; `taking(group)` while a group runs (its warnings)."""
    groups = [[attrs.evolve(r, resolved=with_tokens(r.resolved)) for r in g if r.resolved is not None] for g in groups]
    resolutions = [r for g in groups for r in g]
    columns = ["record", "line", *ds.fields, "measure", "step", "value"]
    store = open_store(out, source, model.spec.model_id, columns, len(ds.records), resume, {"batch": batch})
    done = store.done if store is not None else set()
    todo = [g for g in groups if not all(r.record.index in done for r in g)]  # a group is saved whole
    per: Rows = {r.record.index: [_as_row(x) for x in store.rows_of(r.record.index)]
                 for g in groups if g not in todo for r in g} if store is not None else {}
    n = sum(len(g) for g in todo)
    head = f"'{ds.name}': {n} record(s) to generate from in {len(todo)} forward group(s)" + (
        f", {len(resolutions) - n} done before" if n < len(resolutions) else "")
    try:
        with RecordProgress(console, n, n, "records", head) as bar:
            for group in todo:
                with taking(group):
                    per.update(_run_group(program, ds, group, source, model, filename, batch, merge))
                if store is not None:
                    for r in group:
                        store.add(r.record.index, [{k: row.get(k, "") for k in columns} for row in per[r.record.index]])
                bar.advance(len(group), len(group))
                if on_group is not None:
                    on_group([r.record.index for r in group])
    except BaseException:
        if store is not None:
            store.abandon()
        raise
    rows = [row for i in sorted(per) for row in per[i]]
    result = DatasetGeneration(ds, tuple(rows), tuple(continuations(ds, rows, model.spec.tokenizer)),
                               step_stats(rows, stats), skipped, source)
    if out is not None and store is not None:
        result.save(out)
        store.finish()
    return result


def _run_group(program: ast.Program, ds: Dataset, group: list[RecordResolution], source: str, model: DeltaModel,
               filename: str, batch: bool, merge: Callable[[list[tuple[int, Resolved]]], Resolved]) -> Rows:
    """The rows of a group of records that share forwards, by record (an error names the group's first)."""
    merged = merge([(r.record.index, r.resolved) for r in group if r.resolved is not None])
    try:
        results = GroupExperiment(source, model, filename=filename, resolved=merged, batch=batch).run()
    except DeltaError as e:
        e.notes = (*e.notes, f"in record {group[0].record.index + 1} ({ds.where(group[0].record)})"
                   + (f" or one of the {len(group) - 1} run with it" if len(group) > 1 else ""))
        raise
    return {r.record.index: record_rows(program, r, results, r.record.index if len(group) > 1 else None)
            for r in group}
