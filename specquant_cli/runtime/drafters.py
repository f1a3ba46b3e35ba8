"""The drafter cache: drafters built from their registry specs (decoding.registry), a persistent one kept
per policy and scope, and one drafting memory per policy (decoding.memory.DraftMemory) that every drafter of the
policy reads and writes: what one policy's drafters remember never feeds another's, so a bench that runs several
policies on the same prompt does not hand one the answer another just produced. A server's slots share the
policies' memories (`with_models`): every request of a policy drafts from what the others have written — within
its scope (its tenant, narrowed by its cache_salt): a memory is read and written through the request's scope
(decoding.memory.ScopedMemory), and persistent drafters are kept per scope."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from specquant_cli.decoding.fences import Fences
from specquant_cli.decoding.memory import DraftMemory, ScopedMemory, tokens_for
from specquant_cli.decoding.protocols import Drafter, TokenContext
from specquant_cli.decoding.registry import drafter_spec
from specquant_cli.runtime.costs import CostModel
from specquant_cli.runtime.pool import Models

MAX_KEPT = 64  # persistent drafters kept (per policy, drafter and scope), least recently used out


class DrafterCache:
    """`p_min`: a model drafter stops a draft below this probability (None: its default); `kv_import`: model
    drafters import the parent's KV cache instead of prefilling the prompt themselves."""

    def __init__(self, pool: Models, costs: CostModel, p_min: Optional[float] = None, kv_import: bool = True,
                 memory_tokens: Optional[int] = None, memories: Optional[dict] = None):
        self.pool = pool
        self.costs = costs
        self.p_min = p_min
        self.kv_import = kv_import
        self.memory_tokens = tokens_for() if memory_tokens is None else memory_tokens
        self._kept: OrderedDict[tuple[str, str, str, str], Drafter] = OrderedDict()
        self._memories: dict[str, DraftMemory] = memories if memories is not None else {}
        self._memory_lock = threading.Lock()
        self._fences: Optional[tuple[object, Fences]] = None

    def memory(self, policy: str, scope: str = "") -> ScopedMemory:
        """The drafting memory of `policy` (made on first use), shared with every cache made by `with_models`, as
        requests of `scope` see it; each holds at most `memory_tokens` (the budget is per policy that drafts from a
        memory, shared by its scopes). A budget of 0 shares nothing: each call gets a memory of its own, which keeps
        just the sequence being written."""
        if self.memory_tokens == 0:
            return DraftMemory(0).view(scope)
        with self._memory_lock:
            mem = self._memories.get(policy)
            if mem is None:
                mem = self._memories[policy] = DraftMemory(self.memory_tokens)
            return mem.view(scope)

    def fences(self) -> Fences:
        """The code fences of the parent's vocabulary (read from it once per model)."""
        model = self.pool.tokenizer()
        if self._fences is None or self._fences[0] is not model:
            self._fences = (model, Fences(model.backtick_pieces, model.piece))
        return self._fences[1]

    def memory_use(self) -> dict[str, dict]:
        """Each policy's memory use (DraftMemory.use)."""
        return {policy: m.use() for policy, m in list(self._memories.items())}

    def drafter(self, name: str, target: str, policy: str, scope: str = "") -> Drafter:
        """The named drafter for `target`'s verification; a persistent one is kept for the session, one per
        `policy` and `scope`, a fresh one is built otherwise. Loads the roles it needs (placement-checked)."""
        spec = drafter_spec(name)
        key = (scope, policy, name, target)
        if spec.persistent and key in self._kept:
            self._kept.move_to_end(key)
            return self._kept[key]
        self.pool.ensure([target, *spec.roles])
        d = spec.build(_Host(self, policy, scope), target)
        if spec.persistent:
            self._kept[key] = d
            while len(self._kept) > MAX_KEPT:
                self._kept.popitem(last=False)
        return d

    def with_models(self, pool: Models, costs: CostModel) -> DrafterCache:
        """A cache with these settings over other models and costs (a serving slot's): drafters of its own,
        the drafting memories of this one."""
        return DrafterCache(pool, costs, self.p_min, self.kv_import, self.memory_tokens, self._memories)

    def clear(self) -> None:
        self._kept.clear()

    def forget(self) -> None:
        """Drop the kept drafters and empty every policy's drafting memory (for every cache sharing them): a
        measurement run that must not draft from an earlier run's answers."""
        self._kept.clear()
        with self._memory_lock:
            self._memories.clear()


@dataclass
class _Host:
    """What a drafter spec's `build` sees (decoding.registry.DraftHost): the cache's settings and models, the
    cost model, and the policy and scope it builds for (a drafter made of others gets theirs from the same)."""

    cache: DrafterCache
    policy: str
    scope: str = ""

    @property
    def p_min(self) -> Optional[float]:
        return self.cache.p_min

    @property
    def kv_import(self) -> bool:
        return self.cache.kv_import

    def context(self, role: str) -> TokenContext:
        return self.cache.pool.context(role)

    def drafter(self, name: str, target: str) -> Drafter:
        return self.cache.drafter(name, target, self.policy, self.scope)

    def verify_cost(self) -> Callable[[int], float]:
        return self.cache.costs.verify_cost()

    def model_gamma(self, role: str):
        return self.cache.costs.model_gamma(role)

    def draft_cost(self, role: str) -> Callable[[int], float]:
        return self.cache.costs.draft_cost(role)

    def step_ratio(self, lower: str, upper: str) -> Optional[float]:
        c = self.cache.costs.calibration(measure=False)
        step, call = (c.draft_step_s.get(lower), c.draft_call(upper, 1)) if c is not None else (None, None)
        return step / call if step and call else None

    def agreement(self, role: str) -> Optional[float]:
        c = self.cache.costs.calibration(measure=False)
        return c.agreement.get(role) if c is not None else None

    def pacer(self):
        """The batch's round pacer as this policy's drafters use it: a planned policy's drafts may rest while
        they would slow the batch, a fixed policy's always draft (only their length is paced)."""
        from specquant_cli.routing.policies import policy_spec

        costs = self.cache.costs
        if costs.pacer is None:
            return None
        return costs.pacer.pace(rest=policy_spec(self.policy).planner is not None, beside=costs.beside)

    def fences(self):
        return self.cache.fences()

    def memory(self):
        return self.cache.memory(self.policy, self.scope)
