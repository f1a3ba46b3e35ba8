"""`specquant bench rpc`: the parent local against llama.cpp RPC workers on loopback, and speculation against an added
round-trip delay (bench.rpc)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from specquant_cli.commands.options import (
    BENCH_MAX_TOKENS,
    JsonFileOpt,
    JsonOpt,
    MarkdownOpt,
    command_line,
    int_list,
    with_settings,
)
from specquant_cli.console import err, out_json
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("rpc", short_help="The parent here against RPC workers",
                help="The parent local, through one and two llama.cpp RPC workers on loopback: per-call ms and "
                     "tok/s; then one worker behind a proxy delaying each way by --delays ms, spec-q4 against "
                     "the parent.")(rpc)


@with_settings("runtime.family", "runtime.parent", "runtime.ctx", "runtime.threads", "runtime.deterministic")
def rpc(
    max_tokens: int = typer.Option(BENCH_MAX_TOKENS, "--max-tokens", min=1, max=4096, help="New tokens per answer"),
    prompts: int = typer.Option(2, "--prompts", min=1, max=3, help="How many of the built-in prompts"),
    reps: int = typer.Option(5, "--repeats", "--reps", min=1, max=101,
                             help="Timings per call size (the median counts)"),
    delays: str = typer.Option("0,1,5", "--delays", help="Comma-separated ms the proxy adds each way", metavar="MS,…"),
    worker_threads: int = typer.Option(max(1, (os.cpu_count() or 2) // 2), "--worker-threads", min=1, max=256,
                                       help="Threads of each worker", show_default="half the cores"),
    json_out: bool = JsonOpt,
    json_file: Optional[Path] = JsonFileOpt,
    md_out: Optional[Path] = MarkdownOpt,
    *, cfg: Settings,
) -> None:
    from specquant_cli.bench import report, stamp
    from specquant_cli.bench import rpc as bench_rpc
    from specquant_cli.commands.options import load_family
    from specquant_cli.errors import InputError
    from specquant_cli.session import bind_parent
    from specquant_cli.settings import SessionSettings

    report.check_outputs({"--json-file": json_file, "--markdown": md_out})
    ds = int_list(delays, "--delays", 0, 10_000)
    fam = bind_parent(load_family(cfg.runtime.family), SessionSettings.of(cfg))
    if "q4" not in fam.roles():
        raise InputError(f"family {fam.name} has no q4 variant: spec-q4 cannot run")
    run_stamp = stamp.take(command_line(), cfg.runtime.threads)
    with err.status("bench rpc") as status:
        measured = bench_rpc.run(fam, ds, prompts, max_tokens, reps, cfg.runtime.ctx, cfg.runtime.threads,
                                 worker_threads, lambda what: status.update(f"bench rpc: {what}"))
    rep = {"command": run_stamp["command"], "stamp": run_stamp, "family": fam.name, "parent": fam.parent_rendering,
           "config": {"max_tokens": max_tokens, "prompts": prompts, "reps": reps, "delays_ms": ds,
                      "worker_threads": worker_threads, "threads": cfg.runtime.threads}, **measured}
    err.print(bench_rpc.markdown(rep), markup=False)
    failure = report.write_outputs(rep, json_file, md_out, render=bench_rpc.markdown)
    if json_out:
        out_json(rep)
    if failure:
        raise failure
