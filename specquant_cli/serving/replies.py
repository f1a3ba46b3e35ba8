"""The answers written back in OpenAI's format: a whole chat completion or completion (`chat_response`,
`completion_response`), the chunks of a stream (`ChunkMaker`), the usage object, and specquant's own account of the
answer (its plan, what the drafts achieved, its spans)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Optional

from specquant_cli.serving.schemas import GenerationParams

# -- responses ----------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def finish_reason(last) -> str:
    return last.finish_reason if last.finish_reason in ("stop", "length") else "stop"


def usage(last) -> dict:
    """OpenAI's usage object. completion_tokens are the answer's tokens; the prediction's tokens the parent verified
    and did not keep are counted apart (rejected_prediction_tokens), not in them: no one is billed here."""
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.new_tokens,
            "total_tokens": last.prompt_tokens + last.new_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens(last)},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                          "accepted_prediction_tokens": last.prediction_accepted,
                                          "rejected_prediction_tokens": last.prediction_rejected}}


def cached_tokens(last) -> int:
    """Prompt tokens the parent did not decode (it held them, or took them from another sequence or the prompt
    cache). The prompt's last token is always decoded, with the first step."""
    return max(0, last.prompt_tokens - 1 - last.prefill_tokens)


def plan_info(answer) -> dict:
    """How an answer was routed and planned (`why`: a planner's reason, empty for a fixed policy)."""
    return {"route": {"tier": answer.route.tier, "score": answer.route.score}, "policy": answer.plan.policy,
            "plan": answer.plan.describe(), "why": answer.plan.why, "lossy": answer.plan.lossy}


def running_info(rec) -> dict:
    """The figures so far, as of record `rec` (cumulative)."""
    return {
        "tokens": rec.new_tokens,
        "acceptance_rate": round(rec.acceptance_rate, 4),
        "mean_accepted_length": round(rec.mean_accepted_length, 4),  # new tokens per parent call
        "tokens_per_s": round(rec.tokens_per_s, 2),  # prefill included
        "decode_tokens_per_s": round(rec.decode_tokens_per_s, 2),  # after the parent's prefill
        "drafted": rec.drafted,
        "accepted": rec.accepted,
        "parent_calls": rec.parent_calls,
    }


def spans_info(rec) -> list[dict]:
    """Where a record's text came from, piece by piece: source "draft" (a model draft the parent accepted),
    "suffix" (a suffix / n-gram draft it accepted), "grammar" (a token the answer's grammar forced, proposed free and
    accepted) or "parent" (its own token: a correction or the bonus)."""
    return [{"text": text, "source": source} for text, source in rec.spans]


def specquant_info(answer, last) -> dict:
    """The `specquant` object of a response: how it was routed and planned, and how the speculation went."""
    return {**plan_info(answer), **running_info(last), "parent_prefill_s": round(last.parent_prefill_s, 4),
            "prefill_s": round(last.prefill_s, 4), "total_s": round(last.total_s, 4)}


def chat_response(rid: str, created: int, model: str, text: str, answer, last, params=None,
                  logprobs: Optional[list] = None) -> dict:
    """A whole chat answer; with `params` asking for tool calls, its calls (serving.structured.message); `logprobs`:
    its `logprobs.content` entries when asked."""
    from specquant_cli.serving.structured import message

    msg, finish = message(text, finish_reason(last), params)
    if logprobs is not None and msg["content"] != text:
        logprobs = []  # the answer was calls (or a cut one): their markup is not content, nor are its tokens
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": msg,
                         "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None,
                         "finish_reason": finish}],
            "usage": usage(last), "specquant": specquant_info(answer, last)}


def completion_response(rid: str, created: int, model: str, text: str, answer, last) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(last)}],
            "usage": usage(last), "specquant": specquant_info(answer, last)}


class ChunkMaker:
    """The chunks of one streamed answer, chat or completion, sharing id, created and model, to the request `params`.
    A chat answer read for tool calls streams its text as long as it opens no call (toolcalls.ToolStream); the calls
    of one that does go out once it has finished, each whole as a `tool_calls` delta, as serving.structured.outcome
    decides for the answer whole (a cut answer sends none, and no markup); `lp`: a function from the parent's
    TokenLogprob entries to `logprobs.content` (None: not asked)."""

    def __init__(self, chat: bool, model: str, include_usage: bool, params: Optional[GenerationParams] = None,
                 lp: Optional[Callable[[list], list]] = None):
        from specquant_cli.toolcalls import ToolStream

        self.chat = chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = now()
        self.model = model
        self.include_usage = include_usage
        self.params = params if chat else None
        self.tools = ToolStream() if params is not None and params.tool_calls and chat else None
        self._text: list[str] = []  # the answer so far
        self.lp = lp
        self._lps: list = []  # entries not yet sent (their text held back)
        self._planned = False  # a chunk carried the plan

    def _chunk(self, choices: list, **extra) -> dict:
        d = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
             "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            d["usage"] = None  # as OpenAI: null on every chunk but the last
        d.update(extra)
        return d

    def _logprobs(self) -> Optional[dict]:
        if self.lp is None:
            return None
        entries, self._lps = self._lps, []
        return {"content": self.lp(entries), "refusal": None}

    def _choice(self, text: Optional[str], finish: Optional[str], role: bool = False, calls=None) -> dict:
        if self.chat:
            delta = {} if not text and (text is None or calls) else {"content": text}
            if calls:
                delta["tool_calls"] = calls
            if role:
                delta = {"role": "assistant", **delta}
            return {"index": 0, "delta": delta, "logprobs": None if role else self._logprobs(),
                    "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def first(self, answer) -> Optional[dict]:
        """The role chunk that opens a chat stream, with the route and plan (completions have none)."""
        if not self.chat:
            return None
        self._planned = True
        return self._chunk([self._choice("", None, role=True)], specquant=plan_info(answer))

    def text(self, answer, rec) -> Optional[dict]:
        """A piece of text, with its spans and the running figures (and the plan, if no chunk had it yet); None
        while nothing can go out (text that may still open a tool call)."""
        self._lps += rec.logprobs
        self._text.append(rec.text)
        text = rec.text
        if self.tools is not None:  # calls wait for the answer's end (outcome)
            text = "".join(x for kind, x in self.tools.feed(rec.text) if kind == "text")
        if not text:
            return None
        info = {"spans": spans_info(rec), **running_info(rec)}
        if not self._planned:
            self._planned = True
            info.update(plan_info(answer))
        return self._chunk([self._choice(text, None)], specquant=info)

    def finish(self, answer, last) -> list[dict]:
        """The chunks that end the stream: the answer's calls, or text held back that never opened a call, then the
        finish reason (serving.structured.outcome of the whole answer)."""
        from specquant_cli.serving.structured import answer_outcome, tool_call

        out = []
        text = "".join(self._text)
        o = answer_outcome(text, finish_reason(last), self.params)
        finish = o.finish
        if o.content != text:
            self._lps = []  # held back with the markup of calls (or of a cut one), which is not content either
        if self.tools is not None:
            rest = self.tools.rest()
            if o.calls:
                out.append(self._chunk([self._choice(None, None, calls=[tool_call(i, c)
                                                                      for i, c in enumerate(o.calls)])]))
            elif (rest and o.content) or self._lps:
                out.append(self._chunk([self._choice(rest if o.content else "", None)]))
        out.append(self._chunk([self._choice(None if self.chat else "", finish)],
                               specquant=specquant_info(answer, last)))
        return out

    def usage(self, last) -> dict:
        d = self._chunk([])
        d["usage"] = usage(last)
        return d
