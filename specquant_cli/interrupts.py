"""Signals: SIGTERM is handled like Ctrl-C, and a few short critical sections defer both.

Ctrl-C and SIGTERM raise KeyboardInterrupt in the main thread, so every `finally` (temp files removed,
child processes killed, models freed) runs for both; the CLI edge turns it into exit code 130."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

DEFERRED = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM: stops like Ctrl-C, but also ends an interactive session (which Ctrl-C does not)."""


_terminated = False


def terminated() -> bool:
    """Whether SIGTERM arrived (an interactive loop checks it, since a stopped answer swallows the interrupt)."""
    return _terminated


def _on_term(signum, frame) -> None:  # noqa: ARG001
    global _terminated
    _terminated = True
    raise Terminated()


def install() -> None:
    """Make SIGTERM behave like Ctrl-C. Only the main thread may install handlers."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_term)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM back while the block runs (a few renames, a child's start); they are delivered
    right after it.

    The Python handlers are swapped for ones that only take note, rather than the signals being masked:
    a mask holds only the calling thread, and a signal the process gets lands on any thread that does not
    mask it (a progress display's refresh thread), after which the main thread runs the handler at its next
    bytecode, wherever that is (measured: inside `subprocess.Popen`, after the fork, so the parent lost the
    child it had just started)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in DEFERRED}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: a handler set outside Python
        if got:
            signal.raise_signal(got[0])  # to the original handler (or default action) now
