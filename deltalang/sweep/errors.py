"""The sweep package's errors.

`DeltaSweepError` is the user's mistake (a sweep that cannot be built, resumed
or written as asked); `Unsupported` never leaves the package: the engine raises
it when it cannot serve a sweep, and the naive path then runs it.
"""

from __future__ import annotations

from deltalang.ground.errors import DeltaError


class DeltaSweepError(DeltaError):
    """A sweep cannot be built, resumed or written as asked."""


class Unsupported(Exception):
    """Internal: the engine cannot serve this sweep; the message says why (the naive path runs it)."""

