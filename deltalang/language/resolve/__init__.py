"""Check a parsed program against a model's shape and make it concrete: `resolve()`.

Input: a parsed program and a `spec.ModelSpec` (config and tokenizer, no weights). Output: `ir.Resolved`,
runs in source order, each with one `ResolvedOp` per block and every position a token index; sweeps stay
templates with their axes resolved (`ResolvedRun.points()`, `.instantiate()`). Every error of a file is
reported at once (`DeltaErrors`), each pointing at its source. Nothing is guessed silently: what cannot
mean what was written is an error; what runs but not exactly as written is a `DeltaWarning` on
`Resolved.warnings`. The steps: `scope`, `declare`, `runs`, `sites`, `sources`, `dataset`. A program over
a dataset is refused by `resolve()`; `resolve_records()` resolves each record's plain program.
"""

from __future__ import annotations

from typing import Mapping

import attrs

from deltalang.ground.datasets import Dataset, Record
from deltalang.ground.errors import DeltaError, DeltaErrors
from deltalang.models.spec import ModelSpec

from .. import ast
from ..ir import Resolved, ResolvedRun
from .dataset import check_over, expand, uses_dataset
from .declare import declare
from .donors import donor_token_warnings, with_warnings
from .effects import warn_unread
from .runs import Draft, implicit_run, resolve_main, resolve_run
from .scope import Scope
from .sources import finish_deferred

__all__ = ["RecordResolution", "resolve", "resolve_records", "uses_dataset"]


def resolve(program: ast.Program, spec: ModelSpec, *, prompt_override: str | None = None,
            source: str = "", filename: str = "<program>") -> Resolved:
    """Check `program` against `spec` and make it concrete. Raises DeltaErrors / DeltaResolveError.

    `prompt_override` is the prompt of the implicit run `main` (the CLI's --prompt);
    `source` and `filename`, when given, locate the errors for rendering.
    """
    try:
        if uses_dataset(program):
            first = next(n for n in ast.walk(program) if isinstance(n, (ast.DatasetDecl, ast.Field)))
            raise DeltaError("a program over a dataset resolves once per record: run it with `deltalang run` or "
                             "deltalang.run(..., data=...)", first.span)
        return resolve_program(Scope(program, spec, prompt_override, source, filename))
    except DeltaError as e:
        raise (e.located(source, filename) if source else e) from None


@attrs.frozen
class RecordResolution:
    """One record of a dataset and its plain program, resolved (`resolved`) or not (`error`)."""

    record: Record
    resolved: Resolved | None
    error: DeltaError | None


def resolve_records(program: ast.Program, datasets: Mapping[str, Dataset], spec: ModelSpec, *,
                    source: str = "", filename: str = "<program>") -> tuple[Dataset, list[RecordResolution]]:
    """Each record's plain program (`dataset.expand`), resolved; the dataset the runs are on.

    What fails for every record is the program's error and is raised (the first
    record's, with a note naming it); a record that alone fails is returned with
    its error. Errors that hold for every record (`dataset.check_over`) are raised first.
    """
    try:
        ds = check_over(program, datasets)
    except DeltaError as e:
        raise (e.located(source, filename) if source else e) from None
    out: list[RecordResolution] = []
    for record in ds.records:
        try:
            out.append(RecordResolution(record, resolve(expand(program, ds, record, spec), spec, source=source,
                                                        filename=filename), None))
        except DeltaError as e:
            out.append(RecordResolution(record, None, e))
    if all(r.error is not None for r in out):
        err = out[0].error
        assert err is not None
        err.notes = (*err.notes, f"in every record of '{ds.name}'; the first is at {ds.where(ds.records[0])}")
        raise err
    return ds, with_donor_warnings(program, ds, out, source, filename)


def with_donor_warnings(program: ast.Program, ds: Dataset, out: list[RecordResolution], source: str,
                        filename: str) -> list[RecordResolution]:
    """The records, the first resolved one carrying the warnings about every record's donors
    (`donors.donor_token_warnings`), so that `check` and `run` both show them once."""
    done = [(r.record, r.resolved) for r in out if r.resolved is not None]
    extra = donor_token_warnings(program, ds, done)
    if not extra:
        return out
    i = next(i for i, r in enumerate(out) if r.resolved is not None)
    first = out[i].resolved
    assert first is not None
    return [*out[:i], attrs.evolve(out[i], resolved=with_warnings(first, extra, source, filename)), *out[i + 1:]]


def resolve_program(scope: Scope) -> Resolved:
    """Declare every name, resolve each run, then the `= NAME` sources; all the errors at once, or the runs
    in source order (a prompt's implicit clean run where the prompt is declared)."""
    declare(scope)
    drafts: dict[int, list[Draft]] = {}
    main_index = None
    for i, item in enumerate(scope.program.items):
        if isinstance(item, ast.RUN_TYPES):
            d = resolve_run(scope, item)
            if d is not None:
                drafts[i] = [d]
        elif isinstance(item, ast.STATEMENT_TYPES) and not isinstance(item, ast.Route) and main_index is None:
            main_index = i
    if main_index is not None:
        d = resolve_main(scope)
        if d is not None:
            drafts.setdefault(main_index, []).append(d)
    finish_deferred(scope)
    runs: list[ResolvedRun] = []
    for i, item in enumerate(scope.program.items):
        if isinstance(item, ast.PromptDecl) and item.name in scope.implicit:
            decl = scope.prompts[item.name]  # --prompt may have replaced `main`
            if isinstance(decl, ast.PromptDecl):
                runs.append(implicit_run(scope, decl))
        runs.extend(d.build() for d in drafts.get(i, []))
    warn_unread(scope, runs)
    if scope.errors:
        errs = sorted(scope.errors, key=lambda e: (e.span.line, e.span.column) if e.span else (0, 0))
        raise errs[0] if len(errs) == 1 else DeltaErrors(list(errs))
    return Resolved(scope.model, dict(scope.prompt_texts), tuple(runs), scope.spec, scope.source, scope.filename,
                    scope.sorted_warnings())
