"""A mixer's short convolution: the windows `conv_window_after(t)` serves, and their recompute.

A prompt's convolution (`conv`) serves the window after each asked position and,
where a worker replaces it, recomputes the outputs of the tokens after it
through that window and writes it into the cache; a decode step's
(`conv_update`) serves and replaces the cache's tail.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from deltalang.ground.errors import DeltaValueError
from deltalang.models.internals import cache as hf_cache

from .requests import Requests


class ConvWindows(Requests):
    """The convolution side of `MixerSite` (which sets `cache`: the running call's cache, or None)."""

    cache: Any

    def conv(self, fn: Callable[..., Any], hidden_states: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None, activation: str | None = None, **kw: Any) -> torch.Tensor:
        """A prompt's short convolution, serving `conv_window_after(t)`."""
        out = fn(hidden_states, weight, bias, activation=activation, **kw)
        step = self.step()
        offset = hidden_states.shape[-1] - self.seq_len  # columns of a cached window in front
        width = weight.shape[-1]
        asked = self.positions("conv_window_after", step, offset)
        done: set[int] = set()
        x = hidden_states
        while asked:
            later = sorted(p for p in asked if p not in done)
            if not later:
                break
            p = later[0]
            window = _window(x, p, width)
            for name in self._names_at("conv_window_after", step, p, offset):
                new = self.serve(name, window, step)
                if new is not window:
                    new = self._checked_window(new, window)
                    out = self._rewindow(fn, x, out, p, new, weight, bias, activation, kw)
                    x = x.clone()
                    lo = p - (width - 1) + 1
                    cols = new[..., max(0, -lo):]
                    x[:, :, max(0, lo):p + 1] = cols.to(x.dtype)
                    window = new
            done.add(p)
            asked = self.positions("conv_window_after", step, offset)
        if x is not hidden_states and self.cache is not None:
            self._store_conv_cache(x, width)
        return out

    def conv_update(self, fn: Callable[..., Any], hidden_states: torch.Tensor, conv_state: torch.Tensor,
                    weight: torch.Tensor, bias: torch.Tensor | None = None,
                    activation: str | None = None, **kw: Any) -> torch.Tensor:
        """A decode step's convolution; the window after its token is the cache's tail."""
        out = fn(hidden_states, conv_state, weight, bias, activation, **kw)
        step = self.step()
        width = weight.shape[-1]
        asked = self.positions("conv_window_after", step)
        for p in list(asked):
            window = conv_state[:, :, -(width - 1):].clone()
            for name in self._names_at("conv_window_after", step, p):
                new = self.serve(name, window, step)
                if new is not window:
                    conv_state[:, :, -(width - 1):] = self._checked_window(new, window).to(conv_state.dtype)
        return out

    def _rewindow(self, fn: Callable[..., Any], x: torch.Tensor, out: torch.Tensor, p: int, window: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                  kw: dict) -> torch.Tensor:
        """Recompute the convolution outputs after position p, seeing `window` as the tokens up to p."""
        if p + 1 >= x.shape[-1]:
            return out
        tail = torch.cat([window.to(x.dtype), x[:, :, p + 1:]], dim=-1)
        y = F.conv1d(tail.to(weight.dtype), weight.unsqueeze(1), bias, padding=0, groups=x.shape[1])
        if activation is not None:
            from transformers.activations import ACT2FN

            y = ACT2FN[activation](y)
        out = out.clone()
        out[:, :, p + 1:] = y.to(out.dtype)
        return out

    def _store_conv_cache(self, x: torch.Tensor, width: int) -> None:
        buf = hf_cache.conv_state(self.cache, self.layer)
        if buf is None:
            return
        tail = x[:, :, -width:]
        if tail.shape[-1] < width:
            tail = F.pad(tail, (width - tail.shape[-1], 0))
        buf.copy_(tail.to(buf.dtype))

    def _checked_window(self, new: Any, like: torch.Tensor) -> torch.Tensor:
        if not isinstance(new, torch.Tensor) or tuple(new.shape) != tuple(like.shape):
            got = list(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
            raise DeltaValueError(
                f"L{self.layer}.conv_window_after: a write of shape {got} does not fit {list(like.shape)} "
                f"[batch, conv_dim, width-1]")
        return new.to(device=like.device, dtype=like.dtype)


def _window(x: torch.Tensor, p: int, width: int) -> torch.Tensor:
    """Columns p-width+2..p of x `[b, c, L]`, zero-filled on the left: `[b, c, width-1]`."""
    lo = p - (width - 1) + 1
    w = x[:, :, max(0, lo):p + 1]
    if w.shape[-1] < width - 1:
        w = F.pad(w, (width - 1 - w.shape[-1], 0))
    return w.clone()
