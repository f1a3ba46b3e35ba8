"""What runs for one prompt (`Plan`): the target role, the drafter, and how the draft length γ is chosen
(`GammaPolicyKind`) — so the runtime builds it without asking which policy made it; and the seam of a
policy that decides per prompt (`Planner`, with what it sees: `PlanContext`). The policy table
(routing.policies) names planners; planners (routing.auto) return plans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal, Optional, Protocol

from specquant_cli.names import Tier

# How a plan's draft length γ is chosen (runtime.costs.CostModel.gamma_policy builds the matching
# decoding.gamma policy):
# none: no drafter; fixed: the session's --gamma; adaptive: adapted to measured costs and acceptance, from
# priors; calibrated: adaptive, seeded with this machine's calibration for the draft role; capped: the
# drafter sizes each draft itself, up to `gamma_cap`.
GammaPolicyKind = Literal["none", "fixed", "adaptive", "calibrated", "capped"]


@dataclass
class PlanContext:
    """What a planner sees of one prompt: its route, copy potential, the roles it may pick (the family's,
    those that fit), this machine's measured costs (None: uncalibrated), the prompt's length and the answer's
    (at most: `answer_tokens`), and the length of its prediction (a copied answer). Attention costs grow with the
    context, and a model draft imports the parent's cache of the prompt once per answer. What the session has
    measured so far is the planner's own state."""

    policy: str
    tier: Optional[Tier]
    copy: float = 0.0
    roles: tuple[str, ...] = ()
    calibration: object = None
    prompt_tokens: int = 0
    answer_tokens: int = 0
    prediction: int = 0  # tokens of the text the answer is expected to resemble (Predicted Outputs); 0: none

    @property
    def position(self) -> int:
        """Where the answer mostly decodes: after the prompt and half the answer."""
        return self.prompt_tokens + self.answer_tokens // 2


class Planner(Protocol):
    """A policy that decides per prompt: `plan(context)` before an answer, `observe(answer)` after it (the
    answer's plan, route and last record: what it achieved) — the policy-level twin of a drafter's `feedback`.
    The runtime keeps one per policy for the session, so what it learns carries over to the next prompt.
    Adding a planner is one module plus one row in the policy table (routing.policies:
    `PolicySpec(..., planner=Factory)`)."""

    def plan(self, context: PlanContext) -> Plan: ...

    def observe(self, answer) -> None: ...

    def usable(self, roles: Sequence[str], calibration) -> tuple[str, ...]:
        """The draft roles of `roles` its plans can use on a machine of these measured costs: loaded ahead, the rest
        left on disk (a plan that picks one after all loads it then)."""
        ...


@dataclass(frozen=True)
class Plan:
    """What runs for one prompt: the target role, the drafter (a registry name) and how γ is chosen
    (`gamma_policy`, up to `gamma_cap` when "capped"; "none" without a drafter)."""

    policy: str
    tier: Optional[Tier]
    target: str
    drafter: Optional[str]
    gamma_policy: GammaPolicyKind = "fixed"
    lossy: bool = False
    gamma_cap: Optional[int] = None
    candidates: tuple = field(default=(), compare=False)  # a planner's predictions, best first
    left_out: tuple = field(default=(), compare=False)  # roles a planner could not pick: ({"role", "why"}, ...)
    why: str = ""

    @property
    def roles(self) -> list[str]:
        """Family roles this plan loads, target first."""
        extra = _drafter_roles(self.drafter) if self.drafter else ()
        return [self.target] + [r for r in extra if r != self.target]

    def describe(self) -> str:
        how = f"{self.target} alone" if not self.drafter else f"{self.drafter} drafts, {self.target} verifies"
        return how + (" (lossy)" if self.lossy else "")

    def to_dict(self) -> dict:
        """The plan as JSON (`route --json`): its drafter under the key "draft", as it always was."""
        return {**{("draft" if k == "drafter" else k): v for k, v in asdict(self).items()},
                "description": self.describe()}


def _drafter_roles(name: str) -> tuple[str, ...]:
    """The roles drafter `name` loads; a name not registered yet is a chain's two roles (`chain-<sibling>-<role>`)
    or a role drafting as itself (spec-<role>)."""
    from specquant_cli.decoding.registry import DRAFTERS, parse_chain

    spec = DRAFTERS.get(name)
    if spec is not None:
        return spec.roles
    chain = parse_chain(name)
    return (chain[1], chain[0]) if chain else (name,)
