"""Servers side by side, each started fresh: `specquant bench load --servers parent,auto,llama:plain …`.

A server that answered one policy's prompts keeps them (its prompt cache, its slots' prefixes, its drafting
memory), so a policy measured after another on the same server finds its prompts half computed. Here every
contender gets a server of its own, started for it on a free loopback port (a `specquant serve` with an empty
`--cache-dir` of its own and `--policies` its one policy, or llama-server in one of its modes on the family's
parent file), warmed with one unrelated request, loaded with the same conversations, and stopped before the
next starts: no contender inherits another's cache, and no two run at once (on 2 cores either would distort
the other's figures).

Contenders are named `POLICY` (a specquant policy) or `llama:MODE` (llama-server: `plain`, `ngram-mod`: its
n-gram table shared by every slot, `ngram-simple` and `ngram-map-k`: its n-gram lookups over the request's own tokens,
`draft-q4`: the family's q4 file as its draft model, `draft-sibling`: the family's sibling model as its draft model).
A request's `prediction` (Predicted Outputs) goes to every server alike; llama-server ignores the field."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from specquant_cli.bench import fidelity
from specquant_cli.bench.stamp import markdown_lines
from specquant_cli.errors import InputError, SpecquantError
from specquant_cli.settings import child_env, settings_table

FIDELITY_COUNTS = ("judged", "not_judged", "identical", "near_tie", "unexplained")  # summed over a server's runs

# llama-server's modes, each at the settings its docs give (docs/speculative.md of the llama.cpp vendored in
# llama-cpp-python 0.3.36): the n-gram drafters as their sample commands run them.
LLAMA_MODES = {"plain": [],
               "ngram-mod": ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "24",
                             "--spec-ngram-mod-n-min", "48", "--spec-ngram-mod-n-max", "64"],
               "ngram-simple": ["--spec-type", "ngram-simple", "--spec-draft-n-max", "64"],
               "ngram-map-k": ["--spec-type", "ngram-map-k", "--spec-draft-n-max", "64"],
               "draft-q4": ["-md", "{q4}", "-td", "{threads}"],
               "draft-sibling": ["-md", "{sibling}", "-td", "{threads}"]}
START_TIMEOUT_S = 900.0  # a cold start loads every model of the family (and measures its costs when uncalibrated)
STOP_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 20  # a server that dies is named with the last lines it wrote


@dataclass(frozen=True)
class Contender:
    """One server to start: `name` as given (`auto`, `llama:ngram-mod`), `kind` specquant or llama-server."""

    name: str
    kind: str
    what: str  # the policy, or llama-server's mode
    settings: tuple = ()  # (setting key, value) pairs a specquant server starts with besides the setup's

    @property
    def is_llama(self) -> bool:
        return self.kind == "llama-server"


def contenders(text: str, check_policy: Callable[[str], str], llama_server: Optional[Path]) -> list[Contender]:
    """`--servers` (comma-separated) as contenders; a one-line error naming the first one that is no policy
    (`check_policy` raises InputError for it: a table policy, spec-<role>, a chain) nor `llama:MODE`, and for
    llama-server contenders without `llama_server`."""
    out = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            raise InputError(f"--servers {text!r}: an empty name")
        if name.startswith("llama:"):
            mode = name.removeprefix("llama:")
            if mode not in LLAMA_MODES:
                raise InputError(f"--servers: {name!r}: llama-server modes are {', '.join(LLAMA_MODES)}")
            if llama_server is None:
                raise InputError(f"--servers {name}: give llama-server's path with --llama-server")
            out.append(Contender(name, "llama-server", mode))
        else:
            try:
                check_policy(name)
            except InputError as e:
                raise InputError(f"--servers: {name!r} is no policy nor llama:MODE ({e})") from None
            out.append(Contender(name, "specquant", name))
    if len({c.name for c in out}) != len(out):
        raise InputError(f"--servers {text!r}: a server named twice")
    return out


@dataclass(frozen=True)
class Setup:
    """How every server is started: the family, slots, context per sequence, threads, and llama-server's path."""

    family: object  # family.manifest.Family
    parallel: int
    ctx: int
    threads: int
    llama_server: Optional[Path] = None
    max_tokens: int = 4096


@dataclass
class Server:
    """A started server: its process, base URL, the temp folder it owns and what it wrote (the last lines)."""

    proc: subprocess.Popen
    url: str
    folder: Path
    lines: list[str] = field(default_factory=list)

    def tail(self) -> str:
        return " | ".join(line.strip() for line in self.lines[-LOG_TAIL_LINES:] if line.strip())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(c: Contender, setup: Setup, folder: Path, port: int) -> list[str]:
    """The command line that starts `c`'s server."""
    fam = setup.family
    if c.is_llama:
        roles = {"{q4}": "q4", "{sibling}": "sibling"}
        extra = [str(fam.path(roles[a])) if a in roles else a.replace("{threads}", str(setup.threads))
                 for a in LLAMA_MODES[c.what]]
        return [str(setup.llama_server), "-m", str(fam.path(fam.parent_rendering)), "--host", "127.0.0.1",
                "--port", str(port), "-t", str(setup.threads), "-tb", str(setup.threads), "-np", str(setup.parallel),
                "-c", str(setup.ctx * setup.parallel), "--jinja", *extra]
    given = {"runtime.family": fam.root, "serving.port": port, "runtime.parallel": setup.parallel,
             "runtime.ctx": setup.ctx, "runtime.threads": setup.threads, "decoding.policy": c.what,
             "serving.policies": c.what, "serving.max_tokens": setup.max_tokens, "serving.cache_dir": folder / "cache",
             **dict(c.settings)}
    table = settings_table()
    flags = [a for k, v in given.items() for a in (table[k].flag, str(v))]
    return [sys.executable, "-m", "specquant_cli", "serve", *flags]


def start(c: Contender, setup: Setup, say: Callable[[str], None]) -> Server:
    """`c`'s server, listening and answering /health; a one-line error (with its last lines) when it exits or
    does not come up within START_TIMEOUT_S."""
    folder = Path(tempfile.mkdtemp(prefix="specquant-sides-"))
    port = free_port()
    cmd = command(c, setup, folder, port)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, errors="replace", start_new_session=True, env=child_env())
    except OSError as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise InputError(f"{c.name}: cannot start {cmd[0]} ({e.strerror or e})") from None
    server = Server(proc, f"http://127.0.0.1:{port}", folder)
    threading.Thread(target=_collect, args=(proc, server.lines), daemon=True).start()
    say(f"{c.name}: starting ({'llama-server ' + c.what if c.is_llama else 'specquant serve --policy ' + c.what})")
    try:
        _wait_ready(c, server)
    except BaseException:
        stop(server)
        raise
    return server


def _collect(proc: subprocess.Popen, lines: list[str]) -> None:
    for line in proc.stderr:
        lines.append(line)
        del lines[:-200]


def _wait_ready(c: Contender, server: Server) -> None:
    end = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < end:
        if server.proc.poll() is not None:
            raise SpecquantError(f"{c.name}: the server exited with {server.proc.returncode} before answering "
                                 f"({server.tail() or 'nothing written'})")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SpecquantError(f"{c.name}: the server did not answer /health within {START_TIMEOUT_S:.0f} s")


def stop(server: Server) -> None:
    """SIGTERM the server's process group, wait for it (SIGKILL after STOP_TIMEOUT_S), remove its folder."""
    proc = server.proc
    try:
        if proc.poll() is None:
            _signal(proc, signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait(STOP_TIMEOUT_S)
    finally:
        shutil.rmtree(server.folder, ignore_errors=True)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    import os

    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def warm(url: str, model: str) -> None:
    """One short unrelated request, so that a server's first-request costs are not the scenario's."""
    import json

    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


@dataclass
class Run:
    """One contender's run: which of the repeats (from 1), its results and summary, and its answers' verdicts."""

    contender: Contender
    repeat: int
    results: list
    summary: dict
    fidelity: Optional[dict] = None

    @property
    def label(self) -> str:
        return self.contender.name + (f" #{self.repeat}" if self.repeat > 1 else "")


def run(contenders: Sequence[Contender], setup: Setup, repeat: int,
        load: Callable[[Contender, str, str], tuple[list, dict]], say: Callable[[str], None]) -> list[Run]:
    """Every contender started fresh, loaded by `load(contender, url, label)` -> (results, summary) and stopped,
    `repeat` times in turn (A B A B …): one server at a time, and the VM's drift falls on each alike."""
    runs = []
    for k in range(1, repeat + 1):
        for c in contenders:
            label = c.name + (f" #{k}" if repeat > 1 else "")
            server = start(c, setup, say)
            try:
                results, summary = load(c, server.url, label + " ")
            finally:
                stop(server)
            runs.append(Run(c, k, results, summary))
    return runs


def _median(xs: list) -> Optional[float]:
    import statistics

    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def report(runs: Sequence[Run], contenders: Sequence[Contender], setup: Setup, config: dict, stamp: dict,
           cal=None) -> dict:
    """The side by side as JSON: every run (summary, verdicts, requests) and, per contender, the medians over its
    runs and its ratio to the first contender's; with `cal` (the parent's calibration on this machine) and requests
    sent one at a time, each contender's share of the verify limit (`verify_limit_share`)."""
    one_at_a_time = config.get("concurrency") == 1 and not config.get("rate")
    rows = []
    first = None
    for c in contenders:
        mine = [r for r in runs if r.contender is c]
        tps = _median([r.summary["output_tokens_per_s"] for r in mine])
        first = tps if first is None else first
        fid = [r.fidelity for r in mine if r.fidelity]
        rows.append({"server": c.name, "kind": c.kind, "command": command_line(c, setup), "runs": len(mine),
                     "output_tokens_per_s": tps, "vs_first": round(tps / first, 3) if tps and first else None,
                     "wall_s": _median([r.summary["wall_s"] for r in mine]),
                     "ttft_p50_s": _median([r.summary["ttft_s"]["p50"] for r in mine]),
                     "itl_p50_s": _median([r.summary["itl_s"]["p50"] for r in mine]),
                     "fidelity": _summed(fid),
                     "prediction": _prediction(mine),
                     "cached_share": _cached_share(mine),
                     "verify_limit_share": limit_share(mine, cal) if one_at_a_time else None,
                     "plans": _plans(mine)})
    return {"command": stamp["command"], "stamp": stamp, "family": str(setup.family.root),
            "parent": setup.family.parent_rendering,
            "parallel": setup.parallel, "ctx": setup.ctx, "threads": setup.threads, "config": config,
            "servers": rows,
            "runs": [{"server": r.contender.name, "repeat": r.repeat, "summary": r.summary, "fidelity": r.fidelity,
                      "requests": [x.to_dict() for x in r.results]} for r in runs]}


def limit_share(runs: Sequence[Run], cal) -> Optional[float]:
    """A contender's share of the verify limit (bench.limit) over its runs of requests sent one at a time: each
    request at the limit takes its own time to the first token, then the parent's calls of a drafter always right for
    its output tokens after its prompt tokens; the share is that time over the requests' own, summed. None without a
    calibration, or when a request failed or its server did not say its prompt tokens."""
    from specquant_cli.bench import limit

    if cal is None:
        return None
    at_limit = taken = 0.0
    for r in runs:
        for x in r.results:
            if not x.ok or x.ttft_s is None or not x.e2e_s or x.prompt_tokens is None:
                return None
            at_limit += x.ttft_s + limit.decode_s(cal, x.prompt_tokens, x.output_tokens)
            taken += x.e2e_s
    return round(at_limit / taken, 3) if taken else None


def _cached_share(runs: Sequence[Run]) -> Optional[float]:
    """The share of the prompt tokens a server took from its cache, over its runs (None: it said nothing of them)."""
    cached = [r.summary.get("cached_tokens") for r in runs]
    prompt = [r.summary.get("prompt_tokens") for r in runs]
    if any(c is None for c in cached) or not all(prompt):
        return None
    return round(sum(cached) / sum(prompt), 4)


def per_turn(rep: dict) -> list[str]:
    """A replay's turns side by side: each server's seconds end to end and output tokens per second per turn (its
    first run), the answer's tokens, and the prompt tokens it took from its cache."""
    first = {}
    for r in rep["runs"]:
        first.setdefault(r["server"], r["requests"])
    names = list(first)
    lines = ["", "Per turn (first run of each; s end to end, out tok/s, cached prompt tokens):", "",
             "| turn | tokens | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    n = max(len(reqs) for reqs in first.values())
    for k in range(n):
        cells, tokens = [], None
        for name in names:
            reqs = [x for x in first[name] if x["turn"] == k]
            x = reqs[0] if reqs else None
            if x is None or not x["ok"]:
                cells.append("failed" if x else "–")
                continue
            tokens = tokens or x["output_tokens"]
            tps = x["output_tokens"] / x["e2e_s"] if x["e2e_s"] else None
            cached = "" if x.get("cached_tokens") is None else f", {x['cached_tokens']} cached"
            cells.append(f"{_num(x['e2e_s'])} s, {_num(tps)}{cached}")
        lines.append(f"| {k + 1} | {tokens if tokens is not None else '–'} | " + " | ".join(cells) + " |")
    return lines


def _prediction(runs: Sequence[Run]) -> Optional[dict]:
    """The prediction tokens a server said it kept and did not keep, over its runs (None: no prediction sent, or it
    said nothing of them: llama-server)."""
    acc = [r.summary.get("prediction_accepted") for r in runs]
    rej = [r.summary.get("prediction_rejected") for r in runs]
    if all(a is None for a in acc):
        return None
    return {"accepted": sum(a or 0 for a in acc), "rejected": sum(x or 0 for x in rej)}


def _plans(runs: Sequence[Run]) -> dict[str, int]:
    """How often each plan ran (what a specquant server said of its answers)."""
    from collections import Counter

    return dict(Counter(x.plan for r in runs for x in r.results if x.plan).most_common())


def command_line(c: Contender, setup: Setup) -> str:
    """The command that starts `c`'s server, as a reader would type it (a placeholder folder and port)."""
    import shlex

    cmd = command(c, setup, Path("DIR"), 0)
    if not c.is_llama:
        cmd = ["specquant", *cmd[3:]]
    return " ".join(shlex.quote(a) for a in cmd)


def markdown(rep: dict) -> str:
    """The side by side as a table: each server's median throughput (and its ratio to the first row's), wall
    time, latencies, the plans it ran and its answers' verdicts; then every run."""
    c, rows = rep["config"], rep["servers"]
    runs = max(r["runs"] for r in rows)
    lines = [f"# Servers side by side: {c['scenario']}, {c['conversations']} conversations × {c['turns']} turns, "
             f"--parallel {rep['parallel']}", "", f"- command: `{rep['command']}`", *markdown_lines(rep.get("stamp")),
             f"- family {rep['family']}, parent {rep['parent']}, {rep['threads']} threads, {c['max_tokens']} max "
             f"tokens, greedy, {c['concurrency'] or 'no cap on those'} in flight; each server started fresh, one at "
             "a time" + (f", {runs} times in turn (medians)" if runs > 1 else ""), "",
             f"| server | out tok/s | × {rows[0]['server']} | wall s | TTFT p50 ms | ITL p50 ms | "
             f"{fidelity.header(any((r['fidelity'] or {}).get('exact') for r in rows))} |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        fid = fidelity.cell(row["fidelity"])
        ratio = f"{row['vs_first']:.2f}x" if row["vs_first"] else "–"
        lines.append(f"| {row['server']} | {_num(row['output_tokens_per_s'])} | {ratio} | {_num(row['wall_s'])} | "
                     f"{_ms(row['ttft_p50_s'])} | {_ms(row['itl_p50_s'])} | {fid} |")
    if rep.get("fidelity_error"):
        lines += ["", f"Fidelity: not judged ({rep['fidelity_error']})."]
    planned = [row for row in rows if row["plans"]]
    if planned:  # what a specquant server said of its answers (llama-server says nothing)
        lines += ["", "Plans each server ran (answers):"]
        lines += [f"- {row['server']}: " + "; ".join(f"{p} ({n})" for p, n in row["plans"].items()) for row in planned]
    said = [row for row in rows if row.get("prediction")]
    if said:
        lines += ["", "Prediction tokens kept / not kept, as each server's usage says: " + "; ".join(
            f"{row['server']} {row['prediction']['accepted']} / {row['prediction']['rejected']}" for row in said)
            + (" (llama-server says nothing of them)" if any(row["kind"] == "llama-server" for row in rows) else "")
            + "."]
    bounded = [row for row in rows if row.get("verify_limit_share") is not None]
    if bounded:
        lines += ["", "Share of the verify limit (each request's own time to the first token, then its answer at the "
                      "parent's calls of a drafter always right, priced by this machine's calibration at their depth): "
                  + "; ".join(f"{row['server']} {row['verify_limit_share']:.2f}" for row in bounded) + "."]
    cached = [row for row in rows if row.get("cached_share") is not None]
    if cached:
        lines += ["", "Prompt tokens taken from the server's cache: " + "; ".join(
            f"{row['server']} {row['cached_share']:.0%}" for row in cached) + "."]
    unjudged = {row["server"]: row["fidelity"]["not_judged"] for row in rows
                if row["fidelity"] and row["fidelity"].get("not_judged")}
    if unjudged:
        lines += ["", "Not judged (the request's tool_choice forces a tool call, a grammar the server holds the "
                      "answer to): " + "; ".join(f"{k} {n}" for k, n in unjudged.items()) + "."]
    if c["scenario"] == "replay":
        lines += per_turn(rep)
    if runs > 1:
        lines += ["", "| run | server | output tok/s | wall s |", "|---|---|---|---|"]
        for k, r in enumerate(rep["runs"], 1):
            lines.append(f"| {k} | {r['server']} | {_num(r['summary']['output_tokens_per_s'])} | "
                         f"{_num(r['summary']['wall_s'])} |")
    return "\n".join(lines) + "\n"


def _num(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.3f}" if x < 100 else f"{x:.1f}"


def _ms(x: Optional[float]) -> str:
    return "–" if x is None else f"{1000 * x:.0f}"


def _summed(fid: list[dict]) -> Optional[dict]:
    """A server's verdict counts summed over its runs (None: none judged), exact where they were judged in the
    deterministic mode (bench.fidelity.shown)."""
    if not fid:
        return None
    return {**{k: sum(f.get(k, 0) for f in fid) for k in FIDELITY_COUNTS},
            **({"exact": True} if any(f.get("exact") for f in fid) else {})}
