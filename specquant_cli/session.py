"""A conversation: route each prompt, pick the plan, stream the answer as response records."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from specquant_cli.decoding.sampling import SamplingParams
from specquant_cli.decoding.stream import Response, stream_generate
from specquant_cli.errors import FamilyError
from specquant_cli.family.manifest import Family
from specquant_cli.reporting import SILENT, Reporter
from specquant_cli.routing.plan import Plan, PlanContext
from specquant_cli.routing.policies import DEFAULT_POLICY, check_policy, plan_for, policy_spec
from specquant_cli.routing.router import Route, Router, load_config
from specquant_cli.runtime import Runtime
from specquant_cli.settings import DEFAULT_FAMILY_DIR, SessionSettings


@dataclass
class Answer:
    prompt: str
    route: Route
    plan: Plan
    text: str = ""
    last: Optional[Response] = None
    route_s: float = 0.0  # spaCy scoring time, before generation starts

    def to_dict(self) -> dict:
        return {
            "prompt": self.prompt,
            "route": {"tier": self.route.tier, "score": self.route.score, "features": self.route.features,
                      "policy": self.plan.policy, "plan": self.plan.describe(), "lossy": self.plan.lossy},
            "text": self.text,
            "finish_reason": self.last.finish_reason if self.last else None,
            "stats": self.last.stats() if self.last else {},
        }


def load_family(path: Optional[Path], warn=None):
    """The family at `path` (the runtime.family setting, resolved), else the demo family's folder. `warn`: where
    the warning of an interrupted update finished on the way goes (family.manifest.recover; none by default)."""
    root = path or DEFAULT_FAMILY_DIR
    try:
        return Family.load(root, warn)
    except FamilyError:
        if path is None:
            raise FamilyError(f"no model family at {root}; fetch the demo family with: specquant pull smollm2-135m") \
                from None
        raise


def bind_parent(fam: Family, settings: SessionSettings) -> Family:
    """The family with the parent's rendering this session runs decided and bound, with its reason
    (system.renderings.decide: as asked, the family's only one, or this machine's faster); a family already
    bound is kept as it is."""
    from specquant_cli.system.renderings import decide

    if fam.parent is not None:
        return fam
    choice = decide(fam, settings.parent, settings.facts, settings.threads, settings.rpc)
    return fam.bind(choice.rendering, choice.why)


def ctx_warning(fam, n_ctx: int) -> Optional[str]:
    """--ctx above the model's trained context works in llama.cpp, but quality degrades past it: the line that
    says so, None below it."""
    trained = fam.hparams.get("context_length")
    if trained and n_ctx > trained:
        return (f"warning: --ctx {n_ctx} is above the model's trained context ({trained} tokens); answers past it "
                "degrade")
    return None


def open_session(settings: SessionSettings, family=None, report: Reporter = SILENT,
                 warn_ctx: bool = False) -> ChatSession:
    """The one assembly point of every front end: family -> runtime -> router -> session.

    Args:
        settings: what to open (settings.SessionSettings); its family is loaded unless `family` is given.
        family: an already loaded family.
        report: where progress and warnings go (reporting.Reporter; silent by default, the commands pass
            console.stderr_reporter()): the family's recovery, the runtime's calibration.
        warn_ctx: also report a context above the model's trained one.

    The router refuses a prompt longer than the context (settings.n_ctx), for every front end. The parent's
    rendering is decided (`bind_parent`) and the policy checked against the family's roles here, before any
    model loads. The caller closes
    `session.runtime`."""
    router_config = load_config(settings.router_config)
    fam = family if family is not None else load_family(settings.family, report.warn)
    fam = bind_parent(fam, settings)
    policy = check_policy(settings.policy or DEFAULT_POLICY, fam.roles())
    warning = ctx_warning(fam, settings.n_ctx)
    if warn_ctx and warning:
        report.say(warning)
    runtime = Runtime.open(fam, n_ctx=settings.n_ctx, gamma=settings.gamma, threads=settings.threads,
                           facts=settings.facts, rpc=settings.rpc, parallel=settings.parallel, report=report,
                           mmap=settings.mmap, rpc_timeout=settings.rpc_timeout, draft_memory=settings.draft_memory,
                           host_reserve=int(settings.cache_ram * (1 << 20)))
    router = Router(router_config, runtime.count_tokens, max_tokens=settings.n_ctx)
    return ChatSession(runtime, router, policy, settings.sampling or SamplingParams(), settings.max_tokens,
                       settings.system, settings.stop)


@dataclass
class ChatSession:
    runtime: Runtime
    router: Router
    policy: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    system: Optional[str] = None
    stop: Sequence[str] = ()
    history: list[dict] = field(default_factory=list)
    last: Optional[Answer] = None
    grammar: object = None  # decoding.grammar.Grammar every answer of `ask` is held to (chat --json-schema)
    tools: Optional[list[dict]] = None  # OpenAI function tools the chat template describes to every `ask`

    def for_runtime(self, runtime: Runtime, router) -> ChatSession:
        """This session's settings over another runtime and router (a serving slot's), with no history."""
        return replace(self, runtime=runtime, router=router, history=[], last=None)

    def set_policy(self, name: str) -> None:
        self.policy = check_policy(name)

    def reset(self) -> None:
        self.history.clear()

    def plan(self, text: str, policy: Optional[str] = None, prompt: Optional[list[int]] = None,
             measure: bool = True, answer_tokens: int = 0, batch: int = 1) -> tuple[Route, Plan]:
        """Route `text` and plan it. A policy with a planner has the session's planner decide, from the
        prompt's copy potential, the roles it may pick, the machine's calibration (measured on first use
        unless `measure` is False), the prompt's length and the answer's (at most `answer_tokens`). `batch` > 1:
        the plan one of that many sequences decoding together would get (the calibration as the batch sees it,
        Calibration.for_batch; a fresh planner, so nothing this session learned alone is carried over)."""
        route = self.router.route(text)
        name = policy or self.policy
        rt = self.runtime
        planner = rt.planner(name) if batch <= 1 else None
        if policy_spec(name).planner is None:
            return route, plan_for(name, route.tier)
        from specquant_cli.routing.auto import copy_potential

        tokens = prompt if prompt is not None else rt.tokenizer().tokenize(text, add_bos=False, special=False)
        costs = rt.calibration(measure=measure)
        if costs is not None and batch > 1:
            costs = costs.for_batch(batch)
        left = rt.unfit_roles()
        roles = tuple(r for r in rt.family.roles() if r not in left)
        ctx = PlanContext(name, route.tier, copy_potential(tokens), roles, costs, len(tokens), answer_tokens)
        plan = plan_for(name, route.tier, ctx, planner)
        if left:
            plan = replace(plan, left_out=tuple({"role": r, "why": f"does not fit: {why}"} for r, why in left.items()))
        return route, plan

    def messages(self, text: str) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return sys_msg + self.history + [{"role": "user", "content": text}]

    def ask(self, text: str, remember: bool = True) -> tuple[Answer, Iterator[Response]]:
        """Route `text`, plan, and return the answer with its record stream.

        Args:
            text: the user's message; the conversation so far (system + history) comes before it.
            remember: add the exchange to the history once the stream is consumed to its end.

        Returns:
            (answer, records): routing and planning happen now, generation only as `records` is consumed;
            `answer.text` and `answer.last` fill in as it goes, complete once the iterator is exhausted."""
        answer, records = self.ask_messages(self.messages(text), route_text=text, grammar=self.grammar,
                                            tools=self.tools)
        if not remember:
            return answer, records

        def run() -> Iterator[Response]:
            yield from records
            self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer.text}]

        return answer, run()

    def ask_messages(self, messages: list[dict], route_text: Optional[str] = None, policy: Optional[str] = None,
                     sampling: Optional[SamplingParams] = None, max_tokens: Optional[int] = None,
                     stop: Optional[Sequence[str]] = None, raw_prompt: Optional[str] = None, scope: str = "",
                     grammar=None, tools: Optional[list[dict]] = None, top_logprobs: Optional[int] = None
                     ) -> tuple[Answer, Iterator[Response]]:
        """Like `ask`, for a whole conversation given as messages (the server's entry point); the session's
        history is not used or changed. The route scores `route_text` (default: the last user message).
        `raw_prompt` is tokenized as it is instead of rendering the messages (plain completions). `scope`: the
        request's scope (a server's tenant and cache_salt; "" for a session alone), whose part of the drafting memory
        its drafter uses. `grammar` (decoding.grammar.Grammar): what the answer must be; `tools`: OpenAI function tools
        the chat template describes to the model; `top_logprobs`: record the parent's log-probabilities with that
        many alternatives."""
        if route_text is None:
            route_text = raw_prompt if raw_prompt is not None else next(
                (m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        t0 = time.perf_counter()
        model = self.runtime.tokenizer()
        prompt = model.tokenize(raw_prompt, add_bos=model.add_bos()) if raw_prompt is not None \
            else model.chat_prompt(messages, tools)
        limit = max_tokens or self.max_tokens
        self.runtime.pool.release_idle()  # a draft no plan has used for a while goes (runtime.pool.IDLE_RELEASE_S)
        route, plan = self.plan(route_text, policy, prompt, answer_tokens=limit)
        answer = Answer(route_text, route, plan, route_s=time.perf_counter() - t0)
        engine = self.runtime.engine(plan, sampling or self.sampling, position=len(prompt), scope=scope,
                                     grammar=grammar, top_logprobs=top_logprobs)
        stops = self.stop if stop is None else stop

        def run() -> Iterator[Response]:
            parts = []
            for rec in stream_generate(engine, prompt, limit, stops):
                parts.append(rec.text)
                answer.last = rec
                yield rec
            answer.text = "".join(parts)
            self.last = answer
            planner = self.runtime.planner(answer.plan.policy)
            if planner is not None and grammar is None:  # a grammar's free tokens would flatter the plan
                planner.observe(answer)  # what the plan achieved, for the next prompt's plan

        return answer, run()
