"""Which adapter answers for the installed transformers: `ERAS`, each era's first release and its adapter module.

An adapter (`v5_21`, `v5_24`, `v5_25`) holds what its releases do differently: `CACHE_KEYWORD`,
`kernel_function(bound)`, `count_tokens(layer, tokens, device)`. `era()` is the installed release's (the newest
era starting at or before it); `era_of(version)` any release's.
"""

from __future__ import annotations

import functools
from types import ModuleType

from packaging.version import Version

from deltalang.ground import compat

from . import v5_21, v5_24, v5_25

# (first release of the era, its adapter), oldest first; the first is pyproject's `>=` bound
ERAS: tuple[tuple[str, ModuleType], ...] = (("5.21.0", v5_21), ("5.24.0", v5_24), ("5.25.0", v5_25))


def era_of(version: str) -> ModuleType:
    """The adapter of transformers `version`: the newest era starting at or before it (the oldest below all)."""
    v = Version(Version(version).base_version)
    found = ERAS[0][1]
    for first, adapter in ERAS:
        if v >= Version(first):
            found = adapter
    return found


@functools.lru_cache(maxsize=1)
def era() -> ModuleType:
    """The adapter of the installed transformers."""
    return era_of(compat.installed("transformers") or ERAS[-1][0])
