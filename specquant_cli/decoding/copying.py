"""Following a copy through its edits: where an answer stands in a document it copies (`Place`), the substitutions
it has made in that text so far (`Edits`: a rename, a changed number), and the draft that reads on from a place with
those substitutions carried forward (`follow`).

An answer that rewrites a file with a rename departs from the file at every occurrence of the old name. Once the
suffix drafter has seen one such departure rejoin the file (decoding.suffix: the parent's tokens replaced some of the
file's, then the copy went on), it learns the substitution — the file's tokens and the answer's in their place — and
proposes the answer's tokens at the next occurrence of the file's, so a draft runs on through it instead of breaking
there (Cursor's speculative edits and SuffixDecoding meet here). A substitution is proposed where the parent made it
the last time the document's tokens occurred: a one-off edit of a common token costs one rejected draft, not one at each
of its occurrences. Where the answer has gone both ways on it, the draft is cut back there (`Edits.holds`). (Ending
every draft before a dropped substitution's occurrences was tried: on edits that change a common token once, it cut
every later draft there and cost more calls than it saved; the record's chance cuts only where the answer wavers.)

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
    """One drafted token of a copy: the place after it; for the first token where a substitution differs from the
    document, (the substitution's document tokens, the packed position of the document's token it stands in for); and
    for the first token of a reading the answer has gone both ways on — a substitution proposed, or the document's own
    tokens where one it made is no longer proposed — that substitution's document tokens (`doubt`) and whether the
    token is the substitution's (`substituted`)."""

    token: int
    after: Place
    opens: Optional[tuple[tuple[int, ...], int]] = None
    doubt: Optional[tuple[int, ...]] = None
    substituted: bool = False


class Edits:
    """The substitutions one answer has made in the text it copies: document tokens -> the answer's, each with its
    record there: which way the answer went last time (the substitution, or the document's own tokens kept where it
    was proposed), and how often it went the way it had gone the time before. One is proposed (`rules`) where the
    answer made it last time: a rename is carried forward from its first occurrence, a one-off edit costs one rejected
    draft, and a rename made in one part of a file and not in the next stops where the answer stops making it. The
    chance a reading holds (`holds`) is the record's: a model that goes both ways on a name has its drafts cut
    there."""

    def __init__(self):
        self.rules: dict[tuple[int, ...], tuple[int, ...]] = {}
        # old -> [new, made last time, times the answer went the same way as the time before, times it switched]
        self._record: dict[tuple[int, ...], list] = {}
        self._longest = 0

    def learn(self, old: Sequence[int], new: Sequence[int]) -> bool:
        """The answer made `old` -> `new` (False: out of bounds, or no change). Another `new` for the same `old`
        starts a fresh record."""
        old, new = tuple(int(t) for t in old), tuple(int(t) for t in new)
        if not 1 <= len(old) <= MAX_FROM or len(new) > MAX_TO or abs(len(new) - len(old)) > MAX_GROWTH or old == new:
            return False
        if old not in self._record and len(self._record) >= MAX_EDITS:
            return False
        if old not in self._record or self._record[old][0] != new:
            self._record[old] = [new, True, 0, 0]
        else:
            self._went(old, True)
        self._longest = max(self._longest, len(old))
        self.rules[old] = new
        return True

    def refute(self, old: tuple[int, ...]) -> None:
        """`old`'s substitution was proposed and the answer kept the document's tokens there."""
        self.kept(old, False)

    def kept(self, old: tuple[int, ...], substituted: bool) -> None:
        """Where `old` was read one way (its substitution, or the document's own tokens), the answer went that way."""
        if old in self._record:
            self._went(old, substituted)

    def _went(self, old: tuple[int, ...], made: bool) -> None:
        rec = self._record[old]
        rec[2 if rec[1] == made else 3] += 1
        rec[1] = made
        if made:
            self.rules[old] = rec[0]
        else:
            self.rules.pop(old, None)

    def new_of(self, old: tuple[int, ...]) -> tuple[int, ...]:
        return self._record[old][0]

    def holds(self, old: tuple[int, ...]) -> float:
        """The chance the answer goes the way it went last time where `old` occurs: its record, on a prior of three
        times the same way and one switch (a rename made once is expected at 3 in 4 of its next occurrences)."""
        _, _, same, switched = self._record[old]
        return (same + 3) / (same + switched + 4)

    def recorded(self, body: Sequence[int], i: int) -> Optional[tuple[int, ...]]:
        """The document tokens of the longest substitution on record (proposed or not) starting at body[i]."""
        for n in range(min(self._longest, len(body) - i), 0, -1):
            key = tuple(body[i:i + n])
            if key in self._record:
                return key
        return None

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
    doubt: Optional[tuple[tuple[int, ...], bool]] = None  # the record the next token reads, and which way
    while len(steps) < limit:
        if queue:
            tok = queue.pop(0)
            steps.append(Step(tok, Place(place.at + i, tuple(queue)), opened, *(doubt or (None, False))))
            opened = doubt = None
            continue
        if i >= len(body):
            break
        old = edits.recorded(body, i) if edits.span else None
        new = edits.rules.get(old) if old is not None else None
        if new is None:  # the document's own token; where a substitution on record is not proposed, in doubt
            same = _common(old, edits.new_of(old)) if old is not None else 0
            for j in range(min(same, limit - len(steps))):  # a context token both share
                steps.append(Step(int(body[i + j]), Place(place.at + i + j + 1)))
            i += same
            if len(steps) >= limit or i >= len(body):
                break
            if old is not None and doubt is None:
                doubt = (old, False)
            i += 1
            steps.append(Step(int(body[i - 1]), Place(place.at + i), opened, *(doubt or (None, False))))
            opened = doubt = None
            continue
        same = _common(old, new)  # a context token both share is the document's own (the rest of the substitution
        for j in range(min(same, limit - len(steps))):  # still to come after it)
            steps.append(Step(old[j], Place(place.at + i + len(old), tuple(new[j + 1:]))))
        if len(steps) >= limit:
            break
        queue, opened, doubt = list(new[same:]), (old, place.at + i + same), (old, True)
        i += len(old)
    return steps


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n
