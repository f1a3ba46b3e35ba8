"""llama.cpp's own speculative modes on the same prompts, for the side-by-side table in docs/BENCHMARKS.md.

Needs a `llama-server` built from the llama.cpp sources vendored in the installed llama-cpp-python's sdist
(this script builds nothing and the repo ships no binary):

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DLLAMA_CURL=OFF && \\
        cmake --build build --target llama-server -j2

    python scripts/bench_native.py --server PATH/llama-server --family models/qwen2.5-coder-1.5b \\
        --dataset ../shared/bench/spec_bench.jsonl --categories summarization --limit 5 --max-tokens 128

Modes: F16 alone, the q4 variant as draft model, ngram-map-k, ngram-mod. Each prompt runs from an empty
prompt cache (`cache_prompt: false`), greedy. Prints one JSON object (per mode: mean tok/s end to end and
in the decode phase, and the speedups over F16 alone) and a markdown table on stderr."""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from specquant_cli.bench.datasets import load
from specquant_cli.family.manifest import Family


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(base: str, proc, timeout: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise SystemExit("llama-server did not become ready")


def run_mode(server: str, fam: Family, mode: str, extra: list[str], items, max_tokens: int, threads: int,
             log: Path) -> list[dict]:
    port = free_port()
    cmd = [server, "-m", str(fam.path("f16")), "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "-c", "4096", "-np", "1", "--jinja", *extra]
    with open(log, "a") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_ready(base, proc)
            post(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hello."}],
                                                 "max_tokens": 8, "temperature": 0})  # warm-up
            out = []
            for it in items:
                r = post(base + "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": it.prompt}], "max_tokens": max_tokens,
                    "temperature": 0, "cache_prompt": False})
                t = r["timings"]
                n = t["predicted_n"]
                wall = (t["prompt_ms"] + t["predicted_ms"]) / 1000
                out.append({"item": it.id, "category": it.category, "mode": mode, "new_tokens": n,
                            "tokens_per_s": n / wall, "decode_tokens_per_s": n / (t["predicted_ms"] / 1000),
                            "draft_n": t.get("draft_n", 0), "draft_accepted": t.get("draft_n_accepted", 0),
                            "text": r["choices"][0]["message"]["content"]})
                print(f"{mode} {it.id}: {out[-1]['tokens_per_s']:.2f} tok/s", file=sys.stderr)
            return out
        finally:
            proc.terminate()
            proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--family", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--categories", default="summarization")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-file", default=None)
    a = ap.parse_args()
    fam = Family.load(a.family)
    items = load([Path(a.dataset)], a.categories.split(","), a.limit)
    modes = {"f16": [], "draft-q4": ["-md", str(fam.path("q4")), "-td", str(a.threads)],
             "ngram-map-k": ["--spec-type", "ngram-map-k"], "ngram-mod": ["--spec-type", "ngram-mod"]}
    log = Path("/tmp/bench_native_server.log")
    rows = []
    for mode, extra in modes.items():
        rows += run_mode(a.server, fam, mode, extra, items, a.max_tokens, a.threads, log)
    base = statistics.mean(r["tokens_per_s"] for r in rows if r["mode"] == "f16")
    base_dec = statistics.mean(r["decode_tokens_per_s"] for r in rows if r["mode"] == "f16")
    summary = {}
    for mode in modes:
        rs = [r for r in rows if r["mode"] == mode]
        tps = statistics.mean(r["tokens_per_s"] for r in rs)
        dec = statistics.mean(r["decode_tokens_per_s"] for r in rs)
        drafted = sum(r["draft_n"] for r in rs)
        summary[mode] = {"tokens_per_s": round(tps, 3), "speedup": round(tps / base, 3),
                         "decode_speedup": round(dec / base_dec, 3),
                         "acceptance": round(sum(r["draft_accepted"] for r in rs) / drafted, 3) if drafted else None}
    rep = {"command": " ".join(sys.argv), "items": len(items), "summary": summary, "records": rows}
    if a.json_file:
        Path(a.json_file).write_text(json.dumps(rep, indent=2))
    print(json.dumps({"summary": summary}))
    print("| mode | tok/s | speedup | decode speedup | acceptance |\n|---|---|---|---|---|", file=sys.stderr)
    for m, s in summary.items():
        print(f"| {m} | {s['tokens_per_s']:.2f} | {s['speedup']:.2f}x | {s['decode_speedup']:.2f}x | "
              f"{s['acceptance'] if s['acceptance'] is not None else '–'} |", file=sys.stderr)


if __name__ == "__main__":
    main()
