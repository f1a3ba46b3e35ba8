"""The model pool: a session's models, loaded lazily per family role, checked against the placement plan
first, kept loaded until released; one llama.cpp context per loaded role (in the deterministic mode with several
sequences, one per role and sequence: `own_caches`)."""

from __future__ import annotations

import time
from typing import Optional, Protocol

from specquant_cli.backend.llama import Context, Model, check_same_vocab
from specquant_cli.decoding.protocols import TokenContext
from specquant_cli.errors import ResourceError
from specquant_cli.family.manifest import Family
from specquant_cli.family.roles import PARENT_ROLE
from specquant_cli.settings import DEFAULT_RPC_TIMEOUT_S, deterministic

# A draft no plan has used for this long is released (its weights and KV cache; the next plan that picks it loads it
# again, from the page cache when the machine has room): ollama unloads an idle model after 5 minutes too.
IDLE_RELEASE_S = 300.0


class Models(Protocol):
    """What the cost model, the drafter cache and the runtime ask of a pool (ModelPool, or a serving slot's
    view of one: serving.slots.SlotPool)."""

    family: Family
    n_ctx: int  # positions of one sequence
    threads: Optional[int]
    rpc: list[str]  # the parent's RPC workers, if any
    draft_roles: list[str]  # the family's roles that draft as models

    def loaded(self) -> list[str]: ...
    def tokenizer(self) -> Model: ...
    def ensure(self, roles: list[str]) -> None: ...
    def context(self, role: str) -> TokenContext: ...
    def fits(self, roles: list[str]) -> bool: ...
    def fit_problem(self, roles: list[str]) -> Optional[str]: ...
    def release(self, roles: list[str]) -> None: ...
    def release_idle(self, idle_s: Optional[float] = ...) -> list[str]: ...
    def reset_caches(self) -> None: ...
    def close(self) -> None: ...


class ModelPool:
    """`parallel`: sequences every context holds (serving.slots gives each concurrent request one), each with
    `n_ctx` positions of its own. `draft_roles`: the family's roles that draft as models
    (decoding.registry.register_family_drafters, called once when the family is opened). `rpc`: the parent's
    RPC workers, `rpc_timeout` their reply deadline in seconds; `mmap`: map model files (runtime.mmap);
    `host_reserve`: host memory (bytes) the placement check counts beside the models (the prompt cache's budget)."""

    def __init__(self, family: Family, draft_roles: list[str], n_ctx: int = 4096, threads: Optional[int] = None,
                 facts=None, rpc: Optional[list[str]] = None, parallel: int = 1, mmap: bool = False,
                 rpc_timeout: float = DEFAULT_RPC_TIMEOUT_S, host_reserve: int = 0):
        self.family = family
        self.draft_roles = list(draft_roles)
        self.rpc = list(rpc or [])
        self.rpc_timeout = rpc_timeout
        self.mmap = mmap
        self.host_reserve = host_reserve
        self.n_ctx = n_ctx
        self.parallel = max(1, parallel)
        self.threads = threads
        self._facts = facts
        self._ctx: dict[str, Context] = {}  # role -> its context (sequence i: slot i's), or slot 0's own
        self._more: dict[str, list[Context]] = {}  # own_caches: role -> slots 1..N-1's contexts
        self._vocab: Optional[Model] = None
        self._workers = None  # the RPC workers as last probed
        self._used: dict[str, float] = {}  # role -> when a plan last asked for it (time.monotonic)

    @property
    def facts(self):
        if self._facts is None:
            from specquant_cli.system.hardware import detect

            self._facts = detect()
        return self._facts

    def loaded(self) -> list[str]:
        return list(self._ctx)

    @property
    def own_caches(self) -> bool:
        """Whether each sequence has a context of its own: in the deterministic mode with several sequences. In one
        shared cache a sequence's cells fall where the others' leave room, and the attention over them sums in
        another order; in a cache of its own they fall where they would alone, so a row is computed as alone. The
        price: sequences no longer share a parent call (serving.slots: they take turns)."""
        return self.parallel > 1 and deterministic()

    def contexts(self) -> dict[str, Context]:
        """The loaded roles' contexts (slot 0's where `own_caches`)."""
        return dict(self._ctx)

    def slot_contexts(self, slot: int) -> dict[str, tuple[Context, int]]:
        """Slot `slot`'s (context, sequence) of each loaded role: sequence `slot` of the shared context, or sequence 0
        of its own (`own_caches`)."""
        if not self.own_caches:
            return {role: (ctx, slot) for role, ctx in self._ctx.items()}
        return {role: (ctx if slot == 0 else self._more[role][slot - 1], 0) for role, ctx in self._ctx.items()}

    def kv_positions(self, role: str) -> int:
        """Positions the KV caches of `role` hold for every sequence together."""
        return self._ctx[role].n_ctx + sum(c.n_ctx for c in self._more.get(role, []))

    def tokenizer(self) -> Model:
        """The parent's vocabulary (no weights unless the parent is already loaded)."""
        if PARENT_ROLE in self._ctx:
            return self._ctx[PARENT_ROLE].model
        if self._vocab is None:
            self._vocab = Model(self.family.path(PARENT_ROLE), vocab_only=True)
        return self._vocab

    def ensure(self, roles: list[str]) -> None:
        """Load what `roles` need, refusing first (with numbers) a set that does not fit."""
        now = time.monotonic()
        self._used.update((r, now) for r in roles)
        missing = [r for r in roles if r not in self._ctx]
        if not missing:
            return
        placement = self._require_fit(self.loaded() + missing)
        for role in missing:
            if self.rpc and role == PARENT_ROLE:
                model = self._remote_parent()
            else:
                model = Model(self.family.path(role), n_gpu_layers=placement.gpu_layers.get(role, 0), mmap=self.mmap)
            if self._ctx:  # every model of a session must speak the same vocabulary
                check_same_vocab(next(iter(self._ctx.values())).model, model)
            if self.own_caches:
                self._ctx[role] = Context(model, self.n_ctx, n_threads=self.threads)
                self._more[role] = [Context(model, self.n_ctx, n_threads=self.threads)
                                    for _ in range(self.parallel - 1)]
            else:
                # One KV cache for all sequences (unified): with a cache per sequence llama.cpp splits a batch whose
                # sequence ids are out of order or have gaps into one pass each (decoding.batch._chunks).
                self._ctx[role] = Context(model, self.n_ctx * self.parallel, n_threads=self.threads,
                                          n_seq_max=self.parallel, kv_unified=self.parallel > 1)
            if self.rpc and role == PARENT_ROLE:
                from specquant_cli.system import rpc

                rpc.arm_sockets(self.rpc, self.rpc_timeout)  # ggml's sockets to the workers get deadlines

    def context(self, role: str) -> Context:
        self.ensure([role])
        return self._ctx[role]

    def fits(self, roles: list[str]) -> bool:
        """Whether `roles` (the parent first) fit where they would run (system.placement)."""
        return self.fit_problem(roles) is None

    def fit_problem(self, roles: list[str]) -> Optional[str]:
        """Why `roles` (the parent first) do not fit where they would run, with the numbers; None when they do."""
        try:
            self._require_fit(roles)
            return None
        except ResourceError as e:
            return str(e)

    def _require_fit(self, roles: list[str]):
        """The placement check; with RPC workers the parent is checked against their free memory (probed now:
        a worker that is down is one clear error here, never ggml's abort) and the rest against this machine."""
        from specquant_cli.system.placement import Placement, need, require_fit

        if self.rpc and PARENT_ROLE in roles:
            from specquant_cli.system import rpc

            if PARENT_ROLE not in self._ctx:
                self._workers = rpc.probe_all(self.rpc)
                rpc.require_remote_fit(self._workers, need(self.family, PARENT_ROLE, self.n_ctx * self.parallel).total,
                                       f"the parent ({self.family.parent_rendering})")
            roles = [r for r in roles if r != PARENT_ROLE]
            if not roles:
                return Placement("rpc")
        return require_fit(self.facts, self.family, roles, self.n_ctx * self.parallel, self.host_reserve)

    def _remote_parent(self) -> Model:
        """The parent with every layer on the RPC workers, split by their free memory (probed by _require_fit)."""
        from specquant_cli.system import rpc

        rpc.install_abort_guard(self.rpc)
        from specquant_cli import interrupts

        interrupts.watch_stalls()  # a wait on a stalled worker does not hold off Ctrl-C or SIGTERM
        workers = self._workers or rpc.probe_all(self.rpc)
        return Model(self.family.path(PARENT_ROLE), n_gpu_layers=-1, devices=rpc.devices(self.rpc),
                     tensor_split=rpc.split_for(workers), mmap=self.mmap)

    def release(self, roles: list[str]) -> None:
        """Unload `roles` (their models and contexts); a later plan that needs one loads it again."""
        for r in roles:
            ctx = self._ctx.pop(r, None)
            self._more.pop(r, None)
            if ctx is not None:
                ctx.model.close()  # frees its contexts first

    def release_idle(self, idle_s: Optional[float] = None) -> list[str]:
        """Release the drafts no plan has asked for in `idle_s` seconds (default IDLE_RELEASE_S; the parent stays);
        returns them."""
        idle_s = IDLE_RELEASE_S if idle_s is None else idle_s
        now = time.monotonic()
        idle = [r for r in self._ctx if r != PARENT_ROLE and now - self._used.get(r, now) > idle_s]
        self.release(idle)
        return idle

    def reset_caches(self) -> None:
        """Empty every KV cache (the bench's fresh-request state)."""
        for c in [*self._ctx.values(), *(c for more in self._more.values() for c in more)]:
            c.reset()

    def close(self) -> None:
        for c in self._ctx.values():
            c.model.close()  # frees its contexts first
        self._ctx.clear()
        self._more.clear()
        if self._vocab is not None:
            self._vocab.close()
            self._vocab = None


def plannable_roles(pool: Models) -> tuple[str, ...]:
    """The family's roles a planner may pick now: loaded, or a draft that fits beside what is loaded."""
    left = unfit_roles(pool)
    return tuple(r for r in pool.family.roles() if r not in left)


def unfit_roles(pool: Models) -> dict[str, str]:
    """The family's roles a planner may not pick now, each with why: the parent itself when it is not loaded and
    does not fit alone (then no plan runs here: said first), a draft that does not fit beside what is loaded
    (system.placement's numbers), or one a serving slot has no view of."""
    loaded = pool.loaded()
    base = [PARENT_ROLE, *(r for r in loaded if r != PARENT_ROLE)]
    out = {}
    if PARENT_ROLE not in loaded and (why := pool.fit_problem(base)) is not None:
        out[PARENT_ROLE] = why
    for r in pool.family.roles():
        if r not in base and (why := pool.fit_problem([*base, r])) is not None:
            out[r] = why
    return out
