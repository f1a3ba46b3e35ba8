"""Predicted Outputs: the text a request expects its answer to resemble (OpenAI's `prediction`; `chat --predict`),
proposed as drafts and verified by the parent like any other, so the answer stays the parent's own.

`PredictionDrafter` stacks on the policy's own drafter (`inner`: suffix drafts, a model, a mix, or none). Its
corpus is the prediction alone: a private drafting memory (decoding.memory) holding it as one document, read by a
suffix drafter (decoding.suffix), the same matcher that drafts from the prompt — so the answer is followed as it
copies the prediction, departs from it (an edit) and rejoins it. At the answer's start it drafts the prediction's
beginning (the answer so far is a prefix of it).

Which drafter proposes: the inner drafter while the parent keeps its drafts whole (it copies the same text, from the
prompt), else the prediction where the answer follows it (a copy in progress, a match of STRONG_MATCH tokens or
more), else the inner drafter, and the prediction's weaker match (a rejoin after an edit, a short match) only when
the inner one proposes nothing — so a wrong prediction (another file) gives way to the policy's own drafts, and its
drafts are sized down to none by their measured acceptance. Drafts from the prediction are sized from the parent's
call-cost curve and their acceptance (per kind of match), up to the engine's draft length (a copy's, from the
curve); the inner drafter's own draft length stays its γ policy's (`inner_gamma`), which hears only its cycles, as
FallbackDrafter's model does.

A draft whose tokens are the prediction's own where the answer stands in it carries the source "prediction"
(names.Source), whichever drafter found it (the prompt often holds the same file): the engine counts those proposed
and those the parent kept (EngineStats.prediction_proposed / prediction_accepted: how the drafting went). The usage's
accepted and rejected prediction tokens are OpenAI's instead: the prediction's tokens that appear in the answer
returned, and the rest (decoding.stream.appeared), a function of the request alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

from specquant_cli.decoding.drafters import DrafterBase
from specquant_cli.decoding.gamma import COPY_GAMMA_MAX
from specquant_cli.decoding.memory import DraftMemory, packed
from specquant_cli.decoding.protocols import CycleOutcome, Draft, Drafter, Prepared
from specquant_cli.decoding.suffix import BUCKETS, CONTINUE, SuffixDrafter

# Per-token acceptance priors of drafts from a prediction, by kind (match-length buckets, CONTINUE, REJOIN): a text the
# client says the answer resembles is trusted more than any earlier text the memory holds.
PREDICTION_PRIORS = (0.6, 0.7, 0.75, 0.8, 0.9, 0.95, 0.75)
STRONG_MATCH = 9  # a match of this many tokens or more drafts before the inner drafter is asked
STRONG = frozenset({i for i, b in enumerate(BUCKETS) if b >= STRONG_MATCH} | {CONTINUE})


class PredictionDrafter(DrafterBase):
    """Drafts from `prediction` (token ids) for an answer that starts at position `start` of the sequence, stacked on
    `inner` (the policy's drafter, or None) whose drafts are up to `inner_gamma`'s length (None: the engine's).
    `verify_cost`: a parent call on n tokens relative to one (what a draft's length is weighed against)."""

    name = "prediction"

    def __init__(self, prediction: Sequence[int], start: int, inner: Optional[Drafter] = None, inner_gamma=None,
                 verify_cost: Optional[Callable[[int], float]] = None, gamma_max: int = COPY_GAMMA_MAX):
        self.prediction = [int(t) for t in prediction]
        self.start = start
        self.inner = inner
        self.inner_gamma = inner_gamma
        memory = DraftMemory(max(1, len(self.prediction)))
        self.doc = memory.new_doc()
        memory.append(self.doc, self.prediction)
        self.lookup = SuffixDrafter(gamma_max, verify_cost, memory=memory, record=False, priors=PREDICTION_PRIORS)
        self.name = f"prediction+{inner.name}" if inner is not None else "prediction"
        self._last = "prediction"  # who proposed the last draft: "prediction" or "inner"
        self._ahead = False  # the inner drafter's last draft was kept whole: it is asked first
        self._predicted = False  # the last draft's tokens are the prediction's

    @property
    def n_ctx(self) -> Optional[int]:
        return self.inner.n_ctx if self.inner is not None else None

    def prepare(self, seq: Sequence[int]) -> Optional[Prepared]:
        self._ahead = False
        self.lookup.prepare(seq)
        self.lookup.expect(self.start, seq, self.prediction, packed(self.doc, 0))
        return self.inner.prepare(seq) if self.inner is not None else None

    def propose(self, seq: Sequence[int], n: int, sp=None, noise=None) -> Draft:
        theirs = self._theirs(seq, n, sp, noise) if self._ahead else None  # the inner drafter copies on
        own = self.lookup.lookup(seq, n, track=True) if self.prediction else Draft()
        if theirs is not None and theirs.tokens:
            return self._chose(theirs, "inner")
        if own.tokens and (self.inner is None or self.lookup.kind in STRONG):
            return self._chose(own, "prediction")
        if self.inner is not None:
            theirs = theirs if theirs is not None else self._theirs(seq, n, sp, noise)
            if theirs.tokens or not own.tokens:
                return self._chose(theirs, "inner")
        return self._chose(own, "prediction")

    def offers(self, seq: Sequence[int]) -> bool:
        ours = bool(self.prediction) and self.lookup.offers(seq)
        return ours or (self.inner is not None and self.inner.offers(seq))

    def _theirs(self, seq: Sequence[int], n: int, sp, noise) -> Draft:
        """The inner drafter's draft, at most its own γ policy's length."""
        g = n if self.inner_gamma is None else min(n, self.inner_gamma.draft_length())
        return self.inner.propose(seq, g, sp, noise) if g > 0 else Draft()

    def _chose(self, draft: Draft, who: str) -> Draft:
        """`draft`, proposed by `who`; its tokens are the prediction's (counted as such, and followed by the
        prediction's drafter) when they are the prediction's own where the answer stands in it."""
        self._last = who
        at = self.lookup.start
        pos = at - packed(self.doc, 0) if at is not None else None
        self._predicted = bool(draft.tokens) and (who == "prediction" or (
            pos is not None and self.prediction[pos:pos + len(draft.tokens)] == draft.tokens))
        return draft

    @property
    def source(self) -> str:
        """The source of the last proposal: "prediction" for the prediction's tokens, else the inner drafter's."""
        return "prediction" if self._predicted or self.inner is None else self.inner.source

    def feedback(self, seq: Sequence[int], outcome: CycleOutcome) -> None:
        self._ahead = self._last == "inner" and outcome.proposed > 0 and outcome.accepted == outcome.proposed
        if self._predicted:
            self.lookup.feedback(seq, outcome)
        if self._last == "prediction":
            return
        if self.inner_gamma is not None:
            self.inner_gamma.update(outcome)
        if self.inner is not None:
            self.inner.feedback(seq, outcome)

    @property
    def counters(self) -> dict[str, float]:
        return self.inner.counters if self.inner is not None else {}
