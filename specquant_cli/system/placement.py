"""Placement: a pure planner (hardware facts + what models need -> where each runs), and its use on a
family (parent + optional draft), refusing before anything loads a set that does not fit."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Optional

from specquant_cli.errors import ResourceError
from specquant_cli.family.gguf_walk import kv_cache_bytes
from specquant_cli.family.roles import PARENT_ROLE, STANDARD_DRAFTS, draft_roles
from specquant_cli.system.hardware import Facts

VRAM_RESERVE = 512 << 20  # CUDA context, scratch buffers
COMPUTE_OVERHEAD = 256 << 20  # compute buffers per model, RAM or VRAM
RAM_HEADROOM = 0.9  # share of available RAM a placement may take (the OS and page cache need the rest)


def fits_ram(facts: Facts, nbytes: int) -> bool:
    return nbytes <= facts.ram_available * RAM_HEADROOM


@dataclass
class ModelNeed:
    """What one model of a plan needs: weights, KV cache, and its layer count (for partial offload)."""
    role: str
    weight_bytes: int
    kv_bytes: int
    n_layers: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes + COMPUTE_OVERHEAD


@dataclass
class Placement:
    mode: str  # gpu | hybrid | cpu
    gpu_layers: dict[str, int] = field(default_factory=dict)  # role -> n_gpu_layers (-1 = all)
    ram_bytes: int = 0  # what stays in host memory
    vram_bytes: int = 0
    fits_ram: bool = True
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def place(facts: Facts, parent: ModelNeed, draft: Optional[ModelNeed] = None) -> Placement:
    """Pure function: hardware facts + what the models need -> where each one runs."""
    models = [parent] + ([draft] if draft else [])
    usable = 0
    if facts.gpus and facts.gpu_offload:
        usable = max(0, max(g.free_bytes for g in facts.gpus) - VRAM_RESERVE)
    ram_ok = lambda b: fits_ram(facts, b)  # noqa: E731
    if usable and sum(m.total for m in models) <= usable:
        return Placement("gpu", {m.role: -1 for m in models}, 0, sum(m.total for m in models), True,
                         "parent and draft fit in free VRAM with their KV caches")
    if usable and parent.total <= usable:
        ram = draft.total if draft else 0
        return Placement("hybrid", {parent.role: -1, **({draft.role: 0} if draft else {})}, ram, parent.total,
                         ram_ok(ram), "parent on GPU, draft on CPU: both together do not fit in VRAM")
    if usable and parent.n_layers:
        per_layer = parent.weight_bytes / parent.n_layers
        n = int((usable - parent.kv_bytes - COMPUTE_OVERHEAD) // per_layer)
        if n >= 1:
            n = min(n, parent.n_layers)
            vram = int(n * per_layer) + parent.kv_bytes + COMPUTE_OVERHEAD
            ram = parent.total - int(n * per_layer) + (draft.total if draft else 0)
            return Placement("hybrid", {parent.role: n, **({draft.role: 0} if draft else {})}, ram, vram,
                             ram_ok(ram), f"parent partly offloaded ({n}/{parent.n_layers} layers), draft on CPU")
    ram = sum(m.total for m in models)
    why = "no usable GPU" if not usable else "the parent does not fit in VRAM"
    if facts.gpus and not facts.gpu_offload:
        why = "llama-cpp-python is built without GPU offload"
    return Placement("cpu", {m.role: 0 for m in models}, ram, 0, ram_ok(ram), f"CPU only: {why}")


def need(fam, role: str, n_ctx: int) -> ModelNeed:
    hp = fam.hparams_of(role)  # a sibling's KV cache is its own network's
    return ModelNeed(role, fam.size(role), kv_cache_bytes(hp, n_ctx), int(hp.get("block_count", 0)))


def place_pair(facts: Facts, fam, parent: str, draft: Optional[str], n_ctx: int) -> Placement:
    return place(facts, need(fam, parent, n_ctx), need(fam, draft, n_ctx) if draft else None)


def family_placements(facts: Facts, fam, n_ctx: int) -> dict:
    """Where each model pair of the family would run: the parent alone, the parent with each draft role beside
    it, and each standard draft alone (the lossy policies' targets: `q4`, `q8`, quasar's `q8`)."""
    roles = fam.roles()
    pairs = {PARENT_ROLE: (PARENT_ROLE, None), **{f"{PARENT_ROLE}+{d}": (PARENT_ROLE, d) for d in draft_roles(roles)},
             **{d: (d, None) for d in STANDARD_DRAFTS}}
    return {name: place_pair(facts, fam, p, d, n_ctx).to_dict() for name, (p, d) in pairs.items()
            if p in roles and (d is None or d in roles)}


def require_fit(facts: Facts, fam, roles: list[str], n_ctx: int, reserve: int = 0,
                beside: Optional[Mapping[str, int]] = None, hint: str = "") -> Placement:
    """Refuse, before loading anything, a set of models that does not fit where it would run. The parent role is
    the parent wherever it stands in `roles` (the first other role is the draft placed beside it; none: only what
    is beside them is checked). `reserve`: host memory (bytes) needed beside the models (the prompt cache's
    budget); `beside`: more of it, each part by what it is (said when it does not fit: serve's prompt cache and
    drafting memories, naming their settings); `hint`: what to change, after the numbers."""
    parts = {**({f"the prompt cache's {reserve / 2**30:.2f} GiB (--cache-ram)": reserve} if reserve else {}),
             **{what: int(n) for what, n in (beside or {}).items() if n}}
    parent = PARENT_ROLE if PARENT_ROLE in roles else roles[0] if roles else None
    rest = [r for r in roles if r != parent]
    pl = place(facts, need(fam, parent, n_ctx), need(fam, rest[0], n_ctx) if rest else None) if parent \
        else Placement("cpu", ram_bytes=0, reason="no model here")
    extra = sum(need(fam, r, n_ctx).total for r in rest[1:])  # further roles run on the CPU
    ram = pl.ram_bytes + extra + sum(parts.values())
    if not fits_ram(facts, ram):
        what = f"models {', '.join(roles)}" if roles else "what is kept beside the models"
        with_ = f" with {' and '.join(parts)}" if parts and roles else f" ({' and '.join(parts)})" if parts else ""
        raise ResourceError(f"{what}{with_} need {ram_shortfall(facts, ram)}" + (f"; {hint}" if hint else ""))
    return pl


def ram_shortfall(facts: Facts, nbytes: int) -> str:
    """How `nbytes` exceeds what a placement may take here, in numbers that read as not fitting: the need rounded up,
    the usable share (RAM_HEADROOM of what is available) rounded down, e.g. "~3.11 GiB of RAM, more than the 2.15
    GiB usable here (90% of 2.39 GiB available)"."""
    usable = facts.ram_available * RAM_HEADROOM
    digits = 2
    while digits < 6 and math.ceil(nbytes / 2**30 * 10**digits) <= math.floor(usable / 2**30 * 10**digits):
        digits += 1  # never "1.08 GiB, more than the 1.08 GiB usable"
    need_s = f"{math.ceil(nbytes / 2**30 * 10**digits) / 10**digits:.{digits}f}"
    usable_s = f"{math.floor(usable / 2**30 * 10**digits) / 10**digits:.{digits}f}"
    return (f"~{need_s} GiB of RAM, more than the {usable_s} GiB usable here ({RAM_HEADROOM:.0%} of "
            f"{facts.ram_available / 2**30:.2f} GiB available)")


def plan_residents(facts: Facts, fam, plans: Mapping[str, list[str]], n_ctx: int) -> dict:
    """What each plan keeps resident, estimated (every model's weights, its KV cache for `n_ctx` positions and its
    compute buffers), beside the RAM this machine has available: name -> {"roles", "bytes", "fits"}. A plan that does
    not fit is one a planner does not pick here (runtime.pool.unfit_roles)."""
    out = {}
    for name, roles in plans.items():
        n = sum(need(fam, r, n_ctx).total for r in roles)
        out[name] = {"roles": list(roles), "bytes": n, "fits": fits_ram(facts, n)}
    return out
