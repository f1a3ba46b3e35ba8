"""Measuring this machine's costs for a family (a system.calibration.Calibration), once per family and machine:

- the parent's call on 1..MAX_BATCH tokens and on LONG_CALLS (the drafts of a copied answer), and each draft role's
  call on 1..DRAFT_BATCH tokens (every model draft the family has: q4, q8 and recipes such as q4i, q3g), each after
  the same 64-token synthetic prompt;
- each draft role's one-token step and its two-token catch-up call ("pair");
- prefill per prompt token, for every role;
- the same calls on 1, 4 and 8 tokens deep in the context (DEEP_POS positions, or fewer in a small
  context; the parent's on 1..64): attention reads every cached position, so a call costs more the longer the
  text before it; and the parent's once more at FAR_POS (an agent's depth), where the context has room;
- the seconds a draft takes to import the parent's KV cache, at 64 positions and at the deep one;
- how often each draft's greedy token agrees with the parent's own answers;
- where the family holds both renderings of its parent (F16 and BF16) and the CPU has BF16 dot products, both
  renderings' prefill and 1/4/8/16-token calls, back to back (`compare_renderings`): system.renderings picks the
  faster.

A few seconds on the demo family (about 45 s more for the deep and far positions on a 1.5B family)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional

from specquant_cli.system.calibration import (
    DEEP_MIN,
    DEEP_PARENT_SIZES,
    DEEP_POS,
    DEEP_SIZES,
    DRAFT_BATCH,
    FAR_MIN,
    FAR_POS,
    LONG_CALLS,
    MAX_BATCH,
    PREFILL_TOKENS,
    RENDERING_SIZES,
    Calibration,
    monotone,
)

DEEP_REPEATS = 3  # the fastest of this many timings per deep call size and per import
REPEATS = 5  # the fastest of this many timings per size: other work on the machine only adds time
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
            progress: Optional[Callable[[str, int, int], None]] = None, siblings=()) -> Calibration:
    """Time the calls on real contexts (`ctx_for(role)`), each after the same synthetic prompt.

    The machine's speed drifts between minutes, so every round times every parent call size and every
    draft call back to back (ratios between them are what the cost model uses), and the fastest of
    REPEATS rounds is kept for each (other work on the machine only ever adds time). Then the calls deep
    in the context, the drafts' imports of the parent's cache (not the `siblings`': another network's cache
    cannot be imported, they prefill), and the agreement pass."""
    roles = [parent, *drafts]
    pctx = ctx_for(parent)
    deep_pos = deep_position(min(ctx_for(r).n_ctx for r in roles))
    far_pos = far_position(pctx.n_ctx, deep_pos)
    lengths = (PREFILL_TOKENS, deep_pos) if deep_pos else (PREFILL_TOKENS,)
    deep_ticks = (len(roles) if deep_pos else 0) + (1 if far_pos else 0)
    # ticks: prefill per role, rounds, deep calls per role and the far one, imports per length, parent answers,
    # agreement per draft
    tick = _ticker(progress, len(roles) + REPEATS + deep_ticks + len(lengths) + 1 + len(drafts))
    prompt = synthetic_prompt(pctx.model.n_vocab, max(PREFILL_TOKENS, deep_pos, far_pos))
    prefill = _time_prefill(ctx_for, roles, prompt[:PREFILL_TOKENS], tick)
    calls, steps_s, pairs, draft_calls = _time_rounds(ctx_for, parent, drafts, prompt[:PREFILL_TOKENS], tick)
    deep = {role: _time_deep(ctx_for(role), prompt[:deep_pos], tick, role,
                             DEEP_PARENT_SIZES if role == parent else DEEP_SIZES) for role in roles} if deep_pos else {}
    # the parent's context holds the deep prompt now: the far one prefills only what lies beyond it
    far = {parent: _time_deep(pctx, prompt[:far_pos], tick, parent, DEEP_PARENT_SIZES)} if far_pos else {}
    imports = _time_imports(ctx_for, parent, [r for r in drafts if r not in siblings], [prompt[:n] for n in lengths],
                            tick)
    agree, cycles = _agreement(ctx_for, parent, drafts, tick)
    return Calibration(calls, steps_s, prefill, agree, cycles, pairs,
                       measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       draft_call_s=draft_calls, deep_call_s=deep, deep_pos=deep_pos, far_call_s=far,
                       far_pos=far_pos, import_s=imports)


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


def far_position(n_ctx: int, deep_pos: int) -> int:
    """Where the parent's far calls are measured in its context of n_ctx positions: FAR_POS, or less where the
    context could not hold its longest deep call after it; 0 (not measured) when that is under FAR_MIN beyond
    `deep_pos`, or nothing was measured deep."""
    pos = min(FAR_POS, n_ctx - max(DEEP_PARENT_SIZES) - 8)
    return pos if deep_pos and pos >= deep_pos + FAR_MIN else 0


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
    long = [n for n in LONG_CALLS if n <= len(prompt) and len(prompt) + n <= pctx.n_ctx]
    calls = {n: float("inf") for n in [*range(1, MAX_BATCH + 1), *long]}
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
    return monotone(calls), steps_s, pairs, {role: monotone(c) for role, c in draft_calls.items()}


def _time_deep(ctx, prompt: list[int], tick, role: str, sizes=DEEP_SIZES) -> dict[int, float]:
    """Call size (of `sizes`, those the context has room for after `prompt`) -> seconds of a call after all of
    `prompt` (prefilled once, without logits), the fastest of DEEP_REPEATS, made monotone. The context is left holding
    `prompt`. One tick."""
    ctx.sync(prompt, logits="none")
    best = {n: float("inf") for n in sizes if len(prompt) + n <= ctx.n_ctx and n <= len(prompt)}
    for _ in range(DEEP_REPEATS):
        for n in best:
            ctx.rewind(len(prompt))
            best[n] = min(best[n], _timed(ctx, prompt[:n]))
    ctx.rewind(len(prompt))
    tick(f"{role} at position {len(prompt)}")
    return monotone(best)


def _time_imports(ctx_for, parent: str, drafts: list[str], prompts: list[list[int]],
                  tick) -> dict[str, dict[int, float]]:
    """Draft role -> positions -> seconds to export the parent's cache holding each prompt and import it into
    the draft's context (what ModelDrafter pays instead of a prefill), the fastest of DEEP_REPEATS. A role
    whose context refuses the parent's state at any length is left out. The longest prompt first (the
    parent holds it after the deep calls: no second prefill). Every context is reset after. One tick per
    prompt."""
    from specquant_cli.errors import LlamaError

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
