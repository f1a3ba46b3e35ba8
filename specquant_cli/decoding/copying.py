"""Following a copy through its edits: where an answer stands in a document it copies (`Place`), the substitutions
it has made in that text so far (`Edits`: a rename, a changed number), and the draft that reads on from a place with
those substitutions carried forward (`follow`).

An answer that rewrites a file with a rename departs from the file at every occurrence of the old name. Once the
suffix drafter has seen one such departure rejoin the file (decoding.suffix: the parent's tokens replaced some of the
file's, then the copy went on), it learns the substitution — the file's tokens and the answer's in their place — and
proposes the answer's tokens at the next occurrence of the file's, so a draft runs on through it instead of breaking
there (Cursor's speculative edits and SuffixDecoding meet here). A substitution the parent does not make where it was
proposed is forgotten (learned again only from another rejoin): a one-off edit of a common token costs one rejected
draft, not one at each of its occurrences. (Ending drafts before the occurrences of a forgotten substitution was
tried: on edits that change a common token once, it cut every later draft there and cost more calls than it saved.)

A substitution is learned as the tokens it replaced (at most MAX_FROM) and those put in their place (at most MAX_TO, and
no more than MAX_GROWTH tokens more or fewer: a name, a number, a word, not a line);
an insertion or a deletion carries the token before it as its context (the file's `lo` followed by `w` where the
answer went on with `w`: `lo` -> `low`), a substitution none (a rename occurs after many different tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

MAX_FROM = 4  # most tokens of the document a learned substitution replaces
MAX_TO = 6  # most tokens it puts in their place
MAX_GROWTH = 3  # most tokens it adds or drops: a name changes by a token or two, a line inserted is no rename
MAX_EDITS = 64  # substitutions one answer keeps (the first learned stay)


@dataclass(frozen=True)
class Place:
    """Where a copy stands: `at`, the packed position (decoding.memory.packed) of the document's next token, and
    `queue`, the tokens of a substitution still to come before it."""

    at: int
    queue: tuple[int, ...] = ()


@dataclass(frozen=True)
class Step:
    """One drafted token of a copy: the place after it, and for the first token where a substitution differs from the
    document, (the substitution's document tokens, the packed position of the document's token it stands in for)."""

    token: int
    after: Place
    opens: Optional[tuple[tuple[int, ...], int]] = None


class Edits:
    """The substitutions one answer has made in the text it copies: document tokens -> the answer's."""

    def __init__(self):
        self.rules: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._longest = 0

    def learn(self, old: Sequence[int], new: Sequence[int]) -> bool:
        """Take `old` -> `new` (False: out of bounds, or no change)."""
        old, new = tuple(int(t) for t in old), tuple(int(t) for t in new)
        if not 1 <= len(old) <= MAX_FROM or len(new) > MAX_TO or abs(len(new) - len(old)) > MAX_GROWTH or old == new:
            return False
        if old not in self.rules and len(self.rules) >= MAX_EDITS:
            return False
        self.rules[old] = new
        self._longest = max(self._longest, len(old))
        return True

    def refute(self, old: tuple[int, ...]) -> None:
        """`old`'s substitution did not hold where it was proposed: forgotten."""
        self.rules.pop(old, None)

    @property
    def span(self) -> int:
        """The longest document text a substitution looks at."""
        return self._longest

    def at(self, body: Sequence[int], i: int) -> Optional[tuple[int, ...]]:
        """The document tokens of the longest substitution starting at body[i], None when none does."""
        for n in range(min(self._longest, len(body) - i), 0, -1):
            key = tuple(body[i:i + n])
            if key in self.rules:
                return key
        return None

    def __bool__(self) -> bool:
        return bool(self.rules)


def follow(body: Sequence[int], place: Place, limit: int, edits: Edits) -> list[Step]:
    """Up to `limit` tokens a copy standing at `place` goes on with: `body`, the document's tokens from `place.at` on
    (as many as there are, or limit + edits.span), read with `edits`' substitutions; ending at the document's end."""
    steps: list[Step] = []
    queue, i = list(place.queue), 0
    opened: Optional[tuple[tuple[int, ...], int]] = None  # the substitution the next token opens
    while len(steps) < limit:
        if queue:
            tok = queue.pop(0)
            steps.append(Step(tok, Place(place.at + i, tuple(queue)), opened))
            opened = None
            continue
        if i >= len(body):
            break
        old = edits.at(body, i) if edits else None
        if old is None:
            i += 1
            steps.append(Step(int(body[i - 1]), Place(place.at + i), opened))
            opened = None
            continue
        new = edits.rules[old]
        same = _common(old, new)  # a context token both share is the document's own
        for j in range(min(same, limit - len(steps))):
            steps.append(Step(old[j], Place(place.at + i + j + 1)))
        if len(steps) >= limit:
            break
        queue, opened = list(new[same:]), (old, place.at + i + same)
        i += len(old)
    return steps


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n
