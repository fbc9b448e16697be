"""The versions of torch, transformers and nnsight deltalang is tested on.

- `SUPPORTED`: each dependency's range, as in pyproject.toml (`tests/test_compat.py` holds them together);
  docs/gpu.md, "Supported versions", says why each bound is where it is;
- `check_versions()`: `UnsupportedVersion`, one line naming the installed version and the range tested;
- `pandas()`: the optional pandas every `to_pandas()` imports, or a DeltaError saying what to install.
What differs between the releases inside the range is `deltalang.models.internals`'.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

from packaging.version import InvalidVersion, Version

from .errors import DeltaError, DeltaModelError

# package -> (oldest tested, first untested): pyproject.toml says `>=low,<high`; `high` is the minor after the newest
# one CI runs (a new release is admitted once it passes there: docs/gpu.md, "Supported versions")
SUPPORTED: dict[str, tuple[str, str]] = {
    "torch": ("2.13", "2.14"),  # CI installs 2.13.0 (the one CPU build on the registry); 2.14/2.15 never ran
    "transformers": ("5.21.0", "5.26"),
    "nnsight": ("0.8.0", "0.9"),
}


class UnsupportedVersion(DeltaModelError):
    """An installed dependency lies outside the range deltalang supports."""


def requirement(package: str) -> str:
    """`package>=low,<high`, as pyproject.toml and pip write it."""
    low, high = SUPPORTED[package]
    return f"{package}>={low},<{high}"


def installed(package: str) -> str | None:
    """The installed version of `package` (from its metadata, nothing imported), or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def problem(package: str, version: str | None) -> str | None:
    """Why `version` of `package` is unsupported (one line), or None when it lies in the range."""
    need = requirement(package)
    if version is None:
        return f"{package} is not installed; deltalang is tested on {need} (pip install '{need}')"
    low, high = SUPPORTED[package]
    try:
        v = Version(version)
    except InvalidVersion:
        return f"cannot read {package}'s version {version!r}; deltalang needs {need}"
    if Version(low) <= v and Version(v.base_version) < Version(high):  # 5.22.0rc1 is in; 6.0.0rc1, 5.21.0.dev0 not
        return None
    return (f"{package} {version} is not supported; deltalang is tested on {need} "
            f"(pip install '{need}')")


def check_versions() -> None:
    """Raise `UnsupportedVersion` when torch, transformers or nnsight is outside its supported range."""
    for package in SUPPORTED:
        why = problem(package, installed(package))
        if why is not None:
            raise UnsupportedVersion(why)


def pandas() -> Any:
    """The pandas module for a `to_pandas()`; not installed (it is optional: the `test` extra holds it), one
    line saying what to install."""
    try:
        return importlib.import_module("pandas")
    except ImportError:
        raise DeltaError("to_pandas() needs pandas, which is not installed: pip install pandas") from None
