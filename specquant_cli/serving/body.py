"""A request's body read strictly: at most the server's cap (an oversized one drained so the client reads the 413),
whole within BODY_TIMEOUT_S, and parsed as strict JSON (UTF-8, finite numbers, each key once, nesting bounded)."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator
from itertools import accumulate
from typing import Any, Optional

from fastapi import Request
from starlette.requests import ClientDisconnect

from specquant_cli.serving.schemas import ApiError
from specquant_cli.serving.worker import disconnected

DRAIN_BYTES = 32 << 20  # an oversized body is read (and dropped) this far past the cap, so the client reads the 413
BODY_TIMEOUT_S = 5  # a body not complete this long after its first wait began is answered 400 (connection closed)
MAX_JSON_DEPTH = 64  # arrays and objects nested deeper are refused before parsing
CLOSE = {"connection": "close"}  # on an answer sent before the whole body was read


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
