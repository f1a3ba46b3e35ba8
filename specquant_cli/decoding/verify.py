"""Verifiers: the parent scores a draft in one batch and decides which tokens to keep.

`LinearVerifier` scores one candidate sequence (seq[-1] + draft) with a logits row per token: greedy keeps
the longest prefix where the parent's argmax equals the draft; sampling keeps the drafted tokens the parent
samples itself at their positions (decoding.sampling.coupled_verify). A tree verifier (several candidates in
one call, through `Context.decode_at` with several sequence ids) would be one more class here."""

from __future__ import annotations

from collections.abc import Sequence

from specquant_cli.decoding.protocols import Draft, TokenContext
from specquant_cli.decoding.sampling import (
    Noise,
    SamplingParams,
    coupled_verify,
    greedy_token,
    greedy_verify,
    probs,
)


class LinearVerifier:
    def __init__(self, sp: SamplingParams, noise: Noise):
        self.sp = sp
        self.noise = noise

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
            else:  # the token at position len(seq) + j is sampled with that position's noise
                accepted, nxt = coupled_verify(lambda j: probs(parent.logits(j), self.sp), draft.tokens,
                                               lambda j, n: self.noise.at(len(seq) + j, n))
        finally:
            parent.rewind(base + 1 + accepted)  # keep seq[-1] and the accepted draft tokens
        return accepted, nxt
