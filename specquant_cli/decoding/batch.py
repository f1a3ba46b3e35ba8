"""Several requests decoding together: one llama.cpp context per model, one sequence id per request, and
each parent call shared by every request that needs one (in the deterministic mode, a context per model and
request: runtime.pool.ModelPool.own_caches; the rounds then run each request's call in turn).

Each request runs on its own thread with its own engine, exactly as it would alone; only its contexts
differ: a `SeqView` is one sequence of a shared context. A view's `decode` does not call llama.cpp itself.
It hands its tokens to the `Batcher`, whose thread waits until every active request is waiting on a call
(or `MAX_WAIT_S` has passed), then runs all the waiting calls as one `llama_decode` per context (split at
the context's batch size) and hands each caller a copy of its logits rows. N requests verifying their drafts
thus cost one parent call on all their tokens — on a CPU, 8 tokens cost ~1.6x one token, not 8x.

When calls for several models wait together (one request verifying while another drafts), the parent's
calls are held for a round or more while the draft steps run: the drafting requests then verify together, in
one parent call, instead of every round costing a parent call and a draft call. How long they may wait is the
batch's round price (`hold_s`: the draft calls the round pacer granted, decoding.rounds), DEFER_MAX_S where
nothing is calibrated.

Every other llama.cpp call on a shared context (removing positions, state export and import) holds
`Batcher.ops`, which a round holds too, so no two threads ever touch a context at once."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from specquant_cli.backend.llama import Context, PrefixCache
from specquant_cli.errors import LlamaError

# A round starts once every active request waits on one; a request that is busy longer than this (planning
# a long prompt, a KV import) does not hold the others back: the round runs without it.
MAX_WAIT_S = 0.05
# When calls for several models wait together, those on the heaviest (the parent) wait for the next round
# while the others (draft steps) run, for at most this long from when they came (where the batch's round price
# gives no bound: nothing calibrated): the drafting requests then reach their verification together and share
# one parent call, as their draft steps share draft calls. Without it a request verifying beside one drafting
# makes each round a parent call and a draft call, which every member waits out (4 clients, q4 drafts, AMD
# EPYC: below the parent alone).
DEFER_MAX_S = 0.25


@dataclass
class Call:
    """One view's decode: its tokens, their positions, and which rows want logits."""

    ctx: Context
    seq: int
    tokens: list[int]
    positions: list[int]
    rows: list[int]
    out: dict[int, np.ndarray] = field(default_factory=dict)
    error: Optional[BaseException] = None
    done: bool = False
    since: float = 0.0  # when it was queued (time.monotonic)
    held: bool = False  # held back from a round for the drafting members to catch up (Batcher._split)


@dataclass
class BatchStats:
    rounds: int = 0  # rounds run (one or more llama_decode calls each: one per context and n_batch chunk)
    calls: int = 0  # view decodes served
    tokens: int = 0
    widest: int = 0  # most view decodes in one round
    deferred: int = 0  # parent calls held for a round after the draft steps waiting beside them


class Batcher:
    """The rendezvous of the requests decoding together. Requests are `member`s while they generate; their
    calls run on the batcher's own thread, in rounds, so that one thread makes every llama.cpp compute call
    (ggml's OpenMP build keeps a team of worker threads per calling thread)."""

    def __init__(self, max_wait_s: float = MAX_WAIT_S, hold_s: Optional[Callable[[], Optional[float]]] = None):
        """`hold_s`: how long the parent's calls may wait for the draft calls beside them (None from it, or no
        `hold_s`: DEFER_MAX_S; 0: never held)."""
        self.max_wait_s = max_wait_s
        self._hold_s = hold_s
        self.ops = threading.RLock()  # held by every llama.cpp call on a shared context
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._active = 0
        self._pending: list[Call] = []
        self._oldest = 0.0  # when the oldest pending call came
        self._free_since = 0.0  # when the last round ended
        self._deferring = False  # the pending calls were held back for the drafting members to catch up
        self._weights: dict[int, int] = {}  # id(context) -> its model's file size: which one is the parent
        self._thread: Optional[threading.Thread] = None

    @property
    def active(self) -> int:
        return self._active

    @contextlib.contextmanager
    def member(self) -> Iterator[None]:
        """While the block runs, rounds wait for this thread's calls (up to `max_wait_s`)."""
        with self._cond:
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()  # the others may be the only ones left: a round may be due

    @contextlib.contextmanager
    def away(self) -> Iterator[None]:
        """A member that waits on something else (another request's prefill) while the block runs: the rounds do
        not wait for its calls meanwhile."""
        with self._cond:
            self._active -= 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._active += 1

    def decode(self, call: Call) -> Call:
        """Queue `call`, wait for the round that runs it, and return it with its logits rows (or raise what
        its llama_decode raised)."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="specquant-batcher", daemon=True)
                self._thread.start()
            call.since = time.monotonic()
            if not self._pending:
                self._oldest = call.since
            self._pending.append(call)
            self._cond.notify_all()
            while not call.done:
                self._cond.wait()
        if call.error is not None:
            raise call.error
        return call

    def hold_s(self) -> float:
        h = self._hold_s() if self._hold_s is not None else None
        return DEFER_MAX_S if h is None else h

    def _due(self) -> bool:
        """A round starts when every member waits on one, or when the oldest wait has lasted `max_wait_s`
        counted from when the last round ended: a call that arrived during a round waits for that round's
        members to come back, or rounds would halve and stay out of step."""
        if not self._pending:
            return False
        if len(self._pending) >= self._active:
            return True
        now = time.monotonic()
        if self._deferring:  # held parent calls wait for the drafting members, at most hold_s
            if now - self._oldest >= self.hold_s():
                return True
            fresh = [c.since for c in self._pending if not c.held]
            return bool(fresh) and now - max(min(fresh), self._free_since) >= self.max_wait_s
        return now - max(self._oldest, self._free_since) >= self.max_wait_s

    def _serve(self) -> None:
        """The batcher's thread: run each round when it is due, hand the results back."""
        while True:
            with self._cond:
                while not self._due():
                    self._cond.wait(self.max_wait_s / 5 if self._pending else None)
                batch, self._pending = self._split(self._pending)
                self._deferring = bool(self._pending)
                for c in self._pending:
                    c.held = True
                if self._pending:
                    self._oldest = min(c.since for c in self._pending)
                    self.stats.deferred += len(self._pending)
            try:
                self._run(batch)
            except BaseException as e:  # noqa: BLE001 - every call of the round fails with it; the thread goes on
                for c in batch:
                    if not c.done:
                        c.error, c.done = e, True
            with self._cond:
                self._free_since = time.monotonic()
                self._cond.notify_all()

    def _split(self, pending: list[Call]) -> tuple[list[Call], list[Call]]:
        """(the round's calls, those held for the next): with calls for several models waiting, the heaviest
        model's (the parent's) are held, up to hold_s after they came, while the others run."""
        weights = {self._weight(c.ctx) for c in pending}  # by model: slots with contexts of their own share one
        if len(weights) < 2:
            return pending, []
        heavy, now, hold = max(weights), time.monotonic(), self.hold_s()
        held = [c for c in pending if self._weight(c.ctx) == heavy and now - c.since < hold]
        return [c for c in pending if not any(c is h for h in held)], held

    def _weight(self, ctx) -> int:
        w = self._weights.get(id(ctx))
        if w is None:
            try:
                w = os.path.getsize(ctx.model.path)
            except (OSError, AttributeError, TypeError):
                w = 0
            self._weights[id(ctx)] = w
        return w

    def _run(self, batch: list[Call]) -> None:
        st = self.stats
        st.rounds += 1
        st.widest = max(st.widest, len(batch))
        with self.ops:
            by_ctx: dict[int, list[Call]] = {}
            for c in batch:
                by_ctx.setdefault(id(c.ctx), []).append(c)
            for calls in by_ctx.values():
                calls.sort(key=lambda c: c.seq)  # see _chunks
                for chunk in _chunks(calls, calls[0].ctx.n_batch):
                    _decode_chunk(chunk)
                    st.calls += len(chunk)
                    st.tokens += sum(len(c.tokens) for c in chunk)


def _chunks(calls: list[Call], n_batch: int) -> Iterator[list[Call]]:
    """Whole calls packed into batches of at most n_batch tokens (a view never sends more than n_batch), in
    sequence order: with a KV cache per sequence (not unified), llama.cpp computes a batch in one pass only
    when its sequence ids come in order and without gaps; [3, 2, 1, 0] took four passes (measured: 640 ms
    against 166 ms for [0, 1, 2, 3] on the 1.5B parent). The runtime's shared contexts use one unified
    cache, which has no such rule (8 sequences, out of order: 270 ms, in order 275 ms); the order keeps a
    per-sequence cache fast too when the running sequences are consecutive."""
    chunk, n = [], 0
    for c in calls:
        if chunk and n + len(c.tokens) > n_batch:
            yield chunk
            chunk, n = [], 0
        chunk.append(c)
        n += len(c.tokens)
    if chunk:
        yield chunk


def _decode_chunk(chunk: list[Call]) -> None:
    ctx = chunk[0].ctx
    tokens, positions, seqs, rows, offsets = [], [], [], [], []
    for c in chunk:
        offsets.append(len(tokens))
        rows += [len(tokens) + r for r in c.rows]
        tokens += c.tokens
        positions += c.positions
        seqs += [(c.seq,)] * len(c.tokens)
    try:
        ctx.decode_at(tokens, positions, seqs, rows)
    except LlamaError as e:
        for c in chunk:  # what llama.cpp may have stored of a failed batch is dropped again
            ctx.remove(c.seq, c.positions[0], -1)
        if len(chunk) > 1:  # one request's bad call must not fail the others: each alone, once
            for c in chunk:
                _decode_chunk([c])
        else:
            chunk[0].error, chunk[0].done = e, True
        return
    for c, off in zip(chunk, offsets):
        c.out = {r: np.array(ctx.logits(off + r)) for r in c.rows}  # copies: the next round overwrites them
        c.done = True


class SeqView(PrefixCache):
    """One sequence of a shared context, as a `TokenContext`: what the engine and drafters see of it is what
    they would see of a context of their own. `tokens` is, position by position, what the sequence holds."""

    def __init__(self, ctx: Context, seq: int, batcher: Batcher, n_ctx: int, prefill_chunk: Optional[int] = None):
        self.ctx = ctx
        self.seq = seq
        self.batcher = batcher
        self.model = ctx.model
        self.n_ctx = n_ctx  # this sequence's share of the context
        self.n_batch = ctx.n_batch
        self.prefill_chunk = min(prefill_chunk or ctx.n_batch, ctx.n_batch)
        self.tokens: list[int] = []
        self._rows: dict[int, np.ndarray] = {}
        self._last_n = 0
        with batcher.ops:  # whatever an earlier view of this sequence left is not what `tokens` says
            ctx.remove(seq, 0, -1)

    def _decode_run(self, chunk: list[int], rows: list[int]) -> None:
        """Through the batcher: the call waits for its round."""
        pos0 = self.n_past
        call = self.batcher.decode(Call(self.ctx, self.seq, chunk, [pos0 + i for i in range(len(chunk))], rows))
        self._rows, self._last_n = call.out, len(chunk)

    def logits(self, i: int = -1) -> np.ndarray:
        """Row i of this view's last decoded batch (negative: from its end)."""
        row = self._rows.get(i + self._last_n if i < 0 else i)
        if row is None:
            raise LlamaError(f"no logits at batch index {i}")
        return row

    def chunk_size(self) -> int:
        """While other requests decode beside it, a prompt goes in `prefill_chunk`-token calls: each round then
        costs the running streams one short call, not a whole batch of prefill."""
        return self.prefill_chunk if self.batcher.active > 1 else self.n_batch

    def rewind(self, n: int) -> None:
        if n >= self.n_past:
            return
        with self.batcher.ops:  # the cells and `tokens` change together: another sequence may copy from this one
            del self.tokens[n:]
            self.ctx.remove(self.seq, n, -1)

    def export_state(self):
        with self.batcher.ops:
            return self.ctx.export_state(self.seq)

    def import_state(self, state, tokens: Sequence[int]) -> bool:
        self.rewind(0)
        with self.batcher.ops:
            if not self.ctx.load_state(state, self.seq):
                return False
        self.tokens = list(tokens)
        return True
