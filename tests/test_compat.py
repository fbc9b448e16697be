"""The supported versions and the one thing that differs between them: the forward's cache keyword.

Ground truth is transformers itself: a prompt's continuation from the cache of its prefix gives the full
forward's logits only when the cache really reached the forward. transformers swallows an unknown keyword
in `**kwargs`, so a wrong keyword would run the continuation from an empty cache, which these tests see.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from deltalang import cli
from deltalang.ground import compat
from deltalang.ground.compat import UnsupportedVersion
from deltalang.models import internals
from deltalang.models.internals import cache_keyword, cache_kwargs, output_cache
from deltalang.models.testing import FAMILY_NAMES, load_hf, tiny_checkpoint
from deltalang.runs import compiled
from deltalang.runtime.model import decoder_layers

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The Eiffel Tower is in Paris"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_continuation_from_the_prefix_cache_gives_the_full_forwards_logits(family: str) -> None:
    path = tiny_checkpoint(family)
    hf = load_hf(path).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
    cut = 9
    with torch.no_grad():
        full = hf(ids, use_cache=False).logits
        cache = output_cache(hf(ids[:, :cut], use_cache=True))
        assert cache is not None
        rest = hf(ids[:, cut:], **cache_kwargs(cache, hf), use_cache=True).logits
        cold = hf(ids[:, cut:], use_cache=False).logits  # what a swallowed keyword would give
    torch.testing.assert_close(rest, full[:, cut:], atol=1e-4, rtol=0)
    assert (cold - full[:, cut:]).abs().max() > 1e-3  # the check above can fail


def test_the_keyword_is_read_off_the_signature_called() -> None:
    def new(x: int, cache: object = None, **kw: object) -> None: ...

    def old(x: int, past_key_values: object = None, **kw: object) -> None: ...

    def neither(x: int, **kw: object) -> None: ...

    assert cache_kwargs(1, new) == {"cache": 1}
    assert cache_kwargs(1, old) == {"past_key_values": 1}
    assert cache_keyword(neither) == cache_keyword() in internals.cache.KEYWORDS  # the installed transformers'


def test_the_default_keyword_is_the_installed_transformers_forwards() -> None:
    hf = load_hf(tiny_checkpoint(FAMILY_NAMES[0]))
    block = decoder_layers(hf)[0]
    assert cache_keyword(hf) == cache_keyword() == cache_keyword(block)  # model, masks and blocks agree


@pytest.mark.parametrize("package, version", [("transformers", "5.20.2"), ("transformers", "6.0.0"),
                                              ("transformers", "5.26.0"), ("transformers", "5.26.0rc1"),
                                              ("transformers", "6.0.0rc1"), ("transformers", "5.21.0.dev0"),
                                              ("nnsight", "0.7.0"), ("nnsight", "0.9.0"), ("nnsight", None)])
def test_an_unsupported_version_is_one_line_naming_it_and_the_range(monkeypatch: pytest.MonkeyPatch,
                                                                    package: str, version: str | None) -> None:
    real = compat.installed
    monkeypatch.setattr(compat, "installed", lambda p: version if p == package else real(p))
    with pytest.raises(UnsupportedVersion) as info:
        compat.check_versions()
    message = str(info.value)
    assert "\n" not in message and compat.requirement(package) in message
    assert (f"{package} {version} is not supported" if version else f"{package} is not installed") in message


@pytest.mark.parametrize("version", ["5.21.0", "5.24.0", "5.25.0", "5.25.3", "5.22.0rc1"])
def test_versions_in_the_range_pass(version: str) -> None:
    assert compat.problem("transformers", version) is None


def test_the_command_line_says_it_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    real = compat.installed
    monkeypatch.setattr(compat, "installed", lambda p: "5.20.2" if p == "transformers" else real(p))
    monkeypatch.setattr(compiled, "_MODELS", {})  # no model an earlier test loaded in this process
    assert cli.main(["run", str(ROOT / "examples" / "eiffel.dl")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("error: transformers 5.20.2 is not supported; deltalang is tested on transformers>=5.21.0,<5.26 "
                   "(pip install 'transformers>=5.21.0,<5.26')")


@pytest.mark.parametrize("command", [["run", str(ROOT / "examples" / "eiffel.dl")], ["info"]])
def test_a_forced_newer_transformers_is_one_line_at_load_and_in_info(monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str],
                                                                       command: list[str]) -> None:
    """A release newer than CI runs (simulated: the installed version string patched to 5.26.0), forced in by a
    user: the range tested and what to install, in one line, before any kernel of it is touched."""
    real = compat.installed
    monkeypatch.setattr(compat, "installed", lambda p: "5.26.0" if p == "transformers" else real(p))
    monkeypatch.setattr(compiled, "_MODELS", {})
    assert cli.main(command) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("error: transformers 5.26.0 is not supported; deltalang is tested on transformers>=5.21.0,<5.26 "
                   "(pip install 'transformers>=5.21.0,<5.26')")


def test_an_nnsight_too_old_to_import_is_one_line(tmp_path: Path) -> None:
    """An nnsight whose names deltalang imports are missing (0.7 lacks `Event`): the version, not a traceback."""
    fake = tmp_path / "site"
    (fake / "nnsight").mkdir(parents=True)
    (fake / "nnsight" / "__init__.py").write_text("")  # nothing deltalang imports from it
    (fake / "nnsight-0.7.0.dist-info").mkdir()
    meta = "Metadata-Version: 2.1\nName: nnsight\nVersion: 0.7.0\n"
    (fake / "nnsight-0.7.0.dist-info" / "METADATA").write_text(meta)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")])}
    main = "import sys, deltalang.cli; sys.exit(deltalang.cli.main(sys.argv[1:]))"
    run = subprocess.run([sys.executable, "-c", main, "run", str(ROOT / "examples" / "eiffel.dl")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines() == ["error: nnsight 0.7.0 is not supported; deltalang is tested on "
                                               "nnsight>=0.8.0,<0.9 (pip install 'nnsight>=0.8.0,<0.9')"]


def test_pyproject_declares_the_ranges_compat_checks() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for package in compat.SUPPORTED:
        assert compat.requirement(package) in deps, (package, deps)


def test_the_ci_scripts_python_runs_here() -> None:
    """The Python `.ci/run` runs inline (the eras it installs) imports what the package has: the suite never runs
    it otherwise, and a module's move left it importing an old path (CI failed after the whole suite passed)."""
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"<<'PY'\n(.*?)\nPY\n", ci, re.S)
    assert blocks, "no inline Python in .ci/run"
    for block in blocks:
        proc = subprocess.run([sys.executable, "-"], input=block, capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        assert len(proc.stdout.split()) >= 3, proc.stdout  # nnsight's newest, its oldest, the oldest transformers


def test_torch_is_admitted_only_where_ci_runs_it() -> None:
    """torch's range holds the release `.ci/run` installs (and its CPU build) and no release CI never ran."""
    ci = (ROOT / ".ci" / "run").read_text()
    pins = set(re.findall(r"pip install torch==(\S+)", ci))
    assert pins, "no torch pin in .ci/run"
    for pin in pins:
        assert compat.problem("torch", pin) is None, pin
        assert compat.problem("torch", pin + "+cpu") is None, pin
    for untested in ("2.14.1", "2.15.0", "2.6.0"):
        assert compat.problem("torch", untested) == (
            f"torch {untested} is not supported; deltalang is tested on torch>=2.13,<2.14 "
            "(pip install 'torch>=2.13,<2.14')")
