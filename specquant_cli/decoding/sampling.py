"""Greedy / temperature / top-k / top-p, and the acceptance rules.

Sampling is keyed by position: the token at sequence position t is the inverse-CDF sample of the parent's
distribution p_t at the uniform number `Uniforms.at(t)`, which depends only on the seed and t. Verifying a
sampled draft is then plain: a drafted token is kept when it is the token the parent samples there
(`coupled_verify`). The answer is exactly the parent's own sampled answer for that seed — the same under
every policy, whichever tokens a drafter proposed (or none), and however many numbers were drawn before. A
model draft samples its tokens from q with the same numbers, so where q is close to p it proposes the token
the parent will sample (coupled sampling)."""

from __future__ import annotations

import secrets
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

    def uniforms(self) -> Uniforms:
        """The numbers an answer is sampled with: this seed's, or a fresh random seed's."""
        return Uniforms(self.seed if self.seed is not None else secrets.randbits(64))


@dataclass(frozen=True)
class Uniforms:
    """One uniform number in [0, 1) per sequence position, from the seed and the position alone."""

    seed: int

    def at(self, position: int) -> float:
        return float(np.random.default_rng((self.seed, position)).random())


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


def sample(p: np.ndarray, u: float) -> int:
    """The inverse-CDF sample of `p` at the uniform number `u` (a token of non-zero probability)."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, u * c[-1], side="right"), p.shape[0] - 1))


def greedy_verify(parent_argmax, draft: Sequence[int]) -> tuple[int, int]:
    """(accepted count, next token): longest prefix where the parent's argmax equals the draft, then the
    parent's own token at the first mismatch, or its bonus token after a full accept.

    `parent_argmax(j)` is the parent's argmax after the first j drafted tokens."""
    for j, d in enumerate(draft):
        t = parent_argmax(j)
        if t != d:
            return j, t
    return len(draft), parent_argmax(len(draft))


def coupled_verify(p_rows, draft: Sequence[int], u) -> tuple[int, int]:
    """(accepted count, next token) when sampling: the parent samples each position (`p_rows(j)`, its
    distribution after j drafted tokens, at the uniform number `u(j)`); a drafted token is kept while it is the
    parent's sample, and the first sample that differs (or the one after a full accept) is the next token.
    The tokens are the parent's samples whatever was drafted: exactly its distribution, and its answer."""
    for j, d in enumerate(draft):
        t = sample(p_rows(j), u(j))
        if t != d:
            return j, t
    return len(draft), sample(p_rows(len(draft)), u(len(draft)))
