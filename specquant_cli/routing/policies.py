"""Policies: which model generates (the target) and what drafts for it, per routed tier or per prompt.

One table (`POLICIES`, filled by `register_policy`) from which the policy list, the `--policy` help, the
bench's default set, each plan's roles and the README's policy table are derived.

A policy either maps the route to a plan by its row (`drafter`, `by_tier`), or names a `Planner` that
decides per prompt and learns from each answer (`auto`); both give a `routing.plan.Plan`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from specquant_cli.decoding.gamma import SUFFIX_GAMMA_MAX
from specquant_cli.decoding.registry import drafter_spec, parse_chain
from specquant_cli.errors import InputError
from specquant_cli.family.roles import PARENT_ROLE, RENDERINGS, draft_roles, is_role_name
from specquant_cli.names import TIERS, Tier
from specquant_cli.routing.plan import GammaPolicyKind, Plan, PlanContext, Planner
from specquant_cli.settings import PolicyTable, register_policy_table


@dataclass(frozen=True)
class PolicySpec:
    """name; help (one line, the README's "what runs"); target: the role that generates; drafter: a name in
    decoding.registry.DRAFTERS (None: the target alone); by_tier: drafter per routed tier, overriding
    `drafter` (the paper's mapping); gamma_policy: how the draft length is chosen (GammaPolicyKind), up to
    gamma_cap for "capped"; lossy: the output is not the parent's; in_bench: part of `specquant bench`'s
    default set; planner: a factory of the `Planner` that decides per prompt instead of the row (the drafts it
    may pick are its own to name: `Planner.usable`, loaded by `Runtime.load_planner_drafts`); roles: further roles
    the policy loads up front."""

    name: str
    help: str
    target: str = PARENT_ROLE
    drafter: Optional[str] = None
    by_tier: Optional[dict[str, Optional[str]]] = None
    gamma_policy: GammaPolicyKind = "fixed"
    lossy: bool = False
    in_bench: bool = True
    gamma_cap: Optional[int] = None
    planner: Optional[Callable[[], Planner]] = None
    roles: tuple[str, ...] = ()

    def drafter_for(self, tier: Optional[Tier]) -> Optional[str]:
        if self.by_tier is not None:
            return self.by_tier[tier or "high"]
        return self.drafter

    @property
    def routed(self) -> bool:
        """Whether the plan depends on the prompt's route (so the routing time is part of its cost)."""
        return self.by_tier is not None or self.planner is not None


POLICIES: dict[str, PolicySpec] = {}
DEFAULT_POLICY = "auto"


def _auto_planner() -> Planner:
    from specquant_cli.routing.auto import AutoPlanner  # imported when first used: numpy, the cost model

    return AutoPlanner()


def _recipe_policies() -> list[PolicySpec]:
    """`spec-<recipe>` for every draft recipe of family.recipes (q4i, q4s, …), described by its recipe."""
    from specquant_cli.family.variants import RECIPES

    return [PolicySpec(f"spec-{r.role}", f"`{r.role}` ({r.help}) drafts, the parent verifies", drafter=r.role,
                       in_bench=False) for r in RECIPES.values()]


def register_policy(spec: PolicySpec) -> PolicySpec:
    for d in {spec.drafter, *(spec.by_tier or {}).values()} - {None}:
        drafter_spec(d)  # fails on an unknown drafter now, not at the first request
    POLICIES[spec.name] = spec
    return spec


for _spec in (
    PolicySpec("auto", "per prompt, the plan with the best predicted speedup from this machine's measured "
               "costs at the prompt's context position, the route and the prompt's copy potential (parent, `suffix`, "
               "each model draft the family has — `q4`, `q8`, recipes such as `q4i`, a sibling model with its own "
               "prefill charged —, its two-level form `stacked-<draft>` once its batch curve is measured, a chain "
               "`chain-<sibling>-<draft>` where that makes the draft's step cheaper, and `suffix+` each); never one "
               "predicted below "
               "1.0x, and an answer whose drafting runs below the parent's rate goes on with the parent alone",
               planner=_auto_planner),
    PolicySpec("paper", "low → `q4` drafts, the parent verifies; medium → `q8` drafts, the parent verifies; high → "
               "the parent alone",
               by_tier={"low": "q4", "medium": "q8", "high": None}),
    PolicySpec("parent", "the parent alone"),
    PolicySpec("spec-q4", "`q4` drafts, the parent verifies", drafter="q4"),
    PolicySpec("spec-q8", "`q8` drafts, the parent verifies", drafter="q8"),
    PolicySpec("stacked-q4", "`q4` drafts with its own steps speculated by suffix drafts over the drafting memory "
               "(a second level `q4` verifies in one call), the parent verifies", drafter="stacked-q4",
               gamma_policy="calibrated", in_bench=False),
    PolicySpec("spec-q4-prefill", "`q4` drafts after its own prompt prefill (no KV import), the parent verifies",
               drafter="q4-prefill", in_bench=False),
    *_recipe_policies(),
    PolicySpec("ngram", "prompt-lookup n-gram drafts (no model call), the parent verifies", drafter="ngram"),
    PolicySpec("suffix", "suffix-match drafts over the prompt, the answer and the session's earlier turns (no "
               "model call), draft length from match length and measured costs, the parent verifies", drafter="suffix",
               gamma_policy="capped", gamma_cap=SUFFIX_GAMMA_MAX),
    PolicySpec("adaptive", "n-gram drafts (matches of 3+ tokens) when the context offers them; after 32 "
               "generated tokens `q4` drafts otherwise; draft length adapted to measured costs and acceptance",
               drafter="ngram+q4", gamma_policy="adaptive"),
    PolicySpec("quasar", "n-gram drafts verified by `q8`, draft length adapted", target="q8", drafter="ngram",
               gamma_policy="adaptive", lossy=True),
    PolicySpec("q4", "the `q4` variant alone", target="q4", lossy=True),
    PolicySpec("q8", "the `q8` variant alone", target="q8", lossy=True),
):
    register_policy(_spec)


def bench_policies() -> list[str]:
    return [n for n, s in POLICIES.items() if s.in_bench]


def policy_help() -> str:
    return ", ".join(f"{n} (lossy)" if s.lossy else n for n, s in POLICIES.items()) + ", spec-<role>, " \
        "spec-chain-<sibling>-<role>"


def policy_spec(name: str) -> PolicySpec:
    """The registered policy `name`, or `spec-<role>` for any other draft role (a variant made by
    `quantize --grade BPW --role NAME`): that role drafts, the parent verifies. A pure lookup: nothing is registered
    here (a family's role drafters are registered when it is opened), and whether the family has the role is
    checked when its models load."""
    spec = POLICIES.get(name)
    if spec is not None:
        return spec
    chain = parse_chain(name.removeprefix("spec-")) if name.startswith("spec-") else None
    if chain is not None:
        return PolicySpec(name, f"the sibling `{chain[0]}` drafts for `{chain[1]}`, which verifies its proposals in "
                          "one call; the parent verifies", drafter=name.removeprefix("spec-"),
                          gamma_policy="calibrated", in_bench=False)
    role = name.removeprefix("spec-")
    if role != name and is_role_name(role) and role != PARENT_ROLE and role not in RENDERINGS:
        from specquant_cli.decoding.registry import DRAFTERS

        taken = DRAFTERS.get(role)
        if taken is None or taken.roles == (role,):  # not a name taken by another drafter (ngram, suffix)
            return PolicySpec(name, f"`{role}` drafts, the parent verifies", drafter=role, in_bench=False)
    raise InputError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}, spec-<role> for "
                     "another draft role of the family, or spec-chain-<sibling>-<role> for a sibling drafting for "
                     "a role")


def check_policy(name: str, roles: Optional[Sequence[str]] = None, siblings: Optional[Sequence[str]] = None) -> str:
    """`name` is a policy (or `spec-<role>`); with a family's `roles`, also one that family can run: every role
    its plans load, over every tier, is there (a planner picks among the family's roles itself); with its `siblings`
    too, a chain `spec-chain-<sibling>-<role>` names a sibling first and a draft of the parent's network second
    (chain_problem), refused before any model loads."""
    spec = policy_spec(name)
    chain = parse_chain(name.removeprefix("spec-")) if name.startswith("spec-") and name not in POLICIES else None
    if chain is not None and roles is not None and siblings is not None:
        why = chain_problem(chain, roles, siblings)
        if why:
            raise InputError(f"policy {name}: {why}")
    if roles is not None and spec.planner is None:
        missing = [r for r in all_roles([name]) if r not in roles]
        if missing:
            raise InputError(f"policy {name}: the family has no {' or '.join(map(repr, missing))} variant "
                             f"(it has: {', '.join(roles)})")
    return name


def chain_problem(chain: tuple[str, str], roles: Sequence[str], siblings: Sequence[str]) -> Optional[str]:
    """Why a family of `roles` and `siblings` cannot run the chain (sibling, role): which of the two is wrong, and the
    chains it can run (none: how to get one); None when it can."""
    sib, role = chain
    drafts = [r for r in draft_roles(roles) if r not in siblings]
    valid = [f"spec-chain-{s}-{r}" for s in siblings for r in drafts]
    if valid:
        can = f"this family's chains: {', '.join(valid)}"
    elif siblings:
        can = "this family has no draft of its own network (q4) to chain"
    else:
        can = ("this family has no chain: it needs a sibling model (quantize --draft-model SMALL.gguf --family FAMILY) "
               "and a draft of its own network (q4)")
    if sib not in siblings and role in siblings:
        return (f"the roles are the wrong way round: {role} is the sibling model, and a chain names the sibling first "
                f"(spec-chain-{role}-{sib}); {can}")
    if sib not in siblings:
        return f"{sib!r} is not a sibling model of this family (a chain's first role is the sibling that drafts); {can}"
    if role in siblings:
        return f"{role!r} is a sibling model too; a chain's second role is a draft of the parent's own network; {can}"
    if role not in drafts:
        return f"the family has no {role!r} draft for the sibling {sib} to draft for; {can}"
    return None


def plan_for(policy: str, tier: Optional[Tier], context: Optional[PlanContext] = None,
             planner: Optional[Planner] = None) -> Plan:
    """The plan `policy` runs for a prompt of `tier`. A policy with a planner asks `planner` (the session's,
    which has learned from earlier answers; a fresh one when not given) with the `context`."""
    spec = policy_spec(policy)
    if spec.planner is not None:
        return (planner or spec.planner()).plan(context or PlanContext(policy, tier))
    drafter = spec.drafter_for(tier)
    return Plan(policy, tier, spec.target, drafter, spec.gamma_policy if drafter else "none", spec.lossy,
                spec.gamma_cap if drafter else None)


def all_roles(policies: list[str]) -> list[str]:
    """Every role any of `policies` loads up front, over every tier: the parent first, then the drafts by name. A
    planner's drafts are not among them: it picks among the family's roles that fit, and names those this machine's
    costs let it use (Planner.usable, loaded by Runtime.load_planner_drafts)."""
    out = {r for p in policies for t in TIERS for r in plan_for(p, t).roles}
    out |= {r for p in policies for r in policy_spec(p).roles}
    return [PARENT_ROLE, *sorted(out - {PARENT_ROLE})]


def markdown_table() -> str:
    """The policy table of docs/policies.md, generated from the registry (specquant_cli.reference writes it)."""
    rows = ["| policy | what runs | output |", "|---|---|---|"]
    for n, s in POLICIES.items():
        name = f"`{n}`" + (" (default)" if n == DEFAULT_POLICY else "")
        rows.append(f"| {name} | {s.help} | {'**lossy**' if s.lossy else '= parent'} |")
    rows.append("| `spec-<role>` | any other draft role of the family (one made by `quantize --grade BPW --role NAME`, "
                "or a sibling model added by `quantize --draft-model`) drafts, the parent verifies | = parent |")
    rows.append("| `spec-chain-<sibling>-<role>` | three levels: the sibling drafts for `<role>` (e.g. `q4`), which "
                "verifies its proposals in one call; the parent verifies `<role>`'s drafts | = parent |")
    return "\n".join(rows)


# The policy settings (--policy, --policies) are declared and checked with this table's names: settings sit below
# it, so it hands them over here.
register_policy_table(PolicyTable(DEFAULT_POLICY, policy_help, check_policy))
