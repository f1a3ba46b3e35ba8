"""Recorded traffic as a benchmark (`specquant bench load --replay TRACE.jsonl`): the chat-completion requests a real
client sent (a coding agent over a multi-turn editing task, recorded by `specquant bench record` or any OpenAI request
log), replayed in order against any server, each request's exact messages (not the server's own answers fed back: an
agent's next turn holds what it was answered then). Every answer is then judged against the parent alone as for any
load (bench.fidelity), so a replay checks that each answer is the parent's, and the report gives time per turn,
tokens per second and the prompt tokens the server took from its cache (an agent resends the same file each turn).

A trace is JSON lines, one request each: `{"endpoint": "/v1/chat/completions", "body": {...}}` as `bench record`
writes it, or the request body alone (an object with `messages`). What is replayed of a body: its messages and its
`prediction`; the rest (`stream`, `temperature`, `max_tokens`, ...) is the benchmark's (streamed, greedy, --max-tokens),
so that every server answers alike. A Responses API request (`/v1/responses`) is replayed as the chat request it
stands for: `instructions` as a system message, `input` (a string, or messages whose content is a string or text
parts) as the conversation; a tool turn of either API is sent as it was recorded.

`aider-bisect.trace.jsonl` (beside this module) is a real one: aider 0.86.2 (`--edit-format whole`, no repository map)
asked to rename the parameter `lo` to `low`, then `hi` to `high`, in CPython 3.11's `bisect.py` (PSF License), through
`bench record` in front of `specquant serve` with the qwen2.5-coder-1.5b family: two requests of about 1,500 tokens,
each holding the whole file (the second the file as the first answer left it), neither with `max_tokens`.

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

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Request:
    """One recorded request, as it is replayed: its messages, its prediction, and where it was read."""

    messages: tuple[dict, ...]
    prediction: Optional[str] = None
    where: str = ""


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
    if endpoint == CHAT:
        messages = body.get("messages")
    elif endpoint == RESPONSES:
        messages = _responses_messages(body, where)
    else:
        raise InputError(f"{where}: endpoint {str(endpoint)[:60]!r} cannot be replayed (expected {CHAT} or "
                         f"{RESPONSES})")
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: 'messages' must be a non-empty array")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InputError(f"{where}: messages[{i}] must be an object with a role of {', '.join(ROLES)}")
    return Request(tuple(messages), _prediction(body.get("prediction"), where), where)


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


def _responses_messages(body: dict, where: str) -> list[dict]:
    """The chat messages a Responses request stands for (its instructions, then its input)."""
    out = [{"role": "system", "content": body["instructions"]}] if isinstance(body.get("instructions"), str) else []
    given = body.get("input")
    if isinstance(given, str):
        return [*out, {"role": "user", "content": given}]
    if not isinstance(given, list):
        raise InputError(f"{where}: a Responses request's 'input' must be a string or an array")
    for i, item in enumerate(given):
        if not isinstance(item, dict) or item.get("role") not in ROLES:
            raise InputError(f"{where}: input[{i}] cannot be replayed as a chat message (a message with a role; "
                             "tool calls and their outputs are not replayed from a Responses trace)")
        out.append({"role": item["role"], "content": _text(item.get("content"), f"{where}: input[{i}]")})
    return out


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [c.get("text") for c in content if isinstance(c, dict)]
        if texts and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise InputError(f"{where}.content: expected a string or text parts")


def turns(reqs: Sequence[Request]) -> tuple[tuple[tuple[dict, ...], ...], tuple[Optional[str], ...]]:
    """(each request's messages, each request's prediction): one conversation's turns, replayed in order."""
    return tuple(r.messages for r in reqs), tuple(r.prediction for r in reqs)
