from __future__ import annotations

import typer

from specquant_cli.commands.options import load_family, with_settings
from specquant_cli.settings import Settings

HELP = ("Serve a family over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/responses, "
        "/v1/models), with a chat page at /.\n\n"
        "Requests decode together (--parallel), each with its own plan (the body's specquant_policy, else "
        "--policy). Loopback unless --host says otherwise; each --api-key is a tenant. docs/serve.md")

SETTINGS = ("decoding.policy", "serving.policies", "serving.host", "serving.port", "serving.api_key",
            "serving.allow_host", "serving.cors_origin",
            "runtime.parallel", "serving.queue", "serving.max_tokens", "serving.max_body",
            "serving.strict_tools", "decoding.gamma",
            "runtime.family", "runtime.parent", "runtime.ctx", "runtime.threads", "runtime.mmap", "runtime.rpc",
            "runtime.rpc_timeout",
            "decoding.draft_memory", "serving.prompt_cache", "serving.cache_ram", "serving.cache_dir",
            "serving.cache_disk",
            "serving.prefill_chunk")


def register(app: typer.Typer) -> None:
    app.command("serve", help=HELP, short_help="Serve the OpenAI-compatible HTTP API")(serve)


@with_settings(*SETTINGS, "runtime.deterministic")
def serve(*, cfg: Settings) -> None:
    from specquant_cli.console import stderr_reporter
    from specquant_cli.serving.server import build_service, run, serve_settings
    from specquant_cli.session import bind_parent
    from specquant_cli.settings import SessionSettings

    family = bind_parent(load_family(cfg.runtime.family), SessionSettings.of(cfg))  # said at start-up
    report = stderr_reporter()
    cfg, opts = serve_settings(cfg, family, report=report)  # every value decided before a context is sized
    svc = build_service(family, cfg, opts, report=report)
    run(svc, opts)
