"""Requests/s and time-to-first-token of `specquant serve` for a short prompt, with 1 and N concurrent clients.

Starts the server (a subprocess on a free port) unless --url is given, warms it up, then for each client
count runs --requests streamed chat requests spread over that many clients (official `openai` client).
TTFT is the time from sending a request to its first content chunk (queueing included); requests/s is
requests over wall time. Prints a markdown table on stdout; the server's log goes to stderr with --verbose.

    .venv/bin/python scripts/bench_serve.py --clients 1,8 --requests 16 --max-tokens 32 --threads 1
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parent.parent
PROMPT = "What is the capital of France?"


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "specquant_cli", "serve", "--port", "0", "--family", args.family,
           "--queue", "64", "--policy", args.policy, "--policies", args.policy]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ready, url = threading.Event(), []

    def read():
        for line in proc.stderr:
            if args.verbose:
                sys.stderr.write(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(300) or not url:
        proc.kill()
        sys.exit("server did not start")
    return proc, url[0]


def one(url: str, max_tokens: int) -> tuple[float, float, int]:
    """(ttft_s, total_s, completion tokens) of one streamed greedy request."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    for chunk in client.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return ttft if ttft is not None else float("nan"), time.perf_counter() - t0, tokens


def run(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda _: one(url, max_tokens), range(requests)))
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    return {"clients": clients, "requests": requests, "wall_s": wall, "req_per_s": requests / wall,
            "ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_max_ms": 1000 * ttfts[-1],
            "latency_p50_ms": 1000 * statistics.median(r[1] for r in results),
            "tokens_per_request": statistics.mean(r[2] for r in results),
            "tokens_per_s": sum(r[2] for r in results) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default=str(REPO / "models" / "smollm2-135m"))
    ap.add_argument("--policy", default="parent")
    ap.add_argument("--clients", default="1,8", help="comma-separated client counts")
    ap.add_argument("--requests", type=int, default=16, help="requests per client count")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="llama.cpp threads (0: the server's default)")
    ap.add_argument("--url", help="an already running server (no API key) instead of starting one")
    ap.add_argument("--verbose", action="store_true", help="the server's log on stderr")
    args = ap.parse_args()

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        for _ in range(2):  # warm-up: first-request costs and the prefix cache
            one(url, args.max_tokens)
        rows = [run(url, int(c), args.requests, args.max_tokens) for c in args.clients.split(",")]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(f"policy {args.policy}, prompt {PROMPT!r}, max_tokens {args.max_tokens}, "
          f"threads {args.threads or 'default'}, {os.cpu_count()} CPUs\n")
    print("| clients | requests | req/s | TTFT p50 (ms) | TTFT max (ms) | latency p50 (ms) | tokens/req | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['requests']} | {r['req_per_s']:.2f} | {r['ttft_p50_ms']:.0f} | "
              f"{r['ttft_max_ms']:.0f} | {r['latency_p50_ms']:.0f} | {r['tokens_per_request']:.0f} | "
              f"{r['tokens_per_s']:.1f} |")


if __name__ == "__main__":
    main()
