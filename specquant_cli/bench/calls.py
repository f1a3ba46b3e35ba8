"""Each role's call-cost curve (`specquant bench calls`): the seconds of one llama.cpp call on 1, 2, 4, 8, 16 tokens
after a prompt of `position` tokens (every row's logits, as a verification asks), and the prefill per prompt token —
the figures speculation is priced from (system.calibration measures the same once per machine, for `auto`).

Each role is measured in a child process of its own (`python -m specquant_cli.bench.calls PATH …`), with the build's
self-test off: a build that cannot run a weight type (an AMX build that faults on Q4_0 batches) is reported for
that role, not crashed on, and the other roles are still measured. One child at a time: on 2 cores, two would
distort each other's figures."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Optional

from specquant_cli.bench.stamp import markdown_lines
from specquant_cli.settings import SELFTEST_CHILD_ENV, child_env

SIZES = (1, 2, 4, 8, 16)
PREFILL_TOKENS = 64
CHILD_TIMEOUT_S = 1800.0


def measure_model(path: str, sizes: Sequence[int], reps: int, position: int, threads: int,
                  n_gpu_layers: int = 0) -> dict:
    """In this process: {"call_s": {n: median seconds}, "prefill_token_s": s} of the model at `path`, with
    `n_gpu_layers` of its layers on the GPU (-1: all; a CPU build keeps them all here)."""
    from specquant_cli.backend.llama import Context, Model

    with Model(path, n_gpu_layers=n_gpu_layers) as m:
        ctx = Context(m, n_ctx=max(512, position + max(sizes) + 8), n_batch=max(64, max(sizes)), n_threads=threads)
        try:
            vocab = max(2, m.n_vocab - 1)
            prompt = [100 + (i * 7919) % (vocab - 100) for i in range(max(position, PREFILL_TOKENS))]
            times = []
            for _ in range(max(1, reps // 2)):
                ctx.reset()
                t0 = time.perf_counter()
                ctx.decode(prompt[:PREFILL_TOKENS], logits="last")
                times.append((time.perf_counter() - t0) / PREFILL_TOKENS)
            prefill = statistics.median(times)
            ctx.reset()
            ctx.sync(prompt[:position], logits="none")
            calls = {}
            for n in sizes:
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    ctx.decode([200 + k for k in range(n)], logits="all")
                    ts.append(time.perf_counter() - t0)
                    ctx.rewind(position)
                calls[n] = statistics.median(ts)
        finally:
            ctx.close()
    return {"call_s": calls, "prefill_token_s": prefill}


def measure(path: str, sizes: Sequence[int], reps: int, position: int, threads: int, n_gpu_layers: int = 0,
            timeout: float = CHILD_TIMEOUT_S) -> dict:
    """measure_model in a child process: its figures, or {"error": why} when the child failed, died or took longer
    than `timeout` seconds."""
    cmd = [sys.executable, "-m", "specquant_cli.bench.calls", path, ",".join(map(str, sizes)), str(reps),
           str(position), str(threads), str(n_gpu_layers)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                           env=child_env(**{SELFTEST_CHILD_ENV: "1"}), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout:.0f} s"}
    if p.returncode < 0:
        try:
            name = signal.Signals(-p.returncode).name
        except ValueError:
            name = f"signal {-p.returncode}"
        return {"error": f"died of {name}"}
    if p.returncode:
        last = next((ln.strip() for ln in reversed(p.stderr.splitlines()) if ln.strip()), "")
        return {"error": last or f"exit code {p.returncode}"}
    try:
        d = json.loads(p.stdout)
        return {"call_s": {int(k): float(v) for k, v in d["call_s"].items()},
                "prefill_token_s": float(d["prefill_token_s"])}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {"error": "the child's answer was no report"}


def run(family, roles: Sequence[str], sizes: Sequence[int] = SIZES, reps: int = 7, position: int = 64,
        threads: int = 2, progress: Optional[Callable[[str], None]] = None) -> dict[str, dict]:
    """Role -> its figures (measure), one role at a time, in the order given."""
    out = {}
    for role in roles:
        if progress:
            progress(role)
        out[role] = {"type": family.variant(role)["type"], **measure(str(family.path(role)), sizes, reps, position,
                                                                     threads)}
    return out


def report(family, curves: dict[str, dict], sizes: Sequence[int], reps: int, position: int, threads: int,
           stamp: dict, machine: dict) -> dict:
    return {"command": stamp["command"], "stamp": stamp, "machine": machine,
            "family": {"name": family.name, "root": str(family.root), "parent": family.parent_rendering},
            "config": {"sizes": list(sizes), "reps": reps, "position": position, "threads": threads},
            "roles": {r: {**c, "call_s": {str(n): round(s, 6) for n, s in c.get("call_s", {}).items()}}
                      for r, c in curves.items()}}


def markdown(rep: dict) -> str:
    """A row per role: ms per call at each size, the call on the most tokens as single steps, prefill per token."""
    c = rep["config"]
    sizes = c["sizes"]
    lines = [f"# Call costs: {rep['family']['name']} (parent {rep['family']['parent']})", "",
             f"- command: `{rep['command']}`", *markdown_lines(rep.get("stamp")),
             f"- ms per call (median of {c['reps']}), every row's logits, after {c['position']} positions; "
             f"{c['threads']} threads", "",
             "| role | type | " + " | ".join(f"{n} tok" for n in sizes) + f" | {sizes[-1]} tok / 1 tok | "
             "prefill ms/token |", "|---|---|" + "---|" * (len(sizes) + 2)]
    for role, r in rep["roles"].items():
        if "error" in r:
            lines.append(f"| {role} | {r['type']} | " + " | ".join("–" for _ in sizes) + f" | {r['error']} | – |")
            continue
        ms = [1000 * r["call_s"][str(n)] for n in sizes]
        lines.append(f"| {role} | {r['type']} | " + " | ".join(f"{x:.1f}" for x in ms)
                     + f" | {ms[-1] / ms[0]:.2f} | {1000 * r['prefill_token_s']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rep: dict, path) -> None:
    """ms per call against tokens per call, a line per role."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specquant_cli.bench.report import save_figure

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for role, r in rep["roles"].items():
        if "call_s" in r and r["call_s"]:
            xs = sorted(int(n) for n in r["call_s"])
            ax.plot(xs, [1000 * r["call_s"][str(n)] for n in xs], marker="o", label=f"{role} ({r['type']})")
    ax.set_xlabel("tokens in one call")
    ax.set_ylabel("ms per call")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{rep['family']['name']}: call cost by tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


def _child(argv: list[str]) -> None:
    path, sizes, reps, position, threads, n_gpu_layers = argv
    d = measure_model(path, [int(x) for x in sizes.split(",")], int(reps), int(position), int(threads),
                      int(n_gpu_layers))
    print(json.dumps({"call_s": {str(k): v for k, v in d["call_s"].items()}, "prefill_token_s": d["prefill_token_s"]}))


if __name__ == "__main__":
    _child(sys.argv[1:])
