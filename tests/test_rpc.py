"""A parent over llama.cpp RPC workers (`specquant worker`, `--rpc`), loopback only.

Two workers per module, subprocesses on free 127.0.0.1 ports. Every subprocess has a deadline: a hang
fails the test instead of stalling the suite. Faults: ggml-rpc aborts the process on a lost worker; what
is asserted is specquant's guard around it (one `error:` line and exit 1 for chat; a 503 and a server
that stays up for serve)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from hostile_util import assert_clean_error
from test_serve import KEY, ServerProc

from conftest import REPO, run_cli

RUN_TIMEOUT_S = 300
PROMPT = "The capital of France is"
COUNTING = "Count from 1 to 1000, separated by commas: 1, 2, 3, 4,"


RECOVER_TIMEOUT_S = 120  # a restarted server loads its models again


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, timeout: float = RUN_TIMEOUT_S, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specquant_cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, **kw)


class Worker:
    """`specquant worker --port P` in a subprocess, ready once it prints its endpoint."""

    def __init__(self, *extra: str, port: int | None = None):
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "specquant_cli", "worker", "--port", str(self.port),
                                      "--threads", "1", *extra], cwd=REPO, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(60) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("worker did not start:\n" + "\n".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if "serving" in line:
                self._ready.set()
        self._ready.set()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def workers():
    ws = [Worker(), Worker()]
    yield ",".join(w.endpoint for w in ws)
    for w in ws:
        w.stop()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["parent", "spec-q4", "auto"])
def test_greedy_output_through_workers_is_identical(family_dir, workers, policy, parent_judge):
    """The same answer through the workers as here; `auto` plans from each place's own calibration (the workers'
    parent is calibrated per worker set), so its batch shapes may differ and its answers part only at a proven
    near-tie: each is then the parent's own or such a near-tie (parent_judge)."""
    args = ["chat", "--family", str(family_dir), "--policy", policy, "--max-tokens", "24", PROMPT]
    local = cli(*args)
    remote = cli(*args, "--rpc", workers)
    assert local.returncode == 0, local.stderr
    assert remote.returncode == 0, remote.stderr
    assert local.stdout.strip()
    if policy == "auto" and remote.stdout != local.stdout:
        for out in (local, remote):
            assert parent_judge(PROMPT, out.stdout.rstrip("\n"), 24) in ("identical", "near-tie"), out.stdout
    else:
        assert remote.stdout == local.stdout


@pytest.mark.slow
def test_bench_through_workers_is_identical_to_local(family_dir, workers, tmp_path):
    args = ["bench", "prompts", "--family", str(family_dir), "--categories", "qa,code", "--limit", "1", "--policies",
            "parent,spec-q4", "--max-tokens", "16", "--warmup", "0"]
    texts = {}
    for where, extra in (("local", []), ("remote", ["--rpc", workers])):
        out = tmp_path / f"{where}.json"
        p = cli(*args, *extra, "--json-file", str(out))
        assert p.returncode == 0, p.stderr
        texts[where] = {(r["item"], r["policy"]): r["text"] for r in json.loads(out.read_text())["records"]}
    assert texts["remote"] == texts["local"] and len(texts["local"]) == 4


@pytest.mark.slow
def test_env_variable_and_doctor_plan(family_dir, workers):
    r = cli("doctor", "--family", str(family_dir), "--json", env={**os.environ, "SPECQUANT_RPC": workers})
    assert r.returncode == 0, r.stderr
    import json

    rep = json.loads(r.stdout)["rpc"]
    assert [w["endpoint"] for w in rep["workers"]] == workers.split(",")
    assert rep["fits"] is True and sum(rep["plan"]["layers"].values()) > 0


@pytest.mark.slow
def test_plan_that_does_not_fit_is_refused_before_loading(family_dir):
    w = Worker("--mem", "0.05")
    try:
        r = cli("chat", "--family", str(family_dir), "--policy", "parent", "--rpc", w.endpoint, "hi", timeout=120)
    finally:
        w.stop()
    assert r.returncode == 1
    assert r.stderr.startswith("error: the parent (f16) needs") and r.stderr.count("\n") == 1


def test_worker_down_at_start_is_one_line(family_dir):
    port = free_port()
    r = cli("chat", "--family", str(family_dir), "--policy", "parent", "--rpc", f"127.0.0.1:{port}", "hi", timeout=60)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and f"127.0.0.1:{port}" in r.stderr and "not reachable" in r.stderr


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
def test_bad_endpoint_is_a_usage_error():
    r = cli("chat", "--rpc", "nohostport", "hi", timeout=60)
    assert r.returncode == 2 and "HOST:PORT" in r.stderr


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
def test_non_loopback_host_needs_allow_remote():
    r = cli("worker", "--host", "0.0.0.0", "--port", str(free_port()), timeout=60)
    assert r.returncode == 1 and "--allow-remote" in r.stderr and "authentication" in r.stderr


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_worker_stops_on_signal(sig, code):
    w = Worker()
    assert w.stop(sig) == code


@pytest.mark.slow
def test_worker_killed_mid_answer_ends_chat_with_a_clear_error(family_dir):
    w = Worker()
    proc = subprocess.Popen([sys.executable, "-m", "specquant_cli", "chat", "--family", str(family_dir), "--policy",
                             "parent", "--max-tokens", "3000", "--rpc", w.endpoint, COUNTING], cwd=REPO,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: any("Accepted client" in ln for ln in w.lines), 120)
        time.sleep(8)  # the parent is loaded on the worker and decoding
        w.proc.kill()
        out, err = proc.communicate(timeout=60)
    finally:
        w.stop()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert err.strip().splitlines()[-1].startswith(f"error: RPC worker {w.endpoint} was lost mid-answer")


@pytest.mark.slow
def test_serve_through_workers_and_a_lost_worker(family_dir):
    """One of two workers killed mid-answer: 503s while it is away, then the server restarts itself (same port),
    the survivor first freed of the dead parent's connection, and answers as before."""
    ws = [Worker() for _ in range(2)]
    srv = ServerProc(["--family", str(family_dir), "--policy", "parent", "--policies", "parent,spec-q4",
                      "--api-key", KEY, "--rpc", ",".join(w.endpoint for w in ws)])
    try:
        client = srv.client()
        r = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=8, temperature=0)
        assert r.choices[0].text
        chat = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=16, temperature=0)
        local = cli("chat", "--family", str(family_dir), "--policy", "parent", "--max-tokens", "16", PROMPT)
        assert chat.choices[0].message.content == local.stdout.rstrip("\n")  # served through the workers = local
        got: dict = {}

        def long_request():
            try:
                client.completions.create(model="smollm2-135m", prompt=COUNTING, max_tokens=3000, temperature=0)
            except openai.APIStatusError as e:
                got["error"] = e

        t = threading.Thread(target=long_request)
        t.start()
        _wait_for(lambda: _status(srv).get("running") == 1, 30)
        time.sleep(2)  # the answer is being generated
        ws[0].proc.kill()
        t.join(60)
        assert not t.is_alive()
        e = got["error"]
        assert e.status_code == 503 and e.body["code"] == "rpc_worker_lost" and ws[0].endpoint in e.body["message"]
        h = httpx.get(srv.url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert h.status_code == 503 and h.json()["status"] == "parent_lost" and h.json()["busy"] is False
        with pytest.raises(openai.APIStatusError) as again:
            client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=4)
        assert again.value.status_code == 503
        ws[0] = Worker(port=ws[0].port)  # the worker is back: the server restarts itself and answers again
        _wait_for(lambda: _health(srv) == 200, RECOVER_TIMEOUT_S)
        back = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=8, temperature=0)
        assert back.choices[0].text == r.choices[0].text
        assert "restarting to load the parent" in srv.log()
    finally:
        code = srv.stop()
        for w in ws:
            w.stop()
    assert code == 0, srv.log()


def _health(srv) -> int:
    try:
        return httpx.get(srv.url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0  # between the old process and the new one nothing listens


def _status(srv) -> dict:
    return httpx.get(srv.url + "/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()


def _wait_for(cond, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.2)


# -- RPC never hangs, and always hears Ctrl-C --------------------------------------------------------------------------
@pytest.mark.parametrize("value,needle", [("0", "above 0"), ("-1", "at least 0"), ("nan", "finite"),
                                          ("inf", "finite"), ("1e30", "at most 86400"), ("-inf", "finite"),
                                          ("abc", "a number"), ("1e-400", "above 0")])
def test_bad_rpc_timeouts_are_one_line(value, needle):
    r = run_cli(["chat", "--family", "/nonexistent", "hi"], env={"SPECQUANT_RPC_TIMEOUT": value})
    assert_clean_error(r, 1, f"SPECQUANT_RPC_TIMEOUT={value}", needle)
    r = run_cli(["chat", "--family", "/nonexistent", "--rpc-timeout", value, "hi"])
    assert r.exit_code == 2 and "--rpc-timeout" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("value", ["inf", "1e30", "nan", "0", "-1"])
def test_bad_worker_memory_is_a_usage_error(value):
    assert_clean_error(run_cli(["worker", "--mem", value]), 2, "--mem")


@pytest.mark.parametrize("spec", ["127.0.0.1:{p},localhost:{p}", "localhost:{p},127.0.0.1:{p}",
                                  "127.0.0.1:{p}, 127.0.0.1:{p},localhost:{p}"])
def test_one_worker_named_twice_is_refused(spec):
    value = spec.format(p=50999)
    assert_clean_error(run_cli(["chat", "--family", "/nonexistent", "--rpc", value, "hi"]), 2, "name one worker")
    assert_clean_error(run_cli(["chat", "--family", "/nonexistent", "hi"], env={"SPECQUANT_RPC": value}), 1,
                       "SPECQUANT_RPC=", "name one worker")


def test_an_empty_rpc_option_is_refused_not_run_locally():
    assert_clean_error(run_cli(["chat", "--family", "/nonexistent", "--rpc", "", "hi"]), 2, "no worker given")


def _worker(*extra: str, host: str = "127.0.0.1"):
    return Worker("--host", host, *extra)


def test_a_worker_binds_a_name(family_dir):
    w = _worker(host="localhost")
    try:
        assert any("serving localhost:" in ln for ln in w.lines)
        r = subprocess.run([sys.executable, "-m", "specquant_cli", "doctor", "--family", str(family_dir), "--json",
                            "--rpc", f"localhost:{w.port}"], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["rpc"]["workers"][0]["endpoint"] == f"localhost:{w.port}"
    finally:
        w.stop()


def test_a_silent_connection_does_not_lock_a_worker(family_dir):
    from specquant_cli.system import rpc
    from specquant_cli.system.rpc_front import QUIET_S

    w = _worker()
    try:
        idle = socket.create_connection(("127.0.0.1", w.port))  # says nothing
        time.sleep(QUIET_S + 1.5)
        assert rpc.probe(w.endpoint).devices  # the worker answers a parent again
        assert any("sent no command" in ln for ln in w.lines)
        assert idle.recv(1) == b""  # closed by the worker
        idle.close()
    finally:
        w.stop()


def test_the_front_drops_the_silent_and_relays_the_rest():
    from specquant_cli.system.rpc_front import Front

    backend = socket.socket()
    backend.bind(("127.0.0.1", 0))
    backend.listen(4)
    front_sock = socket.socket()
    front_sock.bind(("127.0.0.1", 0))
    front_sock.listen(4)
    said: list[str] = []
    front = Front(front_sock, backend.getsockname()[1], said.append, quiet_s=0.3)
    threading.Thread(target=front.serve, daemon=True).start()
    try:
        silent = socket.create_connection(front_sock.getsockname())
        silent.settimeout(5)
        assert silent.recv(1) == b"" and "sent no command" in said[0]
        stingy = socket.create_connection(front_sock.getsockname())  # a byte, then nothing: no header
        stingy.sendall(b"\x0e")
        stingy.settimeout(5)
        assert stingy.recv(1) == b"" and len(said) == 2
        talker = socket.create_connection(front_sock.getsockname())
        header = b"\x0e" + (4).to_bytes(8, "little")
        talker.sendall(header[:3])
        talker.sendall(header[3:] + b"ping")
        conn, _ = backend.accept()
        conn.settimeout(5)
        got = b""
        while len(got) < len(header) + 4:
            got += conn.recv(64)
        assert got == header + b"ping"
        conn.sendall(b"pong")
        talker.settimeout(5)
        assert talker.recv(4) == b"pong"
        for s in (silent, stingy, talker, conn):
            s.close()
    finally:
        front.stop.set()
        backend.close()


def _stalled_run(family_dir, args: list[str], sig: int):
    """A command on a parent over a worker that stops answering mid-answer; `sig` then. (rc, seconds, stderr)."""
    w = _worker()
    try:
        p = subprocess.Popen([sys.executable, "-m", "specquant_cli", *args, "--family", str(family_dir),
                              "--rpc", w.endpoint, "--threads", "1"], cwd=REPO, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = p.stdout.read(8)  # the answer is being generated
        assert first, p.stderr.read()
        w.proc.send_signal(signal.SIGSTOP)
        time.sleep(1.0)
        t0 = time.monotonic()
        p.send_signal(sig)
        try:
            p.wait(30)
        finally:
            w.proc.send_signal(signal.SIGCONT)
        return p.returncode, time.monotonic() - t0, p.stderr.read()
    finally:
        w.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stalled_worker_does_not_hold_off_a_signal(family_dir, sig):
    rc, seconds, err = _stalled_run(family_dir, ["chat", "--policy", "parent", "--max-tokens", "3000", COUNTING], sig)
    assert seconds < 5 and rc in (130, 143), (rc, seconds, err)
    assert "Traceback" not in err and "lost" not in err


def test_serve_stopping_on_a_stalled_worker_answers_503_and_exits(family_dir):
    """Every open request gets the documented 503 in OpenAI's shape at once, and the process exits within its
    grace period, though its generation waits on a worker that stopped answering."""

    from specquant_cli.serving.server import RPC_RELEASE_S, SHUTDOWN_GRACE_S

    w = _worker()
    srv = ServerProc(["--family", str(family_dir), "--policy", "parent", "--policies", "parent", "--parallel", "1",
                      "--rpc", w.endpoint])
    got: dict = {}
    try:
        client = srv.client(key="none")

        def long_request():
            try:
                client.completions.create(model="m", prompt=COUNTING, max_tokens=3000, temperature=0)
            except openai.APIStatusError as e:
                got["error"] = e

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(4)  # the answer is being generated
        w.proc.send_signal(signal.SIGSTOP)
        time.sleep(1.0)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        t.join(30)
        answered = time.monotonic() - t0
        srv.proc.wait(SHUTDOWN_GRACE_S + RPC_RELEASE_S + 15)
        took = time.monotonic() - t0
    finally:
        w.proc.send_signal(signal.SIGCONT)
        srv.stop()
        w.stop()
    e = got["error"]
    assert e.status_code == 503 and e.body["code"] == "shutting_down" and answered < 5, (answered, e)
    assert srv.proc.returncode == 0 and took < SHUTDOWN_GRACE_S + RPC_RELEASE_S + 10, (took, srv.log())
    assert "Traceback" not in srv.log()
