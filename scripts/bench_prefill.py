"""Prefill once, measured: `specquant loadtest` over conversations that share one long system prompt, against
`specquant serve` and (with --llama-server PATH) llama-server, each started fresh for every scenario so that no
run finds another's prompts cached.

    python scripts/bench_prefill.py --family models/qwen2.5-coder-1.5b --parallel 2 \\
        --llama-server /path/to/llama-server --out docs/bench/prefill-amd

Scenarios (each `conversations x turns`, all conversations in flight at once, greedy, --max-tokens answers):
`2x4` (two long prompts arriving together, then their later turns) and `4x3` (more conversations than slots).
Each run's JSON (loadtest's) is written to OUT-<server>-<scenario>.json and a table to OUT.md; the answers of
every specquant run with its prompt cache on are judged against the parent alone (loadtest --family) after the
run. llama-server runs with its defaults (prompt cache on, --cache-ram 8192 MiB), -np PARALLEL, -c PARALLEL x --ctx,
the same threads."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import bench_serve  # noqa: E402 - the same server start-up and readiness wait

SCENARIOS = {"2x4": (2, 4), "4x3": (4, 3)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_specquant(args, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "specquant_cli", "serve", "--port", "0", "--family", args.family, "--parallel",
           str(args.parallel), "--ctx", str(args.ctx), "--threads", str(args.threads), "--policy", args.policy,
           "--policies", args.policy, *extra]
    return bench_serve.launch(cmd)


def start_llama(args) -> tuple[subprocess.Popen, str]:
    from specquant_cli.family.manifest import Family

    port = free_port()
    cmd = [args.llama_server, "-m", str(Family.load(args.family).path("f16")), "--port", str(port), "-t",
           str(args.threads), "-tb", str(args.threads), "-np", str(args.parallel), "-c",
           str(args.ctx * args.parallel), "--jinja"]
    with open("/tmp/bench_serve_llama.log", "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    bench_serve._wait_ready(url, proc)
    return proc, url


def warm(url: str) -> None:
    """One short unrelated request: both servers' first-request costs, not the scenario's prompts."""
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def loadtest(args, url: str, scenario: str, out: Path, judged: bool) -> dict:
    conversations, turns = SCENARIOS[scenario]
    cmd = [sys.executable, "-m", "specquant_cli", "loadtest", "--url", url, "--scenario", "shared-system",
           "--conversations", str(conversations), "--turns", str(turns), "--concurrency", str(conversations),
           "--max-tokens", str(args.max_tokens), "--system-tokens", str(args.system_tokens), "--out", str(out),
           *(["--family", args.family, "--ctx", str(args.ctx)] if judged else [])]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", required=True)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--system-tokens", type=int, default=800)
    ap.add_argument("--scenarios", default="2x4,4x3")
    ap.add_argument("--servers", default="specquant,specquant-no-cache,llama-server")
    ap.add_argument("--llama-server")
    ap.add_argument("--out", required=True, help="path prefix of the JSON files and the .md table")
    args = ap.parse_args()
    rows = []
    for scenario in args.scenarios.split(","):
        for server in args.servers.split(","):
            if server == "llama-server" and not args.llama_server:
                continue
            proc, url = start_llama(args) if server == "llama-server" else \
                start_specquant(args, ["--no-prompt-cache"] if server == "specquant-no-cache" else [])
            try:
                warm(url)
                out = Path(f"{args.out}-{server}-{scenario}.json")
                report = loadtest(args, url, scenario, out, judged=server == "specquant")
            finally:
                proc.terminate()
                proc.wait(60)
            rows.append((server, scenario, report["summary"]))
            print(f"{server} {scenario}: {json.dumps(headline(report['summary']))}", file=sys.stderr)
    Path(f"{args.out}.md").write_text(table(rows, args))


def headline(s: dict) -> dict:
    return {k: s.get(k) for k in ("wall_s", "ttft_first_turn_s", "ttft_later_turns_s", "output_tokens_per_s")} | \
        {"p50": {k: (s.get(k) or {}).get("p50") for k in ("ttft_first_turn_s", "ttft_later_turns_s")}}


def table(rows, args) -> str:
    lines = [f"`--parallel {args.parallel}`, shared system prompt of ~{args.system_tokens} tokens, "
             f"{args.max_tokens}-token greedy answers, all conversations in flight at once.", "",
             "| server | scenario | wall s | first-turn TTFT p50 s | later-turn TTFT p50 s | output tok/s |",
             "|---|---|---|---|---|---|"]
    for server, scenario, s in rows:
        first, later = s.get("ttft_first_turn_s") or {}, s.get("ttft_later_turns_s") or {}
        lines.append(f"| {server} | {scenario} | {s.get('wall_s')} | {first.get('p50')} | {later.get('p50')} | "
                     f"{s.get('output_tokens_per_s')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
