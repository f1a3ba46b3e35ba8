"""What this machine's calls cost for a family, measured once and read by the `auto` policy:

- the parent's call on 1..MAX_BATCH tokens, and each draft role's call on 1..DRAFT_BATCH tokens (every model
  draft the family has: q4, q8 and recipes such as q4i, q3g), each after the same 64-token synthetic prompt;
- each draft role's one-token step and its two-token catch-up call ("pair");
- prefill per prompt token, for every role;
- the same calls on 1, 4 and 8 tokens deep in the context (DEEP_POS positions, or fewer in a small
  context): attention reads every cached position, so a call costs more the longer the text before it;
- the seconds a draft takes to import the parent's KV cache, at 64 positions and at the deep one;
- how often each draft's greedy token agrees with the parent's own answers;
- where the family holds both renderings of its parent (F16 and BF16) and the CPU has BF16 dot products, both
  renderings' prefill and 1/4/8/16-token calls, back to back (`renderings`): system.renderings picks the faster.

An entry is per rendering of the parent: the fingerprint names it.

A few seconds on the demo family (about 20 s more for the deep positions on a 1.5B family); cached in
the family folder keyed by a hardware fingerprint and the llama-cpp-python version."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from specquant_cli.errors import InputError
from specquant_cli.family.roles import PARENT_ROLE, is_role_name
from specquant_cli.fsutil import create_temp, write_json_atomic

CALIBRATION_FILE = "calibration.json"
SCHEMA = 6  # part of the cache key: an entry measured by an older version is measured again
MAX_BATCH = 16  # parent call sizes measured: 1..MAX_BATCH tokens
DRAFT_BATCH = 8  # draft call sizes measured: 1..DRAFT_BATCH tokens (a draft verifying another's proposals)
DEEP_POS = 1024  # the deep position measured, when the context has room for it and a call after it
DEEP_MIN = 256  # a context with less room than this is not measured deep (too close to PREFILL_TOKENS)
DEEP_SIZES = (1, 4, 8)  # call sizes measured at the deep position
DEEP_REPEATS = 3  # the fastest of this many timings per deep call size and per import
MAX_DEEP_POS = 1 << 20  # a stored deep position beyond this is not one any context holds
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

def fingerprint(facts, threads: Optional[int] = None, rpc: Optional[list[str]] = None,
                parent: Optional[str] = None) -> dict:
    """What a calibration depends on; a parent on RPC workers is calibrated per worker set (`rpc` endpoints), and
    each rendering of the parent (`parent`: f16, bf16) on its own. `threads`: as resolved (settings: never 0); None
    stands for every core."""
    from importlib.metadata import version

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"schema": SCHEMA, "cpu": model, "cores": facts.cores_logical,
            "threads": threads or max(1, os.cpu_count() or 1),
            "gpus": [g.name for g in facts.gpus], "gpu_offload": facts.gpu_offload,
            "llama_cpp_python": version("llama-cpp-python"), **({"rpc": sorted(rpc)} if rpc else {}),
            "parent": parent or "f16"}


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
    # role -> tokens in one draft call (1..DRAFT_BATCH) -> seconds, after PREFILL_TOKENS positions: what a
    # draft pays to verify several proposed tokens in one call (a second drafting level)
    draft_call_s: dict[str, dict[int, float]] = field(default_factory=dict)
    # role (the parent's too) -> tokens in one call (DEEP_SIZES) -> seconds, after deep_pos positions
    deep_call_s: dict[str, dict[int, float]] = field(default_factory=dict)
    deep_pos: int = 0  # the position deep_call_s was measured at; 0: not measured (the context was too small)
    # draft role -> positions in the parent's cache -> seconds to export it and import it into the draft's
    import_s: dict[str, dict[int, float]] = field(default_factory=dict)
    # rendering (f16, bf16) -> {"prefill_token_s": s, "call_s": {tokens: s}}, timed back to back (compare_renderings);
    # empty when the family has one rendering or the CPU no BF16 dot products
    renderings: dict[str, dict] = field(default_factory=dict)

    def verify_cost(self, n: int) -> float:
        """A parent call on n tokens, relative to a one-token call (linear beyond the measured sizes)."""
        return _curve_at(self.parent_call_s, n) / self.parent_call_s[1]

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

    batch = 1  # sequences decoding together that the figures are per-sequence shares of (for_batch)
    single = None  # for a batch view: the costs of one sequence alone (a Calibration; not a stored field)

    def call_s(self, n: int) -> float:
        """Seconds of a parent call on n tokens (linear beyond the measured sizes)."""
        return self.verify_cost(n) * self.parent_call_s[1]

    def draft_call(self, role: str, n: int) -> Optional[float]:
        """Seconds of one call of the draft `role` on n tokens (linear beyond the measured sizes). Data
        measured before draft calls were (only a one-token step): the step times the prior shape of a
        call's cost by size. None when the role was not measured."""
        curve = self.draft_call_s.get(role)
        if curve:
            return _curve_at(curve, n)
        if role in self.draft_step_s:
            from specquant_cli.decoding.gamma import verify_shape

            return self.draft_step_s[role] * verify_shape(n)
        return None

    def depth_factor(self, role: str, n: int, pos: int) -> float:
        """A call of `role` on n tokens after `pos` positions, relative to the same call after
        PREFILL_TOKENS: linear in pos through 1.0 at PREFILL_TOKENS and the measured factor at deep_pos
        (for a size not measured deep, the factor interpolated between the measured sizes, the nearest one
        beyond them), extrapolated beyond deep_pos. Never below 1.0 (a call does not get cheaper with more
        text before it: a measured factor below 1 is noise), 1.0 up to PREFILL_TOKENS and when the role was
        not measured deep. On a batch view, the figures of one sequence alone."""
        deep = self._deep_factors(role)
        if not deep or self.deep_pos <= PREFILL_TOKENS:
            return 1.0
        at_deep = max(1.0, _interpolate(deep, n))
        return 1.0 + (at_deep - 1.0) * max(0, pos - PREFILL_TOKENS) / (self.deep_pos - PREFILL_TOKENS)

    def _deep_factors(self, role: str) -> dict[int, float]:
        """Call size -> the deep call's cost over the same call after PREFILL_TOKENS, where both were measured."""
        own = self.single or self
        base = own.parent_call_s if role == PARENT_ROLE else own.draft_call_s.get(role, {})
        deep = own.deep_call_s.get(role, {})
        return {n: deep[n] / base[n] for n in deep if n in base}

    def call_s_at(self, n: int, pos: int) -> float:
        """Seconds of a parent call on n tokens after `pos` positions (call_s scaled by depth_factor; on a
        batch view, the factor of the whole batch's call)."""
        return self.call_s(n) * self.depth_factor(PARENT_ROLE, n * self.batch, pos)

    def at(self, pos: int) -> Calibration:
        """These costs after `pos` positions of context: every parent call and draft call scaled by its
        depth_factor (a batch view stays one, its parent calls scaled as the whole batch's call). Unchanged
        where nothing was measured deep."""
        if not self.deep_call_s or pos <= PREFILL_TOKENS:
            return self

        def scaled(role: str, curve: dict[int, float], per: int = 1) -> dict[int, float]:
            return {n: s * self.depth_factor(role, n * per, pos) for n, s in curve.items()}

        view = replace(self, parent_call_s=scaled(PARENT_ROLE, self.parent_call_s, self.batch),
                       draft_step_s={r: s * self.depth_factor(r, 1, pos) for r, s in self.draft_step_s.items()},
                       draft_pair_s={r: s * self.depth_factor(r, 2, pos) for r, s in self.draft_pair_s.items()},
                       draft_call_s={r: scaled(r, c) for r, c in self.draft_call_s.items()})
        view.batch, view.single = self.batch, self.single
        return view

    def import_cost(self, role: str, n_tokens: int) -> Optional[float]:
        """Seconds for the draft `role` to import the parent's cache of n_tokens positions: linear through
        the measured lengths (in proportion to the one length when only one was measured); never falling
        with length. None when the role's import was not measured (refused, or not tried)."""
        points = self.import_s.get(role)
        if not points:
            return None
        lo, hi = min(points), max(points)
        if lo == hi:
            return points[lo] * n_tokens / lo
        slope = max(0.0, (points[hi] - points[lo]) / (hi - lo))
        return max(0.0, points[lo] + slope * (n_tokens - lo))

    def for_batch(self, b: int) -> Calibration:
        """The costs one of `b` sequences decoding together sees: a parent call with n tokens for each costs
        call(b * n), shared b ways; a draft step costs what it costs alone. Concurrent requests' draft steps
        rarely line up — each has its own draft length, accepts and misses — so a round holds one request's
        draft call beside another's parent call and every member waits for both. (Priced as shared, like the
        parent's, suffix+q4 drafts were predicted 1.2-1.8x the parent at 2 requests on the Intel Xeon, and
        ran 0.80x.) b = 1: self."""
        if b <= 1:
            return self
        view = replace(self, parent_call_s={n: self.call_s(b * n) / b for n in self.parent_call_s})
        view.batch, view.single = b, self
        return view

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        """From a stored entry (JSON: call sizes and positions as strings); fields it lacks take their defaults."""
        return cls(parent_call_s=_sized(d["parent_call_s"]),
                   draft_step_s=_per_role(d.get("draft_step_s", {})),
                   prefill_token_s=_per_role(d.get("prefill_token_s", {})),
                   agreement=_per_role(d.get("agreement", {})),
                   tokens_per_cycle={k: [float(x) for x in v] for k, v in d.get("tokens_per_cycle", {}).items()},
                   draft_pair_s=_per_role(d.get("draft_pair_s", {})),
                   fingerprint=d.get("fingerprint", {}), measured_at=d.get("measured_at", ""),
                   left_out=[str(r) for r in d.get("left_out", [])],
                   draft_call_s={k: _sized(v) for k, v in d.get("draft_call_s", {}).items()},
                   deep_call_s={k: _sized(v) for k, v in d.get("deep_call_s", {}).items()},
                   deep_pos=int(d.get("deep_pos", 0)),
                   import_s={k: _sized(v) for k, v in d.get("import_s", {}).items()},
                   renderings={r: {"prefill_token_s": float(t["prefill_token_s"]), "call_s": _sized(t["call_s"])}
                               for r, t in d.get("renderings", {}).items()})


def _sized(d: dict) -> dict[int, float]:
    """{size or position: seconds} with integer keys (JSON stores them as strings)."""
    return {int(k): float(v) for k, v in d.items()}


def _per_role(d: dict) -> dict[str, float]:
    return {k: float(v) for k, v in d.items()}


def _curve_at(curve: dict[int, float], n: int) -> float:
    """A measured cost curve (call size -> seconds) at n: the measured figure, else the line through the
    largest size and half of it (the calls grow linearly once the matrix kernels are saturated)."""
    if n in curve:
        return curve[n]
    top = max(curve)
    half = max((k for k in curve if k <= top // 2), default=top)
    slope = (curve[top] - curve[half]) / (top - half) if half < top else 0.0
    return curve[top] + slope * (n - top)


def _interpolate(points: dict[int, float], x: int) -> float:
    """Piecewise-linear through `points` at x; the nearest end's value beyond them."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]]
    hi = next(k for k in xs if k >= x)
    lo = max(k for k in xs if k < x)
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def _monotone(curve: dict[int, float]) -> dict[int, float]:
    """A call on fewer tokens cannot cost more than one on more: each size's figure capped by the next."""
    out = dict(curve)
    sizes = sorted(out)
    for small, big in zip(reversed(sizes[:-1]), reversed(sizes[1:])):
        out[small] = min(out[small], out[big])
    return out


def _timed(ctx, tokens, logits: str = "all") -> float:
    t0 = time.perf_counter()
    ctx.decode(tokens, logits=logits)
    return time.perf_counter() - t0


def greedy_answer(ctx, prompt: list[int], n: int) -> list[int]:
    """The parent's own greedy answer: n tokens after `prompt` (fewer at an end-of-generation token, which
    is left out). `ctx` is reset before and after."""
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


def draft_hits(ctx, prompt: list[int], answer: list[int]) -> list[bool]:
    """Teacher-forced: at each answer position, does the draft's argmax equal the parent's token? (A greedy
    draft proposes exactly these argmaxes for as long as it has matched.) `ctx` is reset before and after."""
    import numpy as np

    ctx.reset()
    ctx.decode(prompt[:-1], logits="none")
    ctx.decode([prompt[-1]] + answer[:-1], logits="all")
    out = [int(np.argmax(ctx.logits(i))) == t for i, t in enumerate(answer)]
    ctx.reset()
    return out


def expected_run_tokens(hits, gamma_max: int) -> list[float]:
    """[E(1), ..., E(gamma_max)]: mean over start positions of (drafted tokens kept in a row, capped at g) + 1.
    `hits` is one list of booleans, or a list of them (runs do not cross from one to the next)."""
    seqs = hits if hits and isinstance(hits[0], list) else [hits]
    runs = []
    for hs in seqs:
        run, rs = 0, [0] * len(hs)
        for i in range(len(hs) - 1, -1, -1):
            run = run + 1 if hs[i] else 0
            rs[i] = run
        runs += rs
    return [round(1 + sum(min(r, g) for r in runs) / max(1, len(runs)), 4) for g in range(1, gamma_max + 1)]


def measure(ctx_for: Callable[[str], object], parent: str, drafts: list[str],
            progress: Optional[Callable[[str, int, int], None]] = None) -> Calibration:
    """Time the calls on real contexts (`ctx_for(role)`), each after the same synthetic prompt.

    The machine's speed drifts between minutes, so every round times every parent call size and every
    draft call back to back (ratios between them are what the cost model uses), and the fastest of
    REPEATS rounds is kept for each (other work on the machine only ever adds time). Then the calls deep
    in the context, the drafts' imports of the parent's cache, and the agreement pass."""
    roles = [parent, *drafts]
    pctx = ctx_for(parent)
    deep_pos = deep_position(min(ctx_for(r).n_ctx for r in roles))
    lengths = (PREFILL_TOKENS, deep_pos) if deep_pos else (PREFILL_TOKENS,)
    deep_ticks = len(roles) if deep_pos else 0
    # ticks: prefill per role, rounds, deep calls per role, imports per length, parent answers, agreement per draft
    tick = _ticker(progress, len(roles) + REPEATS + deep_ticks + len(lengths) + 1 + len(drafts))
    prompt = synthetic_prompt(pctx.model.n_vocab, max(PREFILL_TOKENS, deep_pos))
    prefill = _time_prefill(ctx_for, roles, prompt[:PREFILL_TOKENS], tick)
    calls, steps_s, pairs, draft_calls = _time_rounds(ctx_for, parent, drafts, prompt[:PREFILL_TOKENS], tick)
    deep = {role: _time_deep(ctx_for(role), prompt[:deep_pos], tick, role) for role in roles} if deep_pos else {}
    imports = _time_imports(ctx_for, parent, drafts, [prompt[:n] for n in lengths], tick)
    agree, cycles = _agreement(ctx_for, parent, drafts, tick)
    return Calibration(calls, steps_s, prefill, agree, cycles, pairs,
                       measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       draft_call_s=draft_calls, deep_call_s=deep, deep_pos=deep_pos, import_s=imports)


RENDERING_SIZES = (1, 4, 8, 16)  # call sizes the renderings' comparison times
RENDERING_REPEATS = 3


def compare_renderings(ctx_for: Callable[[str], object], renderings: list[str],
                       tick: Optional[Callable[[str], None]] = None) -> dict[str, dict]:
    """Rendering -> {"prefill_token_s", "call_s": {n: s}}: each rendering's prefill of PREFILL_TOKENS tokens and
    its calls on RENDERING_SIZES tokens after it, on `ctx_for(rendering)`'s context, the renderings timed in turn
    within each of RENDERING_REPEATS rounds (the VM drifts between minutes: only ratios within one run are
    compared), the fastest of each kept. Every context is reset after."""
    ctxs = {r: ctx_for(r) for r in renderings}
    prompt = synthetic_prompt(next(iter(ctxs.values())).model.n_vocab, PREFILL_TOKENS)
    best = {r: {"prefill_token_s": float("inf"), "call_s": {n: float("inf") for n in RENDERING_SIZES}}
            for r in renderings}
    for ctx in ctxs.values():  # the first pass touches every weight (a cold model reads from disk)
        ctx.reset()
        ctx.decode(prompt, logits="last")
    for i in range(RENDERING_REPEATS):
        for r, ctx in ctxs.items():
            ctx.reset()
            b = best[r]
            b["prefill_token_s"] = min(b["prefill_token_s"], _timed(ctx, prompt, "last") / len(prompt))
            for n in RENDERING_SIZES:
                ctx.rewind(len(prompt))
                b["call_s"][n] = min(b["call_s"][n], _timed(ctx, prompt[:n]))
        if tick:
            tick(f"renderings round {i + 1}")
    for ctx in ctxs.values():
        ctx.reset()
    return best


def deep_position(n_ctx: int) -> int:
    """Where the deep calls are measured in a context of n_ctx positions: DEEP_POS, or less where the
    context could not hold a parent call after it; 0 (not measured) when that is below DEEP_MIN."""
    pos = min(DEEP_POS, n_ctx - MAX_BATCH - 8)
    return pos if pos >= DEEP_MIN else 0


def synthetic_prompt(n_vocab: int, n: int) -> list[int]:
    """n token ids spread over the vocabulary: every measured call reads the same text (a prefix of it)."""
    return [(7 + 13 * i) % n_vocab for i in range(n)]


def _ticker(progress: Optional[Callable[[str, int, int], None]], steps: int) -> Callable[[str], None]:
    """tick(what): one of `steps` steps done, reported to `progress` (when there is one)."""
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(what, done, steps)

    return tick


def _time_prefill(ctx_for, roles: list[str], prompt: list[int], tick) -> dict[str, float]:
    """Role -> seconds per prompt token; each context left holding `prompt`. One tick per role."""
    prefill = {}
    for role in roles:  # the first pass touches every weight (a cold model reads from disk)
        ctx = ctx_for(role)
        ctx.reset()
        ctx.decode(prompt, logits="last")
        ctx.reset()
        prefill[role] = _timed(ctx, prompt, "last") / len(prompt)
        tick(f"{role} prefill")
    return prefill


def _time_rounds(ctx_for, parent: str, drafts: list[str], prompt: list[int], tick):
    """REPEATS rounds, each timing every parent call size, every draft call size, draft steps and pairs;
    the fastest of each kept, the call curves made monotone. Each context holds `prompt` on entry. Returns
    (parent calls, draft steps, draft pairs, draft calls). One tick per round."""
    pctx = ctx_for(parent)
    calls = {n: float("inf") for n in range(1, MAX_BATCH + 1)}
    steps_s = {role: float("inf") for role in drafts}
    pairs = {role: float("inf") for role in drafts}
    draft_calls = {role: {n: float("inf") for n in range(1, DRAFT_BATCH + 1)} for role in drafts}
    for r in range(REPEATS):
        for n in calls:
            pctx.rewind(len(prompt))
            calls[n] = min(calls[n], _timed(pctx, prompt[:n]))
        for i, role in enumerate(drafts):
            dctx = ctx_for(role)
            for n in draft_calls[role]:
                dctx.rewind(len(prompt))
                draft_calls[role][n] = min(draft_calls[role][n], _timed(dctx, prompt[:n]))
            for k in range(DRAFT_STEPS):
                steps_s[role] = min(steps_s[role], _timed(dctx, [prompt[(r * DRAFT_STEPS + k + i) % len(prompt)]]))
            pairs[role] = min(pairs[role], _timed(dctx, prompt[r:r + 2]))
        tick(f"timing round {r + 1}")
    return _monotone(calls), steps_s, pairs, {role: _monotone(c) for role, c in draft_calls.items()}


def _time_deep(ctx, prompt: list[int], tick, role: str) -> dict[int, float]:
    """Call size (DEEP_SIZES) -> seconds of a call after all of `prompt` (prefilled once, without logits),
    the fastest of DEEP_REPEATS, made monotone. The context is left holding `prompt`. One tick."""
    ctx.sync(prompt, logits="none")
    best = {n: float("inf") for n in DEEP_SIZES}
    for _ in range(DEEP_REPEATS):
        for n in DEEP_SIZES:
            ctx.rewind(len(prompt))
            best[n] = min(best[n], _timed(ctx, prompt[:n]))
    ctx.rewind(len(prompt))
    tick(f"{role} at position {len(prompt)}")
    return _monotone(best)


def _time_imports(ctx_for, parent: str, drafts: list[str], prompts: list[list[int]],
                  tick) -> dict[str, dict[int, float]]:
    """Draft role -> positions -> seconds to export the parent's cache holding each prompt and import it into
    the draft's context (what ModelDrafter pays instead of a prefill), the fastest of DEEP_REPEATS. A role
    whose context refuses the parent's state at any length is left out. The longest prompt first (the
    parent holds it after the deep calls: no second prefill). Every context is reset after. One tick per
    prompt."""
    from specquant_cli.backend.llama import LlamaError

    pctx = ctx_for(parent)
    seconds: dict[str, dict[int, float]] = {role: {} for role in drafts}
    refused: set[str] = set()
    for prompt in sorted(prompts, key=len, reverse=True):
        pctx.sync(prompt, logits="none")
        for role in drafts:
            try:
                t = None if role in refused else _time_import(pctx, ctx_for(role), prompt)
            except LlamaError:  # the parent's state could not be exported
                t = None
            if t is None:
                refused.add(role)
            else:
                seconds[role][len(prompt)] = t
        tick(f"imports at position {len(prompt)}")
    pctx.reset()
    return {role: s for role, s in seconds.items() if role not in refused}


def _time_import(pctx, dctx, tokens: list[int]) -> Optional[float]:
    """The fastest of DEEP_REPEATS exports of `pctx`'s cache (holding `tokens`) imported into `dctx`; None
    when `dctx` refuses it. `dctx` is reset after."""
    best = float("inf")
    try:
        for _ in range(DEEP_REPEATS):
            dctx.reset()
            t0 = time.perf_counter()
            if not dctx.import_state(pctx.export_state(), tokens):
                return None
            best = min(best, time.perf_counter() - t0)
        return best
    finally:
        dctx.reset()


def _agreement(ctx_for, parent: str, drafts: list[str], tick) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Role -> argmax agreement with the parent's own greedy answers, and expected tokens per cycle for draft
    lengths 1..MAX_BATCH-1. One tick for the parent's answers, one per draft."""
    pctx = ctx_for(parent)
    pairs_text = []
    for q in AGREEMENT_PROMPTS:
        prompt = pctx.model.chat_prompt([{"role": "user", "content": q}])
        pairs_text.append((prompt, greedy_answer(pctx, prompt, AGREEMENT_TOKENS)))
    tick("parent answers")
    agree, cycles = {}, {}
    for role in drafts:
        per_prompt = [draft_hits(ctx_for(role), p, a) for p, a in pairs_text if a]
        hits = [h for hs in per_prompt for h in hs]
        agree[role] = round(sum(hits) / max(1, len(hits)), 4)
        cycles[role] = expected_run_tokens(per_prompt, MAX_BATCH - 1)
        tick(f"{role} agreement pass")
    return agree, cycles


# -- the stored entries: checked on every read ------------------------------------------------------------
MAX_FILE_BYTES = 4 << 20  # an entry is a few KB: a calibration file larger than this is not one
MAX_SECONDS = 600.0  # no single call measured here takes ten minutes: a larger timing is not a measurement
MIN_SECONDS = 1e-6  # nor does any take under a microsecond (a rate from a smaller one overflows)
FIELDS = {  # every key an entry holds, and what its value must be
    "parent_call_s": "object", "draft_step_s": "object", "prefill_token_s": "object", "agreement": "object",
    "tokens_per_cycle": "object", "draft_pair_s": "object", "fingerprint": "object", "measured_at": "string",
    "left_out": "array", "draft_call_s": "object", "deep_call_s": "object", "deep_pos": "number",
    "import_s": "object", "renderings": "object",
}
_TOL = 1e-3  # the stored run lengths are rounded to 4 decimals


def _json_type(v) -> str:
    if isinstance(v, dict):
        return "object"
    if isinstance(v, list):
        return "array"
    if isinstance(v, str):
        return "string"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return "null" if v is None else type(v).__name__


def _number(v, what: str) -> float:
    """A finite JSON number (not a boolean), else ValueError naming `what`."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{what} is a {_json_type(v)}, not a number")
    try:
        x = float(v)
    except OverflowError:
        raise ValueError(f"{what} is out of range") from None
    if not math.isfinite(x):
        raise ValueError(f"{what} is {x}, not a finite number")
    return x


def _seconds(v, what: str) -> float:
    x = _number(v, what)
    if not MIN_SECONDS <= x <= MAX_SECONDS:
        raise ValueError(f"{what} {x:g} s is not a timing (must be {MIN_SECONDS:g} .. {MAX_SECONDS:g} s)")
    return x


def _roles(d: dict, field_name: str) -> None:
    for role in d:
        if not is_role_name(role):
            raise ValueError(f"{field_name} names the role {role[:40]!r}, which is not a role name")


def entry_problem(entry) -> Optional[str]:
    """Why a stored entry cannot be used (its keys, types and values), or None when it can."""
    try:
        _check_entry(entry)
    except ValueError as e:
        return str(e)
    return None


def _check_entry(entry) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"a JSON {_json_type(entry)}, not an object")
    entry = {"renderings": {}, **entry}  # a family of one rendering compares none
    missing = [k for k in FIELDS if k not in entry]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing")
    for k, want in FIELDS.items():
        if _json_type(entry[k]) != want:
            raise ValueError(f"{k} is a JSON {_json_type(entry[k])}, not an {want}" if want[0] in "aeiou"
                             else f"{k} is a JSON {_json_type(entry[k])}, not a {want}")
    calls = entry["parent_call_s"]
    sizes = []
    for k, v in calls.items():
        if not (k.isascii() and k.isdigit() and 1 <= int(k) <= MAX_BATCH):
            raise ValueError(f"parent_call_s has the call size {k[:20]!r}, not one of 1..{MAX_BATCH}")
        sizes.append(int(k))
        _seconds(v, f"parent_call_s[{k}]")
    if sorted(sizes) != list(range(1, len(sizes) + 1)):
        raise ValueError(f"parent_call_s sizes {sorted(sizes)} are not 1..N" if sizes else "parent_call_s is empty")
    for name in ("draft_step_s", "prefill_token_s", "draft_pair_s"):
        _roles(entry[name], name)
        for role, v in entry[name].items():
            _seconds(v, f"{role} {name}")
    _roles(entry["agreement"], "agreement")
    for role, v in entry["agreement"].items():
        x = _number(v, f"{role} agreement")
        if not 0 <= x <= 1:
            raise ValueError(f"{role} agreement {x:g} outside [0, 1]")
    _roles(entry["tokens_per_cycle"], "tokens_per_cycle")
    for role, runs in entry["tokens_per_cycle"].items():
        if not isinstance(runs, list) or len(runs) > MAX_BATCH - 1:
            raise ValueError(f"{role} tokens_per_cycle is not a list of at most {MAX_BATCH - 1} numbers")
        prev = 1.0  # E(g) - E(g-1) is the share of positions whose run reaches g: an acceptance, in [0, 1]
        for g, v in enumerate(runs, 1):
            x = _number(v, f"{role} tokens_per_cycle[{g}]")
            if not -_TOL <= x - prev <= 1 + _TOL:
                raise ValueError(f"{role} tokens_per_cycle[{g}] = {x:g} after {prev:g}: an acceptance of "
                                 f"{x - prev:g}, outside [0, 1]")
            prev = x
    if not all(isinstance(r, str) for r in entry["left_out"]):
        raise ValueError("left_out holds something other than role names")
    deep_pos = _check_deep_pos(entry["deep_pos"])
    _check_curves(entry, "draft_call_s", range(1, DRAFT_BATCH + 1))
    _check_curves(entry, "deep_call_s", DEEP_SIZES)
    if entry["deep_call_s"] and not deep_pos:
        raise ValueError("deep_call_s holds timings but deep_pos is 0 (not measured)")
    _check_curves(entry, "import_s", range(1, max(PREFILL_TOKENS, deep_pos) + 1))
    _check_renderings(entry["renderings"])


def _check_renderings(d: dict) -> None:
    """renderings: f16/bf16 -> {"prefill_token_s": seconds, "call_s": {size in RENDERING_SIZES: seconds}}."""
    from specquant_cli.family.roles import RENDERINGS

    for r, t in d.items():
        if r not in RENDERINGS:
            raise ValueError(f"renderings names {r[:40]!r}, not one of {', '.join(RENDERINGS)}")
        if not isinstance(t, dict) or set(t) != {"prefill_token_s", "call_s"} or not isinstance(t["call_s"], dict):
            raise ValueError(f"renderings[{r}] is not an object of prefill_token_s and call_s")
        _seconds(t["prefill_token_s"], f"renderings[{r}] prefill_token_s")
        for k, v in t["call_s"].items():
            if not (k.isascii() and k.isdigit() and len(k) <= 3 and int(k) in RENDERING_SIZES):
                raise ValueError(f"renderings[{r}] has the call size {k[:20]!r}, not one of {_span(RENDERING_SIZES)}")
            _seconds(v, f"renderings[{r}] call_s[{k}]")


def _check_deep_pos(v) -> int:
    """deep_pos: a whole number of positions, 0 (not measured) .. MAX_DEEP_POS."""
    x = _number(v, "deep_pos")
    if not 0 <= x <= MAX_DEEP_POS or x != int(x):
        raise ValueError(f"deep_pos {x:g} is not a position (a whole number 0 .. {MAX_DEEP_POS})")
    return int(x)


def _check_curves(entry: dict, name: str, sizes) -> None:
    """entry[name]: role -> {size as a digit string, one of `sizes`: seconds}."""
    _roles(entry[name], name)
    for role, curve in entry[name].items():
        if not isinstance(curve, dict):
            raise ValueError(f"{role} {name} is a JSON {_json_type(curve)}, not an object")
        for k, v in curve.items():
            if not (k.isascii() and k.isdigit() and len(k) <= 8 and int(k) in sizes):
                raise ValueError(f"{role} {name} has the size {k[:20]!r}, not one of {_span(sizes)}")
            _seconds(v, f"{role} {name}[{k}]")


def _span(sizes) -> str:
    """How a set of allowed sizes reads in a message: 1..8, or 1, 4, 8."""
    return f"{sizes.start}..{sizes.stop - 1}" if isinstance(sizes, range) else ", ".join(map(str, sizes))


def _read(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """A calibration file's entries ({} when there is none), or None and why it cannot be used."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return None, f"{path} cannot be read ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return None, f"{path} is not a regular file"
    if st.st_size > MAX_FILE_BYTES:
        return None, (f"{path} is {st.st_size / 2**20:.1f} MiB, larger than any calibration file "
                      f"(limit {MAX_FILE_BYTES >> 20} MiB)")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        return None, f"{path} cannot be read ({e.strerror})"
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, f"{path} is not UTF-8 text (invalid byte at offset {e.start})"
    except json.JSONDecodeError as e:
        return None, f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    except (ValueError, RecursionError) as e:
        return None, f"{path} is not valid JSON ({type(e).__name__})"
    if not isinstance(data, dict):
        return None, f"{path} holds a JSON {_json_type(data)}, not an object of entries"
    return data, None


def _same_machine_older(data: dict, fp: dict) -> Optional[int]:
    """The schema of an entry for this machine measured by another version, if there is one."""
    for k in data:
        try:
            other = json.loads(k)
        except ValueError:
            continue
        if isinstance(other, dict) and other.get("schema") != fp.get("schema") and \
                {**other, "schema": None} == {**fp, "schema": None}:
            return other.get("schema")
    return None


# -- where the entries live: the family folder, or the user's cache when the family cannot be written -----
def cache_dir() -> Optional[Path]:
    """The calibrations' folder in specquant's user cache (settings.cache_home); None when there is no home."""
    from specquant_cli.settings import cache_home

    home = cache_home()
    return home / "calibrations" if home is not None else None


def _base_sha(root: Path) -> str:
    try:
        m = json.loads((Path(root) / "manifest.json").read_text(encoding="utf-8"))
        sha = m.get("base", {}).get("sha256") if isinstance(m, dict) and isinstance(m.get("base"), dict) else None
        return sha if isinstance(sha, str) else ""
    except (OSError, ValueError):
        return ""


def cache_file(root: Path) -> Optional[Path]:
    """The user-cache file for a family that cannot keep its calibration itself: keyed by the folder's real
    path and the sha256 of the family's base (a different family later at the same path gets its own)."""
    folder = cache_dir()
    if folder is None:
        return None
    real = os.path.realpath(root)
    key = hashlib.sha256(f"{real}\0{_base_sha(root)}".encode("utf-8", "surrogateescape")).hexdigest()[:32]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(real))[:64].lstrip(".") or "family"
    return folder / f"{name}-{key}.json"


def _places(root: Path) -> list[Path]:
    cached = cache_file(root)
    return [Path(root) / CALIBRATION_FILE] + ([cached] if cached else [])


def cannot_write(folder: Path, create: bool = False) -> Optional[str]:
    """Why no new file can be made in `folder` (a probe file is created and removed), or None when one can.
    The single place writability is decided (the tests make a folder read-only here)."""
    try:
        if create:
            os.makedirs(folder, exist_ok=True)
        fd, probe = create_temp(Path(folder) / "write-probe")
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    try:
        probe.unlink()
    except OSError:
        pass
    return None


def save_target(root: Path) -> Path:
    """The file a new measurement will be saved in: the family's own, else the user-cache one; an InputError
    (before anything is measured) when neither can be written."""
    why = cannot_write(Path(root))
    if why is None:
        return Path(root) / CALIBRATION_FILE
    cached = cache_file(root)
    if cached is None:
        raise InputError(f"cannot save a calibration: the family folder {root} is not writable ({why}) and there "
                         "is no user cache folder (set XDG_CACHE_HOME)")
    why_cache = cannot_write(cached.parent, create=True)
    if why_cache is not None:
        raise InputError(f"cannot save a calibration: the family folder {root} is not writable ({why}), nor is "
                         f"the cache folder {cached.parent} ({why_cache})")
    return cached


def load_checked(root: Path, fp: dict) -> tuple[Optional[Calibration], Optional[str]]:
    """This machine's entry, checked (keys, types, finite positive timings, agreements and acceptances in
    [0, 1]): from the family folder, else from the user cache. Returns (entry, None), or (None, why the
    stored entry was not used) — why is None when there simply is none."""
    key, why = key_of(fp), None
    for path in _places(root):
        data, problem = _read(path)
        if data is None:
            why = why or problem
            continue
        if key not in data:
            older = _same_machine_older(data, fp)
            if older is not None and why is None:
                why = (f"the stored entry for this machine ({path}) was measured by another version "
                       f"(calibration schema {older!r}, this version's is {SCHEMA})")
            continue
        entry = data[key]
        problem = entry_problem(entry)
        if problem:
            why = why or f"the stored entry for this machine ({path}) is invalid ({problem})"
            continue
        return Calibration.from_dict(entry), None
    return None, why


def load(root: Path, fp: dict) -> Optional[Calibration]:
    """This machine's valid entry, or None (an invalid one is never returned: see load_checked)."""
    return load_checked(root, fp)[0]


def save(root: Path, fp: dict, cal: Calibration) -> tuple[Path, Optional[str]]:
    """Add this fingerprint's entry, keeping the other valid entries of this schema (a family folder may move
    between machines); entries an older version measured, and broken ones, are dropped. Written in the
    family folder, or in the user cache when the family folder cannot be written. Returns the file written
    and, when that is the cache, why the family folder could not take it. OSError when neither could."""
    cal.fingerprint = fp
    last: Optional[OSError] = None
    for i, path in enumerate(_places(root)):
        try:
            if i:
                os.makedirs(path.parent, exist_ok=True)
            data, _ = _read(path)
            data = {k: v for k, v in (data or {}).items() if _schema_of(k) == SCHEMA and entry_problem(v) is None}
            data[key_of(fp)] = cal.to_dict()
            write_json_atomic(path, data)
            return path, (None if last is None else (last.strerror or str(last)))
        except OSError as e:
            last = last or e
    raise last if last is not None else OSError(errno.EROFS, "nowhere to save the calibration")
