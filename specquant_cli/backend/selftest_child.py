"""The build self-test's child (backend.selftest runs it): write a tiny llama model, quantize it to each
weight type asked for and decode a multi-token batch then single steps through each, checking the logits
are finite. A kernel that faults kills this process, not the user's.

Usage: python -m specquant_cli.backend.selftest_child DIR TYPE [TYPE ...]   (prints `ok TYPE` per type;
DIR is a work folder the parent owns and removes, so a killed child leaves nothing behind)"""

from __future__ import annotations

import math
import os
import signal
import sys
from pathlib import Path
from typing import Optional

import llama_cpp
import numpy as np

from specquant_cli.backend import selftest
from specquant_cli.backend.llama import Context, Model, llama_log_to
from specquant_cli.backend.tiny import write_tiny_llama
from specquant_cli.settings import env


def _check_type(t: str, base: Path, work: Path) -> Optional[str]:
    """Quantize the tiny model to t and decode a 16-token batch then 4 single steps. None when sound."""
    path = work / f"{t}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, selftest.FTYPES[t])
    params.nthread = 1
    if llama_cpp.llama_model_quantize(os.fsencode(base), os.fsencode(path), params) != 0:
        return f"could not quantize to {t}"
    fault = env(selftest.FAULT_ENV)
    if fault.partition(":")[0] == t:
        os.kill(os.getpid(), getattr(signal, fault.partition(":")[2] or "SIGILL"))
    with Model(path) as m:
        ctx = Context(m, n_ctx=128, n_batch=32, n_threads=min(4, os.cpu_count() or 1))
        ctx.decode(list(range(1, 17)), logits="all")
        rows = [ctx.logits(i).copy() for i in range(16)]  # views are valid only until the next decode
        for _ in range(4):
            ctx.decode([int(np.argmax(rows[-1]))], logits="last")
            rows.append(ctx.logits(-1).copy())
        ctx.close()
    worst = max(float(np.abs(r).max()) if np.isfinite(r).all() else math.inf for r in rows)
    if not math.isfinite(worst) or worst > 1e4:  # random weights at 0.05 give logits of a few units
        return f"bad logits (max |logit| {worst:.3g})"
    if min(float(np.ptp(r)) for r in rows) <= 0:
        return "bad logits (constant)"
    return None


def main(argv: list[str]) -> int:
    os.environ[selftest.CHILD_ENV] = "1"  # a model loaded here never starts a self-test of its own (even run by hand)
    if len(argv) < 2 or not Path(argv[0]).is_dir():
        print("usage: python -m specquant_cli.backend.selftest_child DIR TYPE [TYPE ...]", file=sys.stderr)
        return 2
    work, types = Path(argv[0]), argv[1:]
    unknown = [t for t in types if t not in selftest.FTYPES]
    if unknown:
        print(f"unknown type {unknown[0]} (expected one of {', '.join(selftest.TYPES)})", file=sys.stderr)
        return 2
    with llama_log_to(None):
        base = write_tiny_llama(work / "base-f16.gguf", dim=256, ff=512, vocab=512, scale=0.05, merges=("<t1> <t2>",))
        for t in types:
            why = _check_type(t, base, work)
            if why:
                print(why, file=sys.stderr)
                return 1
            print(f"ok {t}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
