"""The generation threads: `parallel` of them, one per slot; queued generations wait for a free slot, each
runs as a stream of items.

A request becomes a `Job`; `EngineWorker.submit` admits it while fewer than `max_queue` jobs wait behind
the running ones (else 429). A slot's thread iterates the job's record stream and hands each record to the
request's event loop; between two records it looks at the job's cancel flag, and a cancelled job has its
record iterator closed at once (which stops the engine and leaves its caches consistent). A job yields:

    ("start", Answer)      routing and planning done
    ("record", Response)   one per piece of text; the last has `finish_reason` set
    ("error", ApiError)    instead of (or after some) records; nothing follows it
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Optional

from specquant_cli.decoding.forms import FormError
from specquant_cli.errors import Cancelled, InputError, ResourceError, SpecquantError, cancel_on
from specquant_cli.serving.schemas import ApiError, GenerationParams

EWMA_WEIGHT = 0.3  # weight of the newest job duration in the Retry-After estimate
MAX_RETRY_AFTER_S = 60


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")


def disconnected() -> ApiError:
    return ApiError(499, "the client disconnected", code="client_disconnected")  # nobody reads it


class Job:
    """One request's generation. Created on the request's event loop, run on the worker thread."""

    def __init__(self, params: GenerationParams, loop: asyncio.AbstractEventLoop):
        self.params = params
        self._loop = loop
        self._items: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self.cancel_reason: Optional[ApiError] = None
        self.done = False  # the worker has put its last item

    def cancel(self, reason: ApiError) -> None:
        if not self._cancel.is_set():
            self.cancel_reason = reason
            self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def cancel_event(self) -> threading.Event:
        return self._cancel

    def put(self, kind: str, payload: Any) -> None:
        """From any thread: hand an item to the request's loop (dropped if that loop is gone)."""
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def get(self) -> tuple[str, Any]:
        return await self._items.get()


class EngineWorker:
    """The generation threads (one per slot) and their bounded queue.

    Args:
        run: called on a slot's thread with a job's params and the slot's index; returns (answer, records)
            where generation happens as `records` is iterated (`ChatSession.ask_messages`).
        max_queue: jobs allowed to wait behind the running ones; a request beyond that gets 429.
        parallel: slots, i.e. jobs generating at once.
        choose: picks a job's slot from the free ones, least recently used first (default: that one).
        parkable, park: before a job runs, `parkable(slot, free)` names the idle slots to park (cheap: under the
            worker's lock), which are held from other jobs while `park(slots)` empties them (outside it), and then
            freed again (Service.park: an idle slot's cells would cost every running request's calls)."""

    def __init__(self, run: Callable[[GenerationParams, int], tuple[Any, Iterator[Any]]], max_queue: int,
                 parallel: int = 1, choose: Optional[Callable[[GenerationParams, list[int]], int]] = None,
                 parkable: Optional[Callable[[int, list[int]], list[int]]] = None,
                 park: Optional[Callable[[list[int]], None]] = None):
        self._run = run
        self.max_queue = max_queue
        self.parallel = parallel
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: set[Job] = set()
        self._stopping: Optional[ApiError] = None
        self._free = list(range(parallel))  # slots no job runs in, least recently used first
        self._choose = choose or (lambda params, free: free[0])
        self._parkable = parkable or (lambda slot, free: [])
        self._park = park or (lambda slots: None)
        self._threads = [threading.Thread(target=self._loop, name=f"specquant-engine-{i}", daemon=True)
                         for i in range(parallel)]
        self._mean_s: Optional[float] = None
        self.lost: Optional[str] = None  # why the engine is gone for good (a lost RPC worker), else None
        self.counts = {"served": 0, "cancelled": 0, "failed": 0}

    # -- the request side (event loop) ---------------------------------------------------------
    def start(self) -> None:
        for t in self._threads:
            t.start()

    def in_flight(self) -> int:
        """Jobs generating now plus those waiting for a slot (what a newly planned job will share calls with)."""
        return len(self._running) + len(self._waiting)

    def submit(self, job: Job) -> None:
        """Admit `job` or raise ApiError 429 (queue full, with Retry-After) or 503 (shutting down)."""
        with self._cond:
            self._refuse_if_full()
            self._waiting.append(job)
            self._cond.notify()

    def check_room(self) -> None:
        """Raise what `submit` would raise now (a request about to do costly work before it is queued: a grammar
        to compile)."""
        with self._cond:
            self._refuse_if_full()

    def _refuse_if_full(self) -> None:
        if self._stopping is not None:
            raise self._stopping
        busy = len(self._running) >= self.parallel or self._waiting
        if busy and len(self._waiting) >= self.max_queue:
            wait = self._retry_after()
            raise ApiError(429, f"the engine is busy and {len(self._waiting)} request(s) are queued "
                                f"(--queue {self.max_queue}); retry in about {wait} s",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": str(wait)})

    def cancel(self, job: Job, reason: ApiError) -> None:
        """Stop `job`: a waiting job leaves the queue now, a running one stops after its current cycle.
        A finished job is left alone."""
        with self._cond:
            if job.done:
                return
            if job in self._waiting:
                self._waiting.remove(job)
                self.counts["cancelled"] += 1
                job.done = True
                job.put("error", reason)
                return
        job.cancel(reason)

    def stop(self, reason: Optional[ApiError] = None) -> None:
        """Refuse new jobs, fail the waiting ones, stop the running ones; the threads then end. Every open
        request gets `reason` (503 shutting_down) now, not when its generation thread next looks (a thread waiting
        on a stalled RPC worker may not look for minutes)."""
        with self._cond:
            if self._stopping is None:
                self._stopping = reason or shutting_down()
            reason = self._stopping
            for job in [*self._waiting, *self._running]:
                job.cancel(reason)
                if not job.done:
                    job.done = True
                    job.put("error", reason)
            self._waiting.clear()
            self._cond.notify_all()

    def alive(self) -> bool:
        """Whether a generation thread is still running."""
        return any(t.is_alive() for t in self._threads)

    def lose_engine(self, reason: ApiError) -> None:
        """From any thread: the engine is gone for good and its threads will not come back (ggml-rpc lost a
        worker mid-graph: system.rpc parks that thread). The running jobs end with `reason` now, as do the
        waiting ones and every later request; the server stays up to say so."""
        with self._cond:
            self.lost = str(reason)
            running, self._running = self._running, set()
            self._stopping = reason
            for job in [*self._waiting, *running]:
                if not job.done:
                    job.done = True
                    job.put("error", reason)
                    self.counts["failed"] += 1
            self._waiting.clear()
            self._cond.notify_all()

    @property
    def stopping(self) -> bool:
        return self._stopping is not None

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the threads, `timeout` seconds in all (not each)."""
        end = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            if t.is_alive():
                t.join(None if end is None else max(0.0, end - time.monotonic()))

    def status(self) -> dict:
        with self._cond:
            return {"busy": len(self._running) >= self.parallel, "running": len(self._running),
                    "parallel": self.parallel, "queued": len(self._waiting), "max_queue": self.max_queue,
                    **self.counts}

    def _retry_after(self) -> int:
        per_job = self._mean_s if self._mean_s is not None else 1.0
        rounds = math.ceil((len(self._waiting) + 1) / self.parallel)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(per_job * rounds)))

    # -- the worker thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                # a job waits for a free slot too: slots being parked are held from it for a moment
                while (not self._waiting or not self._free) and self._stopping is None:
                    self._cond.wait()
                if not self._waiting or not self._free:  # stopping, nothing left
                    return
                job = self._waiting.popleft()
                self._running.add(job)
                slot = self._pick(job)
                self._free.remove(slot)
                parking = self._held_for_parking(slot)
            t0 = time.perf_counter()
            outcome = "failed"
            try:
                if parking:  # within the job's time, and its slot freed again whatever happens
                    self._park_slots(parking)
                outcome = self._execute(job, slot)
            finally:
                with self._cond:
                    self._running.discard(job)
                    self._free.append(slot)
                    job.done = True
                    self.counts[outcome] += 1
                    took = time.perf_counter() - t0
                    self._mean_s = took if self._mean_s is None else \
                        (1 - EWMA_WEIGHT) * self._mean_s + EWMA_WEIGHT * took

    def _held_for_parking(self, slot: int) -> list[int]:
        """Under the lock: the idle slots to park before `slot` runs (`parkable`), taken out of the free ones."""
        try:
            parking = [i for i in self._parkable(slot, list(self._free)) if i in self._free]
        except Exception:  # noqa: BLE001 - parking is an optimization: its failure costs speed, not the job
            return []
        for i in parking:
            self._free.remove(i)
        return parking

    def _park_slots(self, slots: list[int]) -> None:
        """Park `slots` (outside the lock), then free them again, first in line (least recently used: empty now)."""
        try:
            self._park(slots)
        except Exception:  # noqa: BLE001 - a slot left holding its cells costs speed, not an answer
            pass
        finally:
            with self._cond:
                self._free[:0] = slots
                self._cond.notify_all()

    def _pick(self, job: Job) -> int:
        """The job's slot (`choose`: Service.slot_for, by what the slots hold of its prompt); the least recently
        used free slot when the choice fails."""
        try:
            slot = self._choose(job.params, list(self._free))
        except Exception:  # noqa: BLE001 - a choice is an optimization: its failure costs a prefill, not the job
            slot = None
        return slot if slot in self._free else self._free[0]

    def _execute(self, job: Job, slot: int) -> str:
        """Run one job to its end; returns which counter it adds to: served, cancelled or failed."""
        last = None
        try:
            with cancel_on(job.cancel_event):  # a long prefill stops between its chunks once the job is cancelled
                answer, records = self._run(job.params, slot)
                job.put("start", answer)
                try:
                    for rec in records:
                        if job.cancelled:
                            break
                        job.put("record", rec)
                        last = rec
                finally:
                    records.close()  # a generator: closing it stops the engine now, caches consistent
        except Cancelled:
            pass  # answered below, as a cancel between records is
        except FormError as e:  # e.g. max_tokens does not fit beside the prompt (Service.answer_room)
            job.put("error", ApiError(400, str(e), param=e.param, code=e.code))
            return "failed"
        except InputError as e:  # e.g. a message the chat template cannot keep as text: the prompt's
            job.put("error", ApiError(400, str(e), param=job.params.prompt_param, code="invalid_request"))
            return "failed"
        except ResourceError as e:
            job.put("error", ApiError(503, str(e), type="server_error", code="resources"))
            return "failed"
        except SpecquantError as e:
            job.put("error", ApiError(500, str(e), type="server_error", code="engine_error"))
            return "failed"
        except Exception as e:  # the client gets no detail, the server's log one line
            sys.stderr.write(f"error: internal error in generation: {type(e).__name__}: {e}\n")
            job.put("error", ApiError(500, "internal error", type="server_error", code="internal_error"))
            return "failed"
        if last is not None and last.finish_reason is not None:
            return "served"  # delivered whole (a cancel that came after the last record changes nothing)
        job.put("error", job.cancel_reason or shutting_down())
        return "cancelled"
