"""The results of a program by name (`Results`), and where they may be saved (`check_out_dir`).

`Results` maps each result name to its value: a tensor for a read, a float (or per-prompt tensor) for a
measure, token ids for `read tokens`, a `measures.TopK` for `top(k)`. `summary()` prints them as
`deltalang run` does (shapes with the catalogue's axis names, or the `axes` given: a reduction's, one head's;
norms named, a per-token norm as a table of its `token_labels`, a KL below 0 shown as 0: `shown_value`), told by
`kinds` what a result holds (`shown.shown` says all three for a compiled program); values stay raw. `save(DIR)`
writes `results.safetensors` (each tensor an independent copy; none without tensors) and `results.json` (with
the versions that produced it). `check_out_dir` finds, touching nothing, whatever would stop a save, so commands
refuse such an `--out` before loading.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from deltalang.compiler.shown import named_kind
from deltalang.ground import display, html
from deltalang.ground.compat import pandas
from deltalang.ground.errors import DeltaError
from deltalang.ground.measures import TopK
from deltalang.ground.version import __version__
from deltalang.models.values import CATALOGUE, DELTANET, MODEL_VALUES, shape_on
from deltalang.runtime.model import DeltaModel

NORM = "‖·‖F"  # how summaries name the Frobenius norm
NONNEGATIVE = ("kl",)  # measures >= 0 in exact arithmetic: float noise below 0 is shown as 0


def axis_names(kind: str, ndim: int, block: str = DELTANET) -> list[str] | None:
    """The axis names of value `kind` from its catalogue shape on a block of kind `block` (`values.shape_on`:
    `[b, heads, key_dim, value_dim]`, a Mamba-2 block's `[b, heads, head_dim, d_state]`), if `ndim` fits.

    A shape with alternatives (`[b, s, heads] (Kimi: [b, s, heads, key_dim])`) gives the one with `ndim` axes.
    """
    shape = shape_on(kind, block) if kind in CATALOGUE else MODEL_VALUES.get(kind, "")
    for group in re.findall(r"\[([^\]]*)\]", shape):
        names = [n.strip() for n in group.split(",")]
        if len(names) == ndim:
            return names
    return None


def named_shape(kind: str, shape: Sequence[int], head: bool = False, block: str = DELTANET) -> str:
    """`[b=1, heads=4, key_dim=32, value_dim=32]`, or `[1, 4, 32, 32]` for a value without catalogue names;
    `head`: one head's slice (`.head(h)`), the value's axes without `heads` (`[b=1, key_dim=32, value_dim=32]`);
    `block`: the kind of block it is of (a Mamba-2 state's axes: `head_dim`, `d_state`)."""
    names = axis_names(kind, len(shape) + (1 if head else 0), block)
    if head and names is not None:
        names = [n for n in names if n != "heads"] if "heads" in names else None
    return shape_text(shape, names)


def shape_text(shape: Sequence[int], names: Sequence[str] | None) -> str:
    """`[b=1, heads=4]` with `names`, `[1, 4]` without."""
    if names is None:
        return "[" + ", ".join(str(n) for n in shape) + "]"
    return "[" + ", ".join(f"{a}={n}" for a, n in zip(names, shape)) + "]"


def for_display(kind: str, value: float) -> float:
    """`value` of a measure of `kind` as shown: a KL below 0 (float noise) as 0. Stored values stay raw."""
    return 0.0 if kind in NONNEGATIVE and value < 0 else value


def shown_value(kind: str, value: Any) -> str:
    """A measure's value as the summary prints it (`for_display`, `display.MEASURE_DIGITS` significant digits)."""
    if not isinstance(value, float):
        return str(value)
    return display.number(for_display(kind, value), display.MEASURE_DIGITS)


class Results(Mapping[str, Any]):
    """The results of a program by name: tensors of reads, floats of measures, decoded tokens."""

    def __init__(self, values: Mapping[str, Any], *, model: DeltaModel | None = None,
                 program: str | None = None, code: str | None = None,
                 kinds: Mapping[str, str] | None = None,
                 token_labels: Mapping[str, tuple[str, ...]] | None = None,
                 code_file: str = "emitted.py", axes: Mapping[str, Sequence[str]] | None = None) -> None:
        self._values = dict(values)
        self._kinds = dict(kinds or {})  # result name -> the value it holds ("next_token_probs", ...)
        self._axes = {k: tuple(v) for k, v in (axes or {}).items()}  # a reduction's, one head's (`shown`)
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
        """The measures that are numbers (`top(k)` is in `tops`)."""
        return {k: v for k, v in self._values.items() if not isinstance(v, (torch.Tensor, TopK))}

    @property
    def tops(self) -> dict[str, TopK]:
        """The `top(k)` measures: each one's token ids and probabilities."""
        return {k: v for k, v in self._values.items() if isinstance(v, TopK)}

    def _top_text(self, v: TopK) -> str:
        """`' Paris' 0.412, ' Rome' 0.120` (token ids without a tokenizer); prompts apart by ` | `."""
        tok = self._model.tokenizer if self._model is not None else None
        return " | ".join(", ".join(f"{display.token(tok.decode([i]))} {display.number(p, 3)}" if tok is not None
                                    else f"{i} {display.number(p, 3)}"
                                    for i, p in row) for row in v.rows())

    @property
    def tokens(self) -> dict[str, list[str]]:
        """Decoded new tokens of each `read tokens`, per prompt."""
        if self._model is None:
            return {}
        tok = self._model.tokenizer
        return {k: [tok.decode(row) for row in v.tolist()] for k, v in self.tensors.items()
                if self._kind(k) == "tokens"}

    def _kind(self, key: str) -> str:
        return self._kinds.get(key) or named_kind(key)

    def summary(self, top: int = 5) -> str:
        """What `deltalang run` prints: a line per result (shapes with axis names, norms named)."""
        lines = []
        tok = self._model.tokenizer if self._model is not None else None
        # the model's recurrent blocks are of one kind: a Mamba-2 model's states are named head_dim, d_state
        block = self._model.spec.family.block_kind if self._model is not None else DELTANET
        normed = False
        for k, v in self._values.items():
            if isinstance(v, TopK):
                lines.append(f"{k:48} {self._top_text(v)}")
            elif not isinstance(v, torch.Tensor):
                lines.append(f"{k:48} {shown_value(self._kind(k), v)}")
            elif self._kind(k) == "tokens" and tok is not None:
                lines.append(f"{k:48} " + " | ".join(repr(tok.decode(r)) for r in v.tolist()))
            elif self._kind(k) == "next_token_probs" and tok is not None:
                p = v.float()
                for row in range(p.shape[0]):
                    vals, ids = p[row].topk(min(top, p.shape[-1]))
                    best = ", ".join(f"{display.token(tok.decode([i]))} {display.number(x, 3)}" for x, i in zip(vals.tolist(), ids.tolist()))
                    lines.append(f"{k:48} top: {best}")
            elif self._kind(k) == "norm" and v.dim() == 2 and k in self._labels:
                over = ", ".join(axis_names("states", 5, block)[2:])  # type: ignore[index]
                lines.append(f"{k:48} per token, {NORM} over {over}:")
                for label, x in zip(self._labels[k], v[0].tolist()):
                    lines.append(f"    {display.token(label):14} {display.number(x)}")
            else:
                normed = True
                shape = self._shape(k, v, block)
                lines.append(f"{k:48} {NORM} {display.number(float(v.float().norm())):<10} {shape}")
        if normed:
            lines.append(f"({NORM}: the Frobenius norm over every axis of the tensor)")
        return "\n".join(lines)

    def _shape(self, key: str, v: torch.Tensor, block: str) -> str:
        """`[b=1, heads=4, key_dim=32, value_dim=32]`: the axes given for `key` (a reduction's, one head's), else
        its kind's in the catalogue (one head's if its name ends in `.head(h)`)."""
        names = self._axes.get(key)
        if names is not None and len(names) == v.dim():
            return shape_text(v.shape, names)
        return named_shape(self._kind(key), v.shape, re.search(r"\.head\(\d+\)$", key) is not None, block)

    def __repr__(self) -> str:
        """A few lines: the summary's first dozen."""
        lines = self.summary().splitlines()
        more = [f"... ({len(lines) - 12} more lines: print(results.summary()))"] if len(lines) > 12 else []
        return "\n".join([f"<deltalang Results: {len(self)} values>", *lines[:12], *more])

    def to_pandas(self) -> Any:
        """The measures that are numbers as rows (`result`, `value`); tensors stay in `tensors`."""
        pd = pandas()

        return pd.DataFrame([{"result": k, "value": float(v)} for k, v in self.measures.items()],
                            columns=["result", "value"])

    def _repr_html_(self) -> str:
        """Notebooks: the summary as a table (`deltalang.ground.html`)."""
        return html.summary_table(self.summary(), list(self), title=f"deltalang Results: {len(self)} values")

    def files(self) -> list[str]:
        """The files `save` writes: `results.safetensors` only when there are tensors."""
        names = (["results.safetensors"] if self.tensors or self.tops else []) + ["results.json"]
        return names + (["program.dl"] if self.program is not None else []) + \
            ([self.code_file] if self.code is not None else [])

    def save(self, directory: str | Path, *, extra: Mapping[str, Any] | None = None) -> Path:
        """Write `files()` atomically: `results.safetensors` (if any tensor), `results.json`, `program.dl`, code.

        Each tensor is saved as its own copy: results that share storage (`states` and
        `state_output`, ...) save like any others. Results of measures only write no
        `results.safetensors`, and remove one a former save left in DIR, so the directory
        never holds tensors of another run. Every file gets the mode the umask gives new
        files. A directory that cannot be written is a DeltaError.
        """
        out = save_atomically(directory, lambda tmp: self._write(tmp, extra))
        if not self.tensors and not self.tops and (out / "results.safetensors").is_file():
            (out / "results.safetensors").unlink()
        return out

    def _write(self, tmp: Path, extra: Mapping[str, Any] | None) -> None:
        from safetensors.torch import save_file

        # clone: safetensors refuses tensors that share storage, and views of one result often do
        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in self.tensors.items()}
        tok = self._model.tokenizer if self._model is not None else None
        for k, v in self.tops.items():  # top(k): its ids and probabilities, tensors of their own
            tensors[f"{k}.ids"], tensors[f"{k}.probs"] = v.ids.contiguous().clone(), v.probs.contiguous().clone()
        meta = {
            "measures": self.measures,
            "top": {k: [[{"id": i, "token": tok.decode([i]) if tok is not None else None, "prob": p} for i, p in row]
                        for row in v.rows()] for k, v in self.tops.items()},
            "tokens": self.tokens,
            "shapes": {k: list(v.shape) for k, v in tensors.items()},
            "model": self._model.spec.model_id if self._model is not None else None,
            "versions": _versions(),
            "program_sha256": hashlib.sha256((self.program or "").encode()).hexdigest(),
            **(dict(extra) if extra else {}),
        }
        (tmp / "results.json").write_text(json.dumps(meta, indent=2, default=str), encoding="utf-8")
        if tensors:
            save_file(tensors, str(tmp / "results.safetensors"))
            # safetensors creates its file 0600; give it the mode open() gave results.json (the umask's)
            os.chmod(tmp / "results.safetensors", stat.S_IMODE((tmp / "results.json").stat().st_mode))
        if self.program is not None:
            (tmp / "program.dl").write_text(self.program, encoding="utf-8")
        if self.code is not None:
            (tmp / self.code_file).write_text(self.code, encoding="utf-8")


def save_atomically(directory: str | Path, write: Callable[[Path], None]) -> Path:
    """Create `directory` if needed, let `write` fill a fresh temporary folder inside it, then move each
    file it wrote into place at once (replacing a former version); the folder is always removed. A
    directory that cannot be written, or a failure while writing (a full disk), is a DeltaError."""
    out = check_out_dir(directory)
    tmp: Path | None = None
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".deltalang-", dir=out))
        write(tmp)
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
    except OSError as e:  # checked before, so only what changed since (a full disk, ...)
        raise DeltaError(f"cannot save results in {directory}: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


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


# what a deltalang run writes in an --out directory (a sweep's plots: `*.png`; temporary files: `*.tmp`, `.deltalang-*`)
OUT_NAMES = frozenset({"results.json", "results.safetensors", "program.dl", "emitted.py", "reference.py", "sweep.csv",
                       "sweep.json", "results.csv", "results.partial.csv", "summary.csv", "summary.json",
                       "progress.json", "attribution.csv", "collection.json", "index.jsonl",
                       "done.json", "shards.json"})  # a shard's part's marker, a sharded run's manifest (`shards`)


def _ours(name: str) -> bool:
    return name in OUT_NAMES or name.endswith((".png", ".tmp")) or name.startswith(".deltalang-") or \
        (name.startswith("shard-") and name.endswith(".safetensors"))  # a collection's shards


def _program_of(directory: Path) -> str | None:
    """The program whose results `directory` holds (its `program.dl`, or an unfinished run's record), or None."""
    try:
        if (directory / "program.dl").is_file():
            return (directory / "program.dl").read_text(encoding="utf-8")
        for name in ("progress.json", "sweep.json"):
            if (directory / name).is_file():
                return json.loads((directory / name).read_text(encoding="utf-8")).get("program")
    except (OSError, ValueError, AttributeError):
        return None
    return None


class OutDir:
    """An `--out DIR` claimed for one program's run (`claim_out_dir`): `failed()` after a failure removes what
    the run wrote there, unless it saved work that `--resume` continues."""

    def __init__(self, path: Path, fresh: bool, made: bool) -> None:
        self.path, self.fresh, self.made = path, fresh, made

    def failed(self) -> None:
        if not self.fresh or not self.path.is_dir() or self._resumable():
            return
        for entry in self.path.iterdir():  # the directory was empty: all of it is this run's
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        if self.made:
            try:
                self.path.rmdir()
            except OSError:
                pass

    def _resumable(self) -> bool:
        for name in ("progress.json", "sweep.json"):
            try:
                if json.loads((self.path / name).read_text(encoding="utf-8")).get("done"):
                    return True
            except (OSError, ValueError, AttributeError):
                continue
        return False


def claim_out_dir(directory: str | Path, program: str, *, resume: bool = False, replace: bool = False) -> OutDir:
    """`--out DIR` for a run of `program`: new or empty, this program's own (or `resume`), or, with `replace`,
    another's whose results are removed first. A DeltaError otherwise: never results beside another's."""
    out = check_out_dir(directory)
    entries = sorted(e.name for e in out.iterdir()) if out.is_dir() else []
    if resume and not entries:
        raise DeltaError(f"--resume: nothing to resume in {directory}: it holds no run (drop --resume to start one)")
    if not entries:
        return OutDir(out, fresh=True, made=not out.is_dir())
    if resume or _program_of(out) == program:
        return OutDir(out, fresh=False, made=False)
    foreign = [e for e in entries if not _ours(e)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise DeltaError(f"--out {directory} holds files that are not deltalang's results ({shown}): give a new or "
                         f"empty directory")
    if not replace:
        raise DeltaError(f"--out {directory} holds another program's results ({', '.join(entries[:4])}"
                         f"{', ...' if len(entries) > 4 else ''}): give a new directory, --resume to continue "
                         f"this program's run there, or --replace to delete them first")
    for name in entries:
        path = out / name
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        except OSError as e:
            raise DeltaError(f"--replace: cannot delete {path}: {e.strerror or e}") from None
    return OutDir(out, fresh=True, made=False)
