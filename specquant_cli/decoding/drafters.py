"""Drafters: context in, up to n proposed tokens out (with the draft's distributions when a model sampled).

Every drafter implements `protocols.Drafter`; `DrafterBase` gives the no-op defaults (nothing to prepare,
no context limit, no feedback), so the engine never asks what kind of drafter it holds."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Optional

import numpy as np

from specquant_cli.decoding.gamma import Acceptance, best_draft_length, expected_tokens
from specquant_cli.decoding.protocols import CycleOutcome, Draft, Level, Prepared, TokenContext, verified
from specquant_cli.decoding.sampling import Noise, SamplingParams, greedy_token, probs, sample

# A model drafter imports the parent's KV cache instead of decoding when it lacks more than this many
# prompt tokens: an import costs about as much as decoding a handful of tokens (709 tokens: 87 ms).
IMPORT_MIN_TOKENS = 8


class DrafterBase:
    name = "drafter"
    source = "draft"  # names.Source of the tokens it proposes: "draft" (a model) or "suffix" (draft-free)

    @property
    def n_ctx(self) -> Optional[int]:
        return None

    def prepare(self, seq: Sequence[int]) -> Optional[Prepared]:
        return None

    def feedback(self, seq: Sequence[int], outcome: CycleOutcome) -> None:
        pass

    def offers(self, seq: Sequence[int]) -> bool:
        """No free copy on offer (a model drafts at a price; a draft-free drafter says otherwise)."""
        return False

    @property
    def counters(self) -> dict[str, float]:
        """Running totals of what drafting did beyond the engine's own counts (a second level's proposals and
        acceptances, time per level); the engine reports their change over an answer."""
        return {}


class NGramDrafter(DrafterBase):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n-gram (longest n first)
    in prompt + output so far, and propose what followed it. Costs no model call."""

    name = "ngram"
    source = "suffix"

    def __init__(self, ngram_sizes: Sequence[int] = (4, 3, 2), min_tokens: int = 1):
        self.sizes = sorted(set(int(n) for n in ngram_sizes), reverse=True)
        self.min_tokens = min_tokens

    def propose(self, seq: Sequence[int], n: int, sp: SamplingParams = None, noise=None) -> Draft:
        if n <= 0:
            return Draft()
        arr = np.asarray(seq, dtype=np.int64)
        for size in self.sizes:
            if len(arr) <= size:
                continue
            tail = arr[-size:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], size)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            hits = hits[hits + size < len(arr)]
            if len(hits):
                start = int(hits[-1]) + size
                tokens = arr[start:start + n].tolist()
                if len(tokens) >= self.min_tokens:
                    return Draft(tokens)
        return Draft()


class ModelDrafter(DrafterBase):
    """A quantized variant drafts with its own context, kept in step with the sequence by prefix reuse.

    With `parent` (a sibling context of the same family and KV layout), the draft skips its prompt prefill:
    after the parent has prefilled, its sequence state is imported (`Context.import_state`); when llama.cpp
    refuses that, the draft prefills itself and the refusal is remembered. With `p_min`, drafting stops as
    soon as the draft's top probability falls below it. With `window`, the draft reads only the last
    `window` tokens of the prompt (plus everything generated since).

    With `lower` (protocols.Level: a suffix drafter reading the drafting memory, or a smaller sibling model with
    its own cache, `ModelLevel`: a chain of three), a second drafting level speculates the
    model's own steps: after each token the model picks, `lower` proposes what follows, the model scores the
    token and the proposals in one call and keeps the proposals as long as they are what it would have picked
    itself (its greedy choice, or its sample with the parent's noise for that position). The draft is the
    model's own either way, token for token: only its cost changes, from one call per token to one call per
    run the lower level got right. `lower` sizes its proposals from the model's batch cost curve and the
    acceptance it measures at this level (its feedback).

    With `pacer` (decoding.rounds.Pace: a server's slots share one pacer), the draft makes at most as many
    calls as the pacer allows for this cycle, the same number for every sequence of the batch drafting with
    this model, none when drafting would not lower the batch's time per token (a planned policy's drafts); its
    verified drafts feed the pacer's pooled acceptance. `role` is the draft model's family role (what the pacer
    prices). A draft that resumes after the sequence ran on without it (rested, or a mixed drafter's other
    source drafted) imports the parent's cache when that spares decoding more than IMPORT_MIN_TOKENS."""

    def __init__(self, ctx: TokenContext, name: str = "model", p_min: Optional[float] = None,
                 stop_ids: frozenset[int] = frozenset(), window: Optional[int] = None,
                 parent: Optional[TokenContext] = None, lower: Optional[Level] = None, pacer=None,
                 role: Optional[str] = None):
        self.ctx = ctx
        self.name = name
        self.p_min = p_min
        self.stop_ids = stop_ids or ctx.model.eog_ids
        self.window = window
        self.parent = parent
        self.lower = lower
        self.pacer = pacer
        self.role = role or name
        self.import_ok = True  # until llama.cpp refuses an import once
        self.start = 0  # first token of the sequence the draft context holds
        self._counts = {"level2_proposed": 0, "level2_accepted": 0, "model_calls": 0, "model_s": 0.0,
                        "lookup_s": 0.0}

    @property
    def n_ctx(self) -> Optional[int]:
        return self.ctx.n_ctx

    @property
    def counters(self) -> dict[str, float]:
        """Its own counts, and a model lower level's calls and seconds (`level2_model_calls`, `level2_model_s`)."""
        return {**self._counts, **(self.lower.counters if self.lower is not None else {})}

    def prepare(self, seq: Sequence[int]) -> Prepared:
        """Catch up on the prompt. Called after the parent's prefill (or between cycles), when the parent's
        cache holds seq[:-1]. An imported cache makes the window unnecessary: the draft reads everything.
        A paced drafter that imports catches up only when it is first given calls (decoding.rounds): beside
        other sequences it may rest for the whole answer, and its import or catch-up call would be a round
        every sequence waits for."""
        t0 = time.perf_counter()
        if self.lower is not None:
            self.lower.prepare(seq)  # a model lower level (a chain's sibling) prefills the prompt here
        lower_s = time.perf_counter() - t0
        if self.pacer is not None and self.parent is not None and self.import_ok and not self.window:
            self.start = 0
            return Prepared(prefill_s=lower_s)
        t0 = time.perf_counter()
        imported = self._import(seq)
        self.start = max(0, len(seq) - self.window) if self.window and not imported else 0
        t1 = time.perf_counter()
        self.ctx.sync(seq[self.start:])
        t2 = time.perf_counter()
        return Prepared(prefill_s=t2 - t1 + lower_s, import_s=t1 - t0 if imported is not None else 0.0,
                        imported=bool(imported))

    def _import(self, seq: Sequence[int]) -> Optional[bool]:
        """Import the parent's cache when that saves a real prefill; None when no import was tried."""
        parent = self.parent
        if parent is None or not self.import_ok:
            return None
        have = parent.tokens
        if have != list(seq[:len(have)]) or len(have) - self.ctx.common_prefix(seq) <= IMPORT_MIN_TOKENS:
            return None
        ok = self.ctx.import_state(parent.export_state(), have)
        self.import_ok = ok
        return ok

    def propose(self, seq: Sequence[int], n: int, sp: SamplingParams, noise: Noise) -> Draft:
        calls = self.pacer.ask(id(self), self.role, len(seq)) if self.pacer is not None and n > 0 else None
        if n <= 0 or calls == 0:
            return Draft()
        if self.start >= len(seq):  # a new, shorter sequence without prepare()
            self.start = 0
        if self.lower is not None:
            self.lower.remember(verified(seq))
        if self.start == 0:
            self._import(seq)  # a long way behind the parent: its cache, not a decode of the gap
        self._call(lambda: self.ctx.sync(seq[self.start:]))
        out: list[int] = []
        row = -1  # the logits row that predicts the next token
        made = 1  # calls this draft has made
        while len(out) < n:
            t = self._pick(self.ctx.logits(row), sp, noise, len(seq) + len(out))
            if t is None:
                break
            out.append(t)
            if t in self.stop_ids or len(out) == n or (calls is not None and made >= calls):
                break  # the last drafted token is decoded lazily, by the next sync, only if it is kept
            row = self._step(seq, out, n, sp, noise)
            made += 1
            if row is None:
                break
        return Draft(out)

    def feedback(self, seq: Sequence[int], outcome: CycleOutcome) -> None:
        if self.pacer is not None and outcome.proposed:
            self.pacer.observe(self.role, outcome.proposed, outcome.accepted)

    def _step(self, seq, out: list[int], n: int, sp, noise) -> Optional[int]:
        """Decode out[-1], with the lower level's proposals after it when there is one; append those the model
        agrees with to `out`. Returns the row predicting the next token, or None when the draft ends here."""
        props = self._proposals(seq, out, n - len(out), sp, noise)
        self._call(lambda: self.ctx.decode([out[-1]] + props, logits="all" if props else "last"))
        if not props:
            return 0
        kept, end = 0, False
        for j, p in enumerate(props):
            t = self._pick(self.ctx.logits(j), sp, noise, len(seq) + len(out))
            if t != p:
                end = t is None
                break
            out.append(p)
            kept += 1
            if p in self.stop_ids:
                end = True
                break
        self._counts["level2_proposed"] += len(props)
        self._counts["level2_accepted"] += kept
        self.lower.feedback(seq, CycleOutcome(len(props), kept, -1, 0.0, 0.0, len(props) + 1))
        if kept < len(props):
            self.ctx.rewind(self.ctx.n_past - (len(props) - kept))
        return None if end or len(out) >= n else kept

    def _proposals(self, seq, out: list[int], room: int, sp, noise) -> list[int]:
        """The lower level's tokens after seq + out (protocols.Level); none without a lower level."""
        if self.lower is None:
            return []
        t0 = time.perf_counter()
        props = self.lower.propose_after(seq, out, room, sp, noise)
        self._counts["lookup_s"] += time.perf_counter() - t0
        return props

    def _call(self, call) -> None:
        t0 = time.perf_counter()
        call()
        self._counts["model_calls"] += 1
        self._counts["model_s"] += time.perf_counter() - t0

    def _pick(self, row: np.ndarray, sp: SamplingParams, noise: Noise, pos: int) -> Optional[int]:
        """The model's token at `pos` from its logits `row` (greedy, or sampled with the parent's noise for
        that position: coupled), None below `p_min`."""
        if sp.greedy:
            t = greedy_token(row)
            return None if self.p_min is not None and _top_prob(row, t) < self.p_min else t
        q = probs(row, sp)
        if self.p_min is not None and float(q.max()) < self.p_min:
            return None
        return sample(q, noise.at(pos, q.shape[0]))


def _top_prob(row: np.ndarray, top: int) -> float:
    return float(1.0 / np.exp(row - row[top]).sum())


# A lower model level's step relative to a call of the model above it, before the calibration says (a 0.5B Q4_K_M
# sibling under a 1.5B Q4_0 draft); and its per-token acceptance by the model above before any feedback.
LOWER_RATIO_PRIOR = 0.45
LOWER_ALPHA_PRIOR = 0.7
LOWER_PRIOR_WEIGHT = 4.0
LOWER_PROBE_EVERY = 16  # a lower level that stopped proposing proposes one token after this many steps without


class ModelLevel:
    """A smaller draft model as the lower level of a draft model (protocols.Level): a chain of three, where the
    sibling drafts, the model above verifies its proposals in one call (keeping the longest run it agrees with),
    and the parent verifies that model's drafts. `drafter` is the sibling's own ModelDrafter (its own KV cache, its
    own prefill: it cannot import the parent's); it proposes after each token the upper model picks, with the
    parent's noise for each position when sampling, so what the upper keeps is its own pick either way.

    The proposal length maximizes the upper's tokens per second: expected_tokens(alpha, k) over one upper call on
    1 + k tokens (`upper_cost`, relative to its one-token call) plus k lower steps (`ratio` of an upper call each),
    alpha the share of proposals the upper kept so far (decayed, from LOWER_ALPHA_PRIOR or `alpha`)."""

    def __init__(self, drafter: ModelDrafter, upper_cost, ratio: Optional[float] = None,
                 alpha: Optional[float] = None, gamma_max: int = 7):
        self.drafter = drafter
        self.upper_cost = upper_cost
        self.ratio = ratio if ratio else LOWER_RATIO_PRIOR
        self.acceptance = Acceptance(alpha or LOWER_ALPHA_PRIOR, LOWER_PRIOR_WEIGHT, 0.9)
        self.gamma_max = gamma_max
        self._idle = 0  # steps of the upper model since the lower level last proposed

    def prepare(self, seq: Sequence[int]) -> None:
        self.drafter.prepare(seq)

    def remember(self, seq: Sequence[int]) -> None:
        pass

    def length(self, room: int) -> int:
        alpha = self.acceptance.alpha
        return best_draft_length(lambda k: expected_tokens(alpha, k) / (self.upper_cost(1 + k) + k * self.ratio),
                                 min(room, self.gamma_max))[0]

    def propose_after(self, seq: Sequence[int], out: list[int], room: int, sp: SamplingParams,
                      noise: Noise) -> list[int]:
        k = self.length(room)
        self._idle = 0 if k else self._idle + 1
        if not k and self._idle >= LOWER_PROBE_EVERY and room:  # a probe: acceptance is learned only from proposals
            k, self._idle = 1, 0
        return self.drafter.propose(list(seq) + out, k, sp, noise).tokens if k > 0 else []

    def feedback(self, seq: Sequence[int], outcome: CycleOutcome) -> None:
        if outcome.proposed:
            self.acceptance.observe(outcome.accepted, outcome.proposed)

    @property
    def counters(self) -> dict[str, float]:
        own = self.drafter.counters
        return {"level2_model_calls": own["model_calls"], "level2_model_s": own["model_s"]}


# A mix leaves its model out while the answer copies: once it is COPY_MIN_TOKENS long and at least COPY_SHARE of it
# came from the draft-free drafter's drafts. Each model draft after a copy run first catches up on the run (a decode
# of it, or an import of the parent's cache), about a parent step; at an edit the parent's own few steps cost less.
COPY_MIN_TOKENS = 32
COPY_SHARE = 0.6


class FallbackDrafter(DrafterBase):
    """Free drafts from `first` (draft-free) when it offers them, the model's drafts otherwise — except while the
    answer copies (COPY_SHARE of it from `first`'s drafts): then `first`'s alone, however short.

    The model drafter wakes up only once the answer is `activate_after` tokens long: without a KV import
    its prefill costs ~2/3 of the parent's per token on a CPU, more than short answers can win back."""

    def __init__(self, first: DrafterBase, then: ModelDrafter, min_tokens: int = 2, activate_after: int = 32,
                 model_gamma=None):
        self.first, self.then = first, then
        self.min_tokens = min_tokens
        self.activate_after = activate_after
        # With `model_gamma` (a GammaPolicy), the model's drafts get their own length, learned from their own
        # outcomes, while `n` (the plan's cap) bounds the draft-free ones: a copy run may be 32 tokens long,
        # a model draft pays per token.
        self.model_gamma = model_gamma
        self.name = f"{first.name}+{then.name}"
        self._prompt_len = 0
        self._active = False
        self._last = "first"
        self._copied = 0  # answer tokens from `first`'s drafts

    @property
    def n_ctx(self) -> Optional[int]:
        return self.then.n_ctx

    def prepare(self, seq: Sequence[int]) -> Optional[Prepared]:
        """The model drafter prepares now only when it may draft from the first cycle (activate_after 0:
        with a KV import that costs milliseconds); otherwise when it first drafts."""
        self._prompt_len = len(seq)
        self._active = self.activate_after == 0
        self._copied = 0
        self.first.prepare(seq)
        return self.then.prepare(seq) if self._active else None

    def propose(self, seq: Sequence[int], n: int, sp: SamplingParams, noise: Noise) -> Draft:
        d = self.first.propose(seq, n, sp, noise)
        self._last = "first"
        answer = len(seq) - self._prompt_len
        if len(d.tokens) >= min(self.min_tokens, n) or answer < self.activate_after or self.copying(answer):
            return d
        self._last = "model"
        g = n if self.model_gamma is None else min(n, self.model_gamma.draft_length())
        if g <= 0:
            return Draft()
        if not self._active:
            self.then.prepare(seq)
            self._active = True
        return self.then.propose(seq, g, sp, noise)

    def offers(self, seq: Sequence[int]) -> bool:
        return self.first.offers(seq)

    def copying(self, answer: int) -> bool:
        """The answer (`answer` tokens so far) copies: COPY_MIN_TOKENS long, COPY_SHARE of it from `first`'s drafts."""
        return answer >= COPY_MIN_TOKENS and self._copied >= COPY_SHARE * answer

    @property
    def counters(self) -> dict[str, float]:
        return self.then.counters

    @property
    def source(self) -> str:
        """The source of the last proposal: the draft-free drafter's or the model's."""
        return (self.first if self._last == "first" else self.then).source

    def feedback(self, seq: Sequence[int], outcome: CycleOutcome) -> None:
        if self._last == "first":
            self._copied += outcome.accepted
            self.first.feedback(seq, outcome)
            return
        if self.model_gamma is not None:
            self.model_gamma.update(outcome)
        self.then.feedback(seq, outcome)
