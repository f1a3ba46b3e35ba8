"""Where output goes: stdout carries data only; everything for a human goes to the stderr console."""

from __future__ import annotations

import errno
import io
import json
import os
import sys

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn


def _width():
    """Terminal width on a terminal; wide enough for the report tables when stderr goes to a file or pipe."""
    from specquant_cli.settings import columns

    fixed = columns()
    if fixed is not None:
        return fixed
    return None if sys.stderr.isatty() else 160


err = Console(stderr=True, highlight=False, soft_wrap=True, width=_width())


def out(text: str = "", end: str = "\n") -> None:
    """Data to stdout. A closed pipe raises BrokenPipeError (the CLI edge stops quietly); any other write
    failure (/dev/full, a closed stdout) is a one-line error."""
    try:
        sys.stdout.write(text + end)
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()
        raise
    except (OSError, ValueError) as e:
        silence_stdout()
        from specquant_cli.errors import SpecquantError

        raise SpecquantError(f"cannot write to stdout ({getattr(e, 'strerror', None) or e})") from None


def silence_stdout() -> None:
    """After stdout failed: point fd 1 at /dev/null, so the interpreter's last flush does not fail again."""
    try:
        fd = sys.stdout.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass


class ClosedStream(io.TextIOBase):
    """Stands in for a stdout that was closed before we started: every write fails cleanly."""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        raise OSError(errno.EBADF, "stdout is closed")


def out_json(obj: object) -> None:
    out(json.dumps(obj, ensure_ascii=False))


def stderr_reporter():
    """The command edge's reporter (reporting.Reporter): lines and the status spinner on the stderr console."""
    from specquant_cli.reporting import Reporter

    return Reporter(say=lambda line: err.print(line, markup=False), status=err.status)


def warn(text: str) -> None:
    """A warning line on the stderr console (family code's `warn` callback at the command edge)."""
    err.print(f"warning: {text}", markup=False)


def byte_progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                    console=err, transient=False)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
