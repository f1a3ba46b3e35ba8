"""`specquant serve` for real: the CLI in a subprocess on a free port, driven by the official `openai` client.

Two servers per module: `server` (the default policy, API key as a flag, small body cap) for the API,
and `busy_server` (queue of 1, parent only, key from the environment) for the queue, disconnects and
SIGTERM. Both run llama.cpp on one thread: the test machine's cores are shared."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from specquant_cli.routing.policies import DEFAULT_POLICY

from conftest import REPO, run_cli

KEY = "test-key-0123456789"
MAX_BODY = 64 * 1024
N = 16  # max tokens: keeps the module fast on the 135M family
LONG = 3000  # a generation that would take far longer than any test waits
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"  # a raw prompt the model continues for as long as it is allowed
START_TIMEOUT_S = 120
PROMPTS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 plus 2?",
    "Who wrote Hamlet?",
    "Say hello in Spanish.",
    "What color is the sky on a clear day?",
    "How many legs does a spider have?",
    "What is the opposite of hot?",
]


class ServerProc:
    """`python -m specquant_cli serve --port 0 ...`; its stderr lines are collected as they come."""

    def __init__(self, args: list[str], env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "specquant_cli", "serve", "--port", "0", "--threads", "1",
                                      *args], cwd=REPO, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(START_TIMEOUT_S) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "\n".join(self.lines))
        port = re.search(r"listening on http://127\.0\.0\.1:(\d+)", "\n".join(self.lines)).group(1)
        self.url = f"http://127.0.0.1:{port}"

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if "listening on" in line:
                self._ready.set()
        self._ready.set()  # it exited

    def client(self, key: str = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()

    def log(self) -> str:
        return "\n".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(family_dir):
    s = ServerProc(["--family", str(family_dir), "--api-key", KEY, "--max-body", str(MAX_BODY)])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def busy_server(family_dir):
    s = ServerProc(["--family", str(family_dir), "--queue", "1", "--parallel", "1", "--policy", "parent",
                    "--policies", "parent"],
                   env={"SPECQUANT_API_KEY": KEY})
    yield s
    s.stop()


def ask(client: openai.OpenAI, prompt: str, **kw) -> str:
    r = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=N, temperature=0, **kw)
    return r.choices[0].message.content


def chat_cli(family_dir, prompt: str, monkeypatch) -> str:
    # One llama.cpp thread, as the servers: on shared cores more threads than are free stall ggml's barriers.
    r = run_cli(["chat", "--family", str(family_dir), "--policy", "parent", "--max-tokens", str(N), "--threads", "1",
                 prompt])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.endswith("\n")
    return r.stdout[:-1]


def wait_for(cond, timeout: float = 30, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return False


# -- the API ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_models_lists_the_family_its_roles_and_policies(server):
    models = server.client().models.list()
    [m] = models.data
    assert m.id == "smollm2-135m" and m.object == "model"
    extra = m.model_extra["specquant"]
    assert set(extra["roles"]) == {"q4", "q8", "parent"} and sorted(extra["loaded"]) == ["parent", "q4", "q8"]
    assert "paper" in extra["policies"] and "parent" in extra["policies"] and extra["default_policy"] == DEFAULT_POLICY
    assert server.client().models.retrieve("smollm2-135m").id == "smollm2-135m"
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("gpt-4")


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(dict.fromkeys(["parent", "paper", DEFAULT_POLICY])))
def test_greedy_chat_equals_the_cli_parent_answer(server, family_dir, monkeypatch, policy):
    """Lossless: speculative policies answer exactly what `chat --policy parent` prints."""
    prompt = "What is the capital of France?"
    expected = chat_cli(family_dir, prompt, monkeypatch)
    r = server.client().chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=N, temperature=0, extra_body={"specquant_policy": policy})
    assert r.choices[0].message.content == expected
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    sq = r.model_extra["specquant"]
    assert sq["policy"] == policy and sq["route"]["tier"] in ("low", "medium", "high")
    assert 0 <= sq["route"]["score"] <= 1
    assert set(sq) >= {"plan", "acceptance_rate", "mean_accepted_length", "tokens_per_s"}
    assert sq["lossy"] is False and sq["mean_accepted_length"] >= 1


@pytest.mark.slow
def test_stream_equals_non_stream_and_include_usage_ends_with_usage(server):
    client = server.client()
    whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPTS[3]}],
                                           max_tokens=N, temperature=0)
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPTS[3]}],
                                                 max_tokens=N, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finish[0].model_extra["specquant"]["policy"] == DEFAULT_POLICY
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


@pytest.mark.slow
def test_completions_plain_and_streamed(server):
    client = server.client()
    r = client.completions.create(model="m", prompt=COUNTING, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.choices[0].text.startswith(" 9") and r.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt=COUNTING, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text


@pytest.mark.slow
def test_policy_from_header_or_body(server):
    client = server.client()
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    by_header = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0,
                                               extra_headers={"x-specquant-policy": "spec-q4"})
    assert by_header.model_extra["specquant"]["policy"] == "spec-q4"
    assert by_header.model_extra["specquant"]["plan"] == "q4 drafts, parent verifies"
    by_body = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0,
                                             extra_headers={"x-specquant-policy": "spec-q4"},
                                             extra_body={"specquant_policy": "ngram"})
    assert by_body.model_extra["specquant"]["policy"] == "ngram"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=msgs, max_tokens=4, extra_body={"specquant_policy": "nope"})
    assert e.value.body["param"] == "specquant_policy"


@pytest.mark.slow
def test_eight_concurrent_clients_all_get_complete_correct_answers(server, parent_judge):
    expected = [ask(server.client(), p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: ask(server.client(), p), PROMPTS))
    assert all(expected) and all(got)
    # decoded together (the default --parallel), an answer may part from its answer alone only at a near-tie
    assert [p for p, a, b in zip(PROMPTS, got, expected) if a != b and parent_judge(p, a, N) == "unexplained"] == []


# -- refusals and errors ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("kw, param", [
    ({"n": 2}, "n"),
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content[1]"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 5}, "temperature"),
])
def test_unsupported_or_invalid_fields_are_400_naming_the_field(server, kw, param):
    args = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(**args)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert set(e.value.body) == {"message", "type", "param", "code"}


@pytest.mark.slow
def test_a_prompt_that_does_not_fit_is_400_before_the_stream_starts(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5000, stream=True)
    assert "context" in e.value.message


@pytest.mark.slow
def test_wrong_or_missing_key_is_401_and_the_key_is_never_echoed(server):
    with pytest.raises(openai.AuthenticationError):
        ask(server.client(key="wrong-key"), "hi")
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer " + KEY[:-1] + "X"})
    assert r.status_code == 401 and KEY[:-1] not in r.text
    assert httpx.get(server.url + "/health").status_code == 200  # as the chat page (GET /): no key needed
    assert httpx.get(server.url + "/").status_code == 200
    assert KEY not in server.log()


@pytest.mark.slow
def test_oversized_body_is_413_and_bad_json_is_400(server):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    big = '{"messages": [{"role": "user", "content": "' + "x" * (MAX_BODY + 10) + '"}]}'
    r = httpx.post(server.url + "/v1/chat/completions", content=big, headers=auth)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [', headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "m"}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    for r in (httpx.post(server.url + "/v1/chat/completions", content=b"\xff\xfe", headers=auth),
              httpx.post(server.url + "/v1/completions", json=[1, 2], headers=auth)):
        assert r.status_code == 400 and "Traceback" not in r.text
    assert "Traceback" not in server.log()


@pytest.mark.slow
def test_one_log_line_per_request(server):
    ask(server.client(), PROMPTS[1])

    def logged():  # the line follows the answer out; the reader thread collects it a moment later
        return [ln for ln in server.lines if "POST /v1/chat/completions 200" in ln]

    assert wait_for(logged, timeout=10)
    line = logged()[-1]
    assert re.search(r"\d+ tokens [\d.]+ tok/s acceptance \d+%", line)


# -- queue, disconnects, signals ----------------------------------------------------------------------

def _long_stream(client: openai.OpenAI):
    """A streamed completion of LONG tokens, read until it is known to be generating."""
    stream = client.completions.create(model="m", prompt=COUNTING, max_tokens=LONG, temperature=0, stream=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    return stream, it


@pytest.mark.slow
def test_full_queue_is_429_with_retry_after(busy_server):
    client = busy_server.client()
    stream, _ = _long_stream(client)  # running
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(ask, busy_server.client(), PROMPTS[0])  # waits behind it
        assert wait_for(lambda: busy_server.health()["queued"] == 1)
        with pytest.raises(openai.RateLimitError) as e:
            ask(client, PROMPTS[1])
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.body["code"] == "queue_full"
        stream.close()  # the queued request now runs
        assert queued.result(timeout=30)


@pytest.mark.slow
def test_a_disconnected_stream_frees_the_engine(busy_server):
    client = busy_server.client()
    before = busy_server.health()["cancelled"]
    stream, _ = _long_stream(client)
    t0 = time.monotonic()
    stream.close()
    ask(client, PROMPTS[2])  # generating LONG tokens would take far longer than this
    assert time.monotonic() - t0 < 10
    assert busy_server.health()["cancelled"] == before + 1
    assert wait_for(lambda: "(client disconnected)" in busy_server.log(), timeout=5)


@pytest.mark.slow
def test_sigterm_ends_the_stream_with_an_error_event_and_exits_cleanly(family_dir):
    s = ServerProc(["--family", str(family_dir), "--policy", "parent", "--policies", "parent"])
    try:
        stream, it = _long_stream(s.client(key="unused"))
        s.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError) as e:
            for _ in it:
                pass
        assert "shutting down" in e.value.message
        assert s.proc.wait(30) == 0
        assert "specquant serve: stopped" in s.log() and "Traceback" not in s.log()
    finally:
        s.stop(signal.SIGKILL)


# -- the schema layer alone (no server) ---------------------------------------------------------------

def test_schema_maps_content_parts_developer_role_and_defaults():
    from specquant_cli.serving.schemas import chat_params

    p = chat_params({"messages": [{"role": "developer", "content": "Be brief."},
                                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}],
                     "stop": "END", "max_completion_tokens": 7, "seed": 3}, lambda p: p or "paper")
    assert p.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"}]
    assert p.stop == ["END"] and p.max_tokens == 7 and p.policy == "paper" and not p.stream
    assert p.sampling.temperature == 1.0 and p.sampling.seed == 3  # OpenAI's default temperature


def test_schema_refuses_function_messages_and_token_prompts():
    from specquant_cli.serving.schemas import ApiError, chat_params, completion_params

    with pytest.raises(ApiError) as e:
        chat_params({"messages": [{"role": "function", "content": "x", "name": "f"}]}, lambda p: "paper")
    assert e.value.param == "messages[0].role"
    with pytest.raises(ApiError) as e:
        completion_params({"prompt": [[1, 2, 3]]}, lambda p: "paper")
    assert e.value.param == "prompt"
    assert completion_params({"prompt": ["one"]}, lambda p: "paper").prompt == "one"
