"""Structured output on the server: a chat request's `response_format`, `tools` and `tool_choice` (read by
decoding.forms into the grammar the engine runs), its history's tool calls and tool results, and `logprobs`; and the
answer written back in OpenAI's shape (`tool_calls`, `finish_reason: tool_calls`, `logprobs.content`), by the one
rule of what a complete answer is (`outcome`: a cut answer is never "stop" with unfinished JSON, and never calls).

Every refusal is a decoding.forms.FormError naming the field (serving.schemas answers it 400): a schema
llguidance cannot compile, an unknown `tool_choice` function, a tool whose parameters are not an object schema, a
schema over decoding.grammar.MAX_SCHEMA_BYTES, a history whose calls and results do not link up (`check_links`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
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
    null) or a tool's result, with the `tool_call_id` of the call it answers. Content may be empty in every role, as
    OpenAI takes it (an agent resends an empty assistant turn or an empty system prompt); only a missing one is
    refused, beside no calls."""
    extra = m.model_extra or {}
    if role == "tool":
        call = extra.get("tool_call_id")
        if not isinstance(call, str) or not call:
            raise _error("a tool message needs the tool_call_id (a string) of the call it answers",
                         f"messages[{i}].tool_call_id")
        return {"role": "tool", "content": content or "", "tool_call_id": call}
    calls = extra.get("tool_calls")
    if role != "assistant" or not calls:
        if content is None:
            raise _error("the message has no content", f"messages[{i}].content")
        return {"role": role, "content": content}
    if not isinstance(calls, list):
        raise _error("tool_calls must be a list", f"messages[{i}].tool_calls")
    return {"role": "assistant", "content": content or "",
            "tool_calls": [_past_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]}


def _past_call(c, param: str) -> dict:
    """One call of an assistant message in the history, its arguments parsed (the template writes them as JSON)."""
    if isinstance(c, dict) and c.get("type", "function") != "function":
        raise _error(f"a call of type {json.dumps(c.get('type'))[:40]} cannot be sent back: function calls only",
                     f"{param}.type")
    if isinstance(c, dict) and (not isinstance(c.get("id"), str) or not c["id"]):
        raise _error("a tool call needs its id (a string), which the tool message answering it names",
                     f"{param}.id")
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict):
        raise _error("a tool call needs function.name (1-64 letters, digits, _ or -) and function.arguments "
                     "(a JSON string)", param)
    name, args = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str) or not forms.NAME.fullmatch(name):
        raise _error("a tool call needs function.name: 1-64 letters, digits, _ or -", f"{param}.function.name")
    if not isinstance(args, str):
        raise _error("function.arguments must be a string of JSON (a tool call's arguments, as the model wrote them)",
                     f"{param}.function.arguments")
    try:
        parsed = json.loads(args)
    except RecursionError:
        raise _error("function.arguments nests too deep", f"{param}.function.arguments") from None
    except ValueError:
        raise _error("function.arguments is not JSON", f"{param}.function.arguments") from None
    return {"id": c["id"], "type": "function", "function": {"name": name, "arguments": parsed}}


def check_links(messages: list[dict]) -> None:
    """The conversation's calls and results, as a whole, as OpenAI checks them: the calls of an assistant message are
    each answered by one tool message naming its id, right after it (before any other message, and before the
    conversation ends); a tool message answers a call of the assistant message before it."""
    calls: dict[str, tuple[int, int]] = {}  # id -> (message, call) of the open calls
    answered: dict[str, int] = {}  # id -> the tool message that answered it
    caller: Optional[int] = None  # the assistant message whose calls the tool messages now answer

    def unanswered(before: str) -> forms.FormError:
        cid, (i, j) = next((cid, at) for cid, at in calls.items() if cid not in answered)
        return _error(f"the call {cid!r} of messages[{i}] has no tool message answering it {before}",
                      f"messages[{i}].tool_calls[{j}]")

    for k, m in enumerate(messages):
        if m["role"] == "tool":
            cid = m["tool_call_id"]
            if caller is None:
                raise _error("a tool message must follow an assistant message with tool_calls (or another tool "
                             "message)", f"messages[{k}].role")
            if cid in answered:
                raise _error(f"tool_call_id {cid!r} was answered already, by messages[{answered[cid]}]",
                             f"messages[{k}].tool_call_id")
            if cid not in calls:
                raise _error(f"tool_call_id {cid!r} answers no call of messages[{caller}] (its calls: "
                             f"{', '.join(map(repr, calls))[:200]})", f"messages[{k}].tool_call_id")
            answered[cid] = k
            continue
        if len(answered) < len(calls):
            raise unanswered(f"before messages[{k}]")
        calls, answered, caller = {}, {}, None
        for j, c in enumerate(m.get("tool_calls") or ()):
            if c["id"] in calls:
                raise _error(f"two calls of messages[{k}] have the id {c['id']!r}", f"messages[{k}].tool_calls[{j}].id")
            calls[c["id"]] = (k, j)
            caller = k
    if len(answered) < len(calls):
        raise unanswered("(the conversation ends first)")


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


@dataclass
class Outcome:
    """What a whole answer is to the client, decided by `outcome` for every endpoint, streamed or not."""

    content: Optional[str]  # None: the answer is calls alone
    calls: list[dict]  # {"name", "arguments"} of a finished call answer
    finish: str  # "stop", "length" (cut: max_tokens, or a stop string inside a constrained answer), "tool_calls"


def outcome(text: str, finish: str, grammar: Optional[Grammar] = None, stopped_by: Sequence[str] = (),
            calls: bool = False) -> Outcome:
    """The one rule of what a complete answer is. `finish`: "stop" (the model ended it, or one of the request's stop
    strings `stopped_by` did) or "length" (max_tokens ran out); `grammar`: what it was held to; `calls`: whether it
    is read for tool calls.

    - A constrained answer that a stop string cut before its grammar's end (JSON not closed, a call not closed) is
      cut: "length", as one that ran out of tokens.
    - An answer read for tool calls that opened a call (or, cut, began to): finished, its calls, content null,
      "tool_calls"; the same when max_tokens cut it after its last call closed (only the end of the turn fell past
      it); cut inside a call, no calls at all (not those of a parallel set that were finished) and empty content,
      "length". Its markup never reaches the content.
    - Anything else is its text, with its finish reason; a cut JSON answer's text is the JSON so far."""
    if finish == "stop" and stopped_by and grammar is not None and grammar.validate(text) is not None:
        finish = "length"
    head = text.lstrip()
    if calls and head and (head.startswith(toolcalls.TOOL_OPEN)
                           or (finish != "stop" and toolcalls.TOOL_OPEN.startswith(head))):
        if finish != "stop":
            try:  # every call it opened closed: what max_tokens cut was the end of the turn, not a call
                return Outcome(None, toolcalls.parse(text), "tool_calls")
            except ValueError:
                return Outcome("", [], finish)
        try:
            return Outcome(None, toolcalls.parse(text), "tool_calls")
        except ValueError:  # not calls after all (an answer no grammar held to the form): text
            pass
    return Outcome(text, [], finish)


def message(text: str, finish: str, params=None) -> tuple[dict, str]:
    """(the assistant message, finish_reason) of a whole chat answer to the request `params`
    (schemas.GenerationParams; None: plain text), by `outcome`."""
    o = answer_outcome(text, finish, params)
    msg = {"role": "assistant", "content": o.content, "refusal": None}
    if o.calls:
        msg["tool_calls"] = [tool_call(None, c) for c in o.calls]
    return msg, o.finish


def answer_outcome(text: str, finish: str, params=None) -> Outcome:
    """`outcome` of an answer to the request `params` (schemas.GenerationParams; None: plain text)."""
    if params is None:
        return Outcome(text, [], finish)
    return outcome(text, finish, params.grammar, params.stop, params.tool_calls)


def logprobs_content(model, entries) -> list[dict]:
    """OpenAI's `logprobs.content` of the parent's TokenLogprob entries."""

    def one(token: int, lp: float) -> dict:
        raw = model.piece(token, special=True)
        return {"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw)}

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
