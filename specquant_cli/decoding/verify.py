"""Verifiers: the parent scores a draft in one batch and decides which tokens to keep.

`LinearVerifier` scores one candidate sequence (seq[-1] + draft) with a logits row per token and walks it:
at each position the parent picks its own token (greedy: its argmax; sampling: its sample with that position's
noise, decoding.sampling), a drafted token is kept while it is the parent's pick, and the first pick that differs
(or the one after a full accept) is the next token. The tokens are the parent's whatever was drafted. Under a
grammar (`constraint`, decoding.grammar) the parent picks among the tokens the grammar allows at each position, so
the answer is the constrained parent's own. With `top_logprobs` set it also records, for each token it keeps, the
parent's log-probability and its most likely alternatives (`logprobs`), from the parent's own raw logits.
A tree verifier (several candidates in one call, through `Context.decode_at` with several sequence ids) would be
one more class here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from specquant_cli.decoding.protocols import Constraint, Draft, TokenContext
from specquant_cli.decoding.sampling import Noise, SamplingParams, greedy_token, probs, sample, walk


@dataclass(frozen=True)
class TokenLogprob:
    """The parent's log-probability of a token it produced, and its `top` alternatives [(token, logprob)]."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    """From the parent's raw logits `row` (no temperature, no mask): log-softmax at `token` and the `top` best."""
    x = np.asarray(row, dtype=np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    best = ()
    if top > 0:
        idx = np.argpartition(-x, top - 1)[:top]
        idx = idx[np.argsort(-x[idx], kind="stable")]
        best = tuple((int(i), float(x[i] - lse)) for i in idx)
    return TokenLogprob(token, float(x[token] - lse), best)


class LinearVerifier:
    def __init__(self, sp: SamplingParams, noise: Noise, constraint: Optional[Constraint] = None,
                 top_logprobs: Optional[int] = None):
        self.sp = sp
        self.noise = noise
        self.constraint = constraint
        self.top_logprobs = top_logprobs  # None: no log-probabilities recorded
        self.logprobs: list[TokenLogprob] = []  # of the tokens the last `verify` produced

    def verify(self, parent: TokenContext, seq: Sequence[int], draft: Draft) -> tuple[int, int]:
        """(accepted, next token). The parent's cache ends holding seq + the accepted draft tokens, less the
        next token; the rewind sits in `finally` so an interruption leaves a consistent record."""
        base = len(seq) - 1
        accepted = 0
        self.logprobs = []
        try:
            parent.rewind(base)
            if parent.n_past != base:  # e.g. after an interruption: re-sync from the prefix cache
                parent.sync(seq[:-1], logits="none")
            parent.decode([seq[-1]] + draft.tokens, logits="all" if draft.tokens else "last")
            accepted, nxt = walk(lambda j: self._pick(parent.logits(j), len(seq) + j), draft.tokens)
        finally:
            parent.rewind(base + 1 + accepted)  # keep seq[-1] and the accepted draft tokens
        return accepted, nxt

    def _pick(self, row: np.ndarray, position: int) -> int:
        """The parent's token at `position` from its logits `row` (masked by the grammar, which then consumes it)."""
        c = self.constraint
        x = c.masked(row) if c is not None else row
        if self.sp.greedy:
            t = greedy_token(x)
        else:  # the token at `position` is sampled with that position's noise
            p = probs(x, self.sp)
            t = sample(p, self.noise.at(position, p.shape[0]))
        if c is not None:
            c.consume(t)
        if self.top_logprobs is not None:
            self.logprobs.append(token_logprob(row, t, self.top_logprobs))
        return t
