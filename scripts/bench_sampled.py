"""Greedy vs sampled decode speed through `specquant serve` and through `specquant chat`, same prompt.

For each policy and temperature, runs the prompt --runs times through the CLI (`chat --json`, one process
per run, its own tokens_per_s) and through one server started for the whole run (its `specquant` extension's
tokens_per_s), and prints a markdown table of medians with serve / CLI. Progress goes to stderr.

    .venv/bin/python scripts/bench_sampled.py --family models/smollm2-135m --policies parent,auto --runs 3
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Explain in three sentences how a hash map handles collisions."


def cli_tok_s(args, policy: str, temperature: float, seed: int) -> float:
    cmd = [sys.executable, "-m", "specquant_cli", "chat", "--family", args.family, "--policy", policy,
           "--max-tokens", str(args.max_tokens), "--temperature", str(temperature), "--seed", str(seed), "--json",
           PROMPT]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL)
    return float(json.loads(out.stdout.splitlines()[-1])["stats"]["tokens_per_s"])


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "specquant_cli", "serve", "--port", "0", "--family", args.family,
           "--policies", ",".join(args.policies)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, ready = [], threading.Event()

    def read():
        for line in proc.stderr:
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url.append(m.group(1))
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(600):
        proc.kill()
        sys.exit("server did not start")
    return proc, url[0]


def serve_tok_s(url: str, args, policy: str, temperature: float, seed: int) -> float:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.max_tokens,
            "temperature": temperature, "seed": seed, "specquant_policy": policy}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return float(r.json()["specquant"]["tokens_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default=str(REPO / "models" / "smollm2-135m"))
    ap.add_argument("--policies", default="parent,auto", type=lambda s: s.split(","))
    ap.add_argument("--temperatures", default="0,0.7", type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    proc, url = start_server(args)
    rows = []
    try:
        for policy in args.policies:
            for t in args.temperatures:
                cli, srv = [], []
                for seed in range(args.runs):
                    srv.append(serve_tok_s(url, args, policy, t, seed))
                    cli.append(cli_tok_s(args, policy, t, seed))
                    print(f"{policy} T={t} seed={seed}: serve {srv[-1]:.1f} cli {cli[-1]:.1f} tok/s", file=sys.stderr)
                rows.append((policy, t, statistics.median(srv), statistics.median(cli)))
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"| policy | temperature | serve tok/s | CLI tok/s | serve / CLI |  ({args.runs} runs, median; "
          f"{args.max_tokens} new tokens)")
    print("|---|---|---|---|---|")
    for policy, t, s, c in rows:
        print(f"| {policy} | {t:g} | {s:.1f} | {c:.1f} | {s / c:.2f} |")


if __name__ == "__main__":
    main()
