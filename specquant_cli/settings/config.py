"""The config file: specquant.toml read, bounded in size and depth (`read_config`), and its setting tables checked
against the declarations (`read_toml`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Optional

from specquant_cli.settings.limits import CONFIG_NAME, MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH
from specquant_cli.settings.table import settings_table


def read_config(path: Optional[Path], cwd: Optional[Path] = None) -> tuple[dict, Optional[Path]]:
    """The parsed TOML of `path` (--config), else of ./specquant.toml when present: (tables, file); ({}, None)
    when there is none. The one reader of the file: the settings' tables and the router's come from it. Bounded:
    at most MAX_CONFIG_BYTES are read (a device such as /dev/zero is refused, a pipe read that far), a UTF-8
    byte-order mark is named, and nesting deeper than MAX_CONFIG_DEPTH is one line, not a RecursionError."""
    import tomllib

    from specquant_cli.errors import InputError
    from specquant_cli.inputs import decode_file

    if path is None:
        candidate = (cwd or Path.cwd()) / CONFIG_NAME
        if not candidate.is_file():
            return {}, None
        path = candidate
    raw = _read_config_bytes(Path(path))
    text = decode_file(raw, f"config {path}")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{path}: not valid TOML ({e})") from None
    except RecursionError:
        data = None
    if data is None or _depth(data) > MAX_CONFIG_DEPTH:
        raise InputError(f"{path}: tables and arrays nest deeper than {MAX_CONFIG_DEPTH} levels; a config is a "
                         "few flat tables")
    return data, Path(path)


def _read_config_bytes(path: Path) -> bytes:
    """The config file's bytes, at most MAX_CONFIG_BYTES: a regular file or a pipe (`--config <(...)`); a
    device or socket is no config."""
    from specquant_cli.errors import InputError

    try:
        st = os.stat(path)
        mode = st.st_mode
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
            kind = "character device" if stat.S_ISCHR(mode) else "block device" if stat.S_ISBLK(mode) else "socket"
            raise InputError(f"{path}: is a {kind}, not a config file; name a TOML file")
        if stat.S_ISREG(mode) and st.st_size > MAX_CONFIG_BYTES:
            raise InputError(_too_big(path))
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise InputError(f"{path}: no such config file") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read config ({e.strerror})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise InputError(_too_big(path))
    return raw


def _too_big(path: Path) -> str:
    return f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB; a config file is a few settings"


def _depth(data: Any) -> int:
    """How deep tables and arrays nest in `data` (the document is level 1), counted without recursion; stops
    counting past MAX_CONFIG_DEPTH."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, level = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_CONFIG_DEPTH:
            break
        stack.extend((c, level + 1) for c in children)
    return deepest


def read_toml(path: Optional[Path], cwd: Optional[Path] = None) -> tuple[dict, Optional[Path]]:
    """The setting tables of the config file (read_config): ({branch: {name: value}}, file). Tables that are no
    settings branch (the router's) are left to their readers."""
    from specquant_cli.errors import InputError

    data, path = read_config(path, cwd)
    branches = {s.branch for s in settings_table().values()}
    out = {}
    for branch in branches & set(data):
        table = data[branch]
        if not isinstance(table, dict):
            raise InputError(f"{path}: {branch} must be a table ([{branch}]), not {type(table).__name__}")
        known = {s.name for s in settings_table().values() if s.branch == branch}
        for name in table:
            if name not in known:
                raise InputError(f"{path}: unknown setting {branch}.{name} (known: {', '.join(sorted(known))})")
        out[branch] = table
    return out, path
