"""Suffix drafting (after SuffixDecoding): match the longest suffix of the context against everything the
drafting memory holds — the prompt, the answer so far, and earlier prompts and answers of the session or of
every request of a server (decoding.memory.DraftMemory) — and propose the continuation most occurrences agree
on. Costs no model call.

Draft length is chosen per draft from the cost of a call of that size (the parent's, or the draft model's
when this drafter drafts for a draft: a second level) and the acceptance measured for matches of that
length (the feedback hook), so a long copy run gets a long draft and a weak match a short one or none."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

from specquant_cli.decoding.drafters import DrafterBase
from specquant_cli.decoding.gamma import SUFFIX_GAMMA_MAX, Acceptance, best_draft_length, expected_tokens, verify_shape
from specquant_cli.decoding.memory import MAX_EXTEND, DraftMemory, Recorder
from specquant_cli.decoding.protocols import CycleOutcome, Draft, verified

MIN_MATCH = 3  # shorter matches do not draft: a 2-token coincidence is wrong more often than not
# Per-token acceptance priors by match length bucket, before feedback arrives (decayed counts).
BUCKETS = (3, 4, 6, 9, 17)
PRIOR_ALPHA = (0.45, 0.55, 0.65, 0.75, 0.85)
PRIOR_WEIGHT = 4.0
DECAY = 0.9


def _bucket(match_len: int) -> int:
    return max(i for i, b in enumerate(BUCKETS) if match_len >= b)


class SuffixDrafter(DrafterBase):
    """`memory`: the drafting memory it reads (a private one when not given); `record`: whether it writes the
    sequences it drafts for into it (a second-level drafter reads a memory the first level writes);
    `verify_cost`: a call on n tokens relative to one, of the model that verifies its drafts."""

    name = "suffix"
    source = "suffix"

    def __init__(self, gamma_max: int = SUFFIX_GAMMA_MAX, verify_cost: Optional[Callable[[int], float]] = None,
                 min_prob: float = 0.3, memory: Optional[DraftMemory] = None, record: bool = True):
        self.gamma_max = gamma_max
        self.verify_cost = verify_cost or verify_shape
        self.min_prob = min_prob
        self.memory = memory if memory is not None else DraftMemory()
        self.recorder = Recorder(self.memory) if record else None
        self.acceptance = [Acceptance(a, PRIOR_WEIGHT, DECAY) for a in PRIOR_ALPHA]  # per match-length bucket
        self._last_bucket: Optional[int] = None

    def prepare(self, seq: Sequence[int]) -> None:
        if self.recorder is not None:
            self.recorder.start(seq)
        return None

    def remember(self, seq: Sequence[int]) -> None:
        """Write the verified sequence `seq` (a continuation of the last, or a new document)."""
        if self.recorder is not None:
            self.recorder.record(seq)

    def _best_length(self, alpha: float, available: int, n: int) -> int:
        """The draft length worth its verifying call: no draft model, so the cost is that call alone."""
        return best_draft_length(lambda gamma: expected_tokens(alpha, gamma) / self.verify_cost(gamma + 1),
                                 min(n, available))[0]

    def propose(self, seq: Sequence[int], n: int, sp=None, noise=None) -> Draft:
        self.remember(verified(seq))  # a grammar's forced tokens at its end are drafted after, not remembered
        return self.lookup(seq, n)

    def propose_after(self, seq: Sequence[int], out: list[int], room: int, sp=None, noise=None) -> list[int]:
        """As a lower level (protocols.Level): up to `room` tokens after seq + out, reading only the tail (a match
        extends at most MAX_EXTEND tokens back)."""
        return self.lookup(list(seq[-MAX_EXTEND:]) + out, room).tokens

    def lookup(self, seq: Sequence[int], n: int) -> Draft:
        """Up to n tokens after `seq` from the memory, writing nothing (`seq` may end in unverified drafts)."""
        self._last_bucket = None
        if n <= 0:
            return Draft()
        match_len, cands = self.memory.match(seq)
        if match_len < MIN_MATCH:
            return Draft()
        tokens = self.memory.walk(cands, min(n, self.gamma_max), self.min_prob)
        b = _bucket(match_len)
        g = self._best_length(self.acceptance[b].alpha, len(tokens), n)
        if g == 0:
            return Draft()
        self._last_bucket = b
        return Draft(tokens[:g])

    def feedback(self, seq: Sequence[int], outcome: CycleOutcome) -> None:
        if self._last_bucket is not None:
            self.acceptance[self._last_bucket].observe(outcome.accepted, outcome.proposed)
