"""Policies: which model generates (the target) and what drafts for it, per routed tier."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from specquant_cli.errors import InputError

POLICIES = ("paper", "parent", "spec-q4", "spec-q8", "ngram", "adaptive", "quasar", "q4", "q8")
LOSSY = {"q4": "q4 alone: lossy, output differs from F16",
         "q8": "q8 alone: lossy, output differs from F16",
         "quasar": "n-gram drafts verified by q8: lossy against F16"}
DEFAULT_POLICY = "paper"


@dataclass(frozen=True)
class Plan:
    policy: str
    tier: Optional[str]
    target: str  # family role that generates: f16, q8, q4
    draft: Optional[str]  # None | "q4" | "q8" | "ngram" | "ngram+q4"
    adaptive_gamma: bool = False
    lossy: bool = False

    @property
    def roles(self) -> list[str]:
        """Family roles this plan loads, target first."""
        extra = [r for r in ("q4", "q8") if self.draft and r in self.draft.split("+")]
        return [self.target] + [r for r in extra if r != self.target]

    def describe(self) -> str:
        how = f"{self.target} alone" if not self.draft else f"{self.draft} drafts, {self.target} verifies"
        return how + (" (lossy)" if self.lossy else "")

    def to_dict(self) -> dict:
        return {**asdict(self), "description": self.describe()}


def check_policy(name: str) -> str:
    if name not in POLICIES:
        raise InputError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return name


def plan_for(policy: str, tier: Optional[str]) -> Plan:
    check_policy(policy)
    if policy == "paper":
        draft = {"low": "q4", "medium": "q8", "high": None}[tier or "high"]
        return Plan(policy, tier, "f16", draft)
    table = {
        "parent": ("f16", None, False), "spec-q4": ("f16", "q4", False), "spec-q8": ("f16", "q8", False),
        "ngram": ("f16", "ngram", False), "adaptive": ("f16", "ngram+q4", True),
        "quasar": ("q8", "ngram", True), "q4": ("q4", None, False), "q8": ("q8", None, False),
    }
    target, draft, adaptive = table[policy]
    return Plan(policy, tier, target, draft, adaptive, policy in LOSSY)
