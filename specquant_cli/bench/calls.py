"""Each role's call-cost curve (`specquant bench calls`): the seconds of one llama.cpp call on 1, 2, 4, … 64 tokens
after a prompt of `position` tokens, at each depth asked (every row's logits, as a verification asks), and the prefill
per prompt token — the figures speculation is priced from (system.calibration measures the same once per machine, for
`auto`, near the start of a context and after 1,024 positions: a call deep in a long context costs more).

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

SIZES = (1, 2, 4, 8, 16, 32, 64)
POSITIONS = (64, 1024)
PREFILL_TOKENS = 64
CHILD_TIMEOUT_S = 1800.0


def measure_model(path: str, sizes: Sequence[int], reps: int, positions: int | Sequence[int], threads: int,
                  n_gpu_layers: int = 0) -> dict:
    """In this process: {"call_s": {n: median seconds} at the first depth, "depth_call_s": {position: {n: median
    seconds}} at each, "prefill_token_s": s} of the model at `path`, with `n_gpu_layers` of its layers on the GPU
    (-1: all; a CPU build keeps them all here). A depth is the positions of context before the calls."""
    from specquant_cli.backend.llama import Context, Model

    depths = [positions] if isinstance(positions, int) else list(positions)
    with Model(path, n_gpu_layers=n_gpu_layers) as m:
        ctx = Context(m, n_ctx=max(512, max(depths) + max(sizes) + 8), n_batch=max(64, max(sizes)),
                      n_threads=threads)
        try:
            vocab = max(2, m.n_vocab - 1)
            prompt = [100 + (i * 7919) % (vocab - 100) for i in range(max(*depths, PREFILL_TOKENS))]
            times = []
            for _ in range(max(1, reps // 2)):
                ctx.reset()
                t0 = time.perf_counter()
                ctx.decode(prompt[:PREFILL_TOKENS], logits="last")
                times.append((time.perf_counter() - t0) / PREFILL_TOKENS)
            prefill = statistics.median(times)
            ctx.reset()
            at = {}
            for position in depths:
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
                at[position] = calls
        finally:
            ctx.close()
    return {"call_s": at[depths[0]], "depth_call_s": at, "prefill_token_s": prefill}


def measure(path: str, sizes: Sequence[int], reps: int, positions: int | Sequence[int], threads: int,
            n_gpu_layers: int = 0, timeout: float = CHILD_TIMEOUT_S) -> dict:
    """measure_model in a child process: its figures, or {"error": why} when the child failed, died or took longer
    than `timeout` seconds."""
    depths = [positions] if isinstance(positions, int) else list(positions)
    cmd = [sys.executable, "-m", "specquant_cli.bench.calls", path, ",".join(map(str, sizes)), str(reps),
           ",".join(map(str, depths)), str(threads), str(n_gpu_layers)]
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
                "depth_call_s": {int(p): {int(k): float(v) for k, v in c.items()}
                                 for p, c in d["depth_call_s"].items()},
                "prefill_token_s": float(d["prefill_token_s"])}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {"error": "the child's answer was no report"}


def run(family, roles: Sequence[str], sizes: Sequence[int] = SIZES, reps: int = 7,
        positions: Sequence[int] = POSITIONS, threads: int = 2,
        progress: Optional[Callable[[str], None]] = None) -> dict[str, dict]:
    """Role -> its figures (measure), one role at a time, in the order given."""
    out = {}
    for role in roles:
        if progress:
            progress(role)
        out[role] = {"type": family.variant(role)["type"], **measure(str(family.path(role)), sizes, reps, positions,
                                                                     threads)}
    return out


def report(family, curves: dict[str, dict], sizes: Sequence[int], reps: int, positions: Sequence[int], threads: int,
           stamp: dict, machine: dict) -> dict:
    def ms(c: dict) -> dict:
        return {str(n): round(s, 6) for n, s in c.items()}

    return {"command": stamp["command"], "stamp": stamp, "machine": machine,
            "family": {"name": family.name, "root": str(family.root), "parent": family.parent_rendering},
            "config": {"sizes": list(sizes), "reps": reps, "position": positions[0], "positions": list(positions),
                       "threads": threads},
            "roles": {r: {**c, "call_s": ms(c.get("call_s", {})),
                          **({"depth_call_s": {str(p): ms(d) for p, d in c["depth_call_s"].items()}}
                             if "depth_call_s" in c else {})}
                      for r, c in curves.items()}}


def markdown(rep: dict) -> str:
    """A row per role and depth: ms per call at each size, the call on the most tokens as single steps, the calls
    against the same calls at the first depth, prefill per token."""
    c = rep["config"]
    sizes = c["sizes"]
    depths = c.get("positions", [c["position"]])
    lines = [f"# Call costs: {rep['family']['name']} (parent {rep['family']['parent']})", "",
             f"- command: `{rep['command']}`", *markdown_lines(rep.get("stamp")),
             f"- ms per call (median of {c['reps']}), every row's logits, after the positions of context shown; "
             f"{c['threads']} threads; × first depth: each call against the same call after {depths[0]} positions "
             "(lowest–highest)", "",
             "| role | type | positions | " + " | ".join(f"{n} tok" for n in sizes) + f" | {sizes[-1]} tok / 1 tok | "
             "× first depth | prefill ms/token |", "|---|---|---|" + "---|" * (len(sizes) + 3)]
    for role, r in rep["roles"].items():
        if "error" in r:
            lines.append(f"| {role} | {r['type']} | – | " + " | ".join("–" for _ in sizes)
                         + f" | {r['error']} | – | – |")
            continue
        curves = r.get("depth_call_s") or {str(depths[0]): r["call_s"]}
        first = curves[str(depths[0])]
        for p in depths:
            ms = [1000 * curves[str(p)][str(n)] for n in sizes]
            ratios = [curves[str(p)][str(n)] / first[str(n)] for n in sizes]
            lines.append(f"| {role} | {r['type']} | {p} | " + " | ".join(f"{x:.1f}" for x in ms)
                         + f" | {ms[-1] / ms[0]:.2f} | {min(ratios):.2f}–{max(ratios):.2f} | "
                         f"{1000 * r['prefill_token_s']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rep: dict, path) -> None:
    """ms per call against tokens per call, a line per role."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specquant_cli.bench.report import save_figure

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for role, r in rep["roles"].items():
        for p, curve in (r.get("depth_call_s") or {str(rep["config"]["position"]): r.get("call_s")}).items():
            if curve:
                xs = sorted(int(n) for n in curve)
                ax.plot(xs, [1000 * curve[str(n)] for n in xs], marker="o",
                        label=f"{role} ({r['type']}) after {p} positions")
    ax.set_xlabel("tokens in one call")
    ax.set_ylabel("ms per call")
    ax.set_xscale("log", base=2)
    ax.set_title(f"{rep['family']['name']}: call cost by tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


def _child(argv: list[str]) -> None:
    path, sizes, reps, positions, threads, n_gpu_layers = argv
    d = measure_model(path, [int(x) for x in sizes.split(",")], int(reps), [int(x) for x in positions.split(",")],
                      int(threads), int(n_gpu_layers))
    print(json.dumps({"call_s": {str(k): v for k, v in d["call_s"].items()},
                      "depth_call_s": {str(p): {str(k): v for k, v in c.items()} for p, c in d["depth_call_s"].items()},
                      "prefill_token_s": d["prefill_token_s"]}))


if __name__ == "__main__":
    _child(sys.argv[1:])
