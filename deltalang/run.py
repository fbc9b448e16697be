"""The public entry points: `compile()` and `run()` a program (`run_sweep`, `sweep` re-exported).

    results = deltalang.run('read L0.states', model=model, prompt="The Eiffel Tower is in the city of")
    results["main.L0.states"].shape

`compile()` returns an `Experiment` (`deltalang.runs.compiled`) whose `run()` gives
`Results` (`deltalang.runs.results`); a program with sweeps runs through the sweep
engine (`deltalang.sweep.run_sweeps`), and a program over a dataset (a `dataset`
line, a record's field, or `data=`) through `deltalang.runs.dataset_run`, giving
`DatasetResults`: the dispatches this layer adds.

Remote execution (nnsight's NDIF) is refused: `compile(..., remote=...)` and
`--remote` raise `REMOTE_REFUSAL`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .ground.errors import DeltaError
from .language import ast
from .language.parse import Partial, parse_partial
from .language.resolve import uses_dataset
from .runs.compiled import Experiment, model_for
from .runs.dataset_run import DatasetResults, run_dataset
from .runs.results import Results
from .runs.shards import from_env, shard_of
from .sweep import run_sweep, run_sweeps, sweep
from .sweep.attribution_dataset import DatasetAttribution
from .sweep.dataset import DatasetSweepResults, run_dataset_sweep

__all__ = ["REMOTE_REFUSAL", "Experiment", "Results", "compile", "run", "run_sweep", "sweep"]

REMOTE_REFUSAL = ("remote execution is not supported: an NDIF server rebuilds a plain transformers model and "
                  "cannot serve deltalang's DeltaNet values; run locally (--device-map shards a large checkpoint "
                  "over local GPUs)")


def compile(source: str, model: Any = None, *, filename: str = "<program>", prompt: str | None = None,
            batch: bool = True, remote: bool | str = False) -> Experiment:
    """Parse, check, plan and emit a program against a model (loaded once and reused).

    `remote`: refused (`REMOTE_REFUSAL`): an NDIF server cannot rebuild deltalang's values.
    """
    if remote:
        raise DeltaError(REMOTE_REFUSAL)
    return _compiled(source, model, filename, prompt, batch, None)


def _compiled(source: str, model: Any, filename: str, prompt: str | None, batch: bool,
              parsed: Partial | None) -> Experiment:
    """`compile`'s Experiment, of `source` parsed here or already (`parsed`)."""
    return Experiment.from_source(source, model, filename=filename, prompt=prompt, batch=batch,
                                  sweep_driver=_run_sweeps, program=parsed)


def run(source: str, model: Any = None, *, filename: str = "<program>", prompt: str | None = None,
        batch: bool = True, remote: bool | str = False, data: Mapping[str, Any] | None = None,
        strict: bool = False, out: str | Path | None = None, resume: bool = False,
        normalise: str | Mapping[str, str] | None = None, shard: tuple[int, int] | str | None = None,
        align: str | None = None, refine_from: str | Path | None = None
        ) -> Results | DatasetResults | DatasetSweepResults | DatasetAttribution:
    """Compile and run a program; returns its Results (DatasetResults for a program over a dataset).

    `data`: {dataset name: a list of dicts or a pandas DataFrame}, used instead of the
    `dataset` line's file; `strict`: a record that does not resolve stops the run. A program with
    sweeps over a dataset gives `DatasetSweepResults` (a sweep by attribution: `DatasetAttribution`). Over a
    dataset, `out` saves the run record by record into that directory and `resume` continues a run saved
    there (as `--out`/`--resume`);
    `normalise` ({"clean": RUN, "corrupted": RUN} or "clean=A,corrupted=B") applies to dataset sweeps.
    `shard` ((K, N) or "K/N"; default: RANK/WORLD_SIZE under torchrun or accelerate launch): run shard K of N of
    the dataset's records, saved in `out/shard-K-of-N` (`deltalang.runs.shards`; `load_results(out)` merges the parts).
    `align` (a sweep over a dataset: "facts.subject", "facts.subject[0]" or "-1", the default): what a per-token
    measure's positions are counted from (`deltalang.sweep.aligned`), as `--align`. `refine_from` (with `shard`):
    the second phase of an attribution with refine split across shards, as `--refine-from` (docs/shards.md).
    A one-prompt program takes none of these: save its results with `Results.save`.
    """
    if remote:
        raise DeltaError(REMOTE_REFUSAL)
    parsed = parse_partial(source, filename)  # the one parse: the tree is passed on
    if parsed.errors and data is None:  # beside the syntax errors, the resolver's errors of the rest (as `compile`)
        _compiled(source, model, filename, prompt, batch, parsed)
    program = parsed.complete()
    if data is not None or uses_dataset(program):
        if prompt is not None:
            raise DeltaError("prompt= does not apply to a program over a dataset: its prompts are the records'")
        loaded = model_for(source, model, filename, program=program)
        part = shard_of(shard) if shard is not None else from_env()
        if any(isinstance(i, ast.Sweep) for i in program.items):
            return run_dataset_sweep(source, loaded, filename=filename, data=data, strict=strict,
                                     normalise=normalise, out=out, resume=resume, shard=part, align=align,
                                     refine_from=refine_from, program=program)
        for given, what in ((normalise, "normalise="), (align, "align="), (refine_from, "refine_from=")):
            if given is not None:
                raise DeltaError(f"{what} applies to sweeps (over a dataset: a `sweep ... on facts...`); "
                                 "this program over a dataset has none")
        return run_dataset(source, loaded, filename=filename, data=data, strict=strict, batch=batch,
                           out=out, resume=resume, shard=part, program=program)
    if align is not None:
        raise DeltaError(f"align={align!r} counts a per-token measure's positions in a sweep over a dataset; this "
                         "program runs one prompt: drop it")
    for given, what in ((out, "out="), (resume or None, "resume="), (normalise, "normalise="), (shard, "shard="),
                        (refine_from, "refine_from=")):
        if given is not None:
            raise DeltaError(f"{what} applies to a program over a dataset; save a one-prompt run's results "
                             "with Results.save(DIR), and run sweeps with deltalang.run_sweep(..., out=DIR)")
    return _compiled(source, model, filename, prompt, batch, parsed).run()


def _run_sweeps(exp: Experiment) -> Results:
    """The results of a program with sweeps, from the sweep engine."""
    return run_sweeps(exp).results
