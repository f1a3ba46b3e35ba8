"""Writes that cannot lose data: no partial file is ever left under its final name, and no good file is
removed or truncated before its replacement is complete.

A write goes to a temporary file created exclusively beside its target (`O_CREAT|O_EXCL|O_NOFOLLOW`, a
unique name: `.NAME.PID.RANDOM.part`, so a symlink planted there is never followed), is flushed and
fsynced, renamed over the target, and the folder is fsynced. Temp files left by a process that died
(SIGKILL, power loss) carry its pid, and `remove_stale` deletes them on the next run.

Reads of a path the user names go through one door (`read_input_file`, or `check_input_file` before a reader that
opens the path itself): only a regular file is read, and a FIFO, a device, a socket or a folder is one line naming
what it is, never a read that blocks. `fingerprint` is the cheap content check of a family's files (a few MiB read
at fixed offsets), `sha256_file` the full one."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from specquant_cli.errors import InputError

# .NAME.PID.RANDOM.part (and the older .NAME.PID.part), and the fetch work folders .fetch-PID-XXXX. NAME is
# matched lazily: a RANDOM of 8 decimal digits (1 in 43) is not a PID, nor is the PID part of NAME.
TEMP_RE = re.compile(r"^\.(?P<name>.+?)\.(?P<pid>\d+)(?:\.[0-9a-f]{8})?\.part$")
WORKDIR_RE = re.compile(r"^\.fetch-(?P<pid>\d+)-")
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def temp_name(final_name: str) -> str:
    return f".{final_name}.{os.getpid()}.{secrets.token_hex(4)}.part"


def create_temp(final: Path, mode: int = 0o666) -> tuple[int, Path]:
    """Create a new, empty temp file beside `final` (`mode`, less the umask): (open fd, path). Never opens an
    existing file or link."""
    final = Path(final)
    for _ in range(64):
        tmp = final.with_name(temp_name(final.name))
        try:
            return os.open(tmp, _CREATE, mode), tmp
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, f"no free temporary name beside {final}")


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (best effort: some file systems cannot fsync a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_temp(tmp: Path, final: Path) -> None:
    """fsync the finished temp file, rename it over `final`, fsync the folder."""
    fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(Path(final).parent)


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield the path of a new, exclusively created temp file beside `final` (for writers that open a path
    themselves); it is fsynced and renamed into place only if the block succeeds, and removed otherwise."""
    final = Path(final)
    remove_stale(final.parent, final.name)
    fd, tmp = create_temp(final)
    os.close(fd)
    try:
        yield tmp
        commit_temp(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def atomic_open(final: Path, mode: str = "w", perms: int = 0o666) -> Iterator:
    """A file object over the exclusively created temp fd (never reopened by name, made with `perms` less the
    umask: 0o600 for a private file); committed on success."""
    final = Path(final)
    remove_stale(final.parent, final.name)
    fd, tmp = create_temp(final, perms)
    try:
        with open(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_bytes_atomic(path: Path, data: bytes, mode: int = 0o666) -> None:
    with atomic_open(Path(path), "wb", mode) as f:
        f.write(data)


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_open(Path(path), "w") as f:
        f.write(text)


def write_json_atomic(path: Path, data: object) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return True


def remove_stale(folder: Path, name: Optional[str] = None) -> list[Path]:
    """Delete temp files (and fetch work folders) that processes no longer alive left in `folder`.

    With `name`, only the temp files of that target. A symlink is removed as a link, never followed."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for e in entries:
        m = TEMP_RE.match(e.name) or (None if name else WORKDIR_RE.match(e.name))
        if not m or (name is not None and m.groupdict().get("name") != name) or pid_alive(int(m.group("pid"))):
            continue
        p = Path(e.path)
        try:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
        except FileNotFoundError:
            continue
        except OSError:
            continue  # not ours to remove (permissions): leave it
    return removed


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name the same file (same inode, or the same resolved path when one is missing)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def check_folder_writable(folder: Path, what: str, create: bool = False) -> Path:
    """A folder we can create files in, with a one-line error naming the option (`what`) otherwise."""
    why = folder_problem(folder, create)
    if why:
        raise InputError(f"{what} {folder}: {why}")
    return Path(folder)


def folder_problem(folder: Path, create: bool = False) -> Optional[str]:
    """Why `folder` is no folder we can create files in (made first, with its parents, when `create`), else None.
    os.path's tests, which read any error as "no": a name too long for the OS is then one the folder cannot be
    created under, not an OSError."""
    folder = Path(folder)
    if os.path.exists(folder) and not os.path.isdir(folder):
        return "not a folder"
    if not os.path.isdir(folder):
        if not create:
            return "no such folder"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return f"cannot create the folder ({e.strerror})"
    try:
        fd, probe = create_temp(folder / "write-probe")
    except OSError as e:
        return f"not writable ({e.strerror})"
    os.close(fd)
    probe.unlink()
    return None


def check_output_file(path: Path, what: str) -> None:
    """An output file path that can be written: its folder exists and is writable, and it is not a folder."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{what} {path}: is a folder, not a file")
    parent = path.parent
    if not parent.exists():
        raise InputError(f"{what} {path}: folder {parent} does not exist")
    if not parent.is_dir():
        raise InputError(f"{what} {path}: {parent} is not a folder")
    try:
        fd, probe = create_temp(path)
    except OSError as e:
        raise InputError(f"{what} {path}: cannot write in {parent} ({e.strerror})") from None
    os.close(fd)
    probe.unlink()


def open_append_nofollow(path: Path, what: str) -> int:
    """An fd appending to `path`, refusing a symlink there (which could point at any file the user owns)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InputError(f"{what} {path} is a symbolic link; refusing to write through it (remove it)") \
                from None
        raise InputError(f"{what} {path}: cannot open it for writing ({e.strerror})") from None


# -- input files: one way every path the user names is opened --------------------------------------------------------
def kind_of(mode: int) -> str:
    """What a file of `mode` is, as a message names it ("a FIFO", "a folder", …); "a regular file" for one."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def input_problem(path: Path, kind: str = "file") -> Optional[str]:
    """Why `path` (links followed) is no regular file to read as a `kind`, e.g. "is a FIFO, not a GGUF file" or
    "no such file"; None for a regular file. Only stat: a FIFO or a device is never opened, so nothing blocks."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "no such file" + (" (a symbolic link to nowhere)" if os.path.islink(path) else "")
    except OSError as e:
        return f"cannot read it ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return f"is {kind_of(st.st_mode)}, not a {kind}"
    return None


def check_input_file(path: Path, what: str, kind: str = "file") -> Path:
    """`path` when it names a regular file (links followed), else InputError "WHAT PATH: is a FIFO, not a KIND"."""
    why = input_problem(path, kind)
    if why:
        raise InputError(f"{what} {path}: {why}".lstrip())
    return Path(path)


def read_input_file(path: Path, what: str, kind: str = "file", limit: Optional[int] = None) -> bytes:
    """The bytes of the regular file `path` (at most `limit`, and one more to tell a larger file): opened without
    blocking (O_NONBLOCK: a FIFO named here opens at once) and checked on its descriptor, so a FIFO, a device, a
    socket or a folder is refused in one line naming what it is, never read or waited on."""
    label = f"{what} {path}".lstrip()
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        why = input_problem(path, kind) or f"cannot read it ({e.strerror})"
        raise InputError(f"{label}: {why}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(f"{label}: is {kind_of(mode)}, not a {kind}")
        with open(fd, "rb", closefd=False) as f:
            return f.read() if limit is None else f.read(limit + 1)
    except OSError as e:
        raise InputError(f"{label}: cannot read it ({e.strerror})") from None
    finally:
        os.close(fd)


# The longest file name a family writes: its temp file (fsutil.temp_name: '.NAME.PID.RANDOM.part') must fit the
# file system's 255 bytes too.
MAX_NAME_BYTES = 255 - len(".") - len(f".{2**22}.{'0' * 8}.part")


def fit_name(name: str) -> str:
    """`name`, or, when it is too long for a file and its temp file (MAX_NAME_BYTES), its start and a short digest
    of the whole name, its extension kept: a long input name still gives a family file, one per input name."""
    raw = os.fsencode(name)
    if len(raw) <= MAX_NAME_BYTES:
        return name
    stem, dot, ext = name.rpartition(".") if "." in name[1:] else (name, "", "")
    tail = f"-{hashlib.sha256(raw).hexdigest()[:12]}{dot}{ext}"
    keep = os.fsencode(stem)[:MAX_NAME_BYTES - len(os.fsencode(tail))]
    return keep.decode("utf-8", "ignore") + tail


# -- content fingerprints: a cheap check that a file is the one recorded ---------------------------------------------
FINGERPRINT_HEAD = 1 << 20  # the first MiB (a GGUF's header and metadata, most of them whole)
FINGERPRINT_BLOCKS = 32  # blocks at fixed offsets spread over the rest, the last one ending at the end
FINGERPRINT_BLOCK = 64 << 10
FINGERPRINT_SCHEME = "sampled-sha256-v1"


def fingerprint(path: Path) -> str:
    """A cheap content fingerprint of a file: the sha256 of its size, its first MiB and FINGERPRINT_BLOCKS blocks of
    64 KiB at offsets fixed by its size (evenly spread, the last one ending at the file's end): 3 MiB read at most,
    milliseconds even for a 3 GB model. It changes with any rewrite of the file that reaches a sampled block (a
    download or quantization written over it, a truncation, most edits), whatever its modification time says; the full
    check is sha256_file (doctor --verify). Cached per file state (device, inode, size, mtime, ctime: a write changes
    ctime, which no user can set back)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if key in _fingerprints:
            return _fingerprints[key]
        size = st.st_size
        h = hashlib.sha256(f"{FINGERPRINT_SCHEME}:{size}:".encode())
        h.update(os.pread(f.fileno(), min(size, FINGERPRINT_HEAD), 0))
        rest = size - FINGERPRINT_HEAD
        if rest > 0:
            span = max(0, rest - FINGERPRINT_BLOCK)
            for i in range(FINGERPRINT_BLOCKS):
                offset = FINGERPRINT_HEAD + span * i // (FINGERPRINT_BLOCKS - 1)
                h.update(os.pread(f.fileno(), min(FINGERPRINT_BLOCK, size - offset), offset))
    if len(_fingerprints) >= 256:
        _fingerprints.clear()
    _fingerprints[key] = h.hexdigest()
    return _fingerprints[key]


_fingerprints: dict[tuple, str] = {}


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
