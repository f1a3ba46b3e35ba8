"""Structured output on the server: a chat request's `response_format`, `tools` and `tool_choice` (read by
decoding.forms into the grammar the engine runs), its history's tool calls and tool results, and `logprobs`; and the
answer written back in OpenAI's shape (`tool_calls`, `finish_reason: tool_calls`, `logprobs.content`).

Every refusal is a decoding.forms.FormError naming the field (serving.schemas answers it 400): a schema
llguidance cannot compile, an unknown `tool_choice` function, a tool whose parameters are not a schema, a schema over
decoding.grammar.MAX_SCHEMA_BYTES."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Optional

from specquant_cli import toolcalls
from specquant_cli.decoding import forms
from specquant_cli.decoding.grammar import Grammar

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass
class Structure:
    """What a chat request asks of its answer's form, and whether it wants log-probabilities."""

    grammar: Optional[Grammar] = None
    tools: Optional[list[dict]] = None
    calls: bool = False
    top_logprobs: Optional[int] = None  # None: no logprobs


def _error(message: str, param: str) -> forms.FormError:
    return forms.FormError(message, param)


def structure(req, model) -> Structure:
    """The form `req` (a ChatRequest) asks of its answer, each part checked against the model's vocabulary."""
    form = forms.read(req.response_format, req.tools, req.tool_choice,
                      (req.model_extra or {}).get("parallel_tool_calls"), model)
    out = Structure(form.grammar, form.tools, form.calls)
    if req.logprobs:
        k = req.top_logprobs or 0
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise _error(f"top_logprobs is an integer from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
        out.top_logprobs = k
    elif req.top_logprobs is not None:
        raise _error("top_logprobs needs logprobs: true", "top_logprobs")
    return out


def history(i: int, m, role: str, content: Optional[str]) -> dict:
    """Message `i` as the template reads it: an assistant's `tool_calls` (arguments as objects) or a tool's result."""
    extra = m.model_extra or {}
    if role == "tool":
        if content is None:
            raise _error("a tool message needs its content", f"messages[{i}].content")
        return {"role": "tool", "content": content, "tool_call_id": str(extra.get("tool_call_id") or "")}
    calls = extra.get("tool_calls")
    if role != "assistant" or not calls:
        if content is None:
            raise _error("the message has no content", f"messages[{i}].content")
        return {"role": role, "content": content}
    if not isinstance(calls, list):
        raise _error("tool_calls must be a list", f"messages[{i}].tool_calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        name, args = (fn.get("name"), fn.get("arguments")) if isinstance(fn, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(args, str):
            raise _error("a tool call needs function.name and function.arguments (a JSON string)",
                         f"messages[{i}].tool_calls[{j}]")
        try:
            parsed = json.loads(args)
        except ValueError:
            raise _error("function.arguments is not JSON", f"messages[{i}].tool_calls[{j}].function.arguments") \
                from None
        out.append({"id": str(c.get("id") or ""), "type": "function",
                    "function": {"name": name, "arguments": parsed}})
    return {"role": "assistant", "content": content or "", "tool_calls": out}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(index: Optional[int], call: dict) -> dict:
    d = {"id": call_id(), "type": "function",
         "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
    return d if index is None else {"index": index, **d}


def message(text: str, finish: str, calls: bool) -> tuple[dict, str]:
    """(the assistant message, finish_reason) of a whole answer: its tool calls when it made them and finished."""
    if calls and finish == "stop" and toolcalls.is_calls(text):
        try:
            parsed = toolcalls.parse(text)
        except ValueError:
            parsed = []
        if parsed:
            return {"role": "assistant", "content": None, "refusal": None,
                    "tool_calls": [tool_call(None, c) for c in parsed]}, "tool_calls"
    return {"role": "assistant", "content": text, "refusal": None}, finish


def logprobs_content(model, entries) -> list[dict]:
    """OpenAI's `logprobs.content` of the parent's TokenLogprob entries."""

    def one(token: int, lp: float) -> dict:
        raw = model.piece(token, special=True)
        return {"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw)}

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
