"""B requests decoding together in one process (`specquant bench batch`): the server's slots, batcher and round
pacer (serving.slots) without HTTP, as llama.cpp's `llama-batched-bench` measures its own batching.

For each `--requests` value B and each policy, B requests (the first B prompts, one each) start together in B
slot threads and run to their end; the run's aggregate tokens per second is every answer's tokens over the wall
time from the start to the last answer's end. Every run starts from empty KV caches and an empty drafting memory,
on fresh slots, and the configurations are interleaved (each B: every policy, then again for --repeat), so the
VM's drift falls on each alike. With `--hold off` beside `priced`, the batcher never holds the parent's calls for
draft calls beside them: the same runs without the hold, to measure what it is worth at each B.

Each answer is compared token for token with the `parent` policy's at the same B when that is among the
policies (greedy answers are the parent's own, up to a near-tie the batch's rounding can flip)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from specquant_cli.bench.stamp import markdown_lines

HOLDS = ("priced", "off")


@dataclass
class BatchRun:
    policy: str
    parallel: int
    hold: str
    repeat: int
    wall_s: float
    tokens: int
    answers: list[list[int]] = field(default_factory=list)
    plans: list[str] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    deferred: int = 0
    identical: Optional[int] = None  # answers equal to the parent's at the same B (None: no parent run)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def run_one(session, policy: str, parallel: int, prompts: Sequence[str], max_tokens: int, hold: str,
            repeat: int, prefill_chunk: Optional[int] = None) -> BatchRun:
    """One run: `parallel` requests of `policy` decoding together on fresh slots of `session`'s runtime."""
    from specquant_cli.serving.slots import LockedRouter, Slots

    shared = session.runtime
    shared.drafters.forget()  # no run drafts from another's answers
    slots = Slots(shared, parallel, prefill_chunk, hold=hold == "priced")  # fresh views: every sequence emptied
    sessions = [session.for_runtime(rt, LockedRouter(session.router, slots.route_lock())) for rt in slots.runtimes]
    running = [0]
    lock = threading.Lock()
    slots.in_flight = lambda: max(1, running[0])
    start = threading.Barrier(parallel)
    out: list = [None] * parallel
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            msgs = [{"role": "user", "content": prompts[i % len(prompts)]}]
            start.wait(600)
            with lock:
                running[0] += 1
            answer, records = sessions[i].ask_messages(msgs, policy=policy, max_tokens=max_tokens)
            tokens = [rec.token for rec in slots.member(records) if rec.token is not None]
            out[i] = (answer, tokens, time.perf_counter())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)
            start.abort()
        finally:
            with lock:
                running[0] -= 1

    threads = [threading.Thread(target=work, args=(i,), name=f"bench-batch-{i}") for i in range(parallel)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    wall = max(end for _, _, end in out) - t0
    answers = [tokens for _, tokens, _ in out]
    lasts = [a.last for a, _, _ in out if a.last is not None]
    return BatchRun(policy, parallel, hold, repeat, wall, sum(len(x) for x in answers), answers,
                    [a.plan.describe() for a, _, _ in out], sum(x.drafted for x in lasts),
                    sum(x.accepted for x in lasts), slots.batcher.stats.rounds, slots.batcher.stats.deferred)


def run(session, policies: Sequence[str], parallels: Sequence[int], holds: Sequence[str], prompts: Sequence[str],
        max_tokens: int, repeats: int, prefill_chunk: Optional[int] = None,
        progress: Optional[Callable[[str], None]] = None) -> list[BatchRun]:
    """Every (B, policy, hold), interleaved: for each B, every policy and hold in turn, `repeats` times."""
    runs = []
    for b in parallels:
        for k in range(1, repeats + 1):
            for policy in policies:
                for hold in holds:
                    if progress:
                        progress(f"{b} requests, {policy}, hold {hold}" + (f", run {k}" if repeats > 1 else ""))
                    runs.append(run_one(session, policy, b, prompts, max_tokens, hold, k, prefill_chunk))
    for r in runs:
        ref = next((x for x in runs if x.policy == "parent" and x.parallel == r.parallel), None)
        if ref is not None:
            r.identical = sum(a == p for a, p in zip(r.answers, ref.answers))
    return runs


def report(runs: Sequence[BatchRun], config: dict, stamp: dict, family) -> dict:
    """Per (B, policy, hold): the median aggregate tok/s over the repeats and its ratio to the parent's at that B
    (the hold priced), the batcher's rounds and held calls, drafted and kept tokens, identical answers."""
    rows = []
    keys = list(dict.fromkeys((r.parallel, r.policy, r.hold) for r in runs))
    for b, policy, hold in keys:
        mine = [r for r in runs if (r.parallel, r.policy, r.hold) == (b, policy, hold)]
        tps = statistics.median(r.tokens_per_s for r in mine)
        rows.append({"parallel": b, "policy": policy, "hold": hold, "runs": len(mine), "tokens_per_s": round(tps, 3),
                     "wall_s": round(statistics.median(r.wall_s for r in mine), 3),
                     "tokens": mine[0].tokens, "rounds": round(statistics.median(r.rounds for r in mine)),
                     "held_calls": round(statistics.median(r.deferred for r in mine)),
                     "drafted": sum(r.drafted for r in mine), "accepted": sum(r.accepted for r in mine),
                     "identical": None if mine[0].identical is None else sum(r.identical for r in mine),
                     "answers": sum(len(r.answers) for r in mine),
                     "plans": sorted({p for r in mine for p in r.plans})})
    for row in rows:
        parents = [x for x in rows if x["parallel"] == row["parallel"] and x["policy"] == "parent"]
        base = next((x for x in parents if x["hold"] == "priced"), parents[0] if parents else None)
        row["vs_parent"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3) if base and base["tokens_per_s"] \
            else None
    return {"command": stamp["command"], "stamp": stamp, "family": {"name": family.name, "root": str(family.root),
                                           "parent": family.parent_rendering},
            "config": config, "rows": rows,
            "runs": [{"parallel": r.parallel, "policy": r.policy, "hold": r.hold, "repeat": r.repeat,
                      "wall_s": round(r.wall_s, 3), "tokens": r.tokens, "tokens_per_s": round(r.tokens_per_s, 3),
                      "rounds": r.rounds, "held_calls": r.deferred, "drafted": r.drafted, "accepted": r.accepted,
                      "identical": r.identical, "plans": r.plans} for r in runs]}


def markdown(rep: dict) -> str:
    c = rep["config"]
    lines = [f"# Requests decoding together: {rep['family']['name']} (parent {rep['family']['parent']})", "",
             f"- command: `{rep['command']}`", *markdown_lines(rep.get("stamp")),
             f"- {c['max_tokens']} max tokens, greedy, {c['threads']} threads; one request per slot, all starting "
             "together; aggregate tok/s (medians" + (f" of {c['repeats']} runs" if c["repeats"] > 1 else "")
             + ")", "",
             "| requests | policy | hold | tok/s | × parent | wall s | rounds | held | drafted/kept | identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        ident = "–" if r["identical"] is None else f"{r['identical']}/{r['answers']}"
        ratio = "–" if r["vs_parent"] is None else f"{r['vs_parent']:.2f}x"
        lines.append(f"| {r['parallel']} | {r['policy']} | {r['hold']} | {r['tokens_per_s']:.2f} | {ratio} | "
                     f"{r['wall_s']:.1f} | {r['rounds']} | {r['held_calls']} | {r['drafted']}/{r['accepted']} | "
                     f"{ident} |")
    plans: dict[str, dict[str, list[int]]] = {}  # policy -> plan -> the numbers of requests it ran at
    for r in rep["rows"]:
        for p in r["plans"]:
            plans.setdefault(r["policy"], {}).setdefault(p, []).append(r["parallel"])
    lines += ["", "Plans each policy ran (at how many requests):"]
    lines += [f"- {policy}: " + "; ".join(f"{p} ({', '.join(map(str, dict.fromkeys(bs)))})" for p, bs in ps.items())
              for policy, ps in plans.items()]
    return "\n".join(lines) + "\n"
