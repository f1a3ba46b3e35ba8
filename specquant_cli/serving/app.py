"""The HTTP front end's routes: FastAPI in OpenAI's shape (chat completions, completions, responses, models,
health, metrics, the chat page), each generating request admitted (its body read strictly: serving.body; validated
by serving.schemas, or serving.responses for /v1/responses; queued as a `worker.Job`) and answered once, as one
JSON object or an SSE stream (serving.sse), inside the guard (serving.guard)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specquant_cli.serving.body import read_json
from specquant_cli.serving.guard import STATE_KEY, Guard
from specquant_cli.serving.metrics import CONTENT_TYPE, Metrics, Observation, outcome_of
from specquant_cli.serving.replies import ChunkMaker, chat_response, completion_response, new_id, now
from specquant_cli.serving.response_maker import ResponseMaker
from specquant_cli.serving.responses import responses_params
from specquant_cli.serving.schemas import ApiError, GenerationParams, chat_params, completion_params, error_body
from specquant_cli.serving.service import Service
from specquant_cli.serving.sse import SSE_HEADERS, ChunkFrames, Frames, ResponseFrames, events
from specquant_cli.serving.structured import logprobs_content
from specquant_cli.serving.worker import Job, disconnected

POLICY_HEADER = "x-specquant-policy"

# The chat page (GET /): static files, served without the API key (the page asks for it), as /health is.
# Every /v1 call still needs the key. The CSP lets the page load and talk to this origin only.
STATIC_DIR = Path(__file__).resolve().parent / "static"
PAGE_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
              "/static/page.js": ("page.js", "text/javascript; charset=utf-8"),
              "/static/page.css": ("page.css", "text/css; charset=utf-8"),
              "/static/icon.svg": ("icon.svg", "image/svg+xml")}
PUBLIC_PATHS = frozenset({"/health", *PAGE_FILES})  # GET or HEAD only
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


def create_app(svc: Service):
    """The ASGI application to serve: the FastAPI routes inside the guard."""
    app = FastAPI(title="specquant", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = Metrics(svc, svc.policies)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        _notes(request)["error"] = e.message
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(error_body(msg, code=code), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(error_body("invalid request", code="invalid_value"), status_code=400)

    @app.get("/health")
    async def health(request: Request):
        """Liveness for anyone; the server's state (its queue, caches and memories) only with a key, or on a server
        without one."""
        stopping = svc.worker.stopping
        state = "parent_lost" if svc.worker.lost else "shutting_down" if stopping else "ok"
        body = {"status": state}
        if svc.api_key is None or _notes(request).get("tenant") is not None:
            body |= {"family": svc.family.name, "policy": svc.default_policy,
                     "kv": svc.kv, "draft_memory": svc.runtime.drafters.memory_use(),
                     "prompt_cache": svc.prompt_cache_status(), **svc.worker.status()}
        return JSONResponse(body, status_code=503 if stopping else 200)

    @app.get("/metrics")
    async def prometheus():  # behind the API key when one is set
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    _add_page(app)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [svc.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != svc.family.name:
            raise ApiError(404, f"model {model_id!r} not found; this server serves {svc.family.name!r}",
                           param="model", code="model_not_found")
        return svc.model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(svc, request, metrics.observe(), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(svc, request, metrics.observe(), chat=False)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await _respond(svc, request, metrics.observe())

    return Guard(app, svc.api_keys, public=PUBLIC_PATHS, policy=svc.origin_policy)


def _add_page(app: FastAPI) -> None:
    """GET routes for the chat page's files, read once now."""
    for path, (name, media_type) in PAGE_FILES.items():
        content = (STATIC_DIR / name).read_bytes()

        async def serve(content=content, media_type=media_type):
            return Response(content, media_type=media_type, headers=PAGE_HEADERS)

        app.add_api_route(path, serve, methods=["GET", "HEAD"], include_in_schema=False)


# -- generation -----------------------------------------------------------------------------------

async def _generate(svc: Service, request: Request, obs: Observation, chat: bool):
    params, job = await _admit(svc, request, obs, chat)

    async def whole(answer, first, notes: dict) -> dict:
        lps: list = []
        text, rec = await _collect(job, answer, first, notes, obs, lps)
        rid, name = new_id("chatcmpl" if chat else "cmpl"), svc.family.name
        lp = _lp(svc, params)
        return chat_response(rid, now(), name, text, answer, rec, params, lp(lps) if lp else None) if chat \
            else completion_response(rid, now(), name, text, answer, rec)

    frames = lambda: ChunkFrames(ChunkMaker(chat, svc.family.name, params.include_usage, params, _lp(svc, params)))
    return await _answer(svc, request, obs, params, job, frames, whole)


async def _respond(svc: Service, request: Request, obs: Observation):
    """POST /v1/responses: the chat machinery's answer as a response object or its stream of events
    (serving.responses)."""
    holder: list = []
    params, job = await _admit(svc, request, obs, chat=True, read=_responses_reader(holder, svc.strict_tools))
    req = holder[0]
    if req.warnings:
        _notes(request)["warning"] = "; ".join(req.warnings)

    async def whole(answer, first, notes: dict) -> dict:
        maker = ResponseMaker(req, svc.family.name)  # created when the first record came, as a stream's is
        text, rec = await _collect(job, answer, first, notes, obs)
        return maker.whole(text, answer, rec)

    frames = lambda: ResponseFrames(ResponseMaker(req, svc.family.name))
    return await _answer(svc, request, obs, params, job, frames, whole)


async def _answer(svc: Service, request: Request, obs: Observation, params: GenerationParams, job: Job,
                  frames: Callable[[], Frames], whole: Callable[..., Awaitable[dict]]):
    """An admitted request's answer, and the end of the request: the job's first record (an error before it is the
    answer), then its SSE stream (`frames()`: how its events are written) when the request asked to stream, else one
    JSON object (`whole(answer, first, notes)`). A client that leaves before the answer cancels the job; the
    request is observed to its end once (served, or the outcome of what stopped it), and the guard's catch-all
    cancels a job nobody waits for any more (`_end`)."""
    notes = _notes(request)
    notes["end"] = lambda: _end(svc, job, obs)  # the guard's catch-all, once answered
    watcher = asyncio.create_task(_watch_disconnect(request, svc, job))
    try:
        answer, kind, payload = await _first(job)
        if kind == "error":
            raise payload
        if params.stream:
            watcher.cancel()  # from here Starlette's own listener cancels the stream on a disconnect
            return StreamingResponse(events(svc, job, frames(), answer, payload, notes, obs),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        response = JSONResponse(await whole(answer, payload, notes))
        obs.end("served")
        return response
    except BaseException as e:
        obs.end(outcome_of(e))
        raise
    finally:
        watcher.cancel()


def _responses_reader(holder: list, refuse_builtin: bool = False) -> Callable:
    """A `read` for _admit that validates a Responses body (serving.responses) and keeps the request in `holder`;
    `refuse_builtin`: refuse built-in tools instead of leaving them out."""

    def read(body, resolve, model) -> GenerationParams:
        req = responses_params(body, resolve, model, refuse_builtin)
        holder.append(req)
        return req.params

    return read


async def _admit(svc: Service, request: Request, obs: Observation, chat: bool,
                 read: Optional[Callable] = None) -> tuple[GenerationParams, Job]:
    """The request's params and its job, queued; a request refused before that is observed as rejected. `read`:
    what validates a chat-like body (default schemas.chat_params)."""
    try:
        body = await read_json(request, svc.max_body)
        header_policy = request.headers.get(POLICY_HEADER)

        def resolve(p: Optional[str]) -> str:
            return svc.policy_for(p or header_policy, "specquant_policy" if p else POLICY_HEADER)

        if chat:  # a grammar compiles off the event loop (a large schema takes a while), a few at once, and only
            svc.worker.check_room()  # for a request the queue would take
            async with svc.compiling:
                params = await asyncio.to_thread(read or chat_params, body, resolve, svc.runtime.tokenizer())
        else:
            params = completion_params(body, resolve)
        params = replace(params, scope=svc.scope_of(_notes(request).get("tenant") or "", params.salt))
        job = Job(params, asyncio.get_running_loop())
        svc.worker.submit(job)
    except ApiError:
        obs.end("rejected")
        raise
    return params, job


def _end(svc: Service, job: Job, obs: Observation) -> None:
    """Once answered: a job still running has nobody to answer (e.g. a stream never read) and is cancelled."""
    svc.worker.cancel(job, disconnected())
    obs.end("cancelled")  # unless the request was observed to an end already


def _lp(svc: Service, params: GenerationParams) -> Optional[Callable[[list], list]]:
    """How the parent's TokenLogprob entries become `logprobs.content` (None: the request did not ask)."""
    if params.top_logprobs is None:
        return None
    model = svc.runtime.tokenizer()
    return lambda entries: logprobs_content(model, entries)


async def _collect(job: Job, answer, rec, notes: dict, obs: Observation, lps: Optional[list] = None
                   ) -> tuple[str, Any]:
    """The whole text of a plain (not streamed) answer from its first record `rec` on, and its last record;
    `lps` gathers the records' log-probabilities."""
    parts = []
    while True:
        parts.append(rec.text)
        if lps is not None:
            lps += rec.logprobs
        notes["gen"] = (answer, rec)
        obs.record(answer, rec)
        if rec.finish_reason is not None:
            return "".join(parts), rec
        kind, payload = await job.get()
        if kind == "error":
            raise payload
        rec = payload


async def _first(job: Job):
    """(answer, kind, payload) of the first record or error; the answer is None before routing is done."""
    answer = None
    while True:
        kind, payload = await job.get()
        if kind == "start":
            answer = payload
            continue
        return answer, kind, payload


async def _watch_disconnect(request: Request, svc: Service, job: Job) -> None:
    """While a request waits or collects its answer, a client that leaves cancels its job."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            svc.worker.cancel(job, disconnected())
            return


def _notes(request: Request) -> dict:
    return request.scope.setdefault("state", {}).setdefault(STATE_KEY, {})
