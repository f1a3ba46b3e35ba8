"""OpenAI's Responses API (`POST /v1/responses`) over the chat machinery.

A request is read into the chat completion it amounts to — `instructions` as the system message, `input` (a string, or
message, function_call and function_call_output items) as the messages, function `tools`, `tool_choice` and
`text.format` as tools and response_format, `max_output_tokens` as max_tokens — and validated by
serving.schemas.chat_params, so it runs with the same speculation, grammar, keys, tenants and guards, and gives the
same text a chat completion of the same messages gives. An error of that validation names the Responses field
(`where`). The answer is written back by serving.response_maker.

Stateless, as `store: false`: nothing is kept, so `previous_response_id`, `conversation` and `item_reference` items
are refused (send the whole conversation in `input`), as are input items other than text (images, files),
`background`, `prompt`, `truncation: auto`, `context_management` and `top_logprobs`. A field OpenAI's Responses API
does not define (`max_tokens`, `response_format`, `n`, ...) is refused by name, as OpenAI refuses it. A `namespace`
tool is its function tools; built-in tools (web_search, file_search, ...) run on OpenAI's side and are left out of
what the model sees, each said in the response's `specquant.warnings` and the server's log (refused instead under
`serve --strict-tools`)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from specquant_cli.decoding.forms import TOOL_CHOICES
from specquant_cli.serving.schemas import ApiError, GenerationParams, chat_params, valid_unicode

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")  # content parts read as text
SAMPLING = ("temperature", "top_p", "top_k", "seed")  # passed on as they are (top_k and seed: not OpenAI's)
PASSED = ("model", "stream", "parallel_tool_calls", "specquant_policy", "cache_salt", *SAMPLING)
STATELESS = "specquant serve stores no responses (as store: false); send the whole conversation in input"
REFUSED = {  # field -> why it cannot be honoured (refused unless null, or false / 0 where noted)
    "previous_response_id": STATELESS,
    "conversation": STATELESS,
    "background": "every response is answered while the request waits",
    "prompt": "no stored prompts",
    "context_management": "nothing is compacted: an input longer than the context is refused (400)",
    "top_logprobs": "no log-probabilities on this endpoint (use /v1/chat/completions)",
}
ALLOWED_FALSY = {"background": False, "top_logprobs": 0}
# The fields of OpenAI's create-response body, besides those read above and below: taken, without effect (nothing is
# stored, billed or cached by key here; max_tool_calls bounds calls to built-in tools, which never run here).
# client_metadata: sent by OpenAI's Codex CLI.
WITHOUT_EFFECT = ("store", "metadata", "user", "include", "reasoning", "service_tier", "prompt_cache_key",
                  "prompt_cache_retention", "safety_identifier", "stream_options", "max_tool_calls", "client_metadata")
FIELDS = frozenset({*PASSED, *REFUSED, *WITHOUT_EFFECT, "input", "instructions", "tools", "tool_choice", "text",
                    "max_output_tokens", "truncation"})
CHAT_FIELDS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "response_format": "text.format", "messages": "input"}  # -> what the Responses API calls it
MAX_METADATA = (16, 64, 512)  # OpenAI's metadata: keys, characters of a key, characters of a value
# Tool types OpenAI runs on its own side (or the client runs for its own items: local_shell, shell, apply_patch,
# tool_search): left out of what the model sees here, or refused under --strict-tools.
BUILTIN_TOOLS = ("web_search", "file_search", "code_interpreter", "computer_use", "image_generation", "local_shell",
                 "shell", "mcp", "apply_patch", "tool_search")


def _refuse(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _unsupported(param: str, why: str) -> ApiError:
    return _refuse(param, f"'{param}' is not supported by specquant serve: {why}", "unsupported_parameter")


# -- the request ------------------------------------------------------------------------------------------------

@dataclass
class Where:
    """Which Responses field each chat field came from: `origins[i]` for message i ("instructions", "input" or an
    input item, "input[3]"), `outputs` the messages that are function_call_output items (their content is `output`),
    `calls[i][j]` the item of the j-th tool call of message i (a function_call)."""

    origins: list[str] = field(default_factory=list)
    outputs: set[int] = field(default_factory=set)
    calls: dict[int, list[str]] = field(default_factory=dict)
    tools: list[str] = field(default_factory=list)  # the Responses field of each chat tool: tools[1].tools[0]

    def name(self, param: Optional[str]) -> Optional[str]:
        """The Responses name of chat field `param` (messages[2].content -> input[1].content)."""
        if param is None:
            return None
        m = re.match(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\])?(.*)$", param)
        if m is None:
            tool = re.match(r"tools\[(\d+)\](?:\.function)?(.*)$", param)  # a Responses tool has no `function` level
            if tool is not None:
                k = int(tool.group(1))
                return (self.tools[k] if k < len(self.tools) else f"tools[{k}]") + tool.group(2)
            return _TOP.get(param) or next((new + param[len(old):] for old, new in _PREFIXES
                                            if param.startswith(old)), param)
        i, j, rest = int(m.group(1)), m.group(2), m.group(3)
        if i >= len(self.origins):
            return "input"
        origin = self.origins[i]
        if j is not None:
            calls = self.calls.get(i, [])
            origin = calls[int(j)] if int(j) < len(calls) else origin
            return origin + _CALL_FIELDS.get(rest, "")
        if origin in ("instructions", "input"):
            return origin
        if rest.startswith(".content"):
            return origin + (".output" + rest[len(".content"):] if i in self.outputs else rest)
        return origin + {".tool_call_id": ".call_id"}.get(rest, "")

    def text(self, message: str) -> str:
        """A chat validation message in Responses words: each field it names, and the history's terms."""
        message = _FIELD.sub(lambda m: self.name(m.group(0)) or m.group(0), message)
        for chat, responses in _WORDS:
            message = message.replace(chat, responses)
        return message


_FIELD = re.compile(r"messages\[\d+\](?:\.tool_calls\[\d+\])?(?:\.[a-z_]+)*|max_completion_tokens|max_tokens|"
                    r"response_format(?:\.[a-z_]+)*|tools\[\d+\](?:\.function(?:\.[a-z_]+)*)?")
_WORDS = (("an assistant message with tool_calls", "function_call items"),
          ("tool message", "function_call_output item"), ("tool_call_id", "call_id"),
          ("the response_format schema", "the text.format schema"), ("function.name", "name"),
          ("function.arguments", "arguments"))


_TOP = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
        "response_format": "text.format", "response_format.type": "text.format.type",
        "response_format.json_schema": "text.format"}
_PREFIXES = (("response_format.json_schema.", "text.format."),)
_CALL_FIELDS = {".function.arguments": ".arguments", ".function.name": ".name", ".id": ".call_id", ".type": ".type"}


@dataclass
class ResponsesRequest:
    """A validated request: its params (as the worker runs them), what the response object repeats of it, what was
    left out of it (`warnings`: built-in tools), and the namespace of each function that came from a namespace
    tool (a call of it names its namespace, as OpenAI's does)."""

    params: GenerationParams
    echo: dict
    warnings: list[str] = field(default_factory=list)
    namespaces: dict[str, str] = field(default_factory=dict)


def responses_params(body: Any, resolve_policy: Callable[[Optional[str]], str], model,
                     refuse_builtin: bool = False) -> ResponsesRequest:
    """Validate a /v1/responses body (see the module's docstring); `model`: the vocabulary a grammar compiles for;
    `refuse_builtin`: refuse built-in tools (serve --strict-tools) instead of leaving them out."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            moved = CHAT_FIELDS.get(name)
            raise _refuse(name, f"Unknown parameter: {json.dumps(name)[:80]}" +
                          (f". In the Responses API it is '{moved}'" if moved else "") + ".", "unknown_parameter")
    for name, why in REFUSED.items():
        if body.get(name) is not None and body.get(name) != ALLOWED_FALSY.get(name, None):
            raise _unsupported(name, why)
    if body.get("truncation") not in (None, "disabled"):
        raise _unsupported("truncation", "only 'disabled': an input longer than the context is refused (400), "
                                         "never cut")
    _check_include(body.get("include"))
    _check_metadata(body.get("metadata"))
    calls = body.get("max_tool_calls")
    if calls is not None and (not isinstance(calls, int) or isinstance(calls, bool) or calls < 0):
        raise _refuse("max_tool_calls", "max_tool_calls must be an integer of at least 0")
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        _check_text(body.get(name), name)
    for name in ("tools", "tool_choice", "text"):  # repeated in the response, built-in tools left out too
        valid_unicode(body.get(name), name)
    warnings: list[str] = []
    chat, where, namespaces = _chat_body(body, warnings, refuse_builtin)
    try:
        params = chat_params(chat, resolve_policy, model)
    except ApiError as e:
        raise ApiError(e.status, where.text(e.message), e.type, where.name(e.param), e.code, e.headers) from None
    params = replace(params, max_tokens_param="max_output_tokens", prompt_param="input")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    echo = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
            "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
            "tool_choice": body.get("tool_choice") or TOOL_CHOICES[1], "tools": body.get("tools") or [],
            "text": {"format": fmt or {"type": "text"}}, "user": body.get("user")}
    return ResponsesRequest(params, echo, warnings, namespaces)


def _check_text(value: Any, param: str) -> None:
    """A string the response repeats (or null): valid Unicode, as every string that goes out must be."""
    if value is None:
        return
    if not isinstance(value, str):
        raise _refuse(param, f"{param} must be a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _refuse(param, f"{param} is not valid Unicode (it holds a lone surrogate)") from None


def _check_metadata(metadata: Any) -> None:
    """`metadata` as OpenAI documents it: an object of at most 16 string values, keys of at most 64 characters and
    values of at most 512."""
    if metadata is None:
        return
    keys, key_chars, value_chars = MAX_METADATA
    if not isinstance(metadata, dict):
        raise _refuse("metadata", "metadata must be an object of string values")
    if len(metadata) > keys:
        raise _refuse("metadata", f"metadata holds at most {keys} keys, not {len(metadata)}")
    for key, value in metadata.items():
        _check_text(key, "metadata")
        if len(key) > key_chars:
            raise _refuse("metadata", f"a metadata key is at most {key_chars} characters, not {len(key)}")
        param = f"metadata.{key}"
        _check_text(value, param)
        if len(value) > value_chars:
            raise _refuse(param, f"a metadata value is at most {value_chars} characters, not {len(value)}")


def _check_include(include: Any) -> None:
    if include is None:
        return
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise _refuse("include", "include must be a list of strings")
    if "message.output_text.logprobs" in include:
        raise _unsupported("include", "no log-probabilities on this endpoint (use /v1/chat/completions)")
    # the others name parts of items this server never makes (reasoning, search results, images): nothing to add


def chat_body(body: dict) -> dict:
    """The chat completion body a Responses body amounts to (messages, function tools, tool_choice, response_format,
    ...), as serve runs it, built-in tools left out; ApiError naming the Responses field for a body that cannot be
    one. (bench load --replay sends a recorded Responses request to any server this way.)"""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return _chat_body(body, [], refuse_builtin=False)[0]


def _chat_body(body: dict, warnings: list[str], refuse_builtin: bool) -> tuple[dict, Where, dict[str, str]]:
    """The chat completion body a Responses body amounts to, where each of its messages and tools came from, and the
    namespace of each function of a namespace tool; what is left out goes to `warnings`."""
    chat: dict = {k: body[k] for k in PASSED if k in body}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    where = Where()
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _refuse("instructions", "instructions must be a string")
        messages.append({"role": "system", "content": instructions})
        where.origins.append("instructions")
    _input_messages(body.get("input"), messages, where)
    chat["messages"] = messages
    namespaces: dict[str, str] = {}
    if body.get("tools") not in (None, []):  # no tools may be an empty list here (not in a chat completion)
        chat["tools"] = _tools(body["tools"], where, namespaces, warnings, refuse_builtin)
        if chat["tools"] == []:  # every tool was built in, and left out
            del chat["tools"]
    if body.get("tool_choice") is not None and (chat.get("tools") or body["tool_choice"] not in TOOL_CHOICES[:2]):
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat, where, namespaces


def _input_messages(items: Any, messages: list[dict], where: Where) -> None:
    """`input` as chat messages: a string is one user message; function_call items join the assistant message they
    follow (or make one), each function_call_output is a tool message."""
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        where.origins.append("input")
        return
    if not isinstance(items, list) or not items:
        raise _refuse("input", "input must be a string or a non-empty list of items")
    for k, item in enumerate(items):
        at = f"input[{k}]"
        if not isinstance(item, dict):
            raise _refuse(at, "an input item must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise _refuse(f"{at}.role", f"unknown role {json.dumps(role)[:40]}: one of {', '.join(MESSAGE_ROLES)}")
            messages.append({"role": role, "content": _content(item.get("content"), at)})
            where.origins.append(at)
        elif kind == "function_call":  # joins the assistant message it follows (its text, or calls before it)
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                where.origins.append(at)
            where.calls.setdefault(len(messages) - 1, []).append(at)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _output(item.get("output"), at)})
            where.origins.append(at)
            where.outputs.add(len(messages) - 1)
        elif kind == "item_reference":
            raise _unsupported(f"{at}.type", f"items of type 'item_reference': {STATELESS}")
        else:
            raise _refuse(f"{at}.type", f"input items of type {json.dumps(kind)[:60]} are not supported: message, "
                                        "function_call and function_call_output")


def _content(content: Any, at: str, empty: bool = False) -> Any:
    """A message item's content as chat content (a string, or text parts; `empty`: an empty list is empty text)."""
    if isinstance(content, str) or content is None:
        return content
    if not isinstance(content, list):
        raise _refuse(f"{at}.content", "content must be a string or a list of content parts")
    if not content and not empty:
        raise _refuse(f"{at}.content", "content is an empty list of parts: send at least one, or \"\" for no text")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise _unsupported(f"{at}.content[{j}]", f"content parts of type {json.dumps(kind)[:40]} (text only: "
                                                     f"{', '.join(TEXT_PARTS)})")
        parts.append({"type": "text", "text": part.get("text")})
    return parts or ""


def _output(output: Any, at: str) -> Any:
    """A function_call_output's output as a tool message's content."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _content(output, at, empty=True)
    raise _refuse(f"{at}.output", "output must be a string or a list of text parts")


def _tools(tools: Any, where: Where, namespaces: dict[str, str], warnings: list[str], refuse_builtin: bool) -> Any:
    """Responses function tools ({"type": "function", "name", "parameters", ...}) as chat tools, a namespace tool
    ({"type": "namespace", "name", "tools": [function tools]}) as its functions (`namespaces`: function -> its
    namespace); a built-in tool is left out, said in `warnings` (refused by name when `refuse_builtin`); another
    type is refused. `where.tools`: the Responses field of each chat tool."""
    if not isinstance(tools, list):
        return tools  # chat_params says what is wrong with it
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "namespace":
            name, members = t.get("name"), t.get("tools")
            if not isinstance(name, str) or not name:
                raise _refuse(f"tools[{i}].name", "a namespace tool needs its name (a string)")
            if not isinstance(members, list):
                raise _refuse(f"tools[{i}].tools", "a namespace tool needs its tools (a list of function tools)")
            for j, member in enumerate(members):
                if not isinstance(member, dict) or member.get("type") != "function":
                    raise _unsupported(f"tools[{i}].tools[{j}].type", "a namespace holds function tools only")
                out.append(_function(member))
                where.tools.append(f"tools[{i}].tools[{j}]")
                if isinstance(member.get("name"), str):
                    namespaces[member["name"]] = name
        elif kind == "function":
            out.append(_function(t))
            where.tools.append(f"tools[{i}]")
        elif _builtin(kind) and not refuse_builtin:
            warnings.append(f"tools[{i}] ({kind[:40]}) was left out: a built-in tool runs on OpenAI's side, and this "
                            "server calls function tools only")
        elif _builtin(kind):  # --strict-tools
            raise _unsupported(f"tools[{i}].type", f"tools of type {json.dumps(kind)[:40]} (built-in tools run on "
                                                   "OpenAI's side; this server calls function tools only)")
        else:
            raise _unsupported(f"tools[{i}].type", f"tools of type {json.dumps(kind)[:40]} (function tools and "
                                                   "namespaces of them only)")
    return out


def _builtin(kind: Any) -> bool:
    """Whether a tool type is one of OpenAI's built-in tools (dated versions too: web_search_preview_2025_03_11)."""
    return isinstance(kind, str) and (kind in BUILTIN_TOOLS or kind.startswith(("web_search_", "computer_use_")))


def _function(t: dict) -> dict:
    return {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                             if t.get(k) is not None}}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") == "function" and "function" not in choice:
            return {"type": "function", "function": {"name": choice.get("name")}}
        if choice.get("type") != "function":
            raise _unsupported("tool_choice", f"a tool_choice of type {json.dumps(choice.get('type'))[:40]} (none, "
                                              "auto, required or {\"type\": \"function\", \"name\": ...})")
    return choice


def _text_format(text: Any) -> Optional[dict]:
    """`text.format` as a chat response_format (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _refuse("text", "text must be an object, e.g. {\"format\": {\"type\": \"json_schema\", ...}}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _refuse("text.format", "text.format must be an object")
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        if "schema" not in spec:
            raise _refuse("text.format.schema", "a json_schema format needs its schema")
        return {"type": "json_schema", "json_schema": spec}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise _refuse("text.format.type", f"unknown text.format type {json.dumps(kind)[:40]}: text, json_object or "
                                      "json_schema")
