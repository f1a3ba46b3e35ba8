"""Names the whole program shares, as types: tiers, family roles, logits modes, finish reasons."""

from __future__ import annotations

import re
from typing import Literal, get_args

Tier = Literal["low", "medium", "high"]
TIERS: tuple[str, ...] = get_args(Tier)

# Family roles are open (quantize can add any), these are the ones the built-in policies know.
Role = str
PARENT_ROLE: Role = "f16"
ROLE_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")  # what `quantize --role NAME` accepts

LogitsMode = Literal["last", "all", "none"]  # which rows of a decoded batch keep logits

FinishReason = Literal["stop", "length", "interrupted"]

# Where a generated token came from: a model draft the parent accepted, a draft-free (suffix / n-gram) draft it
# accepted, or the parent's own token (a correction or the bonus token, or every token without a drafter).
Source = Literal["draft", "suffix", "parent"]
SOURCES: tuple[str, ...] = get_args(Source)
