"""The prompt cache: sequence states (`llama_state_seq_get_data`) kept in host RAM under a byte budget when a
sequence is about to be reused for another prompt, least recently used out (`PromptCache`); optionally written to a
private folder (`--cache-dir`) that a later server reads back, each entry tagged with the parent's weights, the build
and the context (`cache_tag`) and signed with the user's key (`user_key`), so an entry of another model, build,
context or user is refused."""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import hashlib
import hmac
import json
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specquant_cli.backend.llama import common_prefix

ENTRY_OVERHEAD = 256  # bytes of bookkeeping per cached state
MAGIC = b"SQPC3\n"  # a cache file's first bytes (3: entries carry their scope)
SUFFIX = ".sqpc"
MAX_HEAD = 4096  # bytes of a cache file's header line
KEY_FILE = "prompt-cache.key"  # in the user's cache folder: the key a cache file's MAC is made with
LOCK_FILE = ".lock"  # in a cache folder: held while a server writes or prunes it
SPARSE_SLACK = 1 << 20  # bytes a file's length may exceed its blocks on disk before it counts as sparse
MAX_NAMED = 5  # refused cache files named in the start-up warning


@dataclass
class Entry:
    """One cached parent sequence: the tokens it held, its state as llama.cpp serialized it, and the scope it
    belongs to (a tenant, narrowed by a cache_salt): only a request of that scope may take it."""

    tokens: array.array  # 'i': 4 bytes a token
    state: ctypes.Array
    size: int  # bytes of `state`
    scope: str = ""

    @property
    def nbytes(self) -> int:
        return self.size + 4 * len(self.tokens) + ENTRY_OVERHEAD


class PromptCache:
    """Parent sequence states in host RAM, keyed by their scope and tokens, least recently used out, never above
    `budget` bytes. `tag` names what a state is valid for (parent weights, llama.cpp build, context size).

    With a `directory` (made private: 0700, files 0600, never through a link) every entry is also written there
    (`write_behind`: by a writer thread of its own, the caller not waiting), and read back at start, newest first
    while the RAM budget lasts. The folder as a whole stays within `disk_budget` bytes: after every write, and at
    start, its oldest files go first (whoever wrote them: servers sharing the folder prune it together, under a
    lock). A file is refused, and named, when it is not a regular file, is sparse (its bytes on disk fewer than its
    size), was written for another tag, or does not check out with `key` (its MAC: user_key, private to the user;
    another key means the key file changed)."""

    def __init__(self, budget: int, tag: str, directory: Optional[Path] = None, report=None,
                 key: Optional[bytes] = None, disk_budget: Optional[int] = None, write_behind: bool = False):
        self.budget = max(0, int(budget))
        self.disk_budget = self.budget if disk_budget is None else max(0, int(disk_budget))
        self.tag = tag
        self.directory = directory
        self.key = key if key is not None else os.urandom(32)
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # oldest first
        self._next = 0
        self._lock = threading.Lock()
        self.bytes = 0
        self.counts = {"hits": 0, "misses": 0, "evictions": 0, "refused_files": 0, "pruned_files": 0}
        # `write_behind` (a server): entries go to the folder from one writer thread, so a request does not wait
        # for the disk (a 2,400-token state of the 1.5B parent is 69 MB, 0.6-0.8 s to write and sync on this VM,
        # paid before the next turn's prefill when a slot gives it up); `flush` waits for those still pending
        self.write_behind = write_behind
        self._pending: list[Entry] = []
        self._writing = False
        self._written = threading.Condition(threading.Lock())
        self._writer: Optional[threading.Thread] = None
        if directory is not None:
            self._read_folder(report)

    # -- lookup and store ------------------------------------------------------------------------
    def best(self, tokens: Sequence[int], scope: str = "") -> tuple[Optional[Entry], int]:
        """The entry of `scope` sharing the longest prefix with `tokens`, and that length (`use` it to keep it
        longer)."""
        with self._lock:
            found, n = None, 0
            for e in self._entries.values():
                k = common_prefix(e.tokens, tokens) if e.scope == scope else 0
                if k > n:
                    found, n = e, k
            return found, n

    def use(self, entry: Entry) -> None:
        """`entry` was restored: it becomes the most recently used (a hit)."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e is entry]:
                self._entries.move_to_end(key)
            self.counts["hits"] += 1

    def covers(self, tokens: Sequence[int], scope: str = "") -> bool:
        """Whether an entry of `scope` already holds all of `tokens` (as its prefix)."""
        with self._lock:
            return any(e.scope == scope and len(e.tokens) >= len(tokens) and
                       common_prefix(e.tokens, tokens) == len(tokens) for e in self._entries.values())

    def put(self, tokens: Sequence[int], state: tuple[ctypes.Array, int], scope: str = "") -> bool:
        """Keep `state` (a sequence of `scope` holding `tokens`), evicting the least recently used entries to stay
        within the budget; an entry of the scope whose tokens are a prefix of these goes (this one holds it all).
        False when it alone is over the budget."""
        buf, size = state
        entry = Entry(array.array("i", tokens), buf, size, scope)
        if entry.nbytes > self.budget:
            return False
        with self._lock:
            for key in [k for k, e in self._entries.items() if e.scope == scope and
                        len(e.tokens) <= len(tokens) and common_prefix(e.tokens, tokens) == len(e.tokens)]:
                self._drop(key)
            self._make_room(entry.nbytes)
            self._add(entry)
        if self.directory is not None and self.write_behind:
            self._enqueue(entry)
        elif self.directory is not None:
            self._write(entry)
        return True

    def discard(self, entry: Entry) -> None:
        """Drop `entry` (llama.cpp refused its state, or it did not hold what it said)."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e is entry]:
                self._drop(key)

    def _add(self, entry: Entry) -> None:
        self._entries[self._next] = entry
        self._next += 1
        self.bytes += entry.nbytes

    def _make_room(self, nbytes: int) -> None:
        while self.bytes + nbytes > self.budget and self._entries:
            self._drop(next(iter(self._entries)))
            self.counts["evictions"] += 1

    def _drop(self, key: int) -> None:
        """Out of RAM; its file (if any) stays until the folder's budget prunes it."""
        self.bytes -= self._entries.pop(key).nbytes

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def status(self) -> dict:
        with self._lock:
            return {"enabled": True, "budget_bytes": self.budget, "bytes": self.bytes, "entries": len(self._entries),
                    **{k: v for k, v in self.counts.items()},
                    "dir": str(self.directory) if self.directory is not None else None,
                    "disk_budget_bytes": self.disk_budget if self.directory is not None else None}

    # -- the folder ------------------------------------------------------------------------------
    def _enqueue(self, entry: Entry) -> None:
        """`entry` to the folder, written by the writer thread (started on the first)."""
        with self._written:
            self._pending.append(entry)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_pending, name="prompt-cache-writer", daemon=True)
                self._writer.start()
            self._written.notify_all()

    def _write_pending(self) -> None:
        while True:
            with self._written:
                while not self._pending:
                    self._written.wait()
                entry, self._writing = self._pending.pop(0), True
            try:
                self._write(entry)
            except Exception:  # noqa: BLE001 - the RAM entry stands; the folder only loses this one
                pass
            finally:
                with self._written:
                    self._writing = False
                    self._written.notify_all()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every entry put so far is in the folder (or failed to be written); False when `timeout`
        seconds passed first."""
        with self._written:
            return self._written.wait_for(lambda: not self._pending and not self._writing, timeout)

    def pending(self) -> int:
        """Entries not yet written to the folder."""
        with self._written:
            return len(self._pending) + self._writing

    def _write(self, e: Entry) -> None:
        """The entry as one private file (header line, tokens, state, then their MAC), written whole or not at
        all; then the folder is pruned to its budget."""
        from specquant_cli.fsutil import write_bytes_atomic

        head = json.dumps({"tag": self.tag, "scope": e.scope, "tokens": len(e.tokens), "state": e.size}).encode()
        body = MAGIC + head + b"\n" + e.tokens.tobytes() + bytes(memoryview(e.state)[:e.size])
        mac = hmac.new(self.key, body, hashlib.sha256).digest()
        if len(body) + len(mac) > self.disk_budget:
            return  # the folder could not keep it
        try:
            with folder_lock(self.directory):
                write_bytes_atomic(self.directory / f"{mac.hex()[:32]}{SUFFIX}", body + mac, mode=0o600)
                self._prune()
        except OSError:
            return  # the RAM entry stands; the folder only loses it

    def _prune(self) -> None:
        """Make the folder hold at most its budget: files that are no cache file at all (a link, not a regular file,
        sparse) go first, then the oldest (any server's, any key's). Called under folder_lock."""
        files = _cache_files(self.directory)
        total = sum(size for _, size, _, problem in files if problem is None)
        for path, size, _, problem in sorted(files, key=lambda f: f[3] is None):  # the stable sort keeps the age
            if problem is None and total <= self.disk_budget:
                break
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            total -= size if problem is None else 0
            self.counts["pruned_files"] += 1

    def _read_folder(self, report) -> None:
        """Entries of the folder, newest first, while the RAM budget lasts; files refused are named in one
        warning, with why. Then the folder is pruned to its budget."""
        refused: list[str] = []
        try:
            with folder_lock(self.directory):
                files = _cache_files(self.directory)
                for path, _, _, problem in reversed(files):  # newest first
                    if problem is not None:
                        refused.append(f"{path.name} ({problem}: removed)")
                        continue
                    entry, why = self._read(path, self.budget - self.bytes)
                    if why is not None:
                        refused.append(f"{path.name} ({why})")
                    elif entry is not None and self.bytes + entry.nbytes <= self.budget:
                        self._add(entry)
                self._prune()
        except OSError:
            return
        self.counts["refused_files"] = len(refused)
        if report is not None and refused:
            shown = "; ".join(refused[:MAX_NAMED]) + (f"; and {len(refused) - MAX_NAMED} more"
                                                      if len(refused) > MAX_NAMED else "")
            report.warn(f"prompt cache: {len(refused)} file(s) in {self.directory} refused: {shown} (kept until the "
                        "folder's budget prunes them, oldest first, unless removed)")

    def _read(self, path: Path, room: int) -> tuple[Optional[Entry], Optional[str]]:
        """(the entry in `path`, None) when it checks out; (None, why) when it is refused; (None, None) when it
        would not fit in `room` bytes of RAM (left alone: nothing is wrong with it). Read through one descriptor
        opened without following a link, its size checked before, its MAC while reading."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            return None, "a link" if e.errno == errno.ELOOP else f"cannot be read: {e.strerror}"
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            why = _file_problem(st)
            if why is not None:
                return None, why
            if st.st_size > self.budget + MAX_HEAD + 32:
                return None, f"{st.st_size} bytes: more than the prompt cache's RAM budget"
            if st.st_size > room + MAX_HEAD + 32:
                return None, None
            raw = f.read(st.st_size + 1)
        body, mac = raw[:-32], raw[-32:]
        if len(raw) != st.st_size or len(raw) < len(MAGIC) + 32 or not body.startswith(MAGIC):
            return None, "not a cache file of this version, or damaged"
        if not hmac.compare_digest(hmac.new(self.key, body, hashlib.sha256).digest(), mac):
            return None, f"written with another key (the user's {KEY_FILE} changed, or another user's file)"
        return self._entry(body)

    def _entry(self, body: bytes) -> tuple[Optional[Entry], Optional[str]]:
        end = body.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEAD)
        try:
            head = json.loads(body[len(MAGIC):end]) if end > 0 else None
        except (ValueError, RecursionError):
            head = None
        if not isinstance(head, dict):
            return None, "damaged"
        if head.get("tag") != self.tag:
            return None, "made for another model, build or context size"
        n, size, scope = head.get("tokens"), head.get("state"), head.get("scope")
        if type(n) is not int or type(size) is not int or type(scope) is not str or n < 1 or size < 1 or \
                end + 1 + 4 * n + size != len(body):
            return None, "damaged"
        tokens = array.array("i")
        tokens.frombytes(body[end + 1:end + 1 + 4 * n])
        state = (ctypes.c_uint8 * size).from_buffer_copy(body, end + 1 + 4 * n)
        return Entry(tokens, state, size, scope), None


def _file_problem(st: os.stat_result) -> Optional[str]:
    """Why a cache file with this status is not read, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "a link"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by another user (uid {st.st_uid})"
    if hasattr(st, "st_blocks") and st.st_blocks * 512 + SPARSE_SLACK < st.st_size:
        return f"sparse: {st.st_size} bytes long, {st.st_blocks * 512} on disk"
    return None


def _cache_files(folder: Path) -> list[tuple[Path, int, float, Optional[str]]]:
    """The folder's cache files (anything named *SUFFIX, links included) as (path, length, mtime, why it is no
    cache file or None), oldest first."""
    out = []
    for path in folder.glob(f"*{SUFFIX}"):
        try:
            st = path.lstat()
        except OSError:
            continue
        out.append((path, st.st_size, st.st_mtime, _file_problem(st)))
    return sorted(out, key=lambda f: (f[2], str(f[0])))


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on the cache folder (its LOCK_FILE, never through a link): servers sharing it prune and
    write one at a time."""
    import fcntl

    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) |
                 getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def private_folder(folder: Path, what: str, report=None) -> Path:
    """`folder` made (0700) or checked: a folder of this user's that no one else can read or enter (a wider mode
    is narrowed to 0700, and said); a link, or a folder of another user's, is refused with how to fix it."""
    from specquant_cli.errors import InputError

    folder = Path(folder)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.lstat()
    except OSError as e:
        raise InputError(f"{what} {folder}: cannot create the folder ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise InputError(f"{what} {folder}: is a symbolic link; name the folder itself")
    if not stat.S_ISDIR(st.st_mode):
        raise InputError(f"{what} {folder}: not a folder")
    if st.st_uid != os.geteuid():
        raise InputError(f"{what} {folder}: owned by another user (uid {st.st_uid}); name a folder of your own")
    if st.st_mode & 0o077:
        try:
            os.chmod(folder, 0o700, follow_symlinks=False)
        except OSError as e:
            raise InputError(f"{what} {folder}: other users can read it (mode {stat.S_IMODE(st.st_mode):o}) and it "
                             f"cannot be made private ({e.strerror}); chmod 700 {folder}") from None
        if report is not None:
            report.warn(f"{what} {folder}: other users could read it (mode {stat.S_IMODE(st.st_mode):o}); made it "
                        "private (700)")
    return folder


def user_key() -> bytes:
    """The key cache files' MACs are made with: 32 random bytes in the user's cache folder (KEY_FILE, mode 0600,
    the folder 0700), made on first use; a folder another user can write to cannot feed this server states. A key
    file that is a link, another user's, or readable by others is refused with how to fix it. A fresh key for this
    process alone when there is no such folder."""
    from specquant_cli.settings import cache_home

    home = cache_home()
    if home is None:
        return os.urandom(32)
    private_folder(home, "the cache folder")
    path = home / KEY_FILE
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return _new_key(path)
    except OSError as e:
        return _key_refused(path, e)
    with os.fdopen(fd, "rb") as f:
        _check_key_file(path, os.fstat(f.fileno()))
        data = f.read(64)
    return data if len(data) == 32 else _new_key(path, replace=True)


def _key_refused(path: Path, e: OSError) -> bytes:
    from specquant_cli.errors import InputError

    if e.errno == errno.ELOOP:
        raise InputError(f"the prompt cache's key {path} is a symbolic link; remove it (a new key is made) or "
                         "put the file itself there") from None
    raise InputError(f"the prompt cache's key {path}: cannot be read ({e.strerror})") from None


def _check_key_file(path: Path, st: os.stat_result) -> None:
    from specquant_cli.errors import InputError

    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"the prompt cache's key {path} is not a regular file; remove it (a new key is made)")
    if st.st_uid != os.geteuid():
        raise InputError(f"the prompt cache's key {path} belongs to another user (uid {st.st_uid}); remove it (a new "
                         "key is made)")
    if st.st_mode & 0o077:
        raise InputError(f"the prompt cache's key {path} can be read by other users (mode "
                         f"{stat.S_IMODE(st.st_mode):o}): chmod 600 {path}, or remove it (a new key is made; files "
                         "written with the old one are then not used)")


def _new_key(path: Path, replace: bool = False) -> bytes:
    """A new key written to `path` (0600, never through a link): exclusively, or over a key of the wrong size."""
    from specquant_cli.fsutil import write_bytes_atomic

    key = os.urandom(32)
    try:
        if replace:
            write_bytes_atomic(path, key, mode=0o600)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key)
    except FileExistsError:
        return user_key()  # another process made it meanwhile
    except OSError:
        return key  # this process alone: its files will not be readable by a later one
    return key


def cache_tag(family, n_ctx: int) -> str:
    """What a cached state is valid for: the parent's weights (their sha256 in the manifest, else the file's size
    and name), the llama.cpp build and CPU, the context size of a sequence."""
    from specquant_cli.backend import selftest
    from specquant_cli.family.roles import PARENT_ROLE

    v = family.variant(PARENT_ROLE)
    weights = v.get("sha256") or f"{family.path(PARENT_ROLE).name}:{family.path(PARENT_ROLE).stat().st_size}"
    return hashlib.sha256(f"{weights}\n{selftest.key()}\n{n_ctx}".encode()).hexdigest()[:24]
