"""`specquant serve` against hostile bytes: every refusal is a 4xx in OpenAI's error shape that reaches the
client (never a 500, a reset or a hang), and the server answers normally afterwards.

One real server for the module (parent policy only, one llama.cpp thread, a small body cap, a 640-token context,
built-in tools refused), driven over real HTTP: httpx for well-formed requests, raw sockets where the transport itself
is the attack. And a machine short of RAM: a --parallel serve chose itself fits it; one the user gave is refused."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from test_serve import ServerProc
from test_serve_sizing import _family_copy

from specquant_cli.errors import ResourceError
from specquant_cli.serving.body import BODY_TIMEOUT_S, MAX_JSON_DEPTH

MAX_BODY = 256 * 1024  # room for 100,000 nested brackets, far below 10 MB
CTX = 640  # room for an answer longer than the 512 tokens serve once gave a request without max_tokens
BIG = 10 * 1024 * 1024
HI = [{"role": "user", "content": "hi"}]
ERROR_KEYS = {"message", "type", "param", "code"}
ANY = object()  # the param is not checked


@pytest.fixture(scope="module")
def server(family_dir):
    s = ServerProc(["--family", str(family_dir), "--policy", "parent", "--policies", "parent",
                    "--max-body", str(MAX_BODY), "--ctx", str(CTX)], env={"SPECQUANT_STRICT_TOOLS": "1"})
    yield s
    s.stop()


def post(server, path: str, body, headers: dict | None = None) -> httpx.Response:
    """POST raw bytes, or a JSON value with non-ASCII escaped (so a lone surrogate travels as \\ud800)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=data, timeout=30,
                      headers={"Content-Type": "application/json", **(headers or {})})


def chat(**kw) -> dict:
    return {"messages": HI, "max_tokens": 2, "temperature": 0, **kw}


def completion(**kw) -> dict:
    return {"prompt": "1, 2, 3,", "max_tokens": 2, "temperature": 0, **kw}


def nested(depth: int) -> bytes:
    """A chat body whose JSON nests `depth` levels in all (the outer object is level 1)."""
    inner = "[" * (depth - 1) + "]" * (depth - 1)
    return ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "x": ' + inner + "}").encode()


def assert_error(status: int, headers_and_body: tuple[int, bytes], param=ANY, code=None, needle=None) -> dict:
    got, raw = headers_and_body
    assert got == status, raw[:300]
    body = json.loads(raw)
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"]
    assert "Traceback" not in err["message"] and err["type"] == "invalid_request_error"
    if param is not ANY:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if needle is not None:
        assert needle in err["message"], err
    return err


def assert_still_serving(server) -> None:
    r = post(server, "/v1/completions", completion(max_tokens=1))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1
    log = server.log()
    assert "Traceback" not in log and " 500 " not in log and "internal error" not in log


def raw_request(server, head: bytes, body: bytes, timeout: float = 10) -> tuple[int, bytes, float]:
    """Send `head` (request line and headers, without the blank line) and `body` on a raw socket; read the
    answer until the server closes. (status, body, seconds)."""
    port = int(server.url.rsplit(":", 1)[1])
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + b"\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    header, _, rest = data.partition(b"\r\n\r\n")
    return int(header.split()[1]), rest, time.monotonic() - t0


# -- invalid JSON: 400 before any field is looked at --------------------------------------------------------

@pytest.mark.parametrize("body, needle", [
    (b"[" * 100_000 + b"]" * 100_000, f"deeper than {MAX_JSON_DEPTH}"),
    (b"[" * 100_000, f"deeper than {MAX_JSON_DEPTH}"),
    (nested(MAX_JSON_DEPTH + 1), f"deeper than {MAX_JSON_DEPTH}"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', "Infinity"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}', "Infinity"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "out of range"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "max_tokens": 2}', "twice"),
    (b'{"messages": [{"role": "user", "content": "\xff"}]}', "UTF-8"),
    (b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', "UTF-8"),  # a surrogate, UTF-8 encoded
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "JSON"),
], ids=["deep-100k", "deep-unclosed", "deep-just-over", "nan", "infinity", "minus-infinity", "overflow",
        "duplicate-key", "bad-utf8", "encoded-surrogate", "huge-int-literal"])
def test_invalid_json_is_400(server, body, needle):
    r = post(server, "/v1/chat/completions", body)
    assert_error(400, (r.status_code, r.content), param=None, code="invalid_json", needle=needle)
    assert_still_serving(server)


# -- strict fields: 400 naming the param --------------------------------------------------------------------

SURROGATE = "\ud800"


@pytest.mark.parametrize("path, body, param", [
    # text that is not valid Unicode, wherever it would reach the model
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a" + SURROGATE}]), "messages[0].content"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]),
     "messages[0].content[0].text"),
    ("/v1/chat/completions", chat(messages=[*HI, {"role": "assistant", "content": SURROGATE}, *HI]),
     "messages[1].content"),
    ("/v1/completions", completion(prompt=SURROGATE), "prompt"),
    ("/v1/completions", completion(prompt=[SURROGATE]), "prompt[0]"),
    ("/v1/chat/completions", chat(stop=SURROGATE), "stop"),
    ("/v1/chat/completions", chat(stop=["x", SURROGATE]), "stop[1]"),
    ("/v1/chat/completions", chat(specquant_policy=SURROGATE), "specquant_policy"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {
        "name": "f", "description": SURROGATE, "parameters": {"type": "object"}}}]), "tools[0].function.description"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {SURROGATE: {"type": "string"}}}}}),
     "response_format.json_schema.schema.properties"),
], ids=["content", "content-part", "assistant-content", "prompt", "prompt-list", "stop", "stop-list", "policy",
        "tool-description", "schema-key"])
def test_lone_surrogates_are_400(server, path, body, param):
    r = post(server, path, body)
    assert_error(400, (r.status_code, r.content), param=param, needle="not valid Unicode")
    assert_still_serving(server)


@pytest.mark.parametrize("path, body, param", [
    # no coercion
    ("/v1/chat/completions", chat(max_tokens="4"), "max_tokens"),
    ("/v1/chat/completions", chat(max_tokens=True), "max_tokens"),
    ("/v1/chat/completions", chat(max_tokens=2.0), "max_tokens"),
    ("/v1/chat/completions", chat(max_completion_tokens="2"), "max_completion_tokens"),
    ("/v1/chat/completions", chat(stream="yes"), "stream"),
    ("/v1/chat/completions", chat(stream=1), "stream"),
    ("/v1/chat/completions", chat(temperature="0.5"), "temperature"),
    ("/v1/chat/completions", chat(temperature=True), "temperature"),
    ("/v1/chat/completions", chat(top_p="1"), "top_p"),
    ("/v1/chat/completions", chat(top_k=1.5), "top_k"),
    ("/v1/chat/completions", chat(seed="1"), "seed"),
    ("/v1/chat/completions", chat(n=1.0), "n"),
    ("/v1/chat/completions", chat(stream=True, stream_options={"include_usage": "yes"}),
     "stream_options.include_usage"),
    ("/v1/completions", completion(max_tokens="2"), "max_tokens"),
    ("/v1/completions", completion(prompt=5), "prompt"),
    # out of range
    ("/v1/chat/completions", chat(max_tokens=10**30), "max_tokens"),
    ("/v1/chat/completions", chat(max_tokens=-1), "max_tokens"),
    ("/v1/chat/completions", chat(seed=2**70), "seed"),
    ("/v1/chat/completions", chat(seed=-1), "seed"),
    ("/v1/chat/completions", chat(top_k=-1), "top_k"),
    ("/v1/chat/completions", chat(top_p=1.5), "top_p"),
    # messages and their content
    ("/v1/chat/completions", chat(messages={"role": "user", "content": "hi"}), "messages"),
    ("/v1/chat/completions", chat(messages=[]), "messages"),
    ("/v1/chat/completions", chat(messages=["hi"]), "messages[0]"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": None}]), "messages[0].content"),
    ("/v1/chat/completions", chat(messages=[{"role": "user"}]), "messages[0].content"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": []}]), "messages[0].content"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     "messages[0].content[0].text"),
    ("/v1/chat/completions", chat(messages=[*HI, {"role": "assistant", "content": None}, *HI]), "messages[1].content"),
    ("/v1/chat/completions", chat(messages=[{"role": "bot", "content": "hi"}]), "messages[0].role"),
    ("/v1/chat/completions", chat(messages=[{"role": 5, "content": "hi"}]), "messages[0].role"),
    ("/v1/chat/completions", chat(messages=[{"content": "hi"}]), "messages[0].role"),
    # stop strings and prompts
    ("/v1/chat/completions", chat(stop=""), "stop"),
    ("/v1/chat/completions", chat(stop=["END", ""]), "stop"),
    ("/v1/chat/completions", chat(stop=[1]), "stop[0]"),
    ("/v1/completions", completion(prompt=""), "prompt"),
    ("/v1/completions", completion(prompt=[""]), "prompt"),
    # not an object
    ("/v1/chat/completions", [1, 2], None),
    ("/v1/completions", "prompt", None),
], ids=lambda v: None if isinstance(v, (dict, list)) else str(v))
def test_loose_fields_are_400_naming_the_param(server, path, body, param):
    r = post(server, path, body)
    assert_error(400, (r.status_code, r.content), param=param)
    assert_still_serving(server)


def test_strict_fields_still_accept_what_openai_sends(server):
    """Integers for floats, content parts, assistant history, the largest seed, exactly the nesting limit."""
    for body in (chat(temperature=0, top_p=1, seed=2**64 - 1, stop=None),
                 chat(messages=[{"role": "developer", "content": "Be brief."},
                                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                {"role": "assistant", "content": "Hello."}, *HI], stop=["END"])):
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    r = post(server, "/v1/chat/completions", nested(MAX_JSON_DEPTH))
    assert r.status_code == 200, r.text


# -- the transport: oversized and stalled bodies ----------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Connection": "close"}], ids=["keep-alive", "connection-close"])
def test_a_10mb_body_gets_the_413_not_a_reset(server, headers):
    r = post(server, "/v1/chat/completions", b"x" * BIG, headers)
    assert_error(413, (r.status_code, r.content), param=None, code="request_too_large", needle=str(MAX_BODY))
    assert_still_serving(server)


def test_a_10mb_body_on_a_raw_socket_asking_to_close_gets_the_413(server):
    """A client that sends everything before it reads (and asked for Connection: close) still reads the 413."""
    head = b"POST /v1/completions HTTP/1.1\r\nConnection: close\r\nContent-Length: %d" % BIG
    status, body, _ = raw_request(server, head, b"x" * BIG)
    assert_error(413, (status, body), param=None, code="request_too_large")
    assert_still_serving(server)


def test_a_body_shorter_than_its_content_length_times_out_to_a_400(server):
    head = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 100"
    status, body, seconds = raw_request(server, head, b'{"messages', timeout=BODY_TIMEOUT_S + 5)
    assert_error(400, (status, body), param=None, code="body_timeout", needle="10 of 100 bytes")
    assert BODY_TIMEOUT_S - 1 < seconds < BODY_TIMEOUT_S + 5
    assert_still_serving(server)


# -- what a client leaves out: the answer runs to the end of the context ------------------------------------------

def test_an_answer_without_max_tokens_runs_to_the_end_of_the_context(server):
    """As OpenAI and llama-server: no max_tokens is no cap (aider sends none for its whole-file edits), so a counting
    answer runs past the 512 tokens serve once stopped it at, to the context's end, and says it was cut."""
    r = post(server, "/v1/completions", {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "length" and usage["completion_tokens"] > 512
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CTX


# -- built-in tools under --strict-tools -------------------------------------------------------------------------

@pytest.mark.parametrize("tool", [{"type": "web_search"}, {"type": "web_search_preview_2025_03_11"},
                                  {"type": "file_search", "vector_store_ids": ["vs_1"]}, {"type": "code_interpreter"}])
def test_builtin_tools_are_refused_under_strict_tools(server, tool):
    fn = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    r = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "tools": [fn, tool]})
    err = assert_error(400, (r.status_code, r.content), param="tools[1].type", code="unsupported_parameter")
    assert "built-in tools run on OpenAI's side" in err["message"]
    assert_still_serving(server)


# -- a machine short of RAM --------------------------------------------------------------------------------------

def _facts(ram: int):
    from specquant_cli.system.hardware import Facts

    return Facts(gpus=[], gpu_status="none", ram_total=ram, ram_available=ram, cores_physical=2, cores_logical=2,
                 cpu_flags={}, gpu_offload=False)


def test_a_parallel_serve_chose_fits_the_ram_and_one_given_that_does_not_is_refused(family_dir, tmp_path, capsys):
    """`serve --ctx 16384` on a machine whose RAM holds 2 such sequences beside the parent, not the 8 the prior cost
    curve picks (the family copy has no calibration): 2, said in one stderr line and in where N came from. A
    --parallel 8 the user gave is refused, naming it. Nothing loads: serve_settings decides N before any model."""
    from specquant_cli.commands.serve import SETTINGS
    from specquant_cli.family.manifest import Family
    from specquant_cli.serving.server import serve_settings
    from specquant_cli.settings import resolve
    from specquant_cli.system.placement import RAM_HEADROOM, require_fit

    family = Family.load(_family_copy(family_dir, tmp_path / "fam"))
    ctx = 16384
    need = {n: require_fit(_facts(1 << 50), family, ["parent"], ctx * n).ram_bytes for n in (2, 3)}
    facts = _facts(int((need[2] + need[3]) / 2 / RAM_HEADROOM))  # room for 2 sequences, not 3
    flags = {"runtime.ctx": ctx, "serving.policies": ["parent"], "decoding.policy": "parent", "serving.cache_ram": 0.0}
    cfg, opts = serve_settings(resolve(SETTINGS, flags=flags, environ={}, cwd=tmp_path), family, facts)
    assert opts.parallel == cfg.runtime.parallel == 2 and "lowered from 8" in opts.parallel_from
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("specquant serve: 2 at once, not the 8")
    assert "8 sequences of --ctx 16384 do not fit" in lines[0]
    with pytest.raises(ResourceError, match=r"--parallel 8 holds --ctx 16384"):
        serve_settings(resolve(SETTINGS, flags={**flags, "runtime.parallel": 8}, environ={}, cwd=tmp_path), family,
                       facts)
