"""The accept/reject loop. Yields one TokenEvent per token the parent would have produced.

Invariant between cycles: the parent's KV cache holds every token of `seq` except the last one, which
is fed as the first token of the next verification batch. Both contexts keep `tokens == KV contents`,
so an interrupted cycle is repaired by the next prefix sync; the rewind after verifying sits in `finally`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence


from specquant_cli.drafters import Draft, Drafter
from specquant_cli.errors import InputError
from specquant_cli.gamma import FixedGamma
from specquant_cli.llama import Context
from specquant_cli.sampling import GREEDY, SamplingParams, greedy_token, greedy_verify, one_hot, probs, \
    speculative_verify


@dataclass
class TokenEvent:
    token: int
    from_draft: bool  # proposed by the drafter and accepted by the parent
    eog: bool = False


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually decoded (the rest came from the prefix cache)
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    parent_calls: int = 0
    cycles_with_draft: int = 0
    prefill_s: float = 0.0  # parent and draft prefill
    draft_s: float = 0.0
    verify_s: float = 0.0


class Engine:
    def __init__(self, parent: Context, drafter: Optional[Drafter] = None, gamma=None,
                 sampling: SamplingParams = GREEDY):
        self.parent = parent
        self.drafter = drafter
        self.gamma = gamma if gamma is not None else FixedGamma(4 if drafter else 0)
        self.sp = sampling
        self.rng = sampling.rng()
        self.stats = EngineStats()
        self.eog_ids = parent.model.eog_ids

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        n_ctx = self.parent.n_ctx
        drafter_ctx = getattr(self.drafter, "ctx", None)
        if drafter_ctx is not None:
            n_ctx = min(n_ctx, drafter_ctx.n_ctx)
        if n_prompt == 0:
            raise InputError("empty prompt")
        if n_prompt + max_tokens > n_ctx:
            raise InputError(f"prompt of {n_prompt} tokens + max_tokens {max_tokens} exceeds the context "
                             f"size {n_ctx}; shorten the prompt or lower --max-tokens")

    def generate(self, prompt: Sequence[int], max_tokens: int) -> Iterator[TokenEvent]:
        self.check_fits(len(prompt), max_tokens)
        st = self.stats = EngineStats(prompt_tokens=len(prompt))
        seq = list(prompt)
        t0 = time.perf_counter()
        st.prefill_tokens = self.parent.sync(seq[:-1], logits="none")
        if self.drafter is not None and hasattr(self.drafter, "prepare"):
            self.drafter.prepare(seq)
        st.prefill_s = time.perf_counter() - t0
        while st.new_tokens < max_tokens:
            room = max_tokens - st.new_tokens - 1  # the cycle's own token always fits
            g = min(self.gamma.next(), room) if self.drafter else 0
            draft = self._draft(seq, g)
            accepted, nxt, v_s = self._verify(seq, draft)
            self.gamma.update(len(draft.tokens), accepted, self._last_draft_s, v_s, len(draft.tokens) + 1)
            for i, tok in enumerate(draft.tokens[:accepted] + [nxt]):
                seq.append(tok)
                st.new_tokens += 1
                eog = tok in self.eog_ids
                yield TokenEvent(tok, from_draft=i < accepted, eog=eog)
                if eog:
                    return

    def _draft(self, seq: list[int], g: int) -> Draft:
        self._last_draft_s = 0.0
        if g <= 0:
            return Draft()
        t0 = time.perf_counter()
        draft = self.drafter.propose(seq, g, self.sp, self.rng)
        self._last_draft_s = time.perf_counter() - t0
        st = self.stats
        st.draft_s += self._last_draft_s
        st.drafted += len(draft.tokens)
        st.cycles_with_draft += bool(draft.tokens)
        return draft

    def _verify(self, seq: list[int], draft: Draft) -> tuple[int, int, float]:
        """Score seq[-1] + draft in one parent call; return (accepted, next token, seconds)."""
        parent, st = self.parent, self.stats
        t0 = time.perf_counter()
        base = len(seq) - 1
        accepted = 0
        try:
            parent.rewind(base)
            if parent.n_past != base:  # e.g. after an interruption: re-sync from the prefix cache
                parent.sync(seq[:-1], logits="none")
            parent.decode([seq[-1]] + draft.tokens, logits="all" if draft.tokens else "last")
            st.parent_calls += 1
            if self.sp.greedy:
                accepted, nxt = greedy_verify(lambda j: greedy_token(parent.logits(j)), draft.tokens)
            else:
                n_vocab = parent.model.n_vocab
                q = draft.q or [one_hot(n_vocab, t) for t in draft.tokens]
                accepted, nxt = speculative_verify(lambda j: probs(parent.logits(j), self.sp), q,
                                                   draft.tokens, self.rng)
        finally:
            parent.rewind(base + 1 + accepted)  # keep seq[-1] and the accepted draft tokens
        st.accepted += accepted
        dt = time.perf_counter() - t0
        st.verify_s += dt
        return accepted, nxt, dt
