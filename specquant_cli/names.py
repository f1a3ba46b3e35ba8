"""Names the whole program shares, as types: tiers, logits modes, finish reasons, token sources.
Family roles have their own module: family.roles."""

from __future__ import annotations

from typing import Literal, get_args

Tier = Literal["low", "medium", "high"]
TIERS: tuple[str, ...] = get_args(Tier)

LogitsMode = Literal["last", "all", "none"]  # which rows of a decoded batch keep logits

FinishReason = Literal["stop", "length", "interrupted"]

# Where a generated token came from: a model draft the parent accepted, a draft-free (suffix / n-gram) draft it
# accepted, or the parent's own token (a correction or the bonus token, or every token without a drafter).
Source = Literal["draft", "suffix", "parent"]
SOURCES: tuple[str, ...] = get_args(Source)
