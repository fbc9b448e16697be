"""The bundled tiny hybrid: a Qwen3.5-architecture model trained on a synthetic world.

`load_model()` with no name opens the checkpoint in `model/` beside this file.
`world.py` holds the facts it was trained on; `scripts/train_bundled.py` in the
repository trains it again, deterministically.
"""

from pathlib import Path

PATH = Path(__file__).resolve().parent / "model"
NAME = "deltalang/bundled-tiny-hybrid"
