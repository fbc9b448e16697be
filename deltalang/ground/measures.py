"""The measures a program can ask for, computed from a run's saved logits or a read site.

Each takes next-token logits `[b, s, vocab]` (or `[b, vocab]`) and returns a float per prompt (a plain float
for one); `norm` takes a read value; `top(logits, k)` returns a `TopK` (ids and probabilities, most likely
first). A `Reduction` (`.head(k)`, `.norm(AXES)`, `.mean(AXES)`, `.project(D)`, and of a state's matrix
`.svd(k)`, `.rank(tol)`, `.erank()`) is a chain of steps over a value's named axes, applied whole or streamed a block of positions at a time (`Reduction.stream`);
`reduced_axes` says which axes a chain leaves. `arguments()` / `evaluate()` are the one dispatch from a
measure's kind to its function, used by emitted code and the sweep engine alike. `unspaced` warns where an answer
written without its leading space is far less likely than the same word after a space (it measures nothing).
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import torch

from . import display
from .errors import DeltaValueError, DeltaWarning, warn


def _last(logits: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    return x[:, -1] if x.dim() == 3 else x


def _scalar(x: torch.Tensor) -> float | torch.Tensor:
    return float(x[0]) if x.shape[0] == 1 else x


def answer_logprob(logits: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """log P(answer) per prompt: the sum of its tokens' log-probabilities under teacher forcing.

    `logits` `[b, s, vocab]` are those of the prompt followed by the answer's tokens but its last, so
    the last `len(tokens)` positions predict the answer's tokens in turn (one token: the last position).
    """
    x = logits.float()
    k = len(tokens)
    if x.dim() == 2:
        if k != 1:
            raise DeltaValueError(f"an answer of {k} tokens needs logits at every position, [b, s, vocab]")
        x = x[:, None]
    if x.shape[1] < k:
        raise DeltaValueError(f"an answer of {k} tokens needs {k} positions of logits, got {x.shape[1]}")
    lp = x[:, -k:].log_softmax(-1)
    return lp[:, torch.arange(k), torch.tensor(list(tokens))].sum(-1)


def prob(logits: torch.Tensor, token: int | Sequence[int]) -> float | torch.Tensor:
    """P(token) at the next position; of an answer of several tokens, their product under teacher forcing
    (`logits`: those of the prompt and the answer's tokens but the last, see `answer_logprob`)."""
    if not isinstance(token, int):
        return _scalar(answer_logprob(logits, token).exp())
    return _scalar(_last(logits).softmax(-1)[:, token])


def rank(logits: torch.Tensor, token: int) -> float | torch.Tensor:
    """How many tokens the model prefers to `token` at the next position (0 = its top choice)."""
    x = _last(logits)
    return _scalar((x > x[:, token : token + 1]).sum(-1).float())


def logit_diff(logits: torch.Tensor, a: int | Sequence[int], b: int | Sequence[int],
               logits_b: torch.Tensor | None = None) -> float | torch.Tensor:
    """logit(a) - logit(b) at the next position. With an answer of several tokens: log P(a) - log P(b), each
    the sum of its tokens' log-probabilities under teacher forcing (`answer_logprob`; `logits` for a,
    `logits_b` for b) — for answers of one token both are the same number."""
    if isinstance(a, int) and isinstance(b, int) and logits_b is None:
        x = _last(logits)
        return _scalar(x[:, a] - x[:, b])
    seq_a = (a,) if isinstance(a, int) else tuple(a)
    seq_b = (b,) if isinstance(b, int) else tuple(b)
    return _scalar(answer_logprob(logits, seq_a) - answer_logprob(logits if logits_b is None else logits_b, seq_b))


# An answer written without its leading space ('Paris' after "the city of") is warned of when the same word after a
# space is at least this many times as likely at the position measured. Where the answer truly starts a word glued
# to what precedes it (after a quote, a newline, a bracket) the unspaced token is the likelier one or close to it; a
# hundredfold gap is the model saying the text continues with a space, so the number measures a token the model was
# never going to write (logit-lens work's commonest slip), far past the noise of near-ties between the two spellings.
UNSPACED_FACTOR = 100.0


class UnspacedWarning(DeltaWarning):
    """`unspaced`'s warning; `result`: the measure's result name (a dataset run names the record from it)."""

    def __init__(self, message: str, result: str) -> None:
        super().__init__(message)
        self.result = result


def unspaced(logits: torch.Tensor, answer: str, token: int, twin: int, result: str = "") -> None:
    """An `UnspacedWarning` (`errors.warn`) where `token`, the answer `answer` written without its leading space,
    is `UNSPACED_FACTOR` or more times less likely than `twin`, the same word after a space, at the position the
    measure `result` reads (`logits` as the measure takes them; of several prompts, the one with the largest gap)."""
    p = _last(logits).softmax(-1)  # as `prob` computes them: the numbers it prints
    mine, other = p[:, token].double(), p[:, twin].double()
    ratio = other / mine.clamp_min(torch.finfo(torch.float64).tiny)
    row = int(ratio.argmax())
    if float(other[row]) < UNSPACED_FACTOR * float(mine[row]):
        return
    warn(UnspacedWarning(
        f"{json.dumps(answer, ensure_ascii=False)} has no leading space: its token {token} "
        f"({display.token(answer)}) has probability {display.number(float(mine[row]), display.MEASURE_DIGITS)} where this measure reads, the "
        f"same word after a space ({display.token(' ' + answer)}, token {twin}) {display.number(float(other[row]), display.MEASURE_DIGITS)}, "
        f"{display.number(float(ratio[row]), 3)} times as likely; for the word after a space measure "
        f"{json.dumps(' ' + answer, ensure_ascii=False)}", result))


def kl(logits: torch.Tensor, reference: torch.Tensor) -> float | torch.Tensor:
    """KL(reference || this run) over the next token, in nats: how far this run moved from `reference`."""
    p = _last(reference).log_softmax(-1)
    q = _last(logits).log_softmax(-1)
    return _scalar((p.exp() * (p - q)).sum(-1))


def norm(x: torch.Tensor | None) -> float | torch.Tensor:
    """The Frobenius norm of a value per prompt over every axis but the batch; per token (`[b, s]`) only
    for `states` of more than one token. A value that does not exist (`state_input` of a fresh prompt,
    which starts from no state) is a DeltaValueError, not a norm of nothing."""
    if x is None:
        raise DeltaValueError("norm of a value this call does not have: state_input is None on a prompt, "
                              "which starts from no state (it exists at decode steps, or once written)")
    x = x.float()
    if x.dim() >= 4 and x.shape[1] > 1 and x.dim() == 5:  # states: [b, s, h, k, v] -> [b, s]
        return x.flatten(2).norm(dim=-1)
    return _scalar(x.flatten(1).norm(dim=-1))


def per_token(kind: str, value: str | None, position: int | None) -> bool:
    """Whether a measure gives a number per token rather than one number (`norm` of `states`)."""
    return kind == "norm" and value == "states" and position is None


def refuse_per_token(measures: Sequence[Any], where: str) -> None:
    """A located DeltaValueError at the first measure (an `ir.ResolvedMeasure`) that gives a number per token
    where `where` (say, "over a dataset") needs one number a run."""
    for m in measures:
        red = getattr(m, "reduce", None)
        left = [a for a, _ in red.shape] if red is not None else None
        by_token = per_token(m.kind, m.value, m.position) and (left is None or left[1:] == [POSITIONS])
        if left is not None and left != [BATCH] and not by_token:
            # a reduction that leaves more than b (norm(states): b and s, said below as a number per token)
            raise DeltaValueError(f"{m.written} is {red.shown()}; {where} each run needs one number: reduce "
                                  f"every axis but b", span=m.span)
        if by_token:
            site = f"L{m.layer}.states" if m.layer is not None else "states"
            raise DeltaValueError(
                f"{m.written or 'norm(' + site + ')'} is one number per token; {where} each run needs one number: "
                f"measure norm(L{m.layer}.state_output) (after the last token) or norm(L{m.layer}.state_after(t))",
                span=m.span)


class TopK:
    """What `top(k)` measures: the k most likely next tokens, `ids` (int64) and `probs` (float32), each
    `[b, k]`, most likely first (ties: the lower id first, as `torch.topk` on CPU gives no such promise)."""

    def __init__(self, ids: torch.Tensor, probs: torch.Tensor) -> None:
        self.ids, self.probs = ids, probs

    @property
    def k(self) -> int:
        return int(self.ids.shape[-1])

    def rows(self) -> list[list[tuple[int, float]]]:
        """Per prompt: [(token id, probability), ...], most likely first."""
        return [list(zip(i, p)) for i, p in zip(self.ids.tolist(), self.probs.tolist())]

    def __repr__(self) -> str:
        return f"TopK({self.rows()!r})"


def top(logits: torch.Tensor, k: int) -> TopK:
    """The `k` most likely next tokens and their probabilities (a `TopK`); `k` past the vocabulary is an error."""
    p = _last(logits).softmax(-1)
    if not 1 <= k <= p.shape[-1]:
        raise DeltaValueError(f"top({k}): the vocabulary has {p.shape[-1]} tokens")
    # a stable order: by probability, then by token id (topk alone leaves ties unordered)
    order = torch.sort(p, dim=-1, descending=True, stable=True).indices[:, :k]
    return TopK(order.cpu(), p.gather(-1, order).cpu())


# ---- reductions ---------------------------------------------------------------

BATCH, POSITIONS = "b", "s"
# `states` as the catalogue names its axes on a DeltaNet block and on a Mamba-2 block (`values.axes`)
STATE_AXES = ((BATCH, POSITIONS, "heads", "key_dim", "value_dim"), (BATCH, POSITIONS, "heads", "head_dim", "d_state"))
# a state's matrix: its two last axes (`key_dim, value_dim`; a Mamba-2 block's `head_dim, d_state`)
MATRIX_AXES = (STATE_AXES[0][3:], STATE_AXES[1][3:])
SINGULAR = "sv"  # the axis `.svd(k)` leaves: the k largest singular values, largest first
SPECTRUM_KINDS = ("svd", "rank", "erank")  # the reductions of a state's matrix, each per head and token
REDUCE_KINDS = ("head", "norm", "mean", "project", *SPECTRUM_KINDS)


class ReductionError(DeltaValueError):
    """A reduction that does not fit its value (an axis it lacks, a direction of another shape)."""


def step_axes(axes: Sequence[str], kind: str, arg: Any) -> tuple[str, ...]:
    """The axes a value has after one reduction step; a `ReductionError` saying why a step does not fit.

    `arg`: head: its index (the value must have `heads`); norm: the axes it reduces (None: every axis but
    `b` and `s`); mean: the axes it averages; project: the direction's shape (every axis but `b` and `s`)."""
    axes = tuple(axes)
    if kind == "head":
        if "heads" not in axes:
            raise ReductionError(f"head({arg}) takes one of the heads, and this value's axes {_show(axes)} have none")
        return tuple(a for a in axes if a != "heads")
    if kind == "project":
        return tuple(a for a in axes if a in (BATCH, POSITIONS))
    if kind in SPECTRUM_KINDS:
        matrix = _matrix(axes, kind)
        kept = tuple(a for a in axes if a not in matrix)
        return (*kept, SINGULAR) if kind == "svd" else kept
    over = tuple(a for a in axes if a not in (BATCH, POSITIONS)) if arg is None else tuple(arg)
    if kind == "norm" and arg is None and not over:  # the norm of one number (per prompt, per token): its size
        return axes
    for a in over:
        if a == BATCH:
            raise ReductionError(f"{kind} over b: b is the batch axis, one result per prompt")
        if a not in axes:
            raise ReductionError(f"{kind} over {a}: this value's axes are {_show(axes)}")
    if len(set(over)) != len(over):
        raise ReductionError(f"{kind} names an axis twice: {', '.join(over)}")
    if not over:
        raise ReductionError(f"{kind} of no axes: this value's axes are {_show(axes)}")
    return tuple(a for a in axes if a not in over)


def reduced_axes(axes: Sequence[str], steps: Sequence[tuple[str, Any]]) -> tuple[str, ...]:
    """The axes a chain of steps leaves (see `step_axes`)."""
    out = tuple(axes)
    for kind, arg in steps:
        out = step_axes(out, kind, None if kind == "project" else arg)
    return out


def _show(axes: Sequence[str]) -> str:
    return "[" + ", ".join(axes) + "]"


def _matrix(axes: tuple[str, ...], kind: str) -> tuple[str, str]:
    """The two axes of a state's matrix among `axes`; a `ReductionError` when the value has not both."""
    for matrix in MATRIX_AXES:
        if all(a in axes for a in matrix):
            return matrix
    raise ReductionError(f"{kind} takes a state's matrix (key_dim, value_dim; on a Mamba-2 block head_dim, d_state), "
                         f"and this value's axes are {_show(axes)}")


def singular_values(x: torch.Tensor, axes: tuple[str, ...]) -> tuple[torch.Tensor, tuple[str, ...]]:
    """The singular values of each state matrix in `x` (float32, largest first) on a last axis `sv`, the matrix's
    two axes gone: `torch.linalg.svdvals` over them."""
    matrix = _matrix(axes, "svd")
    kept = [i for i, a in enumerate(axes) if a not in matrix]
    m = x.float().permute(*kept, axes.index(matrix[0]), axes.index(matrix[1]))
    return torch.linalg.svdvals(m), (*(axes[i] for i in kept), SINGULAR)


def spectrum(x: torch.Tensor, axes: tuple[str, ...], kind: str, arg: Any) -> torch.Tensor:
    """`svd`: the `arg` largest singular values; `rank`: how many exceed `arg` times the largest (as
    `torch.linalg.matrix_rank(rtol=arg)`; 0 for a zero matrix); `erank`: the effective rank, exp of the entropy of
    the singular values normalised to sum 1 (Roy and Vetterli; 0 for a zero matrix). float32."""
    sv, _ = singular_values(x, axes)
    if kind == "svd":
        return sv[..., : int(arg)]
    top = sv[..., :1]
    if kind == "rank":
        return ((sv > float(arg) * top) & (top > 0)).sum(-1).float()
    total = sv.sum(-1, keepdim=True)
    p = sv / total.clamp_min(torch.finfo(sv.dtype).tiny)
    entropy = -(p * torch.log(p.clamp_min(torch.finfo(sv.dtype).tiny))).sum(-1)
    return torch.where(total[..., 0] > 0, entropy.exp(), torch.zeros_like(entropy))


def _apply(x: torch.Tensor, axes: tuple[str, ...], kind: str, arg: Any) -> tuple[torch.Tensor, tuple[str, ...]]:
    """One step on a whole tensor whose axes are `axes`."""
    out = step_axes(axes, kind, None if kind == "project" else arg)
    if kind == "head":
        return x.select(axes.index("heads"), int(arg)), out
    if kind in SPECTRUM_KINDS:
        return spectrum(x, axes, kind, arg), out
    x = x.float()
    if kind == "project":
        dims = [i for i, a in enumerate(axes) if a not in (BATCH, POSITIONS)]
        d = arg.to(device=x.device, dtype=torch.float32)
        return (x * d).sum(dim=dims) if dims else x * d, out
    dims = [axes.index(a) for a in (arg if arg is not None else [a for a in axes if a not in (BATCH, POSITIONS)])]
    if kind == "norm" and not dims:  # `.norm()` of one number per prompt (or token): its absolute value
        return x.abs(), out
    if kind == "norm":
        return torch.linalg.vector_norm(x, dim=dims), out
    return x.mean(dim=dims), out


class Reduction:
    """A chain of reduction steps over a value whose axes are `axes` (`b` first): `("head", 2)`,
    `("norm", ("key_dim", "value_dim"))` (None: every axis but `b` and `s`), `("mean", ("s",))`,
    `("project", direction)` (a tensor of the value's shape without `b` and `s`; it contracts them all),
    `("svd", k)`, `("rank", tol)`, `("erank", None)` (of the state's matrix: `spectrum`)."""

    def __init__(self, axes: Sequence[str], steps: Sequence[tuple[str, Any]]) -> None:
        self.axes, self.steps = tuple(axes), [(k, _direction(a) if k == "project" else a) for k, a in steps]
        self.out_axes = reduced_axes(self.axes, [(k, None if k == "project" else a) for k, a in self.steps])
        # the steps before the first one over positions run per token (a block of positions at a time)
        first = next((i for i, (k, a) in enumerate(self.steps) if k in ("norm", "mean")
                      and POSITIONS in (a if a is not None else ())), len(self.steps))
        self.per_token, self.rest = self.steps[:first], self.steps[first:]

    @property
    def keeps_positions(self) -> bool:
        return POSITIONS in self.out_axes

    def __call__(self, x: torch.Tensor | None) -> torch.Tensor:
        if x is None:
            raise DeltaValueError("a reduction of a value this call does not have: state_input is None on a "
                                  "prompt, which starts from no state")
        axes = self.axes
        for kind, arg in self.steps:
            x, axes = _apply(x, axes, kind, arg)
        return x

    def __repr__(self) -> str:
        return f"Reduction({self.axes!r}, {[(k, 'tensor' if k == 'project' else a) for k, a in self.steps]!r})"

    def uses_head_norms(self, pads: Sequence[int] | None = None) -> bool:
        """Whether the chain starts with a norm of `states` over its state axes (`key_dim, value_dim`; a Mamba-2
        block's `head_dim, d_state`) and maybe `heads`, so that its result follows from each head's squared state
        norm (`from_head_norms`), which the value layer computes without the states (`deltarule.per_token_sq_norms`,
        `ssd.per_token_sq_norms`). Not where a later step over positions
        would count a padded row's padding."""
        if self.axes not in STATE_AXES or not self.steps:
            return False
        kind, arg = self.steps[0]
        if kind != "norm":
            return False
        matrix = set(self.axes[3:])
        over = set(arg) if arg is not None else {"heads", *matrix}
        if over not in (matrix, {"heads", *matrix}):
            return False
        return not any(pads or ()) or self.keeps_positions

    def from_head_norms(self, sq: torch.Tensor) -> torch.Tensor:
        """The result from `sq` `[b, s, heads]`, each head's squared state norm after every token."""
        kind, arg = self.steps[0]
        every = arg is None or "heads" in arg
        axes: tuple[str, ...] = (BATCH, POSITIONS) if every else (BATCH, POSITIONS, "heads")
        x = (sq.sum(-1) if every else sq).sqrt()
        for kind, arg in self.steps[1:]:
            x, axes = _apply(x, axes, kind, arg)
        return x

    def stream(self, batch: int, length: int, pads: Sequence[int] | None = None) -> "ReductionStream":
        """An accumulator fed blocks of positions of a per-token value (`s` its second axis)."""
        return ReductionStream(self, batch, length, list(pads) if pads else [0] * batch)


def _direction(d: Any) -> torch.Tensor:
    d = torch.as_tensor(d)
    return d[0] if d.dim() > 1 and d.shape[0] == 1 else d


class ReductionStream:
    """`add(row, start, block)` for each block `[t, ...]` of positions [start, start + t) of one batch row, in
    any order; `result()` the reduced value, `[batch, ...]` (with `s`: every position, the padding's zeros).
    Positions before a row's padding `pads[row]` are left out of a mean or norm over positions."""

    def __init__(self, red: Reduction, batch: int, length: int, pads: list[int]) -> None:
        self.red, self.batch, self.length, self.pads = red, batch, length, pads
        self.acc: torch.Tensor | None = None
        self.axes: tuple[str, ...] = ()
        self.other = 1  # a mean over positions and other axes: how many elements of those per position

    def add(self, row: int, start: int, block: torch.Tensor) -> None:
        skip = max(0, self.pads[row] - start)
        if skip >= block.shape[0]:
            return
        start, x, axes = start + skip, block[skip:][None], self.red.axes
        for kind, arg in self.red.per_token:
            x, axes = _apply(x, axes, kind, arg)
        if self.red.rest:  # the first step over positions: a partial sum (of squares, for a norm)
            kind, over = self.red.rest[0]
            dims = [axes.index(a) for a in over]
            part = (x.float().square() if kind == "norm" else x.float()).sum(dim=dims)
            if self.acc is None:
                self.acc, self.axes = part.new_zeros((self.batch, *part.shape[1:])), tuple(a for a in axes
                                                                                             if a not in over)
                self.other = math.prod(x.shape[d] for d in dims if axes[d] != POSITIONS)
            self.acc[row] += part[0]
            return
        if self.acc is None:
            self.acc, self.axes = x.new_zeros((self.batch, self.length, *x.shape[2:])), axes
        self.acc[row, start:start + x.shape[1]] = x[0]

    def result(self) -> torch.Tensor:
        assert self.acc is not None, "a reduction stream fed nothing"
        x, axes = self.acc, self.axes
        if self.red.rest:
            kind, over = self.red.rest[0]
            x = x.sqrt() if kind == "norm" else x / self._count(over)
            for kind, arg in self.red.rest[1:]:
                x, axes = _apply(x, axes, kind, arg)
        return x

    def _count(self, over: Sequence[str]) -> torch.Tensor:
        """How many elements each row's mean sums: its positions past the padding, times the other axes'."""
        assert self.acc is not None
        n = torch.tensor([(self.length - p) * self.other for p in self.pads], dtype=torch.float32,
                         device=self.acc.device)
        return n.view(-1, *([1] * (self.acc.dim() - 1)))


def reduced(x: torch.Tensor) -> float | torch.Tensor:
    """A reduced measure's value: one number for one prompt when it is one number per prompt."""
    x = x.float()
    return _scalar(x) if x.dim() == 1 else x


KINDS = {"prob": prob, "rank": rank, "logit_diff": logit_diff, "kl": kl, "norm": norm, "top": top}
LOGIT_KINDS = ("prob", "rank", "logit_diff", "kl", "top")  # the measures of next-token logits
_TOKENS = {"prob": 1, "rank": 1, "logit_diff": 2, "top": 1}  # how many token ids each kind takes (top: its k)


def arguments(kind: str, token_ids: Sequence[int], reference: Any = None) -> tuple[Any, ...]:
    """What measure `kind` takes after the run's own input: its token ids, or (`kl`) `reference`."""
    if kind == "kl":
        return (reference,)
    return tuple(token_ids[:_TOKENS.get(kind, 0)])


def evaluate(kind: str, x: torch.Tensor, token_ids: Sequence[int] = (),
             reference: torch.Tensor | None = None) -> float | torch.Tensor:
    """Measure `kind` of `x` (a run's logits, or the value `norm` reads); `reference`: `kl`'s other logits."""
    return KINDS[kind](x, *arguments(kind, token_ids, reference))
