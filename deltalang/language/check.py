"""`check()`: a program parsed and resolved against a model's shape, without running it.

`check(text, model)` parses a program, finds the model's shape (a `ModelSpec`
from a spec, a loaded model, a path or id, or the program's own `model` line),
resolves the program against it and returns the `Resolved` program, or raises
a located `DeltaError`. Each of the resolver's warnings (`Resolved.warnings`)
also goes through Python's `warnings` module (a `DeltaWarning`), so a notebook
shows them. What `deltalang check` prints is `deltalang.compiler.explain.format_resolved`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from deltalang.ground.errors import DeltaError, DeltaErrors, DeltaModelError, warn
from deltalang.models.spec import ModelSpec, load_spec

from . import ast
from .ir import Resolved
from .parse import Partial, parse_partial
from .resolve import resolve, uses_dataset


def _spec_for(model: Any, program: ast.Program, trust_remote_code: bool = False) -> ModelSpec:
    """A ModelSpec from: a ModelSpec, an object with `.spec`, a path or id, or None.

    None means the program's own `model "ID"` line, else the bundled model.
    """
    if isinstance(model, ModelSpec):
        return model
    spec = getattr(model, "spec", None)
    if isinstance(spec, ModelSpec):
        return spec
    if model is None:
        declared = next((i.name for i in program.items if isinstance(i, ast.ModelDecl)), None)
        return load_spec(declared, trust_remote_code=trust_remote_code)
    if isinstance(model, (str, Path)):
        return load_spec(model, trust_remote_code=trust_remote_code)
    raise DeltaModelError(f"not a model: {model!r}; pass a checkpoint path, a ModelSpec or a loaded model")


def check(text: str, model: Any = None, *, filename: str = "<program>", prompt: str | None = None,
          trust_remote_code: bool = False, program: ast.Program | Partial | None = None) -> Resolved:
    """Parse and resolve a program against a model's config and tokenizer. Raises a located DeltaError.

    `model`: None (the program's `model` line, else the bundled model), a checkpoint
    path or id, a `ModelSpec`, or anything with a `.spec` (a loaded model).
    `prompt`: the prompt of the implicit top-level run `main` (the CLI's --prompt).
    Every warning of the program (`.warnings` of the result) also goes through `warnings.warn`.
    `program`: `text` already parsed, by `parse` or `parse_partial` (whose errors are raised here as when `check`
    parses: beside the resolver's errors of the rest); the entry points parse a program once and pass it on.
    """
    parsed = parse_partial(text, filename) if program is None else program
    if isinstance(parsed, Partial):
        if parsed.errors:
            raise _with_resolve_errors(parsed, model, text, filename, prompt, trust_remote_code)
        parsed = parsed.program
    try:
        spec = _spec_for(model, parsed, trust_remote_code)
        resolved = resolve(parsed, spec, prompt_override=prompt, source=text, filename=filename)
    except DeltaError as e:
        raise e.located(text, filename) from None
    for w in resolved.warnings:
        warn(w)
    return resolved


def _with_resolve_errors(partial: Partial, model: Any, text: str, filename: str, prompt: str | None,
                         trust_remote_code: bool) -> DeltaError:
    """The syntax errors and, when only statements failed, the resolver's errors of the rest of the program:
    every independent error of one pass at once (mypy's way), not those the left-out statements explain (a
    name their `as` defines, a sweep variable they use, nothing left to run)."""
    errors = list(partial.errors)
    if partial.statements_only and not uses_dataset(partial.program):
        try:
            resolve(partial.program, _spec_for(model, partial.program, trust_remote_code), prompt_override=prompt,
                    source=text, filename=filename)
        except DeltaErrors as e:
            errors.extend(x for x in e.errors if not _explained(x, partial.dropped))
        except DeltaModelError:
            pass  # the model cannot be loaded: the syntax errors alone
        except DeltaError as e:
            errors.extend([e] if not _explained(e, partial.dropped) else [])
    errors.sort(key=lambda e: (e.span.line, e.span.column) if e.span else (0, 0))
    for e in errors:
        e.located(text, filename)
    return errors[0] if len(errors) == 1 else DeltaErrors(errors)


def _explained(error: DeltaError, dropped: tuple[str, ...]) -> bool:
    """Whether a resolver error may come from the statements the parser left out rather than from its own line."""
    if "nothing to run" in error.message:
        return True
    defined = {m for d in dropped for m in re.findall(r"\bas\s+([A-Za-z_]\w*)", d)}
    words = {w for d in dropped for w in re.findall(r"[A-Za-z_]\w*", d)}
    quoted = set(re.findall(r"'([^']+)'", error.message))
    return bool(quoted & defined) or ("never used" in error.message and bool(quoted & words))
