"""Greedy / temperature / top-k / top-p, and the acceptance rules.

Sampling is keyed by position and token (Gumbel-max): the token at sequence position t is the argmax over the
parent's candidates i of log p_t(i) + g(t, i), where g is Gumbel noise drawn from the seed, t and i alone
(`Noise.at`). That is an exact sample of p_t, and it is as steady as greedy decoding: the answer changes only
where two candidates' perturbed scores lie within the logits' own rounding of each other (a batch of another
shape computes the last digits differently). An inverse-CDF walk over the vocabulary in token-id order would move
with the smallest change of any token's probability; this does not.

Verifying a sampled draft is then plain: a drafted token is kept when it is the token the parent samples there
(`coupled_verify`). The answer is the parent's own sampled answer for that seed — the same under every policy,
whichever tokens a drafter proposed (or none), however many requests share the batch. A model draft samples its
tokens from q with the same noise, so where q is close to p it proposes the token the parent will sample (coupled
sampling)."""

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

    def noise(self) -> Noise:
        """The noise an answer is sampled with: this seed's, or a fresh random seed's."""
        return Noise(self.seed if self.seed is not None else secrets.randbits(64))


class Noise:
    """Gumbel noise per sequence position and token, from the seed, the position and the token id alone. The
    last few positions' vectors are kept: a model draft and the parent's verification sample the same ones."""

    KEEP = 16  # positions kept (a draft's length and its verification)

    def __init__(self, seed: int):
        self.seed = seed
        self._kept: dict[tuple[int, int], np.ndarray] = {}

    def at(self, position: int, n: int) -> np.ndarray:
        """g(position, i) for the tokens i < n: -log(-log(U)), U uniform in (0, 1)."""
        key = (position, n)
        g = self._kept.get(key)
        if g is None:
            u = np.random.default_rng((self.seed, position)).random(n)
            g = -np.log(-np.log1p(-u))  # 1 - u lies in (0, 1]: log1p(-u) < 0 except at u = 0 (g = -inf: never wins)
            if len(self._kept) >= self.KEEP:
                self._kept.pop(next(iter(self._kept)))
            self._kept[key] = g
        return g

    def __eq__(self, other) -> bool:
        return isinstance(other, Noise) and other.seed == self.seed

    def __hash__(self) -> int:
        return hash(self.seed)

    def __repr__(self) -> str:
        return f"Noise({self.seed})"


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


def scores(p: np.ndarray, g: np.ndarray) -> np.ndarray:
    """The perturbed scores log p(i) + g(i) (-inf where p is 0): their argmax is the sample."""
    with np.errstate(divide="ignore"):
        return np.log(p) + g


def sample(p: np.ndarray, g: np.ndarray) -> int:
    """The Gumbel-max sample of `p` with the noise `g` (Noise.at): a token of non-zero probability."""
    return int(np.argmax(scores(p, g)))


def sample_margin(p: np.ndarray, g: np.ndarray) -> tuple[int, float]:
    """The sample and how far its perturbed score lies above the next one (log units): a flip between batch
    shapes needs the logits to move by about this much."""
    s = scores(p, g)
    top2 = np.argpartition(s, -2)[-2:] if s.shape[0] > 1 else np.array([0, 0])
    a, b = sorted(top2, key=lambda i: -s[i])
    return int(a), float(s[a] - s[b])


def walk(pick, draft: Sequence[int]) -> tuple[int, int]:
    """(accepted count, next token): `pick(j)` is the parent's token after the first j drafted tokens (its argmax,
    or its sample), asked once per position in order; drafted tokens are kept while they are its picks, and its
    pick at the first mismatch (or after a full accept) is the next token."""
    for j, d in enumerate(draft):
        t = pick(j)
        if t != d:
            return j, t
    return len(draft), pick(len(draft))


def coupled_verify(p_rows, draft: Sequence[int], noise) -> tuple[int, int]:
    """(accepted count, next token) when sampling: the parent samples each position (`p_rows(j)`, its
    distribution after j drafted tokens, with the noise `noise(j, n)` of that position); a drafted token is kept
    while it is the parent's sample, and the first sample that differs (or the one after a full accept) is the
    next token. The tokens are the parent's samples whatever was drafted: exactly its distribution, and its
    answer."""

    def pick(j: int) -> int:
        p = p_rows(j)
        return sample(p, noise(j, p.shape[0]))

    return walk(pick, draft)
