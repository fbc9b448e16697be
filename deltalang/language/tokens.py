"""Prompts as the model's tokens: ids, each token's character span and its text decoded alone.

`tokenize(spec, text)` is the one place a prompt becomes tokens for the
language (positions, quoted pieces, answers); `token_id` tokenizes an answer on
its own, `spaced_twin` finds the same word after a space; `decoded` is each token's text as messages and tables
show it (through `display.token`: `␣Tower`, never the tokenizer's spelling 'ĠTower'). Depends on `spec` only.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from deltalang.ground.errors import DeltaResolveError
from deltalang.models.spec import ModelSpec


@attrs.frozen
class PromptTokens:
    """A prompt as the model sees it: ids, each token's character span, each token's text decoded alone."""

    text: str
    ids: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]
    decoded: tuple[str, ...]  # ' Tower'; `display.token` shows it

    def __len__(self) -> int:
        return len(self.ids)

    def find(self, piece: str) -> int | None:
        """The index of the last token of `piece`'s first occurrence, or None."""
        start = self.text.find(piece)
        if start < 0 or not piece:
            return None
        end = start + len(piece)
        last = None
        for i, (a, b) in enumerate(self.offsets):
            if b > a and a < end and b > start:
                last = i
        return last

    def cut(self, piece: str) -> list[int]:
        """The tokens `piece`'s first occurrence covers only in part (a token's own whitespace aside)."""
        start = self.text.find(piece)
        if start < 0 or not piece:
            return []
        end = start + len(piece)
        return [i for i, (a, b) in enumerate(self.offsets)
                if b > a and a < end and b > start and (self.text[a:start].strip() or self.text[end:b].strip())]

    def unknown(self, unk_id: int | None) -> list[int]:
        """The positions the tokenizer could only read as its unknown token."""
        return [] if unk_id is None else [i for i, t in enumerate(self.ids) if t == unk_id]


def tokenize(spec: ModelSpec, text: str) -> PromptTokens:
    """Tokenize a prompt with character offsets (from the tokenizer, else by decoding)."""
    tok = spec.tokenizer
    if tok is None:
        raise DeltaResolveError(f"the model {spec.model_id!r} has no tokenizer, so positions cannot be resolved")
    ids = tuple(int(i) for i in spec.token_ids(text))
    offsets: tuple[tuple[int, int], ...] | None = None
    try:
        enc = tok(text, return_offsets_mapping=True)
        if tuple(enc["input_ids"]) == ids:
            offsets = tuple((int(a), int(b)) for a, b in enc["offset_mapping"])
    except (NotImplementedError, TypeError, ValueError, KeyError):
        offsets = None
    if offsets is None:
        offsets = _decoded_offsets(tok, ids)
    return PromptTokens(text, ids, offsets, decoded(tok, ids))


def decoded(tokenizer: Any, ids: Sequence[int]) -> tuple[str, ...]:
    """Each token's text decoded alone (' Tower'), as every message and table shows tokens (`display.token`)."""
    return tuple(str(tokenizer.decode([int(i)])) for i in ids)


def _decoded_offsets(tok: Any, ids: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Offsets for tokenizers without an offset mapping: decode growing prefixes."""
    out: list[tuple[int, int]] = []
    prev = 0
    for i in range(len(ids)):
        end = len(tok.decode(list(ids[: i + 1]), skip_special_tokens=True))
        out.append((prev, end))
        prev = end
    return tuple(out)


def token_id(spec: ModelSpec, text: str) -> list[int]:
    """The ids `text` tokenizes to on its own, without special tokens."""
    return [int(i) for i in spec.tokenizer(text, add_special_tokens=False)["input_ids"]]


def spaced_twin(spec: ModelSpec, text: str, ids: Sequence[int]) -> int | None:
    """The one token of `" " + text` where `text`, an answer of one token `ids`, has no leading space and the
    same word after a space is another single token ('Paris' -> ' Paris'); None otherwise (a tokenizer that
    spells the space as a token of its own, or one that adds it itself, has no twin)."""
    if len(ids) != 1 or not text or text[0].isspace():
        return None
    twin = token_id(spec, " " + text)
    return twin[0] if len(twin) == 1 and twin[0] != ids[0] else None
