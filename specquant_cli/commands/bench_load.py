"""`specquant bench load`: a load of streamed conversations against one running server (bench.load), or against
servers started fresh here one at a time (bench.sides); each answer judged against the parent alone afterwards."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
from specquant_cli.commands.options import (
    BENCH_MAX_TOKENS,
    CategoriesOpt,
    DatasetOpt,
    JsonFileOpt,
    JsonOpt,
    MarkdownOpt,
    command_line,
    finite,
    int_list,
    split_list,
    with_settings,
)
from specquant_cli.console import err, out_json
from specquant_cli.errors import InputError, SpecquantError
from specquant_cli.settings import Settings


def _positive(value: Optional[float]) -> Optional[float]:
    """Option callback: a finite number above 0."""
    if value is not None and (finite(value) is not None) and value <= 0:
        raise typer.BadParameter(f"{value:g}: expected a number above 0")
    return value


def register(app: typer.Typer) -> None:
    app.command("load", short_help="Load a server with streamed conversations",
                help="Load an OpenAI-compatible server (specquant serve, llama-server, …) with streamed "
                     "conversations: TTFT, inter-token latency, throughput, goodput. With --servers, servers started "
                     "here side by side under the same load; with --family, answers judged against the parent "
                     "after the run. docs/benchmarking.md")(load_cmd)


@with_settings("runtime.family", "runtime.parent", "runtime.ctx", "runtime.threads", "runtime.mmap",
               "runtime.parallel", "runtime.deterministic")
def load_cmd(
    url: Optional[str] = typer.Option(None, "--url", help="A running server's base URL",
                                      show_default=False),
    servers: Optional[str] = typer.Option(None, "--servers", help="Or servers started here: auto,llama:ngram-mod,…",
                                          metavar="NAMES",
                                          show_default=False),
    llama_server: Optional[Path] = typer.Option(None, "--llama-server",
                                                help="The llama-server for --servers llama:MODE",
                                                show_default=False),
    repeat: int = typer.Option(1, "--repeats", "--repeat", min=1, max=20,
                               help="Run --servers N times in turn (medians)"),
    model: Optional[str] = typer.Option(None, "--model", help="Model id to ask for",
                                        show_default="the first of /v1/models"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Sent as Authorization: Bearer KEY",
                                          show_default=False),
    scenario: str = typer.Option("single", "--scenario", help=" | ".join(SCENARIOS), metavar="NAME"),
    conversations: int = typer.Option(8, "--conversations", min=1, help="Conversations to run"),
    turns: Optional[int] = typer.Option(None, "--turns", min=1, help="User turns per conversation",
                                        show_default="1 single, else 3"),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", min=1, help="Conversations at once",
                                              show_default="1, or no cap with --rate"),
    rate: Optional[float] = typer.Option(None, "--rate", callback=_positive,
                                         help="Poisson arrivals: conversations per second",
                                         show_default=False, metavar="PER_S"),
    seed: int = typer.Option(0, "--arrival-seed", "--seed", min=0, help="Seed of the Poisson arrivals"),
    max_tokens: int = typer.Option(BENCH_MAX_TOKENS, "--max-tokens", min=1, help="max_tokens of every request"),
    system_tokens: Optional[int] = typer.Option(None, "--system-tokens", min=1,
                                                help="Tokens of the shared system prompt",
                                                show_default=str(DEFAULT_SYSTEM_TOKENS)),
    dataset: list[Path] = DatasetOpt,
    edits: bool = typer.Option(False, "--edits", help="Add the built-in code-edit set (each with a prediction)"),
    replay: Optional[Path] = typer.Option(None, "--replay", help="Replay a recorded trace (bench record) in order",
                                          metavar="TRACE", show_default=False),
    only: Optional[str] = typer.Option(None, "--requests", help="Replay only these (1: its first request)",
                                       metavar="N,…", show_default="all"),
    prediction: str = typer.Option("on", "--prediction", metavar="MODE",
                                   help="Predictions: on, off, wrong (another one's)"),
    categories: Optional[str] = CategoriesOpt,
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="At most N questions per category",
                                        show_default=False),
    ttft_target: float = typer.Option(DEFAULT_TTFT_TARGET_S, "--ttft-target", min=0.0, callback=finite,
                                      help="Goodput: seconds to the first token", metavar="S"),
    itl_target: float = typer.Option(DEFAULT_ITL_TARGET_S, "--itl-target", min=0.0, callback=finite,
                                     help="Goodput: mean seconds between pieces", metavar="S"),
    extra_body: Optional[str] = typer.Option(None, "--extra-body", help="JSON merged into every request body",
                                             show_default=False, metavar="JSON"),
    timeout: float = typer.Option(DEFAULT_READ_TIMEOUT_S, "--timeout", callback=_positive,
                                  help="Seconds a request may wait between reads", metavar="S"),
    request_timeout: float = typer.Option(DEFAULT_REQUEST_TIMEOUT_S, "--request-timeout", callback=_positive,
                                          help="Seconds a whole request may take", metavar="S"),
    deadline: Optional[float] = typer.Option(None, "--deadline", callback=_positive,
                                             help="Seconds the whole run may take", metavar="S",
                                             show_default=False),
    json_out: bool = JsonOpt,
    json_file: Optional[Path] = JsonFileOpt,
    md_out: Optional[Path] = MarkdownOpt,
    *, cfg: Settings,
) -> None:
    """The JSON report (--json on stdout, --json-file) has the run's figures, every request's timings, messages and
    answer text (two runs can be compared answer by answer) and, with --family, each answer's verdict against the
    parent alone, computed here after the load (never during it). Progress goes to stderr, one line per request,
    then the summary (a table of the servers side by side)."""
    from specquant_cli.bench import datasets, load, report, stamp

    if replay is not None and (dataset or edits or categories or limit or turns is not None or scenario != "single"
                               or conversations != 8 or rate is not None or system_tokens is not None
                               or prediction == "wrong"):
        raise InputError("--replay sends the trace's requests as recorded: it takes no --dataset, --edits, "
                         "--categories, --limit, --scenario, --turns, --conversations, --rate, --system-tokens or "
                         "--prediction wrong")
    if only is not None and replay is None:
        raise InputError("--requests applies to --replay")
    turns = turns if turns is not None else (1 if scenario == "single" else 3)
    if (url is None) == (servers is None):
        raise InputError("give --url (a running server) or --servers (servers started fresh here), one of them")
    if llama_server is not None and servers is None:
        raise InputError("--llama-server applies to --servers")
    if repeat > 1 and servers is None:
        raise InputError("--repeat applies to --servers")
    if system_tokens is not None and scenario != "shared-system":
        raise InputError("--system-tokens applies to --scenario shared-system")
    system = load.system_prompt(system_tokens or DEFAULT_SYSTEM_TOKENS) if scenario == "shared-system" else None
    extra = _extra_body(extra_body)
    report.check_outputs({"--json-file": json_file, "--markdown": md_out},
                         inputs=[*dataset, *([replay] if replay else []), *([cfg.config] if cfg.config else [])])
    cats = split_list(categories, "--categories", "category")
    if replay is not None:
        from specquant_cli.bench import replay as traces

        reqs = traces.read(replay)
        if only is not None:
            reqs = [reqs[n - 1] for n in sorted(set(int_list(only, "--requests", 1, len(reqs))))]
        sent, predicted, fields = traces.turns(reqs)
        convs = load.replayed(sent, predicted if prediction == "on" else (), fields)
        scenario, turns = "replay", len(reqs)
    else:
        items = datasets.with_predictions(datasets.load(dataset, cats, limit, edits=edits), prediction)
        convs = load.conversations(scenario, [it.prompt for it in items], conversations, turns, system,
                                   [it.prediction for it in items])
    if concurrency is None and rate is None:
        concurrency = 1
    starts = load.arrival_times(len(convs), rate, seed)
    family = cfg.runtime.family
    if family is None and servers is not None:
        raise InputError("--servers needs --family (the family every server serves)")
    if family is not None:  # before the load: a family that cannot be read must not fail the run at its end
        from specquant_cli.commands.options import load_family

        family = load_family(family)
    run = _Run(convs, starts, concurrency, deadline, turns, ttft_target, itl_target)
    config = {"scenario": scenario, "conversations": len(convs), "turns": turns, "concurrency": concurrency,
              "rate": rate, "seed": seed, "max_tokens": max_tokens, "temperature": 0,
              "system_tokens": (system_tokens or DEFAULT_SYSTEM_TOKENS) if system else None,
              "system_chars": len(system) if system else None, "extra_body": extra,
              "datasets": ([] if replay is None else [f"replay:{replay}" + (f" requests {only}" if only else "")])
              or [*(["edits"] if edits else []), *(str(d) for d in dataset)] or ["builtin"],
              "categories": cats, "limit": limit, "prediction": prediction,
              "timeout_s": timeout,
              "request_timeout_s": request_timeout, "deadline_s": deadline}
    how = (f"{scenario}: {len(convs)} conversations × {turns} turns, "
           + (f"Poisson {rate}/s (seed {seed})" if rate else f"{concurrency} in flight"))
    if servers is not None:
        _side_by_side(servers, llama_server, family, cfg, run, config, how, max_tokens, extra, timeout,
                      request_timeout, repeat, json_out, json_file, md_out)
        return
    base = load.normal_url(url)
    name = load.find_model(base, api_key, model, min(timeout, request_timeout, PROBE_TIMEOUT_S))
    target = load.Target(base, name, max_tokens, api_key, extra, timeout, request_timeout)
    err.print(f"bench load: {base}, model {name}, {how}", markup=False)
    run_stamp = stamp.take(command_line(), None, models_here=False)  # the server's threads are its own
    results, summary = run.go(target)

    def made(judged: Optional[dict]) -> dict:
        return {"command": run_stamp["command"], "stamp": run_stamp, "server": {"url": base, "model": name},
                "config": config, "summary": summary,
                "fidelity_family": str(family.root) if judged is not None else None, "fidelity": judged,
                "requests": [r.to_dict() for r in results]}

    judged = None
    if family is not None and any(r.ok for r in results) and not _sampled(extra):
        with _kept(lambda: made(None), json_file, md_out, load.markdown):
            judged = _judge(family, cfg, [results], max_tokens)[0]
    rep = made(judged)
    err.print(_summary_line(summary, judged), markup=False)
    failure = report.write_outputs(rep, json_file, md_out, render=load.markdown)
    if json_out:
        out_json(rep)
    if failure:
        raise failure
    if not summary["requests"]["succeeded"]:
        first = next((r.error for r in results if r.error), "no request was sent")
        raise InputError(f"no request succeeded (first error: {first})")


class _Run:
    """The same load for every server: the conversations, their start times, the cap in flight, the run's
    deadline and the goodput targets."""

    def __init__(self, convs, starts, concurrency, deadline, turns: int, ttft_target: float, itl_target: float):
        self.convs, self.starts, self.concurrency, self.deadline = convs, starts, concurrency, deadline
        self.turns, self.ttft_target, self.itl_target = turns, ttft_target, itl_target
        self.planned = len(convs) * turns

    def go(self, target, label: str = ""):
        """(results, summary) of one run against `target`, a progress line per request on stderr."""
        from specquant_cli.bench import load

        done = [0]

        def line(r: load.RequestResult) -> None:
            done[0] += 1
            what = (f"ttft {r.ttft_s:.2f} s, {r.output_tokens} tokens in {r.e2e_s:.2f} s"
                    if r.ok and r.ttft_s is not None else "no content" if r.ok else f"failed: {r.error}")
            err.print(f"{label}[{done[0]}/{self.planned} {r.start_s + (r.e2e_s or 0):.1f}s] conversation "
                      f"{r.conversation} turn {r.turn}: {what}", markup=False)

        results, wall = load.run(target, self.convs, self.starts, self.concurrency, line, self.deadline)
        late = _not_sent_at_deadline(results, self.turns, self.planned) if self.deadline is not None else 0
        if late:
            err.print(f"bench load: the run's deadline of {self.deadline:g} s passed; {late} of {self.planned} "
                      "requests not sent", markup=False)
        return results, load.summarize(results, wall, self.ttft_target, self.itl_target, self.planned)


def _side_by_side(servers: str, llama_server: Optional[Path], family, cfg: Settings, run: _Run, config: dict,
                  how: str, max_tokens: int, extra: dict, timeout: float, request_timeout: float, repeat: int,
                  json_out: bool, json_file: Optional[Path], md_out: Optional[Path]) -> None:
    """Each of `servers` started fresh (bench.sides), loaded by `run`, stopped, `repeat` times in turn; then every
    answer judged against the parent alone here."""
    from specquant_cli.bench import load, report, sides, stamp
    from specquant_cli.routing.policies import check_policy
    from specquant_cli.session import bind_parent
    from specquant_cli.settings import SessionSettings

    if llama_server is not None and not (llama_server.is_file() and os.access(llama_server, os.X_OK)):
        raise InputError(f"--llama-server {llama_server}: not an executable file")
    contenders = sides.contenders(servers, lambda name: check_policy(name, family.roles(), family.siblings()),
                                  llama_server)
    if any(c.is_llama and c.what == "draft-sibling" for c in contenders) and "sibling" not in family.siblings():
        raise InputError(f"--servers llama:draft-sibling: the family {family.name} has no sibling draft model")
    family = bind_parent(family, SessionSettings.of(cfg))
    parallel = cfg.runtime.parallel
    if parallel is None:  # as serve decides it, so that every server (llama-server too) runs the same number
        from specquant_cli.serving.slots import parallel_for

        parallel = parallel_for(family, None, cfg.runtime.threads, [])[0]
    setup = sides.Setup(family, parallel, cfg.runtime.ctx, cfg.runtime.threads, llama_server, max_tokens)
    run_stamp = stamp.take(command_line(), setup.threads)
    err.print(f"bench load: {len(contenders)} servers, each started fresh at --parallel {setup.parallel}"
              + (f", {repeat} times in turn" if repeat > 1 else "") + f"; {how}", markup=False)

    def load_one(c: sides.Contender, url: str, label: str):
        name = load.find_model(url, None, None, PROBE_TIMEOUT_S)
        sides.warm(url, name)
        results, summary = run.go(load.Target(url, name, max_tokens, None, extra, timeout, request_timeout), label)
        err.print(f"bench load: {label.strip()}: " + _summary_line(summary, None), markup=False)
        return results, summary

    runs = sides.run(contenders, setup, repeat, load_one, lambda line: err.print(f"bench load: {line}", markup=False))
    cal = _calibration(family, cfg)
    with _kept(lambda: sides.report(runs, contenders, setup, config, run_stamp, cal), json_file, md_out,
               sides.markdown):
        judged = [None] * len(runs) if _sampled(extra) else _judge(family, cfg, [r.results for r in runs],
                                                                   max_tokens)
    for r, j in zip(runs, judged):
        r.fidelity = j
    rep = sides.report(runs, contenders, setup, config, run_stamp, cal)
    err.print(sides.markdown(rep), markup=False)
    failure = report.write_outputs(rep, json_file, md_out, render=sides.markdown)
    if json_out:
        out_json(rep)
    if failure:
        raise failure


@contextmanager
def _kept(made: Callable[[], dict], json_file: Optional[Path], md_out: Optional[Path], render) -> Iterator[None]:
    """The judge runs after the load; should it fail or be stopped (Ctrl-C), the load's report is written without
    verdicts (`fidelity_error` says why) before the failure goes on, so that minutes of measurement are not lost."""
    from specquant_cli.bench import report

    try:
        yield
    except BaseException as e:
        rep = made()
        rep["fidelity_error"] = f"the judge did not finish: {type(e).__name__}" + (f": {e}"[:200] if str(e) else "")
        if report.write_outputs(rep, json_file, md_out, render=render) is None and (json_file or md_out):
            err.print("bench load: the load's report was written without verdicts", markup=False)
        raise


def _not_sent_at_deadline(results, turns: int, planned: int) -> int:
    """The requests never sent because the run's deadline passed: those planned, less those sent, less the turns
    that a failed request (one the deadline did not cancel) ended its conversation before."""
    from specquant_cli.bench.answer import DEADLINE_ERROR

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


def _sampled(extra: dict) -> bool:
    """Whether --extra-body asks for sampled answers: those are the parent's distribution, not its greedy answer,
    and are not judged (a note says so)."""
    t = extra.get("temperature")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0:
        err.print("bench load: sampled answers (--extra-body temperature) are not judged against the parent's "
                  "greedy answer", markup=False)
        return True
    return False


def _calibration(family, cfg: Settings):
    """The parent's stored calibration on this machine (None where it has none: nothing is measured here), which
    prices the verify limit."""
    from specquant_cli.runtime import Runtime

    try:
        runtime = Runtime.open(family, n_ctx=cfg.runtime.ctx, threads=cfg.runtime.threads, mmap=cfg.runtime.mmap)
        try:
            return runtime.calibration(measure=False)
        finally:
            runtime.close()
    except (SpecquantError, OSError) as e:  # the load's figures stand without it
        err.print(f"bench load: no verify limit ({e})", markup=False)
        return None


def _judge(family, cfg: Settings, runs: list, max_tokens: int) -> list[Optional[dict]]:
    """Each run's answers judged against the parent alone (one runtime for all); None for a run with no answer."""
    from specquant_cli.bench import fidelity
    from specquant_cli.console import stderr_reporter
    from specquant_cli.runtime import Runtime
    from specquant_cli.session import bind_parent
    from specquant_cli.settings import SessionSettings

    family = bind_parent(family, SessionSettings.of(cfg))  # judged against the parent as a server here serves it
    runtime = Runtime.open(family, n_ctx=cfg.runtime.ctx, threads=cfg.runtime.threads, mmap=cfg.runtime.mmap,
                           report=stderr_reporter())
    try:
        out = []
        with err.status("fidelity: the parent alone answers every request's messages") as status:
            parent = fidelity.ParentAnswers(runtime, max_tokens)
            for k, results in enumerate(runs, 1):
                if not any(r.ok for r in results):
                    out.append(None)
                    continue
                out.append(fidelity.judge(results, parent, lambda i, n, k=k: status.update(
                    f"fidelity: the parent alone, {i}/{n} ({k})")))
        return out
    finally:
        runtime.close()


def _summary_line(s: dict, judged: Optional[dict]) -> str:
    n, g, t = s["requests"], s["goodput"], s["ttft_s"]
    p50 = "–" if t["p50"] is None else f"{t['p50']:.2f} s"
    line = (f"{n['succeeded']}/{n['planned']} requests in {s['wall_s']:.1f} s: {s['request_throughput']} req/s, "
            f"{s['output_tokens_per_s']} tok/s, TTFT p50 {p50}, goodput {g['requests']} ({g['share']:.0%})"
            if g["share"] is not None else f"{n['succeeded']}/{n['planned']} requests")
    if s.get("prediction_accepted") is not None:
        line += f"; prediction {s['prediction_accepted']} accepted / {s['prediction_rejected']} rejected"
    if judged is not None:
        from specquant_cli.bench.fidelity import shown

        line += "; fidelity " + " / ".join(f"{n} {name}" for name, n in shown(judged))
    return line
