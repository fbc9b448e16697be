"""deltalang: experiments on the recurrent memory of gated-DeltaNet blocks, compiled to nnsight.

    import deltalang
    model = deltalang.load_model()            # the bundled tiny hybrid
    with model.trace("The Eiffel Tower is in the city of"):
        s = model.layers[1].linear_attn.state_after(3).save()

The package face: re-exports only (ARCHITECTURE.md shows where each lives).
Each public name is imported on first use (module `__getattr__`), so
`import deltalang` and the commands that need no model (`deltalang --help`,
`fmt`, `check`) never import torch or nnsight; `deltalang.X` is the same object
as before, and `from deltalang import X` works for every name in `__all__`.
"""

from __future__ import annotations

import importlib as _importlib
import sys as _sys
import types as _types
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from .ground.version import __version__

if _TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from .ground.allocator import keep_freed_memory
    from .ground.errors import DeltaError
    from .language.check import check
    from .language.parse import parse
    from .merge import load_results
    from .models import families
    from .models.spec import ModelSpec, load_spec
    from .run import compile, run, run_sweep, sweep
    from .runs.collection import Collection
    from .runs.compiled import Experiment
    from .runs.dataset_run import DatasetResults
    from .runs.results import Results
    from .runtime.kernels import route_kernels, routed
    from .runtime.model import DeltaModel, load_model
    from .sweep.attribution_dataset import DatasetAttribution
    from .sweep.dataset import DatasetSweepResults

# public name -> the module (relative to the package) that defines it, or the module it is
_LAZY: dict[str, str] = {
    "families": "models.families", "DeltaError": "ground.errors", "route_kernels": "runtime.kernels",
    "routed": "runtime.kernels", "check": "language.check", "DeltaModel": "runtime.model",
    "load_model": "runtime.model", "parse": "language.parse", "Experiment": "runs.compiled",
    "Results": "runs.results", "DatasetResults": "runs.dataset_run", "DatasetSweepResults": "sweep.dataset",
    "DatasetAttribution": "sweep.attribution_dataset", "compile": "run", "run": "run", "run_sweep": "run", "sweep": "run",
    "ModelSpec": "models.spec", "load_spec": "models.spec", "Collection": "runs.collection", "load_results": "merge",
    "keep_freed_memory": "ground.allocator", "measures": "ground.measures",
}

__all__ = ["Collection", "DatasetAttribution", "DatasetResults", "DatasetSweepResults", "DeltaError", "DeltaModel", "Experiment", "ModelSpec", "Results", "check", "compile", "families",
           "keep_freed_memory", "load_model", "measures", "load_results", "load_spec", "parse", "route_kernels", "routed", "run", "run_sweep", "sweep", "__version__"]


def __getattr__(name: str) -> _Any:
    """`deltalang.NAME`: import the module that defines NAME the first time it is asked for."""
    home = _LAZY.get(name)
    if home is None:
        raise AttributeError(f"module 'deltalang' has no attribute {name!r}")
    module = _importlib.import_module(f".{home}", __name__)
    value = module if home.rpartition(".")[2] == name and name not in _SHADOWED else getattr(module, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def load_ipython_extension(ipython: _Any) -> None:
    """`%load_ext deltalang` in Jupyter/IPython: the `%%deltalang` cell magic (`deltalang.notebook`)."""
    from .notebook import load_ipython_extension as load

    load(ipython)


def __dir__() -> list[str]:
    """The public names (and the submodules imported so far): no `typing` or import machinery."""
    modules = {n for n, v in globals().items() if isinstance(v, _types.ModuleType) and not n.startswith("_")
               and getattr(v, "__name__", "").startswith(__name__ + ".")}
    return sorted(set(__all__) | {"load_ipython_extension"} | modules)


# public functions named like the modules they live in or beside (`run`, `check`, `parse`, `sweep`)
_SHADOWED = frozenset({"run", "check", "parse", "sweep"})


class _Face(_types.ModuleType):
    """The package module: importing submodule `deltalang.run` never rebinds the public `deltalang.run`.

    The import system sets a package's attribute to each submodule it imports; for
    the names above the public function keeps the name (as the eager face did).
    """

    def __setattr__(self, name: str, value: _Any) -> None:
        if name in _SHADOWED and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Face
