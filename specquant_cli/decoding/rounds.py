"""The price of a batch round, and the pace it sets for model drafts.

When B sequences decode together (serve --parallel), a round is one parent call over every sequence's tokens
plus the draft calls that round needs, and every sequence of the batch waits for both: the batcher runs the
draft models' calls first and holds the parent's until the drafting sequences reach their verification
(decoding.batch). A draft pays only when it lowers the time per token *of the whole batch*, not of the one
sequence that drafts: at B = 4 on a 2-core CPU the parent's call on 4 tokens costs 1.4x its call on 1, so the
parent alone already makes 4 tokens for 1.4 one-token calls, and three q4 calls before a 16-token
verification cost about as much as the tokens they win.

`round_price` is that price: for m of B sequences drafting with one model in `calls` calls each (the others
decode one token a round), the seconds of the cycle and the tokens it yields, from this machine's measured
call curves. `best_calls` picks the number of calls with the lowest seconds per token (0: no model draft
this round). `RoundPacer` is what the drafters of a server's slots share: each model drafter asks it, before
each draft, how many calls it may make; all the sequences drafting with one model get the same number, so
they make their draft calls in the same rounds and verify together in one parent call (in step: a second
drafting level changes how many tokens a call yields, never how many calls a cycle makes)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Optional

from specquant_cli.decoding.gamma import GAMMA_MAX, Acceptance, expected_tokens

# A draft must lower the batch's seconds per token by this much to run (the calibration takes the fastest of
# several timings, so its curves are a few percent optimistic).
ROUND_MARGIN = 1.03
# A drafter that has not asked for this long has left the batch (its answer ended, or its plan stopped drafting).
STALE_S = 2.0
# The parent's calls wait this much longer than the granted draft calls are priced at (hold_s): the batcher's
# round-trip per call (a wait for every member, the logits copied out) is not in the calibrated call times.
HOLD_SLACK = 1.5
ALPHA_WEIGHT = 8.0  # the calibration's agreement counts as this many observed tokens in the pooled acceptance


def round_price(cal, role: str, b: int, m: int, calls: int, alpha: float,
                runs: Optional[list[float]] = None) -> tuple[float, float]:
    """(seconds, tokens) of one cycle of a batch of `b` sequences of which `m` draft with `role` in `calls`
    calls each (the first catches up on the last cycle's two tokens) and the others decode one token: the
    draft calls on m sequences' tokens, then one parent call on all of them. `cal` is one sequence's
    calibration (call_s, draft_call); a cycle's tokens per drafting sequence are `runs[calls - 1]` (measured
    runs) when given, else the geometric E(alpha, calls)."""
    if calls <= 0 or m <= 0:
        return cal.call_s(b), float(b)
    draft = cal.draft_call(role, 2 * m) + (calls - 1) * cal.draft_call(role, m)
    verify = cal.call_s(b - m + m * (calls + 1))
    made = runs[calls - 1] if runs and len(runs) >= calls else expected_tokens(alpha, calls)
    return draft + verify, (b - m) + m * made


def best_calls(cal, role: str, b: int, m: int, alpha: float, runs: Optional[list[float]] = None,
               most: int = GAMMA_MAX, rest: bool = True) -> tuple[int, float]:
    """(calls, speedup): the draft calls per cycle with the fewest seconds per token of the batch, and its
    speedup over the parent alone at this batch (1.0 and 0 calls when no draft clears ROUND_MARGIN). With
    `rest` False (a policy that always drafts) at least one call, whatever the speedup."""
    s0, t0 = round_price(cal, role, b, m, 0, alpha)
    base = s0 / t0
    best, gain = 0, 0.0
    for c in range(1, most + 1):
        s, t = round_price(cal, role, b, m, c, alpha, runs)
        if t > 0 and base / (s / t) > gain:
            best, gain = c, base / (s / t)
    return (best, gain) if gain >= ROUND_MARGIN or not rest else (0, 1.0)


class RoundPacer:
    """The model drafts' pace for a server's slots. `calibration()` gives one sequence's measured costs (None:
    uncalibrated, and drafters pace themselves), `members()` the sequences decoding together now (the
    batcher's members). Drafters `ask` before each draft and report each verified draft (`observe`): the
    acceptance is pooled per draft model, as the batch prices one round for all of them."""

    def __init__(self, calibration: Callable[[], object], members: Callable[[], int]):
        self._calibration = calibration
        self._members = members
        self._lock = threading.Lock()
        # id(drafter) -> (role, when it last asked, the calls it was given)
        self._drafting: dict[int, tuple[str, float, int]] = {}
        self._alpha: dict[str, Acceptance] = {}
        self.decisions: dict[tuple[int, int], int] = {}  # (b, m) -> calls: what the last rounds were given

    def ask(self, who: int, role: str, position: int = 0, rest: bool = True) -> Optional[int]:
        """Calls drafter `who` (a `role` model, its sequence at context `position`) may make before this cycle's
        verification: None when its sequence decodes alone or nothing is calibrated (its own γ policy
        decides), 0 when no draft lowers the batch's time per token and the drafter may `rest` (a planned
        policy's; one that always drafts gets at least one call)."""
        cal = self._calibration()
        b = self._members()
        now = time.monotonic()
        with self._lock:
            self._drafting[who] = (role, now, 0)
            for k in [k for k, (_, t, _) in self._drafting.items() if now - t > STALE_S]:
                del self._drafting[k]
            m = sum(1 for r, _, _ in self._drafting.values() if r == role)
            if b <= 1 or cal is None or role not in getattr(cal, "draft_step_s", {}):
                return None
            m = min(m, b)
            at = cal.at(position) if position and hasattr(cal, "at") else cal
            calls, _ = best_calls(at, role, b, m, self._acceptance(role, cal).alpha, rest=rest)
            self.decisions[(b, m)] = calls
            self._drafting[who] = (role, now, calls)
            return calls

    def hold_s(self) -> Optional[float]:
        """How long the parent's calls may wait for the drafting sequences' draft calls (decoding.batch): the
        draft calls the pacer granted this cycle, priced at the batch's size, with HOLD_SLACK for the rounds'
        own overhead; 0 when nothing drafts; None when nothing is calibrated (the batcher's fixed bound)."""
        cal = self._calibration()
        if cal is None:
            return None
        now = time.monotonic()
        longest = 0.0
        with self._lock:
            roles = {r for r, t, c in self._drafting.values() if c and now - t <= STALE_S}
            for role in roles:
                entries = [c for r, t, c in self._drafting.values() if r == role and c and now - t <= STALE_S]
                m, calls = len(entries), max(entries)
                one = cal.draft_call(role, m) if hasattr(cal, "draft_call") else None
                if one:
                    longest = max(longest, (cal.draft_call(role, 2 * m) + (calls - 1) * one) * HOLD_SLACK)
        return longest

    def pace(self, rest: bool, beside: Callable[[], int] = lambda: 0) -> Pace:
        """This pacer as one policy's model drafters in one slot use it: a planned policy's may `rest` (draft
        nothing while drafting would slow the batch), a fixed one's always draft; `beside()`: the positions the
        other slots hold in the same KV caches (every call reads them too)."""
        return Pace(self, rest, beside)

    def observe(self, role: str, proposed: int, accepted: int) -> None:
        with self._lock:
            cal = self._calibration()
            self._acceptance(role, cal).observe(accepted, proposed)

    def _acceptance(self, role: str, cal) -> Acceptance:
        a = self._alpha.get(role)
        if a is None:
            prior = (getattr(cal, "agreement", {}) or {}).get(role, 0.8) if cal is not None else 0.8
            a = self._alpha[role] = Acceptance(min(0.95, prior), ALPHA_WEIGHT, decay=0.97)
        return a


class Pace:
    """A RoundPacer as one policy's model drafters in one slot see it: `ask` (the calls this cycle may make, the
    other slots' positions counted in) and `observe` (a verified draft), with the policy's `rest`."""

    def __init__(self, pacer: RoundPacer, rest: bool, beside: Callable[[], int] = lambda: 0):
        self.pacer, self.rest, self.beside = pacer, rest, beside

    def ask(self, who: int, role: str, position: int = 0) -> Optional[int]:
        return self.pacer.ask(who, role, position + self.beside(), self.rest)

    def observe(self, role: str, proposed: int, accepted: int) -> None:
        self.pacer.observe(role, proposed, accepted)
