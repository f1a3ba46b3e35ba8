"""Verifiers: the parent scores a draft in one batch and decides which tokens to keep.

`LinearVerifier` scores one candidate sequence (seq[-1] + draft) with a logits row per token: greedy keeps
the longest prefix where the parent's argmax equals the draft; sampling uses speculative sampling with the
residual step. A tree verifier (several candidates in one call, through `Context.decode_at` with several
sequence ids) would be one more class here."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specquant_cli.decoding.protocols import Draft, TokenContext
from specquant_cli.decoding.sampling import (
    SamplingParams,
    greedy_token,
    greedy_verify,
    one_hot,
    probs,
    speculative_verify,
)


class LinearVerifier:
    def __init__(self, sp: SamplingParams, rng: np.random.Generator):
        self.sp = sp
        self.rng = rng

    def verify(self, parent: TokenContext, seq: Sequence[int], draft: Draft) -> tuple[int, int]:
        """(accepted, next token). The parent's cache ends holding seq + the accepted draft tokens, less the
        next token; the rewind sits in `finally` so an interruption leaves a consistent record."""
        base = len(seq) - 1
        accepted = 0
        try:
            parent.rewind(base)
            if parent.n_past != base:  # e.g. after an interruption: re-sync from the prefix cache
                parent.sync(seq[:-1], logits="none")
            parent.decode([seq[-1]] + draft.tokens, logits="all" if draft.tokens else "last")
            if self.sp.greedy:
                accepted, nxt = greedy_verify(lambda j: greedy_token(parent.logits(j)), draft.tokens)
            else:
                n_vocab = parent.model.n_vocab
                q = draft.q or [one_hot(n_vocab, t) for t in draft.tokens]
                accepted, nxt = speculative_verify(lambda j: probs(parent.logits(j), self.sp), q,
                                                   draft.tokens, self.rng)
        finally:
            parent.rewind(base + 1 + accepted)  # keep seq[-1] and the accepted draft tokens
        return accepted, nxt
