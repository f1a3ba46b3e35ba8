"""`specquant bench record`: a pass-through proxy that records a real client's requests as a trace (bench.record),
for `bench load --replay`."""

from __future__ import annotations

from pathlib import Path

import typer

from specquant_cli.console import err


def register(app: typer.Typer) -> None:
    app.command("record", short_help="Record a client's requests for --replay",
                help="A pass-through proxy in front of a running server: point a client (a coding agent) at it, "
                     "and every chat-completion and Responses request it sends is appended to TRACE, one JSON line "
                     "each, for `bench load --replay TRACE`. Ctrl-C stops it. docs/benchmarking.md")(record)


def record(
    trace: Path = typer.Argument(..., help="The trace file to append to (JSON lines)", metavar="TRACE"),
    upstream: str = typer.Option(..., "--upstream", help="The server's base URL", metavar="URL"),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on"),
    port: int = typer.Option(8090, "--port", min=1, max=65535, help="Port to listen on"),
) -> None:
    from specquant_cli.bench import record as recorder
    from specquant_cli.bench.answer import normal_url
    from specquant_cli.errors import InputError

    base = normal_url(upstream)
    if trace.exists() and not trace.is_file():
        raise InputError(f"{trace}: not a regular file (the trace is appended to)")
    err.print(f"bench record: http://{host}:{port}/v1 -> {base}/v1, requests appended to {trace}", markup=False)
    n = recorder.serve(base, trace, host, port, lambda line: err.print(line, markup=False))
    err.print(f"bench record: {n} requests recorded in {trace}", markup=False)
