"""The command line's program and options: read and parsed once, checked before a command starts, refused where ignored.

`read_program(args)`: the program's text and file name, read once (kept on `args.program`); `parsed_program(args)`:
that text parsed once (`parse.parse_partial`, kept on `args.parsed`), the tree every handler passes on.
`check_options(args)`: options that would fail only once a model is loaded or has run (`--prompt ""`,
`--device`, `--remote`, an `--out` that cannot be written), and combinations that mean nothing (`--naive`
with `--attribution`, `--resume` or `--replace` without `--out`; `--refine-from DIR` is the `--out`).
`claim_out(args)` claims the `--out` directory for the program (`results.claim_out_dir`: never results
beside another program's); `run_checked(args, func)` runs a command between the two (the command line's and
the notebook magic's way in). `refuse_resume` (`--resume` of a program that runs at once),
`refuse_unused_prompt` (a `--prompt` no statement uses), `refuse_unswept` (a sweep's options without one),
`refuse_shard` and `refuse_over_dataset` (`--shard`, `--align`, `--by`, `--prompt` where the program would ignore
them) and `refuse_ignored` (an exact sweep's options under attribution; a `--normalise` whose two runs are one) are
DeltaErrors where `cli` knows the program.
`launch_defaults(args)`: under `torchrun` or `accelerate launch`, `--shard` from RANK/WORLD_SIZE and `--device`
from LOCAL_RANK where not given (`deltalang.runs.shards`). `shard_joined(argv)`: `--shard -1/2` as `--shard=-1/2`, so
that a negative shard is deltalang's one line, not argparse's usage. Imports are lazy, so `deltalang --help` loads nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from .ground.errors import DeltaError

T = TypeVar("T")

if TYPE_CHECKING:
    from .language.ast import Program
    from .language.parse import Partial

# what `--device` may name; availability is asked of torch
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


def read_program(args: argparse.Namespace) -> tuple[str, str]:
    """(text, filename) of the program: `-e TEXT`, a UTF-8 file, or '-' for standard input (read once, kept on
    `args.program`)."""
    if getattr(args, "program", None) is None:
        args.program = _read(args)
    return args.program


def parsed_program(args: argparse.Namespace) -> Partial:
    """The program of `read_program` parsed once per command (`parse.parse_partial`, kept on `args.parsed`) and
    passed on: its statements' errors are reported where it is checked, beside the resolver's errors of the rest
    (`check`); a text that does not parse at all raises its error here, at every call."""
    from .language.parse import parse_partial

    parsed = getattr(args, "parsed", None)
    if parsed is None:
        text, filename = read_program(args)
        try:
            parsed = parse_partial(text, filename)
        except DeltaError as e:
            parsed = e
        args.parsed = parsed
    if isinstance(parsed, DeltaError):
        raise parsed
    return parsed


def _read(args: argparse.Namespace) -> tuple[str, str]:
    """`read_program`'s (text, filename), read."""
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
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None


def launch_defaults(args: argparse.Namespace) -> None:
    """`--shard` (given, or RANK of WORLD_SIZE) as a `shards.Shard`; `--device` not given: `cuda:LOCAL_RANK` for a
    process a launcher started on a machine with CUDA, else cpu."""
    if not hasattr(args, "device"):
        return
    from .runs.shards import from_env, launch_device, shard_of

    if hasattr(args, "shard"):
        args.shard = shard_of(args.shard) if args.shard is not None else from_env()
    if args.device is None:
        device = None
        if from_env() is not None and "LOCAL_RANK" in os.environ:
            import torch

            device = launch_device(torch.cuda.device_count() if torch.cuda.is_available() else 0)
        args.device = device or "cpu"


def check_options(args: argparse.Namespace) -> None:
    """The options that would fail only after a model loaded or ran, checked first (`launch_defaults` filled in)."""
    launch_defaults(args)
    if getattr(args, "prompt", None) == "":
        raise DeltaError("--prompt is empty: a run needs at least one token; give the prompt's text")
    if getattr(args, "remote", None) is not None:
        from .run import REMOTE_REFUSAL

        raise DeltaError(REMOTE_REFUSAL)
    if getattr(args, "device", None) is not None and getattr(args, "device_map", None) is None:
        check_device(args.device)
    refine_from = getattr(args, "refine_from", None)  # phase two of a sharded refine writes where phase one did
    if refine_from is not None and getattr(args, "shard", None) is None:
        raise DeltaError("--refine-from DIR is the second phase of an attribution with refine split by --shard: "
                         "give --shard K/N (or run it under torchrun)")
    if refine_from is not None and getattr(args, "out", None) is None:
        args.out = refine_from
    elif refine_from is not None and os.path.realpath(args.out) != os.path.realpath(refine_from):
        raise DeltaError(f"--refine-from {refine_from} refines the parts its shards saved there: drop --out "
                         f"{args.out}")
    if getattr(args, "out", None) is not None:
        from .runs.results import check_out_dir

        check_out_dir(args.out)
    elif getattr(args, "resume", False) or getattr(args, "replace", False):
        raise DeltaError(f"--{'resume' if args.resume else 'replace'} is about the run's --out directory: give --out DIR")
    if getattr(args, "naive", False) and getattr(args, "attribution", False):
        raise DeltaError("--naive runs every cell exactly as a full forward, --attribution estimates them from "
                         "gradients: give one of them")
    if getattr(args, "resume", False) and getattr(args, "replace", False):
        raise DeltaError("--resume continues the run in --out, --replace deletes it: give one of them")


def run_checked(args: argparse.Namespace, func: Callable[[argparse.Namespace], T], source: str | None = None) -> T:
    """`func(args)` with its options checked first (`check_options`) and its `--out` claimed for the program
    (`claim_out`; `source`: its text where `args` name no file, a notebook cell's); a run that fails leaves nothing
    that looks like results there (`results.OutDir.failed`). The command line's and the notebook magic's way in."""
    check_options(args)
    claim = claim_out(args, source)
    try:
        return func(args)
    except BaseException:
        if claim is not None:
            claim.failed()
        raise


def refuse_resume(args: argparse.Namespace) -> None:
    """`--resume` of a one-prompt program without sweeps (it runs at once): an error."""
    if getattr(args, "resume", False):
        raise DeltaError("--resume continues a run over a dataset or a sweep; this program runs at once: drop it")


def claim_out(args: argparse.Namespace, source: str | None = None) -> Any:
    """The `--out` directory claimed for this program (`results.claim_out_dir`; `source`: its text, else
    `read_program`'s), or None without --out."""
    if getattr(args, "out", None) is None:
        return None
    from .runs.results import claim_out_dir

    shard = getattr(args, "shard", None)  # shard K of N writes DIR/shard-K-of-N only (`deltalang.runs.shards`)
    out = args.out if shard is None else f"{args.out}/{shard.name}"
    resume = args.resume
    if shard is not None:  # a resume of a part that never started is its start (`shards.resumes`)
        from .runs.shards import resumes

        resume = resumes(Path(out), resume)
    return claim_out_dir(out, read_program(args)[0] if source is None else source, resume=resume,
                         replace=getattr(args, "replace", False))


def refuse_shard(args: argparse.Namespace) -> None:
    """`--shard` (or a launcher's RANK) splits a run over a dataset's records: an error for a one-prompt program;
    so is `--align` (`refuse_align`)."""
    if getattr(args, "shard", None) is not None:
        raise DeltaError(f"--shard {args.shard.k}/{args.shard.n} splits a run over a dataset's records; this program "
                         f"runs one prompt: drop it (under torchrun: run it in one process)")
    if getattr(args, "refine_from", None) is not None:
        raise DeltaError("--refine-from is the second phase of an attribution over a dataset split by --shard; this "
                         "program runs one prompt: drop it")
    refuse_align(args)


def refuse_over_dataset(args: argparse.Namespace, program: Program) -> None:
    """What a program over a dataset (`program`, parsed) would ignore: `--prompt` (its prompts are the records'),
    `--align`/`--by` without a sweep (checked before a model loads)."""
    if getattr(args, "prompt", None) is not None:
        raise DeltaError("--prompt does not apply to a program over a dataset: its prompts are the records'")
    if getattr(args, "align", None) is None and getattr(args, "by", None) is None:
        return
    from .language import ast

    if not any(isinstance(i, ast.Sweep) for i in program.items):
        refuse_align(args, "runs over a dataset without a sweep")


def refuse_align(args: argparse.Namespace, what: str = "runs one prompt") -> None:
    """`--align` (a per-token measure's positions) and `--by` (records grouped by a field) apply to a sweep over a
    dataset: an error for any other program (`what` it is), which would ignore them."""
    for flag, does in (("align", "counts a per-token measure's positions"), ("by", "groups the records")):
        if getattr(args, flag, None) is not None:
            raise DeltaError(f"--{flag} {getattr(args, flag)} {does} in a sweep over a dataset; this program {what}: "
                             "drop it")


SWEEP_OPTIONS = ("attribution", "steps", "refine", "path", "refine_from", "normalise", "batch_size", "naive")


def refuse_unswept(args: argparse.Namespace, program: Program, what: str) -> None:
    """The options of a sweep (`SWEEP_OPTIONS`: `--attribution`, `--normalise`, ...) given for a program without one
    (`program`, parsed; `what` it does): an error, as it would ignore them (checked before a model loads)."""
    from .language import ast

    given = [f"--{o.replace('_', '-')}" for o in SWEEP_OPTIONS
             if (v := getattr(args, o, None)) is not None and v is not False]  # `--steps 0` is given
    if given and not any(isinstance(i, ast.Sweep) for i in program.items):
        raise DeltaError(f"{', '.join(given)}: {'an option' if len(given) == 1 else 'options'} of a sweep; this "
                         f"program {what} and has no sweep: drop {'it' if len(given) == 1 else 'them'}")


def refuse_unused_prompt(resolved: Any, prompt: str | None) -> None:
    """`--prompt` is the prompt of the statements outside any run: an error where there are none."""
    if prompt is not None and not any(r.name == "main" and r.implicit for r in resolved.runs):
        raise DeltaError("--prompt gives the prompt of the statements outside any run (the implicit trace 'main'); "
                         "this program has none, so it would change nothing: drop --prompt, or edit the prompt "
                         "the runs name")


def refuse_ignored(args: argparse.Namespace, attribution: bool, exp: Any = None) -> None:
    """Options of an exact sweep that attribution would ignore, and a `--normalise` whose denominator is zero."""
    given = [f"--{o.replace('_', '-')}" for o in ("naive", "normalise", "batch_size", "resume") if getattr(args, o, None)]
    if attribution and given:
        raise DeltaError(f"{', '.join(given)}: not an option of a sweep by attribution (it estimates every cell from "
                         f"gradients and runs the top cells exactly); drop it, or run the sweep exactly")
    norm = getattr(args, "normalise", None)
    pairs = dict(p.split("=", 1) for p in (norm or "").split(",") if p.count("=") == 1)
    clean, corrupted = (pairs.get(k, "").strip() for k in ("clean", "corrupted"))
    prompts = getattr(getattr(exp, "resolved", None), "prompts", {})
    if clean and (clean == corrupted or (clean in prompts and prompts.get(clean) == prompts.get(corrupted))):
        raise DeltaError(f"--normalise {norm}: clean and corrupted are the same run, so (clean - corrupted) is 0 and "
                         f"every normalised value would be nan: name two runs that differ")


def shard_joined(argv: list[str]) -> list[str]:
    """`--shard -1/2` as `--shard=-1/2`: argparse takes a value starting with '-' for an option (its usage text);
    joined, `shards.shard_of` says what is wrong in one line, as for `--shard=-1/2`."""
    out: list[str] = []
    rest = iter(argv)
    for a in rest:
        if a == "--shard" and out[-1:] != ["--"]:
            value = next(rest, None)
            out.extend([a] if value is None else [f"--shard={value}"] if value[:1] == "-" and value[1:2].isdigit()
                       else [a, value])
        else:
            out.append(a)
    return out
