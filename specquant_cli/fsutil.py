"""Atomic writes and hashing: no partial file is ever left under its final name."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path


def temp_path_for(final: Path) -> Path:
    return final.with_name(f".{final.name}.{os.getpid()}.part")


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside `final`; rename it into place only if the block succeeds."""
    final = Path(final)
    tmp = temp_path_for(final)
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_json_atomic(path: Path, data: object) -> None:
    with atomic_path(Path(path)) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
