"""The verify limit: the speed a drafter that is always right, at no cost, would give an answer on this machine.

Such a drafter leaves the parent its prefill and its verifying calls, every drafted token kept: the answer's first
token comes with the prefill, and from there each call is the size (among those the calibration prices, never more
than the tokens left) that makes the most tokens per second at that call's depth in the context (the depth-aware
curve, system.calibration.Calibration.call_s_at), every token of it kept. Time per answer = its own measured prefill +
the calls' calibrated seconds. A policy's share of the limit is the limit's time over its own, summed over the items
(time-weighted): 1.0 is a perfect drafter, and the parent alone sits at its own tokens' cost against the limit's."""

from __future__ import annotations

from typing import Optional


def decode_s(cal, prompt_tokens: int, new_tokens: int) -> float:
    """Seconds of the parent's calls that make `new_tokens` after `prompt_tokens` when every draft is right."""
    sizes = range(1, cal.longest_call + 1)
    pos, left, s = prompt_tokens, new_tokens - 1, 0.0  # a call of n: the last token and n - 1 drafts, n kept
    while left > 0:
        n = max((k for k in sizes if k <= left), key=lambda k: (k / cal.call_s_at(k, pos), k))
        s += cal.call_s_at(n, pos)
        pos, left = pos + n, left - n
    return s


def limit_s(cal, prompt_tokens: int, new_tokens: int, prefill_s: float) -> Optional[float]:
    """An answer's time at the verify limit (its own prefill included); None without a calibration."""
    if cal is None or not new_tokens:
        return None
    return prefill_s + decode_s(cal, prompt_tokens, new_tokens)
