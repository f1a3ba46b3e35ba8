"""One request of a load (bench.load), as the client sees it: what is asked (`Target`), what came back
(`RequestResult`), and `stream_chat`, which sends one streamed greedy chat completion and times its content pieces.

No server is trusted: the event stream is read line by line within caps (bench.bounded), the request has a
deadline for the whole of it, the answer is over at [DONE] or soon after its finish_reason, and an answer longer
than max_tokens allows (more pieces, more characters, a larger usage) fails. Each of these is the request's error,
never an exception."""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Optional

from specquant_cli.bench.bounded import Lines, Refused, brief, decoded, error_text, read_body
from specquant_cli.errors import InputError

DEFAULT_READ_TIMEOUT_S = 600.0  # --timeout: seconds one read may wait (a CPU server's long prefill included)
DEFAULT_REQUEST_TIMEOUT_S = 1800.0  # --request-timeout: seconds a whole request may take (a byte trickle ends here)
STREAM_BYTES_MIN = 16 << 20  # one answer's whole event stream: at least this much may come,
STREAM_BYTES_PER_TOKEN = 4096  # ... or this much per max_tokens when that is more (chunks of ~0.3 KiB a token)
MAX_CHARS_PER_TOKEN = 64  # content characters one token may carry, generously (vocabularies' longest are ~16-32)
FINISH_GRACE_S = 2.0  # after a finish_reason: seconds the usage chunk and [DONE] may still take
FINISH_GRACE_LINES = 32  # ... and the lines (keep-alive pings) read after it at most
DEADLINE_ERROR = "cancelled: the run's deadline passed"  # the error of a request in flight at --deadline
IDENTITY = {"Accept-Encoding": "identity"}  # asked of every server; gzip and deflate are still read, bounded


# -- one request ---------------------------------------------------------------------------------------------------

@dataclass
class RequestResult:
    """One chat completion as the client saw it. Times are seconds; `start_s` from the run's start."""

    conversation: int
    turn: int
    messages: list[dict]
    prediction: Optional[str] = None  # the text sent as the request's `prediction` (Predicted Outputs)
    ok: bool = False
    error: Optional[str] = None
    text: str = ""
    start_s: float = 0.0
    ttft_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: Optional[float] = None
    output_tokens: int = 0
    tokens_from: str = "chunks"  # "usage": the server's completion_tokens; "chunks": content pieces counted
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None  # of those, what the server took from its cache (its usage's, when it says)
    finish_reason: Optional[str] = None
    fidelity: Optional[dict] = None
    # what a specquant server says of the answer (its `specquant` object): the plan it ran, and the tokens
    # drafted and kept, and the parent's calls; None from a server that says nothing of it
    plan: Optional[str] = None
    drafted: Optional[int] = None
    accepted: Optional[int] = None
    parent_calls: Optional[int] = None
    # the server's own clock (its `specquant` object's parent_prefill_s, prefill_s and total_s): the parent's prefill,
    # that with a drafter's preparation, and the answer from the engine's start; e2e_s - server_total_s is what came
    # before the engine (queue, slot, plan) and the delivery
    server_parent_prefill_s: Optional[float] = None
    server_prefill_s: Optional[float] = None
    server_total_s: Optional[float] = None
    # the usage's completion_tokens_details of a request sent with a prediction: its tokens the server kept and those
    # it did not (None: not said)
    prediction_accepted: Optional[int] = None
    prediction_rejected: Optional[int] = None
    fields: dict = field(default_factory=dict)  # a replayed request's other fields, sent as recorded (tools, ...)

    @property
    def mean_itl_s(self) -> Optional[float]:
        return statistics.fmean(self.itl_s) if self.itl_s else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["itl_s"] = [round(x, 6) for x in self.itl_s]
        for k in ("start_s", "ttft_s", "e2e_s"):
            d[k] = None if d[k] is None else round(d[k], 6)
        return d


@dataclass(frozen=True)
class Target:
    """Where requests go and how: the base URL (without /v1), the model id, the request body's fixed part, the
    seconds one read may wait (`timeout_s`) and the seconds a whole request may take (`request_timeout_s`)."""

    url: str
    model: str
    max_tokens: int
    api_key: Optional[str] = None
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = DEFAULT_READ_TIMEOUT_S
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S

    def headers(self) -> dict:
        return {**IDENTITY, **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}

    def body(self, messages: list[dict], prediction: Optional[str] = None, fields: Optional[dict] = None) -> dict:
        """A standard streamed greedy chat completion, with OpenAI's `prediction` when one is given and a replayed
        request's `fields` (tools, tool_choice); non-standard fields only as --extra-body asks."""
        predicted = {"prediction": {"type": "content", "content": prediction}} if prediction else {}
        return {"model": self.model, "messages": messages, **(fields or {}), "max_tokens": self.max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **predicted,
                **self.extra_body}

    def stream_cap(self) -> int:
        """The most bytes one answer's event stream may take: a floor, or a generous allowance per token."""
        return max(STREAM_BYTES_MIN, self.max_tokens * STREAM_BYTES_PER_TOKEN)

    def max_chars(self) -> int:
        """The most content characters an answer of `max_tokens` tokens can have (no token is longer)."""
        return self.max_tokens * MAX_CHARS_PER_TOKEN


def normal_url(url: str) -> str:
    """The server's base URL, http(s)://host[:port][/prefix], without a trailing / or /v1."""
    from urllib.parse import urlsplit

    text = url.strip().rstrip("/")
    if text.endswith("/v1"):
        text = text[:-3]
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as e:
        raise InputError(f"--url {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise InputError(f"--url {url!r}: expected the server's base URL, e.g. http://127.0.0.1:8080")
    return text


def _count(v) -> Optional[int]:
    """A count a server reports (a JSON integer, not a boolean, within 0 .. 2**31), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1 << 31 else None


def _seconds(v) -> Optional[float]:
    """A duration a server reports (a JSON number, not a boolean, within 0 .. a day), else None."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 86400
    return float(v) if ok else None


# -- one answer, streamed ------------------------------------------------------------------------------------------

class _Answer:
    """One streamed answer as its event-stream lines come: the content pieces timed into `result`, and every
    bound of `target` checked on the way. `take(line)` says when reading may stop; a broken bound raises."""

    def __init__(self, target: Target, result: RequestResult, clock: Callable[[], float], t0: float):
        self.target, self.result, self.clock, self.t0 = target, result, clock, t0
        self.parts: list[str] = []
        self.calls: dict[int, dict] = {}  # the answer's tool calls by index: {"name", "arguments"} as streamed
        self.chars = 0
        self.pieces = 0  # content and tool-call pieces streamed
        self.last: Optional[float] = None  # when the last content piece came
        self.end: Optional[float] = None  # when the last event that was no comment came
        self.usage_tokens: Optional[int] = None
        self.done = False  # data: [DONE] came
        self.finished_at: Optional[float] = None  # a choice's finish_reason came
        self.lines_after_finish = 0

    @property
    def complete(self) -> bool:
        return self.done or self.finished_at is not None

    def take(self, raw: bytes) -> bool:
        """One line; True when the answer is over ([DONE], or enough lines after the finish)."""
        if self.finished_at is not None:
            self.lines_after_finish += 1
            if self.lines_after_finish > FINISH_GRACE_LINES:
                return True  # keep-alive pings after the finish: the answer is over, [DONE] or not
        line = raw.decode("utf-8", "replace")
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        self.end = self.clock()
        if data == "[DONE]":
            self.done = True
            return True
        try:
            chunk = json.loads(data)
        except (ValueError, RecursionError):
            raise Refused(f"not JSON in the event stream: {data[:80]!r}") from None
        if isinstance(chunk, dict):
            self._chunk(chunk)
        return False

    def _chunk(self, chunk: dict) -> None:
        r, max_tokens = self.result, self.target.max_tokens
        if chunk.get("error"):
            e = chunk["error"]
            raise Refused("error event: " + brief(str(e.get("message", e) if isinstance(e, dict) else e)))
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
            if self.usage_tokens > max_tokens:
                raise Refused(f"the server counted {self.usage_tokens} completion tokens for max_tokens "
                               f"{max_tokens}")
            r.prompt_tokens = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None
            cached = usage.get("prompt_tokens_details")
            r.cached_tokens = _count(cached.get("cached_tokens")) if isinstance(cached, dict) else None
            details = usage.get("completion_tokens_details")
            if r.prediction and isinstance(details, dict):
                r.prediction_accepted = _count(details.get("accepted_prediction_tokens"))
                r.prediction_rejected = _count(details.get("rejected_prediction_tokens"))
        self._notes(chunk.get("specquant"))
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            content = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(content, str) and content:
                self._piece(content)
            calls = delta.get("tool_calls") if isinstance(delta, dict) else None
            for call in calls if isinstance(calls, list) else []:
                self._call_piece(call)
            if isinstance(choice, dict) and choice.get("finish_reason"):
                r.finish_reason = brief(str(choice["finish_reason"]), 40)
                if self.finished_at is None:
                    self.finished_at = self.clock()

    def _notes(self, info) -> None:
        """A specquant server's notes on the answer: the plan (its first mention), tokens drafted and kept, the
        parent's calls, the prefill's and the answer's seconds (the latest figures). Anything else, or anything of
        another shape, is ignored."""
        if not isinstance(info, dict):
            return
        r = self.result
        if r.plan is None and isinstance(info.get("plan"), str):
            r.plan = brief(info["plan"], 120)
        for k in ("drafted", "accepted", "parent_calls"):
            v = _count(info.get(k))
            if v is not None:
                setattr(r, k, v)
        for k in ("parent_prefill_s", "prefill_s", "total_s"):
            v = _seconds(info.get(k))
            if v is not None:
                setattr(r, "server_" + k, v)

    def _call_piece(self, call) -> None:
        """A piece of a tool call (OpenAI's delta.tool_calls[i]: its index, the function's name and a piece of its
        arguments): timed and bounded as content is, and kept by index."""
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            return
        index = call.get("index") if isinstance(call.get("index"), int) else 0
        name, args = (v if isinstance(v, str) else "" for v in (fn.get("name"), fn.get("arguments")))
        if not (name or args):
            return
        self._timed(len(name) + len(args))
        held = self.calls.setdefault(index, {"name": "", "arguments": ""})
        held["name"] += name
        held["arguments"] += args

    def text(self) -> str:
        """The answer's text: its content, then its tool calls (if any) as the model writes them (Hermes form,
        toolcalls.call_text), so an answer that is a tool call can be compared with the parent's own text."""
        from specquant_cli import toolcalls

        content = "".join(self.parts)
        return toolcalls.written(content, [c for _, c in sorted(self.calls.items())]) if self.calls else content

    def _piece(self, content: str) -> None:
        """A content piece: timed, and held to the bounds (each piece carries at least one token)."""
        self._timed(len(content))
        self.parts.append(content)

    def _timed(self, chars: int) -> None:
        """A piece of the answer came (content or a tool call's): timed, and held to the bounds."""
        r, max_tokens = self.result, self.target.max_tokens
        self.pieces += 1
        if self.pieces > max_tokens:
            raise Refused(f"the server streamed more than {max_tokens} content pieces for max_tokens {max_tokens}")
        self.chars += chars
        if self.chars > self.target.max_chars():
            raise Refused(f"the server streamed over {self.target.max_chars()} characters for max_tokens "
                           f"{max_tokens} (at most {MAX_CHARS_PER_TOKEN} a token)")
        now = self.clock()
        if self.last is None:
            r.ttft_s = now - self.t0
        else:
            r.itl_s.append(now - self.last)
        self.last = now


async def _exchange(client, target: Target, answer: _Answer, scope: asyncio.Timeout) -> None:
    """POST the request and read its event stream line by line into `answer`, until [DONE], the end of the
    stream, or a short grace after the finish (`scope`, the request's deadline, is brought forward to it)."""
    body = target.body(answer.result.messages, answer.result.prediction, answer.result.fields)
    async with client.stream("POST", target.url + "/v1/chat/completions", json=body, headers=target.headers()) as resp:
        if resp.status_code != 200:
            try:
                body, cut = await read_body(resp)
            except Refused as e:
                raise Refused(f"HTTP {resp.status_code}: {e}") from None
            raise Refused(error_text(resp.status_code, body, cut))
        kind = resp.headers.get("content-type", "")
        if not kind.startswith("text/event-stream"):
            raise Refused(f"the answer is no event stream (Content-Type: {brief(kind, 80) or 'none'})")
        lines = Lines()
        graced = False
        async for data in decoded(resp, target.stream_cap(), "the event stream"):
            for line in lines.feed(data):
                if answer.take(line):
                    return
            if answer.finished_at is not None and not graced:
                graced = True  # the finish came: [DONE] (and the usage) may take FINISH_GRACE_S more, no longer
                loop = asyncio.get_running_loop()
                scope.reschedule(min(scope.when(), loop.time() + FINISH_GRACE_S))
        for line in lines.close():
            if answer.take(line):
                return
    if not answer.complete:
        raise Refused("the event stream ended before the answer did (no finish_reason, no [DONE])")


async def stream_chat(client, target: Target, result: RequestResult, clock: Callable[[], float],
                      run_end: Optional[float] = None) -> RequestResult:
    """Send `result.messages` and read the server-sent events, timing each content piece; `result` is filled
    in (ok, or the error that ended it) and returned. Nothing a server does escapes as an exception: every
    broken bound (line, stream size, pieces, characters, tokens), every HTTP error and the request's deadline
    (`target.request_timeout_s` for the whole request, or `run_end` on `clock` when the run ends sooner) is the
    result's error. After the finish the answer is over at [DONE], or FINISH_GRACE_S later at the latest."""
    import httpx

    t0 = clock()
    limit = target.request_timeout_s
    why = f"no full answer within {limit:g} s (the request's deadline)"
    if run_end is not None and run_end - t0 < limit:
        limit, why = max(0.0, run_end - t0), DEADLINE_ERROR
    answer = _Answer(target, result, clock, t0)
    try:
        async with asyncio.timeout(limit) as scope:
            await _exchange(client, target, answer, scope)
    except TimeoutError:  # before OSError: TimeoutError is one
        if not answer.complete:
            result.error = why
    except Refused as e:
        result.error = str(e)
    except (httpx.HTTPError, httpx.StreamError, httpx.InvalidURL, OSError) as e:
        result.error = f"{type(e).__name__}: {brief(str(e))}" if str(e) else type(e).__name__
    finally:
        result.e2e_s = (answer.end if answer.complete and answer.end is not None else clock()) - t0
        result.text = answer.text()
    if result.error is not None:
        return result
    result.ok = True
    result.output_tokens = answer.usage_tokens if answer.usage_tokens is not None else answer.pieces
    result.tokens_from = "usage" if answer.usage_tokens is not None else "chunks"
    return result
