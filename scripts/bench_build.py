"""Per-call decode cost of the installed llama.cpp build: F16 parent calls of 1, 4, 8 and 16 tokens and a
one-token step of the q4 draft (ms, median of --reps). Run it under two builds (PYTHONPATH pointing at
another llama-cpp-python) to compare them; what a build cannot run is reported, not crashed on: each
measurement runs in a child process.

    .venv/bin/python scripts/bench_build.py --family models/qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(path: str, sizes: list[int], reps: int) -> dict:
    from specquant_cli.backend.llama import Context, Model

    out = {}
    with Model(path) as m:
        ctx = Context(m, n_ctx=512, n_batch=64)
        prompt = list(range(100, 164))
        ctx.decode(prompt, logits="last")
        for n in sizes:
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                ctx.decode(list(range(200, 200 + n)), logits="all")
                times.append(time.perf_counter() - t)
                ctx.rewind(len(prompt))
            out[n] = round(statistics.median(times) * 1000, 1)
        ctx.close()
    return out


def measure(path: str, sizes: list[int], reps: int) -> dict | str:
    env = {**os.environ, "SPECQUANT_SELFTEST_CHILD": "1"}  # measure the build as it is, faults included
    p = subprocess.run([sys.executable, __file__, "--child", path, ",".join(map(str, sizes)), str(reps)],
                       capture_output=True, text=True, env=env)
    if p.returncode < 0:
        return f"died of signal {-p.returncode}"
    if p.returncode:
        return p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}"
    return json.loads(p.stdout)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="models/qwen2.5-coder-1.5b")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    from specquant_cli.family.manifest import Family
    from specquant_cli.system.hardware import build_features

    fam = Family.load(args.family)
    b = build_features()
    print(f"build: {' '.join(b['cpu_features'])} (AMX {'in' if b['amx'] else 'out'})", file=sys.stderr)
    f16 = measure(str(fam.path("f16")), [1, 4, 8, 16], args.reps)
    q4 = measure(str(fam.path("q4")), [1], args.reps)
    print(json.dumps({"amx": b["amx"], "f16_call_ms": f16, "q4_step_ms": q4}))


if __name__ == "__main__":
    main()
