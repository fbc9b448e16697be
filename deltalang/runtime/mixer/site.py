"""`MixerSite`: the model side of one recurrent mixer, tying its requests, kernel call and convolution together.

Delta-rule calls are served by `state.DeltaRuleCall`, Mamba-2 scans by `scan.SSDCall`, both sharing `conv`.
One site per transformers mixer (`mixer._deltalang_site`), knowing every wrapper that bound it weakly; a
call serves the wrapper whose trace is interleaving when it begins. Its forward hooks put the call on the
stack of running mixers (`kernels.enter`) and unwind it on exit, even when the forward raises (after a
KeyboardInterrupt: `kernels.unwinding()`, or the mixer's next run). Public attributes: `module`, `family`,
`layer`, `dims`, `interleaver`, `path`, `pads`, `seq_len`, `cache`, `running`, and `direct` (writes
applied without a trace, by the sweep engine).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from nnsight.intervention.interleaver import Interleaver

from deltalang.ground.errors import DeltaValueError
from deltalang.models.internals import cache as hf_cache

from .. import deltarule, kernels
from .conv import ConvWindows
from .scan import SSDCall
from .state import DeltaRuleCall

if TYPE_CHECKING:
    from deltalang.models.families import Family


class MixerSite(DeltaRuleCall, SSDCall, ConvWindows):
    """The model side of one recurrent mixer (delta rule or Mamba-2): hooks, and the values it serves (a
    `kernels.Site`)."""

    def __init__(self, module: torch.nn.Module, family: "Family", layer: int, dims: dict[str, int]) -> None:
        self.module = module
        self.family = family
        self.layer = layer
        self.dims = dims
        # every wrapper that bound this mixer: (its interleaver, weakly; the envoy path it uses)
        self._routes: list[tuple[weakref.ref[Interleaver], str]] = []
        # the wrapper the running call serves (None between calls)
        self.interleaver: Interleaver | None = None
        self.path = ""
        self._depth: int | None = None  # where the running call entered the stack
        self.pads: list[int] | None = None  # per row, left padding of this call
        self.seq_len = 0
        self.cache: Any = None
        self.running = False
        # writes applied without a trace (the sweep engine): (value kind, absolute position) ->
        # (rows of the batch, the value for those rows)
        self.direct: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.last = False  # the model's last DeltaNet block (set by `deltalang.runtime.model`)
        self._hooks = [
            module.register_forward_pre_hook(self._enter, with_kwargs=True),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def bind(self, interleaver: Interleaver, path: str) -> None:
        """Serve a wrapper's traces too (weakly: a dropped wrapper drops out)."""
        self._routes = [r for r in self._routes if r[0]() not in (None, interleaver)]
        self._routes.append((weakref.ref(interleaver), path))

    def _route(self) -> tuple[Interleaver | None, str]:
        """The bound wrapper whose trace is interleaving now, if any."""
        for ref, path in self._routes:
            il = ref()
            if il is not None and il.interleaving:
                return il, path
        return None, ""

    def kernel(self, fn: Any, decode: bool, *args: Any, **kwargs: Any) -> Any:
        """One call of the mixer's kernel, by its mechanism: the delta rule's, or Mamba-2's scan (`scan`)."""
        if hf_cache.recording(self.cache, self.layer):  # a prompt's last tokens then run one by one, as decode steps
            raise DeltaValueError(f"L{self.layer}: the cache records its past states (transformers' "
                                  f"activate_past_recording, as assisted decoding does); a trace that reads or writes "
                                  f"a recurrent value needs a cache that does not record")
        if self.family.block_kind == "ssm":
            return self.ssd_kernel(fn, decode, *args, **kwargs)
        return DeltaRuleCall.kernel(self, fn, decode, *args, **kwargs)

    # -- hooks ---------------------------------------------------------------

    def _enter(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._depth is not None:  # left by a forward that ended in a BaseException
            kernels.unwind(self._depth)
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        self.seq_len = int(hidden.shape[1]) if hidden is not None else 0
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[1] == self.seq_len:
            self.pads = [int(x) for x in (mask.shape[1] - mask.to(torch.long).sum(dim=1)).tolist()]
        else:
            self.pads = None
        self.cache = hf_cache.argument(kwargs)
        self.interleaver, self.path = self._route()
        self.running = True
        self._depth = kernels.enter(self)

    def _exit(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._depth is not None:
            kernels.unwind(self._depth)
        if self.last:  # no later block of this forward reuses the states buffer
            deltarule.release()

    def ended(self) -> None:
        """This call has left the stack of running mixers."""
        self.running = False
        self._depth = None
        self.interleaver = None  # neither a wrapper nor a cache is held between calls
        self.cache = None
