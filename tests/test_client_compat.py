"""What agent builders' client libraries meet on `specquant serve`, with the official `openai` client over real HTTP on
the smollm2-135m family: an answer cut inside a tool call (or a parallel set of them) is no call and shows no markup,
streamed or not; a stop string that cuts a constrained answer makes it cut ("length"); under tool_choice "auto" a
text answer may begin with "<"; empty content is taken in every role and rendered; a max_tokens that does not fit is
refused naming the field and the numbers; a history whose calls and results do not link up is refused, as are
non-object parameters; a self-referencing $ref and integers past 64 bits get messages that name the input.

One server for the module (--parallel 1, one thread); comparisons run the parent alone (greedy), so two requests for
the same prompt decode the same batches."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_serve import KEY, ServerProc

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What's the weather in Paris, in celsius?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
EXTRACT = [{"role": "user", "content": "Extract the person as JSON: Maria Lopez is 34 and lives in Madrid."}]
PARENT = {"specquant_policy": "parent"}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(family_dir):
    s = ServerProc(["--family", str(family_dir), "--api-key", KEY, "--parallel", "1"])
    yield s
    s.stop()


def _chat(server, **kw):
    args = {"model": "m", "messages": ASK_WEATHER, "max_tokens": 96, "temperature": 0, "extra_body": PARENT, **kw}
    return server.client().chat.completions.create(**args)


def _streamed(server, **kw) -> tuple[str, list, str]:
    """(content, calls as (name, arguments), finish_reason) of a streamed chat answer."""
    content, calls, finish = "", {}, None
    for chunk in _chat(server, stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            calls.setdefault(tc.index, ["", ""])
            calls[tc.index][0] += tc.function.name or ""
            calls[tc.index][1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(c) for _, c in sorted(calls.items())], finish


def _refused(server, body: dict, path: str = "/v1/chat/completions") -> dict:
    """The error of a request that must be a 400 in OpenAI's shape."""
    r = httpx.post(server.url + path, json={"model": "m", "max_tokens": 4, **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# -- cut answers ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_tool_call_cut_by_max_tokens_is_no_call_and_shows_no_markup(server):
    """One call cut short, and a parallel set cut inside its last call (its first call finished): neither returns
    calls nor any of their markup, streamed or not; the finish reason says the answer was cut."""
    whole = _chat(server, tools=[WEATHER], tool_choice="required")
    assert whole.choices[0].finish_reason == "tool_calls" and len(whole.choices[0].message.tool_calls) >= 2
    inside_last = whole.usage.completion_tokens - 3
    for max_tokens in (8, inside_last):
        r = _chat(server, tools=[WEATHER], tool_choice="required", max_tokens=max_tokens)
        c = r.choices[0]
        assert (c.finish_reason, c.message.content, c.message.tool_calls) == ("length", "", None), c
        assert _streamed(server, tools=[WEATHER], tool_choice="required", max_tokens=max_tokens) == ("", [], "length")


@pytest.mark.slow
def test_a_stop_string_that_cuts_a_constrained_answer_makes_it_cut(server):
    """A stop string inside a json_schema answer or a tool call: "length" (never "stop" with unfinished JSON, never
    calls), streamed or not; one that comes after the JSON's end changes nothing."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = _chat(server, messages=EXTRACT, response_format=fmt)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop" and json.loads(text)
    r = _chat(server, messages=EXTRACT, response_format=fmt, stop=['"city"'])
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == text[:text.index('"city"')]
    content, _, finish = _streamed(server, messages=EXTRACT, response_format=fmt, stop=['"city"'])
    assert (content, finish) == (r.choices[0].message.content, "length")
    assert _chat(server, messages=EXTRACT, response_format=fmt, stop=["}}"]).choices[0].finish_reason == "stop"
    r = _chat(server, tools=[WEATHER], tool_choice="required", stop=['"unit"'])
    assert (r.choices[0].finish_reason, r.choices[0].message.content, r.choices[0].message.tool_calls) == \
        ("length", "", None)
    assert _streamed(server, tools=[WEATHER], tool_choice="required", stop=['"unit"']) == ("", [], "length")


# -- tool_choice auto ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_auto_keeps_a_text_answer_that_begins_with_a_tag(server):
    """Under tool_choice "auto" a text answer may begin with "<": the parent's greedy text is the one it gives with
    the same tools under "none" (where nothing holds it), streamed too."""
    ask = [{"role": "user", "content": "Output only this text: <b>bold</b>"}]
    none = _chat(server, messages=ask, tools=[WEATHER], tool_choice="none", max_tokens=10)
    text = none.choices[0].message.content
    assert text.startswith("<b>")
    auto = _chat(server, messages=ask, tools=[WEATHER], tool_choice="auto", max_tokens=10)
    assert auto.choices[0].message.content == text and auto.choices[0].message.tool_calls is None
    assert _streamed(server, messages=ask, tools=[WEATHER], max_tokens=10)[:2] == (text, [])


# -- empty content -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_empty_content_is_taken_in_every_role_and_rendered(server):
    """An empty system prompt, an empty user or assistant turn, an empty text part, an empty tool result: answered
    (not 400), each rendered by the chat template as a turn of its own: the prompt is not the one without it (an empty
    system prompt replaces the template's default one), and one character more in it is one token more."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": '{"city": "Paris", "unit": "c"}'}}

    def conversation(text: str) -> list[list[dict]]:
        return [[{"role": "system", "content": text}, *HI],
                [*HI, {"role": "assistant", "content": text}, *HI],
                [*HI, {"role": "assistant", "content": text}, {"role": "user", "content": text}],
                [{"role": "user", "content": [{"type": "text", "text": text}]}, *HI],
                [*HI, {"role": "assistant", "content": text, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_1", "content": text}]]

    def prompt_tokens(messages) -> int:
        r = _chat(server, messages=messages, max_tokens=1)
        assert r.choices[0].finish_reason in ("stop", "length")
        return r.usage.prompt_tokens

    without = [HI, [*HI, *HI], [*HI], HI, None]
    for empty, one, alone in zip(conversation(""), conversation("x"), without):
        n = prompt_tokens(empty)
        if alone is None:  # calls and results, written as plain turns for this template: "x" joins their markup
            assert n > prompt_tokens(HI)
            continue
        assert n != prompt_tokens(alone), empty
        places = json.dumps(one).count('"x"')
        assert prompt_tokens(one) - n == places, empty  # "x" in each empty place is one token


# -- refusals that name the field ----------------------------------------------------------------------------

@pytest.mark.slow
def test_a_max_tokens_that_does_not_fit_names_the_field_and_the_numbers(server):
    n_prompt = _chat(server, messages=HI, max_tokens=1).usage.prompt_tokens
    for body, param, path in [({"messages": HI, "max_tokens": 5000}, "max_tokens", "/v1/chat/completions"),
                              ({"messages": HI, "max_completion_tokens": 5000}, "max_completion_tokens",
                               "/v1/chat/completions"),
                              ({"prompt": "hi", "max_tokens": 5000}, "max_tokens", "/v1/completions")]:
        err = _refused(server, body, path)
        assert err["param"] == param and "5000" in err["message"] and "4096" in err["message"], err
        assert "--max-tokens" not in err["message"]
    err = _refused(server, {"messages": HI, "max_tokens": 5000})
    assert f"prompt is {n_prompt} tokens" in err["message"] and f"at most {4096 - n_prompt}" in err["message"]
    err = _refused(server, {"messages": [{"role": "user", "content": "word " * 5000}]})
    assert err["param"] == "messages" and "context holds 4096" in err["message"], err


def _call(cid="call_1", **kw) -> dict:
    return {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}, **kw}


ANSWERED = [*HI, {"role": "assistant", "content": None, "tool_calls": [_call()]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.mark.slow
@pytest.mark.parametrize("messages, param, says", [
    ([*HI, {"role": "assistant", "content": None, "tool_calls": [_call()]},
      {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}], "messages[2].tool_call_id", "answers no call"),
    ([*HI, {"role": "assistant", "content": None, "tool_calls": [_call()]},
      {"role": "tool", "content": "sunny"}], "messages[2].tool_call_id", "tool_call_id"),
    ([*HI, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "messages[1].role", "must follow"),
    ([*HI, {"role": "assistant", "content": None, "tool_calls": [_call()]}, *HI], "messages[1].tool_calls[0]",
     "no tool message answering it"),
    ([*HI, {"role": "assistant", "content": None, "tool_calls": [_call(), _call("call_2")]},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "messages[1].tool_calls[1]", "'call_2'"),
    ([*ANSWERED, {"role": "tool", "tool_call_id": "call_1", "content": "again"}], "messages[3].tool_call_id",
     "answered already"),
    ([*HI, {"role": "assistant", "content": None, "tool_calls": [_call(type="custom")]},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "messages[1].tool_calls[0].type", "custom"),
    ([*HI, {"role": "assistant", "content": None, "tool_calls": [_call(id=None)]}], "messages[1].tool_calls[0].id",
     "id"),
], ids=["unknown-id", "no-id", "no-call-before", "unanswered", "one-of-two-unanswered", "answered-twice",
        "custom-call", "call-without-id"])
def test_a_history_whose_calls_and_results_do_not_link_is_400(server, messages, param, says):
    err = _refused(server, {"messages": messages, "tools": [WEATHER]})
    assert err["param"] == param and says in err["message"], err


@pytest.mark.slow
def test_parameters_that_are_not_an_object_schema_are_400_and_untyped_ones_describe_an_object(server):
    """A function's arguments are a JSON object: parameters of another type are refused naming the field; parameters
    without a type are an object's (the call's arguments parse as one)."""
    for parameters in ({"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                       {"type": ["object", "null"]}):
        err = _refused(server, {"messages": HI, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": parameters}}]})
        assert err["param"] == "tools[0].function.parameters" and "object" in err["message"], err
    untyped = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    r = _chat(server, tools=[untyped], tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    assert all(isinstance(json.loads(t.function.arguments), dict) for t in r.choices[0].message.tool_calls)


@pytest.mark.slow
@pytest.mark.parametrize("schema, says", [
    ({"$defs": {"A": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}, "$ref '#/$defs/A' leads back to itself"),
    ({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"allOf": [{"$ref": "#/$defs/A"}]}}, "type": "object",
      "properties": {"a": {"$ref": "#/$defs/A"}}}, "leads back to itself"),
    ({"type": "object", "properties": {"n": {"type": "integer", "maximum": 10**30}}},
     "integer 10000000000000000000... (31 digits) at /properties/n/maximum"),
    ({"enum": [2**64]}, "at /enum/0: a schema's integers fit in 64 bits"),
], ids=["self-ref", "ref-cycle", "big-maximum", "big-enum"])
def test_a_schema_the_engine_cannot_take_gets_a_message_naming_it(server, schema, says):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    err = _refused(server, {"messages": HI, "response_format": fmt})
    assert err["param"] == "response_format.json_schema.schema" and says in err["message"], err
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": schema}}}}
    if "$defs" not in schema:  # a tool's parameters are the root of their own $refs
        err = _refused(server, {"messages": HI, "tools": [tool]})
        assert err["param"] == "tools[0].function.parameters" and "64 bits" in err["message"], err


@pytest.mark.slow
def test_a_linked_history_is_taken_and_a_result_of_no_call_is_not(server):
    r = _chat(server, messages=[*ANSWERED, {"role": "user", "content": "And tomorrow?"}], tools=[WEATHER],
              max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, messages=[*HI, {"role": "tool", "tool_call_id": "x", "content": "y"}])
    assert e.value.body["param"] == "messages[1].role"
    r = _chat(server, messages=HI, max_tokens=2)  # and the server answers on
    assert r.choices[0].finish_reason in ("stop", "length")
