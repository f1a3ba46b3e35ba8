"""The manifest file read: one JSON object from a regular file, bounded in size, each key given once
(`read_existing`); and how a warning is handed on (`WarnFn`, `silent`)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from specquant_cli.names import MANIFEST

MAX_MANIFEST_BYTES = 16 << 20  # a manifest is a few KiB; anything this large is not one


WarnFn = Callable[[str], None]  # a warning's text (the command edge prints it as "warning: …")


def silent(text: str) -> None:
    pass


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_json_object(path: Path) -> dict:
    """A JSON object from a regular file (not through a symlink); ValueError/OSError otherwise."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ValueError("it is a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    if st.st_size > MAX_MANIFEST_BYTES:
        raise ValueError(f"{st.st_size} bytes, too large for a manifest")
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"), object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 at byte {e.start}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    return data


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json's object_pairs_hook: a key given twice is refused (json.loads would keep the last silently)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def read_existing(root: Path) -> tuple[Optional[dict], Optional[str]]:
    """(manifest, None) when `root` holds a readable manifest object; (None, why) when one is there but
    unusable; (None, None) when there is none."""
    p = Path(root) / MANIFEST
    if not os.path.lexists(p):
        return None, None
    try:
        return read_json_object(p), None
    except (OSError, ValueError) as e:
        return None, str(getattr(e, "strerror", None) or e)
