"""Reading prompts: when stdin is read, and UTF-8 checking."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Optional
from urllib.parse import urlsplit

from specquant_cli.errors import InputError

UTF8_BOM = b"\xef\xbb\xbf"


def decode_input(data: bytes, what: str = "input") -> str:
    """Input must be UTF-8: invalid bytes are refused (not replaced), so no prompt is silently altered."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{what} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                         "convert it first, e.g. with iconv -t UTF-8") from None


def decode_file(data: bytes, what: str) -> str:
    """A file the program reads for itself (a config, a key file) as UTF-8 (decode_input), refusing a leading
    UTF-8 byte-order mark by name: TOML and a key file take none, and left in it would be a character of the
    first key or a syntax error at line 1, column 1. Prompts keep theirs (decode_input: the text as given)."""
    if data.startswith(UTF8_BOM):
        raise InputError(f"{what} starts with a UTF-8 byte-order mark; save it without one")
    return decode_input(data, what)


def check_text(value: str, what: str) -> str:
    """An argument must be UTF-8 too: the shell hands undecodable bytes over as surrogates, refused here."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        decode_input(value.encode("utf-8", "surrogateescape"), what)
        raise InputError(f"{what} is not valid UTF-8") from None
    return value


def stdin_is_tty() -> bool:
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


def read_stdin() -> str:
    if sys.stdin is None:
        raise InputError("stdin is closed; give the prompt as an argument")
    stream = getattr(sys.stdin, "buffer", None)
    try:
        data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8")
    except OSError as e:
        raise InputError(f"cannot read stdin ({e.strerror})") from None
    return decode_input(data, "stdin")


def read_line() -> str:
    """One line of stdin for an interactive session, without its newline. EOFError at the end; InputError
    (the session goes on) for a line that is not UTF-8."""
    if sys.stdin is None:
        raise EOFError
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:
        return input()
    raw = stream.readline()
    if not raw:
        raise EOFError
    return decode_input(raw.rstrip(b"\n").rstrip(b"\r"), "that line")


def read_prompt(args: Optional[Sequence[str]], allow_empty: bool = False) -> str:
    """The prompt from PROMPT arguments. The rule (documented in the README): stdin is read when no
    argument is given, or where an argument is '-'; a prompt given as an argument never waits on a pipe,
    so a shell `while read` loop gets one answer per line. Arguments are joined by blank lines."""
    args = list(args or [])
    if not args:
        args = ["-"]
    parts, stdin_text = [], None
    for a in args:
        if a == "-":
            if stdin_text is None:
                stdin_text = read_stdin()
            parts.append(stdin_text)
        else:
            parts.append(check_text(a, "the PROMPT argument"))
    text = "\n\n".join(p.strip("\n") for p in parts if p.strip())
    if not text.strip() and not allow_empty:
        raise InputError("empty prompt: give PROMPT or pipe text on stdin")
    return text


def normal_origin(origin: str) -> Optional[str]:
    """'scheme://host[:port]' of an Origin value (lower case, http(s) default ports dropped), None when it is no
    origin (`null`, a path, no host). Any scheme with a host is one: a browser extension's page
    (`chrome-extension://ID`) or an app's webview can be allowed by name, not only with `*`."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    if not parts.scheme or not parts.hostname or parts.path not in ("", "/") or \
            parts.query or parts.fragment or parts.username or parts.password:
        return None
    if parts.scheme not in ("http", "https"):
        return f"{parts.scheme}://{parts.netloc.lower()}"
    host = parts.hostname.lower()
    host = f"[{host}]" if ":" in host else host
    default = {"http": 80, "https": 443}[parts.scheme]
    return f"{parts.scheme}://{host}" + (f":{port}" if port not in (None, default) else "")
