"""Scripted-logits stand-ins for llama.cpp contexts: the only fakes, used for the accept/reject math.

FakeContext implements the same `TokenContext` protocol as the real adapter and inherits its prefix logic
(`backend.llama.PrefixCache`), so the tests exercise the real `sync` / `common_prefix`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from specquant_cli.backend.llama import PrefixCache
from specquant_cli.decoding.drafters import DrafterBase
from specquant_cli.decoding.protocols import Draft


class FakeModel:
    def __init__(self, n_vocab: int, eog: int):
        self.n_vocab = n_vocab
        self.eog_ids = frozenset({eog})

    def piece(self, token: int) -> bytes:
        return f"<{token}>".encode()


class FakeContext(PrefixCache):
    """logits_fn(tokens so far) -> logits row. Tracks tokens exactly like the real adapter."""

    def __init__(self, model: FakeModel, logits_fn: Callable[[Sequence[int]], np.ndarray], n_ctx: int = 512):
        self.model = model
        self.fn = logits_fn
        self.n_ctx = n_ctx
        self.tokens: list[int] = []
        self._rows: list[np.ndarray] = []
        self.decode_calls = 0

    def decode(self, tokens, logits="last"):
        if not len(tokens):
            return
        self.decode_calls += 1
        rows = []
        for t in tokens:
            self.tokens.append(t)
            rows.append(np.asarray(self.fn(self.tokens), dtype=np.float32))
        self._rows = rows

    def logits(self, i=-1):
        return self._rows[i]

    def rewind(self, n):
        del self.tokens[n:]


def peaked(token: int, n_vocab: int, height: float = 10.0) -> np.ndarray:
    row = np.zeros(n_vocab, dtype=np.float32)
    row[token] = height
    return row


class ScriptedDrafter(DrafterBase):
    """Proposes fixed token lists, one per call (then nothing); records the feedback it hears."""

    name = "scripted"

    source = "draft"

    def __init__(self, proposals: list[list[int]]):
        self.proposals = list(proposals)
        self.calls = 0
        self.outcomes = []

    def propose(self, seq, n, sp=None, noise=None):
        self.calls += 1
        toks = self.proposals.pop(0) if self.proposals else []
        return Draft(list(toks[:n]))

    def feedback(self, seq, outcome):
        self.outcomes.append(outcome)
