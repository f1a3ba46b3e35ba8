"""Drafters by name. A spec knows which family roles its drafter loads and how to build one from the
runtime; adding a drafter is one module plus one `register_drafter` call (or one row below)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Protocol

from specquant_cli.decoding.protocols import Drafter, TokenContext
from specquant_cli.errors import InputError
from specquant_cli.family.roles import builtin_draft_roles, draft_roles, is_role_name

# Prompt tokens the adaptive policy's late-woken drafter reads when it cannot import the parent's cache.
# Only there: a window bounds the draft's prefill but costs acceptance on long documents (Spec-Bench
# summarization: 93 % -> 18 % for spec-q4).
DRAFT_WINDOW = 128


class DraftHost(Protocol):
    """What a drafter spec may ask of the runtime that builds it (runtime.drafters.DrafterCache): settings,
    models, measured costs, and the other drafters of the same policy (the one being built for) and scope."""

    p_min: Optional[float]
    kv_import: bool

    def context(self, role: str) -> TokenContext: ...

    def drafter(self, name: str, target: str) -> Drafter:
        """Another registered drafter, of the same policy and scope (a persistent one shared with it)."""
        ...

    def verify_cost(self) -> Callable[[int], float]:
        """A parent call on n tokens relative to one token (measured, or the prior shape)."""
        ...

    def model_gamma(self, role: str):
        """An adaptive γ policy for `role`'s drafts, starting at the session's γ, seeded with this machine's
        measured costs."""
        ...

    def draft_cost(self, role: str) -> Callable[[int], float]:
        """A call of `role`'s model on n tokens relative to one token (its measured batch curve, or the
        prior shape): what a second drafting level weighs its proposals against."""
        ...

    def step_ratio(self, lower: str, upper: str) -> Optional[float]:
        """`lower`'s one-token step relative to `upper`'s one-token call (calibrated; None when either is not)."""
        ...

    def agreement(self, role: str) -> Optional[float]:
        """How often `role`'s greedy token agrees with the parent's (calibrated; None when not measured)."""
        ...

    def pacer(self):
        """The batch's round pacer as this policy's drafters use it (decoding.rounds.Pace) when the drafter
        decodes beside other sequences (a serving slot's), else None."""
        ...

    def fences(self):
        """The code fences of the parent's vocabulary (decoding.fences.Fences)."""
        ...

    def memory(self):
        """The drafting memory of this policy as this scope sees it (decoding.memory.ScopedMemory), shared by every
        drafter of them."""
        ...


@dataclass(frozen=True)
class DrafterSpec:
    """name: the drafter's registry key; roles: family roles it loads (none for draft-free drafters);
    build(host, target_role) -> Drafter; persistent: the runtime keeps one instance for the whole session
    (a drafter with memory across requests), otherwise it builds a fresh one per answer; memory: it reads and
    writes its policy's drafting memory (counted by serve's memory check); prefills: the roles whose own prefill of
    the prompt every answer pays (a sibling model cannot import the parent's cache: auto charges it)."""

    name: str
    roles: tuple[str, ...]
    build: Callable[[DraftHost, str], Drafter]
    persistent: bool = False
    help: str = ""
    memory: bool = False
    prefills: tuple[str, ...] = ()  # roles of `roles` that prefill the prompt themselves (siblings: no KV import)


DRAFTERS: dict[str, DrafterSpec] = {}


def register_drafter(spec: DrafterSpec) -> DrafterSpec:
    DRAFTERS[spec.name] = spec
    return spec


def drafter_spec(name: str) -> DrafterSpec:
    try:
        return DRAFTERS[name]
    except KeyError:
        raise InputError(f"unknown drafter {name!r}; known: {', '.join(DRAFTERS)}") from None


def _model(role: str, window: Optional[int] = None, kv_import: bool = True):
    def build(host: DraftHost, target: str) -> Drafter:
        from specquant_cli.decoding.drafters import ModelDrafter

        parent = host.context(target) if host.kv_import and kv_import else None
        return ModelDrafter(host.context(role), role, host.p_min, window=window, parent=parent, pacer=host.pacer(),
                            role=role)

    return build


def _suffix(host: DraftHost, target: str) -> Drafter:
    from specquant_cli.decoding.suffix import SuffixDrafter

    return SuffixDrafter(verify_cost=host.verify_cost(), memory=host.memory(), fences=host.fences())


# The longest run a second level proposes to the draft model: its batch curve is measured up to 8 tokens.
LEVEL2_MAX = 7


def _chain(sibling: str, role: str):
    """Three levels: `sibling` drafts for `role`, which verifies its proposals in one call and keeps the longest run
    it agrees with; the parent verifies `role`'s drafts. `role` imports the parent's cache, the sibling prefills its
    own; the sibling's proposal lengths are sized from `role`'s call curve and the sibling's measured step."""
    def build(host: DraftHost, target: str) -> Drafter:
        from specquant_cli.decoding.drafters import ModelDrafter, ModelLevel

        low = ModelDrafter(host.context(sibling), sibling, host.p_min, role=sibling)
        lower = ModelLevel(low, host.draft_cost(role), host.step_ratio(sibling, role), host.agreement(sibling),
                           LEVEL2_MAX)
        parent = host.context(target) if host.kv_import else None
        return ModelDrafter(host.context(role), chain_name(sibling, role), host.p_min, parent=parent, lower=lower,
                            pacer=host.pacer(), role=role)

    return build


def chain_name(sibling: str, role: str) -> str:
    """The drafter (and `spec-` policy) name of the chain where `sibling` drafts for `role`."""
    return f"chain-{sibling}-{role}"


def parse_chain(name: str) -> Optional[tuple[str, str]]:
    """(sibling, role) of a chain's name (`chain_name`), None for any other name."""
    parts = name.split("-")
    if len(parts) == 3 and parts[0] == "chain" and all(is_role_name(p) for p in parts[1:]) and parts[1] != parts[2]:
        return parts[1], parts[2]
    return None


def _stacked(role: str, first=None, imports: bool = True):
    """`role` drafts, its own steps speculated by suffix drafts (a second level). Alone, its lower level writes
    the sequence into the policy's memory and reads it; beside a first-level suffix drafter (`first`, of the
    same answer), it reads what that one writes. `imports`: it may import the parent's cache (not a sibling)."""
    def build(host: DraftHost, target: str) -> Drafter:
        from specquant_cli.decoding.drafters import ModelDrafter
        from specquant_cli.decoding.suffix import SuffixDrafter

        memory = first.memory if first is not None else host.memory()
        lower = SuffixDrafter(LEVEL2_MAX, verify_cost=host.draft_cost(role), memory=memory, record=first is None)
        parent = host.context(target) if host.kv_import and imports else None
        return ModelDrafter(host.context(role), f"stacked-{role}", host.p_min, parent=parent, lower=lower,
                            pacer=host.pacer(), role=role)

    return build


# Suffix proposals the parent verifies itself in a mix with a two-level draft: shorter ones go to the draft's
# second level instead, which checks them at a draft call's cost (Spec-Bench, AMD EPYC: the parent kept 81 %
# of a mix's drafts with 2-token suffix runs, 90 % of the two-level draft's alone).
STACKED_SUFFIX_MIN = 4


def _suffix_then(role: str, stacked: bool = False, imports: bool = True):
    def build(host: DraftHost, target: str) -> Drafter:
        from specquant_cli.decoding.drafters import FallbackDrafter

        first = host.drafter("suffix", target)
        make = _stacked(role, first, imports) if stacked else _model(role, kv_import=imports)
        model = make(host, target)
        return FallbackDrafter(first, model, min_tokens=STACKED_SUFFIX_MIN if stacked else 2, activate_after=0,
                               model_gamma=host.model_gamma(role))

    return build


def _ngram(host: DraftHost, target: str) -> Drafter:
    from specquant_cli.decoding.drafters import NGramDrafter

    return NGramDrafter()


def _ngram_then_q4(host: DraftHost, target: str) -> Drafter:
    from specquant_cli.decoding.drafters import FallbackDrafter, NGramDrafter

    return FallbackDrafter(NGramDrafter((4, 3)), _model("q4", DRAFT_WINDOW)(host, target))


for _spec in (
    DrafterSpec("ngram", (), _ngram, help="prompt-lookup n-gram drafts (no model call)"),
    DrafterSpec("q4", ("q4",), _model("q4"), help="the q4 variant drafts (imports the parent's KV cache)"),
    DrafterSpec("q4-prefill", ("q4",), _model("q4", kv_import=False), help="the q4 variant drafts, own prefill"),
    DrafterSpec("q8", ("q8",), _model("q8"), help="the q8 variant drafts"),
    DrafterSpec("ngram+q4", ("q4",), _ngram_then_q4,
                help="n-gram drafts when the context offers them, q4 drafts after 32 tokens otherwise"),
    DrafterSpec("suffix", (), _suffix, persistent=True, memory=True,
                help="suffix-match drafts over everything the session has seen (no model call)"),
):
    register_drafter(_spec)


def register_role_drafters(role: str) -> None:
    """A draft role's own drafter (`role`), its two-level form (`stacked-role`: its steps speculated by
    suffix drafts) and their mixes with suffix drafts (`suffix+role`, `suffix+stacked-role`, for the auto
    policy), unless those names are taken. Every non-parent role of a loaded family gets them, so a variant
    made by `quantize --grade BPW --role NAME` drafts like the built-in ones (`spec-NAME`, auto)."""
    rows = (
        (role, _model(role), f"the {role} variant drafts", False),
        (f"stacked-{role}", _stacked(role), f"{role} drafts, its own steps speculated by suffix drafts (a second "
                                            f"level {role} verifies in one call)", True),
        (f"suffix+{role}", _suffix_then(role), f"suffix drafts on copy runs, {role} drafts (own adaptive length) "
                                               "elsewhere", True),
        (f"suffix+stacked-{role}", _suffix_then(role, stacked=True),
         f"suffix drafts on copy runs, stacked {role} drafts (own adaptive length) elsewhere", True),
    )
    for name, build, help_, memory in rows:
        if name not in DRAFTERS:
            register_drafter(DrafterSpec(name, (role,), build, help=help_, memory=memory))


for _role in builtin_draft_roles():
    register_role_drafters(_role)


def sibling_name_problem(role: str) -> Optional[str]:
    """Why `role` cannot name a sibling: it is the name of a drafter that is not that role's model (ngram, suffix)."""
    spec = DRAFTERS.get(role)
    if spec is not None and spec.roles != (role,):
        return f"{role!r} names the {role} drafter ({spec.help or 'not a model'}); pick another name"
    return None


def register_sibling_drafters(sibling: str, roles, siblings=()) -> None:
    """A sibling role's drafters: its own (`sibling`: it drafts for the parent directly), its two-level form and
    their mixes with suffix drafts, each prefilling the prompt itself (never importing the parent's cache), and a
    chain `chain-<sibling>-<role>` for every model draft role of the family that shares the parent's network (q4
    first; not another of its `siblings`). Registered over any earlier registration of these names (a sibling must
    never be handed the parent's cache), but never over a drafter of another kind: InputError then."""
    why = sibling_name_problem(sibling)
    if why:
        raise InputError(f"sibling role {why}")
    rows = (
        (sibling, _model(sibling, kv_import=False), f"the sibling model {sibling} drafts (its own prefill)", False),
        (f"stacked-{sibling}", _stacked(sibling, imports=False),
         f"the sibling {sibling} drafts, its own steps speculated by suffix drafts", True),
        (f"suffix+{sibling}", _suffix_then(sibling, imports=False),
         f"suffix drafts on copy runs, the sibling {sibling} elsewhere", True),
        (f"suffix+stacked-{sibling}", _suffix_then(sibling, stacked=True, imports=False),
         f"suffix drafts on copy runs, the stacked sibling {sibling} elsewhere", True),
    )
    for name, build, help_, memory in rows:
        register_drafter(DrafterSpec(name, (sibling,), build, help=help_, memory=memory, prefills=(sibling,)))
    for role in draft_roles(roles):
        if role not in (sibling, *siblings) and role in DRAFTERS and DRAFTERS[role].roles == (role,) \
                and not DRAFTERS[role].prefills:
            register_drafter(DrafterSpec(chain_name(sibling, role), (role, sibling), _chain(sibling, role),
                                         help=f"the sibling {sibling} drafts for {role} (which verifies its proposals "
                                              "in one call), the parent verifies", prefills=(sibling,)))


def register_family_drafters(roles, siblings=()) -> list[str]:
    """The one call that registers an opened family's role drafters (Runtime.open makes it): every draft role gets
    `register_role_drafters`, every sibling role (`siblings`: a smaller model of the same vocabulary)
    `register_sibling_drafters`. Returns `model_draft_roles(roles)`."""
    for r in draft_roles(roles):
        if r not in siblings:
            register_role_drafters(r)
    for r in siblings:
        register_sibling_drafters(r, roles, siblings)
    return model_draft_roles(roles)


def model_draft_roles(roles) -> list[str]:
    """Those of `roles` whose registered drafter of the same name is that role's model (q4, q8, the recipes, a
    registered family's own roles; not a role that happens to be named like another drafter), parent first
    order (family.roles.ordered)."""
    return [r for r in draft_roles(roles) if r in DRAFTERS and DRAFTERS[r].roles == (r,)]
