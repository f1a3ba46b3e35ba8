"""Prefill once: what a sequence about to prefill a prompt takes instead of decoding it.

A parent's prompt is the expensive part on a CPU (~15 ms a token for the 1.5B F16 parent), and assistants,
agents and RAG templates resend the same long prefix on every turn. Before a sequence prefills, `PrefixSharing`
looks for the longest prefix of its prompt that is already computed:

- in its own cache (llama.cpp keeps what the sequence held: the last turn of its conversation);
- in another sequence of the same context: the contexts hold all their sequences in one unified KV cache, so
  another sequence's cells are given to this one (`llama_memory_seq_cp`: metadata only, no copy, no prefill);
- in the `PromptCache`: sequence states (`llama_state_seq_get_data`) kept in host RAM, under a byte budget,
  when a sequence was about to be reused for another prompt; least recently used out; optionally written to a
  folder (`--cache-dir`) that a later server reads back, refusing entries of another model, build or context.

When another sequence is prefilling a prompt that shares a longer prefix with this one (two conversations over one
system prompt arriving together), this one waits for it to pass the shared part, then takes it: the shared prefix
is computed once. Only the parent's sequences take part: a model draft imports the parent's KV, as always.

The KV cells a prefix is made of are the ones a cold prefill would make, computed in other batches: the same
tokens' keys and values up to the float rounding of another batch shape, as the sequence's own cache already was.

Why one file of ~570 lines: the three sources of a prefix (own cache, another sequence, the prompt cache and its
folder) and the wait for another's prefill share one lock and one choice of the longest prefix."""

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
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specquant_cli.backend.llama import common_prefix
from specquant_cli.errors import check_cancelled

MIN_REUSE = 16  # tokens: a shorter prefix is prefilled, not copied, restored or cached
WAIT_S = 600.0  # the longest a sequence waits for another's prefill of their shared prefix
POLL_S = 0.02
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

    With a `directory` (made private: 0700, files 0600, never through a link) every entry is also written there,
    and read back at start, newest first while the RAM budget lasts. The folder as a whole stays within
    `disk_budget` bytes: after every write, and at start, its oldest files go first (whoever wrote them: servers
    sharing the folder prune it together, under a lock). A file is refused, and named, when it is not a regular
    file, is sparse (its bytes on disk fewer than its size), was written for another tag, or does not check out
    with `key` (its MAC: user_key, private to the user; another key means the key file changed)."""

    def __init__(self, budget: int, tag: str, directory: Optional[Path] = None, report=None,
                 key: Optional[bytes] = None, disk_budget: Optional[int] = None):
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
        if self.directory is not None:
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


class PrefixSharing:
    """The parent sequences of one context (`views`: each a PrefixCache with `seq`, `tokens`, `ctx`) and the
    prompt cache (None: off); `reuse` False takes nothing, not even a sequence's own prefix. `ops` is the lock
    every llama.cpp call on the context holds; `away`, when given, is a context manager under which a waiting
    sequence does not hold the batcher's rounds back.

    Every sequence holds cells of one scope (`enter`: a request's tenant and cache_salt). A prefill takes a prefix
    only from its own scope — its own cells, another sequence's of the same scope, a prompt cache entry of it —
    and waits only for a prefill of its own scope: one tenant's prompts never make another's faster."""

    def __init__(self, views: list, cache: Optional[PromptCache], ops, away=None, reuse: bool = True):
        self.views = list(views)
        self.reuse = reuse  # False (--no-prompt-cache): every prompt is prefilled whole, its own prefix included
        self.cache = cache
        self.ops = ops
        self.away = away or contextlib.nullcontext
        self._targets: dict[int, tuple[int, ...]] = {}  # seq -> the prompt it is prefilling now
        self._scopes: dict[int, str] = {}  # seq -> the scope of the cells it holds
        self._lock = threading.Condition()
        self.counts = {"copied_tokens": 0, "restored_tokens": 0, "waits": 0}  # what sharing saved, and its waits
        for v in self.views:
            v.prefixes = self

    def scope(self, index: int) -> str:
        """The scope of what sequence `index` (of `views`) holds."""
        return self._scopes.get(self.views[index].seq, "")

    def enter(self, index: int, scope: str) -> bool:
        """Sequence `index` is about to serve a request of `scope`. When it holds another scope's cells, they go to
        the prompt cache (under their scope) and the sequence is emptied: True (the caller empties the drafts'
        sequences too)."""
        view = self.views[index]
        if self.scope(index) == scope:
            return False
        if self.reuse:
            self._keep(view, (), self.scope(index))
        with self.ops:
            view.rewind(0)
        self._scopes[view.seq] = scope
        return True

    def prefill(self, view, tokens: Sequence[int]) -> int:
        """Make `view` hold exactly `tokens`, taking the longest computed prefix there is; returns tokens decoded."""
        tokens = tuple(tokens)
        if not self.reuse:
            view.rewind(0)
            return view.sync(tokens, logits="none")
        scope = self._scopes.get(view.seq, "")
        self._keep(view, tokens, scope)
        cached = self.cache.best(tokens, scope) if self.cache is not None else (None, 0)
        with self._prefilling(view, tokens, cached[1]):
            self._take(view, tokens, cached)
            return view.sync(tokens, logits="none")

    def _peers(self, view) -> list:
        """The other sequences holding cells of `view`'s scope."""
        scope = self._scopes.get(view.seq, "")
        return [v for v in self.views if v is not view and self._scopes.get(v.seq, "") == scope]

    def _keep(self, view, tokens: tuple[int, ...], scope: str) -> None:
        """Before `view` gives up what it holds beyond `tokens`' prefix, its state goes to the prompt cache under
        `scope` (unless a sequence of the scope or an entry holds it all already)."""
        held = list(view.tokens)
        if self.cache is None or len(held) < MIN_REUSE or common_prefix(held, tokens) >= len(held) - MIN_REUSE:
            return
        with self.ops:
            if any(common_prefix(v.tokens, held) == len(held) for v in self._peers(view)):
                return
        if self.cache.covers(held, scope):
            return
        with self.ops:
            state = view.ctx.export_state(view.seq)
        self.cache.put(held, state, scope)

    @contextlib.contextmanager
    def _prefilling(self, view, tokens: tuple[int, ...], cached: int) -> Iterator[None]:
        """While `view` prefills `tokens`, others of its scope sharing a longer prefix wait for it; it first waits for
        any other prefill of its scope whose prompt shares more with `tokens` than what is computed anywhere
        (`cached`: the prompt cache's longest prefix of it)."""
        with self._lock:
            deadline = time.monotonic() + WAIT_S
            while self._ahead(view, tokens, cached) is not None and time.monotonic() < deadline:
                self.counts["waits"] += 1
                check_cancelled()
                with self.away():
                    self._lock.wait(POLL_S)
            self._targets[view.seq] = tokens
        try:
            yield
        finally:
            with self._lock:
                self._targets.pop(view.seq, None)
                self._lock.notify_all()

    def _ahead(self, view, tokens: tuple[int, ...], cached: int) -> Optional[int]:
        """A sequence of `view`'s scope prefilling a prompt that shares with `tokens` a prefix it has not yet
        computed, longer than what `view` could take now (`cached`: the prompt cache's longest prefix of it); None
        when none is."""
        peers = self._peers(view)
        have = max([cached, common_prefix(view.tokens, tokens)] + [common_prefix(v.tokens, tokens) for v in peers])
        for other in peers:
            target = self._targets.get(other.seq)
            if target is None:
                continue
            shared = common_prefix(target, tokens)
            if shared >= have + MIN_REUSE and len(other.tokens) < shared:
                return other.seq
        return None

    def _take(self, view, tokens: tuple[int, ...], cached: tuple[Optional[Entry], int]) -> None:
        """Give `view` the longest computed prefix of `tokens` held elsewhere in its scope (another sequence's
        cells, or the `cached` (entry, length) when that is longer), when it beats its own by MIN_REUSE tokens."""
        own = common_prefix(view.tokens, tokens)
        entry, n = cached
        with self.ops:
            donors = [(common_prefix(v.tokens, tokens), v) for v in self._peers(view)]
            shared, donor = max(donors, key=lambda d: d[0], default=(0, None))
            if donor is not None and shared >= own + MIN_REUSE and shared >= n:
                view.rewind(own)
                view.ctx.copy_seq(donor.seq, view.seq, own, shared)
                view.tokens[:] = tokens[:shared]
                self.counts["copied_tokens"] += shared - own
                return
        if self.cache is None:
            return
        if entry is None or n < own + MIN_REUSE:
            self.cache.count("misses")
            return
        with self.ops:
            view.rewind(0)
            loaded = view.ctx.load_state((entry.state, entry.size), view.seq)
            if not loaded or view.ctx.positions(view.seq) != (0, len(entry.tokens) - 1):
                view.ctx.remove(view.seq, 0, -1)  # refused, or not the positions its tokens say: never used again
                self.cache.discard(entry)
                self.cache.count("misses")
                return
            view.tokens[:] = list(entry.tokens)
            view.rewind(n)
        self.cache.use(entry)
        self.counts["restored_tokens"] += n - own

    def status(self) -> dict:
        """The prompt cache's use and budget with the prompt tokens sharing saved (prompt_cache_status's shape)."""
        cache = self.cache.status() if self.cache is not None else \
            {"enabled": False, "budget_bytes": 0, "bytes": 0, "entries": 0, "hits": 0, "misses": 0, "evictions": 0,
             "dir": None}
        return {**cache, "restored_tokens": self.counts["restored_tokens"],
                "copied_tokens": self.counts["copied_tokens"]}
