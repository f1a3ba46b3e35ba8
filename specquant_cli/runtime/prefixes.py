"""Prefill once: what a sequence about to prefill a prompt takes instead of decoding it.

A parent's prompt is the expensive part on a CPU (~15 ms a token for the 1.5B F16 parent), and assistants,
agents and RAG templates resend the same long prefix on every turn. Before a sequence prefills, `PrefixSharing`
looks for the longest prefix of its prompt that is already computed:

- in its own cache (llama.cpp keeps what the sequence held: the last turn of its conversation);
- in another sequence of the same context: the contexts hold all their sequences in one unified KV cache, so
  another sequence's cells are given to this one (`llama_memory_seq_cp`: metadata only, no copy, no prefill); in
  the deterministic mode each slot has a context of its own, and the other's state is copied as bytes;
- in the `PromptCache` (runtime.prompt_cache): sequence states kept in host RAM when a sequence was about to be
  reused for another prompt, or parked (below), and optionally in a folder a later server reads back.

One unified KV cache costs its idle cells too: every call of every sequence attends over all the cells in use, another
sequence's included (masked), so a conversation left held in an idle slot slows every other request's calls (measured
on the 1.5B BF16 parent, AMD EPYC, 2 threads, at 1,500 positions: a 32-token call 450-456 ms alone, 559-619 ms with an
idle 2,400-token conversation held beside it; scripts/idle_cells.py). Where a prompt cache keeps what a slot gives
up, a request that starts therefore parks the idle slots first (`park`: their states go to the prompt cache, their
cells are freed), and takes the slot that shares the longest prefix of its prompt: a conversation's next turn its own
slot, an agent that resends its system prompt with new files the slot of its last request. A parked conversation's
next turn restores its state from RAM (a copy of its KV bytes), far less than its cells cost the others' calls
meanwhile.

When another sequence is prefilling a prompt that shares a longer prefix with this one (two conversations over one
system prompt arriving together), this one waits for it to pass the shared part, then takes it: the shared prefix
is computed once. Only the parent's sequences take part: a model draft imports the parent's KV, as always.

The KV cells a prefix is made of are the ones a cold prefill would make, computed in other batches: the same
tokens' keys and values up to the float rounding of another batch shape, as the sequence's own cache already was
(bit for bit in the deterministic mode)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Optional

from specquant_cli.backend.llama import common_prefix
from specquant_cli.errors import check_cancelled
from specquant_cli.runtime.prompt_cache import Entry, PromptCache

MIN_REUSE = 16  # tokens: a shorter prefix is prefilled, not copied, restored or cached
WAIT_S = 600.0  # the longest a sequence waits for another's prefill of their shared prefix
POLL_S = 0.02


class PrefixSharing:
    """The parent sequences of one context (`views`: each a PrefixCache with `seq`, `tokens`, `ctx`) and the
    prompt cache (None: off); `reuse` False takes nothing, not even a sequence's own prefix. `ops` is the lock
    every llama.cpp call on the context holds; `away`, when given, is a context manager under which a waiting
    sequence does not hold the batcher's rounds back.

    Every sequence holds cells of one scope (`enter`: a request's tenant and cache_salt). A prefill takes a prefix
    only from its own scope — its own cells, another sequence's of the same scope, a prompt cache entry of it —
    and waits only for a prefill of its own scope: one tenant's prompts never make another's faster."""

    def __init__(self, views: list, cache: Optional[PromptCache], ops, away=None, reuse: bool = True):
        self.views = list(views)
        self.reuse = reuse  # False (--no-prompt-cache): every prompt is prefilled whole, its own prefix included
        self.cache = cache
        self.ops = ops
        self.away = away or contextlib.nullcontext
        # keyed by id(view), not by sequence id: views of contexts of their own (the deterministic mode's slots) are
        # all sequence 0
        self._targets: dict[int, tuple[int, ...]] = {}  # view -> the prompt it is prefilling now
        self._scopes: dict[int, str] = {}  # view -> the scope of the cells it holds
        self._lock = threading.Condition()
        self.counts = {"copied_tokens": 0, "restored_tokens": 0, "waits": 0}  # what sharing saved, and its waits
        for v in self.views:
            v.prefixes = self

    @property
    def parks(self) -> bool:
        """Whether idle sequences are parked: what they give up is kept (a prompt cache, reuse on), and they hold
        their cells in one KV cache with the others (not the deterministic mode's caches of their own)."""
        return self.reuse and self.cache is not None and len({id(v.ctx) for v in self.views}) == 1

    def holds(self, index: int) -> bool:
        """Whether sequence `index` holds parent cells (what parking would free)."""
        return bool(self.views[index].tokens)

    def park(self, index: int) -> None:
        """Idle sequence `index` keeps its state in the prompt cache (unless another sequence or an entry holds it
        all already); the caller then empties it, drafts' sequences included."""
        self._keep(self.views[index], (), self.scope(index))

    def scope(self, index: int) -> str:
        """The scope of what sequence `index` (of `views`) holds."""
        return self._scopes.get(id(self.views[index]), "")

    def enter(self, index: int, scope: str) -> bool:
        """Sequence `index` is about to serve a request of `scope`. When it holds another scope's cells, they go to
        the prompt cache (under their scope) and the sequence is emptied: True (the caller empties the drafts'
        sequences too)."""
        view = self.views[index]
        if self.scope(index) == scope:
            return False
        if self.reuse:
            self.park(index)
        with self.ops:
            view.rewind(0)
        self._scopes[id(view)] = scope
        return True

    def prefill(self, view, tokens: Sequence[int]) -> int:
        """Make `view` hold exactly `tokens`, taking the longest computed prefix there is; returns tokens decoded."""
        tokens = tuple(tokens)
        if not self.reuse:
            view.rewind(0)
            return view.sync(tokens, logits="none")
        scope = self._scopes.get(id(view), "")
        self._keep(view, tokens, scope)
        cached = self.cache.best(tokens, scope) if self.cache is not None else (None, 0)
        with self._prefilling(view, tokens, cached[1]):
            self._take(view, tokens, cached)
            return view.sync(tokens, logits="none")

    def _peers(self, view) -> list:
        """The other sequences holding cells of `view`'s scope."""
        scope = self._scopes.get(id(view), "")
        return [v for v in self.views if v is not view and self._scopes.get(id(v), "") == scope]

    def _keep(self, view, tokens: tuple[int, ...], scope: str) -> None:
        """Before `view` gives up what it holds beyond `tokens`' prefix, its state goes to the prompt cache under
        `scope` (unless a sequence of the scope or an entry holds it all already)."""
        held = list(view.tokens)
        if self.cache is None or len(held) < MIN_REUSE or common_prefix(held, tokens) >= len(held) - MIN_REUSE:
            return
        with self.ops:
            if any(common_prefix(v.tokens, held) == len(held) for v in self._peers(view)):
                return
        if self.cache.covers(held, scope):
            return
        with self.ops:
            state = view.ctx.export_state(view.seq)
        self.cache.put(held, state, scope)

    @contextlib.contextmanager
    def _prefilling(self, view, tokens: tuple[int, ...], cached: int) -> Iterator[None]:
        """While `view` prefills `tokens`, others of its scope sharing a longer prefix wait for it; it first waits for
        any other prefill of its scope whose prompt shares more with `tokens` than what is computed anywhere
        (`cached`: the prompt cache's longest prefix of it)."""
        with self._lock:
            deadline = time.monotonic() + WAIT_S
            while self._ahead(view, tokens, cached) is not None and time.monotonic() < deadline:
                self.counts["waits"] += 1
                check_cancelled()
                with self.away():
                    self._lock.wait(POLL_S)
            self._targets[id(view)] = tokens
        try:
            yield
        finally:
            with self._lock:
                self._targets.pop(id(view), None)
                self._lock.notify_all()

    def _ahead(self, view, tokens: tuple[int, ...], cached: int):
        """A sequence of `view`'s scope prefilling a prompt that shares with `tokens` a prefix it has not yet
        computed, longer than what `view` could take now (`cached`: the prompt cache's longest prefix of it); None
        when none is."""
        peers = self._peers(view)
        have = max([cached, common_prefix(view.tokens, tokens)] + [common_prefix(v.tokens, tokens) for v in peers])
        for other in peers:
            target = self._targets.get(id(other))
            if target is None:
                continue
            shared = common_prefix(target, tokens)
            if shared >= have + MIN_REUSE and len(other.tokens) < shared:
                return other
        return None

    def _take(self, view, tokens: tuple[int, ...], cached: tuple[Optional[Entry], int]) -> None:
        """Give `view` the longest computed prefix of `tokens` held elsewhere in its scope (another sequence's
        cells, or the `cached` (entry, length) when that is longer), when it beats its own by MIN_REUSE tokens."""
        own = common_prefix(view.tokens, tokens)
        entry, n = cached
        with self.ops:
            donors = [(common_prefix(v.tokens, tokens), v) for v in self._peers(view)]
            shared, donor = max(donors, key=lambda d: d[0], default=(0, None))
            if donor is not None and shared >= own + MIN_REUSE and shared >= n:
                if donor.ctx is view.ctx:  # one cache: the cells become the view's too
                    view.rewind(own)
                    view.ctx.copy_seq(donor.seq, view.seq, own, shared)
                    view.tokens[:] = tokens[:shared]
                elif not _copy_state(donor, view, shared):  # a cache of its own: the donor's cells as bytes
                    return
                self.counts["copied_tokens"] += shared - own
                return
        if self.cache is None:
            return
        if entry is None or n < own + MIN_REUSE:
            self.cache.count("misses")
            return
        with self.ops:
            view.rewind(0)
            loaded = view.ctx.load_state((entry.state, entry.size), view.seq)
            if not loaded or view.ctx.positions(view.seq) != (0, len(entry.tokens) - 1):
                view.ctx.remove(view.seq, 0, -1)  # refused, or not the positions its tokens say: never used again
                self.cache.discard(entry)
                self.cache.count("misses")
                return
            view.tokens[:] = list(entry.tokens)
            view.rewind(n)
        self.cache.use(entry)
        self.counts["restored_tokens"] += n - own

    def status(self) -> dict:
        """The prompt cache's use and budget with the prompt tokens sharing saved (prompt_cache_status's shape)."""
        cache = self.cache.status() if self.cache is not None else \
            {"enabled": False, "budget_bytes": 0, "bytes": 0, "entries": 0, "hits": 0, "misses": 0, "evictions": 0,
             "dir": None}
        return {**cache, "restored_tokens": self.counts["restored_tokens"],
                "copied_tokens": self.counts["copied_tokens"]}


def _copy_state(donor, view, n: int) -> bool:
    """`view` (a sequence of another context) holds the first `n` positions of `donor`'s cells, copied as llama.cpp
    serializes them: the same bytes, so its rows are computed as if it had computed that prefix. False (and `view`
    empty) where llama.cpp refuses the state."""
    if not view.import_state(donor.export_state(), donor.tokens):
        return False
    view.rewind(n)
    return True
