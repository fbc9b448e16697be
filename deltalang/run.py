"""Compile and run programs: `compile()`, `run()`, `Results`, and the `run` / `emit` commands.

    results = deltalang.run('read L0.states', model=model, prompt="The Eiffel Tower is in the city of")
    results["main.L0.states"].shape

The emitted code is executed from `linecache` under a `<deltalang:FILE>` name
(nnsight reads the `with` blocks' source back). A DeltaError raised while it
runs (a write that does not fit, ...) is reported against the program line its
op came from; any other exception is deltalang's own bug and propagates as it
is (the command line reports it as one).

Remote execution (nnsight's NDIF) is refused: `compile(..., remote=...)` and
`--remote` raise `REMOTE_REFUSAL`.

`Results.save(DIR)` always writes every result (each tensor an independent
copy, so values that share storage save); `check_out_dir` finds, touching
nothing, whatever would stop a save in DIR, so the commands refuse such an
`--out` before the model loads.
"""

from __future__ import annotations

import argparse
import builtins
import hashlib
import json
import linecache
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from . import __version__
from .errors import DeltaError, Span
from .model import DeltaModel, load_model
from .plan import Plan, build_plan, format_plan

_MODELS: dict[tuple, DeltaModel] = {}

REMOTE_REFUSAL = ("remote execution is not supported: an NDIF server rebuilds a plain transformers model and "
                  "cannot serve deltalang's DeltaNet values; run locally (--device-map shards a large checkpoint "
                  "over local GPUs)")


def get_model(model: Any = None, *, device: str = "cpu", dtype: Any = None,
              trust_remote_code: bool = False, device_map: str | None = None) -> DeltaModel:
    """A loaded model: `model` itself, or a path / hub id / None (bundled), loaded once per process."""
    if isinstance(model, DeltaModel):
        return model
    key = (str(model) if model is not None else None, device, str(dtype), trust_remote_code, device_map)
    if key not in _MODELS:
        _MODELS[key] = load_model(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                                  device_map=device_map)
    return _MODELS[key]


class Results(Mapping[str, Any]):
    """The results of a program by name: tensors of reads, floats of measures, decoded tokens."""

    def __init__(self, values: Mapping[str, Any], *, model: DeltaModel | None = None,
                 program: str | None = None, code: str | None = None,
                 kinds: Mapping[str, str] | None = None,
                 token_labels: Mapping[str, tuple[str, ...]] | None = None,
                 code_file: str = "emitted.py") -> None:
        self._values = dict(values)
        self._kinds = dict(kinds or {})  # result name -> the value it holds ("next_token_probs", ...)
        self._labels = dict(token_labels or {})  # per-token results: the run's tokens, for display
        self._model = model
        self.program = program
        self.code = code
        self.code_file = code_file  # what `save` names `code`: emitted.py, or a sweep's reference.py

    def __getitem__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError:
            raise KeyError(f"{key!r}; results are: {', '.join(self._values)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self._values.items() if isinstance(v, torch.Tensor)}

    @property
    def measures(self) -> dict[str, float]:
        return {k: v for k, v in self._values.items() if not isinstance(v, torch.Tensor)}

    @property
    def tokens(self) -> dict[str, list[str]]:
        """Decoded new tokens of each `read tokens`, per prompt."""
        if self._model is None:
            return {}
        tok = self._model.tokenizer
        return {k: [tok.decode(row) for row in v.tolist()] for k, v in self.tensors.items()
                if self._kind(k) == "tokens"}

    def _kind(self, key: str) -> str:
        return self._kinds.get(key) or key.rsplit(".", 1)[-1]

    def summary(self, top: int = 5) -> str:
        lines = []
        tok = self._model.tokenizer if self._model is not None else None
        for k, v in self._values.items():
            if not isinstance(v, torch.Tensor):
                lines.append(f"{k:48} {v:.6g}" if isinstance(v, float) else f"{k:48} {v}")
            elif self._kind(k) == "tokens" and tok is not None:
                lines.append(f"{k:48} " + " | ".join(repr(tok.decode(r)) for r in v.tolist()))
            elif self._kind(k) == "next_token_probs" and tok is not None:
                p = v.float()
                for row in range(p.shape[0]):
                    vals, ids = p[row].topk(min(top, p.shape[-1]))
                    best = ", ".join(f"{tok.decode([i])!r} {x:.3f}" for x, i in zip(vals.tolist(), ids.tolist()))
                    lines.append(f"{k:48} top: {best}")
            elif self._kind(k) == "norm" and v.dim() == 2 and k in self._labels:
                lines.append(f"{k:48} per token:")
                for label, x in zip(self._labels[k], v[0].tolist()):
                    lines.append(f"    {label!r:14} {x:.4f}")
            else:
                lines.append(f"{k:48} {str(tuple(v.shape)):24} norm {float(v.float().norm()):.4f}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<deltalang Results: {len(self)} values>\n" + self.summary()

    def _repr_html_(self) -> str:  # notebooks
        import html

        return "<pre>" + html.escape(repr(self)) + "</pre>"

    def save(self, directory: str | Path, *, extra: Mapping[str, Any] | None = None) -> Path:
        """Write `results.safetensors`, `results.json` (and `program.dl`, `code_file`) atomically.

        Each tensor is saved as its own copy: results that share storage (`states` and
        `state_output`, ...) save like any others. A directory that cannot be written is a DeltaError.
        """
        out = check_out_dir(directory)
        tmp: Path | None = None
        try:
            out.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".deltalang-", dir=out))
            self._write(tmp, extra)
            for f in tmp.iterdir():
                os.replace(f, out / f.name)
        except OSError as e:  # checked before, so only what changed since (a full disk, ...)
            raise DeltaError(f"cannot save results in {directory}: {e.strerror or e}") from None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        return out

    def _write(self, tmp: Path, extra: Mapping[str, Any] | None) -> None:
        from safetensors.torch import save_file

        # clone: safetensors refuses tensors that share storage, and views of one result often do
        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in self.tensors.items()}
        save_file(tensors, str(tmp / "results.safetensors"))
        meta = {
            "measures": self.measures,
            "tokens": self.tokens,
            "shapes": {k: list(v.shape) for k, v in tensors.items()},
            "model": self._model.spec.model_id if self._model is not None else None,
            "versions": _versions(),
            "program_sha256": hashlib.sha256((self.program or "").encode()).hexdigest(),
            **(dict(extra) if extra else {}),
        }
        (tmp / "results.json").write_text(json.dumps(meta, indent=2, default=str), encoding="utf-8")
        if self.program is not None:
            (tmp / "program.dl").write_text(self.program, encoding="utf-8")
        if self.code is not None:
            (tmp / self.code_file).write_text(self.code, encoding="utf-8")


def check_out_dir(directory: str | Path) -> Path:
    """`directory` as a Path, or a DeltaError if results could not be saved there; creates nothing.

    It must be a directory, or not exist yet under a directory; the nearest existing
    one must take a new entry (tried with a temporary directory, removed at once).
    """
    out = Path(directory)
    if str(directory) == "":
        raise DeltaError("cannot save results in '': give a directory")
    try:
        probe = out
        while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
            probe = probe.parent
        if probe.is_symlink() and not probe.exists():
            raise DeltaError(f"cannot save results in {directory}: {probe} is a broken link")
        if not probe.is_dir():
            where = "it is" if probe == out else f"{probe} is"
            raise DeltaError(f"cannot save results in {directory}: {where} a file, not a directory")
        tempfile.TemporaryDirectory(prefix=".deltalang-", dir=probe).cleanup()
    except OSError as e:
        raise DeltaError(f"cannot save results in {directory}: {probe} cannot be written ({e.strerror or e})") \
            from None
    except ValueError as e:  # a NUL in the name
        raise DeltaError(f"cannot save results in {directory!r}: {e}") from None
    return out


def _versions() -> dict[str, str]:
    import nnsight
    import transformers

    return {"deltalang": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "nnsight": getattr(nnsight, "__version__", "?")}


class Experiment:
    """A compiled program: its `plan`, its `code`, and `run()`."""

    def __init__(self, source: str, model: DeltaModel, *, filename: str = "<program>",
                 prompt: str | None = None, batch: bool = True, resolved: Any = None) -> None:
        from .check import check

        self.source = source
        self.filename = filename
        self.model = model
        self.prompt = prompt
        # `resolved`: the program already checked, maybe rewritten (the sweep engine runs parts of it)
        self.resolved = resolved if resolved is not None else check(source, model.spec, filename=filename,
                                                                    prompt=prompt)
        try:
            self.plan: Plan = build_plan(self.resolved, batch=batch)
        except DeltaError as e:
            raise e.located(source, filename)
        from .emit import emit

        self.emitted = emit(self.plan, filename=filename, model_id=_model_arg(model))

    @property
    def code(self) -> str:
        return self.emitted.code

    def format_plan(self) -> str:
        return format_plan(self.plan)

    @property
    def has_sweeps(self) -> bool:
        return any(r.kind == "sweep" for r in self.resolved.runs)

    @property
    def code_file(self) -> str:
        """The name `code` is saved under: a sweep's code is the reference form the engine does not run."""
        return "reference.py" if self.has_sweeps else "emitted.py"

    def run(self) -> Results:
        """Execute the emitted code on the model; sweeps go through the sweep engine (`deltalang.sweep`)."""
        if self.has_sweeps:
            from .sweep import run_sweeps

            return run_sweeps(self).results
        name = f"<deltalang:{self.filename}:{hashlib.sha1(self.code.encode()).hexdigest()[:8]}>"
        linecache.cache[name] = (len(self.code), None, self.code.splitlines(keepends=True), name)
        namespace: dict[str, Any] = {"__name__": "deltalang_emitted", "__file__": name}
        exec(builtins.compile(self.code, name, "exec"), namespace)
        try:
            values = namespace["experiment"](self.model)
        except DeltaError as e:  # the program's mistake, found as it ran: point at its line
            raise self._locate(e, name, e) from None
        kinds = {op.key: op.value for p in self.plan.passes for r in p.runs for op in r.ops if op.key}
        kinds.update({m.result_name: m.kind for _, m in self.plan.measures})
        tokens = {r.name: r.tokens for r in self.resolved.runs}
        labels = {m.result_name: tokens.get(run, ()) for run, m in self.plan.measures if m.kind == "norm"}
        return Results(values, model=self.model, program=self.source, code=self.code, kinds=kinds,
                       token_labels=labels, code_file=self.code_file)

    def _locate(self, err: DeltaError, codename: str, exc: BaseException) -> DeltaError:
        tb = getattr(exc, "__intervention_tb__", None) or exc.__traceback__
        span: Span | None = None
        for frame, lineno in traceback.walk_tb(tb):
            if frame.f_code.co_filename == codename and lineno in self.emitted.line_map:
                span = self.emitted.line_map[lineno]
        if span is not None and err.span is None:
            err.span = span
        return err.located(self.source, self.filename)


def _model_arg(model: DeltaModel) -> str | None:
    from .bundled import NAME

    return None if model.spec.model_id == NAME else model.spec.model_id


def compile(source: str, model: Any = None, *, filename: str = "<program>", prompt: str | None = None,
            batch: bool = True, remote: bool | str = False) -> Experiment:
    """Parse, check, plan and emit a program against a model (loaded once and reused).

    `remote`: refused (`REMOTE_REFUSAL`): an NDIF server cannot rebuild deltalang's values.
    """
    if remote:
        raise DeltaError(REMOTE_REFUSAL)
    return Experiment(source, _model_for(source, model, filename), filename=filename, prompt=prompt, batch=batch)


def run(source: str, model: Any = None, *, filename: str = "<program>", prompt: str | None = None,
        batch: bool = True, remote: bool | str = False) -> Results:
    """Compile and run a program; returns its Results."""
    return compile(source, model, filename=filename, prompt=prompt, batch=batch, remote=remote).run()


def _model_for(source: str, model: Any, filename: str, **kw: Any) -> DeltaModel:
    if model is None:
        from . import ast
        from .parse import parse

        try:
            program = parse(source, filename)
        except DeltaError as e:
            raise e.located(source, filename)
        for item in program.items:
            if isinstance(item, ast.ModelDecl):
                model = item.name
    return get_model(model, **kw)


# ---------------------------------------------------------------------------
# the commands
# ---------------------------------------------------------------------------


def _experiment(args: argparse.Namespace) -> Experiment:
    """The program of a command compiled against its model (options already checked by `cli.check_options`)."""
    from .cli import read_program

    source, filename = read_program(args)
    model = _model_for(source, args.model, filename, device=args.device, dtype=args.dtype,
                       trust_remote_code=args.trust_remote_code, device_map=args.device_map)
    return Experiment(source, model, filename=filename, prompt=args.prompt)


def emit_main(args: argparse.Namespace) -> int:
    exp = _experiment(args)
    print(exp.format_plan() if args.plan else exp.code, end="")
    return 0


def run_main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    exp = _experiment(args)
    if exp.has_sweeps:
        from .sweep import sweep_main

        return sweep_main(args, exp)
    t1 = time.perf_counter()
    results = exp.run()
    t2 = time.perf_counter()
    print(results.summary())
    print(f"({len(exp.plan.passes)} pass(es); compile {1000 * (t1 - t0):.0f} ms incl. model load, "
          f"run {t2 - t1:.2f} s)", file=sys.stderr)
    if args.out is not None:
        out = results.save(args.out)
        print(f"wrote {out}/results.safetensors, results.json, program.dl, {results.code_file}", file=sys.stderr)
    return 0
