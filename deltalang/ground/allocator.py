"""glibc's allocator told to keep freed memory for reuse: `keep_freed_memory()`, what the command line does.

Contract: on Linux with glibc, allocations under `retain` bytes come from the heap and up to `retain` bytes
freed at its top stay there (`mallopt`: M_MMAP_THRESHOLD, M_TRIM_THRESHOLD; M_TOP_PAD 64 MiB), so a
forward's tensors reuse the pages the block before freed instead of faulting in fresh ones. No number
changes; the process keeps up to `retain` bytes it no longer uses. Not applied (returns False) elsewhere,
or when the user chose glibc's malloc settings through its environment (`MALLOC_*_`, `glibc.malloc.*` in
`GLIBC_TUNABLES`).
Why and what it buys: docs/benchmarks.md ("The allocator").
"""

from __future__ import annotations

import ctypes
import os
import platform

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
_TOP_PAD = 64 << 20
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory(retain: int = 1 << 30) -> bool:
    """Let this process reuse up to `retain` bytes (at most 2 GiB - 1, mallopt's int) of freed memory (see the
    module doc); whether glibc took the settings."""
    if not 0 < retain < 1 << 31:
        raise ValueError(f"retain must be between 1 byte and 2 GiB, not {retain}")
    try:
        libc_name = os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.36"; unknown off glibc
    except (AttributeError, ValueError, OSError):
        return False
    if platform.system() != "Linux" or not libc_name.startswith("glibc"):
        return False
    if any(name in os.environ for name in _USER_SETTINGS) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: glibc's
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_MMAP_THRESHOLD, retain), (_M_TRIM_THRESHOLD, retain), (_M_TOP_PAD, _TOP_PAD)))
