"""deltalang: experiments on the recurrent memory of gated-DeltaNet blocks, compiled to nnsight.

    import deltalang
    model = deltalang.load_model()            # the bundled tiny hybrid
    with model.trace("The Eiffel Tower is in the city of"):
        s = model.layers[1].linear_attn.state_after(3).save()

The package face: re-exports only (ARCHITECTURE.md shows where each lives).
"""

from __future__ import annotations

from .version import __version__

from . import families  # noqa: E402
from .errors import DeltaError
from .kernels import route_kernels, routed
from .check import check
from .model import DeltaModel, load_model
from .parse import parse
from .compiled import Experiment
from .results import Results
from .run import compile, run, run_sweep, sweep
from .spec import ModelSpec, load_spec

__all__ = ["DeltaError", "DeltaModel", "Experiment", "ModelSpec", "Results", "check", "compile", "families",
           "load_model", "load_spec", "parse", "route_kernels", "routed", "run", "run_sweep", "sweep", "__version__"]
