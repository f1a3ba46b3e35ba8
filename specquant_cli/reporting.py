"""How core code tells a human something without printing: a `Reporter` handed in by the command layer.

Core modules (runtime, family) never write to stdout or stderr; they call the reporter they were given.
`SILENT` (the default) drops everything; `console.stderr_reporter()` is the command edge's, which prints a
line on the stderr console and shows a transient status line while long work runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Protocol

Say = Callable[[str], None]  # one finished line for a human (a warning, a note)


class Status(Protocol):
    def update(self, text: str) -> None: ...


StatusFn = Callable[[str], AbstractContextManager[Status]]  # a status line shown while the block runs


def silent(line: str) -> None:
    """Says nothing."""


class _NoStatus:
    def update(self, text: str) -> None:
        pass


@contextmanager
def no_status(text: str) -> Iterator[Status]:
    yield _NoStatus()


@dataclass(frozen=True)
class Reporter:
    say: Say = silent
    status: StatusFn = no_status

    def warn(self, text: str) -> None:
        """`text` as a warning line ("warning: …")."""
        self.say(f"warning: {text}")


SILENT = Reporter()
