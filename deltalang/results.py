"""The results of a program by name (`Results`), and where they may be saved (`check_out_dir`).

`Results` maps each result name to its value: a tensor for a read, a float (or
a per-prompt tensor) for a measure, token ids for `read tokens`. `summary()`
prints them as `deltalang run` does, decoding tokens with the model's tokenizer
when one is given; `kinds` and `token_labels` (what each result holds, the run's
tokens of a per-token measure) only shape that display.

`Results.save(DIR)` always writes every result (each tensor an independent
copy, so values that share storage save); `check_out_dir` finds, touching
nothing, whatever would stop a save in DIR, so the commands refuse such an
`--out` before the model loads. `results.json` records the versions that
produced it (`_versions`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from .errors import DeltaError
from .model import DeltaModel
from .version import __version__


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
