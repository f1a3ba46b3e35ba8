"""Greedy / temperature / top-k / top-p, and the speculative acceptance rules.

The same `probs` transform is applied to the parent's logits (p) and the draft's (q), which is what makes
speculative sampling lossless: accept a drafted token with probability min(1, p/q), otherwise sample from
normalize(max(0, p - q)); after a full accept the bonus token comes from p."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

# Temperatures are floored here so that T -> 0 with sampling on stays finite (it approaches argmax).
MIN_TEMPERATURE = 1e-6
# top-p first looks for its nucleus among this many highest logits (argpartition, no full sort); only
# when their mass stays below top_p does it sort the whole vocabulary.
TOP_P_CANDIDATES = 2048


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


GREEDY = SamplingParams()


def greedy_token(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def probs(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """Full-vocabulary distribution after temperature, top-k and top-p (float64, sums to 1)."""
    x = np.asarray(logits, dtype=np.float64) / max(sp.temperature, MIN_TEMPERATURE)
    n = x.shape[0]
    keep: Optional[np.ndarray] = None
    if 0 < sp.top_k < n:
        keep = np.argpartition(x, n - sp.top_k)[n - sp.top_k:]
    if sp.top_p < 1.0:
        m = min(n, TOP_P_CANDIDATES)
        cand = keep if keep is not None else np.argpartition(x, n - m)[n - m:]
        cand = cand[np.argsort(-x[cand], kind="stable")]
        e = np.exp(x[cand] - x[cand[0]])
        # Why two normalisers: after top-k the nucleus is taken within the top-k distribution (the k
        # kept tokens sum to 1, as llama.cpp's and mlx's chains do); without top-k, over the full vocabulary.
        full = e.sum() if keep is not None else np.exp(x - x[cand[0]]).sum()
        cum = np.cumsum(e) / full
        if keep is None and cum[-1] < sp.top_p:  # rare: mass spread beyond 2048 candidates
            cand = np.argsort(-x, kind="stable")
            e = np.exp(x[cand] - x[cand[0]])
            cum = np.cumsum(e) / e.sum()
        cut = int(np.searchsorted(cum, sp.top_p)) + 1
        keep = cand[:cut]
    if keep is not None:
        out = np.zeros(n)
        e = np.exp(x[keep] - x[keep].max())
        out[keep] = e / e.sum()
        return out
    e = np.exp(x - x.max())
    return e / e.sum()


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), p.shape[0] - 1))


def greedy_verify(parent_argmax, draft: Sequence[int]) -> tuple[int, int]:
    """(accepted count, next token): longest prefix where the parent's argmax equals the draft, then the
    parent's own token at the first mismatch, or its bonus token after a full accept.

    `parent_argmax(j)` is the parent's argmax after the first j drafted tokens."""
    for j, d in enumerate(draft):
        t = parent_argmax(j)
        if t != d:
            return j, t
    return len(draft), parent_argmax(len(draft))


def speculative_verify(p_rows, q_rows: Sequence[np.ndarray], draft: Sequence[int],
                       rng: np.random.Generator) -> tuple[int, int]:
    """(accepted count, next token) by speculative sampling. `p_rows(j)` is the parent's distribution
    after j drafted tokens; q_rows[j] the draft's distribution it sampled draft[j] from."""
    for j, d in enumerate(draft):
        p, q = p_rows(j), q_rows[j]
        if q[d] > 0 and rng.random() < min(1.0, p[d] / q[d]):
            continue
        residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        # Why fall back to p: the residual is all zero only when p == q (up to rounding), and then a
        # rejection has probability ~0 anyway; sampling p keeps the output distribution p.
        return j, sample(residual / total if total > 0 else p, rng)
    return len(draft), sample(p_rows(len(draft)), rng)


def one_hot(n: int, token: int) -> np.ndarray:
    q = np.zeros(n)
    q[token] = 1.0
    return q
