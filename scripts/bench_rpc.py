#!/usr/bin/env python3
"""RPC benchmark: the parent local vs on llama.cpp RPC workers (loopback), and speculation vs round-trip delay.

    .venv/bin/python scripts/bench_rpc.py --family models/smollm2-135m --max-tokens 48 --prompts 2

1. Parent per-call ms by batch size (1, 4, 8 tokens) and parent-only tok/s: local, through one worker, through
   two workers (layers split by free memory).
2. One worker behind a delaying TCP proxy (asyncio, D ms added each way): spec-q4 (adaptive γ, draft local) vs
   parent tok/s for each D. Every remote call pays the round trips; a verify call of γ+1 tokens pays them once
   for up to γ+1 tokens, so speculation should hide more of the delay as D grows.

Workers are started here (`python -m specquant_cli worker`), with --worker-threads each. Greedy output is
checked identical to the local parent's. Markdown on stdout, progress on stderr."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from specquant_cli.decoding.drafters import ModelDrafter
from specquant_cli.decoding.engine import Engine
from specquant_cli.decoding.gamma import AdaptiveGamma
from specquant_cli.decoding.stream import generate_text
from specquant_cli.family.manifest import Family
from specquant_cli.runtime import Runtime
from specquant_cli.session import open_session
from specquant_cli.settings import SessionSettings

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring and two examples.",
    "Explain what a hash table is and how collisions are handled.",
    "Write a bash script that prints the ten largest files under the current directory.",
]
BATCHES = (1, 4, 8)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "specquant_cli", "worker", "--port", str(port), "--threads",
                          str(threads)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return p, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    p.kill()
    raise SystemExit("a worker did not start")


class DelayProxy:
    """127.0.0.1:port -> target, every chunk forwarded after `delay_ms` (each way), order kept."""

    def __init__(self, target: str, delay_ms: float):
        self.target = target.rsplit(":", 1)
        self.delay = delay_ms / 1000
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()

    async def _client(self, reader, writer) -> None:
        up_r, up_w = await asyncio.open_connection(self.target[0], int(self.target[1]))
        up_w.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer), return_exceptions=True)

    async def _pipe(self, reader, writer) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def send():  # a chunk leaves `delay` after it arrived; later chunks are not held behind its sleep
            while (item := await queue.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - self.loop.time()))
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.create_task(send())
        while data := await reader.read(1 << 16):
            queue.put_nowait((self.loop.time() + self.delay, data))
        queue.put_nowait(None)
        await sender


def per_call_ms(ctx, prefix: list[int], n: int, reps: int) -> float:
    ctx.reset()
    ctx.sync(prefix, logits="none")
    base = ctx.n_past
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ctx.decode(prefix[-n:], logits="all")
        ts.append(time.perf_counter() - t0)
        ctx.rewind(base)
    return statistics.median(ts) * 1000


def tok_s(rt: Runtime, prompts, max_tokens: int, spec: bool, ref: dict) -> float:
    parent = rt.pool.context("f16")
    rates = []
    for i, p in enumerate(prompts):
        rt.reset_caches()
        eng = Engine(parent, ModelDrafter(rt.pool.context("q4"), "q4"), AdaptiveGamma()) if spec else Engine(parent)
        _, toks, last = generate_text(eng, p, max_tokens)
        if i in ref and toks != ref[i]:
            say(f"  WARNING: output of prompt {i + 1} differs from the local parent's")
        ref.setdefault(i, toks)
        rates.append(last.tokens_per_s)
    return statistics.mean(rates)


def measure(fam: Family, rpc: list[str], a, ref: dict, spec: bool, calls: bool) -> dict:
    rt = open_session(SessionSettings(n_ctx=a.n_ctx, rpc=rpc), family=fam).runtime
    try:
        parent = rt.pool.context("f16")
        prompts = [parent.model.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS[:a.prompts]]
        generate_text(Engine(parent), prompts[0], 4)  # warm-up
        row = {"parent": tok_s(rt, prompts, a.max_tokens, False, ref)}
        if calls:
            row["calls"] = {n: per_call_ms(parent, prompts[0], n, a.reps) for n in BATCHES}
        if spec:
            row["spec"] = tok_s(rt, prompts, a.max_tokens, True, ref)
        return row
    finally:
        rt.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="models/smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--delays", default="0,1,5", help="ms added each way by the proxy")
    ap.add_argument("--worker-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    a = ap.parse_args()
    fam = Family.load(a.family)
    workers = [start_worker(a.worker_threads) for _ in range(2)]
    eps = [ep for _, ep in workers]
    ref: dict = {}
    try:
        rows = {}
        for name, rpc in (("local", []), ("1 worker", eps[:1]), ("2 workers", eps)):
            say(f"{name} ...")
            rows[name] = measure(fam, rpc, a, ref, spec=False, calls=True)
        delayed = {}
        for d in (float(x) for x in a.delays.split(",")):
            say(f"1 worker +{d:g} ms each way ...")
            proxy = DelayProxy(eps[0], d)
            delayed[d] = measure(fam, [proxy.endpoint], a, ref, spec=True, calls=True)
    finally:
        for p, _ in workers:
            p.send_signal(signal.SIGTERM)
            p.wait(20)
    report(fam, a, rows, delayed)


def report(fam: Family, a, rows: dict, delayed: dict) -> None:
    print(f"## RPC parent: {fam.name}, {a.max_tokens} tokens x {a.prompts} prompts, "
          f"workers with {a.worker_threads} thread(s), loopback\n")
    print("| parent on | " + " | ".join(f"{n}-token call ms" for n in BATCHES) + " | parent tok/s |")
    print("|---|" + "---:|" * (len(BATCHES) + 1))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{r['calls'][n]:.1f}" for n in BATCHES) + f" | {r['parent']:.1f} |")
    print("\n| added delay (each way) | 1-token call ms | parent tok/s | spec-q4 tok/s | speedup |")
    print("|---:|---:|---:|---:|---:|")
    for d, r in delayed.items():
        print(f"| {d:g} ms | {r['calls'][1]:.1f} | {r['parent']:.1f} | {r['spec']:.1f} | "
              f"{r['spec'] / r['parent']:.2f}x |")


if __name__ == "__main__":
    main()
