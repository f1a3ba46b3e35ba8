"""Recording a real client's traffic (`specquant bench record`): a pass-through proxy in front of any OpenAI-compatible
server that writes every chat-completion and Responses request body it forwards, in order, one JSON line each
(`{"endpoint", "body", "t"}`: t the seconds since the proxy started), to the trace that `bench load --replay` replays.
Point a coding agent at the proxy (aider's `--openai-api-base`, a Codex CLI provider's `base_url`) and let it work.

Each line is written and flushed before the request goes upstream, so a trace is whole up to the last request when the
recorder stops (Ctrl-C). Everything else (GET /v1/models, errors, the answers) passes through unrecorded; answers are
streamed through as they come. Bodies that are not JSON objects pass through and are not recorded."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import IO

RECORDED = ("/v1/chat/completions", "/v1/responses")
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}


class Trace:
    """The trace file: one request a line, flushed as written."""

    def __init__(self, out: IO[str]):
        self.out = out
        self.t0 = time.monotonic()
        self.count = 0

    def write(self, endpoint: str, body: dict) -> None:
        line = {"endpoint": endpoint, "body": body, "t": round(time.monotonic() - self.t0, 3)}
        self.out.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.out.flush()
        self.count += 1


def app(upstream: str, trace: Trace, say=lambda line: None):
    """The proxy: an ASGI app forwarding everything to `upstream` (its base URL, without /v1)."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None, connect=30.0))

    async def forward(request: Request):
        raw = await request.body()
        path = request.url.path
        if request.method == "POST" and path in RECORDED:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if isinstance(body, dict):
                trace.write(path, body)
                say(f"record: {path} #{trace.count} ({len(raw)} bytes)")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        req = client.build_request(request.method, path, params=request.query_params, headers=headers, content=raw)
        resp = await client.send(req, stream=True)
        out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            async def chunks():
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()
            return StreamingResponse(chunks(), status_code=resp.status_code, headers=out)
        data = await resp.aread()
        await resp.aclose()
        return Response(data, status_code=resp.status_code, headers=out)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await client.aclose()

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)], lifespan=lifespan)


def serve(upstream: str, out_path: Path, host: str, port: int, say) -> int:
    """Run the proxy until Ctrl-C/SIGTERM; the number of requests recorded. The trace is appended to."""
    import uvicorn

    with open(out_path, "a", encoding="utf-8") as out:
        trace = Trace(out)
        config = uvicorn.Config(app(upstream, trace, say), host=host, port=port, log_level="warning")
        uvicorn.Server(config).run()
        return trace.count
