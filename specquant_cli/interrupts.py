"""Signals: SIGTERM is handled like Ctrl-C, and a few short critical sections defer both.

Ctrl-C and SIGTERM raise KeyboardInterrupt in the main thread, so every `finally` (temp files removed,
child processes killed, models freed) runs for both; the CLI edge turns it into exit code 130."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator

DEFERRED = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM: stops like Ctrl-C, but also ends an interactive session (which Ctrl-C does not)."""


_terminated = False


def terminated() -> bool:
    """Whether SIGTERM arrived (an interactive loop checks it, since a stopped answer swallows the interrupt)."""
    return _terminated


_c_callbacks: set = set()  # the code of Python functions that C calls back (c_callback)


def c_callback(fn):
    """Mark `fn` as a function C calls back (llama.cpp's log): an exception raised inside it is swallowed by
    ctypes, so a Ctrl-C or SIGTERM whose handler runs while it, or anything it calls, runs is raised again once
    it has returned (redeliver) rather than inside it."""
    _c_callbacks.add(fn.__code__)
    return fn


def _inside_c_callback(frame) -> bool:
    while frame is not None:
        if frame.f_code in _c_callbacks:
            return True
        frame = frame.f_back
    return False


def _on_int(signum, frame) -> None:
    if _inside_c_callback(frame):
        redeliver(signum)
        return
    raise KeyboardInterrupt()


def _on_term(signum, frame) -> None:
    global _terminated
    _terminated = True
    if _inside_c_callback(frame):
        redeliver(signum)
        return
    raise Terminated()


def install() -> None:
    """Make SIGTERM behave like Ctrl-C, and neither raise inside a function C calls back. Only the main thread
    may install handlers; a SIGINT handler other than Python's own is left alone."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_term)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_int)


def redeliver(signum: int) -> None:
    """Raise the signal again, REDELIVER_S from now, from a helper thread: its handler then runs in the main
    thread at its next Python line, once the function C called back has returned (should that be inside such a
    function again, the handler hands it here again)."""
    def later() -> None:
        time.sleep(REDELIVER_S)
        signal.raise_signal(signum)

    threading.Thread(target=later, name="specquant-redeliver", daemon=True).start()


REDELIVER_S = 0.05


STALL_GRACE_S = 1.5
_watch: dict = {}


def watch_stalls(grace_s: float = STALL_GRACE_S) -> None:
    """For a command whose main thread may wait inside a C call that no signal ends (llama.cpp's wait on an RPC
    worker is a condition wait, which the kernel restarts): Ctrl-C or SIGTERM that Python has not handled within
    `grace_s` ends the process with exit 130 and "interrupted" (the call cannot be resumed or unwound). Python's
    handlers are wrapped to note that they ran; a handler someone installs later (a server's) turns the watch off
    for that signal. Main thread only; once per process."""
    if threading.current_thread() is not threading.main_thread() or _watch:
        return
    import os

    r, w = os.pipe()
    os.set_blocking(w, False)
    handled = {s: 0 for s in DEFERRED}
    wrappers = {}
    for s in DEFERRED:
        inner = signal.getsignal(s)
        if not callable(inner):
            continue

        def wrapper(signum, frame, inner=inner):
            handled[signum] += 1
            return inner(signum, frame)

        wrappers[s] = wrapper
        signal.signal(s, wrapper)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    _watch.update(pipe=(r, w), wrappers=wrappers)

    def watch() -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            for signum in {b for b in data if b in wrappers}:
                if signal.getsignal(signum) is not wrappers[signum]:
                    continue  # someone else's handler has it now (a server's): theirs to handle
                seen = handled[signum]
                time.sleep(grace_s)
                if handled[signum] == seen and signal.getsignal(signum) is wrappers[signum]:
                    os.write(2, b"interrupted\n")
                    os._exit(130)

    threading.Thread(target=watch, name="specquant-signal-watch", daemon=True).start()


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
