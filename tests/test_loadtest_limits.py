"""`specquant bench load` trusts no server: the real client (load.run, stream_chat, find_model, and the command in a
child process) against a raw-socket HTTP server on loopback that sends exactly the bytes each hostile case wants,
made on the fly (a line with no end, gzip bombs, bodies of hundreds of MB, trickles, pings after the finish,
answers longer than max_tokens). Each case fails fast, with its reason as the request's error, memory bounded."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib
from contextlib import contextmanager

import pytest

from specquant_cli.bench import answer, bounded, load
from specquant_cli.errors import SpecquantError

from conftest import REPO, run_cli

READ_S = 30.0  # the per-read timeout of every case: never what ends one
REQUEST_S = 3.0  # the whole request's deadline
FAST_S = 20.0  # every case is over well within this
MEMORY_BOUND = 48 << 20  # Python allocations one case may add at its peak (the largest bodies sent are 200+ MB)
RSS_BOUND_KIB = 300 << 10  # and the process's peak resident size may grow by at most this (KiB)
SAFETY = 1 << 30  # a generator stops after this much, so that a client that never stops fails instead of hanging

SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
DONE = b"data: [DONE]\n\n"


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def piece(text: str) -> bytes:
    return sse({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})


FINISH = sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})


def usage(n: int) -> bytes:
    return sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})


GOOD = piece("Hello") + piece(", wor") + piece("ld.") + FINISH + usage(3)


def head(status: str = "200 OK", kind: str = "text/event-stream", extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nConnection: close\r\n{extra}\r\n".encode()


def endless(send, block: bytes, limit: int = SAFETY) -> None:
    """`block` again and again as fast as the client reads, until it hangs up (or `limit` bytes)."""
    sent = 0
    while sent < limit:
        send(block)
        sent += len(block)


def gzip_bomb(unit: bytes, total: int = SAFETY):
    """A gzip stream that inflates to `unit` repeated, `total` bytes of it, compressed on the fly (~1000:1)."""
    c = zlib.compressobj(6, zlib.DEFLATED, 31)
    block = unit * max(1, (1 << 20) // len(unit))
    made = 0
    while made < total:
        out = c.compress(block)
        made += len(block)
        if out:
            yield out
    yield c.flush()


def trickle(send, data: bytes, gap: float) -> None:
    for i in range(len(data)):
        send(data[i:i + 1])
        time.sleep(gap)


def models_ok(send, body) -> None:
    data = json.dumps({"object": "list", "data": [{"id": "hostile-model"}]}).encode()
    send(head(kind="application/json", extra=f"Content-Length: {len(data)}\r\n") + data)


class Hostile:
    """An HTTP/1.1 server on loopback, one thread per connection: each request is read (headers, body) and handed
    to `chat(send, body)` (POST) or `models(send, body)` (GET /v1/models), which write the raw bytes they want."""

    def __init__(self, chat, models=models_ok):
        self.chat, self.models = chat, models
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.requests: list[tuple[str, str, dict]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn, conn.makefile("rb") as f:
                method, path, _ = f.readline().decode("latin-1").split(" ", 2)
                headers = {}
                while line := f.readline().strip():
                    k, _, v = line.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length", 0))
                body = json.loads(f.read(length)) if length else None
                self.requests.append((method, path, headers))
                (self.models if path == "/v1/models" else self.chat)(conn.sendall, body)
        except (OSError, ValueError):
            pass  # the client hung up: what these servers are for

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()


@pytest.fixture
def hostile():
    servers: list[Hostile] = []

    def make(chat, models=models_ok) -> Hostile:
        servers.append(Hostile(chat, models))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


@contextmanager
def bounded_memory():
    """Asserts that the block adds at most MEMORY_BOUND of Python allocations at its peak (tracemalloc) and at
    most RSS_BOUND_KIB to the process's peak resident size."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BOUND, f"{peak >> 20} MiB allocated at the peak"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < RSS_BOUND_KIB


def ask(url: str, max_tokens: int = 8, request_timeout: float = REQUEST_S, deadline=None, conversations: int = 1):
    """The real load.run: `conversations` single-turn requests, one at a time. (results, seconds taken)."""
    target = load.Target(url, "m", max_tokens, timeout_s=READ_S, request_timeout_s=request_timeout)
    convs = load.conversations("single", ["hello"], conversations, 1)
    t = time.monotonic()
    results, _ = load.run(target, convs, [0.0] * conversations, 1, None, deadline)
    return results, time.monotonic() - t


def failed(url: str, **kw):
    """One request that must fail fast: (its error, seconds taken)."""
    (r,), took = ask(url, **kw)
    assert not r.ok and r.error, r
    assert took < FAST_S, took
    s = load.summarize([r], took, planned=1)
    assert s["requests"]["succeeded"] == 0 and s["output_tokens"] == 0 and s["goodput"]["requests"] == 0
    return r.error, took


# -- a well-behaved server still passes -----------------------------------------------------------------------------

def test_a_correct_stream_succeeds_with_the_servers_token_count(hostile):
    srv = hostile(lambda send, body: send(SSE_HEAD + GOOD + DONE))
    (r,), took = ask(srv.url)
    assert r.ok and r.error is None and r.text == "Hello, world." and r.finish_reason == "stop"
    assert r.output_tokens == 3 and r.tokens_from == "usage" and len(r.itl_s) == 2 and took < 2
    assert srv.requests[0][2]["accept-encoding"] == "identity"


def call_piece(index: int, name: str = "", arguments: str = "") -> bytes:
    fn = {**({"name": name} if name else {}), "arguments": arguments}
    return sse({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": index, "type": "function",
                                                                      "function": fn}]}, "finish_reason": None}]})


def test_a_replayed_turn_sends_its_tools_and_its_tool_calls_come_back_as_the_model_writes_them(hostile):
    """A tool call streamed in pieces (llama-server's way: the name, then the arguments a few characters at a time)
    becomes the answer's text in the model's own form, so that it can be judged against the parent's tokens."""
    bodies = []
    calls = (call_piece(0, "read_file", '{"pa') + call_piece(0, arguments='th": "a.py"}') + call_piece(1, "ls")
             + call_piece(1, arguments="{}"))
    srv = hostile(lambda send, body: (bodies.append(body), send(SSE_HEAD + calls + FINISH + usage(9) + DONE)))
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    target = load.Target(srv.url, "m", 64, timeout_s=READ_S, request_timeout_s=REQUEST_S)
    convs = load.replayed([[{"role": "user", "content": "read a.py"}]], (), [{"tools": tools, "tool_choice": "auto"}])
    (r,), _ = load.run(target, convs, [0.0], 1, None)
    assert r.ok and bodies[0]["tools"] == tools and bodies[0]["tool_choice"] == "auto"
    assert r.text == ('<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
                      '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>')
    assert r.output_tokens == 9 and r.ttft_s is not None and len(r.itl_s) == 3


def test_tool_call_arguments_past_max_tokens_fail(hostile):
    block = call_piece(0, arguments="a") * 1000
    srv = hostile(lambda send, body: (send(SSE_HEAD + call_piece(0, "f")), endless(send, block, 2000 * len(block)),
                                      send(FINISH + DONE)))
    error, took = failed(srv.url)
    assert error == "the server streamed more than 8 content pieces for max_tokens 8" and took < 5


def test_a_correct_gzip_stream_is_inflated_and_succeeds(hostile):
    def chat(send, body):  # a server that compresses anyway: read, within the same bounds
        c = zlib.compressobj(6, zlib.DEFLATED, 31)
        send(head(extra="Content-Encoding: gzip\r\n") + c.compress(GOOD + DONE) + c.flush())

    (r,), _ = ask(hostile(chat).url)
    assert r.ok and r.text == "Hello, world." and r.output_tokens == 3


def test_event_stream_lines_end_at_lf_crlf_or_cr_even_split_across_reads():
    lines = bounded.Lines(limit=16)
    got = [*lines.feed(b"data: a\r"), *lines.feed(b"\ndata: b\rdata: c\n\nda"), *lines.feed(b"ta: d"), *lines.close()]
    assert [x for x in got if x] == [b"data: a", b"data: b", b"data: c", b"data: d"]
    with pytest.raises(bounded.Refused, match="passed 16 bytes"):
        lines.feed(b"x" * 17)


# -- sizes ---------------------------------------------------------------------------------------------------------

def test_a_line_without_end_fails_at_the_line_cap(hostile):
    srv = hostile(lambda send, body: (send(SSE_HEAD + b'data: {"choices": [{"delta": {"content": "'),
                                      endless(send, b"x" * 65536)))
    with bounded_memory():
        error, _ = failed(srv.url)
    assert error == "an event-stream line passed 1 MiB (no line end)"


def test_a_200_mb_piece_fails_at_the_line_cap(hostile):
    def chat(send, body):
        send(SSE_HEAD + b'data: {"choices": [{"index": 0, "delta": {"content": "')
        endless(send, b"y" * 65536, 200 << 20)
        send(b'"}, "finish_reason": "stop"}]}\n\n' + DONE)

    with bounded_memory():
        error, _ = failed(hostile(chat).url)
    assert error == "an event-stream line passed 1 MiB (no line end)"


def test_a_never_ending_stream_fails_at_the_stream_cap(hostile):
    srv = hostile(lambda send, body: (send(SSE_HEAD), endless(send, b": " + b"p" * 65000 + b"\n")))
    with bounded_memory():
        error, _ = failed(srv.url)
    assert error == "the event stream passed 16 MiB"


def test_a_gzip_bomb_stream_fails_at_the_stream_cap(hostile):
    def chat(send, body):
        send(head(extra="Content-Encoding: gzip\r\n"))
        for part in gzip_bomb(b": " + b"p" * 1000 + b"\n"):  # keep-alive comments, a GiB of them
            send(part)

    with bounded_memory():
        error, _ = failed(hostile(chat).url)
    assert error == "the event stream passed 16 MiB"


def test_a_gzip_bomb_error_body_is_cut_with_its_status(hostile):
    def chat(send, body):
        send(head("500 Internal Server Error", "text/plain", "Content-Encoding: gzip\r\n"))
        for part in gzip_bomb(b"z" * 4096):
            send(part)

    with bounded_memory():
        error, _ = failed(hostile(chat).url)
    assert error == "HTTP 500: " + "z" * 200 + " (a body over 1 MiB, cut)"


def test_a_600_mb_error_body_is_cut_with_its_status(hostile):
    def chat(send, body):
        send(head("503 Service Unavailable", "text/plain", f"Content-Length: {600 << 20}\r\n"))
        endless(send, b"busy " * 13107, 600 << 20)

    with bounded_memory():
        error, _ = failed(hostile(chat).url)
    assert error.startswith("HTTP 503: busy busy ") and error.endswith(" (a body over 1 MiB, cut)")
    assert len(error) < 300


def test_a_long_error_message_stays_one_short_line(hostile):
    def chat(send, body):
        data = json.dumps({"error": {"message": "no\n" * 200000}}).encode()  # 600 kB of message
        send(head("400 Bad Request", "application/json", f"Content-Length: {len(data)}\r\n") + data)

    error, _ = failed(hostile(chat).url)
    assert error.startswith("HTTP 400: no no no ") and "\n" not in error and len(error) <= 320


def test_a_600_mb_models_answer_is_cut(hostile):
    def models(send, body):
        send(head(kind="application/json", extra=f"Content-Length: {600 << 20}\r\n") + b'{"data": [')
        endless(send, b'{"id": "m"}, ' * 5041, 600 << 20)

    srv = hostile(lambda send, body: None, models)
    t = time.monotonic()
    with bounded_memory(), pytest.raises(SpecquantError) as e:
        load.find_model(srv.url, None, None, 5.0)
    assert str(e.value) == f"GET {srv.url}/v1/models: an answer over 1 MiB; name the model with --model"
    assert load.find_model(srv.url, None, "named", 5.0) == "named"  # the model named: the server just answered
    assert time.monotonic() - t < FAST_S


def test_a_gzip_bomb_models_answer_is_cut(hostile):
    def models(send, body):
        send(head(kind="application/json", extra="Content-Encoding: gzip\r\n"))
        for part in gzip_bomb(b" " * 4096):
            send(part)

    srv = hostile(lambda send, body: None, models)
    t = time.monotonic()
    with bounded_memory(), pytest.raises(SpecquantError, match="an answer over 1 MiB; name the model"):
        load.find_model(srv.url, None, None, 5.0)
    assert time.monotonic() - t < FAST_S


def test_an_encoding_not_asked_for_is_refused(hostile):
    error, _ = failed(hostile(lambda send, body: send(head(extra="Content-Encoding: br\r\n") + b"\x1b\x00")).url)
    assert error == "the answer is encoded as 'br' (identity was asked for)"


# -- deadlines -----------------------------------------------------------------------------------------------------

@pytest.mark.slow  # waits out a deadline: seconds
def test_a_byte_trickle_fails_at_the_request_deadline(hostile):
    srv = hostile(lambda send, body: (send(SSE_HEAD), trickle(send, GOOD + DONE, 0.5)))  # a byte each 0.5 s
    error, took = failed(srv.url)
    assert error == "no full answer within 3 s (the request's deadline)" and REQUEST_S - 0.1 < took < REQUEST_S + 3


@pytest.mark.slow  # waits out a deadline: seconds
def test_trickled_headers_fail_at_the_request_deadline(hostile):
    srv = hostile(lambda send, body: trickle(send, SSE_HEAD + GOOD + DONE, 0.3))
    error, took = failed(srv.url)
    assert error == "no full answer within 3 s (the request's deadline)" and took < REQUEST_S + 3


@pytest.mark.slow  # waits out a deadline: seconds
def test_pings_that_never_end_fail_at_the_request_deadline(hostile):
    def chat(send, body):
        send(SSE_HEAD + piece("Hi"))
        for _ in range(10000):  # no finish_reason, ever: a ping each 0.1 s
            send(b": ping\n\n")
            time.sleep(0.1)

    error, took = failed(hostile(chat).url)
    assert error == "no full answer within 3 s (the request's deadline)" and took < REQUEST_S + 3


def pings_forever(send, body):
    """An answer that never comes: the stream opens, then a keep-alive ping each 0.1 s."""
    send(SSE_HEAD)
    for _ in range(10000):
        send(b": ping\n\n")
        time.sleep(0.1)


@pytest.mark.slow  # waits out a deadline: seconds
def test_the_run_deadline_cancels_the_request_in_flight_and_starts_no_more(hostile):
    srv = hostile(pings_forever)
    results, took = ask(srv.url, request_timeout=60.0, deadline=2.0, conversations=3)
    assert [r.error for r in results] == ["cancelled: the run's deadline passed"]  # the other two: never sent
    assert len([q for q in srv.requests if q[0] == "POST"]) == 1 and 1.9 < took < 5


# -- the stream's end ----------------------------------------------------------------------------------------------

@pytest.mark.slow  # waits out a deadline: seconds
def test_slow_pings_after_the_finish_end_the_answer_after_the_grace(hostile):
    def chat(send, body):
        send(SSE_HEAD + GOOD)  # finish and usage, then no [DONE]: pings each 0.3 s, for ever
        for _ in range(10000):
            send(b": ping\n\n")
            time.sleep(0.3)

    (r,), took = ask(hostile(chat).url, request_timeout=30.0)
    assert r.ok and r.text == "Hello, world." and r.output_tokens == 3 and r.tokens_from == "usage"
    assert answer.FINISH_GRACE_S - 0.1 < took < answer.FINISH_GRACE_S + 2
    assert r.e2e_s < 1.0  # to the last event, not to the end of the grace


def test_fast_pings_after_the_finish_end_the_answer_at_the_line_bound(hostile):
    srv = hostile(lambda send, body: (send(SSE_HEAD + GOOD), endless(send, b": ping\n")))
    (r,), took = ask(srv.url, request_timeout=30.0)
    assert r.ok and r.output_tokens == 3 and took < 1.5


def test_pings_after_done_do_not_keep_the_request_alive(hostile):
    def chat(send, body):
        send(SSE_HEAD + GOOD + DONE)
        for _ in range(10000):
            send(b": ping\n\n")
            time.sleep(0.2)

    (r,), took = ask(hostile(chat).url, request_timeout=30.0)
    assert r.ok and r.output_tokens == 3 and took < 1.5


# -- answers longer than asked -------------------------------------------------------------------------------------

def test_two_million_pieces_for_max_tokens_8_fail(hostile):
    block = piece("a") * 1000
    srv = hostile(lambda send, body: (send(SSE_HEAD), endless(send, block, 2000 * len(block)), send(FINISH + DONE)))
    error, took = failed(srv.url)
    assert error == "the server streamed more than 8 content pieces for max_tokens 8" and took < 5


def test_a_100_kb_piece_for_max_tokens_8_fails(hostile):
    srv = hostile(lambda send, body: send(SSE_HEAD + piece("w" * 100_000) + FINISH + usage(1) + DONE))
    error, _ = failed(srv.url)
    assert error == "the server streamed over 512 characters for max_tokens 8 (at most 64 a token)"


def test_usage_claiming_more_tokens_than_asked_fails(hostile):
    srv = hostile(lambda send, body: send(SSE_HEAD + piece("Hi") + FINISH + usage(1000) + DONE))
    error, _ = failed(srv.url)
    assert error == "the server counted 1000 completion tokens for max_tokens 8"


# -- the command -----------------------------------------------------------------------------------------------------

def specquant(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    exe = REPO / ".venv" / "bin" / "specquant"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "specquant_cli"]
    t = time.monotonic()
    p = subprocess.run([*cmd, "bench", "load", "--json", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    return p, time.monotonic() - t


def test_the_command_fails_in_one_line_on_pieces_past_max_tokens(hostile):
    block = piece("a") * 1000
    srv = hostile(lambda send, body: (send(SSE_HEAD), endless(send, block, 2000 * len(block))))
    p, took = specquant("--url", srv.url, "--conversations", "1", "--max-tokens", "8", "--request-timeout", "3")
    assert p.returncode == 1 and took < FAST_S and p.stdout.startswith("{")
    assert p.stderr.splitlines()[-1] == ("error: no request succeeded (first error: the server streamed more than "
                                         "8 content pieces for max_tokens 8)")
    assert "Traceback" not in p.stderr
    rep = json.loads(p.stdout)
    assert rep["summary"]["goodput"]["requests"] == 0 and rep["summary"]["output_tokens"] == 0
    assert rep["config"]["request_timeout_s"] == 3.0 and rep["config"]["deadline_s"] is None


@pytest.mark.slow  # waits out a deadline: seconds
def test_the_command_ends_at_its_deadline(hostile):
    srv = hostile(pings_forever)
    p, took = specquant("--url", srv.url, "--conversations", "2", "--deadline", "2")
    assert p.returncode == 1 and took < FAST_S and "Traceback" not in p.stderr
    assert "bench load: the run's deadline of 2 s passed; 1 of 2 requests not sent" in p.stderr
    assert p.stderr.splitlines()[-1] == ("error: no request succeeded (first error: cancelled: the run's deadline "
                                         "passed)")
    assert json.loads(p.stdout)["config"]["deadline_s"] == 2.0


@pytest.mark.parametrize("value", ["0", "-1", "inf"])
def test_the_new_options_refuse_what_is_no_positive_number(value):
    from conftest import run_cli

    for option in ("--request-timeout", "--deadline"):
        r = run_cli(["bench", "load", "--url", "http://127.0.0.1:1", option, value])
        assert r.exit_code == 2 and option in r.stderr
        assert "expected a number above 0" in r.stderr or "not a finite number" in r.stderr


def test_a_judge_that_fails_after_the_load_leaves_the_load_s_report(hostile, family_dir, tmp_path, monkeypatch):
    """Minutes of load are not lost to the judge: its failure (or Ctrl-C) still writes the report, without verdicts,
    saying why, and the command fails."""
    from specquant_cli.commands import bench_load
    from specquant_cli.errors import InputError

    def broken(*a, **k):
        raise InputError("the judge broke")

    monkeypatch.setattr(bench_load, "_judge", broken)
    srv = hostile(lambda send, body: send(SSE_HEAD + GOOD + DONE))
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    r = run_cli(["bench", "load", "--url", srv.url, "--conversations", "1", "--family", str(family_dir),
                 "--json-file", str(out), "--markdown", str(md)])
    assert r.exit_code == 1 and "the judge broke" in r.stderr
    rep = json.loads(out.read_text())
    assert rep["summary"]["requests"]["succeeded"] == 1 and rep["fidelity"] is None
    assert rep["fidelity_error"] == "the judge did not finish: InputError: the judge broke"
    assert "Fidelity: not judged (the judge did not finish" in md.read_text()
