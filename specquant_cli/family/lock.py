"""A family's lock: flock on `.specquant.lock` in its folder (the kernel drops it when its holder dies), taken
once per process and thread (`family_lock`); `LockUnavailable` while another holds it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from specquant_cli.errors import FamilyError
from specquant_cli.names import LOCK

# -- the family's lock: held while committing (and by quantize for its whole run) -----------------------
_held: dict[tuple, list] = {}  # (dev, inode, thread) of a lock file this process holds -> [fd, depth]
_held_guard = threading.Lock()
class LockUnavailable(FamilyError):
    """The lock file cannot be opened (a read-only folder): no update can be made here, nor be under way
    from this user."""


_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _open_lock(root: Path) -> int:
    path = root / LOCK
    try:
        fd = os.open(path, _LOCK_FLAGS, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FamilyError(f"{path} is a symbolic link; refusing to lock through it (remove it)") from None
        try:  # a read-only folder: an existing lock file can still be locked
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            raise LockUnavailable(f"{root}: cannot open the family's lock {LOCK} ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FamilyError(f"{path} is not a regular file; remove it")
    return fd


def _same_inode(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _acquire(root: Path) -> tuple[tuple, bool]:
    """(key, taken now) for the family's lock; FamilyError when another process holds it."""
    for _ in range(64):
        fd = _open_lock(root)
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, threading.get_ident())
        with _held_guard:
            if key in _held:  # this thread holds it already: re-entrant
                os.close(fd)
                _held[key][1] += 1
                return key, False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FamilyError(f"{root} is being updated by another process (it holds {LOCK}); "
                                  "try again when it has finished") from None
            raise FamilyError(f"{root}: cannot lock the family ({e.strerror})") from None
        if _same_inode(fd, root / LOCK):  # not a file its last holder removed while we opened it
            with _held_guard:
                _held[key] = [fd, 1]
            return key, True
        os.close(fd)
    raise FamilyError(f"{root}: cannot lock the family (its lock file keeps changing)")


def _release(root: Path, key: tuple) -> None:
    with _held_guard:
        entry = _held[key]
        entry[1] -= 1
        if entry[1]:
            return
        del _held[key]
    with contextlib.suppress(OSError):  # removed while held, so a folder is left as it was found
        os.unlink(root / LOCK)
    os.close(entry[0])  # the kernel releases the lock here, as it does when its holder dies, however


@contextlib.contextmanager
def family_lock(root: Path) -> Iterator[None]:
    """Hold the family folder's update lock (flock on its .specquant.lock, re-entrant within a thread).
    FamilyError when another process holds it. The kernel releases it when its holder dies."""
    root = Path(root)
    key, _ = _acquire(root)
    try:
        yield
    finally:
        _release(root, key)
