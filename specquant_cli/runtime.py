"""A session's models: loaded lazily per family role, checked against the placement plan first, kept
loaded for the rest of the session; and the engine a plan asks for."""

from __future__ import annotations

from typing import Optional

from specquant_cli.backend.llama import Context, Model, check_same_vocab
from specquant_cli.decoding.engine import DEFAULT_GAMMA, Engine
from specquant_cli.decoding.gamma import CALIBRATED_PRIOR_COUNTS, PRIOR_PSEUDO_COUNTS, AdaptiveGamma, FixedGamma
from specquant_cli.decoding.protocols import Drafter
from specquant_cli.decoding.registry import drafter_spec, register_family_drafters
from specquant_cli.decoding.sampling import SamplingParams
from specquant_cli.family.manifest import Family
from specquant_cli.family.roles import PARENT_ROLE
from specquant_cli.reporting import SILENT, Reporter
from specquant_cli.routing.policies import Plan, Planner, policy_spec

ADAPTIVE_GAMMA_MAX = 8  # the adaptive controller's longest model draft


class Runtime:
    def __init__(self, family: Family, n_ctx: int = 4096, gamma: int = DEFAULT_GAMMA, threads: Optional[int] = None,
                 p_min: Optional[float] = None, facts=None, kv_import: bool = True, rpc: Optional[list[str]] = None,
                 parallel: int = 1, report: Reporter = SILENT):
        """`parallel`: sequences every context holds (serving.slots gives each concurrent request one), each
        with `n_ctx` positions of its own. `report`: where calibration's progress and warnings go (the command
        layer's stderr reporter; silent by default)."""
        from specquant_cli.system import rpc as rpc_mod

        self.family = family
        self.rpc = list(rpc) if rpc is not None else rpc_mod.configured()  # the parent's RPC workers, if any
        self.n_ctx = n_ctx
        self.parallel = max(1, parallel)
        self.gamma = gamma
        self.threads = threads
        self.p_min = p_min
        self.report = report
        self.kv_import = kv_import  # model drafters import the parent's KV cache instead of prefilling
        self._facts = facts
        self._ctx: dict[str, Context] = {}
        self._vocab: Optional[Model] = None
        self._drafters: dict[str, Drafter] = {}  # persistent drafters, kept across requests
        self.scope = ""  # the policy whose drafter is being built
        self._calibration = None
        self._planners: dict[str, Optional[Planner]] = {}  # per policy, kept for the session (they learn)
        self._draft_roles = register_family_drafters(family.roles())  # a custom graded role drafts too

    @property
    def facts(self):
        if self._facts is None:
            from specquant_cli.system.hardware import detect

            self._facts = detect()
        return self._facts

    def loaded(self) -> list[str]:
        return list(self._ctx)

    def tokenizer(self) -> Model:
        """The parent's vocabulary (no weights unless the parent is already loaded)."""
        if PARENT_ROLE in self._ctx:
            return self._ctx[PARENT_ROLE].model
        if self._vocab is None:
            self._vocab = Model(self.family.path(PARENT_ROLE), vocab_only=True)
        return self._vocab

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer().tokenize(text, add_bos=False, special=False))

    def ensure(self, roles: list[str]) -> None:
        """Load what `roles` need, refusing first (with numbers) a set that does not fit."""
        missing = [r for r in roles if r not in self._ctx]
        if not missing:
            return
        placement = self._require_fit(self.loaded() + missing)
        for role in missing:
            if self.rpc and role == PARENT_ROLE:
                model = self._remote_parent()
            else:
                model = Model(self.family.path(role), n_gpu_layers=placement.gpu_layers.get(role, 0))
            if self._ctx:  # every model of a session must speak the same vocabulary
                check_same_vocab(next(iter(self._ctx.values())).model, model)
            # One KV cache for all sequences (unified): with a cache per sequence llama.cpp splits a batch whose
            # sequence ids are out of order or have gaps into one pass each (decoding.batch._chunks).
            self._ctx[role] = Context(model, self.n_ctx * self.parallel, n_threads=self.threads,
                                      n_seq_max=self.parallel, kv_unified=self.parallel > 1)
            if self.rpc and role == PARENT_ROLE:
                from specquant_cli.system import rpc

                rpc.arm_sockets(self.rpc)  # ggml's sockets to the workers get deadlines

    def _require_fit(self, roles: list[str]):
        """The placement check; with RPC workers the parent is checked against their free memory (probed now:
        a worker that is down is one clear error here, never ggml's abort) and the rest against this machine."""
        from specquant_cli.system.placement import Placement, need, require_fit

        if self.rpc and PARENT_ROLE in roles:
            from specquant_cli.system import rpc

            if PARENT_ROLE not in self._ctx:
                self._workers = rpc.probe_all(self.rpc)
                rpc.require_remote_fit(self._workers, need(self.family, PARENT_ROLE, self.n_ctx * self.parallel).total,
                                       f"the parent ({PARENT_ROLE})")
            roles = [r for r in roles if r != PARENT_ROLE]
            if not roles:
                return Placement("rpc")
        return require_fit(self.facts, self.family, roles, self.n_ctx * self.parallel)

    def _remote_parent(self) -> Model:
        """The parent with every layer on the RPC workers, split by their free memory (probed by _require_fit)."""
        from specquant_cli.system import rpc

        rpc.install_abort_guard(self.rpc)
        workers = self.__dict__.get("_workers") or rpc.probe_all(self.rpc)
        return Model(self.family.path(PARENT_ROLE), n_gpu_layers=-1, devices=rpc.devices(self.rpc),
                     tensor_split=rpc.split_for(workers))

    def context(self, role: str) -> Context:
        self.ensure([role])
        return self._ctx[role]

    def planner(self, policy: str) -> Optional[Planner]:
        """The session's planner for `policy` (built on first use and kept: it learns from every answer of the
        session, across requests); None for a policy whose table row is its plan."""
        if policy not in self._planners:
            factory = policy_spec(policy).planner
            self._planners[policy] = factory() if factory is not None else None
        return self._planners[policy]

    def drafter(self, name: str, target: str, scope: str = "") -> Drafter:
        """The named drafter, built from its registry spec; a persistent one is kept for the session, one per
        `scope` (the policy: what one policy's drafter remembers never feeds another's, so a bench that runs
        several policies on the same prompt does not hand one the answer another just produced)."""
        spec = drafter_spec(name)
        key = f"{scope}:{name}>{target}"
        self.scope = scope
        if spec.persistent and key in self._drafters:
            return self._drafters[key]
        self.ensure([target, *spec.roles])
        d = spec.build(self, target)
        if spec.persistent:
            self._drafters[key] = d
        return d

    # -- measured costs ---------------------------------------------------------------------------
    def calibration(self, measure: bool = True, force: bool = False, require_save: bool = False):
        """This machine's measured costs for the family (system.calibration): read from the family folder (or
        the user cache, for a family folder that cannot be written), else measured now (with progress through
        `self.report`) and saved there; None when `measure` is False and nothing valid is cached. A stored
        entry is checked on every read: an invalid one is not used, and the reason is reported (once). A cached
        entry that lacks a draft role the family has gained since (a recipe added by `quantize --types`) is
        measured again when `measure` is True; `force` measures regardless. `require_save`: refuse (before
        measuring) when the result could be saved nowhere."""
        from specquant_cli.system import calibration as cal

        if force:
            fp = cal.fingerprint(self.facts, self.threads, self.rpc)
            self._calibration = self._measure(cal, fp, require_save)
        if self._calibration is None or (measure and self._uncalibrated()):
            fp = cal.fingerprint(self.facts, self.threads, self.rpc)
            self._calibration, why = cal.load_checked(self.family.root, fp)
            if measure and (self._calibration is None or self._uncalibrated()):
                if why:
                    self._say_once(f"calibration: {why}; measuring again")
                self._calibration = self._measure(cal, fp, require_save)
            elif why:
                self._say_once(f"calibration: {why}; not used (specquant calibrate measures it again)")
        return self._calibration

    def _say_once(self, line: str) -> None:
        said = self.__dict__.setdefault("_said", set())
        if line not in said:
            said.add(line)
            self.report.say(line)

    def draft_roles(self) -> list[str]:
        """The family's roles that draft as models (q4, q8, recipes such as q4i, q3g, a custom graded role)."""
        return list(self._draft_roles)

    def fits(self, roles: list[str]) -> bool:
        """Whether `roles` (the parent first) fit where they would run (system.placement)."""
        from specquant_cli.errors import ResourceError

        try:
            self._require_fit(roles)
            return True
        except ResourceError:
            return False

    def plannable_roles(self) -> tuple[str, ...]:
        """The family's roles a planner may pick now: loaded, or a draft that fits beside what is loaded."""
        base = [PARENT_ROLE, *(r for r in self.loaded() if r != PARENT_ROLE)]
        return tuple(r for r in self.family.roles() if r in base or r in self._ctx or self.fits([*base, r]))

    def load_planner_drafts(self) -> list[str]:
        """Load every calibrated draft a planner may pick (those that fit), so that none loads mid-answer;
        returns the ones loaded now."""
        c = self.calibration(measure=False)
        new = [r for r in self.draft_roles() if c and r in c.draft_step_s and r not in self._ctx]
        done = []
        for r in new:
            if r in self.plannable_roles():
                self.ensure([r])
                done.append(r)
        return done

    def _uncalibrated(self) -> list[str]:
        c = self._calibration
        return [r for r in self.draft_roles() if c is None or (r not in c.draft_step_s and r not in c.left_out)]

    def _measure(self, cal, fp, require_save: bool = False):
        from specquant_cli.errors import ResourceError

        if require_save:
            cal.save_target(self.family.root)  # a one-line error now, not after a minute of measuring
        before = set(self._ctx)
        self.ensure([PARENT_ROLE])
        drafts, skipped = [], []
        for role in self.draft_roles():  # as many drafts as fit beside the parent; the rest are left out
            try:
                self.ensure([role])
                drafts.append(role)
            except ResourceError:
                skipped.append(role)
        if skipped:
            self.report.say(f"calibration: {', '.join(skipped)} left out (not enough memory beside the others); "
                            "auto will not pick them")
        with self.report.status("calibrating this machine's costs (once per family and machine)") as status:
            c = cal.measure(self.context, PARENT_ROLE, drafts,
                            lambda what, i, n: status.update(f"calibrating: {what} ({i}/{n})"))
        c.left_out = skipped
        try:
            where, why = cal.save(self.family.root, fp, c)
            if why is not None:
                self.report.say(f"calibration: cannot write in the family folder {self.family.root} ({why}); "
                                f"this machine's costs are kept in {where}")
        except OSError as e:
            if require_save:
                from specquant_cli.errors import InputError

                raise InputError(f"calibration not saved ({e.strerror or e})") from None
            self.report.warn(f"calibration not saved ({e.strerror}): it is measured again next time")
        self.release([r for r in drafts if r not in before])  # loaded only to be measured
        return c

    def release(self, roles: list[str]) -> None:
        """Unload `roles` (their models and contexts); a later plan that needs one loads it again."""
        for r in roles:
            ctx = self._ctx.pop(r, None)
            if ctx is not None:
                ctx.model.close()

    def verify_cost(self):
        from specquant_cli.decoding.gamma import verify_shape

        c = self.calibration(measure=False)
        return c.verify_cost if c else verify_shape

    def model_gamma(self, role: str, gamma_init: int) -> AdaptiveGamma:
        """Adaptive γ for `role`'s drafts, its cost estimates seeded with the calibration when there is one."""
        c = self.calibration(measure=False)
        prior = {n: s for n, s in c.parent_call_s.items()} if c else None
        draft = c.draft_step_s.get(role) if c else None
        measured = c is not None and role in c.agreement
        alpha = min(0.95, c.agreement[role]) if measured else 0.5  # capped: 256 tokens cannot promise more
        return AdaptiveGamma(gamma_max=max(ADAPTIVE_GAMMA_MAX, self.gamma), gamma_init=gamma_init, verify_prior=prior,
                             draft_prior=draft, alpha_prior=alpha,
                             prior_counts=CALIBRATED_PRIOR_COUNTS if measured else PRIOR_PSEUDO_COUNTS)

    def engine(self, plan: Plan, sp: SamplingParams) -> Engine:
        """An engine for `plan`: loads the plan's roles (placement-checked), builds its drafter and γ policy.

        Args:
            plan: from `routing.policies.plan_for` (or a policy's own planner).
            sp: sampling parameters; greedy when temperature is 0."""
        self.ensure(plan.roles)
        drafter = self.drafter(plan.drafter, plan.target, plan.policy) if plan.drafter else None
        return Engine(self._ctx[plan.target], drafter, self.gamma_policy(plan) if drafter else FixedGamma(0), sp)

    def gamma_policy(self, plan: Plan):
        """The draft-length policy `plan.gamma_policy` names (routing.policies.GammaPolicyKind)."""
        kind = plan.gamma_policy
        if kind == "capped":
            return FixedGamma(plan.gamma_cap)  # the drafter sizes its drafts itself, up to the cap
        if kind == "calibrated":
            return self.model_gamma(plan.drafter, self.gamma)
        if kind == "adaptive":
            return AdaptiveGamma(gamma_max=max(ADAPTIVE_GAMMA_MAX, self.gamma), gamma_init=self.gamma)
        return FixedGamma(0 if kind == "none" else self.gamma)

    def reset_caches(self) -> None:
        """Empty every KV cache (the bench's fresh-request state). Persistent drafters keep their memory."""
        for c in self._ctx.values():
            c.reset()

    def close(self) -> None:
        for c in self._ctx.values():
            c.model.close()  # frees its context first
        self._ctx.clear()
        self._drafters.clear()
        if self._vocab is not None:
            self._vocab.close()
            self._vocab = None
