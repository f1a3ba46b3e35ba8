"""The `auto` policy's planner (`AutoPlanner`): per prompt, predict each candidate plan's decode-phase
speedup over the parent from this machine's measured costs (system.calibration), the prompt's route and
its copy potential, and run the best one; never a plan predicted below 1.0x (the parent alone is the floor).

A copied answer is drafted as far as the parent's measured call-cost curve pays (`copy_cap`): the suffix drafts of
every plan that has them, and with a prediction (Predicted Outputs) the plan is suffix drafts alone — the prediction
and the prompt draft, no draft model is paid for an answer that is already written down (its drafts stack on the
plan's: runtime.Runtime.engine). A mix of suffix and model drafts leaves the model out while its answer copies
(decoding.drafters.FallbackDrafter).

Predictions start from priors and follow what the session measures: after each answer the measured
speedup of the plan that ran updates that plan's estimate for the tier. Within an answer, the model
drafter's adaptive draft length drops to 0 (parent steps, with an occasional probe) when acceptance
drifts down, which is the re-plan at cycle grain."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from specquant_cli.decoding.gamma import (
    GAMMA_MAX,
    SUFFIX_GAMMA_MAX,
    best_draft_length,
    copy_length,
    expected_tokens,
    verify_shape,
)
from specquant_cli.decoding.rounds import best_calls
from specquant_cli.family.roles import PARENT_ROLE, STANDARD_DRAFTS
from specquant_cli.routing.plan import Plan, PlanContext

# Per-token acceptance prior of a q4 draft with the parent's own KV cache (Spec-Bench on the 1.5B
# family: 89 %; lower on a true F16 base, see the provenance caveat), and of q8.
ALPHA_PRIOR = {"q4": 0.85, "q8": 0.95}
DRAFT_RATIO_PRIOR = {"q4": 0.4, "q8": 0.7}  # a draft step relative to a one-token parent call (CPU)
# Copy runs: the share of an answer that repeats its context is taken to be the prompt's copy potential,
# and suffix drafts speed those tokens up by COPY_GAIN (prior: 3.3-3.6 tokens per parent call at ~1.2
# one-token costs per call, measured on Spec-Bench summarization); the rest runs at the parent's pace, or
# at a model draft's when one fills in between copy runs.
COPY_GAIN = 2.5
COPY_SCORED = 5  # tokens per parent call behind COPY_GAIN (3.3-3.6 kept + the parent's own + a miss)
LEARN_RATE = 0.3  # weight of one measured answer in the session's estimate
# A model draft must be predicted this much above the parent to run: the cost model uses the fastest of
# several calibration timings, so it is optimistic by a few percent. Draft-free drafts need no margin: when nothing
# matches they propose nothing and the cycle is a plain parent step.
MODEL_MARGIN = 1.03
# A draft role other than the family's own q4/q8 (a recipe such as q4i, q3g) must also be predicted this much
# above q4's plan of the same kind to replace it: with six drafts to choose from, the best-looking of several
# small-sample estimates is optimistic (the winner's curse).
RECIPE_MARGIN = 1.03
# A second drafting level (`stacked-<role>`: suffix proposals the draft model verifies in one call) is priced
# from the draft's measured batch curve: a proposal is on offer at a share of the draft's steps equal to the
# prompt's copy potential, and each proposed token is kept with LEVEL2_ALPHA until the first miss (measured on
# Spec-Bench, AMD EPYC: 62-70 %). Where the batch curve is measured it replaces the plain form of the draft.
LEVEL2_ALPHA = 0.65
# The prompt lengths (tokens) and the answer length over which usable_roles asks which drafts auto picks.
USABLE_PROMPTS = (0, 128, 512)
USABLE_ANSWER = 256


def copy_potential(tokens: Sequence[int], n: int = 3) -> float:
    """Share of the prompt's positions whose preceding n-gram occurred earlier in the prompt: how much of
    the context an n-gram index can match. Long, repetitive contexts (code, documents) score high."""
    if len(tokens) <= n + 1:
        return 0.0
    arr = np.asarray(tokens, dtype=np.int64)
    seen, hits = set(), 0
    for i in range(n, len(arr)):
        g = arr[i - n:i].tobytes()
        hits += g in seen
        seen.add(g)
    rep = hits / (len(arr) - n)
    length = min(1.0, len(arr) / 1000)  # a long context is often quoted back (summaries, RAG, edits)
    return round(min(1.0, 0.5 * rep + 0.5 * length), 4)


@dataclass
class Candidate:
    name: str  # the drafter ("parent" for none)
    drafter: Optional[str]
    predicted: float  # decode-phase speedup over the parent
    gamma: int
    why: str
    source: str = "prior"  # prior | session (measured this session)
    needs: float = 1.0  # predicted speedup it must reach to run (MODEL_MARGIN for model drafts)
    model: bool = False  # a model drafts alone (its draft length adapts within the answer)

    @property
    def gamma_policy(self) -> str:
        """How the plan's draft length is chosen (routing.plan.GammaPolicyKind): a model alone adapts from
        the calibration, suffix drafts (alone or mixed) size their own drafts up to a cap."""
        return "none" if self.drafter is None else "calibrated" if self.model else "capped"


@dataclass
class AutoState:
    """What the session has measured: decode speedup per (tier, drafter)."""

    measured: dict[tuple[str, str], float] = field(default_factory=dict)

    def observe(self, tier: str, drafter: str, speedup: float) -> None:
        old = self.measured.get((tier, drafter))
        self.measured[(tier, drafter)] = speedup if old is None else (1 - LEARN_RATE) * old + LEARN_RATE * speedup


def _model_speedup(alpha: float, draft_cost, verify_cost, per_cycle=None) -> tuple[float, int]:
    """Best predicted decode speedup over draft lengths, with the tokens a cycle yields taken from the
    calibration's measured runs when there are some, else from the geometric model E(alpha, g)."""
    def speedup(gamma: int) -> float:
        if gamma == 0:
            return 1.0  # the parent alone, by definition
        tokens = per_cycle[gamma - 1] if per_cycle and len(per_cycle) >= gamma else expected_tokens(alpha, gamma)
        return tokens / (draft_cost(gamma) + verify_cost(gamma + 1))

    gamma, best = best_draft_length(speedup, GAMMA_MAX)
    return best, gamma


def copy_gain(calibration) -> float:
    """COPY_GAIN for one of `calibration.batch` sequences decoding together: a suffix draft's extra tokens
    cost as much more as a call of COPY_SCORED tokens per sequence costs more in the batch than alone (at 8
    sequences on a CPU a call is no longer nearly flat in its tokens, so copying pays far less)."""
    single = getattr(calibration, "single", None)
    if single is None:
        return COPY_GAIN
    return COPY_GAIN * min(1.0, single.verify_cost(COPY_SCORED) / calibration.verify_cost(COPY_SCORED))


def stacked_step(calibration, role: str, copy: float) -> Optional[float]:
    """A draft step with a second level, relative to the plain step: the cheapest mix over proposal lengths k
    of a plain step (no proposal on offer) and a call on 1 + k tokens that yields the kept proposals too.
    None when the draft's batch curve was not measured."""
    from specquant_cli.decoding.registry import LEVEL2_MAX

    calls = getattr(calibration, "draft_call_s", {}).get(role) if calibration is not None else None
    if not calls:
        return None
    step = calibration.draft_call(role, 1)
    best = 1.0
    for k in range(1, LEVEL2_MAX + 1):
        tokens = 1.0 + copy * (expected_tokens(LEVEL2_ALPHA, k) - 1.0)
        cost = (1.0 - copy) * step + copy * calibration.draft_call(role, 1 + k)
        best = min(best, cost / step / tokens)
    return best


def in_batch(calibration) -> bool:
    """The costs are a batch view (Calibration.for_batch) of more than one sequence, with its single costs."""
    return calibration is not None and getattr(calibration, "batch", 1) > 1 and \
        getattr(calibration, "single", None) is not None


def batch_speedup(calibration, role: str, alpha: float, runs, position: int = 0) -> tuple[float, int]:
    """(speedup, draft length) of `role`'s drafts for one of B sequences decoding together, priced per batch
    round (decoding.rounds): every sequence of the batch drafting in step, their draft calls and the parent's
    verification shared, against the parent's round over the B sequences, after `position` positions (those of
    the whole KV cache: the other sequences' included). (1.0, 0) when no draft length lowers the batch's time per
    token: the round pacer then drafts nothing, whatever the plan."""
    one = calibration.single.at(position) if position else calibration.single
    g, s = best_calls(one, role, calibration.batch, calibration.batch, alpha, runs)
    return s, g


def candidates(tier: str, copy: float, roles: Sequence[str], calibration=None,
               state: Optional[AutoState] = None, position: int = 0, prompt_tokens: int = 0,
               answer_tokens: int = 0) -> list[Candidate]:
    """Every plan's predicted decode speedup, best first: the parent, suffix drafts, each model draft the
    family has (q4 and q8 from priors when uncalibrated; any other draft role, e.g. the recipes q4i, q3g,
    only once this machine's calibration has measured it), its two-level form when its batch curve is
    measured, and suffix drafts mixed with each of those. Costs are taken at context `position` where the
    calibration measured how they grow with it; a model draft's import of the parent's cache of the prompt
    (`prompt_tokens`), once per answer, is spread over `answer_tokens` where it was measured."""
    from specquant_cli.decoding.registry import DRAFTERS, model_draft_roles

    depth = position + getattr(calibration, "beside", 0)  # the other sequences' cells are read too
    if calibration is not None and depth and hasattr(calibration, "at"):
        calibration = calibration.at(position)
    vc = calibration.verify_cost if calibration else verify_shape
    out = [Candidate("parent", None, 1.0, 0, "the floor: the parent alone")]
    suffix = 1.0 / (copy / copy_gain(calibration) + (1.0 - copy))
    out.append(Candidate("suffix", "suffix", suffix, SUFFIX_GAMMA_MAX,
                         f"draft-free, nothing lost when nothing matches: copy potential {copy:.2f}"))
    measured = calibration.draft_step_s if calibration else {}
    for role in model_draft_roles(roles):
        if role not in measured and role not in ALPHA_PRIOR:
            continue
        ratio = (calibration.draft_ratio(role) if calibration else None) or DRAFT_RATIO_PRIOR.get(role, 0.4)
        alpha = (calibration.agreement.get(role) if calibration else None) or ALPHA_PRIOR.get(role, 0.85)
        runs = calibration.tokens_per_cycle.get(role) if calibration else None
        cycle = (lambda g, r=role: calibration.draft_cycle(r, g)) if role in measured else (lambda g, k=ratio: g * k)
        s, g = _model_speedup(alpha, cycle, vc, runs)
        stacked = stacked_step(calibration, role, copy) if role in measured else None
        two_level = stacked is not None and f"stacked-{role}" in DRAFTERS
        if two_level:
            # The two-level form replaces the plain one: with no proposal on offer its step is the plain step,
            # and its lower level sizes each proposal from the draft's batch curve and the acceptance it sees.
            s, g = _model_speedup(alpha, lambda g, r=role, k=stacked: calibration.draft_cycle(r, g) * k, vc, runs)
        if role in measured and in_batch(calibration):  # beside other sequences: priced per batch round
            s, g = batch_speedup(calibration, role, alpha, runs, depth)
        if two_level:
            out.append(Candidate(f"stacked-{role}", f"stacked-{role}", s, g, f"{role} drafts, its steps speculated "
                                 f"by suffix proposals ({stacked:.2f}x the cost of a plain step at copy potential "
                                 f"{copy:.2f}), acceptance prior {alpha:.0%}, best draft length {g}",
                                 needs=MODEL_MARGIN, model=True))
            out += _mixed(f"stacked-{role}", s, g, copy)
            continue
        out.append(Candidate(role, role, s, g, f"{role} step {ratio:.2f}x a parent step, acceptance prior "
                                               f"{alpha:.0%}, best draft length {g}", needs=MODEL_MARGIN, model=True))
        out += _mixed(role, s, g, copy)
    if not in_batch(calibration):
        out += _chains(calibration, roles, vc)
    _charge_imports(out, calibration, prompt_tokens, answer_tokens)
    if state:
        for c in out:
            m = state.measured.get((tier, c.name))
            if m is not None and c.drafter:
                c.predicted, c.source = m, "session"
    _raise_recipe_bars(out)
    return sorted(out, key=lambda c: -c.predicted)


def chain_step(calibration, sibling: str, role: str) -> Optional[tuple[float, int]]:
    """(cost, proposal length): a step of `role` with `sibling` proposing k tokens after each of its picks, relative
    to `role`'s plain step — the cheapest over k of k sibling steps plus one call of `role` on 1 + k tokens, per
    token that yields (E(alpha, k), alpha the sibling's measured agreement with the parent, standing for its
    agreement with `role`). None when either was not measured."""
    from specquant_cli.decoding.registry import LEVEL2_MAX

    step = calibration.draft_step_s.get(role) if calibration is not None else None
    alpha = calibration.agreement.get(sibling) if calibration is not None else None
    if not step or not alpha or sibling not in calibration.draft_step_s or not calibration.draft_call_s.get(role):
        return None
    best, k_best = 1.0, 0
    for k in range(1, LEVEL2_MAX + 1):
        cost = calibration.draft_cycle(sibling, k) * calibration.parent_call_s[1] + calibration.draft_call(role, 1 + k)
        ratio = cost / step / expected_tokens(alpha, k)
        if ratio < best:
            best, k_best = ratio, k
    return best, k_best


def _chains(calibration, roles: Sequence[str], vc) -> list[Candidate]:
    """Three-level plans (`chain-<sibling>-<role>`, registered for the family's siblings): `role`'s drafts priced at
    its step as the sibling makes it cheaper (chain_step); only where that is below the plain step."""
    from specquant_cli.decoding.registry import DRAFTERS

    out = []
    for name, spec in DRAFTERS.items():
        if not name.startswith("chain-") or not set(spec.roles) <= set(roles) or calibration is None:
            continue
        role, sibling = spec.roles
        priced = chain_step(calibration, sibling, role)
        if priced is None or priced[0] >= 1.0:
            continue
        factor, k = priced
        alpha = calibration.agreement.get(role, ALPHA_PRIOR.get(role, 0.85))
        s, g = _model_speedup(alpha, lambda g, r=role, f=factor: calibration.draft_cycle(r, g) * f, vc,
                              calibration.tokens_per_cycle.get(role))
        out.append(Candidate(name, name, s, g, f"{sibling} proposes {k} tokens per {role} call ({role}'s step at "
                                               f"{factor:.2f}x its plain cost), {role}'s acceptance {alpha:.0%}, best "
                                               f"draft length {g}", needs=MODEL_MARGIN, model=True))
    return out


def _charge_imports(cands: list[Candidate], calibration, prompt_tokens: int, answer_tokens: int) -> None:
    """Every plan with a model draft catches up on the prompt once: a draft that shares the parent's network
    imports its cache (where the import was measured), a sibling prefills the prompt itself (where its prefill was
    measured); the plan's decode speedup over an answer of `answer_tokens` falls by that time (in one-token parent
    calls)."""
    from specquant_cli.decoding.registry import DRAFTERS

    if calibration is None or not answer_tokens or not hasattr(calibration, "import_cost"):
        return
    for c in cands:
        spec = DRAFTERS.get(c.drafter) if c.drafter else None
        if not spec or not spec.roles:
            continue
        costs = [calibration.prefill_cost(r, prompt_tokens) if r in spec.prefills
                 else calibration.import_cost(r, prompt_tokens) for r in spec.roles]
        cost = sum(x for x in costs if x)
        if cost and c.predicted > 0:
            calls = cost / calibration.parent_call_s[1]
            c.predicted = answer_tokens / (answer_tokens / c.predicted + calls)


def _mixed(name: str, s: float, g: int, copy: float) -> list[Candidate]:
    """`suffix+name`: suffix drafts cover the copy share of the answer, `name`'s drafts (predicted `s`) the
    rest; time per token adds up. None when `name`'s drafts do not clear MODEL_MARGIN themselves: a draft that
    barely pays alone is within the cost model's error, and mixed in it only adds the model's calls."""
    from specquant_cli.decoding.registry import DRAFTERS

    if f"suffix+{name}" not in DRAFTERS or s < MODEL_MARGIN:
        return []
    mix = 1.0 / (copy / COPY_GAIN + (1.0 - copy) / s)
    return [Candidate(f"suffix+{name}", f"suffix+{name}", mix, g, f"suffix drafts on copy runs, {name} elsewhere",
                      needs=MODEL_MARGIN)]


def _raise_recipe_bars(cands: list[Candidate]) -> None:
    """A recipe draft or a sibling (alone or mixed, plain or two-level, or a chain) must beat q4's plan of the same
    kind by RECIPE_MARGIN: the best-looking of several drafts measured on a few hundred tokens is optimistic. On
    Spec-Bench (AMD EPYC kind) the 0.5B sibling, predicted a few percent above q4 from its cheaper step, ran at q4's
    decode speed and below it end to end (its own prefill)."""
    by = {c.name: c for c in cands}
    for c in cands:
        role = c.name.removeprefix("suffix+").removeprefix("stacked-")
        if c.drafter is None or role == "suffix" or role in STANDARD_DRAFTS:
            continue
        mix = "suffix+" if c.name.startswith("suffix+") else ""
        ref = by.get(f"{mix}stacked-q4") or by.get(f"{mix}q4")
        if ref is not None:
            c.needs = max(c.needs, ref.predicted * RECIPE_MARGIN)


def choose(cands: list[Candidate]) -> Candidate:
    """The best candidate that clears its bar (a draft-free one wins ties with the parent); the parent when
    none does. Never a plan predicted below 1.0x."""
    ok = [c for c in cands if c.drafter is not None and c.predicted >= c.needs]
    if not ok:
        return next(c for c in cands if c.drafter is None)
    return max(ok, key=lambda c: (round(c.predicted, 3), "suffix" in c.name))  # ties: the free drafts too


def copy_cap(calibration, position: int = 0) -> tuple[int, str]:
    """(draft length, why) of the suffix and prediction drafts of a copied answer: the longest the parent's measured
    call-cost curve pays at the context `position` (decoding.gamma.copy_length), within the calls measured; a
    calibration stored before the long calls were measured, or none, gives the plain suffix cap."""
    if calibration is None:
        return SUFFIX_GAMMA_MAX, "uncalibrated: the suffix policy's cap"
    if hasattr(calibration, "at") and position:
        calibration = calibration.at(position)
    cap = copy_length(calibration.verify_cost, calibration.longest_call)
    if calibration.longest_call <= SUFFIX_GAMMA_MAX:
        return cap, (f"parent calls measured up to {calibration.longest_call} tokens: the suffix policy's cap; "
                     "specquant calibrate measures longer ones")
    return cap, f"the parent's measured call-cost curve, up to {calibration.longest_call} tokens"


def usable_roles(roles: Sequence[str], calibration) -> tuple[str, ...]:
    """The draft roles of `roles` auto's plans use for the common prompt, as `calibration` prices them: the roles of
    every candidate that clears its bar for a prompt of no, half or full copy potential and of up to USABLE_PROMPTS[-1]
    tokens (a draft's import or prefill of the prompt charged), answering USABLE_ANSWER tokens: what is loaded ahead.
    A plan may still pick another draft (far into a long context the costs move, and what the session measures moves
    the bars); that one loads when picked. On the AMD EPYC kind the 1.5B family's q8 (a step 0.86 of the parent's
    call) and its sibling (held to q4's price) are not loaded ahead."""
    from specquant_cli.decoding.registry import DRAFTERS

    out: list[str] = []
    for copy in (0.0, 0.5, 1.0):
        for n in USABLE_PROMPTS:
            position = n + USABLE_ANSWER // 2
            for c in candidates("high", copy, roles, calibration, position=position, prompt_tokens=n,
                                answer_tokens=USABLE_ANSWER):
                spec = DRAFTERS.get(c.drafter) if c.drafter else None
                if spec is not None and c.predicted >= c.needs:
                    out += [r for r in spec.roles if r in roles]
    return tuple(dict.fromkeys(out))


class AutoPlanner:
    """The auto policy's planner (routing.plan.Planner): `plan` predicts every candidate from the context
    and runs the best; `observe` feeds the decode speedup an answer achieved (vs the calibrated parent step)
    back into the session's estimate for its tier and plan."""

    MIN_OBSERVED_TOKENS = 8  # a shorter answer's speed is mostly noise

    def __init__(self):
        self.state = AutoState()
        self._calibration = None  # the costs the last plan was made with

    def plan(self, ctx: PlanContext) -> Plan:
        self._calibration = ctx.calibration
        cands = candidates(ctx.tier or "high", ctx.copy, ctx.roles, ctx.calibration, self.state, ctx.position,
                           ctx.prompt_tokens, ctx.answer_tokens)
        shown = tuple({"plan": c.name, "predicted_speedup": round(c.predicted, 3), "gamma": c.gamma, "why": c.why,
                       "source": c.source} for c in cands)
        cap, cap_why = copy_cap(ctx.calibration, ctx.position)
        if ctx.prediction:  # the answer is written down: drafted as far as a call pays, and no model paid for it
            return Plan(ctx.policy, ctx.tier, PARENT_ROLE, "suffix", gamma_policy="capped", gamma_cap=cap,
                        candidates=shown, why=f"a prediction of {ctx.prediction} tokens: drafted from it and the "
                                              f"prompt, up to {cap} tokens a call ({cap_why}), no draft model")
        best = choose(cands)
        why = f"{best.name} predicted {best.predicted:.2f}x ({best.source}): {best.why}"
        if best.drafter is None:
            why = "no candidate predicted above 1.0x: " + why
        elif best.gamma_policy == "capped":
            why += f"; copy runs drafted up to {cap} tokens a call ({cap_why})"
        return Plan(ctx.policy, ctx.tier, PARENT_ROLE, best.drafter, gamma_policy=best.gamma_policy,
                    gamma_cap=cap if best.gamma_policy == "capped" else None, candidates=shown, why=why)

    def usable(self, roles: Sequence[str], calibration) -> tuple[str, ...]:
        return usable_roles(roles, calibration)

    def observe(self, answer) -> None:
        cal, rec = self._calibration, answer.last
        if cal is None or rec is None or rec.new_tokens < self.MIN_OBSERVED_TOKENS:
            return
        self.state.observe(answer.route.tier, answer.plan.drafter or "parent",
                           rec.decode_tokens_per_s * cal.parent_call_s[1])
