"""Recorded agent traffic (bench.record, bench.replay): a real client's requests recorded through the pass-through
proxy in front of a real `specquant serve` (the `openai` client, streamed and whole, chat completions and the Responses
API), then replayed in order by `bench load --replay` with every answer judged against the parent alone; a trace that
is not one is refused in one line naming its file and line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import openai
import pytest

from specquant_cli.bench import replay

from conftest import REPO, run_cli

FILE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
TURNS = [
    [{"role": "system", "content": "You edit code."},
     {"role": "user", "content": f"Here is shapes.py:\n\n```python\n{FILE}```\n\nRename w to width."}],
]


@pytest.fixture(scope="module")
def real_server(family_dir):
    from test_serve import ServerProc

    s = ServerProc(["--family", str(family_dir), "--parallel", "1", "--api-key", "none"])
    yield s
    s.stop()


class Recorder:
    """`specquant bench record TRACE --upstream URL --port 0`-like: the proxy as a child process on a free port."""

    def __init__(self, trace, upstream: str):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "specquant_cli", "bench", "record", str(trace),
                                      "--upstream", upstream, "--port", str(self.port)], cwd=REPO,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"
        import httpx

        for _ in range(100):
            try:
                httpx.get(self.url + "/v1/models", timeout=2, headers={"Authorization": "Bearer none"})
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("the recorder did not start: " + "".join(self.lines))

    def stop(self) -> str:
        self.proc.send_signal(2)
        out, _ = self.proc.communicate(timeout=30)
        return out


@pytest.mark.slow
def test_a_client_s_requests_are_recorded_passed_through_and_replayed_as_the_parent_s(real_server, family_dir,
                                                                                       tmp_path):
    trace = tmp_path / "agent.jsonl"
    rec = Recorder(trace, real_server.url)
    try:
        client = openai.OpenAI(base_url=rec.url + "/v1", api_key="none", max_retries=0, timeout=120)
        whole = client.chat.completions.create(model="m", messages=TURNS[0], max_tokens=12, temperature=0)
        answer = whole.choices[0].message.content
        assert answer
        second = [*TURNS[0], {"role": "assistant", "content": answer}, {"role": "user", "content": "Now h to height."}]
        streamed = client.chat.completions.create(model="m", messages=second, max_tokens=12, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        r = client.responses.create(model="m", instructions="You edit code.", input="Say hi.", max_output_tokens=8)
        assert r.output_text is not None
    finally:
        rec.stop()
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert [x["endpoint"] for x in lines] == ["/v1/chat/completions"] * 2 + ["/v1/responses"]
    assert lines[0]["body"]["messages"] == TURNS[0] and lines[1]["body"]["messages"] == second
    assert lines[0]["t"] <= lines[1]["t"] <= lines[2]["t"]
    reqs = replay.read(trace)
    assert [list(q.messages) for q in reqs] == [TURNS[0], second, [{"role": "system", "content": "You edit code."},
                                                                 {"role": "user", "content": "Say hi."}]]
    out = tmp_path / "replay.json"
    p = subprocess.run([sys.executable, "-m", "specquant_cli", "bench", "load", "--url", real_server.url,
                        "--api-key", "none", "--replay", str(trace), "--max-tokens", "12", "--family", str(family_dir),
                        "--threads", "1", "--json-file", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    rep = json.loads(out.read_text())
    assert rep["config"]["scenario"] == "replay" and rep["summary"]["requests"]["succeeded"] == 3
    assert [q["turn"] for q in rep["requests"]] == [0, 1, 2]
    assert [q["messages"] for q in rep["requests"]] == [list(q.messages) for q in reqs]
    assert rep["requests"][0]["text"] == answer  # the same request, the same greedy answer
    assert all(q["fidelity"]["verdict"] == "identical" for q in rep["requests"])
    assert rep["summary"]["prompt_tokens"] > 0 and rep["summary"]["cached_tokens"] is not None
    for q in rep["requests"][:2]:  # the server's own clock: within what the client saw
        assert 0 < q["server_parent_prefill_s"] <= q["server_prefill_s"] <= q["server_total_s"] <= q["e2e_s"]


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"endpoint": "/v1/embeddings", "body": {"input": "x"}}', "cannot be replayed"),
    ('{"messages": []}', "'messages' must be a non-empty array"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0] must be an object with a role"),
    ('{"endpoint": "/v1/responses", "body": {"input": [{"type": "item_reference", "id": "x"}]}}',
     "input[0].type: 'input[0].type' is not supported"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": {"f": 1}}', "'tools' must be an array of objects"),
    ('{"messages": [{"role": "user", "content": "x"}], "prediction": {"content": 3}}', "'prediction' must be"),
    ("[" * 100 + "]" * 100, "nested deeper"),
])
def test_a_trace_that_is_not_one_is_refused_in_one_line(tmp_path, line, message):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n' + line + "\n")
    r = run_cli(["bench", "load", "--url", "http://127.0.0.1:9", "--replay", str(trace)])
    assert r.exit_code == 1 and message in r.stderr and f"{trace}:2" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_replay_takes_no_scenario_of_its_own(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n')
    for extra in (["--edits"], ["--turns", "2"], ["--conversations", "3"], ["--prediction", "wrong"]):
        r = run_cli(["bench", "load", "--url", "http://127.0.0.1:9", "--replay", str(trace), *extra])
        assert r.exit_code == 1 and "--replay sends the trace's requests as recorded" in r.stderr
    r = run_cli(["bench", "load", "--url", "http://127.0.0.1:9", "--replay", str(tmp_path / "none.jsonl")])
    assert r.exit_code == 1 and "none.jsonl" in r.stderr and "Traceback" not in r.stderr
    assert re.search(r"error: .*none\.jsonl", r.stderr)


def test_the_shipped_agent_trace_replays_its_tool_turns_as_chat_requests():
    """The Agents SDK trace (Responses API): its function_call and function_call_output items become the assistant's
    tool calls and tool messages, its function tool and tool_choice go with every request, as serve converts them."""
    reqs = replay.read(REPO / "specquant_cli" / "bench" / "agents-bisect.trace.jsonl")
    assert len(reqs) == 4
    sent, _, fields = replay.turns(reqs)
    assert all([t["function"]["name"] for t in f["tools"]] == ["read_file"] for f in fields)
    assert [f.get("tool_choice") for f in fields] == ["required", None] * 2  # the SDK resets it after a tool call
    assert [m["role"] for m in sent[1]] == ["system", "user", "assistant", "tool"]
    call = sent[1][2]["tool_calls"][0]
    assert call["function"]["name"] == "read_file" and call["id"] == sent[1][3]["tool_call_id"]
    assert '"""Bisection algorithms."""' in sent[1][3]["content"]
    assert [m["role"] for m in sent[3]] == ["system", "user", "assistant", "tool", "assistant", "user", "assistant",
                                            "tool"]
    assert sent[3][4]["content"].startswith("```python\n")  # output_text parts as the text they make


def test_requests_picks_from_the_trace_and_only_from_one():
    r = run_cli(["bench", "load", "--url", "http://127.0.0.1:9", "--requests", "1"])
    assert r.exit_code == 1 and "--requests applies to --replay" in r.stderr
    trace = REPO / "specquant_cli" / "bench" / "agents-bisect.trace.jsonl"
    for bad in ("5", "0", "2,x"):
        r = run_cli(["bench", "load", "--url", "http://127.0.0.1:9", "--replay", str(trace), "--requests", bad])
        assert r.exit_code == 1 and "is no whole number from 1 to 4" in r.stderr, r.stderr


def test_a_request_whose_tool_choice_forces_a_call_is_not_judged():
    """The server holds such an answer to a grammar; the parent alone, answering freely, is no judge of it."""
    from specquant_cli.bench.answer import RequestResult
    from specquant_cli.bench.fidelity import _forced

    assert [_forced(RequestResult(0, 0, [], fields=f)) for f in (
        {}, {"tool_choice": "auto"}, {"tool_choice": "none"}, {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "f"}}})] == [False, False, False, True, True]


@pytest.mark.slow
def test_the_agent_trace_replays_its_tool_turns_and_judges_what_it_can(real_server, family_dir, tmp_path):
    """The Agents SDK trace's first two requests through a real server: the forced tool call comes back as a call and
    is not judged; the rewrite from the tool's output is judged against the parent alone, tools in its prompt."""
    out, trace = tmp_path / "replay.json", REPO / "specquant_cli" / "bench" / "agents-bisect.trace.jsonl"
    p = subprocess.run([sys.executable, "-m", "specquant_cli", "bench", "load", "--url", real_server.url,
                        "--api-key", "none", "--replay", str(trace), "--requests", "1,2", "--max-tokens", "96",
                        "--family", str(family_dir), "--threads", "1", "--json-file", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    rep = json.loads(out.read_text())
    first, second = rep["requests"]
    assert first["fields"]["tool_choice"] == "required" and first["text"].startswith("<tool_call>\n{")
    assert first["fidelity"]["verdict"] == "not judged" and rep["fidelity"]["not_judged"] == 1
    assert [t["function"]["name"] for t in second["fields"]["tools"]] == ["read_file"]
    assert second["fidelity"]["verdict"] == "identical" and rep["fidelity"]["judged"] == 1
    assert rep["config"]["datasets"][0].endswith("agents-bisect.trace.jsonl requests 1,2")


def test_a_replayed_request_holds_the_server_s_own_answer_to_an_earlier_one():
    """Where a request holds an earlier replayed request's messages and then its answer, the answer sent is the one
    this server gave (a trace recorded with sampling holds answers no greedy server gives); tool calls stay."""
    sent, _, _ = replay.turns(replay.read(REPO / "specquant_cli" / "bench" / "agents-bisect.trace.jsonl"))
    mine = replay.with_answers(sent[3], [(sent[0], None), (sent[1], "```python\nmine\n```")])
    assert mine[4] == {**sent[3][4], "content": "```python\nmine\n```"}
    assert mine[:4] == list(sent[3][:4]) and mine[5:] == list(sent[3][5:])  # the tool call and its output as recorded
    assert replay.with_answers(sent[3], [(sent[1], None)]) == list(sent[3])  # a failed turn or a tool call: recorded
    assert replay.with_answers(sent[3], [(sent[2], "x")]) == list(sent[3])  # not where this request begins
    assert replay.with_answers(sent[1], [(sent[1], "x")]) == list(sent[1])  # no answer after them


@pytest.mark.slow
def test_a_replayed_rewrite_finds_the_server_s_own_answer_in_its_cache(real_server, family_dir, tmp_path):
    out, trace = tmp_path / "replay.json", REPO / "specquant_cli" / "bench" / "agents-bisect.trace.jsonl"
    p = subprocess.run([sys.executable, "-m", "specquant_cli", "bench", "load", "--url", real_server.url,
                        "--api-key", "none", "--replay", str(trace), "--requests", "2,4", "--max-tokens", "32",
                        "--json-file", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    first, second = json.loads(out.read_text())["requests"]
    # the first rewrite's prompt and the server's own (cut) answer to it: the recorded answer would miss after 3 tokens
    assert second["cached_tokens"] >= first["prompt_tokens"] + 16, (first, second)
