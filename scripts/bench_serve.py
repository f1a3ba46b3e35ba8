"""`specquant serve` under concurrent clients: one request at a time (--parallel 1) against requests decoded
together (--parallel N), per policy, with every answer checked against the parent's own.

For each --parallel value a server is started (a subprocess on a free port, --policies as given), warmed
up, then for each policy and client count C, C clients (official `openai` client, streamed, greedy) each send
one Spec-Bench question at once. Per run: aggregate tokens/s (all completion tokens over wall time),
per-request tokens/s (tokens over that request's own latency, median), TTFT p50/p95 (from sending to the
first content chunk: queueing and prefill included), and the plan each answer ran (in the JSON). After the
servers, the parent alone (in this process, one token per call) answers every question; each served answer
is `identical` to it, a `near-tie` (where it leaves the parent's answer the parent's top two logits are
closer than the measured batch-vs-single noise and the answer takes the other of the two) or `unexplained`.

    python scripts/bench_serve.py --family models/qwen2.5-coder-1.5b --parallel 1,8 --policies parent,auto \\
        --clients 1,2,4,8 --max-tokens 128 --json-file docs/bench/serve-qwen.json \\
        --markdown docs/bench/serve-qwen.md --plot docs/bench/serve-qwen.png

With `--llama-server PATH` (a llama-server built from the llama.cpp sources vendored in the installed
llama-cpp-python's sdist; see scripts/bench_native.py: nothing of it is committed), the same questions also go
to llama-server at each --parallel value (`-np N`, N × 4096 positions, the same threads), in each of
`--llama-modes` (plain: no speculation; ngram-mod: its n-gram table shared by all slots; draft-q4: the q4
variant as its draft model), with its prompt cache off per request, and its answers are judged the same way.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from specquant_cli.bench import fidelity
from specquant_cli.bench.datasets import load

REPO = Path(__file__).resolve().parent.parent
SPEC_BENCH = REPO.parent / "shared" / "bench" / "spec_bench.jsonl"
# One question from each of Spec-Bench's multi-turn categories: short prompts, open answers.
CATEGORIES = "writing,roleplay,reasoning,math,coding,extraction,stem,humanities"


def start_server(args, parallel: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "specquant_cli", "serve", "--port", "0", "--family", args.family, "--queue", "64",
           "--parallel", str(parallel), "--policy", args.policies[0], "--policies", ",".join(args.policies),
           "--max-tokens", str(args.max_tokens)]
    return launch(cmd, args.verbose)


def launch(cmd: list[str], verbose: bool = False) -> tuple[subprocess.Popen, str]:
    """Start `specquant serve` (`cmd`), echo its notable stderr lines, return it and its URL once it listens."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ready, url = threading.Event(), []

    def read():
        for line in proc.stderr:
            if verbose or "listening" in line or "error" in line or "warning" in line:
                sys.stderr.write(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                url.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(900) or not url:
        proc.kill()
        sys.exit("bench_serve: the server did not start")
    return proc, url[0]


LLAMA_MODES = {"plain": [], "ngram-mod": ["--spec-type", "ngram-mod"], "draft-q4": ["-md", "{q4}", "-td", "2"]}


def one(url: str, question: str, policy: str, max_tokens: int) -> dict:
    """One streamed greedy request: its TTFT, latency, completion tokens, text and the plan it ran. A policy
    named `llama-server …` is one of llama-server's modes: its prompt cache is turned off for the request."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    t0 = time.perf_counter()
    ttft, tokens, parts, plan = None, 0, [], None
    extra = {"cache_prompt": False} if policy.startswith("llama-server") else {"specquant_policy": policy}
    for chunk in client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra):
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        plan = (chunk.model_extra or {}).get("specquant", {}).get("plan", plan)
    return {"ttft_s": ttft if ttft is not None else float("nan"), "latency_s": time.perf_counter() - t0,
            "tokens": tokens, "text": "".join(parts), "plan": plan}


def run(url: str, questions: list[str], policy: str, clients: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda q: one(url, q, policy, max_tokens), questions[:clients]))
    wall = time.perf_counter() - t0
    ttfts = sorted(a["ttft_s"] for a in answers)
    return {"policy": policy, "clients": clients, "wall_s": round(wall, 3),
            "tokens_per_s": round(sum(a["tokens"] for a in answers) / wall, 3),
            "request_tokens_per_s": round(statistics.median(a["tokens"] / a["latency_s"] for a in answers), 3),
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
            "ttft_p95_ms": round(1000 * ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))], 1),
            "answers": answers}


def serve_runs(args, questions: list[str], parallel: int) -> list[dict]:
    proc, url = start_server(args, parallel)
    try:
        for policy in args.policies:  # warm-up: first-request costs
            one(url, questions[0], policy, 8)
        rows = []
        for policy in args.policies:
            for c in args.clients:
                row = {"parallel": parallel, **run(url, questions, policy, c, args.max_tokens)}
                print(f"parallel {parallel} {policy} x{c}: {row['tokens_per_s']:.2f} tok/s", file=sys.stderr)
                rows.append(row)
        return rows
    finally:
        proc.terminate()
        proc.wait(60)


def llama_runs(args, questions: list[str], parallel: int) -> list[dict]:
    """The same clients against llama-server in each of --llama-modes, at `parallel` slots."""
    import socket

    from specquant_cli.family.manifest import Family

    fam, rows = Family.load(args.family), []
    for mode in args.llama_modes:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        extra = [a.replace("{q4}", str(fam.path("q4"))) for a in LLAMA_MODES[mode]]
        cmd = [args.llama_server, "-m", str(fam.path("f16")), "--port", str(port), "-t", "2", "-tb", "2",
               "-np", str(parallel), "-c", str(4096 * parallel), "--jinja", *extra]
        with open("/tmp/bench_serve_llama.log", "a") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url, name = f"http://127.0.0.1:{port}", f"llama-server {mode}"
        try:
            _wait_ready(url, proc)
            one(url, questions[0], name, 8)  # warm-up
            for c in args.clients:
                row = {"parallel": parallel, **run(url, questions, name, c, args.max_tokens)}
                print(f"parallel {parallel} {name} x{c}: {row['tokens_per_s']:.2f} tok/s", file=sys.stderr)
                rows.append(row)
        finally:
            proc.terminate()
            proc.wait(60)
    return rows


def _wait_ready(url: str, proc: subprocess.Popen) -> None:
    import urllib.request

    for _ in range(600):
        if proc.poll() is not None:
            sys.exit("bench_serve: llama-server exited (see /tmp/bench_serve_llama.log)")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    sys.exit("bench_serve: llama-server did not become ready")


def judge(args, questions: list[str], rows: list[dict]) -> dict:
    """The parent's own answer to each question (one token per call), then a verdict on every served answer."""
    from specquant_cli.decoding.engine import Engine
    from specquant_cli.decoding.stream import generate_text
    from specquant_cli.family.manifest import Family
    from specquant_cli.family.roles import PARENT_ROLE
    from specquant_cli.runtime import Runtime

    rt = Runtime.open(Family.load(args.family))
    try:
        ctx = rt.pool.context(PARENT_ROLE)
        noise = fidelity.measure_noise(ctx, 4, 8)
        prompts = [ctx.model.chat_prompt([{"role": "user", "content": q}]) for q in questions]
        reference = []
        for p in prompts:
            ctx.reset()
            reference.append(generate_text(Engine(ctx), p, args.max_tokens)[1])
        for row in rows:
            for i, a in enumerate(row["answers"]):
                a["fidelity"] = fidelity.classify_text(ctx, prompts[i], reference[i], a["text"], noise.bound)
            verdicts = [a["fidelity"]["verdict"] for a in row["answers"]]
            row["fidelity"] = {v: verdicts.count(v) for v in (fidelity.IDENTICAL, fidelity.NEAR_TIE,
                                                              fidelity.UNEXPLAINED)}
        return noise.to_dict()
    finally:
        rt.close()


def markdown(report: dict) -> str:
    base = {(r["policy"], r["clients"]): r["tokens_per_s"] for r in report["runs"] if r["parallel"] == 1}
    out = [f"`{report['command']}`", "", f"{report['machine']}; prompts: {report['prompts']}", "",
           "| --parallel | policy | clients | aggregate tok/s | vs --parallel 1 | per-request tok/s | TTFT p50 (ms) "
           "| TTFT p95 (ms) | identical / near-tie / unexplained |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        ref = base.get((r["policy"], r["clients"]))
        f = r.get("fidelity", {})
        out.append(f"| {r['parallel']} | {r['policy']} | {r['clients']} | {r['tokens_per_s']:.2f} | "
                   f"{r['tokens_per_s'] / ref:.2f}x | " if ref else f"| {r['parallel']} | {r['policy']} | "
                   f"{r['clients']} | {r['tokens_per_s']:.2f} | – | ")
        out[-1] += (f"{r['request_tokens_per_s']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} | "
                    f"{f.get('identical', '–')} / {f.get('near-tie', '–')} / {f.get('unexplained', '–')} |")
    n = report.get("noise")
    if n:
        out += ["", f"Batch-vs-single noise of the parent's top-2 margin: max {n['max_margin_diff']:.4g}, near-tie "
                    f"bound {n['bound']:.4g} (x{n['safety_factor']})."]
    return "\n".join(out) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for key in sorted({(r["parallel"], r["policy"]) for r in report["runs"]}):
        pts = [(r["clients"], r["tokens_per_s"]) for r in report["runs"] if (r["parallel"], r["policy"]) == key]
        ax.plot(*zip(*pts), marker="o", label=f"--parallel {key[0]}, {key[1]}")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(f"specquant serve, {Path(report['family']).name}, {report['max_tokens']} tokens")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def machine() -> str:
    import os
    import platform

    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else \
        platform.processor()
    return f"{model}, {os.cpu_count()} logical cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default=str(REPO / "models" / "qwen2.5-coder-1.5b"))
    ap.add_argument("--parallel", default="1,8", help="comma-separated --parallel values (one server each)")
    ap.add_argument("--policies", default="parent,auto")
    ap.add_argument("--clients", default="1,2,4,8", help="comma-separated client counts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dataset", default=str(SPEC_BENCH))
    ap.add_argument("--categories", default=CATEGORIES)
    ap.add_argument("--json-file", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--verbose", action="store_true", help="the servers' logs on stderr")
    ap.add_argument("--llama-server", help="a llama-server binary: the same clients against it too")
    ap.add_argument("--llama-modes", default="plain,ngram-mod", help=f"comma-separated: {', '.join(LLAMA_MODES)}")
    args = ap.parse_args()
    args.llama_modes = [m for m in args.llama_modes.split(",") if m]
    if any(m not in LLAMA_MODES for m in args.llama_modes):
        sys.exit(f"bench_serve: --llama-modes takes {', '.join(LLAMA_MODES)}")
    args.policies = [p for p in args.policies.split(",") if p]
    args.clients = [int(c) for c in args.clients.split(",")]
    items = load([Path(args.dataset)], args.categories.split(","), limit=1)
    questions = [it.prompt for it in items]
    if len(questions) < max(args.clients):
        sys.exit(f"bench_serve: {len(questions)} questions for up to {max(args.clients)} clients")
    rows = [r for p in args.parallel.split(",") for r in serve_runs(args, questions, int(p))]
    if args.llama_server:
        rows += [r for p in args.parallel.split(",") for r in llama_runs(args, questions, int(p))]
    noise = judge(args, questions, rows)
    report = {"command": "python " + " ".join(sys.argv), "machine": machine(),
              "family": args.family, "max_tokens": args.max_tokens,
              "prompts": ", ".join(f"{it.category} {it.id}" for it in items[:max(args.clients)]),
              "noise": noise, "runs": rows}
    md = markdown(report)
    sys.stdout.write(md)
    if args.json_file:
        args.json_file.write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(md)
    if args.plot:
        plot(report, args.plot)
    bad = sum(r["fidelity"]["unexplained"] for r in rows)
    if bad:
        print(f"bench_serve: {bad} unexplained divergence(s) from the parent's answers", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
