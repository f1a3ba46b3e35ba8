"""The outermost ASGI layer (`Guard`): the Host and Origin checks, CORS preflights, JSON-only POST bodies, the API
key (the request's tenant), one stderr log line per request, and no traceback out."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Callable, Collection, Sequence
from typing import Optional, Union

from specquant_cli.serving.schemas import error_body
from specquant_cli.serving.security import OriginPolicy, is_json
from specquant_cli.serving.service import stderr_line

STATE_KEY = "specquant"  # per-request notes for the log line, in the ASGI scope's state


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
