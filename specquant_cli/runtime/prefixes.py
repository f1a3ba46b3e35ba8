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
tokens' keys and values up to the float rounding of another batch shape, as the sequence's own cache already was."""

from __future__ import annotations

import array
import contextlib
import ctypes
import hashlib
import hmac
import json
import os
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
MAGIC = b"SQPC2\n"  # a cache file's first bytes
SUFFIX = ".sqpc"
MAX_HEAD = 4096  # bytes of a cache file's header line
KEY_FILE = "prompt-cache.key"  # in the user's cache folder: the key a cache file's MAC is made with


@dataclass
class Entry:
    """One cached parent sequence: the tokens it held and its state as llama.cpp serialized it."""

    tokens: array.array  # 'i': 4 bytes a token
    state: ctypes.Array
    size: int  # bytes of `state`
    file: Optional[Path] = None  # the file this process wrote it to (only such a file is ever deleted)

    @property
    def nbytes(self) -> int:
        return self.size + 4 * len(self.tokens) + ENTRY_OVERHEAD


class PromptCache:
    """Parent sequence states in host RAM, keyed by their tokens, least recently used out, never above `budget`
    bytes. `tag` names what a state is valid for (parent weights, llama.cpp build, context size): entries read from
    `directory` carry it, and one with another tag, or a file that does not check out (its MAC is made with `key`,
    private to the user: user_key), is refused and left alone. Files this process did not write are never
    deleted."""

    def __init__(self, budget: int, tag: str, directory: Optional[Path] = None, report=None,
                 key: Optional[bytes] = None):
        self.budget = max(0, int(budget))
        self.tag = tag
        self.directory = directory
        self.key = key if key is not None else os.urandom(32)
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # oldest first
        self._next = 0
        self._lock = threading.Lock()
        self.bytes = 0
        self.counts = {"hits": 0, "misses": 0, "evictions": 0, "refused_files": 0}
        if directory is not None:
            self._read_folder(report)

    # -- lookup and store ------------------------------------------------------------------------
    def best(self, tokens: Sequence[int]) -> tuple[Optional[Entry], int]:
        """The entry sharing the longest prefix with `tokens`, and that length (`use` it to keep it longer)."""
        with self._lock:
            found, n = None, 0
            for e in self._entries.values():
                k = common_prefix(e.tokens, tokens)
                if k > n:
                    found, n = e, k
            return found, n

    def use(self, entry: Entry) -> None:
        """`entry` was restored: it becomes the most recently used (a hit)."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e is entry]:
                self._entries.move_to_end(key)
            self.counts["hits"] += 1

    def covers(self, tokens: Sequence[int]) -> bool:
        """Whether an entry already holds all of `tokens` (as its prefix)."""
        with self._lock:
            return any(len(e.tokens) >= len(tokens) and common_prefix(e.tokens, tokens) == len(tokens)
                       for e in self._entries.values())

    def put(self, tokens: Sequence[int], state: tuple[ctypes.Array, int]) -> bool:
        """Keep `state` (a sequence holding `tokens`), evicting the least recently used entries to stay within the
        budget; an entry whose tokens are a prefix of these goes (this one holds it all). False when it alone is
        over the budget."""
        buf, size = state
        entry = Entry(array.array("i", tokens), buf, size)
        if entry.nbytes > self.budget:
            return False
        with self._lock:
            for key in [k for k, e in self._entries.items()
                        if len(e.tokens) <= len(tokens) and common_prefix(e.tokens, tokens) == len(e.tokens)]:
                self._drop(key)
            while self.bytes + entry.nbytes > self.budget and self._entries:
                self._drop(next(iter(self._entries)))
                self.counts["evictions"] += 1
            self._entries[self._next] = entry
            self._next += 1
            self.bytes += entry.nbytes
        if self.directory is not None:
            self._write(entry)
        return True

    def discard(self, entry: Entry) -> None:
        """Drop `entry` (llama.cpp refused its state, or it did not hold what it said)."""
        with self._lock:
            for key in [k for k, e in self._entries.items() if e is entry]:
                self._drop(key)

    def _drop(self, key: int) -> None:
        e = self._entries.pop(key)
        self.bytes -= e.nbytes
        if e.file is not None:
            with contextlib.suppress(OSError):
                e.file.unlink()

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def status(self) -> dict:
        with self._lock:
            return {"enabled": True, "budget_bytes": self.budget, "bytes": self.bytes, "entries": len(self._entries),
                    **{k: v for k, v in self.counts.items()},
                    "dir": str(self.directory) if self.directory is not None else None}

    # -- the folder ------------------------------------------------------------------------------
    def _write(self, e: Entry) -> None:
        """The entry as one file (header line, tokens, state, then their MAC), written whole or not at all; deleted
        again when the entry was evicted meanwhile."""
        from specquant_cli.fsutil import write_bytes_atomic

        head = json.dumps({"tag": self.tag, "tokens": len(e.tokens), "state": e.size}).encode() + b"\n"
        body = MAGIC + head + e.tokens.tobytes() + bytes(memoryview(e.state)[:e.size])
        mac = hmac.new(self.key, body, hashlib.sha256).digest()
        path = self.directory / f"{mac.hex()[:32]}{SUFFIX}"
        try:
            write_bytes_atomic(path, body + mac)
        except OSError:
            return  # the RAM entry stands; the folder only loses it
        with self._lock:
            if any(x is e for x in self._entries.values()):
                e.file = path
                return
        with contextlib.suppress(OSError):
            path.unlink()

    def _read_folder(self, report) -> None:
        """Entries of the folder, newest last, within the budget; files another server wrote for other weights, a
        build or context size, and files that do not check out, are counted as refused and left where they are."""
        try:
            files = sorted(self.directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        except OSError:
            return
        for path in files:
            entry = self._read(path)
            if entry is None:
                self.counts["refused_files"] += 1
                continue
            while self.bytes + entry.nbytes > self.budget and self._entries:
                self._drop(next(iter(self._entries)))  # read, not written here: its file stays
                self.counts["evictions"] += 1
            self._entries[self._next] = entry
            self._next += 1
            self.bytes += entry.nbytes
        if report is not None and self.counts["refused_files"]:
            report.warn(f"prompt cache: {self.counts['refused_files']} file(s) in {self.directory} refused (another "
                        "model, build or context size, or damaged)")

    def _read(self, path: Path) -> Optional[Entry]:
        """The entry in `path`, None unless it is a regular file within the budget that checks out."""
        import stat

        try:
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_size > self.budget + (1 << 20):
                return None  # a link, a device or a FIFO is never read; nor a file the budget cannot hold
            raw = path.read_bytes()
        except OSError:
            return None
        body, mac = raw[:-32], raw[-32:]
        if len(raw) < len(MAGIC) + 32 or not body.startswith(MAGIC) or \
                not hmac.compare_digest(hmac.new(self.key, body, hashlib.sha256).digest(), mac):
            return None  # damaged, or not written with this user's key
        end = body.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEAD)
        try:
            head = json.loads(body[len(MAGIC):end]) if end > 0 else None
        except (ValueError, RecursionError):
            return None
        if not isinstance(head, dict) or head.get("tag") != self.tag:
            return None
        n, size = head.get("tokens"), head.get("state")
        if type(n) is not int or type(size) is not int or n < 1 or size < 1 or end + 1 + 4 * n + size != len(body):
            return None
        tokens = array.array("i")
        tokens.frombytes(body[end + 1:end + 1 + 4 * n])
        state = (ctypes.c_uint8 * size).from_buffer_copy(body, end + 1 + 4 * n)
        return Entry(tokens, state, size)  # read, not written here: its file is never deleted by this process


def user_key() -> bytes:
    """The key cache files' MACs are made with: 32 random bytes in the user's cache folder (KEY_FILE, mode 0600),
    made on first use; a folder another user can write to cannot feed this server states. A fresh key for this
    process alone when there is no such folder or it cannot be written."""
    from specquant_cli.settings import cache_home

    home = cache_home()
    if home is None:
        return os.urandom(32)
    path = home / KEY_FILE
    try:
        data = path.read_bytes()
        if len(data) == 32:
            return data
        home.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    except FileNotFoundError:
        try:
            home.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError:
            return os.urandom(32)
    except OSError:
        return os.urandom(32)
    key = os.urandom(32)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
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
    sequence does not hold the batcher's rounds back."""

    def __init__(self, views: list, cache: Optional[PromptCache], ops, away=None, reuse: bool = True):
        self.views = list(views)
        self.reuse = reuse  # False (--no-prompt-cache): every prompt is prefilled whole, its own prefix included
        self.cache = cache
        self.ops = ops
        self.away = away or contextlib.nullcontext
        self._targets: dict[int, tuple[int, ...]] = {}  # seq -> the prompt it is prefilling now
        self._lock = threading.Condition()
        self.counts = {"copied_tokens": 0, "restored_tokens": 0, "waits": 0}  # what sharing saved, and its waits
        for v in self.views:
            v.prefixes = self

    def prefill(self, view, tokens: Sequence[int]) -> int:
        """Make `view` hold exactly `tokens`, taking the longest computed prefix there is; returns tokens decoded."""
        tokens = tuple(tokens)
        if not self.reuse:
            view.rewind(0)
            return view.sync(tokens, logits="none")
        self._keep(view, tokens)
        cached = self.cache.best(tokens) if self.cache is not None else (None, 0)
        with self._prefilling(view, tokens, cached[1]):
            self._take(view, tokens, cached)
            return view.sync(tokens, logits="none")

    def _keep(self, view, tokens: tuple[int, ...]) -> None:
        """Before `view` gives up what it holds beyond `tokens`' prefix, its state goes to the prompt cache (unless a
        sequence or an entry holds it all already)."""
        held = list(view.tokens)
        if self.cache is None or len(held) < MIN_REUSE or common_prefix(held, tokens) >= len(held) - MIN_REUSE:
            return
        with self.ops:
            if any(v is not view and common_prefix(v.tokens, held) == len(held) for v in self.views):
                return
        if self.cache.covers(held):
            return
        with self.ops:
            state = view.ctx.export_state(view.seq)
        self.cache.put(held, state)

    @contextlib.contextmanager
    def _prefilling(self, view, tokens: tuple[int, ...], cached: int) -> Iterator[None]:
        """While `view` prefills `tokens`, others sharing a longer prefix wait for it; it first waits for any other
        prefill whose prompt shares more with `tokens` than what is computed anywhere (`cached`: the prompt
        cache's longest prefix of it)."""
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
        """A sequence prefilling a prompt that shares with `tokens` a prefix it has not yet computed, longer than
        what `view` could take now (`cached`: the prompt cache's longest prefix of it); None when none is."""
        have = max([cached] + [common_prefix(v.tokens, tokens) for v in self.views])
        for seq, target in self._targets.items():
            if seq == view.seq:
                continue
            shared = common_prefix(target, tokens)
            other = self._view(seq)
            if shared >= have + MIN_REUSE and other is not None and len(other.tokens) < shared:
                return seq
        return None

    def _view(self, seq: int):
        return next((v for v in self.views if v.seq == seq), None)

    def _take(self, view, tokens: tuple[int, ...], cached: tuple[Optional[Entry], int]) -> None:
        """Give `view` the longest computed prefix of `tokens` held elsewhere (another sequence's cells, or the
        `cached` (entry, length) when that is longer), when it beats its own by MIN_REUSE tokens."""
        own = common_prefix(view.tokens, tokens)
        entry, n = cached
        with self.ops:
            donors = [(common_prefix(v.tokens, tokens), v) for v in self.views if v is not view]
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
