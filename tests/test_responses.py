"""The Responses API (`POST /v1/responses`) for real, driven by the official `openai` client's `responses.create`,
`responses.stream` and `responses.parse` on the smollm2-135m family: the text a chat completion of the same messages
gives (greedy), the documented stream of events, json_schema output, a function-call round trip (the call's output
sent back in `input`), a cut answer `incomplete` and never a call, calls that closed before max_tokens ran out
returned (chat completions too); what agents send: Codex CLI's first request (a `namespace` of function tools, built-in
tools left out and said), every field OpenAI defines; and the refusals, each a 400 in OpenAI's error shape naming the
innermost field: fields OpenAI does not define, unknown item types, `previous_response_id` (nothing is stored), a
schema that cannot compile, non-text content, metadata beyond OpenAI's bounds.

One server for the module (--parallel 1, one thread); comparisons run the parent alone."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel
from test_serve import KEY, ServerProc, wait_for

from conftest import run_cli

PARENT = {"specquant_policy": "parent"}
SHORT = "Reply with one word: yes or no. Is the sky blue?"  # the parent's greedy answer ends in a few tokens
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}, "strict": True}
CHAT_WEATHER = {"type": "function",
                "function": {k: WEATHER[k] for k in ("name", "description", "parameters", "strict")}}
ASK_WEATHER = "What's the weather in Paris, in celsius?"
EXTRACT = "Extract the city as JSON: Maria Lopez is 34 and lives in Madrid, Spain."


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def server(family_dir):
    s = ServerProc(["--family", str(family_dir), "--api-key", KEY, "--parallel", "1"])
    yield s
    s.stop()


def _create(server, **kw):
    args = {"model": "m", "input": SHORT, "max_output_tokens": 32, "temperature": 0, "extra_body": PARENT, **kw}
    return server.client().responses.create(**args)


def _stream_events(server, **kw) -> list:
    args = {"model": "m", "input": SHORT, "max_output_tokens": 32, "temperature": 0, "extra_body": PARENT, **kw}
    return list(server.client().responses.create(stream=True, **args))


def _chat(server, messages, **kw):
    return server.client().chat.completions.create(model="m", messages=messages, temperature=0, extra_body=PARENT,
                                                   **kw)


# -- answers ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [32, 3], ids=["whole", "cut"])
def test_create_gives_the_text_a_chat_completion_of_the_same_messages_gives(server, max_tokens):
    """instructions + input items against system + messages: the same greedy text and token counts; a whole answer
    is `completed`, one cut by max_output_tokens `incomplete` (reason max_output_tokens)."""
    r = _create(server, instructions="Be brief.", max_output_tokens=max_tokens,
                input=[{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi!"},
                       {"type": "message", "role": "user", "content": [{"type": "input_text", "text": SHORT}]}])
    chat = _chat(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."},
                          {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": SHORT}],
                 max_tokens=max_tokens)
    c = chat.choices[0]
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == c.message.content
    assert (r.status, c.finish_reason) in (("completed", "stop"), ("incomplete", "length"))
    assert (r.incomplete_details is None) == (r.status == "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and max_tokens == 3
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.model_extra["specquant"]["policy"] == "parent"


@pytest.mark.slow
def test_stream_is_the_documented_sequence_of_events(server):
    """responses.stream: created, in_progress, the message's item and part, its text deltas, their ends, completed
    (its response the one create gives), numbered in order; a cut answer ends with response.incomplete."""
    whole = _create(server)
    with server.client().responses.stream(model="m", input=SHORT, max_output_tokens=32, temperature=0,
                                          extra_body=PARENT) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == final.output_text == whole.output_text and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id == events[0].response.id
    cut = _stream_events(server, max_output_tokens=1)
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert cut[-1].response.output[0].status == "incomplete"


@pytest.mark.slow
def test_json_schema_output_parses_and_matches_the_chat_answer(server):
    parsed = server.client().responses.parse(model="m", input=EXTRACT, text_format=City, max_output_tokens=64,
                                             temperature=0, extra_body=PARENT)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)
    chat = server.client().chat.completions.parse(model="m", messages=[{"role": "user", "content": EXTRACT}],
                                                  response_format=City, max_tokens=64, temperature=0,
                                                  extra_body=PARENT)
    assert parsed.output_text == chat.choices[0].message.content
    with server.client().responses.stream(model="m", input=EXTRACT, text_format=City, max_output_tokens=64,
                                          temperature=0, extra_body=PARENT) as stream:
        assert stream.get_final_response().output_parsed == parsed.output_parsed
    obj = _create(server, input="Describe a cat as a JSON object with keys name and color.", max_output_tokens=64,
                  text={"format": {"type": "json_object"}})
    assert obj.status == "completed" and isinstance(json.loads(obj.output_text), dict)


@pytest.mark.slow
def test_a_function_call_round_trip(server):
    """A required call comes back as function_call items (streamed: item added, arguments delta and done, item
    done; the same calls); sent back with its output, the next answer is the chat completion's for that history."""
    r = _create(server, input=ASK_WEATHER, tools=[WEATHER], tool_choice="required", max_output_tokens=96)
    assert r.status == "completed" and r.output and all(o.type == "function_call" for o in r.output)
    for call in r.output:
        assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
        assert set(json.loads(call.arguments)) == {"city", "unit"}
    events = _stream_events(server, input=ASK_WEATHER, tools=[WEATHER], tool_choice="required", max_output_tokens=96)
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" not in kinds
    assert kinds.count("response.function_call_arguments.done") == len(r.output)
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.item.name, e.item.arguments) for e in done] == [(c.name, c.arguments) for c in r.output]
    assert [(c.name, c.arguments) for c in events[-1].response.output] == [(c.name, c.arguments) for c in r.output]

    call = r.output[0]
    items = [{"role": "user", "content": ASK_WEATHER}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}]
    after = _create(server, input=items, tools=[WEATHER], max_output_tokens=24)
    chat = _chat(server, [{"role": "user", "content": ASK_WEATHER},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": call.call_id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}}]},
                          {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C."}],
                 tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                   "parameters", "strict")}}],
                 max_tokens=24)
    assert after.usage.input_tokens == chat.usage.prompt_tokens
    if chat.choices[0].message.tool_calls:
        assert [(o.name, o.arguments) for o in after.output] == \
            [(t.function.name, t.function.arguments) for t in chat.choices[0].message.tool_calls]
    else:
        assert after.output_text == chat.choices[0].message.content


@pytest.mark.slow
def test_a_call_cut_by_max_output_tokens_is_incomplete_and_no_call(server):
    r = _create(server, input=ASK_WEATHER, tools=[WEATHER], tool_choice="required", max_output_tokens=8)
    assert r.status == "incomplete" and r.output == [] and r.output_text == ""
    events = _stream_events(server, input=ASK_WEATHER, tools=[WEATHER], tool_choice="required", max_output_tokens=8)
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.incomplete"]


# -- refusals --------------------------------------------------------------------------------------------------

def _post(server, body: dict, key: str = KEY) -> httpx.Response:
    """POST a body, non-ASCII escaped (a lone surrogate travels as \\ud800)."""
    return httpx.post(server.url + "/v1/responses", content=json.dumps({"model": "m", "max_output_tokens": 4, **body}),
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}, timeout=60)


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}


@pytest.mark.slow
@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": "hi", "tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
     "tools[0].tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools[0].parameters"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_123"}, "conversation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#"}}}},
     "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": "4"}, "max_output_tokens"),
    ({"input": "hi", "temperature": 5}, "temperature"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "call_9",
                                                     "output": "x"}]}, "input[1]"),
    ({"input": [{"role": "user", "content": "hi"}, CALL,
                {"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input[2].call_id"),
    ({"input": [{"role": "user", "content": "hi"}, CALL]}, "input[1]"),
    ({"input": [{"role": "user", "content": "hi"}, {**CALL, "arguments": "{not json"},
                {"type": "function_call_output", "call_id": "call_1", "output": "x"}]}, "input[1].arguments"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"instructions": "Be brief."}, "input"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
], ids=lambda v: None if isinstance(v, dict) else str(v))
def test_bad_input_is_400_naming_the_field(server, body, param):
    r = _post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err


@pytest.mark.slow
def test_the_key_rules_hold_and_harmless_fields_are_taken(server):
    assert _post(server, {"input": "hi"}, key="wrong").status_code == 401
    r = _post(server, {"input": "hi", "store": True, "metadata": {"a": "b"}, "user": "u", "include": [],
                       "reasoning": {"effort": "low"}, "truncation": "disabled", "parallel_tool_calls": False,
                       "text": {"format": {"type": "text"}, "verbosity": "low"}, "service_tier": "auto",
                       "tools": [], "tool_choice": "auto"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["metadata"] == {"a": "b"} and body["parallel_tool_calls"] is False
    with pytest.raises(openai.BadRequestError) as e:
        server.client().responses.create(model="m", input="hi", previous_response_id="resp_1")
    assert "stores no responses" in e.value.message


# -- calls that closed before max_tokens ran out ----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("parallel", [False, True], ids=["one-call", "parallel-calls"])
def test_calls_that_closed_before_max_tokens_ran_out_are_returned_cut_ones_are_not(server, parallel):
    """Where max_tokens cuts only the end of the turn, every call the answer opened closed: they come back, as OpenAI
    returns them (chat plain and streamed, Responses plain and streamed; parallel: two calls), and logprobs.content
    lists no markup token, as content holds none. Cut inside a call, nothing comes back."""
    client = server.client()
    args = {"model": "m", "messages": [{"role": "user", "content": ASK_WEATHER}], "tools": [CHAT_WEATHER],
            "tool_choice": "required", "parallel_tool_calls": parallel, "temperature": 0, "logprobs": True,
            "extra_body": PARENT}
    whole = client.chat.completions.create(max_tokens=200, **args)
    calls = [(t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls]
    assert whole.choices[0].finish_reason == "tool_calls" and len(calls) >= 1 + parallel
    assert whole.choices[0].logprobs.content == []
    n = whole.usage.completion_tokens  # the calls, then the end of the turn

    turn_cut = client.chat.completions.create(max_tokens=n - 1, **args)
    c = turn_cut.choices[0]
    assert turn_cut.usage.completion_tokens == n - 1
    assert c.finish_reason == "tool_calls" and c.message.content is None and c.logprobs.content == []
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == calls
    chunks = [ch for ch in client.chat.completions.create(max_tokens=n - 1, stream=True, **args) if ch.choices]
    assert [(d.function.name, d.function.arguments) for ch in chunks for d in ch.choices[0].delta.tool_calls or []] \
        == calls
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not [e for ch in chunks if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content or []]

    kw = {"input": ASK_WEATHER, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": parallel,
          "max_output_tokens": n - 1}
    r = _create(server, **kw)
    assert r.status == "completed" and [(o.name, o.arguments) for o in r.output] == calls
    events = _stream_events(server, **kw)
    assert events[-1].type == "response.completed"
    assert [(o.name, o.arguments) for o in events[-1].response.output] == calls

    call_cut = client.chat.completions.create(max_tokens=n - 3, **args)  # inside the last call's closing markup
    c = call_cut.choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls and c.message.content == ""
    assert c.logprobs.content == []
    assert _create(server, **{**kw, "max_output_tokens": n - 3}).output == []


# -- the fields of a request -------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("field, value, moved", [
    ("max_tokens", 4, "max_output_tokens"), ("max_completion_tokens", 4, "max_output_tokens"),
    ("response_format", {"type": "json_object"}, "text.format"), ("messages", [{"role": "user", "content": "hi"}],
                                                                  "input"),
    ("n", 2, None), ("presence_penalty", 0, None), ("frequency_penalty", 0.5, None), ("logit_bias", {"1": 5}, None),
    ("prediction", {"type": "content", "content": "x"}, None), ("stop", ["\n"], None), ("logprobs", True, None),
    ("no_such_field", 1, None),
])
def test_fields_the_responses_api_does_not_define_are_refused_by_name(server, field, value, moved):
    """As OpenAI: a chat completion's field, or any other it does not define, is a 400 naming it, never dropped
    without a word (a response_format that shaped nothing, an n that gave one answer)."""
    r = _post(server, {"input": "hi", field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (field, "unknown_parameter") and field in err["message"], err
    if moved:
        assert f"'{moved}'" in err["message"], err


EVERY_FIELD = {  # each field of OpenAI's create-response body, as the openai client, Agents SDK and Codex CLI send them
    "model": "m", "input": "hi", "instructions": "Be brief.", "max_output_tokens": 4, "temperature": 0, "top_p": 1,
    "stream": False, "store": False, "include": [], "parallel_tool_calls": True, "reasoning": {"effort": "low"},
    "text": {"format": {"type": "text"}, "verbosity": "medium"}, "tool_choice": "auto", "tools": [],
    "truncation": "disabled", "user": "u-1", "previous_response_id": None, "metadata": {"run": "42"},
    "prompt_cache_key": "thread-1", "prompt_cache_retention": "24h", "service_tier": "auto",
    "safety_identifier": "s-1", "stream_options": None, "top_logprobs": 0, "background": False, "max_tool_calls": 3,
    "conversation": None, "prompt": None, "client_metadata": {"x-codex-installation-id": "i-1"},
}


@pytest.mark.slow
def test_every_field_openai_defines_and_clients_send_is_taken(server):
    r = _post(server, EVERY_FIELD)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"run": "42"} and r.json()["status"] in ("completed", "incomplete")


@pytest.mark.slow
@pytest.mark.parametrize("metadata, param, ok", [
    ({f"k{i}": "v" for i in range(16)}, None, True),
    ({"k" * 64: "v" * 512}, None, True),
    ("team-a", "metadata", False),
    (["team", "a"], "metadata", False),
    ({f"k{i}": "v" for i in range(17)}, "metadata", False),
    ({"k" * 65: "v"}, "metadata", False),
    ({"team": "v" * 513}, "metadata.team", False),
    ({"team": 5}, "metadata.team", False),
    ({"team": {"a": "b"}}, "metadata.team", False),
    ({"team": "\ud800"}, "metadata.team", False),
], ids=["16-keys", "longest-key-and-value", "a-string", "a-list", "17-keys", "key-of-65", "value-of-513",
        "a-number", "an-object", "lone-surrogate"])
def test_metadata_is_checked_as_openai_documents_it(server, metadata, param, ok):
    """An object of at most 16 string values, keys of at most 64 characters, values of at most 512: repeated in the
    response as sent; anything else a 400 naming it (never echoed unchecked, never a 500)."""
    r = _post(server, {"input": "hi", "metadata": metadata})
    if ok:
        assert r.status_code == 200 and r.json()["metadata"] == metadata, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.slow
@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "\ud800"}]}]},
     "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": []}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": "hi"}, {**CALL, "arguments": {"city": "Paris"}},
                {"type": "function_call_output", "call_id": "call_1", "output": "x"}]}, "input[1].arguments"),
    ({"input": [{"role": "user", "content": "hi"}, {**CALL, "name": None},
                {"type": "function_call_output", "call_id": "call_1", "output": "x"}]}, "input[1].name"),
    ({"input": "hi", "tools": [WEATHER, {"type": "namespace", "name": "ns", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "string"}}]}]}, "tools[1].tools[0].parameters"),
    ({"input": "hi", "tools": [{"type": "web_search"}, {**WEATHER, "description": "\ud800"}]},
     "tools[1].description"),
    ({"input": "hi", "user": "\ud800"}, "user"),
], ids=["text-not-a-string", "text-lone-surrogate", "no-parts", "arguments-an-object", "no-name",
        "namespace-member-parameters", "tool-description", "user"])
def test_refusals_name_the_innermost_field(server, body, param):
    r = _post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err


# -- what agents send ------------------------------------------------------------------------------------------

FILES = {"type": "namespace", "name": "files", "description": "Tools for the files of the workspace", "tools": [
    {"type": "function", "name": "read_file", "description": "Read a file of the workspace", "strict": False,
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
                    "additionalProperties": False}}]}
SHELL = {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
         "strict": False, "parameters": {"type": "object", "properties": {
             "command": {"type": "array", "items": {"type": "string"}}}, "required": ["command"]}}


def _sse(server, body: dict) -> list[dict]:
    """The events of a streamed response, read off the wire (`event:` and `data:` lines)."""
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    return events


@pytest.mark.slow
def test_a_codex_first_request_is_answered_namespace_tools_taken_builtins_left_out_and_said(server):
    """Codex CLI's first request, as it sends it: function tools, a namespace of them, web_search beside them,
    client_metadata and prompt_cache_key, streamed. It is answered (llama-server answers it too), the built-in tool
    left out of what the model sees and said: in the response's specquant.warnings and on the server's log line."""
    body = {"model": "m", "instructions": "You are a coding agent. Be brief.",
            "input": [{"type": "message", "role": "developer", "content": [
                          {"type": "input_text", "text": "<permissions>workspace-write</permissions>"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": SHORT}]}],
            "tools": [SHELL, FILES, {"type": "web_search", "external_web_access": False}], "tool_choice": "auto",
            "parallel_tool_calls": False, "reasoning": None, "store": False, "stream": True, "include": [],
            "prompt_cache_key": "0199a2c4-thread", "client_metadata": {"x-codex-installation-id": "i-1"},
            "max_output_tokens": 24, "temperature": 0, **PARENT}
    events = _sse(server, body)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]["response"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete") and final["output"]
    [warning] = final["specquant"]["warnings"]
    assert warning.startswith("tools[2] (web_search) was left out")
    assert events[0]["response"]["specquant"]["warnings"] == [warning]
    assert wait_for(lambda: any("/v1/responses 200" in line and "(warning: tools[2] (web_search) was left out" in line
                                for line in server.lines), timeout=10)  # the log line comes once the stream ended


@pytest.mark.slow
def test_a_call_of_a_namespace_function_names_its_namespace_and_goes_back_in_input(server):
    r = _create(server, input="Read the file README.md", tools=[FILES, {"type": "web_search"}],
                tool_choice={"type": "function", "name": "read_file"}, max_output_tokens=96)
    [call] = r.output
    assert r.status == "completed" and call.type == "function_call" and call.name == "read_file"
    assert call.namespace == "files" and set(json.loads(call.arguments)) == {"path"}
    after = _create(server, input=[{"role": "user", "content": "Read the file README.md"},
                                   call.model_dump(exclude_none=True),
                                   {"type": "function_call_output", "call_id": call.call_id, "output": "# specquant"}],
                    tools=[FILES], max_output_tokens=8)
    assert after.status in ("completed", "incomplete") and after.usage.input_tokens > r.usage.input_tokens


def test_serve_help_names_every_endpoint():
    r = run_cli(["serve", "--help"])
    assert r.exit_code == 0
    for endpoint in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models"):
        assert endpoint in r.stdout, endpoint
