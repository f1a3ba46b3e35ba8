from __future__ import annotations

import typer

from specquant_cli.commands.options import load_family, with_settings
from specquant_cli.settings import Settings

HELP = ("Serve a family over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, /v1/models, "
        "/health.\n\n"
        "Concurrent requests decode together (--parallel): each in its own sequence, with its own plan, and every "
        "parent call shared by all that need one; the rest wait in a bounded queue (a full queue answers 429). The "
        "policy per request comes from the body's specquant_policy or the x-specquant-policy header, else --policy. "
        "Binds to 127.0.0.1 unless --host says otherwise; with --api-key (or $SPECQUANT_API_KEY; repeat it, or give "
        "--api-key-file, for several) every /v1 request needs Authorization: Bearer KEY (GET /health, which then "
        "says only whether the server lives, and the chat page at / do not). Each key is a tenant: the prompt cache, "
        "the slots' cells and the drafting memory are never shared across keys (a request's cache_salt narrows "
        "them further); a server without a key is one tenant. One log line per request on "
        "stderr; SIGINT/SIGTERM stop cleanly.")

SETTINGS = ("decoding.policy", "serving.policies", "serving.host", "serving.port", "serving.api_key",
            "serving.allow_host", "serving.cors_origin",
            "runtime.parallel", "serving.queue", "serving.max_tokens", "serving.max_body", "decoding.gamma",
            "runtime.family", "runtime.parent", "runtime.ctx", "runtime.threads", "runtime.mmap", "runtime.rpc",
            "runtime.rpc_timeout",
            "decoding.draft_memory", "serving.prompt_cache", "serving.cache_ram", "serving.cache_dir",
            "serving.cache_disk",
            "serving.prefill_chunk")


def register(app: typer.Typer) -> None:
    app.command("serve", help=HELP)(serve)


@with_settings(*SETTINGS)
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
