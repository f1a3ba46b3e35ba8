"""The drafting memory: one suffix index over every sequence a scope has seen, shared by all its drafters.

A server's slots (and a CLI session's turns) read and write one `DraftMemory`, so one user's answers draft
for the next, as llama.cpp's `ngram-mod` shares one table between its slots. Each sequence is a document;
the index maps every k-gram (2..MAX_K-1 tokens) to the positions that followed it, packed as
(document << 32 | position). The memory is bounded: past its token budget the least recently used
documents (last written or drafted from) are dropped, never the one being written. Their index entries
are skipped from then on, and the index is rebuilt once the dead entries outnumber the live ones.

Thread-safe: one lock around every read and write (a lookup is a few dict reads, far below a model call).
Only verified tokens are written (the parent's own sequence); a drafter that looks up a longer sequence
(a second level, after unverified drafts) reads without writing.

Each document belongs to a scope (a server's tenant, narrowed by a request's `cache_salt`): a lookup finds only
its own scope's documents, so what one tenant asked never drafts, or speeds up, another's answer. The scopes share
the memory's one budget (`ScopedMemory` is one scope's view)."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Optional

from specquant_cli.settings import DEFAULT_DRAFT_MEMORY_MIB

MAX_K = 8  # longest indexed k-gram (k - 1 tokens of context + the position that followed)
MIN_K = 3  # shortest looked up: a 2-token context (a 1-token coincidence is no match)
MAX_EXTEND = 64  # backward extension limit when measuring a match
MAX_CANDIDATES = 64  # most recent occurrences considered
# Measured with tracemalloc on 200 k tokens of mixed text (tests/test_memory.py keeps it true): the
# documents, the index's lists and packed ints, and its gram keys, per stored token.
BYTES_PER_TOKEN = 700
_SHIFT = 32
_POS = (1 << _SHIFT) - 1  # the position part of a packed (document << 32 | position)
MAX_VIEWS = 256  # scopes' views kept (a view is a few bytes; a dropped one is made again)


def tokens_for(budget_mib: float = DEFAULT_DRAFT_MEMORY_MIB) -> int:
    """The tokens a budget of `budget_mib` MiB holds."""
    return int(budget_mib * (1 << 20) // BYTES_PER_TOKEN)


def packed(doc: int, pos: int) -> int:
    """Position `pos` of document `doc`, packed as the index stores it."""
    return (doc << _SHIFT) | pos


def offset(packed_pos: int) -> int:
    """The position within its document of a packed position."""
    return packed_pos & _POS


def _entries_of(n: int) -> int:
    """Index entries of a document of n tokens: one per k-gram size with a position after it."""
    return sum(max(0, n - k + 1) for k in range(MIN_K, MAX_K + 1))


class DraftMemory:
    """Documents of verified tokens and their k-gram index, least recently used out past `max_tokens`."""

    def __init__(self, max_tokens: Optional[int] = None):
        self.max_tokens = tokens_for() if max_tokens is None else max(0, int(max_tokens))
        self._lock = threading.Lock()
        self._docs: dict[int, list[int]] = {}
        self._scope: dict[int, str] = {}  # document -> the scope it belongs to
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest use first
        # hash of a k-gram -> the packed position that followed it, or a list of them once there are several
        self._index: dict[int, object] = {}
        self._next = 1
        self.tokens = 0  # tokens held by live documents
        self._entries = 0  # index entries, live and dead
        self._live = 0  # index entries of live documents
        self.evicted = 0  # documents dropped for the budget
        self._views: OrderedDict[str, ScopedMemory] = OrderedDict()  # scope -> its view, the last MAX_VIEWS

    def view(self, scope: str = "") -> ScopedMemory:
        """`scope`'s view of this memory: the same object for the same scope (while among the last MAX_VIEWS)."""
        with self._lock:
            v = self._views.get(scope)
            if v is None:
                v = self._views[scope] = ScopedMemory(self, scope)
                while len(self._views) > MAX_VIEWS:
                    self._views.popitem(last=False)
            self._views.move_to_end(scope)
            return v

    # -- writing -----------------------------------------------------------------------------------
    def new_doc(self, scope: str = "") -> int:
        with self._lock:
            doc = self._next
            self._next += 1
            self._docs[doc] = []
            self._scope[doc] = scope
            self._lru[doc] = None
            return doc

    def append(self, doc: int, tokens: Sequence[int]) -> bool:
        """Add `tokens` at the end of document `doc`; False when it is gone (evicted): start a new one."""
        with self._lock:
            body = self._docs.get(doc)
            if body is None:
                return False
            for t in tokens:
                self._push(doc, body, int(t))
            self.tokens += len(tokens)
            self._lru.move_to_end(doc)
            self._evict(keep=doc)
            return True

    def _push(self, doc: int, body: list[int], t: int) -> None:
        body.append(t)
        n, index, packed = len(body), self._index, (doc << _SHIFT) | (len(body) - 1)
        for k in range(MIN_K, MAX_K + 1):
            if n - k < 0:
                break
            key = hash(tuple(body[n - k:n - 1]))
            had = index.get(key)
            if had is None:
                index[key] = packed
            elif isinstance(had, list):
                had.append(packed)
            else:
                index[key] = [had, packed]
            self._entries += 1
            self._live += 1

    def _evict(self, keep: int) -> None:
        """Drop the least recently used documents while over the budget; never `keep`, the one being written
        (a budget of 0 keeps just that one: each answer drafts from itself alone)."""
        dropped = False
        while self.tokens > self.max_tokens:
            doc = next((d for d in self._lru if d != keep), None)
            if doc is None:
                break
            del self._lru[doc]
            body = self._docs.pop(doc)
            del self._scope[doc]
            self.tokens -= len(body)
            self._live -= _entries_of(len(body))
            self.evicted += 1
            dropped = True
        if dropped and self._entries > 2 * max(1, self._live):
            self._rebuild()

    def _rebuild(self) -> None:
        docs, self._index, self._entries, self._live = self._docs, {}, 0, 0
        for doc, body in docs.items():
            tokens, docs[doc] = list(body), []
            for t in tokens:
                self._push(doc, docs[doc], t)

    # -- reading -----------------------------------------------------------------------------------
    def match(self, seq: Sequence[int], scope: str = "") -> tuple[int, list[int]]:
        """(match length, packed positions that followed it): the longest suffix of `seq` seen before in `scope`'s
        documents, its most recent occurrences (MAX_CANDIDATES), those with the longest backward extension."""
        with self._lock:
            for k in range(min(MAX_K, len(seq) + 1), MIN_K - 1, -1):
                found = self._index.get(hash(tuple(seq[len(seq) - (k - 1):])))
                hits = [p for p in (found if isinstance(found, list) else () if found is None else (found,))
                        if self._scope.get(p >> _SHIFT) == scope][-MAX_CANDIDATES:]
                lens = [self._extend_back(seq, p, 0) for p in hits]  # from 0: a hash collision matches nothing
                hits = [(p, n) for p, n in zip(hits, lens) if n >= k - 1]
                if not hits:
                    continue
                best = max(n for _, n in hits)
                return best, [p for p, n in hits if n == best]
            return 0, []

    def _extend_back(self, seq: Sequence[int], packed: int, n: int) -> int:
        body, pos, i = self._docs[packed >> _SHIFT], packed & _POS, n
        while i < MAX_EXTEND and i < len(seq) and pos - i - 1 >= 0 and body[pos - i - 1] == seq[-i - 1]:
            i += 1
        return i

    def walk(self, cands: list[int], limit: int, min_prob: float, survivors: Optional[list[int]] = None) -> list[int]:
        """Follow the continuation most candidates agree on while its estimated probability stays above
        `min_prob`; the documents drafted from count as used. `survivors` (a list) receives the candidates whose
        continuation is the whole walk."""
        with self._lock:
            alive = [(self._docs[p >> _SHIFT], p & _POS, p) for p in cands if (p >> _SHIFT) in self._docs]
            out, prob = [], 1.0
            for step in range(limit):
                nxt = Counter(body[pos + step] for body, pos, _ in alive if pos + step < len(body))
                if not nxt:
                    break
                tok, c = nxt.most_common(1)[0]
                prob *= c / len(alive)
                if prob < min_prob:
                    break
                out.append(tok)
                alive = [(b, p, k) for b, p, k in alive if p + step < len(b) and b[p + step] == tok]
            for p in cands:
                if (p >> _SHIFT) in self._lru:
                    self._lru.move_to_end(p >> _SHIFT)
            if survivors is not None:
                survivors += [k for _, _, k in alive]
            return out

    def token_at(self, packed: int) -> Optional[int]:
        """The token at a packed position (None: past its document's end, or the document is gone)."""
        with self._lock:
            body = self._docs.get(packed >> _SHIFT)
            pos = packed & _POS
            return body[pos] if body is not None and pos < len(body) else None

    def read(self, packed: int, n: int) -> list[int]:
        """Up to n tokens of a document from a packed position on (fewer at its end; none when it is gone); the
        document counts as used."""
        with self._lock:
            doc = packed >> _SHIFT
            body = self._docs.get(doc)
            if body is None:
                return []
            self._lru.move_to_end(doc)
            pos = packed & _POS
            return body[pos:pos + max(0, n)]

    def find_after(self, packed: int, tail: Sequence[int], window: int) -> Optional[int]:
        """Where a sequence that left a document at `packed` (a packed position) rejoins it: the packed position
        right after the nearest occurrence of `tail` ending within `window` positions from `packed` on (a token
        follows it); None when there is none, or the document is gone."""
        with self._lock:
            body = self._docs.get(packed >> _SHIFT)
            if body is None or not tail:
                return None
            pos, m, tail = packed & _POS, len(tail), list(tail)
            for end in range(max(pos, m - 1), min(len(body) - 1, pos + window)):
                if body[end] == tail[-1] and body[end - m + 1:end + 1] == tail:
                    return packed - pos + end + 1
            return None

    def use(self) -> dict:
        """What the memory holds: documents, tokens, its budget (tokens and estimated bytes), evictions."""
        with self._lock:
            return {"documents": len(self._docs), "tokens": self.tokens, "max_tokens": self.max_tokens,
                    "bytes_estimate": self.tokens * BYTES_PER_TOKEN, "evicted": self.evicted,
                    "scopes": len(set(self._scope.values()))}


class ScopedMemory:
    """One scope's view of a DraftMemory: the documents it writes are its own, and it finds only those."""

    def __init__(self, memory: DraftMemory, scope: str = ""):
        self.memory = memory
        self.scope = scope

    @property
    def max_tokens(self) -> int:
        return self.memory.max_tokens

    def new_doc(self) -> int:
        return self.memory.new_doc(self.scope)

    def append(self, doc: int, tokens: Sequence[int]) -> bool:
        return self.memory.append(doc, tokens)

    def match(self, seq: Sequence[int]) -> tuple[int, list[int]]:
        return self.memory.match(seq, self.scope)

    def walk(self, cands: list[int], limit: int, min_prob: float, survivors: Optional[list[int]] = None) -> list[int]:
        return self.memory.walk(cands, limit, min_prob, survivors)

    def token_at(self, packed: int) -> Optional[int]:
        return self.memory.token_at(packed)

    def read(self, packed: int, n: int) -> list[int]:
        return self.memory.read(packed, n)

    def find_after(self, packed: int, tail: Sequence[int], window: int) -> Optional[int]:
        return self.memory.find_after(packed, tail, window)

    def use(self) -> dict:
        return self.memory.use()


class Recorder:
    """One drafter's cursor into a memory: the document its current sequence is written to. A sequence that
    does not continue the last one written starts a new document."""

    def __init__(self, memory: DraftMemory):
        self.memory = memory
        self._doc: Optional[int] = None
        self._n = 0  # tokens of the current sequence written
        self._last: Optional[int] = None  # the last of them

    def start(self, seq: Sequence[int]) -> None:
        """A new sequence (a new answer): a new document."""
        self._doc = None
        self.record(seq)

    def record(self, seq: Sequence[int]) -> None:
        """Write what `seq` adds to the current document (a new document when it does not continue it)."""
        n = self._n
        if self._doc is None or n > len(seq) or (n and int(seq[n - 1]) != self._last):
            self._doc, n = self.memory.new_doc(), 0
        if n == len(seq):
            return
        if not self.memory.append(self._doc, seq[n:]):  # evicted meanwhile: again, with the whole sequence
            self._doc, n = self.memory.new_doc(), 0
            self.memory.append(self._doc, seq)
        self._n, self._last = len(seq), int(seq[-1])
