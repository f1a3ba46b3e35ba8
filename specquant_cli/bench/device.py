"""The GPU device check's steps: `python -m specquant_cli.bench.device run …` (scripts/device_check.sh runs it, on
the device after building llama.cpp for CUDA, here with CUDA off), and the model it carries (`… cut FAMILY OUT`,
from scripts/device_prepare.sh). docs/gpu.md tells the reader what it does and how to run it.

A device call carries at most 64 MiB, so no model of the demo family travels. Two kinds of model serve instead
(bench.device_models):
- the demo parent's shape with random weights, written there: a call's cost is a matter of shape, not of weights;
  and its greedy answers on random weights still set the batched verification kernels against the one-token ones
  at the real sizes (a 151936-token head, 12 query heads over 2 KV heads);
- smollm2-135m cut to fit (4 of its 30 blocks, Q4_0, 24.5 MiB carried, its F16 parent rendered there): real
  embeddings, vocabulary and chat template, so the prompts are text and the logits have a real model's margins.
  Its answers are poor text (a network missing 26 of its 30 blocks), but losslessness is a property of an answer
  against its parent, not of the answer's quality.

Steps, each timed and recorded (a step that fails is reported and the next still run; one that would not finish in
the time left is skipped, not started), the cheap and decisive first: the build's self-test (with a GPU: every
weight type decoded on the GPU too), greedy identity against the parent on the cut model (drafts on the GPU and on
the CPU, near-ties judged by bench.fidelity against this machine's measured batch-vs-single noise), the demo-shaped
family, doctor (NVML facts, the placement plan), call costs (each model on 1..16 tokens: with CUDA the parent and
drafts on the GPU, the drafts on the CPU beside it, the paper's hybrid placement, and the parent on the CPU), and
greedy identity on the demo-shaped model. What runs models on the GPU runs in child processes, so a fault in a
kernel fails its step, not the check. The report (OUT/device-check.json and .md)
is rewritten after every step, so a call killed at its limit keeps what was done."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from specquant_cli.backend.tiny import Shape
from specquant_cli.bench.device_models import (
    CUT_FILE,
    CUT_SOURCE,
    DEMO_SHAPE,
    QUICK_SHAPE,
    cut,
    make_cut_family,
    make_demo_family,
)
from specquant_cli.bench.device_report import markdown, summary_lines

SCHEMA = 1
REPORT, SUMMARY, LOG, LLAMA_LOG = "device-check.json", "device-check.md", "check.log", "llama.log"
DRAFTERS = (("q8", 8), ("q4", 4), ("ngram", 3))  # (drafter, γ): long accepted runs, rejections, many rejections
PROMPTS = (
    "What is the capital of France?",
    "def fibonacci(n):\n    # complete this Python function",
    "Explain photosynthesis in two sentences.",
    "Write a SQL query that counts users by country.",
    "Name the planets of the solar system in order.",
    "Why is the sky blue?",
    "Repeat after me: the quick brown fox jumps over the lazy dog. the quick brown fox",
    "Convert 100 degrees Fahrenheit to Celsius.",
)
GPU_ALL, CPU_ONLY = -1, 0


@dataclass(frozen=True)
class Plan:
    """How much the check measures: the device's run, or --quick (the test suite's, on 2 cores)."""

    shape: Shape = DEMO_SHAPE
    sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    reps: int = 5
    position: int = 64
    prompts: int = 6
    max_tokens: int = 32
    n_ctx: int = 512


QUICK = Plan(shape=QUICK_SHAPE, reps=3, prompts=2, max_tokens=12)


# -- the report ------------------------------------------------------------------------------------------------
class Check:
    """The steps' records and the report files, rewritten after every step."""

    def __init__(self, out: Path, work: Path, mode: str, plan: Plan, quick: bool, budget_s: float, env: dict):
        self.out, self.work, self.mode, self.plan = out, work, mode, plan
        self.deadline = time.monotonic() + budget_s
        self.rec: dict = {"schema": SCHEMA, "mode": mode, "quick": quick, "started_at": _now(),
                          "budget_s": budget_s, "machine": _machine(), "env": env, "plan": _plan_dict(plan),
                          "steps": {}, "verdict": "incomplete"}
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self._log = open(self.out / LOG, "w", encoding="utf-8")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, line: str) -> None:
        print(f"device_check: {line}", file=sys.stderr, flush=True)
        self._log.write(f"{_now()} {line}\n")
        self._log.flush()

    def step(self, name: str, need_s: float, fn: Callable[[], dict], why_not: Optional[str] = None) -> Optional[dict]:
        """Run `fn` as step `name` when `need_s` seconds are left (and nothing says `why_not`); record its result
        (a dict; `passed` False marks a check that ran and failed), or its error, and rewrite the report."""
        if why_not is None and self.left() < need_s:
            why_not = f"{self.left():.0f} s left, the step needs ~{need_s:.0f}"
        if why_not:
            self.rec["steps"][name] = {"status": "skipped", "why": why_not}
            self.say(f"{name}: skipped ({why_not})")
            self.write()
            return None
        self.say(f"{name} …")
        t0 = time.monotonic()
        try:
            result = fn()
            self.rec["steps"][name] = {"status": "ok", "seconds": round(time.monotonic() - t0, 1), **result}
            ok = result.get("passed", True)
            self.say(f"{name}: {'done' if ok else 'FAILED'} in {time.monotonic() - t0:.1f} s"
                     + (f" ({result['summary']})" if result.get("summary") else ""))
        except Exception as e:  # a step's failure is a finding to report; the next steps still run
            self._log.write(traceback.format_exc())
            self.rec["steps"][name] = {"status": "failed", "seconds": round(time.monotonic() - t0, 1),
                                       "error": f"{type(e).__name__}: {e}".splitlines()[0][:500]}
            self.say(f"{name}: failed: {self.rec['steps'][name]['error']}")
            result = None
        self.write()
        return result

    def finish(self) -> int:
        steps = self.rec["steps"].values()
        bad = [s for s in steps if s["status"] == "failed" or s.get("passed") is False]
        if str(((self.rec["env"] or {}).get("build") or {}).get("state", "")).startswith("failed"):
            bad.append({"build": "failed"})
        self.rec["verdict"] = "fail" if bad else "incomplete" if any(s["status"] == "skipped" for s in steps) \
            else "pass"
        self.rec["finished_at"] = _now()
        self.write()
        self._log.close()
        print(summary_lines(self.rec))
        return 0 if self.rec["verdict"] == "pass" else 1

    def write(self) -> None:
        from specquant_cli.fsutil import write_json_atomic

        write_json_atomic(self.out / REPORT, self.rec)
        tmp = self.out / (SUMMARY + ".tmp")
        tmp.write_text(markdown(self.rec), encoding="utf-8")
        os.replace(tmp, self.out / SUMMARY)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _plan_dict(plan: Plan) -> dict:
    d = asdict(plan)
    d["shape"] = {**asdict(plan.shape), "n_params": plan.shape.n_params}
    return d


def _machine() -> dict:
    from specquant_cli.system.hardware import cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "host": platform.node(), "python": platform.python_version()}


# -- the steps ------------------------------------------------------------------------------------------------
def _specquant(args: list[str], timeout: float) -> tuple[int, Optional[dict], str]:
    """`specquant ARGS` (the command line as users run it) in a child: (exit code, its JSON, last stderr line)."""
    p = subprocess.run([sys.executable, "-m", "specquant_cli.cli", *args], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=max(5.0, timeout))
    try:
        data = json.loads(p.stdout)
    except ValueError:
        data = None
    last = next((ln.strip() for ln in reversed(p.stderr.splitlines()) if ln.strip()), "")
    return p.returncode, data if isinstance(data, dict) else None, last


def selftest_step(timeout: float) -> dict:
    """`specquant doctor --selftest --json`; where the command line cannot start (a package it needs is missing
    here), the same self-test in this process."""
    import llama_cpp

    rc, rep, last = _specquant(["doctor", "--selftest", "--json"], timeout)
    st = ((rep or {}).get("hardware") or {}).get("build", {}).get("selftest")
    via = "specquant doctor --selftest"
    if st is None:
        from specquant_cli.backend import selftest

        st, via = selftest.run().to_dict(), f"in process (the command line could not run: {last or f'exit {rc}'})"
    gpu = st.get("gpu")
    return {"passed": bool(st.get("ok")), "via": via, "selftest": st, "llama_cpp": str(Path(llama_cpp.__file__).parent),
            "build": ((rep or {}).get("hardware") or {}).get("build"),
            "summary": f"{'passed' if st.get('ok') else 'failed'}: "
            + ", ".join(f"{t} {o}" for t, o in st.get("types", {}).items()) + (f"; GPU {gpu}" if gpu else "; CPU only")}


def doctor_step(family: Path, timeout: float) -> dict:
    """`specquant doctor --json --family FAMILY` (NVML facts, the placement plan); in process where the command line
    cannot start."""
    from specquant_cli.settings import settings_table

    rc, rep, last = _specquant(["doctor", "--json", settings_table()["runtime.family"].flag, str(family)], timeout)
    via = "specquant doctor"
    if rep is None:
        from specquant_cli.family.manifest import Family
        from specquant_cli.system import hardware
        from specquant_cli.system.placement import family_placements

        facts = hardware.detect()
        rep = {"hardware": facts.to_dict(), "advice": hardware.advice(facts),
               "placements": family_placements(facts, Family.load(family), 4096)}
        via = f"in process (the command line could not run: {last or f'exit {rc}'})"
    hw = rep.get("hardware", {})
    gpus = ", ".join(f"{g['name']} ({g['free_bytes'] / 2**30:.0f} of {g['total_bytes'] / 2**30:.0f} GiB free)"
                     for g in hw.get("gpus", [])) or f"none ({hw.get('gpu_status')})"
    pl = rep.get("placements", {})
    return {"via": via, "exit_code": rc, "doctor": {k: rep.get(k) for k in ("hardware", "advice", "placements",
                                                                              "parent", "plans")},
            "summary": f"GPUs: {gpus}; offload {'yes' if hw.get('gpu_offload') else 'no'}; "
                       + ", ".join(f"{k} {v['mode']}" for k, v in pl.items())}


def calls_rows(mode: str) -> list[tuple[str, str, int]]:
    """(row name, role, n_gpu_layers): with CUDA the parent and drafts on the GPU, the drafts on the CPU (hybrid),
    and the parent on the CPU; without, all on the CPU."""
    from specquant_cli.family.roles import PARENT_ROLE

    if mode != "cuda":
        return [(f"{r}@cpu", r, CPU_ONLY) for r in (PARENT_ROLE, "q8", "q4")]
    return [(f"{PARENT_ROLE}@gpu", PARENT_ROLE, GPU_ALL), ("q8@gpu", "q8", GPU_ALL), ("q4@gpu", "q4", GPU_ALL),
            ("q8@cpu", "q8", CPU_ONLY), ("q4@cpu", "q4", CPU_ONLY), (f"{PARENT_ROLE}@cpu", PARENT_ROLE, CPU_ONLY)]


def calls_step(family: Path, mode: str, plan: Plan, threads: int, left: Callable[[], float]) -> dict:
    """Each row's call-cost curve (bench.calls, a child per row), and each draft's cost per step beside the
    parent's: c = draft's 1-token call / parent's 1-token call, what speculation is priced from."""
    from specquant_cli.bench import calls
    from specquant_cli.family.manifest import Family
    from specquant_cli.family.roles import PARENT_ROLE

    fam = Family.load(family)
    rows: dict[str, dict] = {}
    for name, role, layers in calls_rows(mode):
        if left() < 20:
            rows[name] = {"role": role, "error": "skipped: out of time"}
            continue
        r = calls.measure(str(fam.path(role)), plan.sizes, plan.reps, plan.position, threads, layers,
                          timeout=max(10.0, left() - 10))
        rows[name] = {"role": role, "type": fam.variant(role)["type"], "n_gpu_layers": layers,
                      **({k: v for k, v in r.items() if k != "call_s"}),
                      **({"call_s": {str(n): round(s, 6) for n, s in r["call_s"].items()}} if "call_s" in r else {})}
    parent = rows.get(f"{PARENT_ROLE}@{'gpu' if mode == 'cuda' else 'cpu'}", {}).get("call_s")
    ratios = {}
    for name, r in rows.items():
        if r["role"] != PARENT_ROLE and parent and "call_s" in r:
            ratios[name] = round(r["call_s"]["1"] / parent["1"], 3)
    failed = [n for n, r in rows.items() if "error" in r]
    head = " · ".join(f"{n} {1000 * r['call_s']['1']:.1f}/{1000 * r['call_s'][str(plan.sizes[-1])]:.1f} ms"
                      for n, r in rows.items() if "call_s" in r)
    return {"passed": not failed, "rows": rows, "c": ratios, "threads": threads,
            "summary": f"1/{plan.sizes[-1]} tokens: {head}" + (f"; failed: {', '.join(failed)}" if failed else "")}


def _text_prompts(model, n: int) -> list[list[int]]:
    return [model.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS[:n]]


def _id_prompts(n_vocab: int, n: int, length: int = 24) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(3, n_vocab, length)] for _ in range(n)]


def identity_step(family: Path, mode: str, plan: Plan, threads: int, text: bool, left: Callable[[], float],
                  llama_log: Optional[Path] = None) -> dict:
    """Greedy answers of each drafter beside the parent (on the GPU with CUDA), drafts on the GPU and on the CPU,
    against the parent's own answers (one token per call); a divergence is judged by bench.fidelity: a near-tie
    inside this machine's batch-vs-single noise, or unexplained. Passed: nothing unexplained."""
    from specquant_cli.backend.llama import Context, Model, llama_log_to
    from specquant_cli.bench import fidelity
    from specquant_cli.family.manifest import Family
    from specquant_cli.family.roles import PARENT_ROLE

    fam = Family.load(family)
    placements = {"gpu": GPU_ALL, "cpu": CPU_ONLY} if mode == "cuda" else {"cpu": CPU_ONLY}
    parent_layers = GPU_ALL if mode == "cuda" else CPU_ONLY
    runs, cut_short = [], False
    with llama_log_to(llama_log):
        parent = Model(fam.path(PARENT_ROLE), n_gpu_layers=parent_layers)
        try:
            pctx = Context(parent, n_ctx=plan.n_ctx, n_threads=threads)
            prompts = _text_prompts(parent, plan.prompts) if text else _id_prompts(parent.n_vocab, plan.prompts)
            probes = None if text else _id_prompts(parent.n_vocab, 3, fidelity.NOISE_TOKENS)
            noise = fidelity.measure_noise(pctx, 4, max(g for _, g in DRAFTERS), sequences=probes)
            refs = []
            for p in prompts:  # what time allows, the rest left out (and said)
                if left() < 15:
                    cut_short = True
                    break
                refs.append(fidelity.parent_answer(pctx, p, plan.max_tokens))
            prompts = prompts[:len(refs)]
            for where, layers in placements.items():
                drafts = {}
                try:
                    for name, gamma in DRAFTERS:
                        if name == "ngram" and where != next(iter(placements)):
                            continue  # the n-gram drafter runs on no device: once is enough
                        if left() < 15:
                            cut_short = True
                            break
                        if name != "ngram" and name not in drafts:
                            drafts[name] = Model(fam.path(name), n_gpu_layers=layers)
                        dctx = Context(drafts[name], n_ctx=plan.n_ctx, n_threads=threads) if name != "ngram" else None
                        runs.append(_identity_run(pctx, dctx, name, gamma, where, prompts, refs, plan, noise, left))
                        cut_short = cut_short or runs[-1]["cut_short"]
                        if dctx is not None:
                            dctx.close()
                finally:
                    for m in drafts.values():
                        m.close()
            pctx.close()
        finally:
            parent.close()
    unexplained = sum(r["unexplained"] for r in runs)
    near = sum(r["near_tie"] for r in runs)
    answers = sum(r["answers"] for r in runs)
    return {"passed": unexplained == 0 and answers > 0, "runs": runs, "noise": noise.to_dict(), "cut_short": cut_short,
            "parent_placement": "gpu" if parent_layers == GPU_ALL else "cpu", "prompts": len(prompts),
            "summary": f"{answers - near - unexplained} of {answers} answers identical, {near} near-tie, "
                       f"{unexplained} unexplained (noise bound {noise.bound:.3g})" + ("; cut short" if cut_short
                                                                                      else "")}


def identity_in_child(family: Path, mode: str, quick: bool, threads: int, text: bool, left: Callable[[], float],
                      llama_log: Optional[Path]) -> dict:
    """identity_step in a child process: a GPU fault that kills it (an abort in a CUDA kernel) fails this step, not
    the steps after it."""
    import signal

    budget = max(10.0, left())
    cmd = [sys.executable, "-m", "specquant_cli.bench.device", "identity", str(family), "--mode", mode, "--n-threads",
           str(threads), "--budget", f"{budget:.0f}", *(["--quick"] if quick else []), *(["--text"] if text else []),
           *(["--llama-log", str(llama_log)] if llama_log else [])]
    p = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=budget + 30)
    if p.returncode:
        last = next((ln.strip() for ln in reversed(p.stderr.splitlines()) if ln.strip()), "")
        died = f"died of {signal.Signals(-p.returncode).name}" if p.returncode < 0 and -p.returncode in \
            signal.valid_signals() else f"exit code {p.returncode}"
        raise RuntimeError(f"the identity check's child {died}" + (f": {last}" if last else ""))
    return json.loads(p.stdout)


def _identity_run(pctx, dctx, name: str, gamma: int, where: str, prompts: list[list[int]], refs: list[list[int]],
                  plan: Plan, noise, left: Callable[[], float]) -> dict:
    """One drafter at one γ over every prompt (while time is left), each from empty caches (as a fresh process
    starts)."""
    from specquant_cli.bench import fidelity
    from specquant_cli.decoding.drafters import ModelDrafter, NGramDrafter
    from specquant_cli.decoding.engine import Engine
    from specquant_cli.decoding.gamma import FixedGamma
    from specquant_cli.decoding.stream import generate_text

    drafter = NGramDrafter() if dctx is None else ModelDrafter(dctx, name)
    eng = Engine(pctx, drafter, FixedGamma(gamma))
    verdicts, divergences, drafted, accepted = [], [], 0, 0
    t0 = time.monotonic()
    for p, ref in zip(prompts, refs):
        if left() < 5:
            break
        pctx.reset()
        if dctx is not None:
            dctx.reset()
        got = generate_text(eng, p, plan.max_tokens)[1]
        drafted, accepted = drafted + eng.stats.drafted, accepted + eng.stats.accepted
        v = {"verdict": fidelity.IDENTICAL} if got == ref else fidelity.classify(pctx, p, ref, got, noise.bound)
        verdicts.append(v["verdict"])
        if v["verdict"] != fidelity.IDENTICAL:
            divergences.append(v)
    return {"drafter": name, "gamma": gamma, "drafts_on": "-" if dctx is None else where, "answers": len(verdicts),
            "cut_short": len(verdicts) < len(prompts),
            "identical": verdicts.count(fidelity.IDENTICAL), "near_tie": verdicts.count(fidelity.NEAR_TIE),
            "unexplained": verdicts.count(fidelity.UNEXPLAINED), "drafted": drafted,
            "acceptance": round(accepted / drafted, 3) if drafted else None, "seconds": round(time.monotonic() - t0, 2),
            "divergences": divergences}


# -- the entry ----------------------------------------------------------------------------------------------------
def run(out: Path, work: Path, mode: str, quick: bool, budget_s: float, env: dict, carried_cut: Optional[Path],
        cut_from: Optional[Path]) -> int:
    plan = QUICK if quick else Plan()
    check = Check(out, work, mode, plan, quick, budget_s, env)
    build = str((env.get("build") or {}).get("state", ""))
    why_not = f"llama-cpp-python did not build ({build})" if build.startswith("failed") else None
    threads = os.cpu_count() or 1
    # The order spends the time on what matters most first: the build's own test, then the cheap lossless check,
    # then what needs the 3.6 GB demo-shaped family.
    check.step("selftest", 30, lambda: selftest_step(min(240.0, check.left())), why_not)
    if carried_cut is None and cut_from is not None and why_not is None:  # here, without device_prepare's files
        made = check.step("cut", 10, lambda: {"path": str(cut(cut_from, work / "cut"))})
        carried_cut = Path(made["path"]) if made else None
    log = out / LLAMA_LOG
    no_cut = why_not or (None if carried_cut else "no cut model (scripts/device_prepare.sh carries it)")
    cut_fam = check.step("models-cut", 10, lambda: make_cut_family(work, carried_cut, threads), no_cut)
    check.step("identity-cut", 20, lambda: identity_in_child(Path(cut_fam["family"]), mode, quick, threads, True,
                                                             check.left, log),
               no_cut or (None if cut_fam else "no family"))
    demo_fam = check.step("models-demo", 40 if quick else 90, lambda: make_demo_family(work, plan.shape, threads),
                          why_not)
    no_demo = why_not or (None if demo_fam else "no demo-shaped family")
    demo = Path(demo_fam["family"]) if demo_fam else None
    check.step("doctor", 10, lambda: doctor_step(demo, min(120.0, check.left())), no_demo)
    check.step("calls", 30 if quick else 60, lambda: calls_step(demo, mode, plan, threads, check.left), no_demo)
    check.step("identity-demo", 20 if quick else 45,
               lambda: identity_in_child(demo, mode, quick, threads, False, check.left, log), no_demo)
    return check.finish()


def main(argv: Sequence[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m specquant_cli.bench.device")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cut", help=f"cut {CUT_SOURCE} to fit a device call (scripts/device_prepare.sh)")
    c.add_argument("family", type=Path)
    c.add_argument("out", type=Path)
    r = sub.add_parser("run", help="the check's steps (scripts/device_check.sh)")
    r.add_argument("--mode", choices=("cuda", "cpu"), required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--env", type=Path, help="the set-up's record (build, carried files)")
    r.add_argument("--budget", type=float, default=540.0, help="seconds for the steps")
    r.add_argument("--quick", action="store_true")
    r.add_argument("--cut", type=Path, default=Path("build/device/models") / CUT_FILE,
                   help="the carried cut model")
    r.add_argument("--cut-from", type=Path, default=Path("models") / CUT_SOURCE,
                   help="without a carried cut model (--mode cpu): cut it from this family first")
    i = sub.add_parser("identity", help="one identity step, in a child of `run` (its JSON on stdout)")
    i.add_argument("family", type=Path)
    i.add_argument("--mode", choices=("cuda", "cpu"), required=True)
    i.add_argument("--n-threads", dest="threads", type=int, required=True)
    i.add_argument("--budget", type=float, required=True)
    i.add_argument("--quick", action="store_true")
    i.add_argument("--text", action="store_true", help="chat prompts (a model with a real tokenizer)")
    i.add_argument("--llama-log", type=Path)
    a = ap.parse_args(argv)
    if a.cmd == "cut":
        print(cut(a.family, a.out))
        return 0
    if a.cmd == "identity":
        deadline = time.monotonic() + a.budget
        print(json.dumps(identity_step(a.family, a.mode, QUICK if a.quick else Plan(), a.threads, a.text,
                                       lambda: deadline - time.monotonic(), a.llama_log)))
        return 0
    env = {}
    if a.env is not None:
        try:
            env = json.loads(a.env.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            env = {"error": f"{a.env}: {e}"}
    carried = a.cut if a.cut.is_file() else None
    cut_from = a.cut_from if a.mode == "cpu" and (a.cut_from / "manifest.json").is_file() else None
    return run(a.out, a.work, a.mode, a.quick, a.budget, env, carried, cut_from)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
