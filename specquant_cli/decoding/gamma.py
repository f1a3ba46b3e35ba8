"""Draft length (γ, `gamma`): fixed, or adapted from observed acceptance and measured costs.

Cost model of one cycle with draft length γ: γ draft steps + one parent call on γ+1 tokens.
With per-token acceptance a, a cycle yields E(a, γ) = (1 - a^(γ+1)) / (1 - a) tokens.

The pieces every draft-length decision shares live here, once: `Acceptance` (the decayed estimate of
per-token acceptance) and `best_draft_length` (the γ with the most tokens per unit of cost, with a
`TIE_MARGIN` against longer drafts). The adaptive controller (`AdaptiveGamma`), the suffix drafter's
per-draft length and the auto planner's predictions all use them.

The policies implement `protocols.GammaPolicy`: `draft_length()` (the γ to draft now) is pure, `update()`
changes state. The protocol keeps the name `draft_length`: it reads as the question the engine asks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from specquant_cli.decoding.protocols import CycleOutcome
from specquant_cli.settings import DEFAULT_GAMMA

# The acceptance prior counts as this many observed tokens, so the first few cycles cannot swing it.
PRIOR_PSEUDO_COUNTS = 4.0
# A prior measured on this machine's pair (the calibration's agreement over 256 parent tokens) counts as
# about one decay window of evidence: worth 4 tokens, one early cycle that kept 1 of 4 drafts took a q4
# draft from 0.92 to 0.77 and its length to 0 for the rest of a 128-token answer (Spec-Bench 123, measured).
CALIBRATED_PRIOR_COUNTS = 16.0
# A longer draft must promise at least this much more throughput than a shorter one to be chosen:
# on near ties the shorter draft wastes less when the estimate is off.
TIE_MARGIN = 1.01
# The longest model draft: what a plan predicts for and an adaptive length may reach. The calibration measures
# parent calls on up to 16 tokens (system.calibration.MAX_BATCH), so a draft of up to 15 is priced from measured
# costs; which length pays is the curves' choice (best_draft_length), not this bound's. (It was 8 while the parent
# was F16, whose 16-token call costs 4 single steps; a BF16 parent's costs 2.6 on the AMD EPYC kind.)
GAMMA_MAX = 15
# Draft-free drafters (suffix) size each draft themselves, up to this (the `suffix` policy's cap, and the least a copied
# answer is planned at).
SUFFIX_GAMMA_MAX = 32
# A copied answer (a prediction, or an answer that copies its prompt) is drafted up to the length where the parent's
# measured call-cost curve stops paying at COPY_ALPHA per token, at most COPY_GAMMA_MAX: the calibration measures the
# parent's calls up to COPY_GAMMA_MAX + 1 tokens (system.calibration.LONG_CALLS). A 16-token BF16 call of the 1.5B
# parent costs 3.5 single steps on the AMD EPYC kind, so a right draft of 15 runs at 4.6x the parent's decode.
COPY_GAMMA_MAX = 63
COPY_ALPHA = 0.99
# RateGuard: a planned answer stops drafting when, after this many drafting cycles, its drafting runs below
# this share of the parent's own rate (the margin covers the VM's minute-to-minute drift of 10-30 %).
GUARD_MIN_CYCLES = 6
GUARD_RATIO = 0.9
# A draft that proposed nothing in less than this made no model call (a memory lookup found no match, a rested
# drafter declined): its cycle is the parent's own step. One that took longer paid for model calls that drafted
# nothing (a stop below p_min): a drafting cycle that kept nothing, which the γ policies and the rate guard count.
FREE_DRAFT_S = 0.002


def drafted(outcome: CycleOutcome) -> int:
    """The tokens a cycle counts as drafted: those proposed, or one for a paid draft that proposed none."""
    return outcome.proposed or (1 if outcome.draft_s >= FREE_DRAFT_S else 0)


def verify_shape(n: int) -> float:
    """Prior shape of a parent call's cost by batch size, relative to one token: on CPUs the step from
    one token (matrix-vector) to two (matrix-matrix kernels) costs ~50 %, each further token ~10 %."""
    return 1.0 if n <= 1 else 1.5 + 0.1 * (n - 2)


class CallCost:
    """A parent call on n tokens relative to a one-token call, near the start of a context (`cost(n)`), and the same
    after `pos` positions of context (`cost.at(pos)(n)`: deep in an edit's context a long call costs more against a
    one-token call than near the start — 1.5x for 32 tokens after 1024 positions against 1.0x for one, 1.5B BF16
    parent, AMD EPYC). `at` is None where nothing was measured deep: the same curve at every depth."""

    def __init__(self, near: Callable[[int], float], at: Optional[Callable[[int], Callable[[int], float]]] = None):
        self.near = near
        self._at = at
        self._bucket: Optional[tuple[int, Callable[[int], float]]] = None

    def __call__(self, n: int) -> float:
        return self.near(n)

    def at(self, pos: int) -> Callable[[int], float]:
        """The curve after `pos` positions (computed once per DEPTH_STEP positions)."""
        if self._at is None:
            return self.near
        b = pos // DEPTH_STEP
        if self._bucket is None or self._bucket[0] != b:
            self._bucket = (b, self._at(b * DEPTH_STEP))
        return self._bucket[1]


DEPTH_STEP = 64  # positions over which a depth's curve is taken as one


class FixedGamma:
    def __init__(self, gamma: int):
        self.gamma = max(0, int(gamma))

    def draft_length(self) -> int:
        return self.gamma

    def update(self, outcome: CycleOutcome) -> None:
        pass

    def __repr__(self) -> str:
        return f"fixed({self.gamma})"


def expected_tokens(alpha: float, g: int) -> float:
    if g == 0:
        return 1.0
    if alpha >= 0.999:
        return g + 1.0
    return (1.0 - alpha ** (g + 1)) / (1.0 - alpha)


def best_draft_length(rate: Callable[[int], float], gamma_max: int) -> tuple[int, float]:
    """The draft length γ in 0..gamma_max with the highest `rate(γ)` (tokens per unit of cost), and that rate.
    A longer γ replaces the best shorter one only when it promises TIE_MARGIN more (on near ties the shorter
    draft wastes less when the estimate is off); γ = 0 is the parent alone."""
    best, best_rate = 0, rate(0)
    for gamma in range(1, gamma_max + 1):
        r = rate(gamma)
        if r > best_rate * TIE_MARGIN:
            best, best_rate = gamma, r
    return best, best_rate


def copy_length(verify_cost: Callable[[int], float], longest: int) -> int:
    """The draft length a copied answer is planned at: the one with the most tokens per unit of a parent call's cost
    (`verify_cost`, relative to one token) at COPY_ALPHA per token, among those whose call was measured (`longest`:
    the longest call measured; beyond it a figure is an extrapolation, and not planned on), never below
    SUFFIX_GAMMA_MAX (what plain suffix drafts are capped at)."""
    top = max(0, min(COPY_GAMMA_MAX, longest - 1))
    best = best_draft_length(lambda g: expected_tokens(COPY_ALPHA, g) / verify_cost(g + 1), top)[0]
    return max(SUFFIX_GAMMA_MAX, best)


class Acceptance:
    """Per-token acceptance as decayed counts of accepted draft tokens and of rejections (one per cycle that
    stopped short), so alpha = acc / (acc + rej) is the per-token acceptance of a geometric model — each
    drafted token is kept with probability alpha until the first rejection — which is exactly the model
    behind E(alpha, γ). Decay lets it follow a drift within an answer. The prior counts as `weight`
    observed tokens."""

    def __init__(self, prior: float = 0.5, weight: float = PRIOR_PSEUDO_COUNTS, decay: float = 0.85):
        self.acc, self.rej = prior * weight, (1 - prior) * weight
        self.decay = decay

    @property
    def alpha(self) -> float:
        return self.acc / max(1e-9, self.acc + self.rej)

    def observe(self, accepted: int, proposed: int) -> None:
        """One cycle: `accepted` of `proposed` drafted tokens kept (nothing to learn from a cycle without)."""
        if proposed:
            self.acc = self.decay * self.acc + accepted
            self.rej = self.decay * self.rej + (1 if accepted < proposed else 0)


class AdaptiveGamma:
    """γ from EMA estimates of acceptance (`Acceptance`), draft cost per token and verify cost per batch
    size: after every cycle, the γ in 0..gamma_max with the most expected tokens per second."""

    def __init__(self, gamma_max: int = GAMMA_MAX, gamma_init: int = DEFAULT_GAMMA, decay: float = 0.85,
                 probe_every: int = 16, alpha_prior: float = 0.5, verify_prior: Optional[dict[int, float]] = None,
                 draft_prior: Optional[float] = None, prior_counts: float = PRIOR_PSEUDO_COUNTS):
        self.gamma_max = gamma_max
        self.gamma = gamma_init
        self.decay = decay
        self.probe_every = probe_every
        self.acceptance = Acceptance(alpha_prior, prior_counts, decay)
        self.t_draft: Optional[float] = draft_prior
        self.t_verify: dict[int, float] = dict(verify_prior or {})
        self._since_draft = 0
        self._probe = False

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha

    def _ema(self, old: Optional[float], new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def update(self, outcome: CycleOutcome) -> None:
        n = drafted(outcome)
        if n:
            self.acceptance.observe(outcome.accepted, n)
            self.t_draft = self._ema(self.t_draft, outcome.draft_s / n)
        self.t_verify[outcome.scored] = self._ema(self.t_verify.get(outcome.scored), outcome.verify_s)
        self.gamma = self._choose()
        # After probe_every cycles without drafting, draft one token once: acceptance may have changed.
        self._since_draft = 0 if n or self.gamma else self._since_draft + 1
        self._probe = self._since_draft >= self.probe_every
        if self._probe:
            self._since_draft = 0

    def _verify_cost(self, n: int) -> Optional[float]:
        """Measured cost of a parent call on n tokens, else the nearest measured size scaled by the prior."""
        if n in self.t_verify:
            return self.t_verify[n]
        if not self.t_verify:
            return None
        k = min(self.t_verify, key=lambda m: (abs(m - n), m))
        return self.t_verify[k] * verify_shape(n) / verify_shape(k)

    def _choose(self) -> int:
        if self.t_draft is None or not self.t_verify:
            return self.gamma
        alpha, t_draft = self.alpha, self.t_draft

        def rate(gamma: int) -> float:
            return expected_tokens(alpha, gamma) / max(gamma * t_draft + (self._verify_cost(gamma + 1) or 0.0), 1e-9)

        return best_draft_length(rate, self.gamma_max)[0]

    def draft_length(self) -> int:
        return 1 if self.gamma == 0 and self._probe else self.gamma

    def __repr__(self) -> str:
        return f"adaptive(gamma={self.gamma}, alpha={self.alpha:.2f})"


class RateGuard:
    """A plan's safety net within an answer: wraps the plan's γ policy and, once the answer's drafting has run
    GUARD_MIN_CYCLES cycles at a rate below GUARD_RATIO of the parent's alone, drafts nothing more (the parent alone)
    until the answer starts to repeat a source: the engine asks the drafter each token whether a copy is on offer at
    no cost (Drafter.offers: a suffix lookup, microseconds) and `reopen`s the guard when one is, which then judges the
    drafting afresh (an answer that opens with a novel sentence and then rewrites a file copies the file). The
    parent's rate is measured in the same answer when it has run plain parent
    steps (cycles without a draft: same machine, same moment), else predicted by `parent_step_s(position)`
    (this machine's calibrated one-token call at that context position). The planner then learns the answer's
    measured speedup as for any other answer."""

    def __init__(self, inner, parent_step_s: Callable[[int], float], position: int):
        self.inner = inner
        self.parent_step_s = parent_step_s
        self.position = position
        self.tripped_at: Optional[int] = None  # tokens into the answer when drafting stopped
        self._tokens = 0  # tokens of drafting cycles
        self._seconds = 0.0
        self._cycles = 0
        self._plain: list[float] = []  # one-token parent calls measured in this answer
        self._made = 0
        self.reopened = 0  # times it drafted again after resting

    def draft_length(self) -> int:
        return 0 if self.tripped_at is not None else self.inner.draft_length()

    def update(self, outcome: CycleOutcome) -> None:
        self.inner.update(outcome)
        made = outcome.accepted + outcome.free + 1
        self._made += made
        self.position += made
        if not drafted(outcome) and not outcome.free:  # a plain parent step (one token)
            self._plain.append(outcome.verify_s)
            return
        self._cycles += 1
        self._tokens += made
        self._seconds += outcome.draft_s + outcome.verify_s
        if self.tripped_at is None and self._cycles >= GUARD_MIN_CYCLES and self._seconds > 0:
            if self._tokens / self._seconds < GUARD_RATIO / self._parent_s():
                self.tripped_at = self._made

    @property
    def resting(self) -> bool:
        """Tripped: drafting nothing until `reopen`."""
        return self.tripped_at is not None

    def reopen(self) -> None:
        """Draft again (a copy is on offer), judged afresh over GUARD_MIN_CYCLES more cycles."""
        self.tripped_at = None
        self._tokens, self._seconds, self._cycles = 0, 0.0, 0
        self.reopened += 1

    def _parent_s(self) -> float:
        if len(self._plain) >= 2:
            return sorted(self._plain)[len(self._plain) // 2]
        return self.parent_step_s(self.position)

    def __repr__(self) -> str:
        return f"guarded({self.inner!r}{', tripped' if self.tripped_at is not None else ''})"
