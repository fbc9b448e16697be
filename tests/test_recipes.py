"""The recipes this project was created from run against deltalang, changing only imports and model lines.

The two documents live in `../shared/seeds/` beside the repository (CI lays
`shared/` there). Their Python blocks are the specification of the Python API:
this test takes each document's code blocks, in order, as one script, rewrites
only the lines that import nnterp or build the model, and runs the script with
plain Python. Every assertion in them must hold. Their printed numbers are for
Qwen3.5-0.8B and are not compared; the script runs on the bundled model (or a
tiny Qwen3.5 checkpoint when the bundled one is absent).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from deltalang.models.bundled import PATH as BUNDLED
from deltalang.models.testing import tiny_checkpoint

SEEDS = Path(__file__).resolve().parents[1].parent / "shared" / "seeds"
FENCE = re.compile(r"```python\n(.*?)```", re.S)


def _seed_files() -> list[Path]:
    return sorted(SEEDS.glob("*.txt")) if SEEDS.is_dir() else []


def rewrite(code: str, model_path: str) -> str:
    """Change only the import lines and the model-loading lines."""
    out = []
    for line in code.splitlines():
        stripped = line.strip()
        indent = line[: len(line) - len(line.lstrip())]
        if stripped == "import nnterp":
            line = indent + "import deltalang as nnterp"
        elif stripped.startswith("from nnterp import"):
            names = [n.strip() for n in stripped[len("from nnterp import"):].split(",")]
            kept = [n for n in names if n != "StandardizedTransformer"]
            line = indent + "import deltalang" + (f"; from deltalang import {', '.join(kept)}" if kept else "")
        elif re.match(r"model\s*=\s*StandardizedTransformer\(", stripped):
            line = indent + f"model = deltalang.load_model({model_path!r})"
        out.append(line)
    return "import deltalang\n" + "\n".join(out) + "\n"


@pytest.mark.parametrize("seed", _seed_files() or [None], ids=lambda p: p.name if p else "absent")
def test_recipe_runs_unchanged(seed: Path | None, tmp_path: Path) -> None:
    if seed is None:
        pytest.skip(f"the recipes are not beside the repository ({SEEDS})")
    blocks = FENCE.findall(seed.read_text())
    assert blocks, f"no python blocks in {seed}"
    model_path = str(BUNDLED) if (BUNDLED / "config.json").exists() else str(tiny_checkpoint("qwen3_5"))
    script = tmp_path / f"recipe_{seed.stem}.py"
    script.write_text(rewrite("\n\n".join(blocks), model_path))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{seed.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
