"""The small exception family raised by core code and translated once at the CLI edge."""

import contextlib
import threading
from collections.abc import Iterator


class SpecquantError(Exception):
    """Base of every error meant for the user: one line, no traceback."""


class InputError(SpecquantError):
    """Bad user input: a path, a prompt, an option value."""


class ModelFileError(InputError):
    """A file that is not a usable GGUF model."""


class FamilyError(SpecquantError):
    """A model family that is missing, incomplete or does not match its manifest."""


class ResourceError(SpecquantError):
    """Not enough disk, RAM or VRAM for what was asked."""


class LlamaError(SpecquantError):
    """llama.cpp refused: a failed load, decode or quantize."""


class VocabMismatchError(SpecquantError):
    """A draft model whose vocabulary differs from its parent's."""


class Cancelled(SpecquantError):
    """The request was cancelled (its client left, the server is stopping) while long work ran for it."""


_watched = threading.local()


@contextlib.contextmanager
def cancel_on(event: threading.Event) -> Iterator[None]:
    """While the block runs on this thread, `check_cancelled` raises Cancelled once `event` is set (a serving job's
    cancel flag, seen by a long prefill between its chunks)."""
    previous = getattr(_watched, "event", None)
    _watched.event = event
    try:
        yield
    finally:
        _watched.event = previous


def check_cancelled() -> None:
    event = getattr(_watched, "event", None)
    if event is not None and event.is_set():
        raise Cancelled("cancelled")
