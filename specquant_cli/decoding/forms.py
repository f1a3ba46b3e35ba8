"""OpenAI's request forms of structured output — `response_format` (json_object, json_schema) and `tools` with
`tool_choice` — read into a decoding.grammar.Grammar, each part checked against the model's vocabulary. Shared by
the server (serving.structured) and the bench's structured-output set (bench.datasets). A refusal is a FormError
naming the field (`param`, as OpenAI names it)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from specquant_cli.decoding import grammar as G
from specquant_cli.errors import InputError

TOOL_CHOICES = ("none", "auto", "required")  # OpenAI's tool_choice words
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function and schema names


class FormError(InputError):
    """A structured-output field that cannot be honoured; `param` names it."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code  # the API error's code (OpenAI's: invalid_value, context_length_exceeded)


@dataclass
class Form:
    """What a request asks of its answer's form."""

    grammar: Optional[G.Grammar] = None
    tools: Optional[list[dict]] = None  # the function tools the template describes (OpenAI's shape)
    calls: bool = False  # the answer is read for tool calls (tools given, tool_choice not "none")


def _error(message: str, param: str) -> FormError:
    return FormError(message, param)


def _schema_grammar(schema: Any, model, param: str, what: str) -> G.Grammar:
    try:
        g = G.json_schema(schema, what)
        G.check(g, model)
    except (InputError, ValueError) as e:
        raise _error(str(e), param) from None
    return g


def response_format_grammar(fmt: Optional[dict], model) -> Optional[G.Grammar]:
    """The grammar of `response_format` (None: text)."""
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return G.json_object()
    if kind != "json_schema":
        raise _error(f"unknown response_format type {kind!r}: text, json_object or json_schema", "response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _error("response_format json_schema needs a 'json_schema' object", "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _error("response_format json_schema needs a 'name' of 1-64 letters, digits, _ or -",
                     "response_format.json_schema.name")
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise _error("'strict' must be a boolean", "response_format.json_schema.strict")
    schema = spec.get("schema", {})
    return _schema_grammar(schema, model, "response_format.json_schema.schema", "the response_format schema")


def _functions(tools: Any, model) -> dict[str, dict]:
    """name -> parameter schema of the request's function tools, each checked."""
    if not isinstance(tools, list) or not tools:
        raise _error("'tools' must be a non-empty list of function tools", "tools")
    if len(tools) > G.MAX_TOOLS:
        raise _error(f"at most {G.MAX_TOOLS} tools", "tools")
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise _error("a tool must be {\"type\": \"function\", \"function\": {...}}", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise _error("a function name is 1-64 letters, digits, _ or -", f"tools[{i}].function.name")
        if name in out:
            raise _error(f"two tools are named {name!r}", f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _error("parameters must be a JSON Schema object", f"tools[{i}].function.parameters")
        kind = params.get("type", "object")  # a call's arguments are an object: a schema without a type is one's
        if kind != "object":
            raise _error(f"the parameters of {name!r} must be a JSON Schema of type \"object\" (a call's arguments "
                         f"are a JSON object), not of type {json.dumps(kind)[:60]}", f"tools[{i}].function.parameters")
        params = {**params, "type": "object"}
        _schema_grammar(params, model, f"tools[{i}].function.parameters", f"the parameters of {name!r}")
        out[name] = params
    return out


def _choice(choice: Any, names: dict) -> tuple[str, Optional[str]]:
    """(one of TOOL_CHOICES, the one function named) of `tool_choice` (unset: the model may call, or answer)."""
    if choice is None:
        return TOOL_CHOICES[1], None
    if choice in TOOL_CHOICES:
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _error("tool_choice is none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                     "tool_choice")
    if name not in names:
        raise _error(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return "required", name


def read(response_format: Optional[dict], tools: Any, tool_choice: Any, parallel: Any, model) -> Form:
    """The form a request asks of its answer: `response_format`, `tools` and `tool_choice` as OpenAI spells them,
    `parallel` its parallel_tool_calls (None: true)."""
    if parallel is not None and not isinstance(parallel, bool):
        raise _error("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    out = Form(grammar=response_format_grammar(response_format, model))
    if tools is None:
        if tool_choice not in (None, "none"):
            raise _error("tool_choice without tools", "tool_choice")
        return out
    names = _functions(tools, model)
    mode, only = _choice(tool_choice, names)
    out.tools = tools
    if model.spells_special(json.dumps(tools, ensure_ascii=False)):
        raise _error("a tool spells a special token of the model's vocabulary", "tools")
    if mode != "none":
        out.calls = True
        chosen = {only: names[only]} if only else names
        try:
            # a named function is called once; otherwise as many calls as the model makes (parallel_tool_calls)
            out.grammar = G.tool_calls(chosen, model, required=mode == "required",
                                       parallel=parallel is not False and only is None, text=out.grammar)
            G.check(out.grammar, model)
        except FormError:
            raise
        except InputError as e:
            raise _error(str(e), "tools") from None
    return out
