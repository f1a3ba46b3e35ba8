"""Names the whole program shares: as types, tiers, logits modes, finish reasons, token sources; and the files a
family folder reserves (family.manifest writes them; the llama.cpp adapter never lets its log onto one).
Family roles have their own module: family.roles."""

from __future__ import annotations

from typing import Literal, get_args

Tier = Literal["low", "medium", "high"]
TIERS: tuple[str, ...] = get_args(Tier)

LogitsMode = Literal["last", "all", "none"]  # which rows of a decoded batch keep logits

FinishReason = Literal["stop", "length", "interrupted"]

# Where a generated token came from: a model draft the parent accepted, a draft-free (suffix / n-gram) draft it
# accepted, a token a grammar forced (proposed at no draft cost) that the parent accepted, a token of the request's
# prediction (Predicted Outputs) that the parent accepted, or the parent's own token (a correction or the bonus token,
# or every token without a drafter).
Source = Literal["draft", "suffix", "grammar", "prediction", "parent"]
SOURCES: tuple[str, ...] = get_args(Source)

# A family folder's own files, besides its models: the manifest, the one a commit replaced, the commit journal,
# one that did not check out, the lock.
MANIFEST = "manifest.json"
CALIBRATION = "calibration.json"  # a family's stored calibrations (system.calibration_file)
PREV_MANIFEST = MANIFEST + ".prev"
JOURNAL = ".specquant-commit.json"
UNUSABLE_JOURNAL = JOURNAL + ".unusable"
LOCK = ".specquant.lock"
RESERVED = {MANIFEST, PREV_MANIFEST, JOURNAL, UNUSABLE_JOURNAL, LOCK, "manifest.json.unusable"}
