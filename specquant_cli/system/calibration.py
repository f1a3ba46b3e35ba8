"""What this machine's calls cost for a family, as the `auto` policy reads it: a `Calibration` holds the measured
curves — the parent's call on 1..MAX_BATCH tokens and on LONG_CALLS, each draft role's call on 1..DRAFT_BATCH
tokens, its one-token step and two-token catch-up, prefill per token, the same calls deep in the context (attention
reads every cached position) and the parent's farther still, the drafts' imports of the parent's cache, each draft's
agreement with the parent, and where the family holds both renderings of its parent, both timed back to back — and
prices a call, a draft cycle or an import from them, after any number of positions (`at`) and for one of B
sequences decoded together (`for_batch`).

system.measure measures one; system.calibration_file stores it in the family folder (or the user cache), keyed by
a hardware fingerprint, and checks every stored entry on every read."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Optional

from specquant_cli.family.roles import PARENT_ROLE

MAX_BATCH = 16  # parent call sizes measured: 1..MAX_BATCH tokens, and LONG_CALLS
# Longer parent calls, measured for the drafts of a copied answer (decoding.gamma.COPY_GAMMA_MAX + 1 the longest).
# A calibration stored before they were measured holds 1..MAX_BATCH only: it still loads, and a copy is then planned
# within what it measured (decoding.gamma.copy_length); `specquant calibrate` measures them.
LONG_CALLS = (24, 32, 48, 64)
DRAFT_BATCH = 8  # draft call sizes measured: 1..DRAFT_BATCH tokens (a draft verifying another's proposals)
DEEP_POS = 1024  # the deep position measured, when the context has room for it and a call after it
DEEP_MIN = 256  # a context with less room than this is not measured deep (too close to PREFILL_TOKENS)
DEEP_SIZES = (1, 4, 8)  # a draft's call sizes measured at the deep position
# the parent's: its verify calls of a copy are that long, and deep in an edit's context a 25-token call costs 1.5x its
# figure near the start where a one-token call costs 1.2x (1.5B BF16 parent, AMD EPYC): the factor grows with the size
DEEP_PARENT_SIZES = (1, 4, 8, 16, 32, 64)
# Where an agent's calls happen (2,000-4,000 positions): the parent's calls (DEEP_PARENT_SIZES) measured there too,
# when the context has room for it, FAR_MIN past the deep position at least. The line through the deep figures alone
# misses there by more than the drift, either way (1.5B BF16 parent, AMD EPYC, a 64-token call after 2,560
# positions: 14 % over what `bench calls` measured in one run, 7 % under what a calibration measured in another).
FAR_POS = 2560
FAR_MIN = 512
PREFILL_TOKENS = 64  # the synthetic prompt every call is measured after
RENDERING_SIZES = (1, 4, 8, 16)  # call sizes the renderings' comparison times


@dataclass
class Calibration:
    parent_call_s: dict[int, float]  # tokens in one parent call -> seconds
    draft_step_s: dict[str, float] = field(default_factory=dict)  # role -> seconds per one-token step
    prefill_token_s: dict[str, float] = field(default_factory=dict)  # role -> seconds per prompt token
    agreement: dict[str, float] = field(default_factory=dict)  # role -> teacher-forced argmax agreement
    # role -> expected tokens per cycle for draft lengths 1..MAX_BATCH-1, from the agreement pass: at every
    # position, how many drafted tokens in a row would have been kept (+1 for the parent's own). Rejections
    # cluster, so this is higher than the geometric E(alpha, g) of the same agreement rate.
    tokens_per_cycle: dict[str, list[float]] = field(default_factory=dict)
    # role -> seconds for a two-token draft call: after a verify the draft catches up on the last drafted
    # token and the parent's own in one call (on this CPU a Q8_0 pair costs 2.2-2.6 single steps)
    draft_pair_s: dict[str, float] = field(default_factory=dict)
    fingerprint: dict = field(default_factory=dict)
    measured_at: str = ""
    left_out: list[str] = field(default_factory=list)  # draft roles not measured (no memory for them beside the rest)
    # role -> tokens in one draft call (1..DRAFT_BATCH) -> seconds, after PREFILL_TOKENS positions: what a
    # draft pays to verify several proposed tokens in one call (a second drafting level)
    draft_call_s: dict[str, dict[int, float]] = field(default_factory=dict)
    # role (the parent's too) -> tokens in one call (DEEP_SIZES) -> seconds, after deep_pos positions
    deep_call_s: dict[str, dict[int, float]] = field(default_factory=dict)
    deep_pos: int = 0  # the position deep_call_s was measured at; 0: not measured (the context was too small)
    # the parent -> tokens in one call (DEEP_PARENT_SIZES) -> seconds, after far_pos positions (beyond deep_pos)
    far_call_s: dict[str, dict[int, float]] = field(default_factory=dict)
    far_pos: int = 0  # the position far_call_s was measured at; 0: not measured (stored before, or no room)
    # draft role -> positions in the parent's cache -> seconds to export it and import it into the draft's
    import_s: dict[str, dict[int, float]] = field(default_factory=dict)
    # rendering (f16, bf16) -> {"prefill_token_s": s, "call_s": {tokens: s}}, timed back to back (compare_renderings);
    # empty when the family has one rendering or the CPU no BF16 dot products
    renderings: dict[str, dict] = field(default_factory=dict)

    def verify_cost(self, n: int) -> float:
        """A parent call on n tokens, relative to a one-token call (linear between and beyond the measured sizes)."""
        return _curve_at(self.parent_call_s, n) / self.parent_call_s[1]

    @property
    def longest_call(self) -> int:
        """The most tokens of a parent call measured (MAX_BATCH for a calibration stored before LONG_CALLS were)."""
        return max(self.parent_call_s)

    def draft_ratio(self, role: str) -> Optional[float]:
        """A draft step relative to a one-token parent call."""
        return self.draft_step_s[role] / self.parent_call_s[1] if role in self.draft_step_s else None

    def draft_cycle(self, role: str, g: int) -> Optional[float]:
        """A draft cycle of g tokens relative to a one-token parent call: g - 1 steps, plus the catch-up of
        the previous cycle — a two-token call after a full accept, one token after a rejection."""
        if role not in self.draft_step_s:
            return None
        step = self.draft_step_s[role]
        pair = self.draft_pair_s.get(role, 2 * step)
        e = self.tokens_per_cycle.get(role)
        p_full = (e[g - 1] - (e[g - 2] if g > 1 else 1.0)) if e and len(e) >= g else 0.5
        return (p_full * pair + (1 - p_full) * step + (g - 1) * step) / self.parent_call_s[1]

    batch = 1  # sequences decoding together that the figures are per-sequence shares of (for_batch)
    single = None  # for a batch view: the costs of one sequence alone (a Calibration; not a stored field)
    beside = 0  # for a batch view: positions the other sequences of the same KV cache hold (for_batch)

    def call_s(self, n: int) -> float:
        """Seconds of a parent call on n tokens (linear beyond the measured sizes)."""
        return self.verify_cost(n) * self.parent_call_s[1]

    def draft_call(self, role: str, n: int) -> Optional[float]:
        """Seconds of one call of the draft `role` on n tokens (linear beyond the measured sizes). Data
        measured before draft calls were (only a one-token step): the step times the prior shape of a
        call's cost by size. None when the role was not measured."""
        curve = self.draft_call_s.get(role)
        if curve:
            return _curve_at(curve, n)
        if role in self.draft_step_s:
            from specquant_cli.decoding.gamma import verify_shape

            return self.draft_step_s[role] * verify_shape(n)
        return None

    def depth_factor(self, role: str, n: int, pos: int) -> float:
        """A call of `role` on n tokens after `pos` positions, relative to the same call after
        PREFILL_TOKENS: piecewise linear in pos through 1.0 at PREFILL_TOKENS, the measured factor at deep_pos
        and, where the role was measured there too, the one at far_pos (for a size not measured, the factor
        interpolated between the measured sizes, the nearest one beyond them), extrapolated beyond the last
        measured position along its last piece. Never below 1.0 (a call does not get cheaper with more text
        before it: a measured factor below 1 is noise) nor, past deep_pos, below the deep factor; 1.0 up to
        PREFILL_TOKENS and when the role was not measured deep. On a batch view, the figures of one sequence
        alone."""
        deep = self._deep_factors(role)
        if not deep or self.deep_pos <= PREFILL_TOKENS:
            return 1.0
        at_deep = max(1.0, _interpolate(deep, n))
        far = self._deep_factors(role, far=True) if pos > self.deep_pos and self.far_pos > self.deep_pos else None
        if far:
            at_far = max(at_deep, _interpolate(far, n))
            return at_deep + (at_far - at_deep) * (pos - self.deep_pos) / (self.far_pos - self.deep_pos)
        return 1.0 + (at_deep - 1.0) * max(0, pos - PREFILL_TOKENS) / (self.deep_pos - PREFILL_TOKENS)

    def _deep_factors(self, role: str, far: bool = False) -> dict[int, float]:
        """Call size -> the deep (`far`: the far) call's cost over the same call after PREFILL_TOKENS, where both
        were measured."""
        own = self.single or self
        base = own.parent_call_s if role == PARENT_ROLE else own.draft_call_s.get(role, {})
        deep = (own.far_call_s if far else own.deep_call_s).get(role, {})
        return {n: deep[n] / base[n] for n in deep if n in base}

    def call_s_at(self, n: int, pos: int) -> float:
        """Seconds of a parent call on n tokens after `pos` positions (call_s scaled by depth_factor; on a
        batch view, the factor of the whole batch's call, after `beside` more positions)."""
        return self.call_s(n) * self.depth_factor(PARENT_ROLE, n * self.batch, pos + self.beside)

    def at(self, pos: int) -> Calibration:
        """These costs after `pos` positions of context (and, on a batch view, the `beside` positions the other
        sequences hold): every parent call and draft call scaled by its depth_factor (a batch view stays one,
        its parent calls scaled as the whole batch's call; `beside` is then counted in). Unchanged where
        nothing was measured deep."""
        pos += self.beside
        if not self.deep_call_s or pos <= PREFILL_TOKENS:
            return self

        def scaled(role: str, curve: dict[int, float], per: int = 1) -> dict[int, float]:
            return {n: s * self.depth_factor(role, n * per, pos) for n, s in curve.items()}

        view = replace(self, parent_call_s=scaled(PARENT_ROLE, self.parent_call_s, self.batch),
                       draft_step_s={r: s * self.depth_factor(r, 1, pos) for r, s in self.draft_step_s.items()},
                       draft_pair_s={r: s * self.depth_factor(r, 2, pos) for r, s in self.draft_pair_s.items()},
                       draft_call_s={r: scaled(r, c) for r, c in self.draft_call_s.items()})
        view.batch, view.single = self.batch, self.single
        return view

    def import_cost(self, role: str, n_tokens: int) -> Optional[float]:
        """Seconds for the draft `role` to import the parent's cache of n_tokens positions: linear through
        the measured lengths (in proportion to the one length when only one was measured); never falling
        with length. None when the role's import was not measured (refused, or not tried)."""
        points = self.import_s.get(role)
        if not points:
            return None
        lo, hi = min(points), max(points)
        if lo == hi:
            return points[lo] * n_tokens / lo
        slope = max(0.0, (points[hi] - points[lo]) / (hi - lo))
        return max(0.0, points[lo] + slope * (n_tokens - lo))

    def prefill_cost(self, role: str, n_tokens: int) -> Optional[float]:
        """Seconds for `role` to prefill n_tokens prompt tokens itself (a sibling draft, which cannot import the
        parent's cache); None when its prefill was not measured."""
        per = self.prefill_token_s.get(role)
        return per * n_tokens if per is not None else None

    def for_batch(self, b: int, beside: int = 0) -> Calibration:
        """The costs one of `b` sequences decoding together sees: a parent call with n tokens for each costs
        call(b * n), shared b ways; a draft step costs what it costs alone (decoding.rounds prices a model draft
        per batch round). `beside`: the positions the other sequences of the same KV cache hold — one unified
        cache for every sequence, so attention reads their cells too (masked), and every call costs as if after
        that many more positions (`at`, `call_s_at`). b = 1 and nothing beside: self."""
        if b <= 1 and not beside:
            return self
        view = replace(self, parent_call_s={n: self.call_s(b * n) / b for n in self.parent_call_s})
        view.batch, view.single, view.beside = max(1, b), self, max(0, beside)
        return view

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        """From a stored entry (JSON: call sizes and positions as strings); fields it lacks take their defaults."""
        return cls(parent_call_s=_sized(d["parent_call_s"]),
                   draft_step_s=_per_role(d.get("draft_step_s", {})),
                   prefill_token_s=_per_role(d.get("prefill_token_s", {})),
                   agreement=_per_role(d.get("agreement", {})),
                   tokens_per_cycle={k: [float(x) for x in v] for k, v in d.get("tokens_per_cycle", {}).items()},
                   draft_pair_s=_per_role(d.get("draft_pair_s", {})),
                   fingerprint=d.get("fingerprint", {}), measured_at=d.get("measured_at", ""),
                   left_out=[str(r) for r in d.get("left_out", [])],
                   draft_call_s={k: _sized(v) for k, v in d.get("draft_call_s", {}).items()},
                   deep_call_s={k: _sized(v) for k, v in d.get("deep_call_s", {}).items()},
                   deep_pos=int(d.get("deep_pos", 0)),
                   far_call_s={k: _sized(v) for k, v in d.get("far_call_s", {}).items()},
                   far_pos=int(d.get("far_pos", 0)),
                   import_s={k: _sized(v) for k, v in d.get("import_s", {}).items()},
                   renderings={r: {"prefill_token_s": float(t["prefill_token_s"]), "call_s": _sized(t["call_s"])}
                               for r, t in d.get("renderings", {}).items()})


def _sized(d: dict) -> dict[int, float]:
    """{size or position: seconds} with integer keys (JSON stores them as strings)."""
    return {int(k): float(v) for k, v in d.items()}


def _per_role(d: dict) -> dict[str, float]:
    return {k: float(v) for k, v in d.items()}


def _curve_at(curve: dict[int, float], n: int) -> float:
    """A measured cost curve (call size -> seconds) at n: the measured figure; between two measured sizes above
    MAX_BATCH (LONG_CALLS), the line through them; else the line through the largest size and half of it (the
    calls grow linearly once the matrix kernels are saturated)."""
    if n in curve:
        return curve[n]
    above = [k for k in curve if k > n]
    if n > MAX_BATCH and above:
        lo, hi = max(k for k in curve if k < n), min(above)
        return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)
    top = max(curve)
    half = max((k for k in curve if k <= top // 2), default=top)
    slope = (curve[top] - curve[half]) / (top - half) if half < top else 0.0
    return curve[top] + slope * (n - top)


def _interpolate(points: dict[int, float], x: int) -> float:
    """Piecewise-linear through `points` at x; the nearest end's value beyond them."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]]
    hi = next(k for k in xs if k >= x)
    lo = max(k for k in xs if k < x)
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def monotone(curve: dict[int, float]) -> dict[int, float]:
    """A call on fewer tokens cannot cost more than one on more: each size's figure capped by the next."""
    out = dict(curve)
    sizes = sorted(out)
    for small, big in zip(reversed(sizes[:-1]), reversed(sizes[1:])):
        out[small] = min(out[small], out[big])
    return out
