"""`deltalang run | check | emit | fmt | info | sweep`.

Contract: whatever the arguments and whatever the program file holds, a
command prints its output, or one `error: ...` (a DeltaError, in the
`file:line:col: error:` form when it points into the program) and exits 1.
`main` is the one place exceptions end: any other exception is a bug in
deltalang, printed as `error: internal error in deltalang (a bug, please report
it): Type: message` with exit 2 (the traceback only under `--debug`); running
out of memory is `error: out of memory: ...`, exit 1; Ctrl-C exits 130.
Argument errors argparse finds exit 2 with its usage line.

Options that would only fail once a model is loaded or has run (`--prompt ""`,
`--device`, `--remote`, an `--out` that cannot be written) are checked by
`check_options` before any command starts. Every command reads its program
with `read_program`.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Callable, Sequence

from .errors import DeltaError

# what `--device` may name; availability is asked of torch
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


def read_program(args: argparse.Namespace) -> tuple[str, str]:
    """(text, filename) of the program: `-e TEXT`, a UTF-8 file, or '-' for standard input."""
    expr = getattr(args, "expr", None)
    file = getattr(args, "file", None)
    if expr is not None and file is not None:
        raise DeltaError("give a program file or -e TEXT, not both")
    if expr is not None:
        return expr, "<-e>"
    if file is None:
        raise DeltaError("no program: give a .dl file, '-' for standard input, or -e TEXT")
    if file == "-":
        try:
            data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
            return data.decode("utf-8"), "<stdin>"
        except UnicodeDecodeError:
            raise DeltaError("standard input is not UTF-8 text") from None
        except (OSError, ValueError) as e:
            raise DeltaError(f"cannot read standard input: {e}") from None
    try:
        return Path(file).read_text(encoding="utf-8"), str(file)
    except FileNotFoundError:
        raise DeltaError(f"no such file: {file}") from None
    except IsADirectoryError:
        raise DeltaError(f"{file} is a directory, not a program") from None
    except UnicodeDecodeError:
        raise DeltaError(f"{file} is not UTF-8 text") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        raise DeltaError(f"cannot read {file}: {getattr(e, 'strerror', None) or e}") from None


def check_device(name: str) -> None:
    """A DeltaError unless torch can put tensors on device `name` here (checked before a model loads)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise DeltaError(f"--device {name!r} is not a device deltalang runs on: one of {', '.join(DEVICE_TYPES)}, "
                         f"with an index if needed (cuda:1)")
    try:
        torch.empty(0, device=device)
    except Exception as e:  # noqa: BLE001 - torch says "not compiled with CUDA" in several exception types
        raise DeltaError(f"--device {name} is not available with this torch ({torch.__version__}): "
                         f"{_first_line(e)}") from None


def check_options(args: argparse.Namespace) -> None:
    """The options that would fail only after a model loaded or ran, checked first."""
    if getattr(args, "prompt", None) == "":
        raise DeltaError("--prompt is empty: a run needs at least one token; give the prompt's text")
    if getattr(args, "remote", None) is not None:
        from .run import REMOTE_REFUSAL

        raise DeltaError(REMOTE_REFUSAL)
    if getattr(args, "device", None) is not None and getattr(args, "device_map", None) is None:
        check_device(args.device)
    if getattr(args, "out", None) is not None:
        from .run import check_out_dir

        check_out_dir(args.out)


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
    parser.add_argument("--debug", action="store_true", help="show the traceback of an internal error")
    sub = parser.add_subparsers(dest="command", required=True)
    debug = argparse.ArgumentParser(add_help=False)  # --debug after the command too
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    p = sub.add_parser("info", parents=[debug], help="the model's blocks, kernels and which values each serves")
    _add_model_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("check", parents=[debug], help="check a program against a model without running it")
    p.add_argument("file", nargs="?", help="a .dl file ('-' for standard input)")
    p.add_argument("-e", dest="expr", help="the program text itself")
    p.add_argument("--prompt", help="the prompt of the implicit top-level trace")
    _add_model_args(p)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("fmt", parents=[debug], help="print a program in canonical form")
    p.add_argument("file", help="a .dl file ('-' for standard input)")
    p.add_argument("--write", "-w", action="store_true", help="rewrite the file in place")
    p.set_defaults(func=cmd_fmt)

    for name, func, helptext in (("run", cmd_run, "run a program"),
                                 ("emit", cmd_emit, "print the nnsight code a program compiles to"),
                                 ("sweep", cmd_sweep, "run a program's sweeps: progress, table, CSV and plots")):
        p = sub.add_parser(name, parents=[debug], help=helptext)
        p.add_argument("file", nargs="?", help="a .dl file ('-' for standard input)")
        p.add_argument("-e", dest="expr", help="the program text itself")
        p.add_argument("--prompt", help="the prompt of the implicit top-level trace")
        _add_model_args(p)
        p.add_argument("--device", default="cpu")
        p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
        p.add_argument("--device-map", default=None,
                       help="shard a large checkpoint over the local GPUs (e.g. 'auto'; needs accelerate)")
        p.add_argument("--remote", nargs="?", const="ndif", choices=["ndif", "local"], default=None,
                       help="not supported: deltalang's values cannot run on an NDIF server (refused with the reason)")
        if name in ("run", "sweep"):
            p.add_argument("--out", help="write results.safetensors, results.json, program.dl and the code here: "
                                         "emitted.py, or a sweep's reference.py (with its sweep.csv, sweep.json "
                                         "and plots, as cells finish)")
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _out_of_memory(e: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return isinstance(e, MemoryError) or (torch is not None and isinstance(e, torch.OutOfMemoryError))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the one place that turns every exception into one line and an exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _quiet_transformers()
    from .errors import show_warnings_on_stderr

    show_warnings_on_stderr()  # a program's warnings, rendered like its errors
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        check_options(args)
        return func(args)
    except DeltaError as e:
        print(e.render(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
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
