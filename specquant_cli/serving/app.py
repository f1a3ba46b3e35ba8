"""The HTTP front end: FastAPI routes in OpenAI's shape, wrapped by a small ASGI guard.

The guard (outermost) checks the API key, logs one line per request on stderr and turns any escaped
exception into a bare 500; the routes read the body themselves (size cap, stall timeout, strict JSON), validate
it through `schemas` (`responses` for /v1/responses, which it reads into a chat completion), queue a `worker.Job`
and answer with one JSON object or an SSE stream.

Why one file of ~600 lines: the guard and the routes are the whole HTTP surface, read together when one asks
what a client can send and what it gets back."""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import replace
from itertools import accumulate
from pathlib import Path
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specquant_cli.serving.metrics import CONTENT_TYPE, Metrics, Observation, outcome_of
from specquant_cli.serving.responses import ResponseMaker, responses_params
from specquant_cli.serving.schemas import (
    ApiError,
    ChunkMaker,
    GenerationParams,
    chat_params,
    chat_response,
    completion_params,
    completion_response,
    error_body,
    new_id,
    now,
)
from specquant_cli.serving.security import OriginPolicy, is_json
from specquant_cli.serving.service import Service, stderr_line
from specquant_cli.serving.structured import logprobs_content
from specquant_cli.serving.worker import Job, disconnected

POLICY_HEADER = "x-specquant-policy"
DRAIN_BYTES = 32 << 20  # an oversized body is read (and dropped) this far past the cap, so the client reads the 413
BODY_TIMEOUT_S = 5  # a body not complete this long after its first wait began is answered 400 (connection closed)
MAX_JSON_DEPTH = 64  # arrays and objects nested deeper are refused before parsing
CLOSE = {"connection": "close"}  # on an answer sent before the whole body was read
STATE_KEY = "specquant"  # per-request notes for the log line, in the ASGI scope's state

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
    notes = _notes(request)
    notes["end"] = lambda: _end(svc, job, obs)  # the guard's catch-all, once answered

    watcher = asyncio.create_task(_watch_disconnect(request, svc, job))
    try:
        answer, kind, payload = await _first(job)
        if kind == "error":
            raise payload
        if params.stream:
            watcher.cancel()  # from here Starlette's own listener cancels the stream on a disconnect
            maker = ChunkMaker(chat, svc.family.name, params.include_usage, params, _lp(svc, params))
            return StreamingResponse(_sse(svc, job, maker, answer, payload, notes, obs),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        lps: list = []
        text, rec = await _collect(job, answer, payload, notes, obs, lps)
        rid, name = new_id("chatcmpl" if chat else "cmpl"), svc.family.name
        lp = _lp(svc, params)
        response = JSONResponse(chat_response(rid, now(), name, text, answer, rec, params, lp(lps) if lp else None)
                                if chat else completion_response(rid, now(), name, text, answer, rec))
        obs.end("served")
        return response
    except BaseException as e:
        obs.end(outcome_of(e))
        raise
    finally:
        watcher.cancel()


async def _respond(svc: Service, request: Request, obs: Observation):
    """POST /v1/responses: the chat machinery's answer as a response object or its stream of events
    (serving.responses)."""
    holder: list = []
    params, job = await _admit(svc, request, obs, chat=True, read=_responses_reader(holder, svc.strict_tools))
    req = holder[0]
    notes = _notes(request)
    if req.warnings:
        notes["warning"] = "; ".join(req.warnings)
    notes["end"] = lambda: _end(svc, job, obs)

    watcher = asyncio.create_task(_watch_disconnect(request, svc, job))
    try:
        answer, kind, payload = await _first(job)
        if kind == "error":
            raise payload
        maker = ResponseMaker(req, svc.family.name)
        if params.stream:
            watcher.cancel()
            return StreamingResponse(_response_sse(svc, job, maker, answer, payload, notes, obs),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, rec = await _collect(job, answer, payload, notes, obs)
        response = JSONResponse(maker.whole(text, answer, rec))
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
        predicted = await asyncio.to_thread(svc.prediction_tokens, params.prediction) if params.prediction else None
        params = replace(params, scope=svc.scope_of(_notes(request).get("tenant") or "", params.salt),
                         prediction=predicted)
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


async def _sse(svc: Service, job: Job, maker: ChunkMaker, answer, first, notes: dict,
               obs: Observation) -> AsyncIterator[str]:
    outcome = None  # until the stream ends
    try:
        opening = maker.first(answer)
        if opening is not None:
            yield _event(opening)
        kind, payload = "record", first
        while True:
            if kind == "error":  # e.g. SIGTERM: end the stream with an error event in OpenAI's shape
                notes["error"] = payload.message
                yield _event(payload.body())
                outcome = outcome_of(payload)
                return
            rec = payload
            notes["gen"] = (answer, rec)
            obs.record(answer, rec)
            chunk = maker.text(answer, rec)  # None while nothing can go out (its logprobs wait for the next)
            if chunk is not None:
                yield _event(chunk)
            if rec.finish_reason is not None:
                for chunk in maker.finish(answer, rec):
                    yield _event(chunk)
                if maker.include_usage:
                    yield _event(maker.usage(rec))
                yield "data: [DONE]\n\n"
                outcome = "served"
                return
            kind, payload = await job.get()
    finally:
        if outcome is None:  # the client went away (Starlette cancelled us): stop generating for nobody
            svc.worker.cancel(job, disconnected())
        obs.end(outcome or "cancelled")


def _event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _response_sse(svc: Service, job: Job, maker: ResponseMaker, answer, first, notes: dict,
                        obs: Observation) -> AsyncIterator[str]:
    """The Responses stream: each event as `event: TYPE` and `data: JSON`; no [DONE]."""
    outcome = None
    try:
        for event in maker.start():
            yield _typed(event)
        kind, payload = "record", first
        while True:
            if kind == "error":
                notes["error"] = payload.message
                for event in maker.error(payload):
                    yield _typed(event)
                outcome = outcome_of(payload)
                return
            rec = payload
            notes["gen"] = (answer, rec)
            obs.record(answer, rec)
            for event in maker.text(rec):
                yield _typed(event)
            if rec.finish_reason is not None:
                for event in maker.finish(answer, rec):
                    yield _typed(event)
                outcome = "served"
                return
            kind, payload = await job.get()
    finally:
        if outcome is None:
            svc.worker.cancel(job, disconnected())
        obs.end(outcome or "cancelled")


def _typed(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


# -- body -----------------------------------------------------------------------------------------

async def read_json(request: Request, cap: int) -> Any:
    """The body parsed as JSON: 413 past `cap` bytes (declared or actual), 400 when it stalls or is not JSON."""
    return parse_json(await read_body(request, cap))


async def read_body(request: Request, cap: int) -> bytes:
    """The body, at most `cap` bytes. An oversized one is drained first (up to DRAIN_BYTES more), as a client
    that is still sending (or that asked for Connection: close) would otherwise read a reset, not the 413."""
    declared = request.headers.get("content-length", "")
    declared = int(declared) if declared.isdigit() else 0
    expects_100 = request.headers.get("expect", "").lower() == "100-continue"
    if declared > cap + DRAIN_BYTES or (declared > cap and expects_100):
        raise _too_big(cap, CLOSE)  # not worth reading (or not sent yet): the connection closes after the answer
    size, parts, chunks = 0, [], request.stream()
    deadline = asyncio.get_running_loop().time() + BODY_TIMEOUT_S  # for the whole body: a byte every 3 s is no body
    try:
        while (chunk := await _next_chunk(chunks, deadline)) is not None:
            size += len(chunk)
            if size > cap + DRAIN_BYTES:
                raise _too_big(cap, CLOSE)
            if size <= cap:
                parts.append(chunk)
    except TimeoutError:
        if max(size, declared) > cap:
            raise _too_big(cap, CLOSE) from None
        got = f"{size} of {declared}" if declared else str(size)
        raise ApiError(400, f"the request body did not arrive within {BODY_TIMEOUT_S} s: {got} bytes came",
                       code="body_timeout", headers=CLOSE) from None
    except ClientDisconnect:
        raise disconnected() from None
    if max(size, declared) > cap:
        raise _too_big(cap)
    return b"".join(parts)


async def _next_chunk(chunks: AsyncIterator[bytes], deadline: float) -> Optional[bytes]:
    async with asyncio.timeout_at(deadline):
        return await anext(chunks, None)


def _too_big(cap: int, headers: Optional[dict] = None) -> ApiError:
    return ApiError(413, f"request body larger than {cap} bytes", code="request_too_large", headers=headers)


def parse_json(data: bytes) -> Any:
    """Strict JSON: UTF-8, no NaN or Infinity (nor numbers beyond a float), no repeated key, nesting bounded."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _bad_json("the request body is not valid UTF-8") from None
    too_deep = _bad_json(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    if _depth(text) > MAX_JSON_DEPTH:
        raise too_deep
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite, object_pairs_hook=_object)
    except RecursionError:  # unbalanced brackets the depth count did not see as deep
        raise too_deep from None
    except ValueError:  # JSONDecodeError, and integers of more digits than Python converts
        raise _bad_json("could not parse the request body as JSON") from None


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)  # an unclosed one runs to the end
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def _depth(text: str) -> int:
    """How deep arrays and objects nest in a JSON text (brackets inside strings skipped), without parsing it."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _no_constant(name: str):
    raise _bad_json(f"{name} is not a JSON number")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _bad_json(f"the number {literal[:32]} is out of range")
    return value


def _object(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _bad_json(f"the key {key!r} appears twice in one JSON object")
            seen.add(key)
    return obj


def _bad_json(message: str) -> ApiError:
    return ApiError(400, message, code="invalid_json")


def _notes(request: Request) -> dict:
    return request.scope.setdefault("state", {}).setdefault(STATE_KEY, {})


# -- the guard ----------------------------------------------------------------------------------------

class Guard:
    """Outermost ASGI layer, in this order: the Host and Origin checks (serving.security: a web page the user
    visits cannot drive the server), CORS preflights of allowed origins, JSON-only POST bodies, Bearer auth
    against every key the server holds (constant-time, each key compared; not needed for a GET or HEAD of a
    `public` path, though checked when sent); the key that matched is the request's tenant (its note "tenant");
    one stderr log line per request, no tracebacks out."""

    def __init__(self, app, api_keys: Union[Sequence[str], str, None], log: Optional[Callable[[str], None]] = None,
                 public: Collection[str] = (), policy: OriginPolicy = OriginPolicy()):
        self.app = app
        keys = [api_keys] if isinstance(api_keys, str) else list(api_keys or ())
        self._keys = [k.encode() for k in keys if k]
        self._log = log or stderr_line
        self._public = frozenset(public)  # paths a GET or HEAD reaches without the key
        self._policy = policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        state = {"status": 0, "complete": False}
        notes = scope.setdefault("state", {}).setdefault(STATE_KEY, {})

        cors: dict[str, str] = {}

        async def send_(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                if cors:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      *((k.encode(), v.encode()) for k, v in cors.items())]}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        try:
            refusal = self._refused(scope, cors)
            denied = self._denied(scope, notes) if refusal is None else None
            if refusal is not None:
                status, code, message = refusal
                notes["error"] = message
                if status == 204:  # an allowed preflight
                    await send_({"type": "http.response.start", "status": 204, "headers": []})
                    await send_({"type": "http.response.body", "body": b"", "more_body": False})
                else:
                    await _send_json(send_, status, error_body(message, type="invalid_request_error", code=code))
            elif denied is not None:
                notes["error"] = denied
                await _send_json(send_, 401, error_body(denied, code="invalid_api_key"),
                                 {"www-authenticate": "Bearer"})
            else:
                await self.app(scope, receive, send_)
        except Exception as e:  # Starlette already answered 500 (or the stream broke): log one line
            if _debug():
                raise
            notes["error"] = f"internal error: {type(e).__name__}"
            if not state["status"]:
                await _send_json(send_, 500, error_body("internal error", type="server_error", code="internal_error"))
        finally:
            end = notes.pop("end", None)
            if end is not None:
                end()
            self._log(_log_line(scope, state, notes, time.perf_counter() - t0))

    def _refused(self, scope, cors: dict) -> Optional[tuple[int, Optional[str], str]]:
        """(status, code, message) of a request refused before auth (or (204, None, ...) for an allowed CORS
        preflight); fills `cors` with the headers an allowed cross-site origin gets."""
        host = _header(scope, b"host")
        problem = self._policy.host_problem(host)
        if problem is not None:
            return 403, "host_not_allowed", problem
        origin = _header(scope, b"origin")
        if origin is not None:
            if not self._policy.origin_allowed(origin, host):
                return 403, "origin_not_allowed", (f"a page of {origin[:80]!r} may not call this server; start it "
                                                   f"with --cors-origin {origin[:80]} to allow that site")
            if self._policy.cross_site(origin, host):
                cors.update(self._policy.cors_headers(origin, _header(scope, b"access-control-request-headers")))
        if scope.get("method") == "OPTIONS" and origin is not None and \
                _header(scope, b"access-control-request-method") is not None:
            return 204, None, "preflight"
        if scope.get("method") == "POST" and not is_json(_header(scope, b"content-type")):
            return 415, "unsupported_media_type", ("a request body must be JSON, sent with the header "
                                                   "Content-Type: application/json")
        return None

    def _denied(self, scope, notes: dict) -> Optional[str]:
        """Why the request may not pass (None: it may; a valid key's tenant goes to `notes`)."""
        if not self._keys:
            return None
        auth = next((v for k, v in scope.get("headers", []) if k == b"authorization"), None)
        if auth is None:
            if scope.get("method") in ("GET", "HEAD") and scope.get("path") in self._public:
                return None
            return "missing API key: send the header Authorization: Bearer <key>"
        scheme, _, token = auth.partition(b" ")
        token = token.strip()
        # compare_digest on bytes of any length: the time does not depend on how much of a key matches; every key is
        # compared, so neither does it depend on which one matched
        found = [hmac.compare_digest(token, key) for key in self._keys]
        if scheme.lower() != b"bearer" or not any(found):
            return "invalid API key"
        notes["tenant"] = self._keys[found.index(True)].decode()
        return None


def _header(scope, name: bytes) -> Optional[str]:
    """The first value of header `name` (lower case), as text; None when absent."""
    value = next((v for k, v in scope.get("headers", []) if k == name), None)
    return value.decode("latin-1") if value is not None else None


async def _send_json(send, status: int, body: dict, headers: Optional[dict] = None) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data, "more_body": False})


def _log_line(scope, state: dict, notes: dict, seconds: float) -> str:
    client = scope.get("client") or ("-", 0)
    parts = [client[0], scope.get("method", "-"), scope.get("path", "-"), str(state["status"] or "-")]
    gen = notes.get("gen")
    if gen is not None:
        answer, rec = gen
        parts += [f"{rec.new_tokens} tokens", f"{rec.tokens_per_s:.1f} tok/s",
                  f"acceptance {rec.acceptance_rate:.0%}", f"{rec.mean_accepted_length:.2f} tok/call"]
        if answer is not None:
            parts.append(f"[{answer.route.tier} {answer.route.score:.2f} → {answer.plan.describe()}]")
    parts.append(f"{seconds:.2f}s")
    if state["status"] and not state["complete"]:
        parts.append("(client disconnected)")
    if notes.get("error"):
        parts.append(f"({notes['error']})")
    if notes.get("warning"):
        parts.append(f"(warning: {notes['warning']})")
    return " ".join(parts)


def _debug() -> bool:
    from specquant_cli.settings import debug

    return debug()
