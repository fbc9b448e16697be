"""Measurements of the bundled model, shared by `scripts/train_bundled.py` and the tests.

Everything goes through plain transformers (no nnsight, no deltalang but `internals`' cache keyword and cache reads): the
memory-patching figures use transformers' own cache as the ground truth for
what a DeltaNet block carries after a prefix.

- `heldout_accuracy`: top-1 accuracy on the held-out phrasings, per relation.
- `answer_prob`: P(answer's first token | prompt).
- `memory_patch`: run a prefix with `use_cache=True`, overwrite every DeltaNet
  block's recurrent state (and, for the "whole memory", its convolution window)
  with a donor prompt's, run the rest of the prompt from that cache, and read
  P(answer).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Sequence

import torch

from ..internals import cache as hf_cache
from ..internals import cache_kwargs, output_cache
from . import PATH, world

MODES = ("none", "state", "whole")


def load(path: Any = None) -> tuple[Any, Any]:
    """The bundled model and tokenizer through `AutoModelForCausalLM` / `AutoTokenizer`, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = PATH if path is None else path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def linear_layers(model: Any) -> list[int]:
    """Indices of the DeltaNet ('linear_attention') blocks."""
    return [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def answer_id(tokenizer: Any, answer: str) -> int:
    """The answer's first token (every answer of the world is one token)."""
    return _ids(tokenizer, answer)[0]


@torch.no_grad()
def next_token_probs(model: Any, tokenizer: Any, prompts: Sequence[str]) -> torch.Tensor:
    """Next-token probabilities after each prompt, `[len(prompts), vocab]`.

    Prompts are grouped by token length and run unpadded, so each row is exactly
    what a solo forward gives.
    """
    ids = [_ids(tokenizer, p) for p in prompts]
    out = torch.empty(len(prompts), model.config.vocab_size)
    groups: dict[int, list[int]] = defaultdict(list)
    for i, row in enumerate(ids):
        groups[len(row)].append(i)
    for rows in groups.values():
        for start in range(0, len(rows), 256):
            chunk = rows[start : start + 256]
            batch = torch.tensor([ids[i] for i in chunk])
            logits = model(batch, use_cache=False).logits[:, -1].float()
            out[chunk] = logits.softmax(-1)
    return out


def answer_prob(model: Any, tokenizer: Any, prompt: str, answer: str) -> float:
    """P(answer | prompt) for a one-token answer."""
    return float(next_token_probs(model, tokenizer, [prompt])[0, answer_id(tokenizer, answer)])


def accuracy(model: Any, tokenizer: Any, items: Iterable[tuple[str, str]]) -> float:
    """Share of (prompt, answer) pairs whose top-1 next token is the answer."""
    items = list(items)
    probs = next_token_probs(model, tokenizer, [p for p, _ in items])
    hits = [int(probs[i].argmax()) == answer_id(tokenizer, a) for i, (_, a) in enumerate(items)]
    return sum(hits) / len(hits)


def heldout_accuracy(model: Any, tokenizer: Any, every: int = 1) -> dict[str, Any]:
    """Top-1 accuracy on held-out phrasings, per relation and overall.

    `every=k` evaluates every k-th held-out example of each relation (a subset,
    said so in the result as `n`).
    """
    result: dict[str, Any] = {}
    hits = total = 0
    for relation in world.RELATIONS:
        exs = world.heldout_examples(relation)[::every]
        acc = accuracy(model, tokenizer, [e.pair() for e in exs])
        result[relation] = {"accuracy": acc, "n": len(exs)}
        hits += round(acc * len(exs))
        total += len(exs)
    result["overall"] = {"accuracy": hits / total, "n": total}
    return result


@torch.no_grad()
def _run_prefix(model: Any, ids: torch.Tensor) -> Any:
    out = model(ids, use_cache=True)
    return output_cache(out)


@torch.no_grad()
def memory_patch(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    prefix_len: int,
    answers: Sequence[str],
    donor: str | Sequence[str] = world.PIZZA_PROMPT,
    mode: str = "whole",
    donor_len: int | None = None,
) -> torch.Tensor:
    """P(answer) after each prompt with every DeltaNet block's memory after `prefix_len` tokens taken from `donor`.

    All prompts must have the same token length. The prefix (first `prefix_len`
    tokens) runs with `use_cache=True`; the donor's first `donor_len` tokens
    (default: `prefix_len`) run the same way; then, for every DeltaNet block,
    `mode="state"` copies the donor's recurrent state into the prompt's cache,
    `mode="whole"` copies the recurrent state and the convolution window, and
    `mode="none"` copies nothing. The rest of the prompt then runs from that
    cache. `donor` is one prompt for all rows or one per row. Returns P(answer)
    per prompt.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    ids = torch.tensor([_ids(tokenizer, p) for p in prompts])
    cache = _run_prefix(model, ids[:, :prefix_len])
    if mode != "none":
        donors = [donor] if isinstance(donor, str) else list(donor)
        n = prefix_len if donor_len is None else donor_len
        donor_ids = torch.tensor([_ids(tokenizer, d)[:n] for d in donors])
        donor_cache = _run_prefix(model, donor_ids)
        for i in linear_layers(model):
            for read in (hf_cache.recurrent_state, hf_cache.conv_state) if mode == "whole" else (hf_cache.recurrent_state,):
                mine, theirs = read(cache, i), read(donor_cache, i)
                assert mine is not None and theirs is not None, f"block {i} keeps no state in the cache"
                mine.copy_(theirs.expand_as(mine))
    logits = model(ids[:, prefix_len:], **cache_kwargs(cache, model), use_cache=True).logits[:, -1].float()
    targets = torch.tensor([answer_id(tokenizer, a) for a in answers])
    return logits.softmax(-1).gather(1, targets[:, None])[:, 0]


@torch.no_grad()
def split_consistency(model: Any, tokenizer: Any, prompt: str, prefix_len: int) -> float:
    """Max |logit difference| between a full forward and prefix-then-rest through the cache."""
    ids = torch.tensor([_ids(tokenizer, prompt)])
    full = model(ids, use_cache=False).logits
    cache = _run_prefix(model, ids[:, :prefix_len])
    first = model(ids[:, :prefix_len], use_cache=False).logits
    rest = model(ids[:, prefix_len:], **cache_kwargs(cache, model), use_cache=True).logits
    return float((torch.cat([first, rest], dim=1) - full).abs().max())


def eiffel_memory(model: Any, tokenizer: Any) -> dict[str, float]:
    """P(' Paris') on the Eiffel prompt: clean, through the cache unpatched, state patched, whole memory patched.

    The prefix ends at 'Tower'; the donor is the pizza prompt's prefix of the same length.
    """
    n = len(_ids(tokenizer, "The Eiffel Tower"))
    out = {"prefix_tokens": n, "clean": answer_prob(model, tokenizer, world.EIFFEL_PROMPT, world.EIFFEL_ANSWER)}
    for mode in MODES:
        p = memory_patch(model, tokenizer, [world.EIFFEL_PROMPT], n, [world.EIFFEL_ANSWER], mode=mode)
        out[{"none": "cache_unpatched", "state": "state_only", "whole": "whole_memory"}[mode]] = float(p[0])
    # the same with the donor's memory after its whole prompt ('... pizza with'), for comparison
    for mode in ("state", "whole"):
        p = memory_patch(
            model, tokenizer, [world.EIFFEL_PROMPT], n, [world.EIFFEL_ANSWER], mode=mode,
            donor_len=len(_ids(tokenizer, world.PIZZA_PROMPT)),
        )  # fmt: skip
        out[f"{'state_only' if mode == 'state' else 'whole_memory'}_full_donor"] = float(p[0])
    out["split_max_abs_logit_diff"] = split_consistency(model, tokenizer, world.EIFFEL_PROMPT, n)
    return out


def landmark_memory(model: Any, tokenizer: Any) -> dict[str, Any]:
    """Over every landmark's canonical prompt: share where patching the memory after the subject halves P(answer).

    Donor: the pizza prompt's prefix of the same length. Also, with another
    landmark as donor (the next one in order), the share where the patched model's
    top-1 answer becomes the donor landmark's city.
    """
    rows = world.landmark_prompts()
    by_len: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (prefix, prompt, _) in enumerate(rows):
        by_len[(len(_ids(tokenizer, prefix)), len(_ids(tokenizer, prompt)))].append(i)
    clean = torch.empty(len(rows))
    patched = {m: torch.empty(len(rows)) for m in ("state", "whole")}
    for (n, _), idx in by_len.items():
        prompts = [rows[i][1] for i in idx]
        answers = [rows[i][2] for i in idx]
        clean[idx] = memory_patch(model, tokenizer, prompts, n, answers, mode="none")
        for m in patched:
            patched[m][idx] = memory_patch(model, tokenizer, prompts, n, answers, mode=m)
    result: dict[str, Any] = {"n": len(rows), "mean_clean": float(clean.mean())}
    for m, p in patched.items():
        name = "state_only" if m == "state" else "whole_memory"
        result[f"{name}_halves_share"] = float((p <= clean / 2).float().mean())
        result[f"{name}_mean_p"] = float(p.mean())
    # another landmark as donor: does the answer follow the donor?
    # (pairs within a length group, skipping donors with the same city)
    follows = counted = 0
    for (n, _), idx in by_len.items():
        pairs = [(i, j) for i, j in zip(idx, idx[1:] + idx[:1]) if rows[i][2] != rows[j][2]]
        if not pairs:
            continue
        p = memory_patch(
            model, tokenizer, [rows[i][1] for i, _ in pairs], n, [rows[j][2] for _, j in pairs],
            donor=[rows[j][1] for _, j in pairs], mode="whole",
        )  # fmt: skip
        follows += int((p > 0.5).sum())
        counted += len(pairs)
    result["other_landmark_donor_pairs"] = counted
    result["whole_memory_from_other_landmark_answers_donor_city_share"] = follows / max(counted, 1)
    return result


def report(model: Any, tokenizer: Any, every: int = 1) -> dict[str, Any]:
    """All figures: held-out accuracy, P(' Paris'), the Eiffel memory patches, the landmark sweep."""
    return {
        "heldout_accuracy": heldout_accuracy(model, tokenizer, every=every),
        "eiffel": eiffel_memory(model, tokenizer),
        "landmarks": landmark_memory(model, tokenizer),
    }
