"""transformers 5.24: as 5.21 (`v5_21`), a forward's cache keyword renamed `cache` (`past_key_values` deprecated)."""

from __future__ import annotations

from .v5_21 import count_tokens, kernel_function

CACHE_KEYWORD = "cache"
