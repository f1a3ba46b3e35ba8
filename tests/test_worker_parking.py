"""The generation threads park idle slots before a job runs (serving.worker.EngineWorker with Service.parkable and
Service.park): the slots being parked are held from every other job until they are empty, then are the first free."""

from __future__ import annotations

import asyncio
import threading
import time

from specquant_cli.serving.worker import EngineWorker, Job


def test_a_slot_being_parked_takes_no_job_until_it_is_empty():
    events: list[tuple] = []
    lock = threading.Lock()
    parking = threading.Event()

    def run(params, slot):
        with lock:
            events.append(("run", params, slot, parking.is_set(), time.monotonic()))
        return object(), (x for x in [])

    def park(slots):
        parking.set()
        time.sleep(0.3)
        with lock:
            events.append(("parked", tuple(slots), time.monotonic()))
        parking.clear()

    held = {1}  # slot 1 holds an idle conversation; slot 0 holds nothing
    worker = EngineWorker(run, max_queue=4, parallel=2, parkable=lambda slot, free: [i for i in free if i in held],
                          park=park)
    loop = asyncio.new_event_loop()
    worker.start()
    try:
        worker.submit(Job("a", loop))  # slot 0, the least recently used: slot 1 is parked before it runs
        time.sleep(0.05)
        held.clear()
        worker.submit(Job("b", loop))  # waits for slot 1 until the park is done
        deadline = time.monotonic() + 10
        while sum(e[0] == "run" for e in events) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        worker.stop()
        worker.join(5)
        loop.close()
    runs = {e[1]: e for e in events if e[0] == "run"}
    parked = [e for e in events if e[0] == "parked"]
    assert [p[1] for p in parked] == [(1,)]
    assert runs["a"][2] == 0 and runs["b"][2] == 1
    assert not runs["b"][3] and runs["b"][4] >= parked[0][2]  # b ran in slot 1 only once it was parked


def test_a_failed_park_frees_its_slots_and_the_job_runs():
    ran = []

    def broken(slots):
        raise RuntimeError("no")

    def run(params, slot):
        ran.append(slot)
        return object(), (x for x in [])

    worker = EngineWorker(run, max_queue=4, parallel=2, parkable=lambda slot, free: list(free), park=broken)
    loop = asyncio.new_event_loop()
    worker.start()
    try:
        for name in ("a", "b"):
            worker.submit(Job(name, loop))
        deadline = time.monotonic() + 10
        while (len(ran) < 2 or worker.status()["running"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        free = sorted(worker._free)
    finally:
        worker.stop()
        worker.join(5)
        loop.close()
    assert free == [0, 1]  # no slot lost to the failed park
    assert len(ran) == 2 and set(ran) <= {0, 1}  # both ran: the slots the park failed on were freed again
