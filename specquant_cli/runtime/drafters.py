"""The drafter cache: drafters built from their registry specs (decoding.registry), a persistent one kept
per scope. The scope is the policy a drafter is built for: what one policy's drafter remembers never feeds
another's, so a bench that runs several policies on the same prompt does not hand one the answer another
just produced."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from specquant_cli.decoding.protocols import Drafter, TokenContext
from specquant_cli.decoding.registry import drafter_spec
from specquant_cli.runtime.costs import CostModel
from specquant_cli.runtime.pool import Models


class DrafterCache:
    """`p_min`: a model drafter stops a draft below this probability (None: its default); `kv_import`: model
    drafters import the parent's KV cache instead of prefilling the prompt themselves."""

    def __init__(self, pool: Models, costs: CostModel, p_min: Optional[float] = None, kv_import: bool = True):
        self.pool = pool
        self.costs = costs
        self.p_min = p_min
        self.kv_import = kv_import
        self._kept: dict[tuple[str, str, str], Drafter] = {}

    def drafter(self, name: str, target: str, scope: str) -> Drafter:
        """The named drafter for `target`'s verification; a persistent one is kept for the session, one per
        `scope`, a fresh one is built otherwise. Loads the roles it needs (placement-checked)."""
        spec = drafter_spec(name)
        key = (scope, name, target)
        if spec.persistent and key in self._kept:
            return self._kept[key]
        self.pool.ensure([target, *spec.roles])
        d = spec.build(_Host(self, scope), target)
        if spec.persistent:
            self._kept[key] = d
        return d

    def with_models(self, pool: Models, costs: CostModel) -> DrafterCache:
        """An empty cache with these settings over other models and costs (a serving slot's)."""
        return DrafterCache(pool, costs, self.p_min, self.kv_import)

    def clear(self) -> None:
        self._kept.clear()


@dataclass
class _Host:
    """What a drafter spec's `build` sees (decoding.registry.DraftHost): the cache's settings and models, the
    cost model, and the scope it builds for (a drafter made of others gets theirs from the same scope)."""

    cache: DrafterCache
    scope: str

    @property
    def p_min(self) -> Optional[float]:
        return self.cache.p_min

    @property
    def kv_import(self) -> bool:
        return self.cache.kv_import

    def context(self, role: str) -> TokenContext:
        return self.cache.pool.context(role)

    def drafter(self, name: str, target: str) -> Drafter:
        return self.cache.drafter(name, target, self.scope)

    def verify_cost(self) -> Callable[[int], float]:
        return self.cache.costs.verify_cost()

    def model_gamma(self, role: str):
        return self.cache.costs.model_gamma(role)
