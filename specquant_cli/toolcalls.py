"""Tool calls in the Hermes form that Qwen2.5's chat template writes and reads:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse` reads an answer's calls; `ToolStream` splits a streamed answer into text and whole calls; `render_messages`
writes tools, assistant tool calls and tool results into messages a chat template without tool support (one that
never mentions `tools`) renders as plain turns."""

from __future__ import annotations

import json
from typing import Optional

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

SYSTEM_TOOLS = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
                "function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function "
                "call, return a json object with function name and arguments within <tool_call></tool_call> XML "
                "tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def call_text(name: str, arguments) -> str:
    return f"{TOOL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{TOOL_CLOSE}"


def parse(text: str) -> list[dict]:
    """[{"name", "arguments"}] of the calls `text` consists of; ValueError when it holds anything else, or an
    unfinished or malformed call."""
    calls, rest = [], text.strip()
    while rest:
        if not rest.startswith(TOOL_OPEN):
            raise ValueError("text outside a tool call")
        end = rest.find(TOOL_CLOSE)
        if end < 0:
            raise ValueError("an unfinished tool call")
        body = json.loads(rest[len(TOOL_OPEN):end])
        if not isinstance(body, dict) or not isinstance(body.get("name"), str) or "arguments" not in body:
            raise ValueError("a tool call without a name and arguments")
        calls.append({"name": body["name"], "arguments": body["arguments"]})
        rest = rest[end + len(TOOL_CLOSE):].strip()
    return calls


def written(content: str, calls: list[dict]) -> str:
    """An answer of `content` and `calls` ({"name", "arguments"}; arguments a JSON object, or a string that is not
    one) as the model writes it: what a client's parsed answer is compared with (bench load's fidelity)."""
    texts = []
    for c in calls:
        args = c["arguments"]
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                pass
        texts.append(call_text(c["name"], args))
    return "\n".join([content, *texts] if content else texts)


def rewritten(text: str) -> str:
    """`text`, if it is tool calls, with each written as `written` writes it (the same calls whatever the model's
    spacing in their JSON); any other text as it is."""
    if not is_calls(text):
        return text
    try:
        return written("", parse(text))
    except (ValueError, RecursionError):
        return text


def is_calls(text: str) -> bool:
    """Whether an answer is tool calls (it opens with a call) rather than text."""
    return text.lstrip().startswith(TOOL_OPEN)


class ToolStream:
    """A streamed answer that may be tool calls: `feed` takes each piece of text and returns what can go out now,
    ("text", str) or ("call", {"name", "arguments"}) items; a call goes out whole once its closing marker came.
    Text that could still open a call is held until it cannot."""

    def __init__(self):
        self.buf = ""
        self.mode: Optional[str] = None  # None: undecided; "text"; "calls"
        self.calls = 0

    def feed(self, piece: str) -> list[tuple[str, object]]:
        self.buf += piece
        if self.mode is None:
            head = self.buf.lstrip()
            if not head or (TOOL_OPEN.startswith(head) and head != TOOL_OPEN):
                return []
            self.mode = "calls" if head.startswith(TOOL_OPEN) else "text"
        if self.mode == "text":
            out, self.buf = self.buf, ""
            return [("text", out)] if out else []
        items = []
        while (end := self.buf.find(TOOL_CLOSE)) >= 0:
            chunk, self.buf = self.buf[:end + len(TOOL_CLOSE)], self.buf[end + len(TOOL_CLOSE):]
            try:
                calls = parse(chunk)
            except ValueError:  # not a call after all (text the grammar did not hold to the form): text from here
                self.mode, rest, self.buf = "text", chunk + self.buf, ""
                return items + [("text", rest)]
            items += [("call", c) for c in calls]
            self.calls += len(calls)
        return items

    def rest(self) -> str:
        """What was held back and never became a call (an answer cut short): it goes out as text; the whitespace
        after the last call does not."""
        out, self.buf = self.buf, ""
        return "" if self.mode == "calls" and not out.strip() else out


def render_messages(messages: list[dict], tools: Optional[list[dict]]) -> list[dict]:
    """`messages` as plain turns for a template without tool support: the tools described in the system message,
    an assistant's calls written in its content, a tool's result as a user turn in <tool_response> tags."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).lstrip("\n")})
        elif m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        text = SYSTEM_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def template_knows_tools(template: Optional[str]) -> bool:
    return bool(template) and "tools" in template and "tool_calls" in template
