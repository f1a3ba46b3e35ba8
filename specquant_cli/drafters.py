"""Drafters: context in, up to n proposed tokens out (with the draft's distributions when a model sampled).

Every drafter has the same narrow protocol, so the engine cannot tell an n-gram lookup from a model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import numpy as np

from specquant_cli.llama import Context
from specquant_cli.sampling import SamplingParams, greedy_token, probs, sample


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    # One distribution per token when a model *sampled* the draft; None for greedy or deterministic drafts
    # (the verifier then treats each token as proposed with probability 1).
    q: Optional[list[np.ndarray]] = None


class Drafter(Protocol):
    name: str

    def prepare(self, seq: Sequence[int]) -> None:
        """Catch up on the prompt before the first cycle (a model drafter's prefill)."""

    def propose(self, seq: Sequence[int], n: int, sp: SamplingParams, rng: np.random.Generator) -> Draft: ...


class NGramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n-gram (longest n first)
    in prompt + output so far, and propose what followed it. Costs no model call."""

    name = "ngram"

    def __init__(self, ngram_sizes: Sequence[int] = (4, 3, 2), min_tokens: int = 1):
        self.sizes = sorted(set(int(n) for n in ngram_sizes), reverse=True)
        self.min_tokens = min_tokens

    def prepare(self, seq: Sequence[int]) -> None:
        pass

    def propose(self, seq: Sequence[int], n: int, sp: SamplingParams = None, rng=None) -> Draft:
        if n <= 0:
            return Draft()
        arr = np.asarray(seq, dtype=np.int64)
        for size in self.sizes:
            if len(arr) <= size:
                continue
            tail = arr[-size:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], size)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            hits = hits[hits + size < len(arr)]
            if len(hits):
                start = int(hits[-1]) + size
                tokens = arr[start:start + n].tolist()
                if len(tokens) >= self.min_tokens:
                    return Draft(tokens)
        return Draft()


class ModelDrafter:
    """A quantized variant drafts with its own context, kept in step with the sequence by prefix reuse.

    With `p_min`, drafting stops as soon as the draft's top probability falls below it. With `window`, the
    draft reads only the last `window` tokens of the prompt (plus everything generated since): its prefill
    of a long prompt, pure overhead, is bounded, while the parent still verifies with the full context."""

    def __init__(self, ctx: Context, name: str = "model", p_min: Optional[float] = None,
                 stop_ids: frozenset[int] = frozenset(), window: Optional[int] = None):
        self.ctx = ctx
        self.name = name
        self.p_min = p_min
        self.stop_ids = stop_ids or ctx.model.eog_ids
        self.window = window
        self.start = 0  # first token of the sequence the draft context holds

    def prepare(self, seq: Sequence[int]) -> None:
        self.start = max(0, len(seq) - self.window) if self.window else 0
        self.ctx.sync(seq[self.start:])

    def propose(self, seq: Sequence[int], n: int, sp: SamplingParams, rng: np.random.Generator) -> Draft:
        if n <= 0:
            return Draft()
        ctx = self.ctx
        if self.start >= len(seq):  # a new, shorter sequence without prepare()
            self.start = 0
        ctx.sync(seq[self.start:])
        out, qs = [], []
        for i in range(n):
            row = ctx.logits(-1)
            if sp.greedy:
                t = greedy_token(row)
                if self.p_min is not None and _top_prob(row, t) < self.p_min:
                    break
            else:
                q = probs(row, sp)
                t = sample(q, rng)
                if self.p_min is not None and float(q.max()) < self.p_min:
                    break
                qs.append(q)
            out.append(t)
            if t in self.stop_ids or i == n - 1:
                break  # the last drafted token is decoded lazily, by the next sync, only if it is kept
            ctx.decode([t], logits="last")
        return Draft(out, qs if not sp.greedy else None)


def _top_prob(row: np.ndarray, top: int) -> float:
    return float(1.0 / np.exp(row - row[top]).sum())


class FallbackDrafter:
    """Free n-gram drafts when the context offers them, the model's drafts otherwise.

    The model drafter wakes up only once the answer is `activate_after` tokens long: its prefill costs
    ~2/3 of the parent's per token on a CPU, more than short answers can win back, so a short answer never
    pays it and a long one pays it once (bounded by the drafter's window)."""

    def __init__(self, first: NGramDrafter, then: ModelDrafter, min_tokens: int = 2, activate_after: int = 32):
        self.first, self.then = first, then
        self.min_tokens = min_tokens
        self.activate_after = activate_after
        self.name = f"{first.name}+{then.name}"
        self.ctx = then.ctx
        self._prompt_len = 0
        self._active = False

    def prepare(self, seq: Sequence[int]) -> None:
        self._prompt_len = len(seq)
        self._active = False

    def propose(self, seq: Sequence[int], n: int, sp: SamplingParams, rng: np.random.Generator) -> Draft:
        d = self.first.propose(seq, n, sp, rng)
        if len(d.tokens) >= min(self.min_tokens, n) or len(seq) - self._prompt_len < self.activate_after:
            return d
        if not self._active:
            self.then.prepare(seq)
            self._active = True
        return self.then.propose(seq, n, sp, rng)
