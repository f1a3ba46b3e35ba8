"""From a family and the hardware facts to a placement per plan (parent + optional draft)."""

from __future__ import annotations

from typing import Optional

from specquant_cli.errors import ResourceError
from specquant_cli.ggufio import kv_cache_bytes
from specquant_cli.hardware import Facts, ModelNeed, Placement, plan

# Model pairs the policies use: (parent role, draft role or None).
PAIRS = {"f16+q4": ("f16", "q4"), "f16+q8": ("f16", "q8"), "f16": ("f16", None),
         "q8 (quasar)": ("q8", None), "q4": ("q4", None)}


def need(fam, role: str, n_ctx: int) -> ModelNeed:
    hp = fam.hparams
    return ModelNeed(role, fam.size(role), kv_cache_bytes(hp, n_ctx), int(hp.get("block_count", 0)))


def plan_pair(facts: Facts, fam, parent: str, draft: Optional[str], n_ctx: int) -> Placement:
    return plan(facts, need(fam, parent, n_ctx), need(fam, draft, n_ctx) if draft else None)


def family_plans(facts: Facts, fam, n_ctx: int) -> dict:
    roles = set(fam.roles())
    return {name: plan_pair(facts, fam, p, d, n_ctx).to_dict() for name, (p, d) in PAIRS.items()
            if p in roles and (d is None or d in roles)}


def require_fit(facts: Facts, fam, roles: list[str], n_ctx: int) -> Placement:
    """Refuse, before loading anything, a set of models that does not fit where it would run."""
    parent, *rest = roles
    pl = plan(facts, need(fam, parent, n_ctx), need(fam, rest[0], n_ctx) if rest else None)
    extra = sum(need(fam, r, n_ctx).total for r in rest[1:])  # further roles run on the CPU
    ram = pl.ram_bytes + extra
    if ram > facts.ram_available * 0.9:
        raise ResourceError(f"models {', '.join(roles)} need ~{ram / 2**30:.2f} GiB of RAM, "
                            f"{facts.ram_available / 2**30:.2f} GiB available")
    return pl
