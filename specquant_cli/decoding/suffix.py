"""Suffix drafting (after SuffixDecoding): match the longest suffix of the context against everything this
drafter has seen — the prompt, the answer so far, and earlier prompts and answers of the session — and
propose the continuation most occurrences agree on. Costs no model call.

The index maps every k-gram (k in 2..MAX_K) of a flat token store to the positions that follow it; the
match is then extended backwards to its true length. Draft length is chosen per draft from the cost of a
parent call of that size and the acceptance measured for matches of that length (the feedback hook), so
a long copy run gets a long draft and a weak match a short one or none."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Optional

from specquant_cli.decoding.drafters import DrafterBase
from specquant_cli.decoding.gamma import SUFFIX_GAMMA_MAX, Acceptance, best_draft_length, expected_tokens, verify_shape
from specquant_cli.decoding.protocols import CycleOutcome, Draft

MAX_K = 8  # longest indexed k-gram; longer matches are measured by extending backwards
MIN_MATCH = 3  # shorter matches do not draft: a 2-token coincidence is wrong more often than not
MAX_EXTEND = 64  # backward extension limit when measuring a match
MAX_CANDIDATES = 64  # most recent occurrences considered
MAX_STORE = 1 << 20  # tokens kept across requests (oldest dropped first)
SEP = -1  # between documents in the store: no k-gram crosses it
# Per-token acceptance priors by match length bucket, before feedback arrives (decayed counts).
BUCKETS = (3, 4, 6, 9, 17)
PRIOR_ALPHA = (0.45, 0.55, 0.65, 0.75, 0.85)
PRIOR_WEIGHT = 4.0
DECAY = 0.9


def _bucket(match_len: int) -> int:
    return max(i for i, b in enumerate(BUCKETS) if match_len >= b)


class SuffixDrafter(DrafterBase):
    name = "suffix"
    source = "suffix"

    def __init__(self, gamma_max: int = SUFFIX_GAMMA_MAX, verify_cost: Optional[Callable[[int], float]] = None,
                 min_prob: float = 0.3):
        self.gamma_max = gamma_max
        self.verify_cost = verify_cost or verify_shape  # relative cost of a parent call on n tokens
        self.min_prob = min_prob
        self.store: list[int] = []
        self.index: dict[tuple, list[int]] = defaultdict(list)
        self._doc_start = 0  # where the current sequence starts in the store
        self._doc_len = 0  # how much of the current sequence is stored
        self.acceptance = [Acceptance(a, PRIOR_WEIGHT, DECAY) for a in PRIOR_ALPHA]  # per match-length bucket
        self._last_bucket: Optional[int] = None

    # -- the store ------------------------------------------------------------------------------
    def prepare(self, seq: Sequence[int]) -> None:
        self._new_doc()
        self._extend(seq)
        return None

    def _new_doc(self) -> None:
        if len(self.store) > MAX_STORE:
            self._rebuild(self.store[-MAX_STORE // 2:])
        self.store.append(SEP)
        self._doc_start, self._doc_len = len(self.store), 0

    def _rebuild(self, tokens: list[int]) -> None:
        self.store, self.index = [], defaultdict(list)
        for t in tokens:
            self._push(t)

    def _push(self, t: int) -> None:
        store = self.store
        store.append(t)
        n = len(store)
        for k in range(2, MAX_K + 1):
            if n - k - 1 < -1:
                break
            gram = tuple(store[n - k:n - 1]) if k > 1 else ()
            if SEP in gram:
                break
            # k-gram of (k-1) tokens ending before t, mapped to the position of t: "what followed"
            self.index[gram].append(n - 1)

    def _extend(self, seq: Sequence[int]) -> None:
        """Append the part of `seq` not stored yet; a sequence that is not a continuation starts a new doc.
        Runs once per draft cycle: within a generation `seq` only grows (prepare starts each generation),
        so the last stored token is checked instead of the whole prefix."""
        n = self._doc_len
        if n > len(seq) or (n and seq[n - 1] != self.store[self._doc_start + n - 1]):
            self._new_doc()
        for t in seq[self._doc_len:]:
            self._push(int(t))
        self._doc_len = len(seq)

    # -- drafting -------------------------------------------------------------------------------
    def _match(self, seq: Sequence[int]) -> tuple[int, list[int]]:
        """(match length, positions that followed it), longest match first, most recent first."""
        end = len(self.store)  # the current sequence's own tail has nothing after it
        for k in range(min(MAX_K, len(seq) + 1), 2, -1):
            hits = [p for p in self.index.get(tuple(seq[len(seq) - (k - 1):]), ()) if p < end][-MAX_CANDIDATES:]
            if not hits:
                continue
            lens = [self._extend_back(seq, p, k - 1) for p in hits]
            best = max(lens)
            return best, [p for p, n in zip(hits, lens) if n == best]
        return 0, []

    def _extend_back(self, seq: Sequence[int], pos: int, n: int) -> int:
        store, i = self.store, n
        while i < MAX_EXTEND and i < len(seq) and pos - i - 1 >= 0 and store[pos - i - 1] == seq[-i - 1]:
            i += 1
        return i

    def _walk(self, cands: list[int], limit: int) -> list[int]:
        """Follow the continuation most candidates agree on, while its estimated probability holds."""
        out, prob, store = [], 1.0, self.store
        for step in range(limit):
            nxt = Counter(store[p + step] for p in cands if p + step < len(store) and store[p + step] != SEP)
            if not nxt:
                break
            tok, c = nxt.most_common(1)[0]
            prob *= c / len(cands)
            if prob < self.min_prob:
                break
            out.append(tok)
            cands = [p for p in cands if p + step < len(store) and store[p + step] == tok]
        return out

    def _best_length(self, alpha: float, available: int, n: int) -> int:
        """The draft length worth its parent call: no draft model, so the cost is the verify call alone."""
        return best_draft_length(lambda gamma: expected_tokens(alpha, gamma) / self.verify_cost(gamma + 1),
                                 min(n, available))[0]

    def propose(self, seq: Sequence[int], n: int, sp=None, uniforms=None) -> Draft:
        self._extend(seq)
        self._last_bucket = None
        if n <= 0:
            return Draft()
        match_len, cands = self._match(seq)
        if match_len < MIN_MATCH:
            return Draft()
        tokens = self._walk(cands, min(n, self.gamma_max))
        b = _bucket(match_len)
        g = self._best_length(self.acceptance[b].alpha, len(tokens), n)
        if g == 0:
            return Draft()
        self._last_bucket = b
        return Draft(tokens[:g])

    def feedback(self, seq: Sequence[int], outcome: CycleOutcome) -> None:
        if self._last_bucket is not None:
            self.acceptance[self._last_bucket].observe(outcome.accepted, outcome.proposed)
