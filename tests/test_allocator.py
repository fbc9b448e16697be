"""`allocator.keep_freed_memory`: freed tensors' pages reused instead of faulted in again, the user's own glibc
settings left alone, and the command line applying it. Each case in a fresh process (the setting is the
process's), its environment without glibc's malloc variables."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from deltalang import cli
from deltalang.ground import allocator

GLIBC = platform.system() == "Linux" and (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
ROOT = Path(__file__).resolve().parents[1]

# minor page faults of a forward's pattern (tensors of 32 and 16 MiB made, then freed) three times, after four
# (glibc's defaults adapt slowly over the first ones; kept, the heap has grown by then)
FAULTS = """
import resource, sys, torch
from deltalang.ground import allocator
kept = allocator.keep_freed_memory() if sys.argv[1] == "keep" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def forward():
    xs = [torch.ones(n << 18) for n in (32, 16) * 6]
    del xs
for _ in range(4):
    forward()
f0 = faults()
for _ in range(3):
    forward()
print(kept, faults() - f0)
"""


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in allocator._USER_SETTINGS and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                         env=clean | (env or {}), check=True)
    return out.stdout.split()


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
def test_freed_tensors_pages_are_reused_once_kept() -> None:
    default_kept, default = _run(FAULTS, "default")
    kept, faults = _run(FAULTS, "keep")
    assert default_kept == "None" and kept == "True"
    one_tensor = (32 << 20) // 4096  # the pages of one 32 MiB tensor
    assert int(default) > 4 * one_tensor  # glibc's defaults: fresh pages for tensors made before
    assert int(faults) < one_tensor


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
def test_the_users_own_malloc_settings_are_left_alone() -> None:
    code = "from deltalang.ground import allocator; print(allocator.keep_freed_memory())"
    assert _run(code) == ["True"]
    assert _run(code, env={"MALLOC_TRIM_THRESHOLD_": "131072"}) == ["False"]
    assert _run(code, env={"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}) == ["False"]
    assert _run(code, env={"GLIBC_TUNABLES": "glibc.cpu.x86_shstk=off"}) == ["True"]  # not malloc's


def test_retain_out_of_mallopts_range_is_refused() -> None:
    with pytest.raises(ValueError, match="2 GiB"):
        allocator.keep_freed_memory(2 << 30)


def test_the_command_line_keeps_freed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[object, ...]] = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda *a: calls.append(a) or True)
    assert cli.main(["check", str(ROOT / "examples" / "eiffel.dl")]) == 0
    assert calls == [()]
