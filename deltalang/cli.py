"""`deltalang run | check | emit | fmt | info | sweep | merge`.

Contract: whatever the arguments and whatever the program file holds, a command prints its output, or one
`error: ...` (a DeltaError, in the `file:line:col: error:` form when it points into the program) and exits 1.
`main` is the one place exceptions end: any other exception is a bug in deltalang, printed as `error: internal
error in deltalang (a bug, please report it): Type: message` with exit 2 (the traceback only under `--debug`);
out of memory is `error: out of memory: ...`, exit 1; Ctrl-C exits 130; argparse's errors exit 2 with its usage.
Options that would only fail once a model is loaded or has run are checked by `check_options` first (`--shard`
and `--device` from a launcher's RANK/WORLD_SIZE/LOCAL_RANK where not given). Every command reads its program with
`read_program` and parses it once with `parsed_program` (`options`), passing the tree on; every handler (`*_main`)
is here and imports lazily: `--help`, `--version` and `fmt` never import torch, transformers or nnsight, `check`
never nnsight; `check` and `fmt` colour (`lexer.highlight`) a terminal only.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .ground.errors import DeltaError, show_warnings_on_stderr
from .ground.version import __version__
from .options import (parsed_program, read_program, refuse_ignored, refuse_over_dataset, refuse_resume, refuse_shard,
                      refuse_unswept, refuse_unused_prompt, run_checked, shard_joined)

if TYPE_CHECKING:
    from .language.ast import Program
    from .runs.compiled import Experiment

DESCRIPTION = "deltalang: experiments on the recurrent memory of gated-DeltaNet blocks, compiled to nnsight."

def _write_program_text(text: str) -> None:
    """Program text (`check`, `fmt`) on standard output: coloured on a terminal, plain when piped."""
    if sys.stdout.isatty():
        from .language.lexer import highlight

        text = highlight(text)
    sys.stdout.write(text)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory or hub id (default: the bundled model)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own Python code")


# ---- the commands: each handler gets the parsed arguments, returns the exit status ----------


def _experiment(args: argparse.Namespace) -> Experiment:
    """The program of a command compiled against its model (options already checked by `check_options`)."""
    from .runs.compiled import Experiment

    source, filename = read_program(args)
    refuse_shard(args)
    exp = Experiment.from_source(source, args.model, filename=filename, prompt=args.prompt, device=args.device,
                                 dtype=args.dtype, trust_remote_code=args.trust_remote_code,
                                 device_map=args.device_map, program=parsed_program(args))
    refuse_unused_prompt(exp.resolved, args.prompt)
    return exp


def info_main(args: argparse.Namespace) -> int:
    """`deltalang info [--model M]`: the model's blocks, kernels and the values each serves."""
    from .models.spec import load_spec
    from .runtime.info import format_info

    spec = load_spec(args.model, trust_remote_code=getattr(args, "trust_remote_code", False))
    print(format_info(spec), end="")
    return 0


def check_main(args: argparse.Namespace) -> int:
    """`deltalang check FILE | -e TEXT [--prompt P] [--model M]`: print the resolved program, or the errors."""
    import warnings

    from .compiler.explain import format_resolved
    from .compiler.plan import checked_plan
    from .ground.errors import DeltaWarning
    from .language.check import check

    try:
        text, filename = read_program(args)
        if _over_dataset(args):
            return check_dataset(args, text, filename)
        with warnings.catch_warnings():  # the warnings are part of the output below
            warnings.simplefilter("ignore", DeltaWarning)
            resolved = check(text, getattr(args, "model", None), filename=filename,
                             prompt=getattr(args, "prompt", None),
                             trust_remote_code=getattr(args, "trust_remote_code", False), program=parsed_program(args))
        refuse_unused_prompt(resolved, getattr(args, "prompt", None))
        try:  # what `run` would refuse while ordering the runs (a cycle, a step a run lacks), max_new_tokens aside
            checked_plan(resolved)
        except DeltaError as e:
            raise e.located(text, filename) from None
    except DeltaError as e:
        print(e.render(), file=sys.stderr)
        return 1
    _write_program_text(format_resolved(resolved))
    return 0


def _over_dataset(args: argparse.Namespace) -> bool:
    """Whether the program runs over a dataset (a syntax error is left to the command's own path)."""
    from .language.resolve import uses_dataset

    try:
        parsed = parsed_program(args)
    except DeltaError:
        return False
    return not parsed.errors and uses_dataset(parsed.program)


def check_dataset(args: argparse.Namespace, text: str, filename: str) -> int:
    """`deltalang check` of a program over a dataset: its first record's plain program, and which records resolve."""
    from .compiler.explain import format_resolved
    from .ground.measures import refuse_per_token
    from .language import ast
    from .language.resolve import resolve_records
    from .models.spec import load_spec
    from .runs.dataset_generate import check_note
    from .runs.records import load_datasets

    program = parsed_program(args).complete()
    refuse_over_dataset(args, program)  # --prompt; --align/--by without a sweep
    model = getattr(args, "model", None) or next((i.name for i in program.items if isinstance(i, ast.ModelDecl)),
                                                 None)
    spec = load_spec(model, trust_remote_code=getattr(args, "trust_remote_code", False))
    ds, recs = resolve_records(program, load_datasets(program, filename, None), spec, source=text, filename=filename)
    first = next(r for r in recs if r.resolved is not None)
    try:  # a record's row is one number a measure
        refuse_per_token([m for run in first.resolved.runs if run.kind != "sweep" for m in run.measures],
                         "over a dataset")  # a sweep's per-token measures: a row per aligned position
    except DeltaError as e:
        raise e.located(text, filename) from None
    print(f"# record {first.record.index + 1} of '{ds.name}' ({ds.where(first.record)}), as its plain program:")
    _write_program_text(format_resolved(first.resolved))
    bad = [r for r in recs if r.error is not None]
    print(f"# {len(recs) - len(bad)} of {len(recs)} records resolve" + ("; left out:" if bad else ""))
    for r in bad:
        print(f"#   {ds.where(r.record)}: {' '.join(str(r.error.message).split()) if r.error else ''}")
    note = check_note(recs)  # a generate over a dataset: what each record keeps, which records share forwards
    if note is not None:
        print(note)
    return 0


def fmt_main(args: argparse.Namespace) -> int:
    """`deltalang fmt FILE [-w]`: print the program in canonical form, or rewrite the file."""
    from .language.ast import format_program

    try:
        text, filename = read_program(args)
        program = parsed_program(args).complete()
    except DeltaError as e:
        print(e.render(), file=sys.stderr)
        return 1
    out = format_program(program, text)
    if getattr(args, "write", False):
        if filename.startswith("<"):
            print("error: fmt -w rewrites a file; standard input has none", file=sys.stderr)
            return 1
        if out != text:
            try:
                Path(filename).write_text(out, encoding="utf-8")
            except OSError as e:
                print(f"error: cannot rewrite {filename}: {e.strerror or e}", file=sys.stderr)
                return 1
        return 0
    _write_program_text(out)
    return 0


def emit_main(args: argparse.Namespace) -> int:
    """`deltalang emit FILE [--plan]`: the nnsight code a program compiles to, or its plan."""
    source, filename = read_program(args)
    if _over_dataset(args):  # a generate over a dataset: its largest group of records' forwards
        from .language.ast import ModelDecl
        from .models.spec import load_spec
        from .runs.dataset_generate import describe
        from .runs.dataset_run import merge
        from .runs.records import load_datasets

        program = parsed_program(args).complete()
        model = args.model or next((i.name for i in program.items if isinstance(i, ModelDecl)), None)
        print(describe(program, source, filename, load_spec(model, trust_remote_code=args.trust_remote_code),
                       load_datasets(program, filename, None), merge, plan=args.plan), end="")
        return 0
    exp = _experiment(args)
    print(exp.format_plan() if args.plan else exp.code, end="")
    if args.plan and exp.has_sweeps:  # which path each sweep's cells take
        from .sweep.job import path_lines

        print("\n".join(path_lines(exp.resolved)))
    return 0


def run_main(args: argparse.Namespace) -> int:
    """`deltalang run FILE [--out DIR]`: run a program, print its results (a program with sweeps: `sweep_main`)."""
    t0 = time.perf_counter()
    source, filename = read_program(args)
    if _over_dataset(args):  # a syntax error: `_experiment` reports it beside the resolver's errors
        return dataset_main(args, source, filename)
    if not (parsed := parsed_program(args)).errors:
        refuse_unswept(args, parsed.program, "runs one prompt")  # before the model loads
    exp = _experiment(args)
    if exp.has_sweeps:
        return sweep_main(args, exp)
    refuse_resume(args)
    t1 = time.perf_counter()
    results = exp.run(progress=True)  # a generate's steps on stderr, one line updated in place
    t2 = time.perf_counter()
    print(results.summary())
    print(f"({len(exp.plan.passes)} pass(es); compile {1000 * (t1 - t0):.0f} ms incl. model load, "
          f"run {t2 - t1:.2f} s)", file=sys.stderr)
    if args.out is not None:
        out = results.save(args.out)
        print(f"wrote {out}/{', '.join(results.files())}", file=sys.stderr)
    return 0


def dataset_main(args: argparse.Namespace, source: str, filename: str) -> int:
    """`deltalang run | sweep FILE [--out DIR] [--strict] ...` of a program over a dataset: per-measure statistics,
    a sweep's cells, or an attribution's estimates (`over_dataset`), then where they were written."""
    from rich.console import Console

    t0 = time.perf_counter()
    out = over_dataset(args, source, filename, parsed_program(args).complete(), args.model, Console(stderr=True))
    print(out.summary())
    return _closing(args, t0, written(out), getattr(out, "phase", None) == "estimates")  # a refine's phase 1


def over_dataset(args: argparse.Namespace, source: str, filename: str, program: Program, model: Any,
                 console: Any) -> Any:
    """A program over a dataset (`program`: `source` parsed) run with every option of `args` as `deltalang run` and
    `sweep` run it: the command line's and the notebook magic's one path. `model`: a DeltaModel, a path or hub id,
    or None (the program's `model`, else the bundled one). DatasetResults, a DatasetGeneration, a collection's
    results, DatasetSweepResults or a DatasetAttribution; `console` shows the progress."""
    from .language import ast
    from .runs.compiled import model_for
    from .runs.dataset_run import run_dataset
    from .runs.records import load_datasets
    from .sweep.dataset import run_dataset_sweep

    refuse_over_dataset(args, program)  # --prompt; --align/--by without a sweep
    refuse_unswept(args, program, "runs over a dataset")  # --attribution, --normalise, ... without one
    datasets = load_datasets(program, filename, None)  # the data's errors before a model loads
    on = model_for(source, model, filename, program=program, device=args.device, dtype=args.dtype,
                   trust_remote_code=args.trust_remote_code, device_map=args.device_map)
    strict, resume = bool(getattr(args, "strict", False)), bool(getattr(args, "resume", False))
    if not any(isinstance(i, ast.Sweep) for i in program.items):
        return run_dataset(source, on, filename=filename, strict=strict, datasets=datasets, out=args.out,
                           resume=resume, console=console, shard=args.shard, program=program)
    refuse_ignored(args, bool(getattr(args, "attribution", False)))
    return run_dataset_sweep(source, on, filename=filename, datasets=datasets, strict=strict,
                             normalise=getattr(args, "normalise", None), out=args.out, by=getattr(args, "by", None),
                             resume=resume, batch_size=getattr(args, "batch_size", None),
                             engine="naive" if getattr(args, "naive", False) else "auto", progress=True,
                             console=console, method="attribution" if getattr(args, "attribution", False) else None,
                             path=getattr(args, "path", None), steps=getattr(args, "steps", None),
                             refine=getattr(args, "refine", None), align=getattr(args, "align", None),
                             shard=args.shard, refine_from=getattr(args, "refine_from", None), program=program)


def written(out: Any) -> str:
    """What a run over a dataset wrote into its --out, as the closing line names it."""
    from .runs.dataset_run import FILES

    return ", ".join(out.files() if hasattr(out, "files") else FILES)


def _closing(args: argparse.Namespace, t0: float, files: str, estimated: bool = False) -> int:
    """A run or sweep over a dataset's last lines: its time, where it wrote `files` (a generate's, a collection's own;
    `shards.wrote`: a shard's part, how many are done, how to merge; `estimated`: a sharded refine's phase 1)."""
    from .runs.shards import wrote

    print(f"({time.perf_counter() - t0:.1f} s incl. model load)", file=sys.stderr)
    if args.out is not None:
        print(wrote(args.out, args.shard, files, estimated), file=sys.stderr)  # a shard: its part, how to merge
    return 0


def sweep_main(args: argparse.Namespace, exp: Experiment | None = None) -> int:
    """`deltalang sweep FILE [--out DIR] [--resume] [--batch-size N] [--normalise clean=A,corrupted=B]`."""
    from rich.console import Console

    from .sweep import render_tables
    from .sweep.attribution import Attribution

    t0 = time.perf_counter()
    if exp is None:
        source, filename = read_program(args)
        if _over_dataset(args):
            return dataset_main(args, source, filename)
        exp = _experiment(args)
    err = Console(stderr=True)
    stdout = Console() if sys.stdout.isatty() else Console(width=200)  # logs keep whole tables
    out = getattr(args, "out", None)
    got = sweeps(args, exp, err, getattr(args, "command", "sweep") == "sweep")
    if isinstance(got, Attribution):  # method attribution: estimates, the top cells exact
        print(got.table(max(20, len(got.refined()))))
        err.print(f"wrote {got.files[0]}" if got.files else "", f"({time.perf_counter() - t0:.1f} s)")
        return 0
    for table in got.tables:
        for item in render_tables(table):
            stdout.print(item)
    cell_prefixes = tuple(f"{t.name}[" for t in got.tables)
    others = {k: v for k, v in got.results.items() if not k.startswith(cell_prefixes)}
    if others:
        print(exp.results_of(others).summary())  # what each holds, as `run` shows a program without sweeps
    if out is not None:
        err.print(f"wrote {out}/: {swept(got, out)}", highlight=False)
    err.print(f"({time.perf_counter() - t0:.1f} s)", highlight=False)
    return 0


def sweeps(args: argparse.Namespace, exp: Experiment, console: Any, note_unsaved: bool = False) -> Any:
    """A one-prompt program with sweeps run with every option of `args` (the command line's and the notebook
    magic's one path): by attribution (its `method attribution` or --attribution) an Attribution, else a
    SweepOutcome, saved in --out. `note_unsaved`: say on `console` that nothing is saved without --out."""
    from .sweep import DeltaSweepError, run_sweeps
    from .sweep.attribution import attribute, method_of

    if not exp.has_sweeps:
        raise DeltaSweepError("the program has no sweep: run it with `deltalang run`")
    out = getattr(args, "out", None)
    how = method_of(exp, "attribution" if getattr(args, "attribution", False) else None, getattr(args, "steps", None),
                    getattr(args, "refine", None), getattr(args, "path", None))
    refuse_ignored(args, how is not None, exp)
    if how is not None:
        return attribute(exp, steps=how.steps, refine=how.refine, out=out, exact=run_sweeps, path=how.path)
    if out is None and note_unsaved:
        console.print("note: no --out, so nothing is saved as cells finish (give --out DIR to keep a CSV and plots)",
                      highlight=False)
    outcome = run_sweeps(exp, out=out, resume=bool(getattr(args, "resume", False)),
                         batch_size=getattr(args, "batch_size", None), normalise=getattr(args, "normalise", None),
                         progress=True, console=console, engine="naive" if getattr(args, "naive", False) else "auto")
    if out is not None:
        outcome.results.save(out)
    return outcome


def swept(outcome: Any, out: str) -> str:
    """What a one-prompt sweep (`outcome`, a SweepOutcome) wrote into its --out `out`, as the closing line names it."""
    shown = ", ".join(str(f.relative_to(out)) if f.is_relative_to(out) else str(f) for f in outcome.files)
    code = outcome.results.code_file
    saved = ", ".join(f for f in outcome.results.files() if f != code)
    return f"{shown}, {saved}, {code} (the sweeps' reference form)"


def merge_main(args: argparse.Namespace) -> int:
    """`deltalang merge DIR`: join the parts the shards of a run wrote in DIR (`deltalang.merge`)."""
    from .merge import merge
    print(merge(args.dir).summary())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltalang", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"deltalang {__version__}",
                        help="print deltalang's version and exit")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an internal error")
    sub = parser.add_subparsers(dest="command", required=True)
    debug = argparse.ArgumentParser(add_help=False)  # --debug after the command too
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    p = sub.add_parser("info", parents=[debug], help="the model's blocks, kernels and which values each serves")
    _add_model_args(p)
    p.set_defaults(func=info_main)

    p = sub.add_parser("check", parents=[debug], help="check a program against a model without running it")
    p.add_argument("file", nargs="?", help="a .dl file ('-' for standard input)")
    p.add_argument("-e", dest="expr", help="the program text itself")
    p.add_argument("--prompt", help="the prompt of the implicit top-level trace")
    _add_model_args(p)
    p.set_defaults(func=check_main)

    p = sub.add_parser("fmt", parents=[debug], help="print a program in canonical form")
    p.add_argument("file", help="a .dl file ('-' for standard input)")
    p.add_argument("--write", "-w", action="store_true", help="rewrite the file in place")
    p.set_defaults(func=fmt_main)

    for name, func, helptext in (("run", run_main, "run a program"),
                                 ("emit", emit_main, "print the nnsight code a program compiles to"),
                                 ("sweep", sweep_main, "run a program's sweeps: progress, table, CSV and plots")):
        p = sub.add_parser(name, parents=[debug], help=helptext)
        p.add_argument("file", nargs="?", help="a .dl file ('-' for standard input)")
        p.add_argument("-e", dest="expr", help="the program text itself")
        p.add_argument("--prompt", help="the prompt of the implicit top-level trace")
        _add_model_args(p)
        p.add_argument("--device", help="cpu (the default), cuda, cuda:1, mps or xpu (torchrun: cuda:LOCAL_RANK)")
        p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
        p.add_argument("--device-map", default=None,
                       help="shard a large checkpoint through accelerate: 'auto', or a JSON file mapping module "
                            "names to devices (0, 'cpu', 'disk'); see docs/gpu.md")
        p.add_argument("--remote", nargs="?", const="ndif", choices=["ndif", "local"], default=None,
                       help="not supported: deltalang's values cannot run on an NDIF server (refused with the reason)")
        if name in ("run", "sweep"):
            p.add_argument("--out", help="write results.safetensors, results.json, program.dl and the code here: "
                                         "emitted.py, or a sweep's reference.py (with its sweep.csv, sweep.json "
                                         "and plots, as cells finish)")
            p.add_argument("--replace", action="store_true",
                           help="--out holds another program's results: delete them first (without it: refused)")
            p.add_argument("--strict", action="store_true",
                           help="over a dataset: stop at a record that does not resolve (default: leave it out)")
            p.add_argument("--shard", metavar="K/N", help="over a dataset: shard K (from 0) of N (docs/shards.md)")
            kept = "the records done (over a dataset)" if name == "run" else "its cells"
            p.add_argument("--resume", action="store_true", help=f"continue the {name} in --out DIR, keeping {kept}")
        if name == "sweep":
            p.add_argument("--batch-size", type=int, default=None, help="cells per forward (default: from memory)")
            p.add_argument("--normalise", default=None, metavar="clean=RUN,corrupted=RUN",
                           help="add (patched - corrupted) / (clean - corrupted) of each logit measure")
            p.add_argument("--naive", action="store_true", help="run every cell as a full forward (the reference)")
        if name in ("run", "sweep"):
            p.add_argument("--align", metavar="FIELD", help="a sweep over a dataset: count a per-token measure's "
                           "positions from this field's token (facts.subject; default -1: each record's end)")
            p.add_argument("--by", metavar="FIELD", help="a sweep over a dataset: each cell's mean by FIELD too")
            p.add_argument("--attribution", action="store_true", help="estimate every cell from gradients")
            p.add_argument("--steps", type=int, default=None, help="attribution: points of the path (0: plain)")
            p.add_argument("--refine", type=int, default=None, help="attribution: run the top K cells exactly")
            p.add_argument("--refine-from", metavar="DIR", help="--shard, refine: phase 2 of 2 (docs/shards.md)")
            p.add_argument("--path", default=None, choices=("blocks", "outputs", "embeddings"), help="attribution path")
        elif name == "emit":
            p.add_argument("--plan", action="store_true", help="print the plan instead of the code")
        p.set_defaults(func=func)
    p = sub.add_parser("merge", parents=[debug], help="join the parts of a run split by --shard in DIR")
    p.add_argument("dir", help="the --out DIR the shards wrote into")
    p.set_defaults(func=merge_main)
    return parser


def _own_process() -> None:
    """A command owns its process: its output the program's (`quiet`), freed memory kept for reuse (`allocator`)."""
    from .ground.allocator import keep_freed_memory
    from .ground.quiet import quiet_transformers

    quiet_transformers()
    keep_freed_memory()


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _out_of_memory(e: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return isinstance(e, MemoryError) or (torch is not None and isinstance(e, torch.OutOfMemoryError))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the one place that turns every exception into one line and an exit status."""
    args = build_parser().parse_args(shard_joined(sys.argv[1:] if argv is None else list(argv)))
    _own_process()
    show_warnings_on_stderr()  # a program's warnings, rendered like its errors
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return run_checked(args, func)
    except DeltaError as e:
        print(e.render(), file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # a generate's progress says how far it got (`compiled.StepProgress`)
        print("interrupted" + (f" {e}" if str(e) else ""), file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place every other exception ends
        if _out_of_memory(e):  # the machine's limit, not a bug and not the program's mistake
            print(f"error: out of memory: {_first_line(e)}", file=sys.stderr)
            return 1
        debug = bool(getattr(args, "debug", False))
        if debug:
            traceback.print_exc(file=sys.stderr)
        what = f"{type(e).__name__}: {_first_line(e)}" if _first_line(e) else type(e).__name__
        print(f"error: internal error in deltalang (a bug, please report it): {what}", file=sys.stderr)
        if not debug:
            print("  note: rerun with --debug to see the traceback", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
