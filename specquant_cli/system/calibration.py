"""What this machine's calls cost for a family: the parent's call on 1..16 tokens, each draft role's
one-token step (every model draft the family has: q4, q8 and recipes such as q4i, q3g), prefill per token.
Measured once (a few seconds on the demo family), cached in the family
folder keyed by a hardware fingerprint and the llama-cpp-python version, read by the `auto` policy."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from specquant_cli.fsutil import write_json_atomic

CALIBRATION_FILE = "calibration.json"
SCHEMA = 4  # part of the cache key: an entry measured by an older version is measured again
MAX_BATCH = 16  # parent call sizes measured: 1..MAX_BATCH tokens
REPEATS = 5  # the fastest of this many timings per size: other work on the machine only adds time
PREFILL_TOKENS = 64
DRAFT_STEPS = 8
# Agreement: the parent answers these prompts greedily, then each draft reads prompt + answer in one pass;
# where the draft's argmax equals the parent's token is what a verification would accept. On the parent's
# own answers, not on external text: a draft agrees more with what the parent writes than with what people
# write (1.5B family: 85 % on a mixed text, 89 % on Spec-Bench answers). Four kinds of answer, 64 tokens
# each: on two prompts of 48 tokens the graded 3-bit draft q3g30 agreed 92 %, as often as q4 did, and auto
# picked it; on 426 tokens of Spec-Bench answers it agrees 87 % against q4's 95 %.
AGREEMENT_PROMPTS = (
    "Explain in a short paragraph why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "A shop sells pens at 3 dollars each and notebooks at 5 dollars each. Maria buys 4 pens and 2 notebooks "
    "and pays with a 50 dollar bill. How much change does she get? Think step by step.",
    "Translate into French: The library opens at nine in the morning and closes at six in the evening, "
    "except on Sundays, when it stays closed all day.",
)
AGREEMENT_TOKENS = 64  # parent tokens per prompt

def fingerprint(facts, threads: Optional[int] = None) -> dict:
    from importlib.metadata import version

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    from specquant_cli.backend.llama import default_threads

    return {"schema": SCHEMA, "cpu": model, "cores": facts.cores_logical, "threads": threads or default_threads(),
            "gpus": [g.name for g in facts.gpus], "gpu_offload": facts.gpu_offload,
            "llama_cpp_python": version("llama-cpp-python")}


def key_of(fp: dict) -> str:
    return json.dumps(fp, sort_keys=True)


def _schema_of(key: str):
    try:
        fp = json.loads(key)
        return fp.get("schema") if isinstance(fp, dict) else None
    except ValueError:
        return None


@dataclass
class Calibration:
    parent_call_s: dict[int, float]  # tokens in one parent call -> seconds
    draft_step_s: dict[str, float] = field(default_factory=dict)  # role -> seconds per one-token step
    prefill_token_s: dict[str, float] = field(default_factory=dict)  # role -> seconds per prompt token
    agreement: dict[str, float] = field(default_factory=dict)  # role -> teacher-forced argmax agreement
    # role -> expected tokens per cycle for draft lengths 1..MAX_BATCH-1, from the agreement pass: at every
    # position, how many drafted tokens in a row would have been kept (+1 for the parent's own). Rejections
    # cluster, so this is higher than the geometric E(alpha, g) of the same agreement rate.
    tokens_per_cycle: dict[str, list[float]] = field(default_factory=dict)
    # role -> seconds for a two-token draft call: after a verify the draft catches up on the last drafted
    # token and the parent's own in one call (on this CPU a Q8_0 pair costs 2.2-2.6 single steps)
    draft_pair_s: dict[str, float] = field(default_factory=dict)
    fingerprint: dict = field(default_factory=dict)
    measured_at: str = ""
    left_out: list[str] = field(default_factory=list)  # draft roles not measured (no memory for them beside the rest)

    def verify_cost(self, n: int) -> float:
        """A parent call on n tokens, relative to a one-token call (linear beyond the measured sizes)."""
        c = self.parent_call_s
        if n in c:
            return c[n] / c[1]
        top = max(c)
        slope = (c[top] - c[top // 2]) / max(1, top - top // 2)
        return (c[top] + slope * (n - top)) / c[1]

    def draft_ratio(self, role: str) -> Optional[float]:
        """A draft step relative to a one-token parent call."""
        return self.draft_step_s[role] / self.parent_call_s[1] if role in self.draft_step_s else None

    def draft_cycle(self, role: str, g: int) -> Optional[float]:
        """A draft cycle of g tokens relative to a one-token parent call: g - 1 steps, plus the catch-up of
        the previous cycle — a two-token call after a full accept, one token after a rejection."""
        if role not in self.draft_step_s:
            return None
        step = self.draft_step_s[role]
        pair = self.draft_pair_s.get(role, 2 * step)
        e = self.tokens_per_cycle.get(role)
        p_full = (e[g - 1] - (e[g - 2] if g > 1 else 1.0)) if e and len(e) >= g else 0.5
        return (p_full * pair + (1 - p_full) * step + (g - 1) * step) / self.parent_call_s[1]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        return cls({int(k): float(v) for k, v in d["parent_call_s"].items()},
                   {k: float(v) for k, v in d.get("draft_step_s", {}).items()},
                   {k: float(v) for k, v in d.get("prefill_token_s", {}).items()},
                   {k: float(v) for k, v in d.get("agreement", {}).items()},
                   {k: [float(x) for x in v] for k, v in d.get("tokens_per_cycle", {}).items()},
                   {k: float(v) for k, v in d.get("draft_pair_s", {}).items()},
                   d.get("fingerprint", {}), d.get("measured_at", ""), [str(r) for r in d.get("left_out", [])])


def _timed(ctx, tokens, logits: str = "all") -> float:
    t0 = time.perf_counter()
    ctx.decode(tokens, logits=logits)
    return time.perf_counter() - t0


def _greedy(ctx, prompt: list[int], n: int) -> list[int]:
    """The parent's own greedy answer: n tokens after `prompt` (fewer at an end-of-generation token)."""
    import numpy as np

    ctx.reset()
    ctx.decode(prompt, logits="last")
    out: list[int] = []
    while len(out) < n:
        t = int(np.argmax(ctx.logits(-1)))
        if t in ctx.model.eog_ids:
            break
        out.append(t)
        ctx.decode([t], logits="last")
    ctx.reset()
    return out


def _hits(ctx, prompt: list[int], answer: list[int]) -> list[bool]:
    """Teacher-forced: at each answer position, does the draft's argmax equal the parent's token?"""
    import numpy as np

    ctx.reset()
    ctx.decode(prompt[:-1], logits="none")
    ctx.decode([prompt[-1]] + answer[:-1], logits="all")
    out = [int(np.argmax(ctx.logits(i))) == t for i, t in enumerate(answer)]
    ctx.reset()
    return out


def expected_run_tokens(hits, g_max: int) -> list[float]:
    """[E(1), ..., E(g_max)]: mean over start positions of (drafted tokens kept in a row, capped at g) + 1.
    `hits` is one list of booleans, or a list of them (runs do not cross from one to the next)."""
    seqs = hits if hits and isinstance(hits[0], list) else [hits]
    runs = []
    for hs in seqs:
        run, rs = 0, [0] * len(hs)
        for i in range(len(hs) - 1, -1, -1):
            run = run + 1 if hs[i] else 0
            rs[i] = run
        runs += rs
    return [round(1 + sum(min(r, g) for r in runs) / max(1, len(runs)), 4) for g in range(1, g_max + 1)]


def measure(ctx_for: Callable[[str], object], parent: str, drafts: list[str],
            progress: Optional[Callable[[str, int, int], None]] = None) -> Calibration:
    """Time the calls on real contexts (`ctx_for(role)`), each after the same synthetic prompt.

    The machine's speed drifts between minutes, so every round times every parent call size and every
    draft step back to back (ratios between them are what the cost model uses), and the fastest of
    REPEATS rounds is kept for each (other work on the machine only ever adds time)."""
    pctx = ctx_for(parent)
    prompt = [(7 + 13 * i) % pctx.model.n_vocab for i in range(PREFILL_TOKENS)]
    steps = REPEATS + 2 * (1 + len(drafts)) - 1
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(what, done, steps)

    prefill = {}
    for role in [parent, *drafts]:  # the first pass touches every weight (a cold model reads from disk)
        ctx = ctx_for(role)
        ctx.reset()
        ctx.decode(prompt, logits="last")
        ctx.reset()
        prefill[role] = _timed(ctx, prompt, "last") / len(prompt)
        tick(f"{role} prefill")
    calls = {n: float("inf") for n in range(1, MAX_BATCH + 1)}
    steps_s = {role: float("inf") for role in drafts}
    pairs = {role: float("inf") for role in drafts}
    for r in range(REPEATS):
        for n in calls:
            pctx.rewind(len(prompt))
            calls[n] = min(calls[n], _timed(pctx, prompt[:n]))
        for i, role in enumerate(drafts):
            dctx = ctx_for(role)
            for k in range(DRAFT_STEPS):
                steps_s[role] = min(steps_s[role], _timed(dctx, [prompt[(r * DRAFT_STEPS + k + i) % len(prompt)]]))
            pairs[role] = min(pairs[role], _timed(dctx, prompt[r:r + 2]))
        tick(f"timing round {r + 1}")
    for n in range(MAX_BATCH - 1, 0, -1):  # a call on fewer tokens cannot cost more than one on more
        calls[n] = min(calls[n], calls[n + 1])
    pairs_text = []
    for q in AGREEMENT_PROMPTS:
        prompt = pctx.model.chat_prompt([{"role": "user", "content": q}])
        pairs_text.append((prompt, _greedy(pctx, prompt, AGREEMENT_TOKENS)))
    tick("parent answers")
    agree, cycles = {}, {}
    for role in drafts:
        per_prompt = [_hits(ctx_for(role), p, a) for p, a in pairs_text if a]
        hits = [h for hs in per_prompt for h in hs]
        agree[role] = round(sum(hits) / max(1, len(hits)), 4)
        cycles[role] = expected_run_tokens(per_prompt, MAX_BATCH - 1)
        tick(f"{role} agreement pass")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return Calibration(calls, steps_s, prefill, agree, cycles, pairs, measured_at=stamp)


def load(root: Path, fp: dict) -> Optional[Calibration]:
    path = Path(root) / CALIBRATION_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entry = data.get(key_of(fp)) if isinstance(data, dict) else None
        return Calibration.from_dict(entry) if entry else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save(root: Path, fp: dict, cal: Calibration) -> None:
    """Add this fingerprint's entry, keeping the others of this schema (a family folder may move between
    machines); entries an older version measured are dropped (nothing reads them again)."""
    path = Path(root) / CALIBRATION_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    data = {k: v for k, v in data.items() if _schema_of(k) == SCHEMA}
    cal.fingerprint = fp
    data[key_of(fp)] = cal.to_dict()
    write_json_atomic(path, data)
