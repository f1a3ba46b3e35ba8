"""Reading what a server sends, bounded: no body is read whole, no line grows without end, no compressed answer
inflates past its cap, and a server's words quoted in an error stay one short line. A broken bound raises
`Refused` (its text is the request's error in bench.load), never something that escapes as a crash."""

from __future__ import annotations

import json
import re

MAX_LINE_BYTES = 1 << 20  # one event-stream line: a token's chunk is a few hundred bytes
MAX_BODY_BYTES = 1 << 20  # a body that is no stream (an error's, GET /v1/models): the rest is not read
INFLATE_STEP = 64 << 10  # a compressed answer is inflated at most this many bytes at a time
MAX_REASON_CHARS = 300  # a server's words quoted in an error
_EOL = re.compile(rb"\r\n|\r|\n")


class Refused(Exception):
    """The server's answer broke a bound or the protocol: the request fails with this text as its error."""


class TooLong(Refused):
    """A body passed its cap (what was read before it is kept by the reader that wants it)."""


def size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n} bytes"


def brief(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """`text` on one line and at most `limit` characters: a server's words in an error stay a line."""
    one = " ".join(text.split())
    return one if len(one) <= limit else one[:limit - 1] + "…"


def decompressor(resp):
    """A zlib decompressor for the answer's Content-Encoding (gzip or deflate, told apart by their first bytes),
    None for an identity answer. Identity is what we ask for; any other encoding is refused, not guessed at."""
    import zlib

    encoding = resp.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip", "deflate"):
        return zlib.decompressobj(32 + zlib.MAX_WBITS)
    raise Refused(f"the answer is encoded as {brief(encoding, 40)!r} (identity was asked for)")


def inflate(d, data: bytes):
    """`data` decompressed in steps of at most INFLATE_STEP bytes: a gzip bomb inflates no further than the reader
    lets it (the rest of its input waits in `unconsumed_tail`, its output is never made)."""
    import zlib

    try:
        out = d.decompress(data, INFLATE_STEP)
        yield out
        while d.unconsumed_tail or len(out) == INFLATE_STEP:  # a full step: there may be more output pending
            out = d.decompress(d.unconsumed_tail, INFLATE_STEP)
            yield out
    except zlib.error as e:
        raise Refused(f"the compressed answer is corrupt ({e})") from None


async def decoded(resp, cap: int, what: str):
    """The answer's body chunk by chunk as the server sends it (decompressed step by step when it is compressed),
    at most `cap` bytes in all: past it `TooLong` is raised, so memory stays bounded whatever the server sends
    and however well it compresses. Never `.read()`: a body is only ever held a chunk at a time."""
    d = decompressor(resp)
    total = 0
    async for raw in resp.aiter_raw():
        for piece in (raw,) if d is None else inflate(d, raw):
            total += len(piece)
            if total > cap:
                raise TooLong(f"{what} passed {size_text(cap)}")
            if piece:
                yield piece


async def read_body(resp, cap: int = MAX_BODY_BYTES) -> tuple[bytes, bool]:
    """The body of an answer that is no stream (an error's, GET /v1/models): at most `cap` bytes, and whether there
    was more (left unread: the connection is closed, not drained)."""
    buf = bytearray()
    try:
        async for piece in decoded(resp, cap, "the body"):
            buf += piece
    except TooLong:
        return bytes(buf), True
    return bytes(buf), False


class Lines:
    """Splits a byte stream into lines (LF, CRLF or CR ended, as server-sent events may be), none longer than
    `limit` bytes: a line that never ends is refused once it passes the limit, not buffered on."""

    def __init__(self, limit: int = MAX_LINE_BYTES):
        self.limit = limit
        self.pending = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        if _EOL.search(data) is None:  # no line ends here: the line so far grows, up to the limit
            self.pending += data
            self._check(len(self.pending))
            return []
        *lines, rest = _EOL.split(bytes(self.pending) + data)
        self.pending = bytearray(rest)
        self._check(max(len(rest), *map(len, lines)))
        return lines

    def close(self) -> list[bytes]:
        """The last line when the stream ended without its line end."""
        rest, self.pending = bytes(self.pending), bytearray()
        return [rest] if rest else []

    def _check(self, n: int) -> None:
        if n > self.limit:
            raise Refused(f"an event-stream line passed {size_text(self.limit)} (no line end)")



def error_text(status: int, body: bytes, cut: bool = False) -> str:
    """`HTTP <status>: <the server's error message>`, on one line and short (of a body cut at its cap, the start)."""
    try:
        err = json.loads(body)["error"]
        message = err["message"] if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError, RecursionError):
        message = body.decode("utf-8", "replace").strip()[:200] or "no body"
    text = f"HTTP {status}: {brief(str(message))}"
    return text + (f" (a body over {size_text(MAX_BODY_BYTES)}, cut)" if cut else "")
