"""The bundled tiny hybrids: a Qwen3.5-architecture model (gated DeltaNet) and a Mamba-2 one, trained on a synthetic world.

`load_model()` with no name opens the checkpoint in `model/` beside this file (NAME);
`load_model("deltalang/bundled-tiny-mamba2-hybrid")` (MAMBA2_NAME) the granitemoehybrid one in
`mamba2_model/`. `world.py` holds the facts both were trained on; `scripts/train_bundled.py` in the
repository trains them again, deterministically (`--family granitemoehybrid` for the second).
"""

from pathlib import Path

PATH = Path(__file__).resolve().parent / "model"
NAME = "deltalang/bundled-tiny-hybrid"

# the second bundled model: a Mamba-2 hybrid (granitemoehybrid, M M M A M M M A) trained on the same world
# (`scripts/train_bundled.py --family granitemoehybrid`)
MAMBA2_PATH = Path(__file__).resolve().parent / "mamba2_model"
MAMBA2_NAME = "deltalang/bundled-tiny-mamba2-hybrid"
# every bundled model by the name `load_model` and a program's `model` line accept
MODELS = {NAME: PATH, MAMBA2_NAME: MAMBA2_PATH}
