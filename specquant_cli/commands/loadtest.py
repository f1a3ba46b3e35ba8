from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from specquant_cli.bench.load import (
    DEFAULT_ITL_TARGET_S,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_SYSTEM_TOKENS,
    DEFAULT_TTFT_TARGET_S,
    PROBE_TIMEOUT_S,
    SCENARIOS,
)
from specquant_cli.commands.options import finite, with_settings
from specquant_cli.console import err, out_json
from specquant_cli.errors import InputError
from specquant_cli.settings import Settings


def _positive(value: Optional[float]) -> Optional[float]:
    """Option callback: a finite number above 0."""
    if value is not None and (finite(value) is not None) and value <= 0:
        raise typer.BadParameter(f"{value:g}: expected a number above 0")
    return value


def register(app: typer.Typer) -> None:
    app.command("loadtest", help="Load an OpenAI-compatible server (specquant serve, llama-server, …) with streamed "
                                 "conversations: TTFT, inter-token latency, throughput, goodput. JSON on stdout, every "
                                 "answer in it; with --family (or SPECQUANT_FAMILY) each answer is judged against "
                                 "the parent alone here, after the run.")(loadtest)


@with_settings("runtime.family", "runtime.parent", "runtime.ctx", "runtime.threads", "runtime.mmap")
def loadtest(
    url: str = typer.Option(..., "--url", help="The server's base URL, e.g. http://127.0.0.1:8080"),
    model: Optional[str] = typer.Option(None, "--model", help="Model id to ask for (default: the first of GET "
                                                              "/v1/models)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Sent as Authorization: Bearer KEY",
                                          show_default=False),
    scenario: str = typer.Option("single", "--scenario", help=f"{' | '.join(SCENARIOS)}: independent one-turn "
                                 "questions; conversations whose turn k carries every earlier turn and the server's "
                                 "answers; the same, all beginning with one shared long system prompt"),
    conversations: int = typer.Option(8, "--conversations", min=1, help="Conversations to run"),
    turns: Optional[int] = typer.Option(None, "--turns", min=1, help="User turns per conversation (default: 1 for "
                                        "single, 3 otherwise)", show_default=False),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", min=1, help="Conversations in flight at once "
                                              "(default 1 without --rate; with --rate: a cap, none by default)",
                                              show_default=False),
    rate: Optional[float] = typer.Option(None, "--rate", callback=_positive,
                                         help="Poisson arrivals: conversations started per second (a single "
                                              "scenario's requests per second)", show_default=False),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the Poisson arrivals"),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, help="max_tokens of every request"),
    system_tokens: Optional[int] = typer.Option(None, "--system-tokens", min=1, help="Approximate length of the "
                                                f"shared system prompt (shared-system; default "
                                                f"{DEFAULT_SYSTEM_TOKENS})", show_default=False),
    dataset: list[Path] = typer.Option([], "--dataset", help="Spec-Bench-format JSONL of questions (repeatable); "
                                                             "default: the built-in prompt set"),
    ttft_target: float = typer.Option(DEFAULT_TTFT_TARGET_S, "--ttft-target", min=0.0, callback=finite,
                                      help="Goodput: seconds to the first token a request may take"),
    itl_target: float = typer.Option(DEFAULT_ITL_TARGET_S, "--itl-target", min=0.0, callback=finite,
                                     help="Goodput: mean seconds between streamed pieces a request may take"),
    extra_body: Optional[str] = typer.Option(None, "--extra-body", help="A JSON object merged into every "
                                             "request body, e.g. '{\"cache_prompt\": false}' for llama-server or "
                                             "'{\"specquant_policy\": \"parent\"}'", show_default=False),
    timeout: float = typer.Option(DEFAULT_READ_TIMEOUT_S, "--timeout", callback=_positive,
                                  help="Seconds a request may take between reads"),
    request_timeout: float = typer.Option(DEFAULT_REQUEST_TIMEOUT_S, "--request-timeout", callback=_positive,
                                          help="Seconds a whole request may take, from sending it to the end of "
                                               "its answer (a server that trickles bytes fails here)"),
    deadline: Optional[float] = typer.Option(None, "--deadline", callback=_positive,
                                             help="Seconds the whole run may take: no request starts after it, "
                                                  "those in flight are cancelled and fail (default: none)",
                                             show_default=False),
    out_file: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON report to FILE"),
    md_out: Optional[Path] = typer.Option(None, "--markdown", help="Write a markdown summary to FILE"),
    *, cfg: Settings,
) -> None:
    """The JSON report (stdout) has the run's figures, every request's timings, messages and answer text (two
    runs can be compared answer by answer) and, with --family, each answer's verdict against the parent alone,
    computed here after the load (never during it). Progress goes to stderr, one line per request."""
    from specquant_cli.bench import datasets, load, report

    base = load.normal_url(url)
    turns = turns if turns is not None else (1 if scenario == "single" else 3)
    if system_tokens is not None and scenario != "shared-system":
        raise InputError("--system-tokens applies to --scenario shared-system")
    system = load.system_prompt(system_tokens or DEFAULT_SYSTEM_TOKENS) if scenario == "shared-system" else None
    extra = _extra_body(extra_body)
    report.check_outputs({"--out": out_file, "--markdown": md_out},
                         inputs=[*dataset, *([cfg.config] if cfg.config else [])])
    questions = [it.prompt for it in datasets.load(dataset)]
    convs = load.conversations(scenario, questions, conversations, turns, system)
    if concurrency is None and rate is None:
        concurrency = 1
    starts = load.arrival_times(len(convs), rate, seed)
    family = cfg.runtime.family
    if family is not None:  # before the load: a family that cannot be read must not fail the run at its end
        from specquant_cli.commands.options import load_family

        family = load_family(family)
    name = load.find_model(base, api_key, model, min(timeout, request_timeout, PROBE_TIMEOUT_S))
    target = load.Target(base, name, max_tokens, api_key, extra, timeout, request_timeout)
    planned = len(convs) * turns
    err.print(f"loadtest: {base}, model {name}, {scenario}: {len(convs)} conversations × {turns} turns, "
              + (f"Poisson {rate}/s (seed {seed})" if rate else f"{concurrency} in flight"), markup=False)
    done = [0]

    def line(r: load.RequestResult) -> None:
        done[0] += 1
        what = (f"ttft {r.ttft_s:.2f} s, {r.output_tokens} tokens in {r.e2e_s:.2f} s" if r.ok and r.ttft_s is not None
                else "no content" if r.ok else f"failed: {r.error}")
        err.print(f"[{done[0]}/{planned} {r.start_s + (r.e2e_s or 0):.1f}s] conversation {r.conversation} turn "
                  f"{r.turn}: {what}", markup=False)

    results, wall = load.run(target, convs, starts, concurrency, line, deadline)
    late = _not_sent_at_deadline(results, turns, planned) if deadline is not None else 0
    if late:
        err.print(f"loadtest: the run's deadline of {deadline:g} s passed; {late} of {planned} requests not sent",
                  markup=False)
    summary = load.summarize(results, wall, ttft_target, itl_target, planned)
    judged = None
    if family is not None and any(r.ok for r in results):
        judged = _judge(family, cfg, results, max_tokens)
    rep = {
        "command": " ".join(["specquant"] + [shlex.quote(a) for a in sys.argv[1:]]),
        "server": {"url": base, "model": name},
        "config": {"scenario": scenario, "conversations": len(convs), "turns": turns, "concurrency": concurrency,
                   "rate": rate, "seed": seed, "max_tokens": max_tokens, "temperature": 0,
                   "system_tokens": (system_tokens or DEFAULT_SYSTEM_TOKENS) if system else None,
                   "system_chars": len(system) if system else None, "extra_body": extra,
                   "datasets": [str(d) for d in dataset] or ["builtin"], "timeout_s": timeout,
                   "request_timeout_s": request_timeout, "deadline_s": deadline},
        "summary": summary,
        "fidelity_family": str(family.root) if judged is not None else None,
        "fidelity": judged,
        "requests": [r.to_dict() for r in results],
    }
    err.print(_summary_line(summary, judged), markup=False)
    failure = _write(rep, out_file, md_out)
    out_json(rep)
    if failure:
        raise failure
    if not summary["requests"]["succeeded"]:
        first = next((r.error for r in results if r.error), "no request was sent")
        raise InputError(f"no request succeeded (first error: {first})")


def _not_sent_at_deadline(results, turns: int, planned: int) -> int:
    """The requests never sent because the run's deadline passed: those planned, less those sent, less the turns
    that a failed request (one the deadline did not cancel) ended its conversation before."""
    from specquant_cli.bench.load import DEADLINE_ERROR

    after_failures = sum(turns - r.turn - 1 for r in results if not r.ok and r.error != DEADLINE_ERROR)
    return planned - len(results) - after_failures


def _extra_body(text: Optional[str]) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InputError(f"--extra-body {text[:40]!r}: not JSON ({e.args[0].split(':')[0]})") from None
    except RecursionError:
        raise InputError(f"--extra-body {text[:40]!r}: nested too deeply") from None
    if not isinstance(value, dict):
        raise InputError(f"--extra-body {text!r}: expected a JSON object")
    fixed = sorted({"model", "messages", "stream"} & set(value))
    if fixed:
        raise InputError(f"--extra-body may not set {', '.join(fixed)} (the load test sets them)")
    return value


def _judge(family, cfg: Settings, results, max_tokens: int) -> dict:
    from specquant_cli.bench import load
    from specquant_cli.console import stderr_reporter
    from specquant_cli.runtime import Runtime
    from specquant_cli.session import bind_parent
    from specquant_cli.settings import SessionSettings

    family = bind_parent(family, SessionSettings.of(cfg))  # judged against the parent as a server here serves it
    runtime = Runtime.open(family, n_ctx=cfg.runtime.ctx, threads=cfg.runtime.threads, mmap=cfg.runtime.mmap,
                           report=stderr_reporter())
    try:
        with err.status("fidelity: the parent alone answers every request's messages") as status:
            return load.judge(results, runtime, max_tokens,
                              lambda i, n: status.update(f"fidelity: the parent alone, {i}/{n}"))
    finally:
        runtime.close()


def _summary_line(s: dict, judged: Optional[dict]) -> str:
    n, g, t = s["requests"], s["goodput"], s["ttft_s"]
    p50 = "–" if t["p50"] is None else f"{t['p50']:.2f} s"
    line = (f"{n['succeeded']}/{n['planned']} requests in {s['wall_s']:.1f} s: {s['request_throughput']} req/s, "
            f"{s['output_tokens_per_s']} tok/s, TTFT p50 {p50}, goodput {g['requests']} ({g['share']:.0%})"
            if g["share"] is not None else f"{n['succeeded']}/{n['planned']} requests")
    if judged is not None:
        line += (f"; fidelity {judged['identical']} identical / {judged['near_tie']} near-tie / "
                 f"{judged['unexplained']} unexplained")
    return line


def _write(rep: dict, out_file: Optional[Path], md_out: Optional[Path]):
    from specquant_cli.bench.load import markdown
    from specquant_cli.errors import SpecquantError
    from specquant_cli.fsutil import write_json_atomic, write_text_atomic

    failed = []
    for opt, path, write in (("--out", out_file, lambda p: write_json_atomic(p, rep)),
                             ("--markdown", md_out, lambda p: write_text_atomic(p, markdown(rep)))):
        if path is None:
            continue
        try:
            write(Path(path))
        except (OSError, SpecquantError) as e:
            failed.append(f"{opt} {path} ({getattr(e, 'strerror', None) or e})")
    return SpecquantError(f"could not write {'; '.join(failed)}") if failed else None
