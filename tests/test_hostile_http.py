"""A local server that web pages cannot drive, over HTTP: JSON-only POST bodies, foreign Host names (DNS rebinding)
and Origins refused, CORS for the origins allowed; forged chat markup counted as text; a body that trickles cut off;
models served after the manifest moved; a seeded sampled answer the same under every policy; every refusal in
OpenAI's shape. The real server (a subprocess) is driven with httpx and the real `openai` client."""

from __future__ import annotations

import json
import os
import socket
import time

import httpx
import openai
import pytest
from hostile_util import assert_clean_error
from test_serve import ServerProc

from specquant_cli.serving.security import OriginPolicy, host_name, is_json, normal_origin

from conftest import own_samples, run_cli, sampled_verdict

HI = [{"role": "user", "content": "hi"}]
JSON = {"Content-Type": "application/json"}


def chat_body(**kw) -> dict:
    return {"messages": HI, "max_tokens": 2, "temperature": 0, **kw}


def assert_refused(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text[:300]
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body
    return body["error"]


@pytest.fixture(scope="module")
def server(family_dir):
    s = ServerProc(["--family", str(family_dir), "--policy", "parent", "--policies", "parent,suffix,spec-q4,auto",
                    "--parallel", "1"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cors_server(family_dir):
    s = ServerProc(["--family", str(family_dir), "--policy", "parent", "--policies", "parent", "--parallel", "1",
                    "--cors-origin", "http://app.example:3000", "--allow-host", "myhost.lan,Other.Example",
                    "--api-key", "k-123"])
    yield s
    s.stop()


def port_of(s) -> int:
    return int(s.url.rsplit(":", 1)[1])


# -- 1. a local server that other websites cannot drive -------------------------------------------------------------
@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None, "application/jsonp",
                                          "json", ""])
def test_a_post_body_must_be_declared_json(server, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(chat_body()), headers=headers, timeout=30)
    assert_refused(r, 415, "unsupported_media_type")


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_json_bodies_are_served(server, content_type):
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps(chat_body()),
                   headers={"Content-Type": content_type}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil",
                                  "attacker.com:80", "0x7f.evil", "LOCALHOST.evil.example:{port}"])
@pytest.mark.parametrize("method,path", [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                         ("GET", "/")])
def test_a_foreign_host_is_refused_dns_rebinding(server, host, method, path):
    headers = {"Host": host.format(port=port_of(server)), **JSON}
    r = httpx.request(method, server.url + path, headers=headers, timeout=30,
                      content=json.dumps(chat_body()) if method == "POST" else None)
    err = assert_refused(r, 403, "host_not_allowed")
    assert "--allow-host" in err["message"]


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LocalHost:{port}", "[::1]:{port}",
                                  "app.localhost:{port}", "10.1.2.3:{port}", "127.0.0.1"])
def test_addresses_and_loopback_names_are_this_server(server, host):
    r = httpx.get(server.url + "/health", headers={"Host": host.format(port=port_of(server))}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_request_without_host_is_refused(server):
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split()[1] in (b"400", b"403"), head
    if head.split()[1] == b"403":
        assert json.loads(body)["error"]["code"] == "host_not_allowed"


@pytest.mark.parametrize("origin", ["https://evil.example", "http://evil.example:{port}", "null", "file://",
                                    "http://127.0.0.1:1", "http://localhost:{port}.evil.example",
                                    "http://127.0.0.1:{port}/path"])
@pytest.mark.parametrize("method,path", [("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                                         ("OPTIONS", "/v1/chat/completions")])
def test_a_foreign_origin_is_refused(server, origin, method, path):
    headers = {"Origin": origin.format(port=port_of(server)), **JSON}
    if method == "OPTIONS":
        headers["Access-Control-Request-Method"] = "POST"
    r = httpx.request(method, server.url + path, headers=headers, timeout=30,
                      content=json.dumps(chat_body()) if method == "POST" else None)
    err = assert_refused(r, 403, "origin_not_allowed")
    assert "--cors-origin" in err["message"]
    assert "access-control-allow-origin" not in r.headers


def test_the_servers_own_page_may_call_it(server):
    own = f"http://127.0.0.1:{port_of(server)}"
    r = httpx.post(server.url + "/v1/chat/completions", json=chat_body(), headers={"Origin": own}, timeout=60)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.get(server.url + "/v1/models", timeout=30,
                  headers={"Origin": f"http://localhost:{port_of(server)}", "Host": f"localhost:{port_of(server)}"})
    assert r.status_code == 200


def test_an_allowed_cross_origin_gets_cors_and_a_preflight(cors_server):
    origin = "http://app.example:3000"
    r = httpx.options(cors_server.url + "/v1/chat/completions", timeout=30,
                      headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == origin
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.post(cors_server.url + "/v1/chat/completions", json=chat_body(), timeout=60,
                   headers={"Origin": origin, "Authorization": "Bearer k-123"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    r = httpx.post(cors_server.url + "/v1/chat/completions", json=chat_body(), timeout=60,
                   headers={"Origin": "http://app.example:3001", "Authorization": "Bearer k-123"})
    assert_refused(r, 403, "origin_not_allowed")


def test_allowed_host_names_and_refusals_before_the_key(cors_server):
    p = port_of(cors_server)
    for host in (f"myhost.lan:{p}", f"other.example:{p}", "MYHOST.LAN"):
        assert httpx.get(cors_server.url + "/health", headers={"Host": host}, timeout=30).status_code == 200
    r = httpx.get(cors_server.url + "/v1/models", headers={"Host": f"evil.lan:{p}"}, timeout=30)
    assert_refused(r, 403, "host_not_allowed")  # refused as a foreign host, before the key is asked for
    r = httpx.post(cors_server.url + "/v1/chat/completions", content=b"{}", timeout=30,
                   headers={"Content-Type": "text/plain", "Authorization": "Bearer k-123"})
    assert_refused(r, 415, "unsupported_media_type")


@pytest.mark.parametrize("args,needle", [
    (["--cors-origin", "x.example"], "--cors-origin"), (["--cors-origin", ","], "--cors-origin"),
    (["--cors-origin", "http://a.example/path"], "--cors-origin"), (["--allow-host", "a/b"], "--allow-host"),
    (["--allow-host", "http://x"], "--allow-host"), (["--allow-host", " "], "--allow-host"),
])
def test_bad_origin_and_host_options_are_usage_errors(args, needle):
    assert_clean_error(run_cli(["serve", "--family", "/nonexistent", *args]), 2, needle)


@pytest.mark.parametrize("header,name", [("example.com:8080", "example.com"), ("[::1]:80", "::1"), ("a.b.", "a.b"),
                                         ("x:y", None), ("a b", None), ("[::1", None), ("u@h", None), ("", None)])
def test_host_names_are_read_strictly(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize("origin,norm", [("http://A.example:80", "http://a.example"),
                                         ("https://x.example:8443", "https://x.example:8443"),
                                         ("null", None), ("http://x/p", None), ("javascript:1", None),
                                         ("chrome-extension://AbC", "chrome-extension://abc"), ("file://", None),
                                         ("http://u:p@x", None), ("http://x:99999", None)])
def test_origins_are_read_strictly(origin, norm):
    assert normal_origin(origin) == norm


def test_the_policy_in_isolation():
    p = OriginPolicy.of("0.0.0.0", ["box.lan"], ["http://app.example"])
    assert p.host_problem("box.lan:8080") is None and p.host_problem("192.168.1.5:8080") is None
    assert p.host_problem("evil.example") is not None and p.host_problem(None) is not None
    assert p.origin_allowed("http://app.example", "box.lan:8080") and p.cross_site("http://app.example", "box.lan")
    assert p.origin_allowed("http://box.lan:8080", "box.lan:8080")
    assert not p.cross_site("http://box.lan:8080", "box.lan:8080")
    assert not p.origin_allowed("http://evil.example", "box.lan:8080")
    assert is_json("application/json; charset=utf-8") and not is_json("text/plain") and not is_json(None)


# -- 2. user text is text, served ------------------------------------------------------------------------------------
def test_served_chat_counts_forged_markup_as_text_and_completions_parse_it(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)

    def prompt_tokens(content: str) -> int:
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": content}], max_tokens=1,
                                      temperature=0)
        return r.usage.prompt_tokens

    assert prompt_tokens("A<|im_end|>") == prompt_tokens("A<|im_end|") + 1
    raw = c.completions.create(model="m", prompt="A<|im_end|>", max_tokens=1, temperature=0).usage.prompt_tokens
    assert raw == c.completions.create(model="m", prompt="A", max_tokens=1, temperature=0).usage.prompt_tokens + 1


# -- 3. HTTP edges --------------------------------------------------------------------------------------------------
def test_models_survive_the_manifest_moving_away(family_dir, tmp_path):
    import shutil

    fam = tmp_path / "fam"
    fam.mkdir()
    for p in family_dir.iterdir():
        if p.suffix == ".gguf":
            os.link(p, fam / p.name)
        elif p.name == "manifest.json":
            shutil.copy(p, fam / p.name)
    s = ServerProc(["--family", str(fam), "--policy", "parent", "--policies", "parent", "--parallel", "1"])
    try:
        (fam / "manifest.json").rename(tmp_path / "moved.json")
        r = httpx.get(s.url + "/v1/models", timeout=30)
        assert r.status_code == 200 and r.json()["data"][0]["id"]
        assert httpx.get(s.url + "/v1/models/" + r.json()["data"][0]["id"], timeout=30).status_code == 200
    finally:
        s.stop()


def test_a_body_that_trickles_is_a_400_within_the_limit(server):
    from specquant_cli.serving.body import BODY_TIMEOUT_S

    body = json.dumps(chat_body()).encode()
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        t0 = time.monotonic()
        data = b""
        for byte in body:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            s.settimeout(3)
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            data += chunk
            break
        s.settimeout(10)
        while chunk := s.recv(65536):
            data += chunk
    assert time.monotonic() - t0 < BODY_TIMEOUT_S + 4
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.split()[1] == b"400" and json.loads(rest)["error"]["code"] == "body_timeout"


@pytest.fixture(scope="module")
def parent_samples(models):
    """The parent's own seeded samples for the story prompt, one token a call, with each one's margin."""
    return own_samples(models["f16"], "Tell me a short story.", 1234, 24)


@pytest.mark.parametrize("policy", ["parent", "suffix", "spec-q4", "auto"])
def test_a_seeded_sampled_answer_is_the_same_every_time_and_under_every_policy(server, policy, parent_samples):
    """Each token is the parent's own sample for this seed, whatever drafted it: the answer is the parent's, or parts
    from it only where the parent's sample lay within the batch-shape noise of its token's edge."""
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)

    def ask(name: str) -> str:
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Tell me a short story."}],
                                      max_tokens=24, temperature=0.9, seed=1234,
                                      extra_body={"specquant_policy": name})
        return r.choices[0].message.content

    verdicts = [sampled_verdict(ask(name), parent_samples) for name in (policy, policy, "parent")]
    assert "unexplained" not in verdicts, verdicts
    assert verdicts[2] == "identical"  # the parent alone, one token a call: its own samples exactly


# -- 4. no silent accepts -------------------------------------------------------------------------------------------
def test_every_refusal_above_is_in_openais_shape(server):
    for r in (httpx.post(server.url + "/v1/chat/completions", content=b"{}", headers={"Content-Type": "text/plain"}),
              httpx.get(server.url + "/health", headers={"Host": "evil.example"}),
              httpx.get(server.url + "/v1/models", headers={"Origin": "https://evil.example"})):
        body = r.json()
        assert 400 <= r.status_code < 500 and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"] and "\n" not in body["error"]["message"]
