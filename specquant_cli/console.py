"""Where output goes: stdout carries data only; everything for a human goes to the stderr console."""

from __future__ import annotations

import json
import os
import sys

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn


def _width():
    """Terminal width on a terminal; wide enough for the report tables when stderr goes to a file or pipe."""
    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    return None if sys.stderr.isatty() else 160


err = Console(stderr=True, highlight=False, soft_wrap=True, width=_width())


def out(text: str = "", end: str = "\n") -> None:
    sys.stdout.write(text + end)
    sys.stdout.flush()


def out_json(obj: object) -> None:
    out(json.dumps(obj, ensure_ascii=False))


def byte_progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                    console=err, transient=False)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"
