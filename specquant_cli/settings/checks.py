"""The value checks settings are declared with: a converted value in, the value to use out (or SettingError) —
threads, RPC workers, the parent's rendering, paths, text, API keys, host names and origins."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from specquant_cli.settings.limits import THREADS_PER_CORE, cores
from specquant_cli.settings.setting import SettingError


# -- checks: a converted value in, the value to use out (or SettingError) -------------------------------------------
def check_threads(n: int) -> int:
    """0 (every core: `cores()`) or 1 .. 4 x those cores: more threads only wait on each other (100000 crashes
    llama.cpp)."""
    cores_here = cores()
    if n < 0:
        raise SettingError("expected 0 (every core) or a positive integer")
    if n > THREADS_PER_CORE * cores_here:
        raise SettingError(f"at most {THREADS_PER_CORE * cores_here} threads on this machine "
                           f"({THREADS_PER_CORE} × {cores_here} logical cores)")
    return n


def check_rpc(value: Any) -> list[str]:
    """'HOST:PORT[,HOST:PORT…]' (or a TOML list) -> distinct endpoints; '' (given but empty) is refused: it would
    run the parent here without a word."""
    items = value if isinstance(value, list) else str(value).split(",")
    if not any(str(x).strip() for x in items):
        raise SettingError("no worker given (expected HOST:PORT[,HOST:PORT…]; leave it unset to run the parent here)")
    out = []
    for item in (str(x).strip() for x in items):
        host, sep, port = item.rpartition(":")
        if not item or not sep or not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
            raise SettingError(f"{item!r}: expected HOST:PORT[,HOST:PORT…] (e.g. 127.0.0.1:50052)")
        if item not in out:
            out.append(item)
    seen: dict[tuple[str, int], str] = {}
    for item in out:  # one worker under two names would be two connections to a server that takes one: a hang
        host, _, port = item.rpartition(":")
        addr = (_resolve(host.strip("[]")), int(port))
        if addr in seen:
            raise SettingError(f"{seen[addr]} and {item} name one worker ({addr[0]}:{addr[1]}); give each once")
        seen[addr] = item
    return out


def _resolve(host: str) -> str:
    """The IPv4 address `host` names (ggml's RPC client resolves the same way), or `host` when it resolves to none."""
    import socket

    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError, IndexError):
        return host


PARENT_CHOICES = ("fastest", "f16", "bf16")


def check_parent(value: Any) -> str:
    """The parent's rendering as asked: fastest, f16 or bf16."""
    v = str(value).strip().lower()
    if v not in PARENT_CHOICES:
        raise SettingError(f"{value!r}: one of {', '.join(PARENT_CHOICES)}")
    return v


def check_path(value: Any) -> Optional[Path]:
    text = str(value)
    if not text or "\0" in text:
        raise SettingError("expected a path")
    return Path(text)


def check_text(value: Any) -> str:
    text = str(value)
    if "\0" in text:
        raise SettingError("a NUL character is no text")
    return text


def check_key(key: Any) -> str:
    """One API key: printable ASCII, nothing around it. An empty key, one with a space or newline at an end (a
    copy-paste slip that no client sends back) or with a control or non-ASCII character is refused, never
    trimmed: the key a client sends must be the key as written. The message never shows the key."""
    if not isinstance(key, str):
        raise SettingError(f"expected a string key, not {type(key).__name__}")
    if not key:
        raise SettingError("an empty key is no key (leave the setting unset for none)")
    if key.strip() != key:
        raise SettingError("the key has leading or trailing whitespace; remove it")
    if not key.isascii():
        raise SettingError("the key has a non-ASCII character (a key is printable ASCII)")
    if not key.isprintable():
        raise SettingError("the key has a control character (a key is printable ASCII)")
    return key


def check_api_keys(value: Any) -> Any:
    """serving.api_key: one key (a string: the key) or several (a repeated --api-key, a TOML array: their list,
    in order), each checked (check_key); a key given twice is refused."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise SettingError("no key given (an empty list; leave the setting unset for none)")
    keys: list[str] = []
    for i, item in enumerate(items, 1):
        try:
            key = check_key(item)
        except SettingError as e:
            raise SettingError(f"key {i} of {len(items)}: {e}" if len(items) > 1 else str(e)) from None
        if key in keys:
            raise SettingError(f"key {i} repeats key {keys.index(key) + 1}; give each key once")
        keys.append(key)
    return keys if isinstance(value, list) else keys[0]  # a list stays one (a repeated flag of one use too)


def key_list(value: Any) -> tuple[str, ...]:
    """serving.api_key's resolved value as a tuple of keys (() when unset)."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def check_positive_seconds(value: float) -> float:
    if value <= 0:
        raise SettingError("expected seconds above 0")
    return value


def check_log_path(value: Any) -> Optional[Path]:
    return check_path(value) if str(value) else None


def check_host_names(value: Any) -> list[str]:
    items = value if isinstance(value, list) else str(value).split(",")
    names = list(dict.fromkeys(str(x).strip().lower() for x in items if str(x).strip()))
    if not names:
        raise SettingError("no name given")
    for n in names:
        if n != "*" and (not n.isascii() or any(c in n for c in "/:@ \t[]") or n.startswith(".")):
            raise SettingError(f"{n!r} is not a host name")
    return names


def check_origins(value: Any) -> list[str]:
    from specquant_cli.inputs import normal_origin

    items = value if isinstance(value, list) else str(value).split(",")
    origins = list(dict.fromkeys(str(x).strip() for x in items if str(x).strip()))
    if not origins:
        raise SettingError("no origin given")
    for o in origins:
        if o != "*" and normal_origin(o) is None:
            raise SettingError(f"{o!r} is not an origin (scheme://host[:port], e.g. http://localhost:3000)")
    return [o if o == "*" else normal_origin(o) for o in origins]
