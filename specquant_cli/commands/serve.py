from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from specquant_cli.commands.options import (
    ConfigOpt,
    CtxOpt,
    FamilyOpt,
    PolicyOpt,
    RpcOpt,
    ThreadsOpt,
    load_family,
)

API_KEY_ENV = "SPECQUANT_API_KEY"

HELP = ("Serve a family over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, /v1/models, "
        "/health.\n\n"
        "Concurrent requests decode together (--parallel): each in its own sequence, with its own plan, and every "
        "parent call shared by all that need one; the rest wait in a bounded queue (a full queue answers 429). The "
        "policy per request comes from the body's specquant_policy or the x-specquant-policy header, else --policy. "
        "Binds to 127.0.0.1 unless --host says otherwise; with --api-key (or $SPECQUANT_API_KEY) every /v1 request "
        "needs Authorization: Bearer KEY (GET /health and the chat page at / do not). One log line per request on "
        "stderr; SIGINT/SIGTERM stop cleanly.")


def register(app: typer.Typer) -> None:
    app.command("serve", help=HELP)(serve)


def serve(
    family: Optional[Path] = FamilyOpt,
    policy: str = PolicyOpt,
    policies: Optional[str] = typer.Option(
        None, "--policies", help="Comma-separated policies a request may choose (default: all); every model "
                                 "they can use is loaded at start-up"),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (0.0.0.0: every interface)"),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port (0: any free port, printed at start)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar=API_KEY_ENV, show_envvar=True,
                                          help="Require Authorization: Bearer KEY on every /v1 request"),
    parallel: Optional[int] = typer.Option(
        None, "--parallel", min=1, max=8,
        help="Requests decoded together (default: as many as this machine's calibrated parent cost curve says "
             "pay, at most 8; 1: one at a time). Each holds --ctx positions of its own"),
    queue: int = typer.Option(32, "--queue", min=0, help="Requests that may wait behind the running ones"),
    max_tokens: int = typer.Option(512, "--max-tokens", min=1,
                                   help="New tokens for a request that sets no max_tokens"),
    max_body: int = typer.Option(1 << 20, "--max-body", min=1024, help="Largest request body in bytes (413 above)"),
    gamma: int = typer.Option(4, "--gamma", min=1, max=16, help="Draft length (initial, for adaptive)"),
    threads: int = ThreadsOpt,
    n_ctx: int = CtxOpt,
    config: Optional[Path] = ConfigOpt,
    rpc: Optional[str] = RpcOpt,
) -> None:
    from specquant_cli.console import stderr_reporter
    from specquant_cli.serving.server import ServeOptions, build_service, run

    offered = [p.strip() for p in policies.split(",") if p.strip()] if policies else []
    opts = ServeOptions(policy=policy, policies=offered, host=host, port=port, api_key=api_key or None,
                        max_queue=queue, max_tokens=max_tokens, max_body=max_body, parallel=parallel)
    svc = build_service(load_family(family), opts, n_ctx=n_ctx, gamma=gamma, threads=threads or None,
                        router_config=config, report=stderr_reporter())
    run(svc, opts)
