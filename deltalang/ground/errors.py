"""DeltaError, DeltaWarning and their kinds, rendered the way mypy renders: `file:line:col: error: msg`.

Every error a user can cause is a DeltaError. One that knows where in a `.dl`
source it comes from carries a `Span`, and `render()` prints the source line
with a caret under the span.

A DeltaWarning is rendered the same way (`file:line:col: warning: msg`): the
program runs, but something in it was not taken exactly as written (a quoted
position that cuts a token, a prompt of unknown words, a `model` line the
caller's model overrides). It is a `UserWarning`, so `warn()` sends it through
Python's `warnings` module, attributed to the first caller outside deltalang;
`show_warnings_on_stderr()` makes the command line print each one, rendered. A warning sent while code
runs (a compiled program's) goes through each `locating()` in force, innermost first: one maps the caller's file
and line to the program's span, one may take it instead of sending it (a dataset run's, to say it once).
"""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Callable, Iterable, Iterator, Self, TextIO

import attrs


@attrs.frozen
class Span:
    """A region of source text: 1-based line and column, end exclusive."""

    line: int
    column: int
    end_line: int
    end_column: int


class Diagnostic(Exception):
    """A message about a program: `span`/`source`/`filename` locate it; `kind` says what it is."""

    kind = "error"

    def __init__(
        self,
        message: str,
        span: Span | None = None,
        *,
        source: str | None = None,
        filename: str = "<program>",
        notes: Iterable[str] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.span = span
        self.source = source
        self.filename = filename
        self.notes = tuple(notes)

    def located(self, source: str, filename: str) -> Self:
        """Attach the program text this diagnostic's span points into."""
        if self.source is None:
            self.source = source
            self.filename = filename
        return self

    def render(self) -> str:
        """`file:line:col: KIND: message`, then the source line and a caret."""
        if self.span is None:
            head = f"{self.filename}: {self.kind}: {self.message}" if self.source is not None else f"{self.kind}: {self.message}"
            return "\n".join([head, *(f"  note: {n}" for n in self.notes)])
        s = self.span
        lines = [f"{self.filename}:{s.line}:{s.column}: {self.kind}: {self.message}"]
        if self.source is not None:
            src_lines = self.source.splitlines()
            if 1 <= s.line <= len(src_lines):
                text = src_lines[s.line - 1]
                width = (s.end_column - s.column) if s.end_line == s.line else len(text) - s.column + 1
                lines.append(f"    {text}")
                lines.append("    " + " " * (s.column - 1) + "^" * max(1, width))
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render() if self.span is not None else self.message


class DeltaError(Diagnostic):
    """An error a user can act on: nothing runs. `span`/`source`/`filename` locate it in a program."""


class DeltaWarning(Diagnostic, UserWarning):
    """Something a program does not mean exactly as written; it still runs. Raise it with `warn()`."""

    kind = "warning"


class RecordsWarning(DeltaWarning):
    """A warning about many records of a dataset at once (it names them itself), not about one record."""


_PACKAGE = str(Path(__file__).resolve().parent.parent) + os.sep
_LOCATORS: list[Callable[[DeltaWarning, str, int], bool]] = []


@contextmanager
def locating(locate: Callable[[DeltaWarning, str, int], bool]) -> Iterator[None]:
    """While inside: `locate(warning, file, line)` of each `warn()`, with its first caller outside deltalang (a
    compiled program's code: `compiled.Experiment` maps the line to the program's span); True: taken, not sent."""
    _LOCATORS.append(locate)
    try:
        yield
    finally:
        _LOCATORS.remove(locate)


def warn(warning: DeltaWarning) -> None:
    """Send `warning` through Python's `warnings`, attributed to the first caller outside deltalang."""
    frame: FrameType | None = sys._getframe(0)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    where = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("", 0)
    if any(locate(warning, *where) for locate in reversed(_LOCATORS)):
        return
    warnings.warn(warning, stacklevel=level)


def show_warnings_on_stderr() -> None:
    """Command line: print every DeltaWarning, rendered, to stderr (others as Python prints them)."""
    if getattr(warnings.showwarning, "_deltalang", False):
        return
    default = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        if isinstance(message, DeltaWarning):
            print(message.render(), file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    show._deltalang = True  # type: ignore[attr-defined]
    warnings.showwarning = show
    warnings.simplefilter("always", DeltaWarning)


class DeltaSyntaxError(DeltaError):
    """The program text does not parse."""


class DeltaResolveError(DeltaError):
    """The program parses but does not fit the model (a value, position, name...)."""


class DeltaPlanError(DeltaError):
    """The runs cannot be ordered (a cycle) or split into passes."""


class DeltaValueError(DeltaError):
    """A value layer error: a value missing on a block, a bad write, a bad position."""


class DeltaModelError(DeltaError):
    """A model cannot be loaded or is not a supported hybrid."""


class DeltaErrors(DeltaError):
    """Several errors of one program, reported together."""

    def __init__(self, errors: list[DeltaError]) -> None:
        super().__init__(f"{len(errors)} errors", None)
        self.errors = errors

    def located(self, source: str, filename: str) -> Self:
        for e in self.errors:
            e.located(source, filename)
        return self

    def render(self) -> str:
        return "\n".join(e.render() for e in self.errors)

    def __str__(self) -> str:
        return self.render()
