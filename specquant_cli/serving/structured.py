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
    """Message `i` as the template reads it: an assistant's `tool_calls` (arguments as objects; its content may be
    null or empty) or a tool's result (its content may be empty)."""
    extra = m.model_extra or {}
    if role == "tool":
        return {"role": "tool", "content": content or "", "tool_call_id": str(extra.get("tool_call_id") or "")}
    calls = extra.get("tool_calls")
    if role != "assistant" or not calls:
        if not content:
            raise _error("the message has no content" if content is None else "the text is empty",
                         f"messages[{i}].content")
        return {"role": role, "content": content}
    if not isinstance(calls, list):
        raise _error("tool_calls must be a list", f"messages[{i}].tool_calls")
    return {"role": "assistant", "content": content or "",
            "tool_calls": [_past_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]}


def _past_call(c, param: str) -> dict:
    """One call of an assistant message in the history, its arguments parsed (the template writes them as JSON)."""
    fn = c.get("function") if isinstance(c, dict) else None
    name, args = (fn.get("name"), fn.get("arguments")) if isinstance(fn, dict) else (None, None)
    if not isinstance(name, str) or not forms.NAME.fullmatch(name) or not isinstance(args, str):
        raise _error("a tool call needs function.name (1-64 letters, digits, _ or -) and function.arguments "
                     "(a JSON string)", param)
    try:
        parsed = json.loads(args)
    except RecursionError:
        raise _error("function.arguments nests too deep", f"{param}.function.arguments") from None
    except ValueError:
        raise _error("function.arguments is not JSON", f"{param}.function.arguments") from None
    return {"id": str(c.get("id") or ""), "type": "function", "function": {"name": name, "arguments": parsed}}


def check_history(messages: list[dict], model) -> None:
    """The calls in the history are written into the prompt as markup (the template's JSON of them): one that
    spells a special token of the vocabulary would forge a turn, and is refused."""
    for i, m in enumerate(messages):
        for j, c in enumerate(m.get("tool_calls") or ()):
            if model.spells_special(json.dumps(c["function"], ensure_ascii=False)):
                raise _error("a tool call spells a special token of the model's vocabulary",
                             f"messages[{i}].tool_calls[{j}]")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(index: Optional[int], call: dict) -> dict:
    d = {"id": call_id(), "type": "function",
         "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
    return d if index is None else {"index": index, **d}


def message(text: str, finish: str, calls: bool) -> tuple[dict, str]:
    """(the assistant message, finish_reason) of a whole answer read for tool calls as a stream of it would be
    (toolcalls.ToolStream): its whole calls, then what never became one as content (an answer cut short); the
    finish reason is "tool_calls" when it made calls and finished."""
    if not calls:
        return {"role": "assistant", "content": text, "refusal": None}, finish
    stream = toolcalls.ToolStream()
    items = stream.feed(text)
    made = [tool_call(None, x) for kind, x in items if kind == "call"]
    rest = "".join(x for kind, x in items if kind == "text") + stream.rest()
    msg = {"role": "assistant", "content": rest or (None if made else ""), "refusal": None}
    if made:
        msg["tool_calls"] = made
    return msg, "tool_calls" if made and finish == "stop" else finish


def logprobs_content(model, entries) -> list[dict]:
    """OpenAI's `logprobs.content` of the parent's TokenLogprob entries."""

    def one(token: int, lp: float) -> dict:
        raw = model.piece(token, special=True)
        return {"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw)}

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
