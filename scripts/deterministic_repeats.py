#!/usr/bin/env python3
"""The deterministic mode's repeat check, as docs/serve.md reports it: one chat request in every combination of
policy x max_tokens N and N+1 x prediction (none, one that holds, a wrong one) x greedy and seeded sampling, each sent
REPEATS times, shuffled, four at once to `specquant serve --deterministic --parallel 4` (prompt cache on), so that
requests land in every slot beside every other and take prefixes from each other and the cache. Every greedy answer
must be the bytes the parent gives alone (`--parallel 1 --no-prompt-cache`; its first N tokens for N+1), every seeded
one the same bytes on each repeat. Prints one JSON line per server; exits 1 if any combination differed.

    .venv/bin/python scripts/deterministic_repeats.py models/smollm2-135m --tokens 48
    .venv/bin/python scripts/deterministic_repeats.py models/qwen2.5-coder-1.5b --tokens 24 --predictions none,holds
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
POLICIES = "parent,spec-q4,suffix,auto"
MESSAGES = [{"role": "system", "content": "You are a careful assistant. Answer in full sentences. " * 6},
            {"role": "user",
             "content": "Explain how a lighthouse keeper kept the lamp burning through a winter storm."}]


class Server:
    def __init__(self, family: str, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "specquant_cli", "serve", "--port", "0", "--family", family,
                                      "--deterministic", "--policies", POLICIES, "--policy", "parent", *args],
                                     cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        for line in self.proc.stderr:
            if m := re.search(r"listening on (http://127\.0\.0\.1:\d+)", line):
                self.url = m.group(1)
                threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()  # drained
                return
        raise SystemExit(f"the server did not start ({' '.join(args)})")

    def ask(self, policy: str, n: int, prediction: str | None = None, seeded: bool = False) -> str:
        body = {"model": "m", "messages": MESSAGES, "max_tokens": n, "specquant_policy": policy,
                **({"temperature": 0.8, "seed": 7} if seeded else {"temperature": 0})}
        if prediction is not None:
            body["prediction"] = {"type": "content", "content": prediction}
        r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=900)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.proc.terminate()
        self.proc.wait(60)


def check(server: Server, ref: str, n: int, repeats: int, at_once: int, policies, predictions, samplings) -> dict:
    combos = [(p, k, pr, s) for p in policies for k in (n, n + 1) for pr in predictions for s in samplings]
    jobs = [c for c in combos for _ in range(repeats)]
    random.Random(0).shuffle(jobs)
    sent = {"none": None, "holds": ref, "wrong": ref[::-1]}
    t0 = time.time()
    with ThreadPoolExecutor(at_once) as ex:
        answers = list(ex.map(lambda c: (c, server.ask(c[0], c[1], sent[c[2]], c[3] == "seeded")), jobs))
    by = collections.defaultdict(list)
    for c, text in answers:
        by[c].append(text)
    differing = []
    for c, texts in by.items():
        if c[3] == "seeded":
            ok = len(set(texts)) == 1
        else:
            ok = all(t == ref if c[1] == n else t.startswith(ref) for t in texts)
        if not ok:
            differing.append(c)
            print(f"differs: {c}: {collections.Counter(texts).most_common(3)}", file=sys.stderr)
    return {"requests": len(jobs), "combinations": len(combos), "differing": len(differing),
            "seconds": round(time.time() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family")
    ap.add_argument("--tokens", type=int, default=48, help="N: answers of N and N+1 tokens")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--predictions", default="none,holds,wrong")
    ap.add_argument("--samplings", default="greedy,seeded")
    a = ap.parse_args()
    policies, predictions, samplings = a.policies.split(","), a.predictions.split(","), a.samplings.split(",")
    with Server(a.family, "--parallel", "1", "--no-prompt-cache") as s:
        ref = s.ask("parent", a.tokens)
    bad = 0
    for args, at_once in ((("--parallel", "4"), 4), (("--parallel", "1", "--no-prompt-cache"), 1)):
        with Server(a.family, *args) as s:
            r = check(s, ref, a.tokens, a.repeats if at_once > 1 else 2, at_once, policies, predictions, samplings)
        print(json.dumps({"server": " ".join(args), **r}))
        bad += r["differing"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
