"""What this machine's calls cost for a family: the parent's call on 1..16 tokens, each draft role's
one-token step, prefill per token. Measured once (a few seconds on the demo family), cached in the family
folder keyed by a hardware fingerprint and the llama-cpp-python version, read by the `auto` policy."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from specquant_cli.fsutil import write_json_atomic

CALIBRATION_FILE = "calibration.json"
MAX_BATCH = 16  # parent call sizes measured: 1..MAX_BATCH tokens
REPEATS = 5  # the fastest of this many timings per size: other work on the machine only adds time
PREFILL_TOKENS = 64
DRAFT_STEPS = 8


def fingerprint(facts, threads: Optional[int] = None) -> dict:
    from importlib.metadata import version

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu": model, "cores": facts.cores_logical, "threads": threads or os.cpu_count() or 1,
            "gpus": [g.name for g in facts.gpus], "gpu_offload": facts.gpu_offload,
            "llama_cpp_python": version("llama-cpp-python")}


def key_of(fp: dict) -> str:
    return json.dumps(fp, sort_keys=True)


@dataclass
class Calibration:
    parent_call_s: dict[int, float]  # tokens in one parent call -> seconds
    draft_step_s: dict[str, float] = field(default_factory=dict)  # role -> seconds per one-token step
    prefill_token_s: dict[str, float] = field(default_factory=dict)  # role -> seconds per prompt token
    fingerprint: dict = field(default_factory=dict)
    measured_at: str = ""

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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        return cls({int(k): float(v) for k, v in d["parent_call_s"].items()},
                   {k: float(v) for k, v in d.get("draft_step_s", {}).items()},
                   {k: float(v) for k, v in d.get("prefill_token_s", {}).items()},
                   d.get("fingerprint", {}), d.get("measured_at", ""))


def _timed(ctx, tokens, logits: str = "all") -> float:
    t0 = time.perf_counter()
    ctx.decode(tokens, logits=logits)
    return time.perf_counter() - t0


def measure(ctx_for: Callable[[str], object], parent: str, drafts: list[str],
            progress: Optional[Callable[[str, int, int], None]] = None) -> Calibration:
    """Time the calls on real contexts (`ctx_for(role)`), each from the same synthetic prompt."""
    pctx = ctx_for(parent)
    vocab = pctx.model.n_vocab
    prompt = [(7 + 13 * i) % vocab for i in range(PREFILL_TOKENS)]
    steps = MAX_BATCH * REPEATS + len(drafts) * DRAFT_STEPS + 1 + len(drafts)
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(what, done, steps)

    pctx.reset()
    prefill = {parent: _timed(pctx, prompt, "last") / len(prompt)}
    tick("parent prefill")
    calls: dict[int, float] = {}
    for n in range(1, MAX_BATCH + 1):
        times = []
        for _ in range(REPEATS):
            pctx.rewind(len(prompt))
            times.append(_timed(pctx, prompt[:n]))
            tick(f"parent call of {n}")
        calls[n] = min(times)
    for n in range(MAX_BATCH - 1, 0, -1):  # a call on fewer tokens cannot cost more than one on more
        calls[n] = min(calls[n], calls[n + 1])
    pctx.reset()
    steps_s = {}
    for role in drafts:
        dctx = ctx_for(role)
        dctx.reset()
        prefill[role] = _timed(dctx, prompt, "last") / len(prompt)
        tick(f"{role} prefill")
        times = []
        for i in range(DRAFT_STEPS):
            times.append(_timed(dctx, [prompt[i]], "last"))
            tick(f"{role} step")
        steps_s[role] = min(times)
        dctx.reset()
    return Calibration(calls, steps_s, prefill, measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def load(root: Path, fp: dict) -> Optional[Calibration]:
    path = Path(root) / CALIBRATION_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entry = data.get(key_of(fp)) if isinstance(data, dict) else None
        return Calibration.from_dict(entry) if entry else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save(root: Path, fp: dict, cal: Calibration) -> None:
    """Add this fingerprint's entry, keeping the others (a family folder may move between machines)."""
    path = Path(root) / CALIBRATION_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    cal.fingerprint = fp
    data[key_of(fp)] = cal.to_dict()
    write_json_atomic(path, data)
