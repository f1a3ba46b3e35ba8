"""Token events -> response records with text and cumulative stats. The last record is the summary.

Each record also says where its text came from: `spans`, (text, source) pieces that concatenate to `text`, one
per token (cut where a stop string or a held-back tail splits a token's text). The source is the token's
(names.Source). Limit: the bytes of a character split across tokens are credited to the token that completes it."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from difflib import SequenceMatcher
from typing import Optional

from specquant_cli.backend.llama import Detokenizer
from specquant_cli.decoding.engine import Engine
from specquant_cli.names import FinishReason, Source

STAT_FIELDS = ("prompt_tokens", "prefill_tokens", "new_tokens", "drafted", "accepted", "acceptance_rate",
               "mean_accepted_length", "parent_calls", "prefill_s", "parent_prefill_s", "draft_prefill_s",
               "kv_import_s", "kv_import",
               "draft_s", "verify_s", "total_s", "tokens_per_s", "decode_tokens_per_s", "finish_reason", "levels",
               "guard_stop", "guard_reopened", "forced", "forced_accepted", "prediction_accepted",
               "prediction_rejected")


Span = tuple[str, Source]  # (text, where it came from)


@dataclass
class Response:
    text: str  # the text this record adds
    token: Optional[int]
    from_draft: bool
    prompt_tokens: int
    prefill_tokens: int  # prompt tokens the parent decoded (the rest it held, or took: runtime.prefixes)
    new_tokens: int
    drafted: int
    accepted: int
    acceptance_rate: float  # accepted / drafted
    mean_accepted_length: float  # new tokens per parent call
    parent_calls: int
    prefill_s: float  # the parent's prefill + the drafter's preparation
    parent_prefill_s: float
    draft_prefill_s: float
    kv_import_s: float
    kv_import: Optional[bool]  # the model drafter imported the parent's KV cache (None: no model drafter)
    draft_s: float
    verify_s: float
    total_s: float
    tokens_per_s: float  # new tokens / total_s (prefill included)
    decode_tokens_per_s: float  # new tokens / the time after the parent's own prefill
    finish_reason: Optional[FinishReason] = None  # on the last record
    spans: list[Span] = field(default_factory=list)  # `text` piece by piece, with each piece's source
    levels: dict = field(default_factory=dict)  # the drafter's counters over the answer (EngineStats.levels)
    guard_stop: Optional[int] = None  # tokens into the answer when its rate guard first stopped drafting
    guard_reopened: int = 0  # times it drafted again where the answer repeated a source
    forced: int = 0  # tokens a grammar forced, proposed at no draft cost
    forced_accepted: int = 0  # of those, the parent's own picks
    # on the last record: the request's prediction tokens that appear in the answer (OpenAI's accepted prediction
    # tokens), and the rest of the prediction (its rejected ones)
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    logprobs: list = field(default_factory=list)  # the parent's TokenLogprob of this record's token, when asked

    def stats(self) -> dict:
        d = asdict(self)
        return {k: d[k] for k in STAT_FIELDS}


def appeared(prediction: Sequence[int], answer: Sequence[int]) -> int:
    """The tokens of `prediction` that appear in `answer`, in order (the matching blocks of the two token sequences):
    OpenAI's accepted prediction tokens, the rest of the prediction its rejected ones. A function of the prediction and
    the answer alone, so of the request (whichever drafter proposed the text, whatever an earlier request left in the
    drafting memory)."""
    if not prediction or not answer:
        return 0
    blocks = SequenceMatcher(None, list(prediction), list(answer), autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks)


def _record(engine: Engine, t0: float, text: str, token, from_draft: bool, finish=None,
            spans: Sequence[Span] = (), logprob=None, answer: Optional[Sequence[int]] = None) -> Response:
    """A record of `engine`'s answer so far; the last (`answer`: the tokens handed out) counts the prediction's."""
    s = engine.stats
    predicted = engine.prediction
    accepted = appeared(predicted, answer) if predicted and answer is not None else 0
    total = time.perf_counter() - t0
    decode = total - s.parent_prefill_s
    return Response(
        text=text, token=token, from_draft=from_draft, prompt_tokens=s.prompt_tokens,
        prefill_tokens=s.prefill_tokens, new_tokens=s.new_tokens,
        drafted=s.drafted, accepted=s.accepted, acceptance_rate=s.accepted / s.drafted if s.drafted else 0.0,
        mean_accepted_length=s.new_tokens / s.parent_calls if s.parent_calls else 0.0,
        parent_calls=s.parent_calls, prefill_s=s.prefill_s, parent_prefill_s=s.parent_prefill_s,
        draft_prefill_s=s.draft_prefill_s, kv_import_s=s.kv_import_s, kv_import=s.kv_import, draft_s=s.draft_s,
        verify_s=s.verify_s, total_s=total, tokens_per_s=s.new_tokens / total if total > 0 else 0.0,
        decode_tokens_per_s=s.new_tokens / decode if decode > 0 else 0.0, finish_reason=finish, spans=list(spans),
        levels=dict(s.levels), guard_stop=s.guard_stop, guard_reopened=s.guard_reopened, forced=s.forced,
        forced_accepted=s.forced_accepted,
        prediction_accepted=accepted, prediction_rejected=len(predicted) - accepted if predicted else 0,
        logprobs=[logprob] if logprob is not None else [])


def _split(spans: Sequence[Span], n: int) -> tuple[list[Span], list[Span]]:
    """The first `n` characters of `spans`, and the rest (the span where n falls is cut in two)."""
    head, tail = [], []
    for text, src in spans:
        if n >= len(text):
            head.append((text, src))
        elif n > 0:
            head.append((text[:n], src))
            tail.append((text[n:], src))
        else:
            tail.append((text, src))
        n = max(0, n - len(text))
    return head, tail


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                best = max(best, k)
                break
    return best


def stream_generate(engine: Engine, prompt: Sequence[int], max_tokens: int,
                    stop: Sequence[str] = ()) -> Iterator[Response]:
    """Yield a record per piece of text; the final record carries finish_reason and the summary stats."""
    t0 = time.perf_counter()
    detok = Detokenizer(engine.parent.model)
    stops = [s for s in stop if s]
    pending, spans, source = "", [], "parent"  # text not yet emitted, its spans, the last token's source
    finish: FinishReason = "length"
    events = engine.generate(prompt, max_tokens)
    answer: list[int] = []  # the tokens handed out (completion_tokens)
    try:
        for ev in events:
            if ev.eog:
                finish = "stop"
                break
            answer.append(ev.token)
            piece, source = detok.add(ev.token), ev.source
            pending += piece
            spans += [(piece, source)] if piece else []
            hit = min((i for i in (pending.find(s) for s in stops) if i >= 0), default=-1)
            if hit >= 0:
                yield _record(engine, t0, pending[:hit], ev.token, ev.from_draft, spans=_split(spans, hit)[0],
                              logprob=ev.logprob)
                pending, spans, finish = "", [], "stop"
                break
            n = len(pending) - _held_back(pending, stops)
            (emit, pending), (head, spans) = (pending[:n], pending[n:]), _split(spans, n)
            yield _record(engine, t0, emit, ev.token, ev.from_draft, spans=head, logprob=ev.logprob)
        tail = detok.flush() if finish != "stop" else ""
        pending += tail
        spans += [(tail, source)] if tail else []
    except KeyboardInterrupt:
        finish = "interrupted"
    finally:
        events.close()
    yield _record(engine, t0, pending, None, False, finish, spans, answer=answer)


def generate_text(engine: Engine, prompt: Sequence[int], max_tokens: int, stop: Sequence[str] = ()):
    """(full text, token ids, last record) — a convenience over stream_generate."""
    parts, tokens, last = [], [], None
    for r in stream_generate(engine, prompt, max_tokens, stop):
        parts.append(r.text)
        if r.token is not None:
            tokens.append(r.token)
        last = r
    return "".join(parts), tokens, last
