"""Serving the DeltaNet values: the model side (`MixerSite`) and the user side (`DeltaNetEnvoy`).

- `requests`: nnsight scheduling: which workers wait on which value, at which
  step and position, and handing values to them;
- `state`: one delta-rule call, split at the positions asked for;
- `conv`: the short convolution's windows and their recompute;
- `site`: `MixerSite`, one per transformers mixer module, tying them together
  (its hooks put a call on `deltalang.runtime.kernels`' stack of running mixers);
- `envoy`: `DeltaNetEnvoy`, whose value properties are generated from the
  catalogue in `deltalang.models.values`.

Below this package: `deltalang.runtime.kernels` (the dispatchers, which reach a running
site through its `Site` protocol). Above it: `deltalang.runtime.model`, which attaches
the sites and installs the envoy.
"""

from ..kernels import _STACK
from .envoy import DeltaNetEnvoy
from .requests import DIRECT, SERVED
from .site import MixerSite

__all__ = ["DIRECT", "SERVED", "DeltaNetEnvoy", "MixerSite"]
