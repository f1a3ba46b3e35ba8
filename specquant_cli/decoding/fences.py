"""Markdown code fences in a token sequence. Where an answer closes the code block it opened, the text a copy reads on
from its source (the request's instructions after a file, the next message of a conversation) is rarely what the answer
says next: it ends, or it says something of its own. A copy's draft stops before the fence that would close the
answer's block, and right after the answer closes one, only a copy that went on through it drafts (decoding.suffix).

A fence is three backticks or more at the start of a line (after spaces or tabs at most); "in one ```python block"
within a sentence is none. Fences are counted over the whole sequence, the prompt's included."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

TICK = ord("`")
FENCE = 3  # backticks in a row that make a fence
LOOK_BACK = 8  # tokens read back for the start of a line (a line of spaces longer than that counts as its start)


@dataclass
class Count:
    """Where counting stands in one growing sequence (an answer's, from its prompt on): the tokens counted, fences so
    far, backticks in a row at the end, whether the last token closed a block, and that token (a sequence that no
    longer holds it there is counted afresh)."""

    n: int = 0
    fences: int = 0
    run: int = 0
    closed: bool = False
    last: Optional[int] = None


class Fences:
    """`pieces`: the text of each token of a vocabulary that holds a backtick (backend.model.Model.backtick_pieces);
    `piece`: any token's text (read back, a token or two, for where a line starts)."""

    def __init__(self, pieces: dict[int, bytes], piece: Callable[[int], bytes]):
        self.pieces = pieces
        self._piece = piece
        self._texts: dict[int, bytes] = {}

    def _text(self, token: int) -> bytes:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.pieces.get(token) or self._piece(token)
        return text

    def _line_start(self, tokens: Callable[[int], int], i: int, head: bytes) -> bool:
        """Whether only spaces or tabs stand between the start of a line and `head`'s end (token i's text up to a
        point), reading back over earlier tokens."""
        text = head
        for j in range(i - 1, i - 1 - LOOK_BACK, -1):
            rest = text.rstrip(b" \t")
            if rest:
                return rest.endswith(b"\n")
            if j < 0:
                return True
            text = self._text(int(tokens(j)))
        return True

    def _advance(self, tokens: Callable[[int], int], i: int, count: int, run: int) -> tuple[int, int, bool]:
        """After token i: (fences so far, backticks in a row at the end that may make one, whether token i completed a
        fence that closes a block). A run of backticks that does not start a line makes none (`run` -1)."""
        piece = self.pieces.get(int(tokens(i)))
        if piece is None:
            return count, 0, False
        closed = False
        for k, ch in enumerate(piece):
            if ch != TICK:
                run = 0
                continue
            if run == 0:
                run = 1 if self._line_start(tokens, i, piece[:k]) else -1
            elif run > 0:
                run += 1
                if run == FENCE:
                    closed = closed or count % 2 == 1
                    count += 1
        return count, run, closed

    def room(self, seq: Sequence[int], draft: Sequence[int], goes_on: bool, count: Optional[Count] = None) -> int:
        """How much of `draft` (read after `seq`) a copy proposes: up to the token that starts the fence closing the
        block open at that point; none right after `seq` closed a block, unless the copy `goes_on` through it (the
        source's fence was the answer's). `count`: where counting stood in an earlier, shorter `seq` of the same answer
        (updated to `seq`'s end: each token is counted once per answer)."""
        n = len(seq)

        def tokens(k: int) -> int:
            return seq[k] if k < n else draft[k - n]

        c = count if count is not None else Count()
        if c.n > n or (c.n and int(seq[c.n - 1]) != c.last):
            c.n, c.fences, c.run, c.closed = 0, 0, 0, False
        for i in range(c.n, n):
            c.fences, c.run, c.closed = self._advance(tokens, i, c.fences, c.run)
        c.n, c.last = n, int(seq[n - 1]) if n else None
        if c.closed and not goes_on:
            return 0
        fences, run = c.fences, c.run
        start = 0  # the draft token where the run of backticks going on began (0: it began in `seq`)
        for i in range(len(draft)):
            if run == 0:
                start = i
            fences, run, closed = self._advance(tokens, n + i, fences, run)
            if closed:
                return start
        return len(draft)
