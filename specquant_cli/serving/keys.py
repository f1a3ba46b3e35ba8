"""The API keys a server takes, each a tenant: the `--api-key` ones (checked as settings, settings.check_api_keys),
then the lines of `--api-key-file`, a file that must be a private regular file of this user's (no link), read
bounded. Every refusal is one line that says how to fix it and never shows a key."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from specquant_cli.errors import InputError
from specquant_cli.inputs import decode_file
from specquant_cli.settings import MAX_KEY_FILE_BYTES, SettingError, Settings, check_key, key_list


def api_keys(cfg: Settings) -> tuple[str, ...]:
    """Every API key the server takes, in order: serving.api_key's (checked as resolved), then the lines of
    serving.api_key_file (read_key_file). A key given twice (in both, or twice in the file) is refused naming
    where; errors.InputError, one line, never showing a key."""
    keys = list(key_list(cfg.get("serving.api_key"))) if "serving.api_key" in cfg.values else []
    path = cfg.get("serving.api_key_file") if "serving.api_key_file" in cfg.values else None
    if path is None:
        return tuple(keys)
    where = cfg.stated("serving.api_key_file")
    for line, key in read_key_file(path, where):
        if key in keys:
            raise InputError(f"{where}: line {line} repeats a key of {cfg.given_by('serving.api_key')}; "
                             "give each key once")
        keys.append(key)
    return tuple(keys)


def read_key_file(path: Path, where: Optional[str] = None) -> list[tuple[int, str]]:
    """The keys of an API key file, each with its line number: one key per line (a CRLF ending is taken; blank
    lines and lines whose first non-blank character is # are skipped), each checked (check_key). Refused, with
    how to fix it: a symbolic link (checked before opening, and opened with O_NOFOLLOW), anything but a regular
    file, a file of another user's or one its group or others may read or write, one larger than
    MAX_KEY_FILE_BYTES, one without a key, a key given twice. `where`: the setting as given (Settings.stated;
    default `--api-key-file PATH`), first in the messages (InputError)."""
    where = where or f"--api-key-file {path}"

    def refused(problem: str) -> InputError:
        return InputError(f"{where}: {problem}")

    data = _read_key_bytes(path, refused)
    keys: dict[str, int] = {}
    for n, line in enumerate(decode_file(data, f"{where}:").split("\n"), 1):
        line = line[:-1] if line.endswith("\r") else line
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            key = check_key(line)
        except SettingError as e:
            raise refused(f"line {n}: {e}") from None
        if key in keys:
            raise refused(f"line {n} repeats the key of line {keys[key]}; give each key once")
        keys[key] = n
    if not keys:
        raise refused("has no key; write one key per line (blank lines and lines starting with # are skipped)")
    return [(n, key) for key, n in keys.items()]


def _read_key_bytes(path: Path, refused: Callable[[str], Exception]) -> bytes:
    """The key file's bytes, read only once it is known to be a private regular file of this user's."""
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise refused("is a symbolic link; name the file itself (a link can be pointed elsewhere)")
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags)  # O_NONBLOCK: a FIFO opens at once (and is refused below), never waits
    except FileNotFoundError:
        raise refused("no such file") from None
    except OSError as e:
        raise refused(f"cannot open it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise refused("is a folder; name the key file in it")
        if not stat.S_ISREG(st.st_mode):
            raise refused("is not a regular file; write the keys to one (chmod 600)")
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise refused(f"belongs to another user (uid {st.st_uid}); copy it to a file of yours, chmod 600")
        if st.st_mode & 0o077:
            raise refused(f"group or others may read or write it (mode {st.st_mode & 0o777:03o}); chmod 600 {path}")
        too_big = f"is larger than {MAX_KEY_FILE_BYTES >> 10} KiB; a key file holds one key per line"
        if st.st_size > MAX_KEY_FILE_BYTES:
            raise refused(too_big)
        chunks, left = [], MAX_KEY_FILE_BYTES + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as e:
        raise refused(f"cannot read it ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise refused(too_big)
    return data


# -- the rest of the environment ----------------------------------------------------------------------------------
