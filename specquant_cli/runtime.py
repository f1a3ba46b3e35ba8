"""A session's models: loaded lazily per family role, checked against the placement plan first, kept
loaded for the rest of the session; and the engine a plan asks for."""

from __future__ import annotations

from typing import Optional

from specquant_cli.drafters import FallbackDrafter, ModelDrafter, NGramDrafter
from specquant_cli.engine import Engine
from specquant_cli.family import Family
from specquant_cli.gamma import AdaptiveGamma, FixedGamma
from specquant_cli.llama import Context, Model, check_same_vocab
from specquant_cli.policies import Plan
from specquant_cli.sampling import SamplingParams

# Prompt tokens the adaptive policy's late-woken drafter reads. Only there: a window bounds the draft's
# prefill but costs acceptance on long documents (Spec-Bench summarization: 93 % -> 18 % for spec-q4).
DRAFT_WINDOW = 128


class Runtime:
    def __init__(self, family: Family, n_ctx: int = 4096, gamma: int = 4, threads: Optional[int] = None,
                 p_min: Optional[float] = None, facts=None, draft_window: Optional[int] = DRAFT_WINDOW):
        self.family = family
        self.n_ctx = n_ctx
        self.gamma = gamma
        self.threads = threads
        self.p_min = p_min
        self.draft_window = draft_window
        self._facts = facts
        self._ctx: dict[str, Context] = {}
        self._vocab: Optional[Model] = None

    @property
    def facts(self):
        if self._facts is None:
            from specquant_cli.hardware import detect

            self._facts = detect()
        return self._facts

    def loaded(self) -> list[str]:
        return list(self._ctx)

    def tokenizer(self) -> Model:
        """The parent's vocabulary (no weights unless the parent is already loaded)."""
        if "f16" in self._ctx:
            return self._ctx["f16"].model
        if self._vocab is None:
            self._vocab = Model(self.family.path("f16"), vocab_only=True)
        return self._vocab

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer().tokenize(text, add_bos=False, special=False))

    def ensure(self, roles: list[str]) -> None:
        """Load what `roles` need, refusing first (with numbers) a set that does not fit."""
        from specquant_cli.placement import require_fit

        missing = [r for r in roles if r not in self._ctx]
        if not missing:
            return
        placement = require_fit(self.facts, self.family, self.loaded() + missing, self.n_ctx)
        for role in missing:
            model = Model(self.family.path(role), n_gpu_layers=placement.gpu_layers.get(role, 0))
            if self._ctx:  # every model of a session must speak the same vocabulary
                check_same_vocab(next(iter(self._ctx.values())).model, model)
            self._ctx[role] = Context(model, self.n_ctx, n_threads=self.threads)

    def context(self, role: str) -> Context:
        self.ensure([role])
        return self._ctx[role]

    def engine(self, plan: Plan, sp: SamplingParams) -> Engine:
        self.ensure(plan.roles)
        target = self._ctx[plan.target]
        drafter = None
        if plan.draft == "ngram":
            drafter = NGramDrafter()
        elif plan.draft == "ngram+q4":
            drafter = FallbackDrafter(NGramDrafter((4, 3)), self._model_drafter("q4", self.draft_window))
        elif plan.draft:
            drafter = self._model_drafter(plan.draft, None)
        if drafter is None:
            gamma = FixedGamma(0)
        elif plan.adaptive_gamma:
            gamma = AdaptiveGamma(g_max=max(8, self.gamma), g_init=self.gamma)
        else:
            gamma = FixedGamma(self.gamma)
        return Engine(target, drafter, gamma, sp)

    def _model_drafter(self, role: str, window: Optional[int]) -> ModelDrafter:
        return ModelDrafter(self._ctx[role], role, self.p_min, window=window)

    def close(self) -> None:
        for c in self._ctx.values():
            c.close()
            c.model.close()
        self._ctx.clear()
