"""The accept/reject loop. Yields one TokenEvent per token the parent would have produced.

Invariant between cycles: the parent's KV cache holds every token of `seq` except the last one, which
is fed as the first token of the next verification batch. Both contexts keep `tokens == KV contents`,
so an interrupted cycle is repaired by the next prefix sync; the verifier's rewind sits in `finally`."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

from specquant_cli.decoding.gamma import FixedGamma
from specquant_cli.decoding.protocols import CycleOutcome, Draft, Drafter, GammaPolicy, TokenContext, Verifier
from specquant_cli.decoding.sampling import GREEDY, SamplingParams
from specquant_cli.decoding.verify import LinearVerifier
from specquant_cli.errors import InputError
from specquant_cli.names import Source
from specquant_cli.settings import DEFAULT_GAMMA


@dataclass
class TokenEvent:
    token: int
    source: Source = "parent"  # "draft" / "suffix": proposed by that kind of drafter and accepted; else the parent's
    eog: bool = False

    @property
    def from_draft(self) -> bool:
        return self.source != "parent"


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens the parent decoded (the rest came from its prefix cache)
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    parent_calls: int = 0
    prefill_s: float = 0.0  # parent prefill + the drafter's preparation (its prefill or KV import)
    parent_prefill_s: float = 0.0  # the parent's own prefill: the floor of any lossless plan
    draft_prefill_s: float = 0.0  # the drafter decoding the prompt itself
    kv_import_s: float = 0.0  # the drafter importing the parent's KV cache instead
    kv_import: Optional[bool] = None  # None: no model drafter prepared; False: it prefilled itself
    draft_s: float = 0.0
    verify_s: float = 0.0
    # what the drafter's own counters (Drafter.counters) added over this answer: a second level's proposals
    # and acceptances, the draft model's calls and seconds
    levels: dict = field(default_factory=dict)
    guard_stop: Optional[int] = None  # tokens into the answer when a rate guard stopped drafting


class Engine:
    def __init__(self, parent: TokenContext, drafter: Optional[Drafter] = None,
                 gamma: Optional[GammaPolicy] = None, sampling: SamplingParams = GREEDY,
                 verifier: Optional[Verifier] = None, first_alone: bool = False):
        """`first_alone`: the first token comes from the parent's own step, right after its prefill; the drafter
        prepares (its prefill or KV import) and drafts from the second token on. The time to the first token is
        then the parent's prefill and one step, not also the drafter's preparation and a draft; it costs one
        cycle's accepted drafts once per answer."""
        self.parent = parent
        self.first_alone = first_alone
        self.drafter = drafter
        self.gamma_policy = gamma if gamma is not None else FixedGamma(DEFAULT_GAMMA if drafter else 0)
        self.sp = sampling
        self.noise = sampling.noise()
        self.verifier = verifier or LinearVerifier(sampling, self.noise)
        self.stats = EngineStats()
        self.eog_ids = parent.model.eog_ids

    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        limits = [self.parent.n_ctx] + ([self.drafter.n_ctx] if self.drafter and self.drafter.n_ctx else [])
        n_ctx = min(limits)
        if n_prompt == 0:
            raise InputError("empty prompt")
        if n_prompt + max_tokens > n_ctx:
            raise InputError(f"prompt of {n_prompt} tokens + max_tokens {max_tokens} exceeds the context "
                             f"size {n_ctx}; shorten the prompt or lower --max-tokens")

    def generate(self, prompt: Sequence[int], max_tokens: int) -> Iterator[TokenEvent]:
        """Generate up to `max_tokens` tokens after `prompt`.

        Args:
            prompt: token ids, already rendered with the chat template.
            max_tokens: upper bound on yielded events.

        Yields:
            One TokenEvent per generated token, in order, exactly the tokens the parent alone would have
            produced (greedy) or a sample of its distribution (sampling). An end-of-generation token is
            yielded with `eog=True` and ends the stream. `self.stats` is replaced at the start and updated as
            the iterator is consumed; closing the iterator early leaves both caches consistent."""
        self.check_fits(len(prompt), max_tokens)
        st = self.stats = EngineStats(prompt_tokens=len(prompt))
        seq = list(prompt)
        alone = self.first_alone and self.drafter is not None  # the next cycle is the parent's own step
        self._prefill(seq, prepare=not alone)
        base = dict(self.drafter.counters) if self.drafter is not None else {}
        while st.new_tokens < max_tokens:
            if alone and st.new_tokens:  # the first token is out: the drafter catches up now
                self._prepare(seq)
                alone = False
            room = max_tokens - st.new_tokens - 1  # the cycle's own token always fits
            g = min(self.gamma_policy.draft_length(), room) if self.drafter and not alone else 0
            draft, draft_s, source = self._draft(seq, g)
            outcome = self._verify(seq, draft, draft_s)
            if not alone:  # the first token's step is no drafting cycle: neither γ nor the drafter learn from it
                self.gamma_policy.update(outcome)
            if self.drafter is not None and not alone:
                self.drafter.feedback(seq, outcome)
                st.levels = {k: v - base.get(k, 0) for k, v in self.drafter.counters.items()}
                st.guard_stop = getattr(self.gamma_policy, "tripped_at", None)
            for i, tok in enumerate(draft.tokens[:outcome.accepted] + [outcome.next_token]):
                seq.append(tok)
                st.new_tokens += 1
                eog = tok in self.eog_ids
                yield TokenEvent(tok, source if i < outcome.accepted else "parent", eog)
                if eog:
                    return

    def _prefill(self, seq: list[int], prepare: bool = True) -> None:
        st = self.stats
        t0 = time.perf_counter()
        st.prefill_tokens = self.parent.prefill(seq[:-1])
        st.parent_prefill_s = st.prefill_s = time.perf_counter() - t0
        if prepare:
            self._prepare(seq)

    def _prepare(self, seq: list[int]) -> None:
        """The drafter catches up on `seq` (the parent holds seq[:-1]); its time counts in prefill_s."""
        if self.drafter is None:
            return
        st = self.stats
        t0 = time.perf_counter()
        rep = self.drafter.prepare(seq)
        if rep is not None:
            st.draft_prefill_s, st.kv_import_s, st.kv_import = rep.prefill_s, rep.import_s, rep.imported
        st.prefill_s += time.perf_counter() - t0

    def _draft(self, seq: list[int], g: int) -> tuple[Draft, float, Source]:
        """(draft, seconds, source): the source is asked right away, as a mixed drafter's changes per draft."""
        if g <= 0:
            return Draft(), 0.0, "parent"
        t0 = time.perf_counter()
        draft = self.drafter.propose(seq, g, self.sp, self.noise)
        dt = time.perf_counter() - t0
        self.stats.draft_s += dt
        self.stats.drafted += len(draft.tokens)
        return draft, dt, self.drafter.source

    def _verify(self, seq: list[int], draft: Draft, draft_s: float) -> CycleOutcome:
        t0 = time.perf_counter()
        accepted, nxt = self.verifier.verify(self.parent, seq, draft)
        dt = time.perf_counter() - t0
        st = self.stats
        st.parent_calls += 1
        st.accepted += accepted
        st.verify_s += dt
        return CycleOutcome(len(draft.tokens), accepted, nxt, draft_s, dt, len(draft.tokens) + 1)
