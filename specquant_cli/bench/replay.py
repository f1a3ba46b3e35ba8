"""Recorded traffic as a benchmark (`specquant bench load --replay TRACE.jsonl`): the chat-completion requests a real
client sent (a coding agent over a multi-turn editing task, recorded by `specquant bench record` or any OpenAI request
log), replayed in order against any server, each request's recorded messages, but for one thing: where a request
holds an earlier replayed request's messages and then its answer (an assistant message of text), that answer is the
one this server gave (`with_answers`), as the agent would have sent it had it been talking to this server. A trace
recorded with sampling (an agent that sends no temperature gets the server's default) holds answers no greedy replay
gives, and a server's prompt cache could never hold them: replayed as recorded, the second rewrite of the Agents SDK
trace below found 3 of its answer's 960 tokens in every server's cache. Tool calls, tool outputs and user messages
stay as recorded. Every answer is then judged against the parent alone as for any load (bench.fidelity), so a
replay checks that each answer is the parent's, and the report gives time per turn, tokens per second and the
prompt tokens the server took from its cache (an agent resends the same file each turn).

A trace is JSON lines, one request each: `{"endpoint": "/v1/chat/completions", "body": {...}}` as `bench record`
writes it, or the request body alone (an object with `messages`). What is replayed of a body: its messages, its
`prediction`, and its `tools` and `tool_choice` (the tools are part of the prompt, and an agent's turn may be a tool
call); the rest (`stream`, `temperature`, `max_tokens`, ...) is the benchmark's (streamed, greedy, --max-tokens), so
that every server answers alike. A Responses API request (`/v1/responses`) is replayed as the chat request it stands
for, converted as `specquant serve` converts it (serving.responses.chat_body): `instructions` as a system message,
`input` as the conversation (function_call items as the assistant's tool calls, function_call_output items as tool
messages), function tools as tools; built-in tools are left out.

Two real traces sit beside this module. `aider-bisect.trace.jsonl`: aider 0.86.2 (`--edit-format whole`, no
repository map) asked to rename the parameter `lo` to `low`, then `hi` to `high`, in CPython 3.11's `bisect.py` (PSF
License), through `bench record` in front of `specquant serve` with the qwen2.5-coder-1.5b family: two requests of
about 1,500 tokens, each holding the whole file (the second the file as the first answer left it), neither with
`max_tokens`.
`agents-bisect.trace.jsonl`: a file-editing agent on the OpenAI Agents SDK 0.24 (Responses API, one `read_file`
function tool, `tool_choice: required` until the tool is called, then a reply with the whole file in a code block),
given the same two renames in one session: four requests, two that call the tool and two that rewrite the file from
the tool's output (the second with the whole first turn before it: the file twice, and the first answer).

Nothing in a trace is trusted: a line that is not such a request is refused naming the file, the line and the problem
(bench.datasets.json_lines: JSON nested at most MAX_DEPTH levels)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specquant_cli.bench.datasets import json_lines
from specquant_cli.errors import InputError
from specquant_cli.fsutil import read_input_file
from specquant_cli.inputs import decode_input
from specquant_cli.serving.responses import chat_body
from specquant_cli.serving.schemas import ApiError

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
ROLES = ("system", "developer", "user", "assistant", "tool")
REPLAYED = ("tools", "tool_choice")  # replayed as recorded, besides the messages and the prediction


@dataclass(frozen=True)
class Request:
    """One recorded request, as it is replayed: its messages, its prediction, its other replayed fields (`tools`,
    `tool_choice`) and where it was read."""

    messages: tuple[dict, ...]
    prediction: Optional[str] = None
    where: str = ""
    fields: tuple[tuple[str, object], ...] = ()  # (name, value), as sent


def read(path: Path) -> list[Request]:
    """The requests of a trace file, in order (at least one)."""
    raw = read_input_file(path, "--replay", "trace file")  # a FIFO or a device: refused, never read
    out = requests(decode_input(raw, f"trace {path}").split("\n"), str(path))
    if not out:
        raise InputError(f"--replay {path}: no request in it (one JSON object per line)")
    return out


def requests(lines: Iterable[str], source: str) -> list[Request]:
    return [_request(d, f"{source}:{n}") for n, d in json_lines(lines, source)]


def _request(d, where: str) -> Request:
    if not isinstance(d, dict):
        raise InputError(f"{where}: expected a JSON object (a request), not {type(d).__name__}")
    endpoint, body = (d.get("endpoint", CHAT), d.get("body")) if "body" in d else (CHAT, d)
    if not isinstance(body, dict):
        raise InputError(f"{where}: 'body' must be an object (the request's JSON body)")
    if endpoint == RESPONSES:
        try:
            body = {**chat_body(body), "prediction": body.get("prediction")}
        except ApiError as e:
            raise InputError(f"{where}: " + (f"{e.param}: " if e.param else "") + e.message) from None
    elif endpoint != CHAT:
        raise InputError(f"{where}: endpoint {str(endpoint)[:60]!r} cannot be replayed (expected {CHAT} or "
                         f"{RESPONSES})")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: 'messages' must be a non-empty array")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InputError(f"{where}: messages[{i}] must be an object with a role of {', '.join(ROLES)}")
    messages = [_flat(m) for m in messages]
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise InputError(f"{where}: 'tools' must be an array of objects")
    fields = tuple((k, body[k]) for k in REPLAYED if body.get(k) not in (None, []))
    return Request(tuple(messages), _prediction(body.get("prediction"), where), where, fields)


def _prediction(p, where: str) -> Optional[str]:
    if p is None:
        return None
    content = p.get("content") if isinstance(p, dict) else None
    if isinstance(content, list):
        parts = [c.get("text") for c in content if isinstance(c, dict)]
        content = "".join(parts) if all(isinstance(t, str) for t in parts) else None
    if not isinstance(content, str):
        raise InputError(f"{where}: 'prediction' must be {{'type': 'content', 'content': text}}")
    return content or None


def _flat(message: dict) -> dict:
    """`message` with content of text parts as the one string they make (what every server reads them as, and what
    the judge's chat template takes); other content as it is (the server says what is wrong with it)."""
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(c, dict) and isinstance(c.get("text"), str) for c in content):
        return {**message, "content": "".join(c["text"] for c in content)}
    return message


def with_answers(recorded: Sequence[dict], earlier: Sequence[tuple[Sequence[dict], Optional[str]]]) -> list[dict]:
    """`recorded` (a replayed request's messages) with the answer of each `earlier` (its recorded messages, the answer
    this server gave it: None for a failed request or a tool call) in place of the recorded one: the assistant
    message of text right after that request's messages, where `recorded` begins with them."""
    out = list(recorded)
    for msgs, answer in earlier:
        n = len(msgs)
        if answer is None or n >= len(out) or list(recorded[:n]) != list(msgs):
            continue
        m = out[n]
        if m.get("role") == "assistant" and isinstance(m.get("content"), str) and not m.get("tool_calls"):
            out[n] = {**m, "content": answer}
    return out


def turns(reqs: Sequence[Request]) -> tuple[tuple[tuple[dict, ...], ...], tuple[Optional[str], ...], tuple[dict, ...]]:
    """(each request's messages, its prediction, its other replayed fields): one conversation's turns, in order."""
    return (tuple(r.messages for r in reqs), tuple(r.prediction for r in reqs),
            tuple(dict(r.fields) for r in reqs))
