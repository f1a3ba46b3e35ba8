"""The llama.cpp build's self-test: a decode per weight type in child processes, a signal death turned into
one line, the result cached per build and CPU and checked on read, and doctor's report of the build."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from hostile_util import assert_clean_error

from specquant_cli.backend import selftest
from specquant_cli.system import hardware

from conftest import REPO, run_cli


def _cli(args, env_extra, tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), **env_extra)
    return subprocess.run([sys.executable, "-m", "specquant_cli", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, stdin=subprocess.DEVNULL, timeout=300)


def _one_error_line(p) -> str:
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, p.stderr
    return lines[0]


def test_every_type_decodes_in_this_build(selftest_cache):
    r = selftest.cached()  # the session ran it first (conftest) and stored it
    assert r is not None and r.ok, r
    assert r.types == {t: "ok" for t in selftest.TYPES}


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
def test_sigill_in_the_child_is_one_line_and_exit_1(tmp_path):
    p = _cli(["doctor", "--selftest"], {selftest.FAULT_ENV: "q4_0:SIGILL"}, tmp_path)
    assert p.returncode == 1, (p.returncode, p.stderr)
    line = _one_error_line(p)
    assert "SIGILL" in line and "Q4_0" in line and "rebuild" in line, line
    # the types after the faulting one were still tested, in a new child
    assert "q4_k  ok" in p.stderr and "q8_0  ok" in p.stderr, p.stderr
    assert "f16   ok" in p.stderr


def test_a_faulting_build_stops_chat_before_its_first_answer(tmp_path, family_dir):
    """The engine's first model load meets the fault in the self-test's child: one line, exit 1, not a
    signal death; the (definitive) result is cached, so the next command says it at once."""
    env = {selftest.FAULT_ENV: "q8_0:SIGSEGV"}
    p = _cli(["chat", "--family", str(family_dir), "--policy", "parent", "--max-tokens", "4", "hi"], env, tmp_path)
    assert p.returncode == 1, (p.returncode, p.stderr)
    line = _one_error_line(p)
    assert "SIGSEGV" in line and "Q8_0" in line, line
    assert p.stdout == ""
    cache = json.loads((tmp_path / "cache" / "specquant" / "selftest.json").read_text())
    (entry,) = cache["entries"].values()
    assert entry["ok"] is False and entry["types"]["q8_0"] == "died of SIGSEGV"
    p2 = _cli(["chat", "--family", str(family_dir), "--policy", "parent", "--max-tokens", "4", "hi"], {}, tmp_path)
    assert p2.returncode == 1 and "checking this llama.cpp build" not in p2.stderr
    assert _one_error_line(p2) == line


@pytest.mark.parametrize("content", [
    "not json", "[]", '{"schema": 1}', '{"schema": 99, "entries": {}}',
    '{"schema": 1, "entries": {"KEY": {"ok": true, "types": {"q4_0": "died of SIGILL"}, "error": null}}}',
    '{"schema": 1, "entries": {"KEY": {"ok": "yes", "types": {}, "error": null}}}',
    '{"schema": 1, "entries": {"KEY": {"ok": false, "types": {}, "error": 7}}}',
])
def test_a_cache_entry_that_does_not_check_out_is_not_trusted(tmp_path, monkeypatch, content):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = selftest.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(content.replace("KEY", selftest.key()))
    assert selftest.cached() is None


def test_cache_is_keyed_by_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ok = selftest.Result(key=selftest.key(), ok=True, types={t: "ok" for t in selftest.TYPES})
    selftest._store(ok)
    assert selftest.cached() is not None
    monkeypatch.setattr(selftest, "cpu_id", lambda: "model name : another CPU\nflags : sse2\n")
    assert selftest.cached() is None


def test_a_read_only_cache_is_not_an_error(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    monkeypatch.setenv("XDG_CACHE_HOME", str(ro / "sub"))
    try:
        selftest._store(selftest.Result(key="k", ok=True, types={t: "ok" for t in selftest.TYPES}))
    finally:
        ro.chmod(0o700)


def test_parse_system_info():
    text = "CPU : SSE3 = 1 | AVX = 1 | AVX512 = 1 | AMX_INT8 = 0 | LLAMAFILE = 1 | REPACK = 1 | "
    assert hardware.parse_system_info(text) == {"SSE3": True, "AVX": True, "AVX512": True, "AMX_INT8": False,
                                                "LLAMAFILE": True, "REPACK": True}


def test_doctor_json_reports_the_build_and_its_selftest():
    r = run_cli(["doctor", "--json"])
    assert r.exit_code == 0, r.stderr
    b = json.loads(r.stdout)["hardware"]["build"]
    assert b["system_info"] and b["cpu_features"]
    assert b["repack"] is True  # the repacked Q4_0 kernels stay on
    assert b["amx"] is (os.environ.get("SPECQUANT_AMX") == "1" and "AMX_INT8" in b["cpu_features"])
    assert b["rpc"] is True  # the set-up builds llama.cpp's RPC backend
    assert b["selftest"]["ok"] is True and set(b["selftest"]["types"]) == set(selftest.TYPES)


def test_child_refuses_an_unknown_type(tmp_path):
    p = subprocess.run([sys.executable, "-m", "specquant_cli.backend.selftest_child", str(tmp_path), "q9_9"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "unknown type q9_9" in p.stderr


def test_fault_result_is_one_line_through_cli_in_process(monkeypatch, family_dir):
    """The same translation in-process: a stored definitive failure makes ensure() raise the one line."""
    bad = selftest.Result(key=selftest.key(), ok=False, types={"q4_0": "died of SIGILL"},
                          error=selftest._death_line("q4_0", 4))
    monkeypatch.setattr(selftest, "_verified", None)
    monkeypatch.setattr(selftest, "cached", lambda k=None: bad)
    r = run_cli(["chat", "--family", str(family_dir), "--policy", "parent", "--max-tokens", "2", "hi"])
    assert_clean_error(r, 1, "SIGILL", "Q4_0")


def test_a_self_test_that_could_not_run_warns_and_goes_on(monkeypatch):
    """No temp space, out of time: not the build's fault, so not a refusal (and not cached)."""
    could_not = selftest.Result(key="k", ok=False, types={"f16": "exit code 1"}, definitive=False,
                                error="the llama.cpp self-test could not run (F16: cannot create a work folder)")
    monkeypatch.setattr(selftest, "_verified", None)
    monkeypatch.setattr(selftest, "cached", lambda k=None: None)
    monkeypatch.setattr(selftest, "run", lambda: could_not)
    said: list[str] = []
    selftest.ensure(status=said.append)
    assert said[-1].startswith("warning: the llama.cpp self-test could not run")


# -- a verdict means the CPU: a child killed from outside condemns nothing, a fault condemns the build -----------------
def _selftest_cli(args, fault, tmp_path, timeout=300):
    from specquant_cli.backend import selftest

    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), **{selftest.FAULT_ENV: fault})
    return subprocess.run([sys.executable, "-m", "specquant_cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, stdin=subprocess.DEVNULL, timeout=timeout)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1"])
def test_a_child_killed_from_outside_condemns_nothing(family_dir, tmp_path, sig):
    p = _selftest_cli(["chat", "--family", str(family_dir), "--policy", "parent", "--max-tokens", "3", "hi"],
                      f"q4_0:{sig}", tmp_path)
    assert p.returncode == 0, p.stderr  # warned, and went on
    assert "could not run" in p.stderr and "specquant doctor --selftest" in p.stderr and p.stdout.strip()
    assert not (tmp_path / "cache" / "specquant" / "selftest.json").exists()  # nothing cached


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
@pytest.mark.parametrize("sig", ["SIGILL", "SIGBUS", "SIGFPE"])
def test_a_fault_condemns_the_build_and_names_the_retest(tmp_path, sig):
    p = _selftest_cli(["doctor", "--selftest"], f"q8_0:{sig}", tmp_path)
    assert p.returncode == 1
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")][-1]
    assert sig in line and "specquant doctor --selftest" in line
    assert json.loads((tmp_path / "cache" / "specquant" / "selftest.json").read_text())["entries"]


def test_a_fault_then_a_kill_still_condemns_the_build(monkeypatch):
    from specquant_cli.backend import selftest

    # BF16 faults, then Q4_0 is killed (each child: types passed, return code, last stderr line, GPUs it decoded on)
    children = iter([(["f16"], -signal.SIGILL, "", None), ([], -signal.SIGKILL, "", None)])
    monkeypatch.setattr(selftest, "_run_child", lambda todo, deadline: next(children))
    r = selftest.run(store=False)
    assert not r.ok and r.definitive and "SIGILL" in r.error and "BF16" in r.error
    assert r.types == {"f16": "ok", "bf16": "died of SIGILL", "q4_0": "killed by SIGKILL"}


def test_an_old_verdict_of_a_kill_is_not_trusted(tmp_path, monkeypatch):
    from specquant_cli.backend import selftest

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = selftest.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema": 1, "entries": {selftest.key(): {
        "ok": False, "types": {"q4_0": "died of SIGKILL"}, "error": "this llama.cpp build cannot run"}}}))
    assert selftest.cached() is None
