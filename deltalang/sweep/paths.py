"""The recorded forwards behind attribution: the clean run, the donors, and the gradient passes of each path.

`record_forward` runs one plain transformers forward recording recurrent blocks (`gradients.record`), with
a measure's gradients when given one. `gradient_runs` gives, per measure, the recordings each variant
integrates: `plain` (the clean run) and the `k` points of a path (`path_rule`): "blocks" (block L's kernel
output moved towards the goal, the pass from block L and the first moved position on, over the clean
stream `plain_runs` captured; several blocks share a pass as rows, up to `CPU_PATH_TOKENS` on a CPU; on
Mamba-2 blocks whole forwards, `whole_block_paths`),
"outputs" (every swept block's output at once) or "embeddings". `goal`: the donor's output, or `factor` x
the clean one. Weights get no gradient. The derivation: docs/attribution.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from deltalang.language.ir import ResolvedMeasure
from deltalang.models import families
from deltalang.models.internals import cache_kwargs
from deltalang.runtime import gradients
from deltalang.runtime.model import DeltaModel, decoder_layers

from .job import measure_label
from .memory import memory_budget, row_bytes
from .recompute import Capture, Row, capture_clean, capture_forward, device_of, dtype_of, prefix_reads, run_rows

PATHS = {"outputs": "out", "embeddings": "emb", "blocks": "blk"}  # path -> the prefix of its variant's name
CPU_PATH_TOKENS = 512  # rows x positions of one block-path pass on a CPU at most (`path_groups`)


@lru_cache(maxsize=None)
def path_rule(k: int, clean_end: bool) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """How k gradient passes integrate a path, int_0^1 g(a) da: the k points a in (0, 1), their weights, and
    the weight of the clean end a = 0, whose gradient (`plain`) is computed anyway.

    Without `clean_end`: k equal midpoints a = (j + 1/2)/k (exact for g linear in a). With it: the
    (k + 1)-point Gauss-Radau rule whose fixed node is the clean end, exact for g a polynomial of degree
    <= 2k (k = 1: a = 2/3, weight 3/4, clean end 1/4). On [-1, 1] with the node -1, its free nodes are
    the roots of (P_k + P_{k+1}) / (1 + x), with weights (1 - x) / ((k + 1)^2 P_k(x)^2), and -1 weighs
    2 / (k + 1)^2 (Legendre polynomials P). `PathEnds.clean_end` says which a path takes."""
    if k < 1:
        raise ValueError(f"a path takes at least one point, got {k}")
    if not clean_end:
        return tuple((j + 0.5) / k for j in range(k)), (1.0 / k,) * k, 0.0
    n = k + 1
    leg = np.polynomial.legendre
    roots = np.sort(leg.legroots(np.eye(n + 1)[n] + np.eye(n + 1)[n - 1]).real)[1:]  # less the node -1
    weights = (1 - roots) / (n**2 * leg.legval(roots, np.eye(n)[n - 1]) ** 2)
    return tuple(float(x) for x in (roots + 1) / 2), tuple(float(w) / 2 for w in weights), 1.0 / n**2


def ids_of(model: DeltaModel, text: str) -> torch.Tensor:
    return torch.tensor([model.spec.token_ids(text)], device=device_of(model))


def measure_of(m: ResolvedMeasure, logits: torch.Tensor) -> torch.Tensor:
    """The measure per row, differentiable, of the next-token logits `[b, s, vocab]`: `[b]`."""
    x = logits[:, -1].float()
    if m.kind == "prob":
        return x.softmax(-1)[:, m.token_ids[0]]
    return x[:, m.token_ids[0]] - x[:, m.token_ids[1]]


def _mixers(model: DeltaModel) -> Callable[[int], torch.nn.Module]:
    layers = decoder_layers(model._module)
    return lambda i: model.family.mixer_of(layers[i])  # where the family keeps it (zamba2: one level down)


def record_forward(model: DeltaModel, blocks: Sequence[int], ids: torch.Tensor | None = None,
                   embeds: torch.Tensor | None = None, measure: ResolvedMeasure | None = None,
                   shifts: dict[int, torch.Tensor] | None = None, cache: Any = None) -> gradients.Recording:
    """One forward of `ids` (or input embeddings) recording `blocks`; with `measure`, its gradients; with
    `cache` (a fresh transformers cache), filling it."""
    hf = model._module

    def forward() -> torch.Tensor:
        kw: dict[str, Any] = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}
        if cache is not None:
            kw.update(cache_kwargs(cache, hf), use_cache=True)
        else:
            kw.update(use_cache=False)
        return hf(**kw, logits_to_keep=1).logits

    with torch.set_grad_enabled(measure is not None):
        rec = gradients.record(hf, model.family, sorted(set(blocks)), _mixers(model), forward, shifts)
        if measure is not None:
            rec.backward(measure_of(measure, rec.result).sum())  # rows are independent: each its own gradient
    rec.result = rec.result.detach()
    return rec


@contextmanager
def frozen_weights(model: DeltaModel) -> Iterator[None]:
    """No weight gradients inside (only activation gradients are wanted); `requires_grad` restored after."""
    frozen = [p for p in model._module.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


def output_of(rec: gradients.Recording, block: int) -> torch.Tensor:
    got = rec.blocks[block].out
    assert got is not None
    return got.detach()


@attrs.frozen
class PathEnds:
    """Where a path runs: the clean recording, and the donor's (or `factor` x the clean outputs).

    `start`: the first position the path moves (the donor's prompt begins as the clean one up to there,
    and no cell's write differs from the clean value before it): a block's path passes run from it."""

    text: str
    clean: gradients.Recording
    donor: gradients.Recording | None
    donor_text: str | None
    factor: float | None
    start: int = 0

    @property
    def clean_end(self) -> bool:
        """Whether the path's rule takes the clean run as a point (`path_rule`): for zeros and scales, whose
        path runs to zero or factor x the clean output (on the bundled model, state zeroed: Spearman 0.892
        with k = 4, against 0.773 for 4 and 0.869 for 8 equal midpoints); not for a donor, whose midpoints
        rank as well (0.939 against 0.943 with k = 2) and better on recall (0.966 against 0.959)."""
        return self.donor is None

    def shift(self, block: int) -> torch.Tensor:
        """goal - clean of block's kernel output, `[1, s, h, dv]`."""
        here = output_of(self.clean, block)
        goal = output_of(self.donor, block) if self.donor is not None else (self.factor or 0.0) * here
        return goal - here


def plain_runs(model: DeltaModel, blocks: Sequence[int], text: str, measures: Sequence[ResolvedMeasure],
               capture_from: int | None = None) -> tuple[dict[str, gradients.Recording], Capture | None]:
    """{measure label: the clean forward of `text` recorded with that measure's gradients} (`plain`); any of
    them is also the clean recording (its kernel inputs and outputs).

    With `capture_from` (the blocks' paths need it) the first measure's forward also leaves the clean
    capture for `run_rows` from that block (`recompute.capture_forward`: no separate clean forward), and
    records every DeltaNet block from there (`with_prefix` takes the capture's prefix states from them)."""
    x0 = model._module.get_input_embeddings()(ids_of(model, text)).detach()
    out: dict[str, gradients.Recording] = {}
    capture: Capture | None = None
    with frozen_weights(model):
        for m in measures:
            embeds = x0.clone().requires_grad_(True)
            if capture_from is None or capture is not None:
                out[measure_label(m)] = record_forward(model, blocks, embeds=embeds, measure=m)
                continue
            layers = sorted(set(blocks) | {i for i in model.spec.recurrent_layers() if i >= capture_from})

            def forward(cache: Any, m: ResolvedMeasure = m, embeds: torch.Tensor = embeds) -> gradients.Recording:
                return record_forward(model, layers, embeds=embeds, measure=m, cache=cache)

            out[measure_label(m)], capture = capture_forward(model, capture_from, forward)
    return out, capture


def with_values(model: DeltaModel, capture: Capture, clean: gradients.Recording,
                reads: Mapping[int, set[tuple[str, int | None]]]) -> Capture:
    """`capture` holding the clean values `reads` asks for (as `recompute.capture_clean` reads them: the state
    or window after a position, the state after the last), taken from the clean recording's blocks."""
    got: dict[tuple[str, int, int | None], torch.Tensor] = {}
    for i, asked in reads.items():
        blk = clean.blocks[i]
        at = {p: capture.seq_len - 1 if p is None else p for value, p in asked if value != "conv_window_after"}
        states = gradients.states_at(model.family, blk, at.values())
        wins = gradients.windows(blk) if any(value == "conv_window_after" for value, _ in asked) else None
        for value, p in asked:
            if value == "conv_window_after":
                assert wins is not None and p is not None
                got[(value, i, p)] = wins[:, p].to(dtype_of(model, value))
            else:
                got[(value, i, p)] = states[at[p]]
    return attrs.evolve(capture, values=got)


def with_prefix(model: DeltaModel, capture: Capture, clean: gradients.Recording, start: int) -> Capture:
    """`capture` holding the clean states and windows after `start` - 1 that `run_rows` continues from."""
    return with_values(model, capture, clean, prefix_reads(model, min(capture.inputs), start))


def reused_capture(capture: Capture, clean: gradients.Recording, text: str) -> Callable[..., Capture]:
    """A stand-in for `recompute.capture_clean` (the engine's `capture`) answering from `plain_runs`' capture
    of `text` and its recording where it holds what is asked (no second clean forward)."""
    def provide(model: DeltaModel, asked: str, first: int, reads: Mapping[int, set[tuple[str, int | None]]]
                ) -> Capture:
        if asked != text or first < min(capture.inputs) or any(i not in clean.blocks for i in reads):
            return capture_clean(model, asked, first, reads)
        return with_values(model, capture, clean, reads)
    return provide


def gradient_runs(model: DeltaModel, blocks: Sequence[int], measures: Sequence[ResolvedMeasure], steps: int,
                  path: str, ends: PathEnds, plain: dict[str, gradients.Recording], capture: Capture | None
                  ) -> dict[str, dict[str, Any]]:
    """{measure label: {variant: recordings that variant integrates}} ("blocks": {block: recordings});
    `plain`, `capture`: `plain_runs`'s (the capture from the first swept block, for path "blocks")."""
    ids = ids_of(model, ends.text)
    embed = model._module.get_input_embeddings()
    out: dict[str, dict[str, Any]] = {}
    if path == "blocks" and steps > 0 and not whole_passes(model):
        assert capture is not None, "path blocks runs from the clean capture (plain_runs' capture_from)"
        capture = with_prefix(model, capture, ends.clean, ends.start)
    with frozen_weights(model):
        for m in measures:
            x0 = embed(ids).detach()
            variants: dict[str, Any] = {"plain": [plain[measure_label(m)]]}
            out[measure_label(m)] = variants
            if steps <= 0:
                continue
            name = f"{PATHS[path]}{steps}"
            if path == "blocks":
                if whole_passes(model):
                    variants[name] = whole_block_paths(model, blocks, m, steps, ends)
                    continue
                assert capture is not None
                variants[name] = block_paths(model, capture, blocks, m, steps, ends)
                continue
            recs = []
            for a in path_rule(steps, ends.clean_end)[0]:
                if path == "embeddings":
                    assert ends.donor_text is not None
                    x1 = embed(ids_of(model, ends.donor_text)).detach()
                    recs.append(record_forward(model, blocks, embeds=(x0 + a * (x1 - x0)).requires_grad_(True),
                                               measure=m))
                else:
                    shifts = {b: a * ends.shift(b) for b in blocks}
                    recs.append(record_forward(model, blocks, embeds=x0.clone().requires_grad_(True), measure=m,
                                               shifts=shifts))
            variants[name] = recs
    return out


def path_groups(model: DeltaModel, blocks: Sequence[int], steps: int, positions: int, whole: bool = False
                ) -> list[list[int]]:
    """Blocks whose paths share one pass: their rows x blocks run, with gradients, fit the memory budget
    (`whole`: every row through every block, `whole_block_paths`; else from its own block on).

    On a CPU consecutive blocks share a pass up to `CPU_PATH_TOKENS` rows x positions (k rows a block, at
    least one block): the linear layers' matrix products are the passes' cost, and a product of fewer rows
    of tokens runs below the cores' peak (2 AVX-512 cores, a 1024 x 3584 layer: 115 / 130 / 152 / 173 /
    167 GFLOP/s at 64 / 128 / 256 / 512 / 1024 tokens). On the 0.8B-shaped benchmark (64 positions, k = 2:
    four blocks a pass) the estimate took 26.3-29.1 s against 29.4-30.9 s at two blocks a pass, 2.2-2.5
    GiB against 1.2 GiB; a long prompt keeps one block a pass."""
    device = device_of(model)
    if device.type == "cpu":
        per = max(1, CPU_PATH_TOKENS // (max(steps, 1) * max(positions, 1)))
        ordered = sorted(blocks)
        return [ordered[i:i + per] for i in range(0, len(ordered), per)]
    per_block = row_bytes(model, positions)  # one row through one block, kept for the backward
    budget = memory_budget(device)
    n = model.spec.num_layers
    groups: list[list[int]] = []
    used = 0
    for b in sorted(blocks):
        cost = steps * (n - (0 if whole else b)) * per_block
        if groups and used + cost <= budget:
            groups[-1].append(b)
            used += cost
        else:
            groups.append([b])
            used = cost
    return groups


def block_paths(model: DeltaModel, capture: Capture, blocks: Sequence[int], m: ResolvedMeasure, steps: int,
                ends: PathEnds) -> dict[int, list[gradients.Recording]]:
    """Each block's own path, its k points (`path_rule`) as rows, from that block on: {block: [its recording]}.

    The passes run at positions `ends.start`.. over the clean prefix (`capture` holds its states and windows:
    `recompute.prefix_reads`); the gradients at the positions before are left zero, which a cell's
    estimate never reads: its W' - W is zero there, and the adjoint scan and the window's taps take a
    position's gradient from the outputs at and after it only."""
    dev = device_of(model)
    a = torch.tensor(path_rule(steps, ends.clean_end)[0], dtype=torch.float32, device=dev)
    start, s = ends.start, capture.seq_len
    out: dict[int, list[gradients.Recording]] = {}
    for group in path_groups(model, blocks, steps, s - start):
        rows = [Row(None, b, start, ()) for b in group for _ in range(steps)]  # type: ignore[arg-type]
        inputs = dict(capture.inputs)
        # block b's convolution in the graph
        inputs.update({b: capture.inputs[b].detach().requires_grad_(True) for b in group})
        cap = attrs.evolve(capture, inputs=inputs)
        shifts = {}
        for n, b in enumerate(group):
            d = ends.shift(b)[:, start:]
            shift = torch.zeros((n + 1) * steps, *d.shape[1:], dtype=torch.float32, device=d.device)
            shift[n * steps:] = a[:, None, None, None] * d.float()  # block b's rows are the last `steps` there
            shifts[b] = shift

        def forward() -> torch.Tensor:
            return run_rows(model, cap, rows, start).logits[:, None]

        with torch.enable_grad():
            rec = gradients.record(model._module, model.family, group, _mixers(model), forward, shifts)
            rec.backward(measure_of(m, rec.result).sum())
        result = rec.result.detach()
        for n, b in enumerate(group):
            blk = rec.blocks[b]
            assert blk.grad_out is not None and blk.grad_conv is not None
            mine = slice(n * steps, (n + 1) * steps)
            # positions start.. of the pass (the convolution's input also holds the prefix's window before them)
            grad_out = F.pad(blk.grad_out[mine], (0, 0, 0, 0, start, 0))
            grad_conv = F.pad(blk.grad_conv[mine][..., blk.grad_conv.shape[-1] - (s - start):], (start, 0))
            own = attrs.evolve(blk, grad_out=grad_out, grad_conv=grad_conv)
            out[b] = [gradients.Recording(rec.family, {b: own}, result[mine])]
    return out


def whole_passes(model: DeltaModel) -> bool:
    """Whether a block's path runs as whole-model forwards (`whole_block_paths`): on Mamba-2 blocks, which the
    engine's continuation (`recompute.run_rows`, over its delta-rule prefix) does not recompute."""
    return model.family.block_kind == families.SSM_KIND


def whole_block_paths(model: DeltaModel, blocks: Sequence[int], m: ResolvedMeasure, steps: int, ends: PathEnds
                      ) -> dict[int, list[gradients.Recording]]:
    """`block_paths` as whole-model forwards from the embeddings, every position: each block's k points
    (`path_rule`) as rows, its shift on its own rows only (several blocks' rows share a pass, `path_groups`).
    The same gradients as a pass from block L and `ends.start` on, at every position the estimate reads."""
    dev = device_of(model)
    a = torch.tensor(path_rule(steps, ends.clean_end)[0], dtype=torch.float32, device=dev)
    ids = ids_of(model, ends.text)
    x0 = model._module.get_input_embeddings()(ids).detach()
    out: dict[int, list[gradients.Recording]] = {}
    for group in path_groups(model, blocks, steps, int(ids.shape[1]), whole=True):
        rows = len(group) * steps
        shifts = {}
        for n, b in enumerate(group):
            d = ends.shift(b)
            shift = torch.zeros(rows, *d.shape[1:], dtype=torch.float32, device=d.device)
            shift[n * steps:(n + 1) * steps] = a[:, None, None, None] * d.float()
            shifts[b] = shift
        embeds = x0.expand(rows, *x0.shape[1:]).clone().requires_grad_(True)
        rec = record_forward(model, group, embeds=embeds, measure=m, shifts=shifts)
        for n, b in enumerate(group):
            blk, mine = rec.blocks[b], slice(n * steps, (n + 1) * steps)
            assert blk.grad_out is not None and blk.grad_conv is not None
            own = attrs.evolve(blk, grad_out=blk.grad_out[mine], grad_conv=blk.grad_conv[mine])
            out[b] = [gradients.Recording(rec.family, {b: own}, rec.result[mine])]
    return out
