"""The seams of the decoding pipeline, written down once: what the engine drives and what plugs into it.

The engine talks to a `TokenContext` (a KV cache with a token record), a `Drafter` (proposes tokens), a
`Verifier` (scores a draft with the parent in one call) and a `GammaPolicy` (how many tokens to draft).
Real implementations: backend.llama.Context; decoding.drafters; decoding.verify; decoding.gamma.
The scripted test context implements the same protocol."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, Protocol, runtime_checkable

import numpy as np

from specquant_cli.names import LogitsMode


class TokenModel(Protocol):
    """What the engine needs of a model: its vocabulary size, end-of-generation ids and token bytes."""

    n_vocab: int

    @property
    def eog_ids(self) -> frozenset[int]: ...

    def piece(self, token: int) -> bytes: ...


@runtime_checkable
class TokenContext(Protocol):
    """A KV cache whose `tokens` list is, position by position, what it holds (sequence 0)."""

    model: TokenModel
    n_ctx: int
    tokens: list[int]

    @property
    def n_past(self) -> int: ...

    def decode(self, tokens: Sequence[int], logits: LogitsMode = "last") -> None: ...

    def logits(self, i: int = -1) -> np.ndarray: ...

    def rewind(self, n: int) -> None: ...

    def sync(self, tokens: Sequence[int], logits: LogitsMode = "last") -> int: ...
    def prefill(self, tokens: Sequence[int]) -> int: ...  # sync without logits, taking a computed prefix if any


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)


class Pending(list):
    """A sequence whose tail from `verified` on is not verified yet: a grammar's forced tokens and an earlier run
    of this cycle's draft, which a drafter drafts after (decoding.engine) but must not remember as the answer."""

    def __init__(self, seq: Sequence[int], tail: Sequence[int]):
        super().__init__(seq)
        self.extend(tail)
        self.verified = len(seq)


def verified(seq: Sequence[int]) -> Sequence[int]:
    """What of `seq` the parent has verified (all of it unless it is a `Pending`)."""
    n = getattr(seq, "verified", None)
    return seq if n is None else seq[:n]


@dataclass(frozen=True)
class CycleOutcome:
    """How one draft-and-verify cycle went; handed to the γ policy and to the drafter's feedback hook."""

    proposed: int  # draft length
    accepted: int  # drafted tokens the parent kept
    next_token: int  # the parent's own token after them (correction or bonus)
    draft_s: float
    verify_s: float
    scored: int  # tokens in the parent's call (proposed + 1 for a linear verifier)
    free: int = 0  # tokens a grammar forced that the parent kept (besides `accepted`; proposed at no draft cost)


@dataclass(frozen=True)
class Prepared:
    """What a drafter's preparation cost: its own prefill, or an import of the parent's KV cache."""

    prefill_s: float = 0.0
    import_s: float = 0.0
    imported: Optional[bool] = None  # None: nothing to prepare (draft-free); False: prefilled itself


class Drafter(Protocol):
    """Proposes up to n tokens to continue a sequence.

    `prepare` is called once per generation before the first cycle (a model drafter catches up on the
    prompt there); `n_ctx` is the drafter's own context limit (None: unlimited); `feedback` hears how
    each draft fared (as transformers' `update_candidate_strategy`); `source` says where its last proposal
    came from (names.Source: "draft" for a model, "suffix" for a draft-free drafter), read right after
    `propose`; `counters` are running totals the engine reports per answer (EngineStats.levels)."""

    name: str
    source: str

    @property
    def n_ctx(self) -> Optional[int]: ...

    def prepare(self, seq: Sequence[int]) -> Optional[Prepared]: ...

    def propose(self, seq: Sequence[int], n: int, sp, noise) -> Draft:
        """Up to n tokens after `seq`. A drafter that samples (sp not greedy) draws its i-th token with
        `noise.at(len(seq) + i, n_vocab)` (decoding.sampling.Noise), the noise the parent samples that position
        with."""
        ...

    def feedback(self, seq: Sequence[int], outcome: CycleOutcome) -> None: ...

    def offers(self, seq: Sequence[int]) -> bool:
        """Whether a copy is on offer after `seq` at no cost (a draft-free drafter's long match, or a copy in
        progress): asked each token while a rate guard rests, so that drafting starts again where the answer starts to
        repeat a source. Microseconds; no model call."""
        ...

    @property
    def counters(self) -> dict[str, float]:
        """Running totals of what drafting did beyond the engine's own counts (a second level's proposals and
        acceptances, the draft model's calls and seconds); the engine reports their change over an answer."""
        ...


class Level(Protocol):
    """The lower level of a two- or three-level draft (decoding.drafters.ModelDrafter's `lower`): after each token
    the draft model picks, it proposes what follows, and the model keeps the proposals it agrees with. A suffix
    drafter over the drafting memory (no model call) or a smaller sibling model (decoding.drafters.ModelLevel)."""

    def prepare(self, seq: Sequence[int]) -> None: ...

    def remember(self, seq: Sequence[int]) -> None:
        """The verified sequence so far (a suffix level writes it into its memory)."""
        ...

    def propose_after(self, seq: Sequence[int], out: list[int], room: int, sp, noise) -> list[int]:
        """Up to `room` tokens after seq + out (out: what the model above drafted so far this cycle)."""
        ...

    def feedback(self, seq: Sequence[int], outcome: CycleOutcome) -> None: ...

    @property
    def counters(self) -> dict[str, float]: ...


class Constraint(Protocol):
    """One answer's place in a grammar (decoding.grammar.Constraint): the parent's token at each position is chosen
    from `masked` logits and then `consume`d; a draft is cut after its `valid_prefix`; `forced` are the tokens
    the grammar allows alone from here (proposed at no draft cost)."""

    def masked(self, row: np.ndarray) -> np.ndarray: ...

    def consume(self, token: int) -> None: ...

    def valid_prefix(self, tokens: Sequence[int]) -> int: ...

    def forced(self, limit: int) -> list[int]: ...

    def fork(self) -> Constraint:
        """A copy at this place (to walk a draft with)."""
        ...

    def advance(self, tokens: Sequence[int]) -> None: ...


class Verifier(Protocol):
    """Scores seq[-1] + draft in one parent call and decides what is kept. Afterwards the parent's cache
    holds seq[:-1] + seq[-1] + the accepted draft tokens (the next token is not yet decoded)."""

    def verify(self, parent: TokenContext, seq: Sequence[int], draft: Draft) -> tuple[int, int]:
        """(accepted count, next token)."""
        ...


class GammaPolicy(Protocol):
    """Draft length: `draft_length()` is pure; every state change happens in `update`."""

    def draft_length(self) -> int: ...

    def update(self, outcome: CycleOutcome) -> None: ...
