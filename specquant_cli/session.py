"""A conversation: route each prompt, pick the plan, stream the answer as response records."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from specquant_cli.decoding.sampling import SamplingParams
from specquant_cli.decoding.stream import Response, stream_generate
from specquant_cli.errors import InputError
from specquant_cli.family.manifest import Family
from specquant_cli.family.roles import PARENT_ROLE
from specquant_cli.reporting import SILENT, Reporter
from specquant_cli.routing.plan import Plan, PlanContext
from specquant_cli.routing.policies import DEFAULT_POLICY, check_policy, plan_for, policy_spec
from specquant_cli.routing.router import Route, Router, load_config
from specquant_cli.runtime import Runtime
from specquant_cli.settings import SessionSettings


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


def load_family(path: Optional[Path], warn=None, say=None):
    """The family `path` names (the runtime.family setting, resolved: a folder, or a name family.store finds in
    ./models, the models folder or its index), else the default family (family.store.default_family), which `say`
    names with why it is the one. `warn`: where the warnings on the way go (an interrupted update finished, an index of
    families that cannot be read; none by default)."""
    from specquant_cli.family import store
    from specquant_cli.settings import models_dir

    warn = warn or (lambda text: None)
    cwd = store.current_folder()
    if path is not None:
        return Family.load(store.locate(path, models_dir(), cwd, warn), warn)
    root, why = store.default_family(models_dir(), cwd, warn)
    fam = Family.load(root, warn)
    if say is not None:
        say(f"family {fam.name} at {root} ({why}; --family NAME runs another, specquant list shows them)")
    return fam


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
    fam = family if family is not None else load_family(settings.family, report.warn, report.say)
    fam = bind_parent(fam, settings)
    policy = check_policy(settings.policy or DEFAULT_POLICY, fam.roles(), fam.siblings())
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
    prediction: Optional[str] = None  # the text every answer of `ask` is expected to resemble (chat --predict)

    def for_runtime(self, runtime: Runtime, router) -> ChatSession:
        """This session's settings over another runtime and router (a serving slot's), with no history."""
        return replace(self, runtime=runtime, router=router, history=[], last=None)

    def set_policy(self, name: str) -> None:
        fam = self.runtime.family
        self.policy = check_policy(name, fam.roles(), fam.siblings())

    def reset(self) -> None:
        self.history.clear()

    def plan(self, text: str, policy: Optional[str] = None, prompt: Optional[list[int]] = None,
             measure: bool = True, answer_tokens: int = 0, batch: int = 1, prediction: int = 0) -> tuple[Route, Plan]:
        """Route `text` and plan it. A policy with a planner has the session's planner decide, from the
        prompt's copy potential, the roles it may pick, the machine's calibration (measured on first use
        unless `measure` is False), the prompt's length and the answer's (at most `answer_tokens`), and the length
        of the answer's prediction (`prediction` tokens; 0: none). `batch` > 1: the plan one of that many sequences
        decoding together would get (the calibration as the batch sees it, Calibration.for_batch; a fresh planner,
        so nothing this session learned alone is carried over)."""
        route = self.router.route(text)
        name = policy or self.policy
        rt = self.runtime
        planner = rt.planner(name) if batch <= 1 else None
        if policy_spec(name).planner is None:
            return route, self._fit(plan_for(name, route.tier))
        from specquant_cli.routing.auto import copy_potential

        tokens = prompt if prompt is not None else rt.tokenizer().tokenize(text, add_bos=False, special=False)
        costs = rt.calibration(measure=measure)
        if costs is not None and batch > 1:
            costs = costs.for_batch(batch)
        left = rt.unfit_roles()
        roles = tuple(r for r in rt.family.roles() if r not in left or r == PARENT_ROLE)  # every plan is the parent's
        ctx = PlanContext(name, route.tier, copy_potential(tokens), roles, costs, len(tokens), answer_tokens,
                          prediction)
        plan = plan_for(name, route.tier, ctx, planner)
        if left:
            plan = replace(plan, left_out=tuple({"role": r, "why": f"does not fit: {why}"} for r, why in left.items()))
        return route, plan

    def _fit(self, plan: Plan) -> Plan:
        """A policy's own plan with, when its roles not loaded yet do not fit beside those that are, each of them as
        left out, with the numbers (what `route` says of a plan that cannot run here)."""
        pool = self.runtime.pool
        missing = [r for r in plan.roles if r not in pool.loaded()]
        if not missing:
            return plan
        why = pool.fit_problem(list(dict.fromkeys([*pool.loaded(), *plan.roles])))
        if why is None:
            return plan
        return replace(plan, left_out=tuple({"role": r, "why": f"does not fit: {why}"} for r in missing))

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
                                            tools=self.tools, prediction=self.prediction_tokens(self.prediction))
        if not remember:
            return answer, records

        def run() -> Iterator[Response]:
            yield from records
            self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer.text}]

        return answer, run()

    def ask_messages(self, messages: list[dict], route_text: Optional[str] = None, policy: Optional[str] = None,
                     sampling: Optional[SamplingParams] = None, max_tokens: Optional[int] = None,
                     stop: Optional[Sequence[str]] = None, raw_prompt: Optional[str] = None, scope: str = "",
                     grammar=None, tools: Optional[list[dict]] = None, top_logprobs: Optional[int] = None,
                     prediction: Sequence[int] = ()) -> tuple[Answer, Iterator[Response]]:
        """Like `ask`, for a whole conversation given as messages (the server's entry point); the session's
        history is not used or changed. The route scores `route_text` (default: the last user message).
        `raw_prompt` is tokenized as it is instead of rendering the messages (plain completions). `scope`: the
        request's scope (a server's tenant and cache_salt; "" for a session alone), whose part of the drafting memory
        its drafter uses. `grammar` (decoding.grammar.Grammar): what the answer must be; `tools`: OpenAI function tools
        the chat template describes to the model; `top_logprobs`: record the parent's log-probabilities with that
        many alternatives; `prediction`: the token ids the answer is expected to resemble (`prediction_tokens` of its
        text), drafted from by a policy that speculates (Predicted Outputs: the answer stays the parent's own)."""
        if route_text is None:
            route_text = raw_prompt if raw_prompt is not None else next(
                (m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        t0 = time.perf_counter()
        model = self.runtime.tokenizer()
        prompt = model.tokenize(raw_prompt, add_bos=model.add_bos()) if raw_prompt is not None \
            else model.chat_prompt(messages, tools)
        limit = max_tokens or self.max_tokens
        predicted = list(prediction)
        self.runtime.pool.release_idle()  # a draft no plan has used for a while goes (runtime.pool.IDLE_RELEASE_S)
        route, plan = self.plan(route_text, policy, prompt, answer_tokens=limit, prediction=len(predicted))
        answer = Answer(route_text, route, plan, route_s=time.perf_counter() - t0)
        engine = self.runtime.engine(plan, sampling or self.sampling, position=len(prompt), scope=scope,
                                     grammar=grammar, top_logprobs=top_logprobs, prediction=predicted)
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
            if planner is not None and grammar is None and not predicted:  # a grammar's free tokens, or a
                planner.observe(answer)  # prediction's, would flatter the plan; what it achieved, for the next one

        return answer, run()

    def prediction_tokens(self, text: Optional[str]) -> list[int]:
        """A prediction's text as the token ids the engine drafts from (tokenized as plain text: no special tokens),
        [] for none or an empty one; an InputError when it is longer than the context. The one place a prediction
        turns from text into tokens, on its way down (chat --predict, a request's `prediction`)."""
        if not text:
            return []
        tokens = self.runtime.tokenizer().tokenize(text, add_bos=False, special=False)
        n_ctx = self.runtime.pool.n_ctx
        if len(tokens) > n_ctx:
            raise InputError(f"the prediction is {len(tokens)} tokens, longer than the context ({n_ctx} tokens)")
        return tokens
