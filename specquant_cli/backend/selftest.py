"""The build self-test: can this llama.cpp build decode on this CPU?

A llama.cpp build compiled for the host (`-march=native`) can hold kernels that fault on another CPU, or
on a VM that advertises an extension it does not run (ggml's AMX kernels: SIGILL on every Q4_0/Q8_0
batch). A signal death is not an error a process can report, so the test runs in a child process: it
writes a tiny llama model, quantizes it to each weight type the families use and decodes a multi-token
batch then single steps through each, checking the logits are finite; where the build has a GPU backend and a
GPU is present, each type is decoded on the GPU too and must agree with the CPU. The parent turns a death into one
line (which type, which signal, what to do).

The result is cached per build and CPU (`$XDG_CACHE_HOME/specquant/selftest.json`, checked on read) and
`ensure()` runs it before the first model of a process is loaded, so on a new machine/build pair the
self-test meets a faulting kernel before the user's answer does.

The child is backend.selftest_child (python -m specquant_cli.backend.selftest_child DIR TYPE [TYPE ...])."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from specquant_cli.errors import LlamaError
from specquant_cli.settings import SELFTEST_CHILD_ENV, SELFTEST_FAULT_ENV, env

TYPES = ("f16", "bf16", "q4_0", "q4_k", "q8_0")  # every weight type the families' roles use
FTYPES = {"f16": "LLAMA_FTYPE_MOSTLY_F16", "bf16": "LLAMA_FTYPE_MOSTLY_BF16", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
           "q4_k": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}
SCHEMA = 1
TIMEOUT_S = 180.0
# The deaths that say something about the build on this CPU; any other signal (SIGKILL from the OOM killer or a
# supervisor, SIGTERM, SIGINT, ...) says the test could not run, and condemns nothing.
FAULTS = frozenset({"SIGILL", "SIGSEGV", "SIGBUS", "SIGFPE"})
RETEST = "specquant doctor --selftest"
CHILD_ENV, FAULT_ENV = SELFTEST_CHILD_ENV, SELFTEST_FAULT_ENV  # declared in settings
REBUILD_HINT = ("rebuild llama-cpp-python for this CPU: ./scripts/test.sh does (its wheel cache is keyed by CPU), "
                "or CMAKE_ARGS='-DGGML_RPC=ON' CFLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
                "CXXFLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' pip install --force-reinstall --no-cache-dir "
                "--no-binary llama-cpp-python llama-cpp-python==0.3.36")

_verified: Optional[str] = None  # the key this process has seen pass


@dataclass
class Result:
    key: str
    ok: bool
    types: dict[str, str] = field(default_factory=dict)  # type -> "ok" or why not
    error: Optional[str] = None  # the one line for the user when not ok
    definitive: bool = True  # a signal death or bad logits (cached); False: could not run (not cached)
    seconds: float = 0.0
    at: str = ""
    gpu: Optional[str] = None  # the GPU backend devices each type was decoded on too (CUDA0, ...); None: CPU only

    def to_dict(self) -> dict:
        return asdict(self)


# -- identity of the build and the CPU ---------------------------------------------------------------------
def cpu_id(cpuinfo: str = "/proc/cpuinfo") -> str:
    keep = []
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part", "Hardware")) and line not in keep:
                    keep.append(line)
                if len(keep) >= 2 and line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    keep.append(os.uname().machine)
    return "".join(keep)


def build_id() -> str:
    """The installed llama-cpp-python: its version and its shared libraries (name, size, mtime)."""
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    parts = [getattr(llama_cpp, "__version__", "?")]
    for p in sorted(lib.glob("*.so*")) + sorted(lib.glob("*.dylib")) + sorted(lib.glob("*.dll")):
        st = p.stat()
        parts.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def key() -> str:
    return hashlib.sha256(f"{build_id()}\n{cpu_id()}".encode()).hexdigest()[:24]


# -- the cache -----------------------------------------------------------------------------------------------
def cache_path() -> Path:
    """The verdict's file in specquant's user cache (settings.cache_home)."""
    from specquant_cli.settings import cache_home

    home = cache_home()
    if home is None:
        raise OSError("no user cache folder (no home, no absolute XDG_CACHE_HOME)")
    return home / "selftest.json"


def _valid_entry(e: object) -> bool:
    return (isinstance(e, dict) and isinstance(e.get("ok"), bool) and isinstance(e.get("types"), dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in e["types"].items())
            and (e.get("error") is None or isinstance(e.get("error"), str))
            and e["ok"] == (e.get("error") is None and set(e["types"]) == set(TYPES)
                            and all(v == "ok" for v in e["types"].values())))


def cached(k: Optional[str] = None) -> Optional[Result]:
    """This build and CPU's stored result, or None (none stored, or an entry that does not check out)."""
    k = k or key()
    try:
        data = json.loads(cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("entries"), dict):
        return None
    e = data["entries"].get(k)
    if not _valid_entry(e) or (not e["ok"] and not any(_condemns(v) for v in e["types"].values())):
        return None  # a failure that says nothing about the build (an older version cached SIGKILL) is no verdict
    return Result(key=k, ok=e["ok"], types=dict(e["types"]), error=e.get("error"),
                  seconds=float(e.get("seconds", 0)) if isinstance(e.get("seconds"), (int, float)) else 0.0,
                  at=str(e.get("at", "")), gpu=e["gpu"] if isinstance(e.get("gpu"), str) else None)


def _condemns(outcome: object) -> bool:
    """Whether a type's recorded outcome says the build cannot run here: a fault signal, or bad logits."""
    return isinstance(outcome, str) and (outcome.startswith("bad logits") or
                                         outcome in {f"died of {name}" for name in FAULTS})


def _store(r: Result) -> None:
    """Best effort: a cache that cannot be written only means the test runs again next time."""
    from specquant_cli.fsutil import write_json_atomic

    try:
        path = cache_path()
    except OSError:
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entries = data["entries"] if data.get("schema") == SCHEMA and isinstance(data.get("entries"), dict) else {}
    except (OSError, ValueError, UnicodeDecodeError, AttributeError, TypeError):
        entries = {}
    entries = {k: v for k, v in entries.items() if _valid_entry(v)}
    entries[r.key] = {k: v for k, v in r.to_dict().items() if k not in ("key", "definitive")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"schema": SCHEMA, "entries": entries})
    except OSError:
        pass


# -- running it ----------------------------------------------------------------------------------------------
def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _death_line(t: str, sig: int) -> str:
    what = {"SIGILL": "an instruction this CPU cannot run", "SIGSEGV": "a memory fault",
            "SIGBUS": "a bus error", "SIGFPE": "an arithmetic fault"}.get(_signal_name(sig), "a fatal signal")
    return (f"this llama.cpp build cannot run on this CPU: it died of {_signal_name(sig)} ({what}) decoding a "
            f"{t.upper()} model in its self-test; {REBUILD_HINT}; then {RETEST} tests it again")


def _run_child(types: list[str], deadline: float) -> tuple[list[str], Optional[int], str, Optional[str]]:
    """One child over `types`. Returns the types it passed, its return code (negative: killed by that signal;
    None: out of time), the last line of its stderr and the GPUs it decoded on too (None: CPU only)."""
    try:
        work_dir = tempfile.TemporaryDirectory(prefix="specquant-selftest-")
    except OSError as e:
        return [], 1, f"cannot create a work folder ({e.strerror})", None
    try:
        with work_dir as work:
            cmd = [sys.executable, "-m", "specquant_cli.backend.selftest_child", work, *types]
            p = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                               env={**os.environ, CHILD_ENV: "1"}, timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return [ln.split()[1] for ln in out.splitlines() if ln.startswith("ok ")], None, "", _gpu_of(out)
    passed = [ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("ok ") and len(ln.split()) == 2]
    last = next((ln.strip() for ln in reversed(p.stderr.splitlines()) if ln.strip()), "")
    return passed, p.returncode, last, _gpu_of(p.stdout)


def _gpu_of(out: str) -> Optional[str]:
    return next((ln.split(None, 1)[1].strip() for ln in out.splitlines() if ln.startswith("gpu ") and ln[4:].strip()),
                None)


def run(types: tuple[str, ...] = TYPES, on_type: Optional[Callable[[str, str], None]] = None,
        store: bool = True) -> Result:
    """Run the self-test now (children; a type that kills its child is recorded and the rest go on in a new
    one). on_type(type, outcome) hears each result as it comes."""
    start, k = time.monotonic(), key()
    deadline = start + TIMEOUT_S
    results: dict[str, str] = {}
    condemned: Optional[str] = None  # the first result that says the build cannot run here
    could_not: Optional[str] = None  # the first that says only that the test could not run
    todo = list(types)
    gpu: Optional[str] = None
    while todo:
        passed, rc, last, gpu_seen = _run_child(todo, deadline)
        gpu = gpu or gpu_seen
        for t in passed:
            results[t] = "ok"
            on_type and on_type(t, "ok")
        todo = [t for t in todo if t not in passed]
        if not todo:
            break
        t, todo = todo[0], todo[1:]
        if rc is None:
            results[t] = f"no answer within {TIMEOUT_S:.0f} s"
            could_not = could_not or f"the llama.cpp self-test did not finish within {TIMEOUT_S:.0f} s (at " \
                                     f"{t.upper()}); {RETEST} tests again"
            todo = []
        elif rc < 0 and _signal_name(-rc) in FAULTS:
            results[t] = f"died of {_signal_name(-rc)}"
            condemned = condemned or _death_line(t, -rc)
        elif rc < 0:  # killed from outside, or an abort: nothing learned about this CPU
            results[t] = f"killed by {_signal_name(-rc)}"
            could_not = could_not or (f"the llama.cpp self-test could not run: its child died of "
                                      f"{_signal_name(-rc)} at {t.upper()} (killed from outside — out of memory, a "
                                      f"supervisor — or aborted); {RETEST} tests again")
            todo = []
        elif last.startswith("bad logits"):
            results[t] = last
            where = "GPU" if "on the GPU" in last else "CPU"
            condemned = condemned or (f"this llama.cpp build gives wrong results on this {where} ({t.upper()}: "
                                      f"{last}); {REBUILD_HINT}; then {RETEST} tests it again")
        else:
            results[t] = last or f"exit code {rc}"
            could_not = could_not or (f"the llama.cpp self-test could not run ({t.upper()}: "
                                      f"{last or f'exit code {rc}'}); {RETEST} tests again")
        on_type and on_type(t, results[t])
    # A fault anywhere condemns the build, whatever else could not run (a verdict the next command must hear).
    error, definitive = (condemned, True) if condemned else (could_not, could_not is None)
    r = Result(key=k, ok=error is None, types=results, error=error, definitive=definitive,
               seconds=round(time.monotonic() - start, 2), at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), gpu=gpu)
    if store and r.definitive:
        _store(r)
    return r


def ensure(status: Optional[Callable[[str], None]] = None) -> None:
    """Before the first model of a process: the cached result for this build and CPU, else the test now.
    Raises LlamaError (one line) when the build cannot run here."""
    global _verified
    if env(CHILD_ENV) == "1":
        return
    k = key()
    if _verified == k:
        return
    r = cached(k)
    if r is None:
        if status:
            status("checking this llama.cpp build on this CPU (once per build and CPU) …")
        r = run()
    if not r.ok and r.definitive:
        raise LlamaError(r.error or "the llama.cpp self-test failed")
    if not r.ok and status:  # the test itself could not run (no temp space, out of time): say so, go on
        status(f"warning: {r.error}; going on without it")
    _verified = k
