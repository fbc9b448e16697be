"""How long the commands take to answer: each command in a fresh process, as a user types it.

For each command: the median wall time of N subprocess runs (after one unmeasured run, so the
operating system's file cache and Lark's table cache are warm), and which of torch, transformers
and nnsight the command imported (asked of the same process, `sys.modules` at exit).
Target: `--help`, `--version` and `fmt` under 0.3 s; `check` loads the config and tokenizer only
(no nnsight); `run` loads the bundled model.

    python benchmarks/startup.py [--repeat 5] [--only help,version,fmt,check,run] [--root CHECKOUT]

`--root` times another checkout's package (an older commit unpacked with `git archive`), for a before/after.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "eiffel.dl")
COMMANDS: dict[str, list[str]] = {
    "help": ["--help"],
    "version": ["--version"],
    "fmt": ["fmt", EXAMPLE],
    "check": ["check", EXAMPLE],
    "run": ["run", EXAMPLE],
}
HEAVY = ("torch", "transformers", "nnsight")
# the command line's own entry (what the `deltalang` script runs), then the heavy modules it loaded
PROBE = ("import sys, atexit\n"
         "atexit.register(lambda: sys.stderr.write('\\nIMPORTED ' + ' '.join(m for m in {heavy!r} "
         "if m in sys.modules) + '\\n'))\n"
         "from deltalang.cli import main\n"
         "sys.exit(main(sys.argv[1:]))\n")


def run_once(args: list[str], probe: bool = False, root: Path = ROOT) -> tuple[float, str]:
    """Seconds for one fresh `deltalang ARGS` process, and (with probe) the heavy modules it imported."""
    code = PROBE.format(heavy=HEAVY) if probe else "import sys\nfrom deltalang.cli import main\nsys.exit(main())"
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=root, env=env)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"deltalang {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    imported = proc.stderr.rsplit("IMPORTED", 1)[-1].split() if probe else []
    return elapsed, ", ".join(imported) or "-"


def _python_alone() -> float:
    """Seconds for a bare interpreter: the floor under every command on this machine, now."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="measured runs per command (default 5)")
    ap.add_argument("--only", default=",".join(COMMANDS), help="the commands to time, comma-separated")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose deltalang to time")
    args = ap.parse_args()
    print(f"deltalang start-up, {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}; median of {args.repeat} fresh processes; {args.root}")
    print(f"{'command':<36} | {'median':>8} | {'min':>8} | imports")
    base = statistics.median(_python_alone() for _ in range(args.repeat))
    print(f"{'python -c pass (the floor)':<36} | {base:>6.2f} s | {'':>8} |")
    for name in args.only.split(","):
        argv = COMMANDS[name]
        _, imported = run_once(argv, probe=True, root=args.root)  # warm-up, and what it loads
        times = [run_once(argv, root=args.root)[0] for _ in range(args.repeat)]
        label = "deltalang " + " ".join(a if a != EXAMPLE else "examples/eiffel.dl" for a in argv)
        print(f"{label:<36} | {statistics.median(times):>6.2f} s | {min(times):>6.2f} s | {imported}")


if __name__ == "__main__":
    main()
