"""The measures a program can ask for, computed from a run's saved logits or a read site.

Each takes the next-token logits `[b, s, vocab]` (or `[b, vocab]`) of a run and
returns a float per prompt (a plain float for one prompt); `norm` takes a read value.
`top(logits, k)` is the one measure that is not a number: a `TopK` (the k most likely
next tokens' ids and probabilities, `[b, k]` each, most likely first).

The one dispatch from a measure's kind to its function and arguments: `arguments()`
(the token ids or the reference run's logits after the run's own input), used both
by the code `emit` writes (`measures.prob(results[...], 123)`) and, through
`evaluate()`, by the sweep engine.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .errors import DeltaValueError


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
        if per_token(m.kind, m.value, m.position):
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
