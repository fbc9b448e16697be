"""deltalang: experiments on the recurrent memory of gated-DeltaNet blocks, compiled to nnsight.

    import deltalang
    model = deltalang.load_model()            # the bundled tiny hybrid
    with model.trace("The Eiffel Tower is in the city of"):
        s = model.layers[1].linear_attn.state_after(3).save()
"""

from __future__ import annotations

from . import families
from .errors import DeltaError
from .kernels import route_kernels
from .model import DeltaModel, load_model
from .spec import ModelSpec, load_spec

__version__ = "0.1.0"

__all__ = ["DeltaError", "DeltaModel", "ModelSpec", "families", "load_model", "load_spec", "route_kernels",
           "__version__"]
