"""Draft length: fixed, or adapted from observed acceptance and measured costs.

Cost model of one cycle with draft length g: g draft steps + one parent call on g+1 tokens.
With per-token acceptance a, a cycle yields E(a, g) = (1 - a^(g+1)) / (1 - a) tokens.
The adaptive controller picks the g in [0, g_max] with the most expected tokens per second."""

from __future__ import annotations

from typing import Optional



def verify_shape(n: int) -> float:
    """Prior shape of a parent call's cost by batch size, relative to one token: on CPUs the step from
    one token (matrix-vector) to two (matrix-matrix kernels) costs ~50 %, each further token ~10 %."""
    return 1.0 if n <= 1 else 1.5 + 0.1 * (n - 2)


class FixedGamma:
    def __init__(self, gamma: int):
        self.gamma = max(0, int(gamma))

    def next(self) -> int:
        return self.gamma

    def update(self, proposed: int, accepted: int, draft_s: float, verify_s: float, batch: int) -> None:
        pass

    def __repr__(self) -> str:
        return f"fixed({self.gamma})"


def expected_tokens(alpha: float, g: int) -> float:
    if g == 0:
        return 1.0
    if alpha >= 0.999:
        return g + 1.0
    return (1.0 - alpha ** (g + 1)) / (1.0 - alpha)


class AdaptiveGamma:
    """EMA estimates of acceptance, draft cost per token and verify cost per batch size."""

    def __init__(self, g_max: int = 8, g_init: int = 4, decay: float = 0.85, probe_every: int = 16,
                 alpha_prior: float = 0.5):
        self.g_max = g_max
        self.gamma = g_init
        self.decay = decay
        self.probe_every = probe_every
        self.acc, self.rej = alpha_prior * 4, (1 - alpha_prior) * 4  # pseudo-counts
        self.t_draft: Optional[float] = None
        self.t_verify: dict[int, float] = {}
        self._since_draft = 0

    @property
    def alpha(self) -> float:
        return self.acc / max(1e-9, self.acc + self.rej)

    def _ema(self, old: Optional[float], new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def update(self, proposed: int, accepted: int, draft_s: float, verify_s: float, batch: int) -> None:
        if proposed:
            rejected = 1 if accepted < proposed else 0
            self.acc = self.decay * self.acc + accepted
            self.rej = self.decay * self.rej + rejected
            self.t_draft = self._ema(self.t_draft, draft_s / proposed)
        self.t_verify[batch] = self._ema(self.t_verify.get(batch), verify_s)
        self.gamma = self._choose()

    def _verify_cost(self, n: int) -> Optional[float]:
        """Measured cost of a parent call on n tokens, else the nearest measured size scaled by the prior."""
        if n in self.t_verify:
            return self.t_verify[n]
        if not self.t_verify:
            return None
        k = min(self.t_verify, key=lambda m: (abs(m - n), m))
        return self.t_verify[k] * verify_shape(n) / verify_shape(k)

    def _choose(self) -> int:
        if self.t_draft is None or not self.t_verify:
            return self.gamma
        best, best_rate = 0, 0.0
        for g in range(0, self.g_max + 1):
            cost = g * self.t_draft + (self._verify_cost(g + 1) or 0.0)
            rate = expected_tokens(self.alpha, g) / max(cost, 1e-9)
            if rate > best_rate * 1.01:  # prefer the shorter draft on near ties
                best, best_rate = g, rate
        return best

    def next(self) -> int:
        if self.gamma == 0:
            self._since_draft += 1
            if self._since_draft >= self.probe_every:  # re-probe: acceptance may have changed
                self._since_draft = 0
                return 1
        return self.gamma

    def __repr__(self) -> str:
        return f"adaptive(g={self.gamma}, alpha={self.alpha:.2f})"
