"""Suffix drafting (after SuffixDecoding): match the longest suffix of the context against everything the
drafting memory holds — the prompt, the answer so far, and earlier prompts and answers of the session or of
every request of a server (decoding.memory.DraftMemory) — and propose the continuation most occurrences agree
on. Costs no model call.

Draft length is chosen per draft from the cost of a call of that size (the parent's, or the draft model's
when this drafter drafts for a draft: a second level) and the acceptance measured for matches of that
length (the feedback hook), so a long copy run gets a long draft and a weak match a short one or none.

While an answer copies a document (a file in the prompt, a prediction), the drafter keeps its place in it: after a
draft the parent kept whole, it drafts on from where the copy stands (`CONTINUE`), whatever else in the memory
matches as well; where the parent departed from the document (an edit), it looks for the answer's last tokens a
little further on in the same document and drafts from there once they appear (`REJOIN`: the edit is over; right
after a departure from a copy, the parent's own token is first taken to replace the document's), rather than waiting
for a match of MIN_MATCH tokens to build up again. Each has its own measured acceptance. The edit a rejoin implies (the
document's tokens the answer replaced, and its own in their place) is learned once the parent keeps the rejoined
draft, and proposed at the document's next occurrences (decoding.copying): a rename breaks the copy once, not at every
occurrence."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

from specquant_cli.decoding.copying import Edits, Place, Step, follow
from specquant_cli.decoding.drafters import DrafterBase
from specquant_cli.decoding.fences import Count, Fences
from specquant_cli.decoding.gamma import (
    COPY_GAMMA_MAX,
    Acceptance,
    CallCost,
    best_draft_length,
    expected_tokens,
    verify_shape,
)
from specquant_cli.decoding.memory import MAX_EXTEND, DraftMemory, Recorder, offset
from specquant_cli.decoding.protocols import CycleOutcome, Draft, verified

MIN_MATCH = 3  # shorter matches do not draft: a 2-token coincidence is wrong more often than not
# Per-token acceptance priors by match length bucket, before feedback arrives (decayed counts); then those of a
# draft that continues the copy the parent kept whole (CONTINUE) and of one that rejoins it after an edit (REJOIN).
BUCKETS = (3, 4, 6, 9, 17)
PRIOR_ALPHA = (0.45, 0.55, 0.65, 0.75, 0.85, 0.9, 0.6)
CONTINUE, REJOIN = len(BUCKETS), len(BUCKETS) + 1
PRIOR_WEIGHT = 4.0
DECAY = 0.9
REJOIN_WINDOW = 32  # positions after the departure where the answer's last tokens are looked for
REJOIN_SPAN = 48  # answer tokens after a departure past which it is no edit any more (a match must find it)
# The answer's last tokens looked for after a departure from a copy in progress (a draft that continued one, or a
# match of COPY_MATCH tokens or more: an edit in a copied text, rejoined on one token), else its last two only (a
# coincidence of one token is common in prose).
COPY_MATCH = 9
COPY_TAILS = (2, 1)
# A draft is sized with the acceptance its text has earned: the tokens the answer has followed it (a match's length, or
# for a copy that goes on those held since it last departed) on RUN_WEIGHT tokens of its kind's measured acceptance (a
# copy that goes on, at the prior: 0.97 after 24 held, 0.99 after 64), so a copy that holds gets drafts of 32-64
# tokens where the parent's call-cost curve pays for them, and a kind that keeps failing stays short.
RUN_WEIGHT = 8.0


def _bucket(match_len: int) -> int:
    return max(i for i, b in enumerate(BUCKETS) if match_len >= b)


class SuffixDrafter(DrafterBase):
    """`memory`: the drafting memory it reads (a private one when not given); `record`: whether it writes the
    sequences it drafts for into it (a second-level drafter reads a memory the first level writes);
    `verify_cost`: a call on n tokens relative to one, of the model that verifies its drafts."""

    name = "suffix"
    source = "suffix"

    def __init__(self, gamma_max: int = COPY_GAMMA_MAX, verify_cost: Optional[Callable[[int], float]] = None,
                 min_prob: float = 0.3, memory: Optional[DraftMemory] = None, record: bool = True,
                 priors: Sequence[float] = PRIOR_ALPHA, fences: Optional[Fences] = None):
        self.gamma_max = gamma_max  # the engine's draft length (a plan's cap) bounds it too
        self.fences = fences  # the vocabulary's code fences: the answer's drafts stop where it closes a block
        self._fence_count = Count()  # where counting them stands in this answer
        self.verify_cost = verify_cost if isinstance(verify_cost, CallCost) else CallCost(verify_cost or verify_shape)
        self.min_prob = min_prob
        self.memory = memory if memory is not None else DraftMemory()
        self.recorder = Recorder(self.memory) if record else None
        # per kind of draft: match-length bucket, CONTINUE, REJOIN
        self.acceptance = [Acceptance(a, PRIOR_WEIGHT, DECAY) for a in priors]
        self._last: Optional[tuple[int, Optional[int], int]] = None  # (kind, packed start, len(seq)) of the draft
        # the last draft read from one place of one document, token by token (followed in feedback), and that place
        self._steps: list[Step] = []
        self._from: Optional[Place] = None
        self._cursor: Optional[tuple[Place, int]] = None  # where the copy stands, and the sequence's length then
        # (packed position, sequence length, tail lengths looked for, whether the parent's first token may have
        # replaced the document's, tokens the copy had held when it departed) of the last departure
        self._departed: Optional[tuple[int, int, tuple[int, ...], bool, int]] = None
        self._trial: Optional[tuple[list[int], list[int]]] = None  # the substitution the last rejoin implies
        self.edits = Edits()  # the substitutions this answer made in what it copies
        self._run = 0  # answer tokens the copy has held since it last departed

    @property
    def kind(self) -> Optional[int]:
        """The kind of the last draft (a match-length bucket, CONTINUE or REJOIN); None when it proposed nothing."""
        return self._last[0] if self._last is not None else None

    @property
    def start(self) -> Optional[int]:
        """The packed position the last draft was read from (None: it proposed nothing, or several agreed on it)."""
        return self._last[1] if self._last is not None else None

    def prepare(self, seq: Sequence[int]) -> None:
        if self.recorder is not None:
            self.recorder.start(seq)
        self._cursor = self._departed = self._trial = None
        self.edits, self._run, self._fence_count = Edits(), 0, Count()
        return None

    def expect(self, start: int, seq: Sequence[int], doc_tokens: Sequence[int], doc_start: int) -> None:
        """An answer that is expected to copy a document from its beginning (a prediction): `doc_start` is the packed
        position of the document's first token, `doc_tokens` its tokens, `start` where the answer begins in `seq`.
        The copy stands where the answer so far follows the document, else it departed at its first token."""
        answer = list(seq[start:])
        if answer == list(doc_tokens[:len(answer)]) and len(answer) < len(doc_tokens):
            self._cursor, self._departed = (Place(doc_start + len(answer)), len(seq)), None
        else:
            self._cursor, self._departed = None, (doc_start, start, COPY_TAILS, False, 0)

    def remember(self, seq: Sequence[int]) -> None:
        """Write the verified sequence `seq` (a continuation of the last, or a new document)."""
        if self.recorder is not None:
            self.recorder.record(seq)

    def _best_length(self, alpha: float, available: int, n: int, pos: int = 0,
                     steps: Sequence[Step] = ()) -> int:
        """The draft length worth its verifying call at context position `pos`: no draft model, so the cost is that
        call alone. Where a copy's `steps` read a substitution the answer has gone both ways on, the tokens from there
        on count with the chance that reading holds (its record): a draft is cut back where the source predicts a
        divergence, not run on through a coin toss."""
        cost = self.verify_cost.at(pos)
        top = min(n, available)
        if not any(st.doubt is not None for st in steps[:top]):
            return best_draft_length(lambda gamma: expected_tokens(alpha, gamma) / cost(gamma + 1), top)[0]
        expect, survive = [1.0], 1.0  # expected tokens of a draft of each length, and the chance its last is reached
        for i in range(top):
            st = steps[i] if i < len(steps) else None
            survive *= alpha * (self.edits.holds(st.doubt) if st is not None and st.doubt is not None else 1.0)
            expect.append(expect[-1] + survive)
        return best_draft_length(lambda gamma: expect[gamma] / cost(gamma + 1), top)[0]

    def _alpha(self, kind: int, held: int) -> float:
        """The per-token acceptance a draft of `kind` is sized with: its measured one, raised by what the text it
        copies has earned — `held` tokens the answer has followed it (the match's length; for a copy that goes on,
        those since it last departed) — with the measured acceptance counting as RUN_WEIGHT tokens."""
        alpha = self.acceptance[kind].alpha
        return (held + RUN_WEIGHT * alpha) / (held + RUN_WEIGHT)

    def offers(self, seq: Sequence[int]) -> bool:
        """A copy is on offer: one stands where `seq` ends, or a match of COPY_MATCH tokens or more (a source the
        answer repeats)."""
        if self._cursor is not None and self._cursor[1] == len(seq):
            return True
        return self.memory.match(seq)[0] >= COPY_MATCH

    def propose(self, seq: Sequence[int], n: int, sp=None, noise=None) -> Draft:
        self.remember(verified(seq))  # a grammar's forced tokens at its end are drafted after, not remembered
        return self.lookup(seq, n, track=True)

    def propose_after(self, seq: Sequence[int], out: list[int], room: int, sp=None, noise=None) -> list[int]:
        """As a lower level (protocols.Level): up to `room` tokens after seq + out, reading only the tail (a match
        extends at most MAX_EXTEND tokens back)."""
        return self.lookup(list(seq[-MAX_EXTEND:]) + out, room).tokens

    def lookup(self, seq: Sequence[int], n: int, track: bool = False) -> Draft:
        """Up to n tokens after `seq` from the memory, writing nothing (`seq` may end in unverified drafts).
        `track`: `seq` is the answer's own sequence (not a second level's), so where the copy stands is followed."""
        self._last, self._steps, self._from = None, [], None
        if n <= 0:
            return Draft()
        track = track and len(verified(seq)) == len(seq)
        found = self._find(seq, track)
        if found is None:
            return Draft()
        kind, cands, place, held = found
        limit = min(n, self.gamma_max)
        if place is not None:  # a copy: read on from where it stands, its substitutions carried forward
            steps = follow(self.memory.read(place.at, limit + self.edits.span), place, limit, self.edits)
            tokens, start = [s.token for s in steps], place.at
        else:
            survivors: list[int] = []
            tokens = self.memory.walk(cands, limit, self.min_prob, survivors)
            start = survivors[0] if track and len(survivors) == 1 else None
            place = Place(start) if start is not None else None
            steps = [Step(t, Place(start + i + 1)) for i, t in enumerate(tokens)] if start is not None else []
        if self.fences is not None and track:
            room = self.fences.room(seq, tokens, kind == CONTINUE, self._fence_count)
            tokens, steps = tokens[:room], steps[:room]
        g = self._best_length(self._alpha(kind, held), len(tokens), n, len(seq), steps)
        if g == 0:
            if kind == CONTINUE:  # the copy stands here all the same: feedback follows it through the parent's token
                self._last, self._from = (kind, start, len(seq)), place
            return Draft()
        self._last, self._steps, self._from = (kind, start, len(seq)), steps[:g], place
        return Draft(tokens[:g])

    def _find(self, seq: Sequence[int], track: bool) -> Optional[tuple[int, list[int], Optional[Place], int]]:
        """(kind, candidate packed positions, the place of a copy, tokens the answer has followed it) to draft from:
        where the copy stands, else the longest match, else (following the answer) where it rejoins the document it
        departed from; None when there is nothing. A rejoin keeps the substitution it implies on trial (learned once
        the parent keeps its draft)."""
        if track and self._cursor is not None:
            place, n = self._cursor
            if n == len(seq) and (place.queue or self.memory.token_at(place.at) is not None):
                return CONTINUE, [], place, self._run
            self._cursor = None
        match_len, cands = self.memory.match(seq)
        # right after a departure from a copy, where it rejoins the document comes before a match shorter than a copy's
        # (one elsewhere, often the answer's own text: "x, low" where the signature went on "=0")
        first = match_len >= COPY_MATCH or self._departed is None or self._departed[2] != COPY_TAILS
        if match_len >= MIN_MATCH and first:
            return _bucket(match_len), cands, None, match_len
        rejoin = self._rejoin(seq) if track and self._departed is not None else None
        if rejoin is not None:
            return rejoin
        if match_len >= MIN_MATCH:
            return _bucket(match_len), cands, None, match_len
        return None

    def _rejoin(self, seq: Sequence[int]) -> Optional[tuple[int, list[int], Optional[Place], int]]:
        """Where the answer rejoins the document it departed from (its last tokens found a little further on, or the
        document's next token after the parent's own took its place), with the substitution it implies on trial, and
        the tokens the copy had held: a copy that held long and broke on a rename drafts on as far as it had earned."""
        at, n, tails, replaced, held = self._departed
        since = len(seq) - n  # answer tokens since the departure (the parent's own first)
        if since > REJOIN_SPAN:
            self._departed = None
            return None
        for m in tails:
            if since >= m:
                q = self.memory.find_after(at, seq[len(seq) - m:], REJOIN_WINDOW)
                if q is not None:
                    self._trial = self._implied(at, q - m, seq, n, len(seq) - m)
                    return REJOIN, [], Place(q), held
        if since == 1 and replaced and self.memory.token_at(at + 1) is not None:
            self._trial = self._implied(at, at + 1, seq, n, len(seq))
            return REJOIN, [], Place(at + 1), held  # the parent's token took the document's (a renamed word)
        return None

    def _implied(self, at: int, end: int, seq: Sequence[int], dep: int, upto: int):
        """The substitution a rejoin implies: the document's tokens from `at` (where the answer left it) to `end`
        (where it rejoins) replaced by the answer's seq[dep:upto]; an insertion or a deletion with the token before it
        (both texts' own) as its context. None when the rejoin reads back before the departure."""
        if end < at or upto < dep:
            return None
        old, new = self.memory.read(at, end - at), list(seq[dep:upto])
        if len(old) != end - at:
            return None
        if not old or not new:
            before = self.memory.token_at(at - 1) if offset(at) > 0 else None
            if before is None or dep == 0 or int(seq[dep - 1]) != before:
                return None
            old, new = [before, *old], [before, *new]
        return old, new

    def feedback(self, seq: Sequence[int], outcome: CycleOutcome) -> None:
        if self._last is None:
            return
        kind, start, n = self._last
        self.acceptance[kind].observe(outcome.accepted, outcome.proposed)
        trial, self._trial = self._trial, None
        if self._from is None or n != len(seq):
            return
        k, steps = outcome.accepted, self._steps
        if len(steps) < min(outcome.proposed, k + 1):  # a longer draft of the same text was verified (another
            # drafter's, of the prediction's own tokens: decoding.prediction): followed as far as it was kept
            need = min(outcome.proposed, k + 1)
            steps = follow(self.memory.read(self._from.at, need + self.edits.span), self._from, need, self.edits)
            if len(steps) < k:  # the document ends before what was kept: nothing to follow
                self._cursor = self._departed = None
                return
        if trial is not None and kind == REJOIN and k >= 1:  # the rejoin held: the edit that led to it is learned
            self.edits.learn(*trial)
        for st in steps[:k]:  # where a substitution on record was read one way and kept
            if st.doubt is not None:
                self.edits.kept(st.doubt, st.substituted)
        before = steps[k - 1].after if k else self._from  # where the copy stood at the parent's own token
        opens = steps[k].opens if k < len(steps) else None
        if opens is not None:  # the parent did not make the substitution proposed here
            self.edits.refute(opens[0])
            if self.memory.token_at(opens[1]) == outcome.next_token:  # it kept the document's own token
                return self._goes_on(Place(opens[1] + 1), n + k + 1, k + 1)
        ahead = follow(self.memory.read(before.at, 1 + self.edits.span), before, 1, self.edits)
        if k == outcome.proposed and ahead and ahead[0].token == outcome.next_token:
            return self._goes_on(ahead[0].after, n + k + 1, k + 1)
        if kind == REJOIN and k == 0 and self._departed is not None:  # a wrong rejoin: the edit goes on
            self._cursor, self._departed = None, (*self._departed[:3], False, 0)
            return
        # a copy in progress (or a long match, or an edit in one) is rejoined on the answer's last token alone, and
        # the parent's token first taken to replace the document's
        copying = kind in (CONTINUE, REJOIN) or (kind < len(BUCKETS) and BUCKETS[kind] >= COPY_MATCH)
        self._cursor, self._departed = None, (before.at, n + k, COPY_TAILS if copying else (2,), copying,
                                              self._run + k if copying else 0)
        self._run = 0

    def _goes_on(self, place: Place, n: int, kept: int) -> None:
        """The copy goes on at `place` once the sequence is `n` tokens long, `kept` more tokens held."""
        self._cursor, self._departed = (place, n), None
        self._run += kept
