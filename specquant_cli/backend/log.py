"""The llama.cpp backend, started once per process (`init_backend`), and where its log goes: a file, stderr or
nowhere (`llama_log_to`, `set_log_file`), a log that cannot be written stopping with one warning line."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from specquant_cli import interrupts
from specquant_cli.errors import InputError

_backend_ready = False
_log_lock = threading.Lock()
_log_file = None  # file object llama.cpp's log goes to, or None to drop it
_log_cb = None  # keep the ctypes callback alive


def init_backend() -> None:
    global _backend_ready, _log_cb
    if _backend_ready:
        return
    import llama_cpp

    @llama_cpp.llama_log_callback
    @interrupts.c_callback  # Ctrl-C here is raised once the callback returns (ctypes would swallow it)
    def cb(level, text, user_data):  # noqa: ARG001
        global _log_file
        f = _log_file
        if f is not None:
            try:
                f.write(text.decode("utf-8", "replace"))
                f.flush()
            except BlockingIOError:  # a pipe nobody drains: this line is dropped, the process goes on
                pass
            except ValueError:  # file closed
                pass
            except OSError as e:  # a full disk, a reader gone: one warning, and the log stops
                _log_file = None
                status_line(f"warning: llama.cpp's log stopped: cannot write to {getattr(f, 'shown', 'it')} "
                        f"({e.strerror or e})")

    _log_cb = cb
    llama_cpp.llama_log_set(_log_cb, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    _backend_ready = True


@contextlib.contextmanager
def llama_log_to(path: Optional[Path]) -> Iterator[None]:
    """Send llama.cpp's own log to `path` (appending) instead of the terminal while the block runs."""
    global _log_file
    init_backend()
    with _log_lock:
        prev = _log_file
        f = open(path, "a", encoding="utf-8") if path else None
        _log_file = f
    try:
        yield
    finally:
        with _log_lock:
            _log_file = prev
            if f:
                f.close()


def log_target_problem(path: Path) -> Optional[str]:
    """Why llama.cpp's log may not go to `path`, or None: never into a family folder (a folder with a manifest)
    nor onto a model file (a GGUF), which appending would destroy."""
    from specquant_cli.names import MANIFEST, RESERVED

    p = Path(os.path.abspath(path))
    real = Path(os.path.realpath(p))
    for candidate in dict.fromkeys([p, real]):
        if candidate.name in RESERVED or candidate.suffix.lower() in (".gguf", ".part"):
            return f"{candidate.name} is a family's file"
        if (candidate.parent / MANIFEST).exists():
            return f"{candidate.parent} is a family folder"
    try:
        with open(real, "rb", opener=lambda f, flags: os.open(f, flags | os.O_NONBLOCK)) as f:
            if real.is_file() and f.read(4) == b"GGUF":
                return f"{real} is a model file"
    except OSError:
        pass
    return None


def set_log_file(path: Path, label: str) -> None:
    """Send llama.cpp's log to `path` (appending) for the rest of the process (the runtime.llama_log setting,
    applied at the command edge; `label` names where it was set, for the error); otherwise it is dropped. Never
    into a family folder or onto a model file; a FIFO without a reader is refused at once, and one whose reader
    stops reading loses lines rather than blocking llama.cpp."""
    global _log_file
    why = log_target_problem(path)
    if why is not None:
        raise InputError(f"{label}: not a place for llama.cpp's log ({why}); name a file elsewhere")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        why = "a pipe nobody reads" if e.errno == errno.ENXIO else e.strerror
        raise InputError(f"{label}: cannot write llama.cpp's log there ({why})") from None
    import stat

    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.set_blocking(fd, True)
    init_backend()
    f = os.fdopen(fd, "a", encoding="utf-8")
    f.shown = os.fspath(path)  # for the warning, whatever the file object calls itself
    with _log_lock:
        previous, _log_file = _log_file, f
    if previous is not None:
        previous.close()


def status_line(line: str) -> None:
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass
