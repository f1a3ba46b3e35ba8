"""The proof behind `identical_rate`: every greedy divergence from the parent, explained or flagged.

A lossless policy must give the parent's own greedy tokens. The one honest way it can differ: the parent
scores a verification batch with slightly different floating-point results than one token at a time, and at
a near-tie (top-2 logits almost equal) the argmax flips. So for each divergence the first differing position
is re-scored by the parent alone, one token at a time, exactly as the `parent` policy decodes, and compared
with the batch-vs-single noise measured on this machine. A flip inside the noise between the parent's own
top two tokens is a `near-tie`; anything else is `unexplained`, which is a bug until shown otherwise. In the
deterministic mode (backend.context) there is no such noise: every divergence is unexplained."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from specquant_cli.backend.llama import Context
from specquant_cli.errors import InputError

IDENTICAL, NEAR_TIE, UNEXPLAINED = "identical", "near-tie", "unexplained"
NOT_JUDGED = "not judged"  # a request the parent alone cannot answer as the server must (a forced tool call)

# Why 2x: the probe sees a few dozen positions and batch shapes; the bench's verification batches meet other
# positions, prompts and KV contents whose rounding can exceed the largest difference the probe happened to
# see. Twice the observed maximum covers that tail, and stays far below the margin of a real disagreement
# (a parent that is sure of its token leads by whole logits, not hundredths).
NOISE_SAFETY_FACTOR = 2.0
# Plain text (no chat template, whose boilerplate is the same few tokens everywhere), prose, code and facts.
NOISE_TEXTS = (
    "The quick brown fox jumps over the lazy dog while the old farmer watches from the red barn, counting "
    "the sheep that wander back across the hill as the sun goes down behind the trees.",
    "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n\n\nfor i in range(10):\n"
    "    print(i, add(i, i * 2))  # prints each number beside three times itself\n",
    "Paris is the capital of France, Berlin is the capital of Germany, Madrid is the capital of Spain, and "
    "the capital of Italy is Rome, a city founded, the legend says, by two brothers raised by a wolf.",
)
NOISE_TOKENS = 24  # per probe sequence: the first NOISE_PREFIX are a prompt, the rest are compared row by row
NOISE_PREFIX = 4
NOISE_PERCENTILE = 99


@dataclass(frozen=True)
class Noise:
    """How far the parent's batched logits stray from its one-token-at-a-time logits on this machine."""

    max_margin_diff: float  # max |top1 - top2 margin, single step - same two tokens, batched|
    p99_margin_diff: float
    max_logit_diff: float  # max |single - batched| over every logit (common shifts included)
    rows: int  # logits rows compared: sequences x positions x batch shapes
    batch_sizes: tuple[int, ...]  # 0 = the whole sequence in one batch
    safety_factor: float = NOISE_SAFETY_FACTOR

    @property
    def bound(self) -> float:
        """The largest single-step margin a batch could flip: a smaller margin between the top two is a near-tie."""
        return self.safety_factor * self.max_margin_diff

    def to_dict(self) -> dict:
        return {"max_margin_diff": self.max_margin_diff, "p99_margin_diff": self.p99_margin_diff,
                "max_logit_diff": self.max_logit_diff, "rows": self.rows,
                "batch_sizes": list(self.batch_sizes), "safety_factor": self.safety_factor, "bound": self.bound}


def top2(row: np.ndarray) -> tuple[int, int, float]:
    """(top-1 token, top-2 token, top-1 logit - top-2 logit); ties go to the lower id, as np.argmax does."""
    t1 = int(np.argmax(row))
    rest = np.array(row, dtype=np.float64)
    rest[t1] = -np.inf
    t2 = int(np.argmax(rest))
    return t1, t2, float(row[t1]) - float(row[t2])


def one_at_a_time(ctx: Context, prompt: Sequence[int], tokens: Sequence[int]) -> Iterator[np.ndarray]:
    """From an empty cache: `prompt` in one batch without logits, then each of `tokens` in its own decode,
    yielding its logits row (a view, valid until the next step). With prompt[:-1] and [prompt[-1]] + answer
    this is exactly how the `parent` policy decodes (engine prefill, then one token per parent call)."""
    ctx.reset()
    ctx.decode(list(prompt), logits="none")
    for t in tokens:
        ctx.decode([t], logits="last")
        yield ctx.logits(-1)


def in_batches(ctx: Context, prompt: Sequence[int], tokens: Sequence[int], size: int) -> Iterator[np.ndarray]:
    """Like `one_at_a_time`, but `tokens` go in batches of `size` (0: all at once) with a row per token, as a
    verifier scores seq[-1] + draft."""
    ctx.reset()
    ctx.decode(list(prompt), logits="none")
    size = size or len(tokens)
    for start in range(0, len(tokens), size):
        chunk = list(tokens[start:start + size])
        ctx.decode(chunk, logits="all")
        for j in range(len(chunk)):
            yield ctx.logits(j)


def verify_batch_sizes(gamma: int, gamma_max: int) -> tuple[int, ...]:
    """The verifier's batch sizes worth probing: one drafted token, the fixed γ, the adaptive longest, and the
    whole sequence at once (0). Batches of two or more share llama.cpp's batched kernels, so a few suffice."""
    return tuple(sorted({2, gamma + 1, max(gamma_max, gamma) + 1})) + (0,)


def measure_noise(ctx: Context, gamma: int, gamma_max: int,
                  sequences: Optional[Sequence[Sequence[int]]] = None) -> Noise:
    """Decode each probe sequence one token at a time and in verifier-sized batches; compare row by row. The probes
    are NOISE_TEXTS tokenized, or `sequences` of token ids (a model without a real tokenizer)."""
    sizes = verify_batch_sizes(gamma, gamma_max)
    margins: list[float] = []
    logit_max = 0.0
    probes = sequences if sequences is not None else [ctx.model.tokenize(text, add_bos=ctx.model.add_bos())
                                                      for text in NOISE_TEXTS]
    for probe in probes:
        seq = list(probe)[:NOISE_TOKENS]
        prompt, rest = seq[:NOISE_PREFIX], seq[NOISE_PREFIX:]
        single = [np.array(r, dtype=np.float64) for r in one_at_a_time(ctx, prompt, rest)]
        for size in sizes:
            for s, b in zip(single, in_batches(ctx, prompt, rest, size)):
                t1, t2, m = top2(s)
                margins.append(abs(m - (float(b[t1]) - float(b[t2]))))
                logit_max = max(logit_max, float(np.max(np.abs(s - b))))
    ctx.reset()
    return Noise(max(margins), float(np.percentile(margins, NOISE_PERCENTILE)), logit_max, len(margins), sizes)


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """First position where the token lists differ (a shorter list differs where it ends); None when equal."""
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def rescore(ctx: Context, prompt: Sequence[int], prefix: Sequence[int], grammar=None) -> np.ndarray:
    """The parent's logits after `prompt` + `prefix`, decoded as the `parent` policy decodes (a copy); with
    `grammar` (decoding.grammar.Grammar), those it forbids after `prefix` at -inf, as the constrained parent sees
    them."""
    last = None
    for row in one_at_a_time(ctx, prompt[:-1], [prompt[-1], *prefix]):
        last = row  # a view; only the final one is kept, and copied before the cache is emptied
    out = np.array(last, dtype=np.float64)
    ctx.reset()
    if grammar is not None:
        from specquant_cli.decoding.grammar import Constraint

        c = Constraint(grammar, ctx.model)
        for t in prefix:
            c.consume(t)
        out = c.masked(out)
    return out


def classify(ctx: Context, prompt: Sequence[int], parent: Sequence[int], other: Sequence[int],
             bound: float, grammar=None) -> dict:
    """Verdict on `other` (a lossless policy's greedy answer) against `parent` (the parent's own): identical,
    a near-tie the noise `bound` can flip between the parent's top two tokens (of those `grammar` allows), or
    unexplained."""
    k = first_difference(parent, other)
    if k is None:
        return {"verdict": IDENTICAL}
    ours = parent[k] if k < len(parent) else None
    theirs = other[k] if k < len(other) else None
    t1, t2, margin = top2(rescore(ctx, prompt, parent[:k], grammar))
    pair = {ours, theirs} == {t1, t2}
    return {"position": k, "parent_token": ours, "policy_token": theirs, "top1": t1, "top2": t2,
            "margin": round(margin, 6), "single_step_pick": "parent" if t1 == ours else "policy" if t1 == theirs
            else "neither", "top2_pair": pair, **_verdict(ctx, pair and margin <= bound)}


def text_divergence(model, parent: Sequence[int], text: str) -> tuple[Optional[int], bytes]:
    """(first parent token whose piece `text` does not continue with, the rest of `text` from there);
    (None, b"") when `text` is the parent's answer."""
    raw, done = text.encode("utf-8"), 0
    for k, t in enumerate(parent):
        piece = model.piece(t)
        if piece and raw.startswith(piece, done):
            done += len(piece)
        elif piece or done < len(raw):  # an empty piece (end of generation) is a difference only if text goes on
            return k, raw[done:]
    return (None, b"") if done == len(raw) else (len(parent), raw[done:])


def classify_text(ctx: Context, prompt: Sequence[int], parent: Sequence[int], text: str, bound: float) -> dict:
    """As `classify`, for an answer known only as text (what an HTTP client gets): where the text leaves the
    parent's answer, the answer's own token is taken to be whichever of the parent's top two it continues
    with (the other one); a text that continues with neither is unexplained. The text may have left the
    parent's tokens a little before it leaves their text — a longer token that starts with the parent's (" travels"
    where the parent wrote " travel", then " plans"): then the TEXT_LOOKBACK tokens before are tried too, the
    latest one first, where the answer's token is one of the top two that the text goes on with."""
    k, _ = text_divergence(ctx.model, parent, text)
    if k is None:
        return {"verdict": IDENTICAL}
    raw, starts = text.encode("utf-8"), [0]
    for t in parent[:k]:
        starts.append(starts[-1] + len(ctx.model.piece(t)))
    first = None
    for j in range(k, max(-1, k - 1 - TEXT_LOOKBACK), -1):
        verdict = _classify_at(ctx, prompt, parent, j, raw[starts[j]:], bound)
        if verdict["verdict"] == NEAR_TIE:
            return verdict
        first = first or verdict
    return first


def _forced(r) -> bool:
    """Whether a replayed request's tool_choice forces a call (required, or a named function)."""
    from specquant_cli.decoding.forms import TOOL_CHOICES

    return r.fields.get("tool_choice") not in (None, *TOOL_CHOICES[:2])  # none and auto leave the model free


def _same_calls(model, parent: Sequence[int], text: str) -> bool:
    """Whether `text` (a client's answer: its tool calls as the server parsed them, written back by
    bench.answer) holds the very calls the parent's tokens write, however the parent spaced their JSON."""
    from specquant_cli import toolcalls

    raw = b"".join(model.piece(t) for t in parent).decode("utf-8", "replace")
    return toolcalls.is_calls(raw) and toolcalls.rewritten(raw) == text


TEXT_LOOKBACK = 3  # tokens before the text's own divergence where the answer's token may have parted


def _classify_at(ctx: Context, prompt: Sequence[int], parent: Sequence[int], k: int, rest: bytes,
                 bound: float) -> dict:
    ours = parent[k] if k < len(parent) else None
    t1, t2, margin = top2(rescore(ctx, prompt, parent[:k]))
    other = next((t for t in (t1, t2) if t != ours and ctx.model.piece(t) and rest.startswith(ctx.model.piece(t))),
                 None)
    pair = other is not None and ours in (t1, t2)
    return {"position": k, "parent_token": ours, "policy_token": other, "top1": t1, "top2": t2,
            "margin": round(margin, 6), "top2_pair": pair, **_verdict(ctx, pair and margin <= bound)}


def _verdict(ctx: Context, tie: bool) -> dict:
    """A divergence's verdict: a near-tie where the batch-vs-single noise can flip it; in the deterministic mode
    (`ctx.uniform`: every row computed alike whatever the call) there is no such noise, and any divergence is a
    failure, unexplained."""
    if ctx.uniform:
        return {"verdict": UNEXPLAINED, "mode": "deterministic"}
    return {"verdict": NEAR_TIE if tie else UNEXPLAINED}


def judge_text(ctx: Context, prompt: Sequence[int], text: str, max_tokens: int, bound: float) -> dict:
    """A served answer (`text`) against the parent's own greedy answer to `prompt`, decoded now in `ctx` from
    nothing, one token per call (as the parent policy decodes): classify_text's verdict."""
    return classify_text(ctx, prompt, parent_answer(ctx, prompt, max_tokens), text, bound)


def parent_answer(ctx: Context, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """The parent's own greedy answer to `prompt`, decoded in `ctx` from nothing, one token per call."""
    from specquant_cli.decoding.engine import Engine
    from specquant_cli.decoding.stream import generate_text

    ctx.reset()
    return generate_text(Engine(ctx), prompt, max_tokens)[1]


def check(ctx: Context, records: Sequence, prompts: dict[str, list[int]], gamma: int, gamma_max: int,
          grammars: Optional[dict] = None) -> dict:
    """Measure the noise, then set `fidelity` on every greedy lossless record with a parent answer to compare
    with (the parent's own records are identical by definition); the report's `fidelity` object. `grammars`: item
    -> the grammar its answers were held to."""
    noise = measure_noise(ctx, gamma, gamma_max)
    reference = {r.item: r.tokens for r in records if r.policy == "parent"}
    divergences = []
    for r in records:
        if r.lossy or r.identical is None or r.item not in reference:
            continue
        verdict = classify(ctx, prompts[r.item], reference[r.item], r.tokens, noise.bound,
                           (grammars or {}).get(r.item))
        r.fidelity = verdict["verdict"]
        if r.fidelity != IDENTICAL:
            divergences.append({"item": r.item, "policy": r.policy, **verdict})
    return {"noise": noise.to_dict(), "divergences": divergences}


def warning(fidelity: Optional[dict]) -> Optional[str]:
    """One line naming every unexplained divergence, or None when there is none."""
    bad = [d for d in (fidelity or {}).get("divergences", []) if d["verdict"] == UNEXPLAINED]
    if not bad:
        return None
    where = ", ".join(f"{d['item']} ({d['policy']}, token {d['position']}, margin {d['margin']:.3g})" for d in bad)
    return (f"warning: {len(bad)} unexplained divergence{'s' if len(bad) > 1 else ''} from the parent's greedy "
            f"output: {where}")


# -- a load's answers, known as text --------------------------------------------------------------------------

class ParentAnswers:
    """The parent alone, for judging: its context, the batch-vs-single noise (measured once) and its answer to
    every prompt asked so far (a side by side asks each server the same conversations: a prompt that recurs,
    because the servers' earlier answers were the same, is answered once)."""

    def __init__(self, runtime, max_tokens: int):
        from specquant_cli.decoding.gamma import GAMMA_MAX
        from specquant_cli.family.roles import PARENT_ROLE

        self.ctx = runtime.pool.context(PARENT_ROLE)
        self.max_tokens = max_tokens
        self.noise = measure_noise(self.ctx, runtime.costs.gamma, GAMMA_MAX)
        self._answers: dict[tuple[int, ...], list[int]] = {}

    def answer(self, prompt: Sequence[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self._answers:
            self._answers[key] = parent_answer(self.ctx, prompt, self.max_tokens)
        return self._answers[key]


def judge(results: Sequence, parent: ParentAnswers,
          progress: Optional[Callable[[int, int], None]] = None) -> dict:
    """After a load (bench.load): the parent alone answers each succeeded request's exact messages (one token per
    call, as the `parent` policy decodes), and each served answer (a bench.answer.RequestResult) is classified
    against it (classify_text: identical, near-tie within the measured batch-vs-single noise, or unexplained). Sets
    each result's `fidelity`; returns the counts, the noise and the divergences."""
    ctx, noise, max_tokens = parent.ctx, parent.noise, parent.max_tokens
    counts = {IDENTICAL: 0, NEAR_TIE: 0, UNEXPLAINED: 0}
    divergences = []
    todo = [r for r in results if r.ok and not _forced(r)]
    for r in results:
        if r.ok and _forced(r):
            r.fidelity = {"verdict": NOT_JUDGED, "why": "its tool_choice forces a tool call (a grammar the server "
                                                        "holds the answer to; the parent alone here is free)"}
    for i, r in enumerate(todo, 1):
        tools = r.fields.get("tools")  # a replayed request's tools are part of its prompt
        prompt = ctx.model.chat_prompt(r.messages, tools)
        if len(prompt) + max_tokens > ctx.n_ctx:
            raise InputError(f"conversation {r.conversation} turn {r.turn}: {len(prompt)} prompt tokens and "
                             f"{max_tokens} new ones do not fit the parent's --ctx {ctx.n_ctx}; raise --ctx")
        answer = parent.answer(prompt)
        verdict = classify_text(ctx, prompt, answer, r.text, noise.bound)
        if verdict["verdict"] != IDENTICAL and tools and _same_calls(ctx.model, answer, r.text):
            verdict = {"verdict": IDENTICAL}
        r.fidelity = verdict
        counts[verdict["verdict"]] += 1
        if verdict["verdict"] != IDENTICAL:
            divergences.append({"conversation": r.conversation, "turn": r.turn, **verdict})
        if progress:
            progress(i, len(todo))
    ctx.reset()
    return {"judged": len(todo), "not_judged": sum(1 for r in results if r.ok and _forced(r)),
            "identical": counts[IDENTICAL], "near_tie": counts[NEAR_TIE],
            "unexplained": counts[UNEXPLAINED], "noise": noise.to_dict(), "divergences": divergences,
            **({"exact": True} if ctx.uniform else {})}


def shown(counts: dict) -> list[tuple[str, int]]:
    """Verdict counts as reports show them: identical, near-tie, unexplained; judged in the deterministic mode
    (`exact`), identical and differing only, since a near-tie is no excuse there."""
    if counts.get("exact"):
        return [("identical", counts["identical"]), ("differing", counts["near_tie"] + counts["unexplained"])]
    return [("identical", counts["identical"]), ("near-tie", counts["near_tie"]),
            ("unexplained", counts["unexplained"])]


def header(exact: bool) -> str:
    """The verdicts column's header (`shown`'s counts)."""
    return "ident/differ" if exact else "ident/tie/unexpl"


def cell(counts: Optional[dict]) -> str:
    return "–" if counts is None else "/".join(str(n) for _, n in shown(counts))
