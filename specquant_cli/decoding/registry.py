"""Drafters by name. A spec knows which family roles its drafter loads and how to build one from the
runtime; adding a drafter is one module plus one `register_drafter` call (or one row below)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Protocol

from specquant_cli.decoding.protocols import Drafter, TokenContext
from specquant_cli.errors import InputError

# Prompt tokens the adaptive policy's late-woken drafter reads when it cannot import the parent's cache.
# Only there: a window bounds the draft's prefill but costs acceptance on long documents (Spec-Bench
# summarization: 93 % -> 18 % for spec-q4).
DRAFT_WINDOW = 128


class DraftHost(Protocol):
    """What a drafter spec may ask of the runtime that builds it."""

    p_min: Optional[float]
    kv_import: bool

    def context(self, role: str) -> TokenContext: ...

    scope: str  # the policy being built for (persistent drafters are kept per scope)

    def drafter(self, name: str, target: str, scope: str = "") -> Drafter: ...

    def verify_cost(self) -> Callable[[int], float]:
        """A parent call on n tokens relative to one token (measured, or the prior shape)."""
        ...

    def model_gamma(self, role: str, g_init: int):
        """An adaptive γ policy for `role`'s drafts, seeded with this machine's measured costs."""
        ...


@dataclass(frozen=True)
class DrafterSpec:
    """name: the drafter's registry key; roles: family roles it loads (none for draft-free drafters);
    build(host, target_role) -> Drafter; persistent: the runtime keeps one instance for the whole session
    (a drafter with memory across requests), otherwise it builds a fresh one per answer."""

    name: str
    roles: tuple[str, ...]
    build: Callable[[DraftHost, str], Drafter]
    persistent: bool = False
    help: str = ""


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
        return ModelDrafter(host.context(role), role, host.p_min, window=window, parent=parent)

    return build


def _suffix(host: DraftHost, target: str) -> Drafter:
    from specquant_cli.decoding.suffix import SuffixDrafter

    return SuffixDrafter(verify_cost=host.verify_cost())


def _suffix_then(role: str):
    def build(host: DraftHost, target: str) -> Drafter:
        from specquant_cli.decoding.drafters import FallbackDrafter

        return FallbackDrafter(host.drafter("suffix", target, host.scope), _model(role)(host, target),
                               activate_after=0, model_gamma=host.model_gamma(role, 4))

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
    # Draft recipes (family.recipes; specquant quantize --types q4i,q4s,q3g,q3g30): any role drafts the same way.
    DrafterSpec("q4i", ("q4i",), _model("q4i"), help="the q4i variant (imatrix Q4_0) drafts"),
    DrafterSpec("q4s", ("q4s",), _model("q4s"), help="the q4s variant (Q4_0, embeddings/output Q4_0) drafts"),
    DrafterSpec("q4si", ("q4si",), _model("q4si"), help="the q4si variant (q4s with the imatrix) drafts"),
    DrafterSpec("q3g", ("q3g",), _model("q3g"), help="the q3g variant (graded, ~3.5 bits per weight) drafts"),
    DrafterSpec("q3g30", ("q3g30",), _model("q3g30"), help="the q3g30 variant (graded, ~3.0 bits per weight) drafts"),
    DrafterSpec("ngram+q4", ("q4",), _ngram_then_q4,
                help="n-gram drafts when the context offers them, q4 drafts after 32 tokens otherwise"),
    DrafterSpec("suffix", (), _suffix, persistent=True,
                help="suffix-match drafts over everything the session has seen (no model call)"),
):
    register_drafter(_spec)


def register_role_drafters(role: str) -> None:
    """A draft role's own drafter (`role`) and its mix with suffix drafts (`suffix+role`, for the auto
    policy), unless those names are taken. Every non-parent role of a loaded family gets them, so a variant
    made by `quantize --grade BPW --role NAME` drafts like the built-in ones (`spec-NAME`, auto)."""
    if role not in DRAFTERS:
        register_drafter(DrafterSpec(role, (role,), _model(role), help=f"the {role} variant drafts"))
    if f"suffix+{role}" not in DRAFTERS:
        register_drafter(DrafterSpec(f"suffix+{role}", (role,), _suffix_then(role),
                                     help=f"suffix drafts on copy runs, {role} drafts (own adaptive length) elsewhere"))


for _role in ("q4", "q8", "q4i", "q4s", "q4si", "q3g", "q3g30"):
    register_role_drafters(_role)


def family_draft_roles(roles, parent: str) -> list[str]:
    """A family's roles that draft as models of their own name, their drafters registered first."""
    for r in roles:
        if r != parent:
            register_role_drafters(r)
    return model_draft_roles(roles)


def model_draft_roles(roles) -> list[str]:
    """Those of `roles` that draft as a model of their own name (q4, q8, the recipe roles), in `roles`' order."""
    return [r for r in roles if r in DRAFTERS and DRAFTERS[r].roles == (r,)]
