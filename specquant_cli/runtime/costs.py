"""The cost model: this machine's measured costs for a family (system.calibration: read, checked, measured
when missing, saved) and what they decide here — the verify cost a drafter weighs and the draft-length
policy a plan names. `BatchCosts` is the same model as one of B sequences decoded together sees it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from specquant_cli.decoding.gamma import (
    CALIBRATED_PRIOR_COUNTS,
    GAMMA_MAX,
    PRIOR_PSEUDO_COUNTS,
    SUFFIX_GAMMA_MAX,
    AdaptiveGamma,
    FixedGamma,
    copy_length,
)
from specquant_cli.decoding.registry import drafter_spec
from specquant_cli.errors import InputError, ResourceError
from specquant_cli.family.roles import PARENT_ROLE
from specquant_cli.reporting import SILENT, Reporter
from specquant_cli.routing.plan import Plan
from specquant_cli.runtime.pool import Models
from specquant_cli.settings import DEFAULT_GAMMA


class CostModel:
    """`gamma`: the session's draft length γ (fixed, or where an adaptive policy starts). `report`: where
    calibration's progress and warnings go (the command layer's stderr reporter; silent by default)."""

    batch = 1  # the sequences decoded together that these costs are for
    pacer = None  # the batch's round pacer (decoding.rounds.RoundPacer): only a batch view has one

    @staticmethod
    def beside() -> int:
        """Positions other sequences hold in the same KV caches (a batch view's; none alone)."""
        return 0

    def __init__(self, pool: Models, gamma: int = DEFAULT_GAMMA, report: Reporter = SILENT):
        self.pool = pool
        self.gamma = gamma
        self.report = report
        self._calibration = None
        self._said: set[str] = set()

    def calibration(self, measure: bool = True, force: bool = False, require_save: bool = False):
        """This machine's measured costs for the family (system.calibration): read from the family folder (or
        the user cache, for a family folder that cannot be written), else measured now (with progress through
        `report`) and saved there; None when `measure` is False and nothing valid is cached. A stored entry is
        checked on every read: an invalid one is not used, and the reason is reported (once). A cached entry
        that lacks a draft role the family has gained since (a recipe added by `quantize --types`) is measured
        again when `measure` is True; `force` measures regardless. `require_save`: refuse (before measuring)
        when the result could be saved nowhere."""
        from specquant_cli.system import calibration_file as cal

        pool = self.pool
        if force:
            self._calibration = self._measure(cal, self._fingerprint(cal), require_save)
        if self._calibration is None or (measure and self._uncalibrated()):
            fp = self._fingerprint(cal)
            self._calibration, why = cal.load_checked(pool.family.root, fp)
            if measure and (self._calibration is None or self._uncalibrated()):
                if why:
                    self._say_once(f"calibration: {why}; measuring again")
                self._calibration = self._measure(cal, fp, require_save)
            elif why:
                self._say_once(f"calibration: {why}; not used (specquant calibrate measures it again)")
        return self._calibration

    def _fingerprint(self, cal) -> dict:
        pool = self.pool
        return cal.fingerprint(pool.facts, pool.threads, pool.rpc, parent=pool.family.parent_rendering)

    def _say_once(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            self.report.say(line)

    def _uncalibrated(self) -> list[str]:
        c = self._calibration
        return [r for r in self.pool.draft_roles if c is None or (r not in c.draft_step_s and r not in c.left_out)]

    def _measure(self, cal, fp, require_save: bool = False):
        from specquant_cli.system import measure

        pool = self.pool
        if require_save:
            cal.save_target(pool.family.root)  # a one-line error now, not after a minute of measuring
        before = set(pool.loaded())
        pool.ensure([PARENT_ROLE])
        drafts, skipped = [], []
        for role in pool.draft_roles:  # as many drafts as fit beside the parent; the rest are left out
            try:
                pool.ensure([role])
                drafts.append(role)
            except ResourceError:
                skipped.append(role)
        if skipped:
            self.report.say(f"calibration: {', '.join(skipped)} left out (not enough memory beside the others); "
                            "auto will not pick them")
        with self.report.status("calibrating this machine's costs (once per family and machine)") as status:
            c = measure.measure(pool.context, PARENT_ROLE, drafts,
                                lambda what, i, n: status.update(f"calibrating: {what} ({i}/{n})"),
                                siblings=pool.family.siblings())
            pool.release([r for r in drafts if r not in before])  # loaded only to be measured
            c.renderings = self._compare_renderings(lambda what: status.update(f"calibrating: {what}"))
        c.left_out = skipped
        self._save(cal, fp, c, require_save)
        return c

    def _compare_renderings(self, tick) -> dict:
        """Both renderings of the parent timed back to back (system.measure.compare_renderings), when the family
        has both, the parent runs here and the CPU has BF16 dot products (without them F16 stays: nothing to
        compare); {} otherwise, or when the other rendering does not fit beside what is loaded."""
        from specquant_cli.system import measure
        from specquant_cli.system.renderings import bf16_dot

        pool = self.pool
        serving = pool.family.parent_rendering
        others = [r for r in pool.family.renderings() if r != serving]
        if not others or pool.rpc or bf16_dot(pool.facts) is None:
            return {}
        try:
            pool.ensure(others)
        except ResourceError:
            self.report.say(f"calibration: the {others[0]} rendering does not fit beside the parent; renderings "
                            "not compared")
            return {}
        try:
            return measure.compare_renderings(lambda r: pool.context(PARENT_ROLE if r == serving else r),
                                              [serving, *others], tick)
        finally:
            pool.release(others)

    def _save(self, cal, fp, c, require_save: bool) -> None:
        root = self.pool.family.root
        try:
            where, why = cal.save(root, fp, c)
            if why is not None:
                self.report.say(f"calibration: cannot write in the family folder {root} ({why}); "
                                f"this machine's costs are kept in {where}")
        except OSError as e:
            if require_save:
                raise InputError(f"calibration not saved ({e.strerror or e})") from None
            self.report.warn(f"calibration not saved ({e.strerror}): it is measured again next time")

    def verify_cost(self) -> Callable[[int], float]:
        """A parent call on n tokens relative to one token (measured, or the prior shape), and its `at(pos)`: the same
        after pos positions of context where the calibration measured calls deep in it (decoding.gamma.CallCost)."""
        from specquant_cli.decoding.gamma import CallCost, verify_shape

        c = self.calibration(measure=False)
        if c is None:
            return CallCost(verify_shape)
        return CallCost(c.verify_cost, (lambda pos: c.at(pos).verify_cost) if c.deep_call_s else None)

    def copy_length(self) -> int:
        """The draft length a copied answer is planned at (decoding.gamma.copy_length): from this machine's measured
        call-cost curve, within the calls it measured (an older calibration's, up to 16 tokens, gives the least:
        SUFFIX_GAMMA_MAX); SUFFIX_GAMMA_MAX uncalibrated."""
        c = self.calibration(measure=False)
        if c is None:
            return SUFFIX_GAMMA_MAX
        return copy_length(c.verify_cost, c.longest_call)

    def model_gamma(self, role: str) -> AdaptiveGamma:
        """Adaptive γ for `role`'s drafts, starting at the session's γ, its cost estimates seeded with the
        calibration when there is one."""
        c = self.calibration(measure=False)
        prior = dict(c.parent_call_s) if c else None
        draft = c.draft_step_s.get(role) if c else None
        measured = c is not None and role in c.agreement
        alpha = min(0.95, c.agreement[role]) if measured else 0.5  # capped: 256 tokens cannot promise more
        return AdaptiveGamma(gamma_max=max(GAMMA_MAX, self.gamma), gamma_init=self.gamma, verify_prior=prior,
                             draft_prior=draft, alpha_prior=alpha,
                             prior_counts=CALIBRATED_PRIOR_COUNTS if measured else PRIOR_PSEUDO_COUNTS)

    def parent_step_s(self) -> Optional[Callable[[int], float]]:
        """Seconds a sequence waits for one token of the parent alone at a context position (calibrated against
        the position when measured): one round of the batch these costs are for, which every sequence of it
        waits out whole; None when uncalibrated."""
        c = self.calibration(measure=False)
        if c is None:
            return None
        return lambda pos: c.call_s_at(1, pos) * c.batch

    def draft_cost(self, role: str) -> Callable[[int], float]:
        """A call of `role`'s model on n tokens relative to one token: its measured batch curve, else the
        prior shape (decoding.gamma.verify_shape)."""
        from specquant_cli.decoding.gamma import verify_shape

        c = self.calibration(measure=False)
        one = c.draft_call(role, 1) if c is not None and hasattr(c, "draft_call") else None
        if not one:
            return verify_shape
        return lambda n: c.draft_call(role, n) / one

    def gamma_policy(self, plan: Plan):
        """The draft-length policy `plan.gamma_policy` names (routing.plan.GammaPolicyKind)."""
        kind = plan.gamma_policy
        if kind == "capped":
            return FixedGamma(plan.gamma_cap)  # the drafter sizes its drafts itself, up to the cap
        if kind == "calibrated":
            return self.model_gamma(drafter_spec(plan.drafter).roles[0])
        if kind == "adaptive":
            return AdaptiveGamma(gamma_max=max(GAMMA_MAX, self.gamma), gamma_init=self.gamma)
        return FixedGamma(0 if kind == "none" else self.gamma)

    def for_batch(self, batch_size: Callable[[], int], pacer=None, beside: Callable[[], int] = lambda: 0
                  ) -> BatchCosts:
        return BatchCosts(self, batch_size, pacer, beside)


class BatchCosts(CostModel):
    """`base`'s costs as one of `batch_size()` sequences decoded together sees them (Calibration.for_batch),
    after the `beside()` positions the other sequences hold in the same KV caches: what a serving slot plans
    with, and the `pacer` its model drafts share with the other slots'. Never measures: the pool's model does,
    before serving starts."""

    def __init__(self, base: CostModel, batch_size: Callable[[], int], pacer=None,
                 beside: Callable[[], int] = lambda: 0):
        super().__init__(base.pool, base.gamma, base.report)
        self._base = base
        self._batch_size = batch_size
        self.pacer = pacer
        self.beside = beside

    @property
    def batch(self) -> int:
        return self._batch_size()

    def calibration(self, measure: bool = True, force: bool = False, require_save: bool = False):
        c = self._base.calibration(measure=False)
        return c.for_batch(self.batch, self.beside()) if c is not None else None
