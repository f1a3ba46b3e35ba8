"""Structured output for real: `response_format` (json_object, json_schema), `tools` with every `tool_choice`,
streamed tool calls, the history's tool calls and results, and `logprobs` — on `specquant serve` driven by the
official `openai` client (its `.parse()` with a pydantic model too), and the engine's constrained answers against
the constrained parent's own, greedy and sampled, on the smollm2-135m family. Plus the refusals: schemas the engine
cannot compile, unknown tool names, invalid parameter schemas, a 10,000-level and a 1 MB schema."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from test_serve import KEY, ServerProc

from specquant_cli.decoding import grammar as G
from specquant_cli.decoding.sampling import SamplingParams
from specquant_cli.toolcalls import ToolStream, parse, render_messages

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"},
                                           "hobbies": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
EXTRACT = "Extract the person as JSON: Maria Lopez is 34, lives in Madrid and likes chess, hiking and jazz."
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
ASK_WEATHER = [{"role": "user", "content": "What's the weather in Paris, in celsius?"}]
N = 96


class Person(BaseModel):
    name: str
    age: int
    city: str
    hobbies: list[str]


@pytest.fixture(scope="module")
def server(family_dir):
    s = ServerProc(["--family", str(family_dir), "--api-key", KEY, "--parallel", "2"])
    yield s
    s.stop()


def _chat(server, **kw):
    args = {"model": "m", "messages": [{"role": "user", "content": EXTRACT}], "max_tokens": N, "temperature": 0, **kw}
    return server.client().chat.completions.create(**args)


# -- the server ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("policy", ["parent", "spec-q4", "auto"])
def test_parse_with_a_pydantic_model_gives_the_constrained_parents_answer(server, policy):
    got = server.client().chat.completions.parse(
        model="m", messages=[{"role": "user", "content": EXTRACT}], response_format=Person, max_tokens=N,
        temperature=0, extra_body={"specquant_policy": policy})
    msg = got.choices[0].message
    assert got.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Person)
    jsonschema.validate(json.loads(msg.content), Person.model_json_schema())
    parent = server.client().chat.completions.parse(
        model="m", messages=[{"role": "user", "content": EXTRACT}], response_format=Person, max_tokens=N,
        temperature=0, extra_body={"specquant_policy": "parent"})
    assert msg.content == parent.choices[0].message.content  # greedy: the constrained parent's own answer


@pytest.mark.slow
def test_json_object_and_json_schema_answers_parse_and_validate(server):
    obj = _chat(server, response_format={"type": "json_object"},
                messages=[{"role": "user", "content": "Describe a cat as a JSON object with keys name and color."}])
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for policy in ("parent", "spec-q4", "suffix"):
        r = _chat(server, response_format=fmt, temperature=0.9, seed=11, extra_body={"specquant_policy": policy})
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        assert r.model_extra["specquant"]["policy"] == policy


@pytest.mark.slow
def test_a_json_answer_cut_by_max_tokens_is_length_not_stop(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = _chat(server, response_format=fmt, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(r.choices[0].message.content)


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_or_named_tool_call_comes_back_as_tool_calls(server, choice):
    r = _chat(server, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice=choice)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        params = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), params)


@pytest.mark.slow
def test_tool_calls_stream_as_deltas_equal_to_the_whole_answer(server):
    whole = _chat(server, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required")
    stream = _chat(server, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", stream=True)
    calls, finish, content = {}, None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            calls.setdefault(tc.index, {"name": "", "arguments": ""})
            calls[tc.index]["name"] += tc.function.name or ""
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in whole.choices[0].message.tool_calls]


@pytest.mark.slow
def test_auto_and_none_may_answer_in_text_and_history_carries_tool_results(server):
    none = _chat(server, messages=[{"role": "user", "content": "Say hi."}], tools=[WEATHER], tool_choice="none")
    assert none.choices[0].finish_reason in ("stop", "length") and none.choices[0].message.tool_calls is None
    first = _chat(server, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    after = _chat(server, messages=history, tools=[WEATHER], tool_choice="auto")
    c = after.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    if c.finish_reason == "tool_calls":
        for t in c.message.tool_calls:
            jsonschema.validate(json.loads(t.function.arguments), WEATHER["function"]["parameters"])
    elif c.finish_reason == "stop":  # text: it cannot have opened a call
        assert c.message.tool_calls is None and not c.message.content.lstrip().startswith("<tool_call>")


@pytest.fixture(scope="module")
def exact_server(family_dir):
    """One sequence at a time, in the deterministic mode: every policy's numbers are the parent's bit for bit."""
    s = ServerProc(["--family", str(family_dir), "--api-key", KEY, "--parallel", "1", "--deterministic"])
    yield s
    s.stop()


@pytest.mark.slow
def test_logprobs_are_the_parents_and_name_each_token(exact_server):
    server = exact_server
    r = _chat(server, max_tokens=8, logprobs=True, top_logprobs=3, extra_body={"specquant_policy": "spec-q4"})
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.top_logprobs[0].token == e.token  # greedy: the parent's most likely token
        assert bytes(e.bytes).decode() == e.token
    parent = _chat(server, max_tokens=8, logprobs=True, top_logprobs=3, extra_body={"specquant_policy": "parent"})
    for a, b in zip(content, parent.choices[0].logprobs.content):
        assert a.token == b.token and a.logprob == b.logprob  # the same numbers, whatever the batch
    streamed = _chat(server, max_tokens=8, logprobs=True, stream=True)
    tokens = [e.token for ch in streamed if ch.choices and ch.choices[0].logprobs
              for e in ch.choices[0].logprobs.content]
    assert "".join(tokens) == r.choices[0].message.content


@pytest.mark.slow
@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"pattern": "("}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
])
def test_bad_structure_is_400_naming_the_field(server, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, max_tokens=4, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert set(e.value.body) == {"message", "type", "param", "code"}


def _huge_schema() -> dict:
    """A schema of 1 MB (10^6 bytes and a little more): its request fits the default 1 MiB body."""
    props = {f"p{i}": {"type": "string", "description": "x" * 80} for i in range(8000)}
    schema = {"type": "object", "properties": props}
    while len(json.dumps(schema)) < 1_000_000:
        props[f"q{len(props)}"] = {"type": "string", "description": "x" * 80}
    return schema


@pytest.mark.slow
def test_a_deep_or_huge_schema_is_400_never_a_500_or_a_hang(server):
    deep = '{"type": "array", "items": ' * 10_000 + '{"type": "string"}' + "}" * 10_000  # json.dumps would recurse
    for schema, says in ((deep, "nested deeper"), (json.dumps(_huge_schema()), "larger than")):
        data = ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": '
                '{"type": "json_schema", "json_schema": {"name": "x", "schema": ' + schema + "}}}")
        assert len(data) < 1 << 20
        r = httpx.post(server.url + "/v1/chat/completions", content=data,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- the engine ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def session(family_dir):
    from specquant_cli.session import open_session
    from specquant_cli.settings import SessionSettings

    s = open_session(SessionSettings(family=family_dir, n_ctx=1024, threads=1))
    yield s
    s.runtime.close()


def _answer(session, messages, policy, sp, grammar, tools=None, max_tokens=N):
    session.runtime.reset_caches()
    _, recs = session.ask_messages(messages, policy=policy, sampling=sp, max_tokens=max_tokens, grammar=grammar,
                                   tools=tools)
    recs = list(recs)
    return "".join(r.text for r in recs), [r.token for r in recs if r.token is not None], recs[-1]


def own_constrained(session, messages, tools, grammar, sp, n) -> tuple[list[int], list[float]]:
    """The constrained parent's own answer, one token a call: each token its pick among what the grammar allows
    (argmax, or its Gumbel-max sample with the answer's noise), with how far that pick's score led the next allowed
    candidate's (log units)."""
    import numpy as np

    from specquant_cli.decoding.sampling import Noise, probs, sample_margin

    model = session.runtime.tokenizer()
    ctx = session.runtime.pool.context("f16" if "f16" in session.runtime.pool.loaded() else "parent")
    c, noise = G.Constraint(grammar, model), Noise(sp.seed or 0)
    seq = model.chat_prompt(messages, tools)
    ctx.rewind(0)
    ctx.sync(seq[:-1], logits="none")
    tokens, margins = [], []
    for _ in range(n):
        ctx.decode([seq[-1]], logits="last")
        x = c.masked(np.array(ctx.logits(-1)))
        if sp.greedy:
            t, second = np.argsort(-x)[:2]
            margin = float(x[t] - x[second])
        else:
            p = probs(x, sp)
            t, margin = sample_margin(p, noise.at(len(seq), p.shape[0]))
        c.consume(int(t))
        if t in model.eog_ids:  # the answer's records end before it
            break
        tokens.append(int(t))
        margins.append(margin)
        seq.append(int(t))
    return tokens, margins


@pytest.mark.slow
@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(temperature=0.9, seed=5)], ids=["greedy", "sampled"])
def test_every_policy_gives_the_constrained_parents_answer(session, sp):
    """Greedy: token for token. Sampled: the parent's own samples, parting (if at all) only where its sample led the
    next allowed candidate by less than the batch shapes' noise (conftest.SAMPLED_NOISE)."""
    from conftest import SAMPLED_NOISE

    model = session.runtime.tokenizer()
    cases = [(G.json_schema(PERSON), [{"role": "user", "content": EXTRACT}], None),
             (G.tool_calls({"get_weather": WEATHER["function"]["parameters"]}, model, required=True), ASK_WEATHER,
              [WEATHER])]
    for grammar, messages, tools in cases:
        G.check(grammar, model)
        ref, margins = own_constrained(session, messages, tools, grammar, sp, N)
        for policy in ("parent", "spec-q4", "auto"):
            text, tokens, last = _answer(session, messages, policy, sp, grammar, tools)
            if tokens[:len(ref)] != ref:
                at = next(i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b)
                assert not sp.greedy and margins[at] < SAMPLED_NOISE, (policy, at, margins[at], text)
            elif last.finish_reason == "stop":
                assert grammar.validate(text) is None, text
            if policy == "parent":
                assert last.forced == 0 and last.parent_calls == last.new_tokens  # alone: a call per token
            else:
                assert last.forced_accepted > 0  # the grammar's forced tokens were proposed and kept


def test_the_grammar_mask_and_forced_tokens(family_dir):
    from specquant_cli.backend.llama import Model

    model = Model(next(family_dir.glob("*q8_0.gguf")), vocab_only=True)
    c = G.Constraint(G.json_schema(PERSON), model)
    first = c.forced()
    assert model_text(model, first).startswith('{"name":')  # the first required key is forced
    row = model_logits_favouring(model, model.tokenize("Sure", add_bos=False)[0])
    masked = c.masked(row)
    assert masked[model.tokenize("Sure", add_bos=False)[0]] == float("-inf") and masked.max() > float("-inf")
    tokens = model.tokenize('{"name": "Ann", "age": 3, "city": "X", "hobbies": []}', add_bos=False)
    assert c.valid_prefix(tokens + model.tokenize(" trailing", add_bos=False)) == len(tokens)
    for t in tokens:
        c.consume(t)
    assert c.done and set(np_nonzero(c.allowed())) <= set(model.eog_ids)
    with pytest.raises(Exception, match="not allowed"):
        c.consume(model.tokenize("x", add_bos=False)[0])


def model_text(model, tokens) -> str:
    return b"".join(model.piece(t) for t in tokens).decode()


def model_logits_favouring(model, token):
    import numpy as np

    row = np.zeros(model.n_vocab, dtype=np.float32)
    row[token] = 10.0
    return row


def np_nonzero(a):
    import numpy as np

    return np.nonzero(a)[0].tolist()


def test_tool_stream_and_history_rendering():
    s = ToolStream()
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", ' \
           '"arguments": {}}\n</tool_call>'
    items = [x for i in range(0, len(text), 7) for x in s.feed(text[i:i + 7])]
    assert items == [("call", {"name": "f", "arguments": {"a": 1}}), ("call", {"name": "g", "arguments": {}})]
    assert parse(text) == [x for _, x in items]
    t = ToolStream()
    assert t.feed("<to") == [] and t.feed("day") == [("text", "<today")]
    with pytest.raises(ValueError):
        parse('<tool_call>\n{"name": "f"')
    msgs = render_messages([{"role": "user", "content": "q"},
                            {"role": "assistant", "content": None, "tool_calls": [
                                {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
                            {"role": "tool", "content": "42", "tool_call_id": "1"}], [WEATHER])
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}


# -- the command line and the bench -------------------------------------------------------------------------------

CAPITAL = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
           "required": ["country", "capital"], "additionalProperties": False}


@pytest.mark.slow
def test_chat_json_schema_prints_only_valid_json_from_argument_and_pipe(family_dir, tmp_path):
    from conftest import run_cli

    schema = tmp_path / "capital.json"
    schema.write_text(json.dumps(CAPITAL))
    args = ["chat", "--family", str(family_dir), "--json-schema", str(schema), "--max-tokens", "48"]
    one = run_cli([*args, "What is the capital of France?"])
    assert one.exit_code == 0, one.stderr
    jsonschema.validate(json.loads(one.stdout), CAPITAL)
    piped = run_cli([*args, "--each-line", "--policy", "spec-q4"],
                    input="What is the capital of France?\nWhat is the capital of Spain?\n")
    assert piped.exit_code == 0, piped.stderr
    lines = piped.stdout.splitlines()
    assert len(lines) == 2 and lines[0] == one.stdout.strip()  # greedy: the constrained parent's answer
    for line in lines:
        jsonschema.validate(json.loads(line), CAPITAL)


@pytest.mark.slow
@pytest.mark.parametrize("content, needle", [
    ('{"type": 5}', "cannot be compiled"),
    ("[", "is not JSON"),
    ("[" * 100_000, "nests too deep"),
    ('"just a string"', "must be a JSON object"),
    ("x" * (G.MAX_SCHEMA_BYTES + 1), "larger than"),
    (None, "no such file"),
])
def test_chat_json_schema_refuses_a_bad_file_in_one_line(family_dir, tmp_path, content, needle):
    from conftest import run_cli

    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    r = run_cli(["chat", "--family", str(family_dir), "--json-schema", str(path), "hi"])
    assert r.exit_code == 1 and r.stdout == ""
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("cut, says", [(["--max-tokens", "3"], "before its JSON was complete"),
                                       (["--stop", ","], "not valid for the schema")])
def test_chat_json_schema_cut_by_max_tokens_or_a_stop_string_exits_1(family_dir, tmp_path, cut, says):
    from conftest import run_cli

    schema = tmp_path / "capital.json"
    schema.write_text(json.dumps(CAPITAL))
    r = run_cli(["chat", "--family", str(family_dir), "--json-schema", str(schema), *cut, "France?"])
    assert r.exit_code == 1 and says in r.stderr


@pytest.mark.slow
def test_bench_structured_reports_validity_forced_tokens_and_identity(family_dir, tmp_path):
    from conftest import run_cli

    out = tmp_path / "s.json"
    r = run_cli(["bench", "prompts", "--family", str(family_dir), "--structured", "--categories", "json,tools",
                 "--limit", "1", "--policies", "parent,spec-q4", "--max-tokens", "64", "--warmup", "0",
                 "--json-file", str(out)])
    assert r.exit_code == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["config"]["datasets"] == ["structured"]
    recs = [x for x in rep["records"] if x["policy"] in ("parent", "spec-q4")]
    assert {x["category"] for x in recs} == {"json", "tools"}
    for x in recs:
        assert x["valid"] in (True, None) and (x["valid"] is None) == (x["finish_reason"] != "stop")
        assert x["fidelity"] in (None, "identical", "near-tie")
    spec = [x for x in recs if x["policy"] == "spec-q4"]
    assert all(x["forced_accepted"] > 0 for x in spec)
    summary = {s["policy"]: s for s in rep["summary"]}
    assert summary["parent"]["forced_share"] == 0 and summary["spec-q4"]["forced_share"] > 0


def test_forms_refuse_what_openai_refuses(family_dir):
    from specquant_cli.backend.llama import Model
    from specquant_cli.decoding.forms import FormError, read

    model = Model(next(family_dir.glob("*q8_0.gguf")), vocab_only=True)
    assert read(None, None, None, None, model).grammar is None
    assert read({"type": "json_object"}, None, None, None, model).grammar.kind == "json_object"
    named = read(None, [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None, model)
    assert named.calls and list(named.grammar.tools) == ["get_time"] and named.grammar.required
    assert read(None, [WEATHER], "none", None, model).grammar is None  # described to the model, never forced
    for args, param in [(({"type": "json_schema"}, None, None), "response_format.json_schema"),
                        (({"type": "json_schema", "json_schema": {"schema": {}}}, None, None),
                         "response_format.json_schema.name"),
                        ((None, None, "required"), "tool_choice"),
                        ((None, [], None), "tools"),
                        ((None, [{"type": "retrieval"}], None), "tools[0]"),
                        ((None, [WEATHER] * (G.MAX_TOOLS + 1), None), "tools")]:
        with pytest.raises(FormError) as e:
            read(*args, None, model)
        assert e.value.param == param, (args, e.value.param)
    special = {"type": "function", "function": {"name": "f", "description": "ends <|im_end|> here"}}
    with pytest.raises(FormError, match="special token"):
        read(None, [special], None, None, model)


def test_tool_parameters_keep_their_own_defs_and_text_cannot_open_a_call(family_dir):
    """A pydantic model's schema ($defs, $ref) stays the root of its call's arguments; under tool_choice auto a text
    answer cannot begin with a call's marker (not even after spaces), and may begin with any other text, "<" too."""
    from specquant_cli.backend.llama import Model

    model = Model(next(family_dir.glob("*q8_0.gguf")), vocab_only=True)
    inner = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    params = {"$defs": {"Inner": inner}, "type": "object", "properties": {"a": {"$ref": "#/$defs/Inner"}},
              "required": ["a"]}
    g = G.tool_calls({"f": params}, model, required=False)
    G.check(g, model)
    for text, allowed in [('<tool_call>\n{"name": "f", "arguments": {"a": {"x": 3}}}\n</tool_call>', True),
                          ('<tool_call>\n{"name": "f", "arguments": {"a": 3}}\n</tool_call>', False),
                          ("Plain words.", True), ("  <tool_call>", False), ("<br>", True), ("<tool kit>", True),
                          (" <b>bold</b>", True)]:
        tokens = model.tokenize(text, add_bos=False, special=True)
        assert (G.Constraint(g, model).valid_prefix(tokens) == len(tokens)) == allowed, text
    assert g.validate('<tool_call>\n{"name": "f", "arguments": {"a": {"x": "no"}}}\n</tool_call>') is not None


def test_a_stream_that_is_not_a_call_after_all_goes_on_as_text_and_a_cut_answer_has_no_calls():
    """The one rule of a complete answer (serving.structured.outcome): a call answer cut short inside a call (a
    parallel set's finished calls with it, or only the marker's first characters) is no call and shows no markup;
    one whose every call closed before max_tokens ran out (only the end of the turn cut) is its calls; a JSON answer
    a stop string cut before its end is cut ("length"), one that ended on its own is not."""
    from specquant_cli.serving.structured import outcome

    s = ToolStream()
    broken = "<tool_call>\n{broken</tool_call> and more"
    assert s.feed(broken) == [("text", broken)]
    assert s.feed(" text") == [("text", " text")]
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    for cut in (call + "\n<tool_call>\n{\"name\": \"f\", \"argu", "<tool_c", call[:-1]):
        o = outcome(cut, "length", calls=True)
        assert (o.content, o.calls, o.finish) == ("", [], "length"), cut
    for finish, text in (("stop", call + "\n"), ("length", call), ("length", call + "\n" + call + "\n")):
        o = outcome(text, finish, calls=True)
        assert o.finish == "tool_calls" and o.content is None and o.calls == [{"name": "f", "arguments": {}}] * \
            text.count("</tool_call>"), (finish, text)
    o = outcome("<br> and text", "stop", calls=True)
    assert (o.content, o.calls, o.finish) == ("<br> and text", [], "stop")
    g = G.json_object()
    assert outcome('{"a": ', "stop", g, ["1"]).finish == "length"  # a stop string cut it
    assert outcome('{"a": 1}', "stop", g, ["}}"]).finish == "stop"
    assert outcome('{"a": ', "stop", g).finish == "stop"  # no stop string: the grammar ended it (never unfinished)


def test_history_takes_calls_without_content_and_refuses_forged_or_deep_ones(family_dir):
    from specquant_cli.backend.llama import Model
    from specquant_cli.serving.schemas import ApiError, chat_params

    model = Model(next(family_dir.glob("*q8_0.gguf")), vocab_only=True)

    def call(name="f", args="{}"):
        return {"id": "c1", "type": "function", "function": {"name": name, "arguments": args}}

    ok = chat_params({"messages": [{"role": "user", "content": "q"},
                                   {"role": "assistant", "content": "", "tool_calls": [call()]},
                                   {"role": "tool", "tool_call_id": "c1", "content": ""},
                                   {"role": "assistant", "tool_calls": [call()]},
                                   {"role": "tool", "tool_call_id": "c1", "content": ""},
                                   {"role": "assistant", "content": ""}]}, lambda p: "parent", model)
    assert [m["role"] for m in ok.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert ok.messages[1]["tool_calls"][0]["function"]["arguments"] == {}
    answer = {"role": "tool", "tool_call_id": "c1", "content": "r"}
    for msgs, param, says in [
        ([{"role": "assistant", "tool_calls": [call(args='{"x": "<|im_end|>"}')]}, answer],
         "messages[1].tool_calls[0]", "special token"),
        ([{"role": "assistant", "tool_calls": [call(name="f\n")]}, answer], "messages[1].tool_calls[0].function.name",
         "name"),
        ([{"role": "assistant", "tool_calls": [call(args={"city": "Paris"})]}, answer],
         "messages[1].tool_calls[0].function.arguments", "string"),
        ([{"role": "assistant", "tool_calls": [call(args="[" * 5000 + "]" * 5000)]}, answer],
         "messages[1].tool_calls[0].function.arguments", "too deep"),
        ([{"role": "assistant", "content": None}], "messages[1].content", "no content"),
    ]:
        with pytest.raises(ApiError) as e:
            chat_params({"messages": [{"role": "user", "content": "q"}, *msgs]}, lambda p: "parent", model)
        assert e.value.status == 400 and e.value.param == param and says in e.value.message, \
            (msgs, e.value.param, e.value.message)
    with pytest.raises(ApiError) as e:
        chat_params({"messages": [{"role": "user", "content": "q"}], "tools": [WEATHER],
                     "parallel_tool_calls": "false"}, lambda p: "parent", model)
    assert e.value.param == "parallel_tool_calls"


def test_forced_tokens_and_an_earlier_run_are_never_remembered_as_the_answer():
    from specquant_cli.decoding.memory import DraftMemory
    from specquant_cli.decoding.protocols import Pending, verified
    from specquant_cli.decoding.suffix import SuffixDrafter

    memory = DraftMemory()
    d = SuffixDrafter(memory=memory)
    seq = list(range(100, 140))
    d.prepare(seq)
    pending = Pending(seq, [7, 8, 9])
    assert list(pending) == seq + [7, 8, 9] and verified(pending) == seq and verified(seq) is seq
    d.propose(pending, 4)
    d.propose(Pending(seq + [5], [6]), 4)
    assert memory.use()["tokens"] == len(seq) + 1  # one document: the verified tokens only, written once


@pytest.mark.slow
def test_constrained_requests_decoding_together_each_give_the_constrained_parents_answer(server, session):
    """Two constrained requests at once on --parallel 2 (their calls batched): each answer is the constrained
    parent's own, parting (if at all) only where its pick led the next allowed token by less than the batch shapes'
    noise (0.1 logits: bench.fidelity measures up to ~0.05 on these families)."""
    from concurrent.futures import ThreadPoolExecutor

    model = session.runtime.tokenizer()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    cases = [({"response_format": fmt, "messages": [{"role": "user", "content": EXTRACT}]},
              G.json_schema(PERSON), [{"role": "user", "content": EXTRACT}], None),
             ({"tools": [WEATHER], "tool_choice": "required", "messages": ASK_WEATHER},
              G.tool_calls({"get_weather": WEATHER["function"]["parameters"]}, model, required=True), ASK_WEATHER,
              [WEATHER])]

    def ask(kw):
        r = _chat(server, extra_body={"specquant_policy": "spec-q4"}, **kw)
        m = r.choices[0].message
        if m.tool_calls:
            return "".join(f'<tool_call>\n{{"name": "{t.function.name}", "arguments": {t.function.arguments}}}\n'
                           f'</tool_call>\n' for t in m.tool_calls)
        return m.content

    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(ask, [kw for kw, *_ in cases] * 2))
    for text, (_, grammar, messages, tools) in zip(got, cases * 2):
        ref, margins = own_constrained(session, messages, tools, grammar, SamplingParams(), N)
        shown = ""
        for t, margin in zip(ref, margins):
            piece = model.piece(t).decode("utf-8", "replace")
            if not text.startswith(shown + piece):
                assert margin < 0.1, (text, shown)
                break
            shown += piece
        else:
            assert text.strip() == shown.strip(), (text, shown)
