"""`specquant bench load`: the figures on synthetic timings, the arrivals, the scenarios against a scripted
OpenAI-compatible server (stdlib, in a thread: it records every request), and one real run against
`specquant serve` on the demo family with every answer judged against the parent alone."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from specquant_cli.bench import load
from specquant_cli.bench.load import RequestResult

from conftest import REPO, run_cli

STANDARD_FIELDS = {"model", "messages", "max_tokens", "temperature", "stream", "stream_options"}


# -- the figures -----------------------------------------------------------------------------------------------------

def test_percentile_interpolates_between_ranks_as_numpy_does():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert load.percentile(xs, 50) == 3.0
    assert load.percentile(xs, 95) == pytest.approx(4.8)
    assert load.percentile(xs, 99) == pytest.approx(4.96)
    assert load.percentile([7.0], 99) == 7.0
    assert load.percentile([], 50) is None
    rng = random.Random(1)
    data = [rng.expovariate(2.0) for _ in range(101)]
    for p in (50, 95, 99):
        assert load.percentile(data, p) == pytest.approx(float(np.percentile(data, p)))


def test_percentiles_are_ordered_and_empty_is_none():
    s = load.percentiles([0.1, 0.4, 0.2, 0.9, 0.3])
    assert s["n"] == 5 and s["mean"] == pytest.approx(0.38)
    assert s["p50"] <= s["p95"] <= s["p99"] <= s["max"] == 0.9
    assert load.percentiles([]) == {"n": 0, "mean": None, "p50": None, "p95": None, "p99": None, "max": None}


def _res(conv, turn, ttft, itl=(), ok=True, tokens=None):
    r = RequestResult(conv, turn, [], ok=ok, ttft_s=ttft if ok else None, itl_s=list(itl),
                      e2e_s=(ttft or 0) + sum(itl), output_tokens=tokens if tokens is not None else len(itl) + 1)
    if not ok:
        r.error = "HTTP 500: boom"
    return r


def test_goodput_counts_requests_within_both_targets():
    rs = [_res(0, 0, 1.0, [0.5, 0.5]),       # meets both
          _res(1, 0, 11.0, [0.1]),           # TTFT too long
          _res(2, 0, 2.0, [0.5, 1.9]),       # mean ITL 1.2 s: too slow
          _res(3, 0, 3.0, [0.2, 1.6]),       # mean ITL 0.9 s: one long gap, the mean within
          _res(4, 0, 9.0),                   # one piece: no gap, meets the ITL target
          _res(5, 0, None, ok=False)]        # failed
    g = load.goodput(rs, 10.0, ttft_target=10.0, itl_target=1.0)
    assert g["requests"] == 3 and g["share"] == 0.5 and g["requests_per_s"] == 0.3
    g = load.goodput(rs, 10.0, ttft_target=10.0, itl_target=1.0, planned=10)  # turns never sent count against it
    assert g["share"] == 0.3
    assert load.goodput(rs, 10.0, ttft_target=0.5, itl_target=1.0)["requests"] == 0


def test_summary_throughput_and_the_ttft_of_first_and_later_turns():
    rs = [_res(0, 0, 2.0, [0.1, 0.3], tokens=3), _res(0, 1, 0.5, [0.2], tokens=2),
          _res(1, 0, 4.0, [], tokens=1), _res(1, 1, None, ok=False)]
    s = load.summarize(rs, 4.0, planned=4)
    assert s["requests"] == {"planned": 4, "sent": 4, "succeeded": 3, "failed": 1, "no_content": 0}
    assert s["request_throughput"] == 0.75 and s["output_tokens"] == 6 and s["output_tokens_per_s"] == 1.5
    assert s["ttft_first_turn_s"]["n"] == 2 and s["ttft_first_turn_s"]["mean"] == 3.0
    assert s["ttft_later_turns_s"]["n"] == 1 and s["ttft_later_turns_s"]["p50"] == 0.5
    assert s["ttft_s"]["p50"] == 2.0
    assert s["itl_s"]["n"] == 3 and s["itl_s"]["max"] == 0.3  # every gap of every request, pooled
    assert s["e2e_s"]["p99"] == pytest.approx(2.4 + 0.98 * (4.0 - 2.4)) and s["e2e_s"]["max"] == 4.0


# -- arrivals and scenarios --------------------------------------------------------------------------------------------

def test_poisson_arrivals_are_seeded_and_reproducible():
    a = load.arrival_times(2000, 4.0, seed=7)
    assert a == load.arrival_times(2000, 4.0, seed=7)
    assert a != load.arrival_times(2000, 4.0, seed=8)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.1)  # exponential gaps of mean 1/rate
    assert np.std(gaps) == pytest.approx(0.25, rel=0.15)  # an exponential's spread equals its mean
    assert load.arrival_times(3, None) == [0.0, 0.0, 0.0]


def test_system_prompt_is_deterministic_numbered_rules_of_about_the_asked_length():
    text = load.system_prompt(800)
    assert text == load.system_prompt(800)
    assert "Rule 1. " in text and "Rule 20. " in text
    assert 800 * 4 <= len(text) < 800 * 4 + 200
    assert load.system_prompt(100) != text and text.startswith(load.system_prompt(100)[:300])


def test_conversations_take_questions_in_order_and_start_over():
    qs = ["q0", "q1", "q2"]
    convs = load.conversations("multi-turn", qs, 2, 2)
    assert [c.questions for c in convs] == [("q0", "q1"), ("q2", "q0")]
    assert all(c.system is None for c in convs)
    shared = load.conversations("shared-system", qs, 2, 2, system="S")
    assert [c.system for c in shared] == ["S", "S"]
    assert [c.questions for c in load.conversations("single", qs, 4, 1)] == [("q0",), ("q1",), ("q2",), ("q0",)]
    with pytest.raises(load.InputError, match="one turn"):
        load.conversations("single", qs, 2, 2)


# -- against a scripted server -----------------------------------------------------------------------------------------

class FakeServer:
    """An OpenAI-compatible chat server that streams `reply to: <last user message>` in pieces (with `usage` when
    asked, unless `usage` is off), and records every request's body and headers."""

    def __init__(self, key=None, usage=True, delay=0.0, pieces=4, fail_on=None, cut_on=None, plain_on=None):
        self.key, self.usage, self.delay, self.pieces, self.fail_on = key, usage, delay, pieces, fail_on
        self.cut_on, self.plain_on = cut_on, plain_on  # questions answered by a cut stream / plain JSON
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _refused(self) -> bool:
                if server.key and self.headers.get("Authorization") != f"Bearer {server.key}":
                    self._json(401, {"error": {"message": "Invalid API key", "type": "invalid_request_error"}})
                    return True
                return False

            def _json(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self._refused():
                    return
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
                else:
                    self._json(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append({"body": body, "headers": dict(self.headers)})
                if self._refused():
                    return
                question = body["messages"][-1]["content"]
                if server.fail_on and server.fail_on in question:
                    self._json(500, {"error": {"message": "scripted failure"}})
                    return
                if server.plain_on and server.plain_on in question:
                    self._json(200, {"choices": [{"message": {"role": "assistant", "content": "hi"}}]})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                reply = f"reply to: {question}"
                n = server.pieces
                cuts = [len(reply) * i // n for i in range(n + 1)]
                chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
                chunks += [{"choices": [{"index": 0, "delta": {"content": reply[a:b]}, "finish_reason": None}]}
                           for a, b in zip(cuts, cuts[1:])]
                chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
                if server.usage and (body.get("stream_options") or {}).get("include_usage"):
                    used = min(2 * n, body["max_tokens"])  # never more than asked: that would be a failure
                    chunks.append({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": used}})
                if server.cut_on and server.cut_on in question:
                    chunks = chunks[:2]  # the server dies mid-answer
                try:
                    for c in chunks:
                        self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
                        self.wfile.flush()
                        time.sleep(server.delay)
                    if not (server.cut_on and server.cut_on in question):
                        self.wfile.write(b"data: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    servers = []

    def make(**kw):
        servers.append(FakeServer(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def loadtest(url, *args):
    r = run_cli(["bench", "load", "--json", "--url", url, *args])
    return r, (json.loads(r.stdout) if r.exit_code == 0 else None)


def test_multi_turn_sends_every_earlier_turn_and_the_servers_own_answers(fake):
    srv = fake()
    r, rep = loadtest(srv.url, "--scenario", "multi-turn", "--conversations", "2", "--turns", "3",
                      "--concurrency", "2", "--max-tokens", "5")
    assert r.exit_code == 0, r.stderr
    assert len(srv.requests) == 6
    by_conv: dict = {}
    for req in srv.requests:
        body = req["body"]
        assert set(body) == STANDARD_FIELDS  # nothing non-standard unless --extra-body asks
        assert body["model"] == "fake-model" and body["temperature"] == 0 and body["max_tokens"] == 5
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        by_conv.setdefault(body["messages"][0]["content"], []).append(body["messages"])
    assert len(by_conv) == 2
    for sent in by_conv.values():
        sent.sort(key=len)
        assert [len(m) for m in sent] == [1, 3, 5]
        for k, msgs in enumerate(sent):
            assert [m["role"] for m in msgs] == ["user", "assistant"] * k + ["user"]
            for i in range(k):  # each earlier answer is exactly what the server streamed for that turn
                assert msgs[2 * i + 1]["content"] == f"reply to: {msgs[2 * i]['content']}"
                assert msgs[:2 * i + 1] == sent[i]  # and the turns before it are those sent then
    reqs = rep["requests"]
    assert [(q["conversation"], q["turn"]) for q in reqs] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    for q in reqs:
        assert q["ok"] and q["text"] == "reply to: " + q["messages"][-1]["content"]
        assert q["output_tokens"] == 5 and q["tokens_from"] == "usage" and len(q["itl_s"]) == 3
    s = rep["summary"]
    assert s["requests"]["succeeded"] == 6 and s["ttft_first_turn_s"]["n"] == 2 and s["ttft_later_turns_s"]["n"] == 4
    assert rep["fidelity"] is None


def test_shared_system_conversations_begin_with_one_deterministic_system_prompt(fake):
    srv = fake()
    r, rep = loadtest(srv.url, "--scenario", "shared-system", "--system-tokens", "200", "--conversations", "3",
                      "--turns", "2", "--concurrency", "3")
    assert r.exit_code == 0, r.stderr
    systems = {req["body"]["messages"][0]["content"] for req in srv.requests}
    assert systems == {load.system_prompt(200)}
    assert all(req["body"]["messages"][0]["role"] == "system" for req in srv.requests)
    assert rep["config"]["system_tokens"] == 200 and rep["summary"]["requests"]["succeeded"] == 6


def test_without_usage_the_pieces_are_counted_and_extra_body_and_key_are_sent(fake, tmp_path):
    srv = fake(key="k-123", usage=False, pieces=3)
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    r, rep = loadtest(srv.url + "/v1/", "--api-key", "k-123", "--conversations", "2", "--model", "mine",
                      "--extra-body", '{"cache_prompt": false}', "--json-file", str(out), "--markdown", str(md))
    assert r.exit_code == 0, r.stderr
    assert all(q["headers"]["Authorization"] == "Bearer k-123" for q in srv.requests)
    assert all(q["body"]["cache_prompt"] is False and q["body"]["model"] == "mine" for q in srv.requests)
    assert all(q["output_tokens"] == 3 and q["tokens_from"] == "chunks" for q in rep["requests"])
    assert json.loads(out.read_text()) == rep
    assert "| TTFT | 2 |" in md.read_text() and "goodput" in md.read_text()
    assert rep["stamp"]["command"] == rep["command"] and rep["stamp"]["threads"] is None  # the server's own
    assert md.read_text().split("\n")[3].startswith(f"- run: specquant {rep['stamp']['specquant']}")


def test_a_failed_request_is_recorded_and_ends_its_conversation(fake):
    srv = fake(fail_on="Mona Lisa")  # the second built-in question: conversation 0's second turn
    r, rep = loadtest(srv.url, "--scenario", "multi-turn", "--conversations", "2", "--turns", "3",
                      "--concurrency", "2")
    assert r.exit_code == 0, r.stderr
    reqs = rep["requests"]
    failed = [q for q in reqs if not q["ok"]]
    assert [(q["conversation"], q["turn"]) for q in failed] == [(0, 1)]
    assert failed[0]["error"] == "HTTP 500: scripted failure"
    assert len(reqs) == 5  # conversation 0's third turn was never sent
    s = rep["summary"]
    assert s["requests"] == {"planned": 6, "sent": 5, "succeeded": 4, "failed": 1, "no_content": 0}
    assert s["goodput"]["requests"] == 4 and s["goodput"]["share"] == pytest.approx(4 / 6, abs=1e-4)
    assert "failed: HTTP 500" in r.stderr


def test_a_cut_stream_and_an_answer_that_is_no_stream_are_failures(fake):
    srv = fake(cut_on="Australia", plain_on="Mona Lisa")  # the first two built-in questions
    r, rep = loadtest(srv.url, "--conversations", "3", "--concurrency", "3")
    assert r.exit_code == 0, r.stderr
    errors = [q["error"] for q in rep["requests"]]
    assert errors[0].startswith("the event stream ended before the answer did")
    assert errors[1] == "the answer is no event stream (Content-Type: application/json)"
    assert errors[2] is None and rep["summary"]["requests"]["succeeded"] == 1


def test_poisson_run_starts_each_conversation_at_its_arrival(fake):
    srv = fake()
    r, rep = loadtest(srv.url, "--rate", "10", "--seed", "3", "--conversations", "5")
    assert r.exit_code == 0, r.stderr
    planned = load.arrival_times(5, 10.0, seed=3)
    starts = [q["start_s"] for q in rep["requests"]]
    for s, t in zip(starts, planned):
        assert t - 0.001 <= s <= t + 0.5
    assert rep["config"]["rate"] == 10.0 and rep["config"]["concurrency"] is None


@pytest.mark.parametrize("args, message", [
    (["--url", "ftp://x"], "base URL"),
    (["--url", "http://127.0.0.1:1", "--extra-body", "{nope"], "--extra-body"),
    (["--url", "http://127.0.0.1:1", "--extra-body", '{"stream": false}'], "may not set stream"),
    (["--url", "http://127.0.0.1:1", "--system-tokens", "100"], "applies to --scenario shared-system"),
    (["--url", "http://127.0.0.1:1", "--turns", "2"], "one turn"),
    (["--url", "http://127.0.0.1:1", "--scenario", "chaos"], "--scenario 'chaos'"),
    (["--url", "http://127.0.0.1:1"], "cannot reach the server at http://127.0.0.1:1"),
])
def test_bad_input_and_an_unreachable_server_are_one_line(args, message):
    r = run_cli(["bench", "load", *args])
    assert r.exit_code == 1, r.stdout
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and message in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_a_refused_key_is_one_line(fake):
    srv = fake(key="secret")
    r = run_cli(["bench", "load", "--url", srv.url])
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"error: GET {srv.url}/v1/models: HTTP 401: Invalid API key (give --api-key)")


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
def test_ctrl_c_stops_the_run_cleanly(fake):
    srv = fake(delay=0.2, pieces=500)  # answers that would take 100 s each
    proc = subprocess.Popen([sys.executable, "-m", "specquant_cli", "bench", "load", "--url", srv.url,
                             "--conversations", "2", "--concurrency", "2"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while len(srv.requests) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(srv.requests) == 2
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert out == ""


# -- for real ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_server(family_dir):
    from test_serve import ServerProc

    s = ServerProc(["--family", str(family_dir), "--parallel", "2"])
    yield s
    s.stop()


def test_against_specquant_serve_every_answer_is_the_parents(real_server, family_dir, tmp_path):
    out = tmp_path / "load.json"
    cmd = [sys.executable, "-m", "specquant_cli", "bench", "load", "--url", real_server.url, "--scenario",
           "shared-system", "--system-tokens", "100", "--conversations", "2", "--turns", "2", "--concurrency", "2",
           "--max-tokens", "8", "--family", str(family_dir), "--threads", "1", "--json", "--json-file", str(out)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert json.loads(out.read_text()) == rep
    assert rep["server"]["model"] == "smollm2-135m"
    s = rep["summary"]
    assert s["requests"] == {"planned": 4, "sent": 4, "succeeded": 4, "failed": 0, "no_content": 0}
    assert s["tokens_from"] == ["usage"] and s["output_tokens"] == sum(q["output_tokens"] for q in rep["requests"])
    assert all(1 <= q["output_tokens"] <= 8 for q in rep["requests"])
    for key in ("ttft_s", "ttft_first_turn_s", "ttft_later_turns_s", "itl_s", "e2e_s"):
        p_ = s[key]
        assert p_["n"] > 0 and 0 < p_["p50"] <= p_["p95"] <= p_["p99"] <= p_["max"], key
    assert s["ttft_first_turn_s"]["n"] == 2 and s["ttft_later_turns_s"]["n"] == 2
    assert s["request_throughput"] > 0 and s["output_tokens_per_s"] > 0 and s["goodput"]["share"] == 1.0
    system = load.system_prompt(100)
    for q in rep["requests"]:
        assert q["messages"][0] == {"role": "system", "content": system}
        assert q["text"] and q["fidelity"]["verdict"] == "identical"
    later = [q for q in rep["requests"] if q["turn"] == 1]
    first = {q["conversation"]: q for q in rep["requests"] if q["turn"] == 0}
    for q in later:
        assert q["messages"][2] == {"role": "assistant", "content": first[q["conversation"]]["text"]}
    f = rep["fidelity"]
    assert (f["judged"], f["identical"], f["near_tie"], f["unexplained"]) == (4, 4, 0, 0)
    assert "identical" in p.stderr and "[4/4" in p.stderr
