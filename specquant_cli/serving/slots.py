"""Slots: what lets `serve --parallel N` decode N requests together.

The shared runtime's pool (runtime.pool.ModelPool) holds N sequences in each context. Slot i is a
`Runtime` of its own over a `SlotPool` (the pool's models and settings, sequence i of every context:
`decoding.batch.SeqView`), the shared measured costs as a batch sees them (`runtime.costs.BatchCosts`), and
drafters and planners of its own. A request runs in a slot exactly as it would alone (its own engine,
plan, sampler and stop rules); the shared `Batcher` turns the parent calls of all the slots that need one
into one llama.cpp call.

Planning knows the batch: a slot's calibration is the pool's as one of B sequences sees it
(`Calibration.for_batch`), B being the requests in flight when it plans, so `auto` weighs a draft against
the parent's *shared* step — at 8 sequences on a CPU a parent step costs each a fraction of a lone one,
and a draft that pays alone often does not."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Optional

from specquant_cli.decoding.batch import Batcher, SeqView
from specquant_cli.decoding.rounds import RoundPacer
from specquant_cli.errors import ResourceError
from specquant_cli.runtime import Runtime
from specquant_cli.runtime.pool import ModelPool
from specquant_cli.settings import MAX_PARALLEL

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


class SlotPool:
    """Slot `slot`'s view of a pool: the pool's family, settings and vocabulary, and sequence `slot` of every
    context it has loaded (decoding.batch.SeqView). Loads nothing: the pool loads every model before serving
    starts, so a role it has not loaded is an error here, and only loaded roles fit."""

    def __init__(self, pool: ModelPool, slot: int, batcher: Batcher, prefill_chunk: Optional[int] = None):
        self._pool = pool
        self.family = pool.family
        self.n_ctx = pool.n_ctx
        self.threads = pool.threads
        self.rpc = pool.rpc
        self.draft_roles = pool.draft_roles
        self._views = {role: SeqView(ctx, seq, batcher, pool.n_ctx, prefill_chunk)
                       for role, (ctx, seq) in pool.slot_contexts(slot).items()}

    @property
    def facts(self):
        return self._pool.facts

    def loaded(self) -> list[str]:
        return list(self._views)

    def tokenizer(self):
        return self._pool.tokenizer()

    def ensure(self, roles: list[str]) -> None:
        missing = [r for r in roles if r not in self._views]
        if missing:
            raise ResourceError(f"{', '.join(missing)} not loaded for concurrent serving")

    def context(self, role: str) -> SeqView:
        self.ensure([role])
        return self._views[role]

    def fits(self, roles: list[str]) -> bool:
        return all(r in self._views for r in roles)

    def fit_problem(self, roles: list[str]) -> Optional[str]:
        missing = [r for r in roles if r not in self._views]
        return f"{', '.join(missing)} not loaded for concurrent serving" if missing else None

    def release(self, roles: list[str]) -> None:
        pass  # the pool's models stay loaded for every slot

    def release_idle(self, idle_s: float = 0.0) -> list[str]:
        return []  # every slot's views stay (what concurrent serving loads, it loads at its start)

    def reset_caches(self) -> None:
        for view in self._views.values():
            view.reset()

    def close(self) -> None:
        self.reset_caches()


def slot_runtime(shared: Runtime, slot: int, batcher: Batcher, batch_size: Callable[[], int],
                 prefill_chunk: Optional[int] = None, pacer: Optional[RoundPacer] = None,
                 beside: Callable[[], int] = lambda: 0) -> Runtime:
    """Slot `slot` of the `shared` runtime: the same models, settings and measured costs — the costs as one of
    `batch_size()` sequences sees them, after the `beside()` positions the other slots hold, the round pacer
    every slot's model drafts share —, its own sequence of every context, drafters and planners."""
    models = SlotPool(shared.pool, slot, batcher, prefill_chunk)
    costs = shared.costs.for_batch(batch_size, pacer, beside)
    return Runtime(models, costs, shared.drafters.with_models(models, costs))


class Slots:
    """The pool's first n sequences as slots, and their batcher. `batch_size` is what a slot plans for: the
    requests in flight (`in_flight`, set by the server to its worker's count), at most n."""

    def __init__(self, shared: Runtime, n: int, prefill_chunk: Optional[int] = None, hold: bool = True):
        """`hold`: the parent's calls wait beside draft calls for as long as the round pacer prices them (False:
        never: what `specquant bench batch --hold off` measures the hold against)."""
        # Slots with caches of their own (the deterministic mode: runtime.pool.ModelPool.own_caches) share no call:
        # they take turns, each planning as if alone, and a parent call waits for nothing.
        self.shared_calls = not getattr(shared.pool, "own_caches", False)
        self.pacer = RoundPacer(lambda: shared.costs.calibration(measure=False), lambda: self.batcher.active)
        self.batcher = Batcher(hold_s=self.pacer.hold_s if hold and self.shared_calls else (lambda: 0.0))
        self.in_flight: Callable[[], int] = lambda: 1
        self.runtimes = [slot_runtime(shared, i, self.batcher, self.batch_size if self.shared_calls else lambda: 1,
                                      prefill_chunk, self.pacer,
                                      (lambda i=i: self.cells_besides(i)) if self.shared_calls else lambda: 0)
                         for i in range(min(n, shared.pool.parallel))]
        self._route_lock = threading.Lock()

    def batch_size(self) -> int:
        return max(1, min(len(self.runtimes), self.in_flight()))

    def cells_besides(self, slot: int) -> int:
        """Positions the other slots' sequences hold in the parent's KV cache: one unified cache for every
        sequence, so each of `slot`'s calls reads their cells too (masked), and costs as if after that many more
        positions (measured on the 1.5B F16 parent with another slot holding ~880 cells: an 8-token call at
        position 1035 took 510 ms, the single-sequence curve at 1024 says 461)."""
        from specquant_cli.family.roles import PARENT_ROLE

        return sum(rt.pool.context(PARENT_ROLE).n_past for i, rt in enumerate(self.runtimes) if i != slot)

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


def parallel_for(family, facts, threads: int, rpc: list[str]) -> tuple[int, str]:
    """How many sequences to decode together when --parallel does not say, decided before any model loads: what
    this machine's stored calibration of the family says pays (best_parallel), else what the prior cost curve
    says (decoding.gamma.verify_shape). Returns (n, "this machine's calibration"), or (the prior's n, None). In the
    deterministic mode, one: there each sequence has a cache of its own and they take turns (SlotPool), so more
    decode no faster together."""
    from specquant_cli.decoding.gamma import verify_shape
    from specquant_cli.settings import deterministic
    from specquant_cli.system import calibration_file as cal
    from specquant_cli.system.hardware import detect

    if deterministic():
        return 1, "the deterministic mode (sequences there take turns)"

    c = cal.load(family.root, cal.fingerprint(facts if facts is not None else detect(), threads, rpc,
                                              parent=family.parent_rendering))
    if c is not None:
        return best_parallel(c.call_s), "this machine's calibration"
    return best_parallel(verify_shape), None
