"""The accept/reject loop. Yields one TokenEvent per token the parent would have produced.

Invariant between cycles: the parent's KV cache holds every token of `seq` except the last one, which
is fed as the first token of the next verification batch. Both contexts keep `tokens == KV contents`,
so an interrupted cycle is repaired by the next prefix sync; the verifier's rewind sits in `finally`."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

from specquant_cli.decoding.gamma import FixedGamma, RateGuard
from specquant_cli.decoding.protocols import (
    Constraint,
    CycleOutcome,
    Draft,
    Drafter,
    GammaPolicy,
    Pending,
    TokenContext,
    Verifier,
)
from specquant_cli.decoding.sampling import GREEDY, SamplingParams
from specquant_cli.decoding.verify import LinearVerifier, TokenLogprob
from specquant_cli.errors import InputError
from specquant_cli.names import Source
from specquant_cli.settings import DEFAULT_GAMMA

MAX_SEGMENTS = 3  # drafter runs in one cycle under a grammar (each one model call or more)


@dataclass
class TokenEvent:
    token: int
    source: Source = "parent"  # "draft" / "suffix": proposed by that kind of drafter and accepted; "grammar": forced
    eog: bool = False
    logprob: Optional[TokenLogprob] = None  # the parent's, when the engine was asked for them

    @property
    def from_draft(self) -> bool:
        return self.source != "parent"


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens the parent decoded (the rest came from its prefix cache)
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0  # drafted tokens the parent kept, of those handed out (a grammar's forced ones apart)
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
    guard_stop: Optional[int] = None  # tokens into the answer when a rate guard first stopped drafting
    guard_reopened: int = 0  # times it drafted again where the answer repeated a source
    forced: int = 0  # tokens a grammar forced, proposed at no draft cost (jump-forward)
    forced_accepted: int = 0  # of those, the parent's own picks
    prediction_proposed: int = 0  # drafted tokens that were the request's prediction's (within `drafted`)
    prediction_accepted: int = 0  # of those, the ones the parent kept, of those handed out (within `accepted`)


class Engine:
    def __init__(self, parent: TokenContext, drafter: Optional[Drafter] = None,
                 gamma: Optional[GammaPolicy] = None, sampling: SamplingParams = GREEDY,
                 verifier: Optional[Verifier] = None, first_alone: bool = False,
                 constraint: Optional[Constraint] = None, jump_forward: bool = False,
                 top_logprobs: Optional[int] = None, max_runs: int = MAX_SEGMENTS,
                 prediction: Optional[Sequence[int]] = None):
        """`first_alone`: the first token comes from the parent's own step, right after its prefill; the drafter
        prepares (its prefill or KV import) and drafts from the second token on. The time to the first token is
        then the parent's prefill and one step, not also the drafter's preparation and a draft; it costs one
        cycle's accepted drafts once per answer.

        `constraint`: the answer's grammar (decoding.grammar.Constraint, one per answer): the parent picks among the
        tokens it allows and every draft is cut at its first token it forbids. `jump_forward`: the tokens the
        grammar forces are proposed before the drafter's, at no draft cost (a policy that speculates; the parent
        alone decodes them one by one). `top_logprobs`: record the parent's log-probabilities (TokenEvent.logprob)
        with that many alternatives. `max_runs`: drafter runs a cycle under a grammar (1 where a round pacer grants
        each sequence its draft calls per cycle). `prediction`: the request's prediction (token ids), whose tokens
        that appear in the answer the usage counts (decoding.stream)."""
        self.parent = parent
        self.prediction = list(prediction) if prediction else None
        self.first_alone = first_alone
        self.drafter = drafter
        self.gamma_policy = gamma if gamma is not None else FixedGamma(DEFAULT_GAMMA if drafter else 0)
        self.sp = sampling
        self.noise = sampling.noise()
        self.constraint = constraint
        self.jump_forward = jump_forward and constraint is not None
        self.max_runs = max(1, max_runs)
        self.verifier = verifier or LinearVerifier(sampling, self.noise, constraint, top_logprobs)
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
            g = self._draft_length(seq, room) if self.drafter and not alone else 0
            draft, kinds, draft_s = self._draft(seq, g, room)
            outcome = self._verify(seq, draft, draft_s)
            own = self._drafters_part(kinds, outcome)
            if not alone:  # the first token's step is no drafting cycle: neither γ nor the drafter learn from it
                self.gamma_policy.update(own)
                if self.drafter is not None:
                    self.drafter.feedback(seq, own)
            if self.drafter is not None and not alone:
                st.levels = {k: v - base.get(k, 0) for k, v in self.drafter.counters.items()}
                if isinstance(self.gamma_policy, RateGuard):
                    guard = self.gamma_policy
                    st.guard_stop = st.guard_stop if st.guard_stop is not None else guard.tripped_at
                    st.guard_reopened = guard.reopened
            logprobs = getattr(self.verifier, "logprobs", None) or []
            for i, tok in enumerate(draft.tokens[:outcome.accepted] + [outcome.next_token]):
                if i < outcome.accepted:
                    self._kept(kinds[i])
                seq.append(tok)
                st.new_tokens += 1
                eog = tok in self.eog_ids
                yield TokenEvent(tok, kinds[i] if i < outcome.accepted else "parent", eog,
                                 logprobs[i] if i < len(logprobs) else None)
                if eog:
                    return

    def _draft_length(self, seq: list[int], room: int) -> int:
        """The γ policy's draft length, at most `room`; a rate guard that rests is reopened where the drafter has a
        copy on offer at no cost (the answer starts to repeat a source)."""
        policy = self.gamma_policy
        if isinstance(policy, RateGuard) and policy.resting and self.drafter.offers(seq):
            policy.reopen()
        return min(policy.draft_length(), room)

    def _kept(self, kind: Source) -> None:
        """A drafted token the parent kept, counted as it is handed out: a consumer that stops early (a stop string)
        leaves what followed it uncounted, so the counts stay within the answer returned."""
        st = self.stats
        if kind == "grammar":
            st.forced_accepted += 1
            return
        st.accepted += 1
        st.prediction_accepted += kind == "prediction"

    def _drafters_part(self, kinds: list[Source], outcome: CycleOutcome) -> CycleOutcome:
        """The cycle as the drafter and γ see it: its own tokens proposed and accepted, and the forced tokens the
        parent kept as `free` (the stats count the tokens proposed here, those kept as they are handed out); when the
        parent parted from the draft at a forced token, the drafter's tokens after it were never judged: it proposed
        nothing this cycle, as far as it learns."""
        st, k = self.stats, outcome.accepted
        forced = [kind == "grammar" for kind in kinds]
        free = sum(forced[:k])
        st.forced += sum(forced)
        st.prediction_proposed += kinds.count("prediction")
        judged = not (k < len(kinds) and forced[k])
        return CycleOutcome(len(kinds) - sum(forced) if judged else 0, k - free, outcome.next_token,
                            outcome.draft_s, outcome.verify_s, outcome.scored, free)

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

    def _draft(self, seq: list[int], g: int, room: int) -> tuple[Draft, list[Source], float]:
        """(draft, each token's source, drafting seconds): up to `g` tokens of the drafter's; under a grammar, cut at
        the first token it forbids, and with jump-forward the tokens it forces proposed too (before, between and
        after the drafter's runs: a run cut by the grammar, or followed by forced tokens, is drafted on from there,
        at most `max_runs` runs a cycle)."""
        if self.constraint is None:
            draft, dt, source = self._propose(seq, g)
            return draft, [source] * len(draft.tokens), dt
        walk = self.constraint.fork()
        tokens: list[int] = []
        kinds: list[Source] = []
        spent, own, runs = 0.0, 0, 0
        while True:
            forced = walk.forced(room - len(tokens)) if self.jump_forward else []
            walk.advance(forced)
            tokens += forced
            kinds += ["grammar"] * len(forced)
            left = min(g - own, room - len(tokens))
            if left <= 0 or runs == self.max_runs or (runs and not forced):
                break
            draft, dt, source = self._propose(Pending(seq, tokens) if tokens else seq, left)
            spent, runs = spent + dt, runs + 1
            ok = draft.tokens[:walk.valid_prefix(draft.tokens)]
            walk.advance(ok)
            tokens += ok
            kinds += [source] * len(ok)
            own += len(ok)
        return Draft(tokens), kinds, spent

    def _propose(self, seq: list[int], g: int) -> tuple[Draft, float, Source]:
        """(draft, seconds, source): the source is asked right away, as a mixed drafter's changes per draft."""
        if g <= 0 or self.drafter is None:
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
        st.verify_s += dt
        return CycleOutcome(len(draft.tokens), accepted, nxt, draft_s, dt, len(draft.tokens) + 1)
