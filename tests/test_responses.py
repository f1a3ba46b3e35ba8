"""The Responses API (`POST /v1/responses`) for real, driven by the official `openai` client's `responses.create`,
`responses.stream` and `responses.parse` on the smollm2-135m family: the text a chat completion of the same messages
gives (greedy), the documented stream of events, json_schema output, a function-call round trip (the call's output
sent back in `input`), a cut answer `incomplete` and never a call; and the refusals, each a 400 in OpenAI's error
shape naming the field: unknown item types, built-in tools, `previous_response_id` (nothing is stored), a schema that
cannot compile, non-text content.

One server for the module (--parallel 1, one thread); comparisons run the parent alone."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel
from test_serve import KEY, ServerProc

PARENT = {"specquant_policy": "parent"}
SHORT = "Reply with one word: yes or no. Is the sky blue?"  # the parent's greedy answer ends in a few tokens
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}, "strict": True}
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
    return httpx.post(server.url + "/v1/responses", json={"model": "m", "max_output_tokens": 4, **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}


@pytest.mark.slow
@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
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
