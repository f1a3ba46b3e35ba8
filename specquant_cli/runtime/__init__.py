"""A session's runtime: three parts and what joins them.

- `pool` (runtime.pool.ModelPool): the models, loaded per family role after the placement check, released
  on request;
- `costs` (runtime.costs.CostModel): this machine's measured costs, the verify cost and the draft-length
  policy a plan names;
- `drafters` (runtime.drafters.DrafterCache): drafters built from the registry, persistent ones kept per
  policy;

and the session's planners (one per policy and batch size: they learn from every answer) and the engine a
plan asks for. A serving slot is a Runtime over a view of a shared pool (serving.slots)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from specquant_cli.backend.llama import Model
from specquant_cli.decoding.engine import MAX_SEGMENTS, Engine
from specquant_cli.decoding.gamma import FixedGamma, RateGuard
from specquant_cli.decoding.memory import tokens_for
from specquant_cli.decoding.registry import register_family_drafters
from specquant_cli.decoding.sampling import SamplingParams
from specquant_cli.family.manifest import Family
from specquant_cli.reporting import SILENT, Reporter
from specquant_cli.routing.plan import Plan, Planner
from specquant_cli.routing.policies import policy_spec
from specquant_cli.runtime.costs import CostModel
from specquant_cli.runtime.drafters import DrafterCache
from specquant_cli.runtime.pool import ModelPool, Models, plannable_roles, unfit_roles
from specquant_cli.settings import DEFAULT_DRAFT_MEMORY_MIB, DEFAULT_GAMMA, DEFAULT_RPC_TIMEOUT_S

__all__ = ["Runtime"]


class Runtime:
    def __init__(self, pool: Models, costs: CostModel, drafters: DrafterCache):
        self.pool = pool
        self.costs = costs
        self.drafters = drafters
        self._planners: dict[tuple[str, int], Optional[Planner]] = {}

    @classmethod
    def open(cls, family: Family, n_ctx: int = 4096, gamma: int = DEFAULT_GAMMA, threads: Optional[int] = None,
             p_min: Optional[float] = None, facts=None, kv_import: bool = True, rpc: Optional[list[str]] = None,
             parallel: int = 1, report: Reporter = SILENT, mmap: bool = False,
             rpc_timeout: float = DEFAULT_RPC_TIMEOUT_S, draft_memory: float = DEFAULT_DRAFT_MEMORY_MIB,
             host_reserve: int = 0) -> Runtime:
        """The runtime of `family`: registers its role drafters (a custom graded role drafts too; the one call
        that does), nothing loaded yet. `parallel`, `rpc`, `rpc_timeout`, `mmap`: runtime.pool.ModelPool's;
        `report`: where calibration's progress and warnings go; `draft_memory`: MiB of each policy's drafting
        memory (decoding.memory); `host_reserve`: bytes of host memory the memory check keeps for more than the models
        (the prompt cache)."""
        roles = register_family_drafters(family.roles(), family.siblings())
        pool = ModelPool(family, roles, n_ctx, threads, facts, rpc, parallel, mmap, rpc_timeout, host_reserve)
        costs = CostModel(pool, gamma, report)
        return cls(pool, costs, DrafterCache(pool, costs, p_min, kv_import, tokens_for(draft_memory)))

    @property
    def family(self) -> Family:
        return self.pool.family

    def tokenizer(self) -> Model:
        return self.pool.tokenizer()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer().tokenize(text, add_bos=False, special=False))

    def calibration(self, measure: bool = True, force: bool = False, require_save: bool = False):
        """This machine's measured costs (runtime.costs.CostModel.calibration)."""
        return self.costs.calibration(measure, force, require_save)

    def planner(self, policy: str) -> Optional[Planner]:
        """The session's planner for `policy` (built on first use and kept: it learns from every answer of the
        session, across requests), one per batch size the costs are for (a speedup measured alone is not the
        one a plan gets among 8 sequences); None for a policy whose table row is its plan."""
        key = (policy, self.costs.batch)
        if key not in self._planners:
            factory = policy_spec(policy).planner
            self._planners[key] = factory() if factory is not None else None
        return self._planners[key]

    def plannable_roles(self) -> tuple[str, ...]:
        """The family's roles a planner may pick now (runtime.pool.plannable_roles)."""
        return plannable_roles(self.pool)

    def unfit_roles(self) -> dict[str, str]:
        """The family's roles a planner may not pick now, each with why (runtime.pool.unfit_roles)."""
        return unfit_roles(self.pool)

    def planner_drafts(self, policies: Sequence[str]) -> tuple[str, ...]:
        """The calibrated draft roles the planners of `policies` can use on this machine (Planner.usable): what
        they load ahead. None without a calibration."""
        c = self.calibration(measure=False)
        if not c:
            return ()
        measured = [r for r in self.pool.draft_roles if r in c.draft_step_s]
        out = [r for p in policies if (pl := self.planner(p)) is not None for r in pl.usable(measured, c)]
        return tuple(dict.fromkeys(out))

    def load_planner_drafts(self, policies: Sequence[str]) -> list[str]:
        """Load the calibrated drafts the planners of `policies` can use (those that fit), so that none loads
        mid-answer; a draft no plan of theirs can pay with stays on disk. Returns the ones loaded now."""
        loaded = self.pool.loaded()
        done = []
        for r in self.planner_drafts(policies):
            if r not in loaded and r in self.plannable_roles():
                self.pool.ensure([r])
                done.append(r)
        return done

    def engine(self, plan: Plan, sp: SamplingParams, position: int = 0, scope: str = "", grammar=None,
               top_logprobs: Optional[int] = None, prediction: Optional[Sequence[int]] = None) -> Engine:
        """An engine for `plan`: loads the plan's roles (placement-checked), builds its drafter (scoped to the
        plan's policy) and γ policy. A planned answer (a policy with a planner) drafts under a rate guard: it
        goes on with the parent alone once its drafting runs below the parent's rate (decoding.gamma.RateGuard).

        Args:
            plan: from `routing.policies.plan_for` (or a policy's own planner).
            sp: sampling parameters; greedy when temperature is 0.
            position: the prompt's length (where the answer starts in the context).
            scope: the request's scope (a server's tenant and cache_salt; "" alone): the part of the drafting memory
                the drafter reads and writes.
            grammar: what the answer must be (decoding.grammar.Grammar), or None. A policy that speculates (a
                drafter, or a planner) proposes the tokens it forces at no draft cost; a model alone does not.
            top_logprobs: record the parent's log-probabilities with that many alternatives (None: none).
            prediction: token ids the answer is expected to resemble (Predicted Outputs), or None. A policy that
                speculates drafts from them too (decoding.prediction.PredictionDrafter, stacked on the plan's drafter,
                whose drafts keep their own length), up to the draft length the parent's call-cost curve pays for a
                copy (CostModel.copy_length); a model alone, or the parent alone, does not."""
        self.pool.ensure(plan.roles)
        drafter = self.drafters.drafter(plan.drafter, plan.target, plan.policy, scope) if plan.drafter else None
        gamma = self.costs.gamma_policy(plan) if drafter else FixedGamma(0)
        planned = policy_spec(plan.policy).planner is not None
        speculates = plan.drafter is not None or planned
        if prediction and speculates:
            from specquant_cli.decoding.prediction import PredictionDrafter

            cap = max(self.costs.copy_length(), plan.gamma_cap or 0)
            drafter = PredictionDrafter(prediction, position, drafter, gamma if drafter else None,
                                        self.costs.verify_cost(), cap)
            gamma = FixedGamma(cap)
        step = self.costs.parent_step_s() if drafter and planned else None
        if step is not None:
            gamma = RateGuard(gamma, step, position)
        target = self.pool.context(plan.target)
        constraint = None
        if grammar is not None:
            from specquant_cli.decoding.grammar import Constraint

            constraint = Constraint(grammar, target.model)
        return Engine(target, drafter, gamma, sp, first_alone=True, constraint=constraint,
                      jump_forward=speculates, top_logprobs=top_logprobs,
                      max_runs=1 if self.costs.pacer is not None else MAX_SEGMENTS, prediction=prediction)

    def reset_caches(self) -> None:
        """Empty every KV cache (the bench's fresh-request state). Persistent drafters keep their memory."""
        self.pool.reset_caches()

    def close(self) -> None:
        self.pool.close()
        self.drafters.clear()
