"""`deltalang run | check | emit | fmt | info | sweep`.

Every DeltaError a command meets is printed in the `file:line:col: error:` form
and exits with status 1; a traceback reaching the user is a bug.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from .errors import DeltaError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory or hub id (default: the bundled model)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own Python code")


def cmd_info(args: argparse.Namespace) -> int:
    from .info import info_main

    return info_main(args)


def cmd_check(args: argparse.Namespace) -> int:
    from .check import check_main

    return check_main(args)


def cmd_fmt(args: argparse.Namespace) -> int:
    from .check import fmt_main

    return fmt_main(args)


def cmd_run(args: argparse.Namespace) -> int:
    from .run import run_main

    return run_main(args)


def cmd_emit(args: argparse.Namespace) -> int:
    from .run import emit_main

    return emit_main(args)


def cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep import sweep_main

    return sweep_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltalang", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="the model's blocks, kernels and which values each serves")
    _add_model_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("check", help="check a program against a model without running it")
    p.add_argument("file", nargs="?", help="a .dl file ('-' for standard input)")
    p.add_argument("-e", dest="expr", help="the program text itself")
    p.add_argument("--prompt", help="the prompt of the implicit top-level trace")
    _add_model_args(p)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("fmt", help="print a program in canonical form")
    p.add_argument("file", help="a .dl file ('-' for standard input)")
    p.add_argument("--write", "-w", action="store_true", help="rewrite the file in place")
    p.set_defaults(func=cmd_fmt)

    for name, func, helptext in (("run", cmd_run, "run a program"),
                                 ("emit", cmd_emit, "print the nnsight code a program compiles to"),
                                 ("sweep", cmd_sweep, "run a program's sweeps: progress, table, CSV and plots")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("file", nargs="?", help="a .dl file ('-' for standard input)")
        p.add_argument("-e", dest="expr", help="the program text itself")
        p.add_argument("--prompt", help="the prompt of the implicit top-level trace")
        _add_model_args(p)
        p.add_argument("--device", default="cpu")
        p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
        p.add_argument("--device-map", default=None,
                       help="shard a large checkpoint over the local GPUs (e.g. 'auto'; needs accelerate)")
        p.add_argument("--remote", nargs="?", const="ndif", choices=["ndif", "local"], default=None,
                       help="run the passes through nnsight's remote execution (NDIF); 'local' simulates it here")
        if name in ("run", "sweep"):
            p.add_argument("--out", help="write results.safetensors, results.json, program.dl, emitted.py here "
                                         "(and a sweep's sweep.csv, sweep.json and plots, as cells finish)")
        if name == "sweep":
            p.add_argument("--resume", action="store_true", help="continue the sweep in --out DIR, keeping its cells")
            p.add_argument("--batch-size", type=int, default=None, help="cells per forward (default: from memory)")
            p.add_argument("--normalise", default=None, metavar="clean=RUN,corrupted=RUN",
                           help="add (patched - corrupted) / (clean - corrupted) of each logit measure")
            p.add_argument("--naive", action="store_true", help="run every cell as a full forward (the reference)")
        elif name == "emit":
            p.add_argument("--plan", action="store_true", help="print the plan instead of the code")
        p.set_defaults(func=func)
    return parser


def _quiet_transformers() -> None:
    """No progress bars or kernel fall-back notices on the command line: its output is the program's."""
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _quiet_transformers()
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except DeltaError as e:
        print(e.render(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
