"""Jupyter: `%load_ext deltalang` gives the `%%deltalang` cell magic.

    %%deltalang --prompt "The Eiffel Tower is in the city of" -o res
    read L1.state_after(-1) as s
    measure prob(" Paris")

The cell is a `.dl` program; the line takes the options of `deltalang run` and `deltalang sweep`
(`cli.build_parser`), `-o NAME` stores the result in a notebook variable, and `--model NAME` may name a
variable holding a `DeltaModel` (else models load once per kernel). The options mean what they mean there:
the cell goes through the command line's own paths (`options.run_checked`, `cli.over_dataset`, `cli.sweeps`),
so an option the program would ignore is refused as there. The value (shown as HTML) is what `deltalang run`
gives: `Results`, `DatasetResults`, a sweep's or an attribution's results, or a `SweepOutcome`. A mistake
shows as on the command line, never a traceback (`<cell>:line:col: error: ...` with a caret; a refused option
as one line), and the cell fails; warnings show the same way and the cell goes on. Loading the extension quiets transformers.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import warnings
from typing import Any, Callable, NoReturn

from .ground.errors import DeltaError, DeltaWarning

CELL = "<cell>"  # the program's file name in messages


class CellError(Exception):
    """A cell's error, shown by IPython as exactly its lines (`_render_traceback_`), not as a traceback."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def _render_traceback_(self) -> list[str]:  # IPython's hook for exceptions that render themselves
        return self.text.splitlines()


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext deltalang`: register the `%%deltalang` cell magic, and quiet transformers as the command line does."""
    from .ground.quiet import quiet_transformers

    quiet_transformers()
    # tqdm's notebook bars need ipywidgets; without them it warns once on import (transformers imports it)
    warnings.filterwarnings("ignore", message="IProgress not found")

    def deltalang(line: str, cell: str) -> Any:
        return run_cell(line, cell, ipython.user_ns)

    deltalang.__doc__ = __doc__
    ipython.register_magic_function(deltalang, magic_kind="cell", magic_name="deltalang")


def magic_parser() -> argparse.ArgumentParser:
    """The command line's `sweep` options, with `run`'s `--strict` and `-o NAME`; refusals raise DeltaError."""
    from .cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = commands.choices["sweep"]
    parser.prog = "%%deltalang"
    parser.description = "Run the cell as a deltalang program (the options of deltalang run and sweep)."
    parser.add_argument("-o", "--output", metavar="NAME", default=None,
                        help="store the results in the notebook variable NAME")
    if "--strict" not in parser._option_string_actions:  # `run`'s, for a program over a dataset
        parser.add_argument("--strict", action="store_true",
                            help="over a dataset: stop at a record that does not resolve (default: leave it out)")
    parser.set_defaults(debug=False)  # `--debug` is the command line's (shared by every command)

    def refuse(message: str) -> NoReturn:
        raise DeltaError(f"%%deltalang: {message} (see %%deltalang --help)")

    parser.error = refuse  # type: ignore[method-assign]
    for action in parser._actions:
        if action.dest in ("file", "expr"):  # the cell is the program
            action.help = argparse.SUPPRESS
    return parser


def parse_line(line: str) -> argparse.Namespace | None:
    """The magic's options; None when they asked for `--help` (printed)."""
    try:
        words = shlex.split(line)
    except ValueError as e:
        raise DeltaError(f"%%deltalang: cannot read the options: {e}") from None
    try:
        args = magic_parser().parse_args(words)
    except SystemExit:  # --help, printed by argparse
        return None
    if args.file is not None or args.expr is not None:
        raise DeltaError("%%deltalang: the cell is the program: give no file and no -e")
    if args.shard is not None or getattr(args, "refine_from", None) is not None:  # separate processes (`shards`)
        option = "--shard" if args.shard is not None else "--refine-from"
        raise DeltaError(f"%%deltalang: {option} is for a run split across processes: start them with torchrun or "
                         "`deltalang run --shard K/N`, then load_results(DIR)")
    if args.output is not None and not args.output.isidentifier():
        raise DeltaError(f"%%deltalang: -o {args.output!r} is not a Python name")
    return args


def run_cell(line: str, cell: str, namespace: dict[str, Any]) -> Any:
    """Run one `%%deltalang` cell (the module's contract); returns its value, or raises CellError."""
    from .cli import _first_line, _out_of_memory
    from .ground.quiet import quiet_transformers
    from .options import run_checked

    args: argparse.Namespace | None = None
    try:
        args = parse_line(line)
        if args is None:
            return None
        quiet_transformers()
        with warnings.catch_warnings():
            _show_delta_warnings()
            value = run_checked(args, lambda a: _run(a, cell, namespace), cell)  # --out claimed for the cell
    except DeltaError as e:
        raise CellError(e.render()) from None
    except KeyboardInterrupt:
        raise CellError("interrupted") from None
    except Exception as e:  # noqa: BLE001 - as the command line: one line, the traceback only with --debug
        if args is not None and args.debug:
            raise
        if _out_of_memory(e):
            raise CellError(f"error: out of memory: {_first_line(e)}") from None
        what = f"{type(e).__name__}: {_first_line(e)}" if _first_line(e) else type(e).__name__
        raise CellError(f"error: internal error in deltalang (a bug, please report it): {what}\n"
                        "  note: rerun with --debug to see the traceback") from None
    if args.output is not None:
        namespace[args.output] = value
    return value


def _show_delta_warnings() -> None:
    """Inside `warnings.catch_warnings()`: each DeltaWarning rendered on stderr (others as Python shows them)."""
    default: Callable[..., None] = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        if isinstance(message, DeltaWarning):
            print(message.render(), file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.simplefilter("always", DeltaWarning)
    warnings.showwarning = show


def _model(args: argparse.Namespace, namespace: dict[str, Any]) -> Any:
    """`--model`: a notebook variable holding a DeltaModel, else the path or hub id as given (None: bundled)."""
    from .runtime.model import DeltaModel

    name = args.model
    if name is not None and name.isidentifier() and isinstance(namespace.get(name), DeltaModel):
        return namespace[name]
    return name


def _run(args: argparse.Namespace, cell: str, namespace: dict[str, Any]) -> Any:
    """The cell as `deltalang run` / `sweep` runs it (options checked, --out claimed): the results it gives."""
    from rich.console import Console

    from .cli import over_dataset, sweeps, swept, written
    from .language.parse import parse_partial
    from .language.resolve import uses_dataset
    from .options import refuse_align, refuse_resume, refuse_unswept
    from .runs.compiled import Experiment
    from .runs.shards import wrote
    from .sweep.attribution import Attribution

    model = _model(args, namespace)
    console = Console(stderr=True, soft_wrap=True)  # progress: one line in place
    parsed = parse_partial(cell, CELL)  # the one parse; its errors as the command line's, beside the resolver's
    if not parsed.errors and uses_dataset(program := parsed.program):
        out = over_dataset(args, cell, CELL, program, model, console)
        if args.out is not None:
            print(wrote(args.out, None, written(out)), file=sys.stderr)
        return out
    refuse_align(args)  # --align/--by: a sweep over a dataset's
    if not parsed.errors:
        refuse_unswept(args, parsed.program, "runs one prompt")  # --attribution, --normalise, ... without a sweep
    exp = Experiment.from_source(cell, model, filename=CELL, prompt=args.prompt, program=parsed, device=args.device,
                                 dtype=args.dtype, trust_remote_code=args.trust_remote_code,
                                 device_map=args.device_map)
    if exp.has_sweeps:
        got = sweeps(args, exp, console)
        if isinstance(got, Attribution):
            if got.files:
                print(f"wrote {got.files[0]}", file=sys.stderr)
        elif args.out is not None:
            print(f"wrote {args.out}/: {swept(got, args.out)}", file=sys.stderr)
        return got
    refuse_resume(args)
    results = exp.run(progress=console)  # a generate's steps, one line in place
    if args.out is not None:
        print(f"wrote {results.save(args.out)}/: {', '.join(results.files())}", file=sys.stderr)
    return results
