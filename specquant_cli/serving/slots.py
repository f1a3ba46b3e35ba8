"""Slots: what lets `serve --parallel N` decode N requests together.

The pool is one `Runtime` whose contexts hold N sequences each. Slot i is a `SlotRuntime`: the pool's
models, calibration and settings, sequence i of every context (`decoding.batch.SeqView`) and drafters of
its own. A request runs in a slot exactly as it would alone (its own engine, plan, sampler and stop rules);
the shared `Batcher` turns the parent calls of all the slots that need one into one llama.cpp call.

Planning knows the batch: a slot's calibration is the pool's as one of B sequences sees it
(`Calibration.for_batch`), B being the requests in flight when it plans, so `auto` weighs a draft against
the parent's *shared* step — at 8 sequences on a CPU a parent step costs each a fraction of a lone one,
and a draft that pays alone often does not."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Optional

from specquant_cli.decoding.batch import Batcher, SeqView
from specquant_cli.errors import ResourceError
from specquant_cli.runtime import Runtime

MAX_PARALLEL = 8
# Doubling the sequences decoded together must raise the parent's aggregate tokens/s by this much to be
# worth it (each sequence's tokens come slower, and every sequence holds a KV cache).
PARALLEL_GAIN = 1.15


def best_parallel(call_s: Callable[[int], float], cap: int = MAX_PARALLEL) -> int:
    """The most sequences worth decoding together on a parent call-cost curve (seconds for n tokens): keep
    doubling while the aggregate rate n / call_s(n) gains PARALLEL_GAIN."""
    n = 1
    while 2 * n <= cap and (2 * n) / call_s(2 * n) >= PARALLEL_GAIN * n / call_s(n):
        n *= 2
    return n


class SlotRuntime(Runtime):
    """Slot `slot` of a pool runtime: same models, settings and measured costs; its own sequence of every
    context and its own drafters. Models are loaded by the pool only (before serving starts)."""

    def __init__(self, pool: Runtime, slot: int, batcher: Batcher, batch_size: Callable[[], int]):
        self.__dict__.update(pool.__dict__)  # settings, facts, vocabulary: the pool's
        self.pool = pool
        self.slot = slot
        self.batcher = batcher
        self._batch_size = batch_size
        self._ctx = {role: SeqView(ctx, slot, batcher, pool.n_ctx) for role, ctx in pool._ctx.items()}
        self._drafters = {}
        self._planners = {}
        self.scope = ""

    def planner(self, policy: str):
        """This slot's planner for `policy` at the current batch size: one per size, as a speedup measured
        alone is not the one a plan gets among 8 sequences."""
        from specquant_cli.routing.policies import policy_spec

        key = f"{policy}@{self._batch_size()}"
        if key not in self._planners:
            factory = policy_spec(policy).planner
            self._planners[key] = factory() if factory is not None else None
        return self._planners[key]

    def tokenizer(self):
        return self.pool.tokenizer()

    def ensure(self, roles: list[str]) -> None:
        missing = [r for r in roles if r not in self._ctx]
        if missing:
            raise ResourceError(f"{', '.join(missing)} not loaded for concurrent serving")

    def calibration(self, measure: bool = True, force: bool = False, require_save: bool = False):
        """The pool's calibration (never measured from a slot), as one of the current batch sees it."""
        c = self.pool.calibration(measure=False)
        return c.for_batch(self._batch_size()) if c is not None else None

    def plannable_roles(self) -> tuple[str, ...]:
        return tuple(r for r in self.family.roles() if r in self._ctx)

    def load_planner_drafts(self) -> list[str]:
        return []

    def release(self, roles: list[str]) -> None:
        pass

    def reset_caches(self) -> None:
        for view in self._ctx.values():
            view.reset()

    def close(self) -> None:
        self.reset_caches()
        self._drafters.clear()


class Slots:
    """The pool's first n sequences as slots, and their batcher. `batch_size` is what a slot plans for: the
    requests in flight (`in_flight`, set by the server to its worker's count), at most n."""

    def __init__(self, pool: Runtime, n: int):
        self.batcher = Batcher()
        self.in_flight: Callable[[], int] = lambda: 1
        self.runtimes = [SlotRuntime(pool, i, self.batcher, self.batch_size) for i in range(min(n, pool.parallel))]
        self._route_lock = threading.Lock()

    def batch_size(self) -> int:
        return max(1, min(len(self.runtimes), self.in_flight()))

    def route_lock(self) -> threading.Lock:
        return self._route_lock

    def member(self, records: Iterator) -> Iterator:
        """`records`, generated as a member of the batch: from its first item to its end (or close), the
        batcher's rounds wait for this slot's calls."""
        with self.batcher.member():
            yield from records


class LockedRouter:
    """A router shared by the slots' threads: one prompt scored at a time (spaCy's pipeline is not
    documented as thread-safe)."""

    def __init__(self, router, lock: threading.Lock):
        self._router = router
        self._lock = lock

    def route(self, text: str):
        with self._lock:
            return self._router.route(text)

    def __getattr__(self, name: str):
        return getattr(self._router, name)


def parallel_for(pool: Runtime, requested: Optional[int]) -> int:
    """--parallel as given, else what the calibrated parent curve says pays (the prior shape when this machine
    has no calibration for the family), at most the sequences the pool's contexts hold."""
    if requested is not None:
        return requested
    from specquant_cli.decoding.gamma import verify_shape

    c = pool.calibration(measure=False)
    curve = c.call_s if c is not None else verify_shape
    return min(pool.parallel, best_parallel(curve))
