#!/usr/bin/env bash
# A look ahead (docs/gpu.md, "Supported versions"): a venv with the newest release of transformers, nnsight,
# torch (its newest CPU build) and flash-linear-attention the registry has, pyproject's caps ignored; the
# conformance subset (.ci/conformance) and the FLA tests run there; then one line per package: its version,
# whether deltalang's range admits it (a tested release) or not, and whether the run passed or its first failure.
#
#   bash scripts/newest.sh            # venv in .newest-venv (kept, reused by the next run)
#   NEWEST_VENV=/tmp/v bash scripts/newest.sh
#
# Exit status 0 when both runs pass, 1 when one fails. It changes nothing in the checkout but the venv.
set -uo pipefail
cd "$(dirname "$0")/.."
venv=${NEWEST_VENV:-.newest-venv}
log=$(mktemp -d)

newest() {  # newest PACKAGE [LOCAL]: the newest release the registry lists (LOCAL: only versions ending +LOCAL)
    pip index versions "$1" 2>/dev/null | sed -n 's/^Available versions: //p' | tr ',' '\n' | tr -d ' ' |
        { if [ -n "${2:-}" ]; then grep -- "+$2\$"; else grep -v '+'; fi; } | head -n1
}

[ -d "$venv" ] || python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install -q --upgrade pip >/dev/null

torch_any=$(newest torch)
torch_cpu=$(newest torch cpu)
[ -n "$torch_cpu" ] || torch_cpu=2.13.0  # a registry without local versions: the CPU wheel the README installs
transformers=$(newest transformers)
nnsight=$(newest nnsight)
fla=$(newest flash-linear-attention)
fla_core=$(newest fla-core)
echo "newest on the registry: torch $torch_any (CPU build $torch_cpu), transformers $transformers, nnsight $nnsight," \
     "flash-linear-attention $fla, fla-core $fla_core"

# deltalang's own dependencies but the four, as pyproject names them; the project itself without its caps
others=$(python - <<'PY'
import re, tomllib
meta = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = ("torch", "transformers", "nnsight")
deps = [d for d in meta["dependencies"] + meta["optional-dependencies"]["test"]
        if re.match(r"[A-Za-z0-9_.-]+", d).group(0) not in skip]
print(" ".join(f"'{d}'" for d in deps))
PY
)
triton=$(python - <<'PY'
import tomllib
fla = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["fla"]
print(next(d for d in fla if d.startswith("triton")))
PY
)
install_ok=1
{
    pip install "torch==$torch_cpu" &&
    pip install "transformers==$transformers" "nnsight==$nnsight" &&
    eval pip install "$others" &&
    pip install --no-deps -e .
} > "$log/install.txt" 2>&1 || install_ok=0
if [ "$install_ok" -eq 0 ]; then
    echo "install failed (last lines of pip):"
    tail -n 5 "$log/install.txt"
    exit 1
fi

first_failure() {  # first_failure LOG STATUS: the first FAILED/ERROR line of a pytest -rfE run, or "passes (N passed)"
    local line
    line=$(grep -m1 -E '^(FAILED|ERROR) ' "$1")
    if [ -n "$line" ]; then echo "first failure: ${line#* }"
    elif [ "$2" -eq 0 ]; then echo "passes ($(grep -E '[0-9]+ passed' "$1" | tail -n1 | sed 's/^=* *//; s/ *=*$//'))"
    else echo "did not finish (pytest exit $2): $(tail -n1 "$1")"; fi
}

# pyproject's addopts already has -q; -o addopts= keeps pytest's closing "N passed" line (-qq drops it)
conformance=$(grep -v '^#' .ci/conformance | tr '\n' ' ')
python -m pytest -p no:cacheprovider -o addopts= -q -rfE $conformance > "$log/conformance.txt" 2>&1
conformance_status=$?
core=$(first_failure "$log/conformance.txt" "$conformance_status")

fla_status=0
if pip install "flash-linear-attention==$fla" "fla-core==$fla_core" "$triton" > "$log/fla-install.txt" 2>&1; then
    python -m pytest -p no:cacheprovider -o addopts= -q -rfE tests/test_fla.py > "$log/fla.txt" 2>&1
    fla_status=$?
    fla_result=$(first_failure "$log/fla.txt" "$fla_status")
else
    fla_status=1
    fla_result="install failed: $(tail -n1 "$log/fla-install.txt")"
fi

python - "$torch_any" "$torch_cpu" "$core" "$fla_result" <<'PY'
import importlib.metadata as md
import sys

from packaging.version import Version

from deltalang.ground import compat

torch_any, torch_cpu, core, fla_result = sys.argv[1:]
ranges = dict(compat.SUPPORTED)
import tomllib
for dep in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["fla"]:
    if dep.startswith("flash-linear-attention"):
        low, high = (part.split("=")[-1].lstrip("<") for part in dep.split(">=", 1)[1].split(","))
        ranges["flash-linear-attention"] = (low, high)


def tested(package: str, version: str) -> str:
    if package not in ranges:
        return "tested (CI installs torch 2.13.0)" if version.startswith("2.13.0") else "untested (CI installs torch 2.13.0)"
    low, high = ranges[package]
    inside = Version(low) <= Version(Version(version).base_version) < Version(high)
    return f"{'tested' if inside else 'untested'} (deltalang admits >={low},<{high})"


for package, result in (("torch", core), ("transformers", core), ("nnsight", core),
                        ("flash-linear-attention", fla_result)):
    version = md.version(package)
    extra = f"; newest of any build {torch_any}" if package == "torch" and torch_any != version.split("+")[0] else ""
    print(f"{package} {version}: {tested(package, version)}{extra}: {result}")
PY
echo "logs: $log"
[ "$conformance_status" -eq 0 ] && [ "$fla_status" -eq 0 ]
