"""The parent on llama.cpp RPC workers (`specquant bench rpc`), on loopback: the parent local, through one worker and
through two (layers split by free memory) — per-call ms at 1, 4, 8 tokens and the parent's tok/s —; then one worker
behind a proxy that delays every chunk by D ms each way, with spec-q4 (adaptive draft length, the draft local)
against the parent for each D. A remote call pays the round trips once whatever its tokens, so speculation should
hide more of the delay as D grows. Workers are started here (`specquant worker`); every answer is checked against
the local parent's."""

from __future__ import annotations

import asyncio
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Optional

from specquant_cli.bench.stamp import markdown_lines

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring and two examples.",
    "Explain what a hash table is and how collisions are handled.",
    "Write a bash script that prints the ten largest files under the current directory.",
]
BATCHES = (1, 4, 8)
WORKER_START_S = 30.0


def start_worker(threads: int) -> tuple[subprocess.Popen, str]:
    """A `specquant worker` on a free loopback port: its process and HOST:PORT once it accepts connections."""
    from specquant_cli.bench.sides import free_port
    from specquant_cli.errors import SpecquantError
    from specquant_cli.settings import settings_table

    port = free_port()
    t = settings_table()
    p = subprocess.Popen([sys.executable, "-m", "specquant_cli", "worker", "--port", str(port),
                          t["runtime.threads"].flag, str(threads)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    end = time.monotonic() + WORKER_START_S
    while time.monotonic() < end and p.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return p, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    p.kill()
    p.wait(10)
    raise SpecquantError(f"an RPC worker did not start within {WORKER_START_S:.0f} s")


def stop_worker(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


class DelayProxy:
    """127.0.0.1:port -> target, every chunk forwarded `delay_ms` after it came (each way), order kept."""

    def __init__(self, target: str, delay_ms: float):
        from specquant_cli.bench.sides import free_port

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

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _client(self, reader, writer) -> None:
        up_r, up_w = await asyncio.open_connection(self.target[0], int(self.target[1]))
        up_w.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer), return_exceptions=True)

    async def _pipe(self, reader, writer) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def send():  # a chunk leaves `delay` after it came; later chunks are not held behind its sleep
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


def _per_call_ms(ctx, prefix: list[int], n: int, reps: int) -> float:
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


def _tok_s(rt, prompts, max_tokens: int, spec: bool, ref: dict, differ: list) -> float:
    from specquant_cli.decoding.drafters import ModelDrafter
    from specquant_cli.decoding.engine import Engine
    from specquant_cli.decoding.gamma import AdaptiveGamma
    from specquant_cli.decoding.stream import generate_text
    from specquant_cli.family.roles import PARENT_ROLE

    parent = rt.pool.context(PARENT_ROLE)
    rates = []
    for i, p in enumerate(prompts):
        rt.reset_caches()
        eng = Engine(parent, ModelDrafter(rt.pool.context("q4"), "q4"), AdaptiveGamma()) if spec else Engine(parent)
        _, toks, last = generate_text(eng, p, max_tokens)
        if i in ref and toks != ref[i]:
            differ.append(i)
        ref.setdefault(i, toks)
        rates.append(last.tokens_per_s)
    return statistics.mean(rates)


def measure(family, rpc: list[str], n_prompts: int, max_tokens: int, reps: int, n_ctx: int, threads: int,
            ref: dict, spec: bool, differ: list) -> dict:
    """One parent placement: per-call ms at BATCHES, the parent's tok/s and, with `spec`, spec-q4's."""
    from specquant_cli.decoding.engine import Engine
    from specquant_cli.decoding.stream import generate_text
    from specquant_cli.family.roles import PARENT_ROLE
    from specquant_cli.session import open_session
    from specquant_cli.settings import SessionSettings

    rt = open_session(SessionSettings(n_ctx=n_ctx, rpc=rpc, threads=threads), family=family).runtime
    try:
        parent = rt.pool.context(PARENT_ROLE)
        prompts = [parent.model.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS[:n_prompts]]
        generate_text(Engine(parent), prompts[0], 4)  # warm-up
        row = {"parent_tok_s": _tok_s(rt, prompts, max_tokens, False, ref, differ),
               "call_ms": {n: _per_call_ms(parent, prompts[0], n, reps) for n in BATCHES}}
        if spec:
            row["spec_q4_tok_s"] = _tok_s(rt, prompts, max_tokens, True, ref, differ)
        return row
    finally:
        rt.close()


def run(family, delays: Sequence[float], n_prompts: int, max_tokens: int, reps: int, n_ctx: int, threads: int,
        worker_threads: int, say: Optional[Callable[[str], None]] = None) -> dict:
    """Every placement and delay, one at a time; two workers for the whole run."""
    say = say or (lambda _: None)
    workers = [start_worker(worker_threads) for _ in range(2)]
    eps = [ep for _, ep in workers]
    ref: dict = {}
    differ: list = []
    try:
        rows = {}
        for name, rpc in (("local", []), ("1 worker", eps[:1]), ("2 workers", eps)):
            say(name)
            rows[name] = measure(family, rpc, n_prompts, max_tokens, reps, n_ctx, threads, ref, False, differ)
        delayed = {}
        for d in delays:
            say(f"1 worker +{d:g} ms each way")
            proxy = DelayProxy(eps[0], d)
            try:
                delayed[d] = measure(family, [proxy.endpoint], n_prompts, max_tokens, reps, n_ctx, threads, ref,
                                     True, differ)
            finally:
                proxy.close()
    finally:
        for p, _ in workers:
            stop_worker(p)
    return {"placements": rows, "delays": {f"{d:g}": r for d, r in delayed.items()},
            "answers_differing_from_local": sorted(set(differ))}


def markdown(rep: dict) -> str:
    c = rep["config"]
    lines = [f"# RPC parent: {rep['family']} (parent {rep['parent']}), {c['max_tokens']} tokens x {c['prompts']} "
             f"prompts, workers with {c['worker_threads']} thread(s), loopback", "", f"- command: `{rep['command']}`",
             *markdown_lines(rep.get("stamp")), "",
             "| parent on | " + " | ".join(f"{n}-token call ms" for n in BATCHES) + " | parent tok/s |",
             "|---|" + "---:|" * (len(BATCHES) + 1)]
    for name, r in rep["placements"].items():
        lines.append(f"| {name} | " + " | ".join(f"{r['call_ms'][n]:.1f}" for n in BATCHES)
                     + f" | {r['parent_tok_s']:.1f} |")
    lines += ["", "| added delay (each way) | 1-token call ms | parent tok/s | spec-q4 tok/s | speedup |",
              "|---:|---:|---:|---:|---:|"]
    for d, r in rep["delays"].items():
        lines.append(f"| {d} ms | {r['call_ms'][1]:.1f} | {r['parent_tok_s']:.1f} | {r['spec_q4_tok_s']:.1f} | "
                     f"{r['spec_q4_tok_s'] / r['parent_tok_s']:.2f}x |")
    bad = rep["answers_differing_from_local"]
    lines += ["", "Every answer identical to the local parent's." if not bad else
              f"Answers of prompts {', '.join(str(i + 1) for i in bad)} differed from the local parent's."]
    return "\n".join(lines) + "\n"
