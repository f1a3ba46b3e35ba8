"""The build self-test's child (backend.selftest runs it): write a tiny llama model, quantize it to each
weight type asked for and decode a multi-token batch then single steps through each, checking the logits
are finite. On a build with a GPU backend and a GPU present, each type is decoded again with every layer on
the GPU, and its logits must agree with the CPU's. A kernel that faults kills this process, not the user's.

Usage: python -m specquant_cli.backend.selftest_child DIR TYPE [TYPE ...]   (prints `gpu NAME` first when the
GPU is tested too, then `ok TYPE` per type; DIR is a work folder the parent owns and removes, so a killed child
leaves nothing behind)"""

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
from specquant_cli.backend.llama import GPU_DEVICE_TYPES, Context, Model, backend_devices, llama_log_to
from specquant_cli.backend.tiny import write_tiny_llama
from specquant_cli.settings import cores, env

GPU_AGREEMENT = 0.25  # the largest |GPU - CPU| logit difference allowed, as a share of the CPU logits' spread


def gpu_names() -> list[str]:
    """The GPUs this build registered (none on a CPU build, or on a GPU build where no GPU is present)."""
    return [name for name, kind in backend_devices() if kind in GPU_DEVICE_TYPES]


def _decode_rows(path: Path, n_gpu_layers: int, steps: Optional[list[int]] = None) -> list[np.ndarray]:
    """Logits of a 16-token batch then 4 single steps: each the batch's argmax (or `steps`, to follow another
    decode's tokens)."""
    with Model(path, n_gpu_layers=n_gpu_layers) as m:
        ctx = Context(m, n_ctx=128, n_batch=32, n_threads=min(4, cores()))
        ctx.decode(list(range(1, 17)), logits="all")
        rows = [ctx.logits(i).copy() for i in range(16)]  # views are valid only until the next decode
        for k in range(4):
            ctx.decode([steps[k] if steps else int(np.argmax(rows[-1]))], logits="last")
            rows.append(ctx.logits(-1).copy())
        ctx.close()
    return rows


def _bad(rows: list[np.ndarray]) -> Optional[str]:
    worst = max(float(np.abs(r).max()) if np.isfinite(r).all() else math.inf for r in rows)
    if not math.isfinite(worst) or worst > 1e4:  # random weights at 0.05 give logits of a few units
        return f"bad logits (max |logit| {worst:.3g})"
    if min(float(np.ptp(r)) for r in rows) <= 0:
        return "bad logits (constant)"
    return None


def _check_type(t: str, base: Path, work: Path, gpu: bool = False) -> Optional[str]:
    """Quantize the tiny model to t and decode a 16-token batch then 4 single steps on the CPU, and with `gpu` again
    with every layer offloaded, the same tokens, whose logits must agree with the CPU's. None when sound."""
    path = work / f"{t}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, selftest.FTYPES[t])
    params.nthread = 1
    if llama_cpp.llama_model_quantize(os.fsencode(base), os.fsencode(path), params) != 0:
        return f"could not quantize to {t}"
    fault = env(selftest.FAULT_ENV)
    if fault.partition(":")[0] == t:
        os.kill(os.getpid(), getattr(signal, fault.partition(":")[2] or "SIGILL"))
    rows = _decode_rows(path, 0)
    why = _bad(rows)
    if why or not gpu:
        return why
    on_gpu = _decode_rows(path, -1, [int(np.argmax(r)) for r in rows[15:19]])
    why = _bad(on_gpu)
    if why:
        return f"{why} on the GPU"
    diff = max(float(np.abs(g - c).max()) for g, c in zip(on_gpu, rows))
    spread = min(float(np.ptp(c)) for c in rows)
    if diff > GPU_AGREEMENT * spread:
        return f"bad logits on the GPU (|GPU - CPU| up to {diff:.3g}, the logits' spread {spread:.3g})"
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
        gpus = gpu_names()
        if gpus:
            print(f"gpu {','.join(gpus)}", flush=True)
        for t in types:
            why = _check_type(t, base, work, gpu=bool(gpus))
            if why:
                print(why, file=sys.stderr)
                return 1
            print(f"ok {t}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
