"""Every policy on the same prompts, interleaved per prompt, each run from empty caches."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

from specquant_cli.bench import fidelity, limit, report
from specquant_cli.bench.datasets import Item, extract_answer
from specquant_cli.decoding.gamma import GAMMA_MAX
from specquant_cli.decoding.sampling import SamplingParams
from specquant_cli.family.roles import PARENT_ROLE
from specquant_cli.routing.router import Router
from specquant_cli.runtime import Runtime
from specquant_cli.session import ChatSession


@dataclass
class Record:
    item: str
    category: str
    policy: str
    tier: str
    plan: str
    lossy: bool
    new_tokens: int
    prompt_tokens: int
    total_s: float
    tokens_per_s: float  # new tokens / wall time (prefill included; routing too for routed policies), mean
    decode_tokens_per_s: float  # new tokens / the time after the parent's own prefill, mean over repeats
    route_s: float
    prefill_s: float
    parent_prefill_s: float
    draft_prefill_s: float
    kv_import_s: float
    kv_import: Optional[bool]
    draft_s: float
    verify_s: float
    drafted: int
    accepted: int
    parent_calls: int
    finish_reason: str
    identical: Optional[bool]  # greedy tokens equal parent's (None: not greedy or no reference run)
    correct: Optional[bool]  # final answer equals the reference's (None: no reference)
    rss_mb: float  # resident size after the runs
    text: str
    tokens: list[int] = field(default_factory=list)  # the answer's token ids: what fidelity re-scores
    fidelity: Optional[str] = None  # identical / near-tie / unexplained (bench.fidelity); None: not judged
    levels: dict = field(default_factory=dict)  # a second drafting level's counts and time (EngineStats.levels)
    guard_stop: Optional[int] = None  # tokens into the answer when its rate guard stopped drafting
    valid: Optional[bool] = None  # a structured item's finished answer is valid for its form (None: no form, or cut)
    structured: bool = False  # held to a form (a schema, json_object or tool calls)
    forced: int = 0  # tokens its grammar forced, proposed at no draft cost
    forced_accepted: int = 0
    peak_rss_mb: float = 0.0  # the process's peak resident size during this policy's runs (system.memory)
    repeat_tokens_per_s: list[float] = field(default_factory=list)  # each repeat's tokens_per_s, in order
    predicted: bool = False  # the item's prediction was sent (Predicted Outputs)
    prediction_accepted: int = 0  # of its tokens proposed as drafts, those the parent kept
    prediction_rejected: int = 0  # ... and those it did not
    limit_s: Optional[float] = None  # the answer's time at the verify limit (bench.limit; None: no calibration)

    def to_dict(self) -> dict:
        return asdict(self)


def warm_up(runtime: Runtime, roles: Sequence[str], runs: int) -> None:
    """A few short generations per model before anything is timed."""
    from specquant_cli.decoding.engine import Engine
    from specquant_cli.decoding.stream import generate_text

    for role in roles:
        ctx = runtime.pool.context(role)
        prompt = ctx.model.chat_prompt([{"role": "user", "content": "Say hello."}])
        for _ in range(runs):
            generate_text(Engine(ctx), prompt, 8)


REFERENCE = report.REFERENCE  # the F16 rendering alone, beside a parent of another rendering


def run(runtime: Runtime, router: Router, items: Sequence[Item], policies: Sequence[str], max_tokens: int,
        sp: SamplingParams, repeats: int = 1, warmup: int = 1,
        progress: Optional[Callable[[Record], None]] = None) -> list[Record]:
    """Every policy on every item, interleaved per item, each with only its own models loaded (`hold`), its peak
    resident size measured over its runs."""
    from specquant_cli.routing.policies import policy_spec

    if any(policy_spec(p).planner is not None for p in policies):
        runtime.calibration()  # measured (once per machine) before anything is timed
    forms = compile_forms(runtime, items)
    records: list[Record] = []
    for item in items:
        parent_tokens = None
        for policy in policies:  # interleaved: machine drift hits every policy alike
            records.append(_timed_runs(runtime, router, item, policy, sp, max_tokens, repeats, parent_tokens,
                                       forms.get(item.id), warmup))
            if policy == "parent":
                parent_tokens = records[-1].tokens
            if progress:
                progress(records[-1])
    return records


def run_reference(reference: Runtime, router: Router, items: Sequence[Item], records: Sequence[Record],
                  max_tokens: int, sp: SamplingParams, repeats: int = 1, warmup: int = 1,
                  progress: Optional[Callable[[Record], None]] = None) -> list[Record]:
    """The REFERENCE rows: `reference`, a runtime whose parent is the F16 rendering, alone on every item, after the
    other runs (and after their models are released: the bench holds one rendering of the parent at a time), each
    answer compared with the parent's of the same item in `records`."""
    parents = {r.item: r.tokens for r in records if r.policy == "parent"}
    forms = compile_forms(reference, items)
    out = []
    for item in items:
        out.append(replace(_timed_runs(reference, router, item, "parent", sp, max_tokens, repeats,
                                       parents.get(item.id), forms.get(item.id), warmup), policy=REFERENCE))
        if progress:
            progress(out[-1])
    return out


def hold(runtime: Runtime, policy: str, warmup: int, plan: Sequence[str] = ()) -> None:
    """Only what `policy` loads (routing.policies.all_roles) and the roles of its `plan` for the next prompt (a
    planner's) stay loaded: the others are released, the missing ones loaded and warmed up. The parent stays
    throughout (every answer is judged against it), so a lossy model's figure includes it."""
    from specquant_cli.routing.policies import all_roles

    want = list(dict.fromkeys([PARENT_ROLE, *all_roles([policy]), *plan]))
    runtime.pool.release([r for r in runtime.pool.loaded() if r not in want])
    new = [r for r in want if r not in runtime.pool.loaded()]
    runtime.pool.ensure(want)
    warm_up(runtime, new, warmup)


def compile_forms(runtime: Runtime, items: Sequence[Item]) -> dict:
    """item id -> its structured-output form (decoding.forms.Form), for the items that have one; a form that cannot
    be compiled is an InputError naming its item, before anything is timed."""
    from specquant_cli.decoding import forms
    from specquant_cli.errors import InputError

    out = {}
    for it in items:
        if it.form:
            f = it.form
            try:
                out[it.id] = forms.read(f.get("response_format"), f.get("tools"), f.get("tool_choice"),
                                        f.get("parallel_tool_calls"), runtime.tokenizer())
            except InputError as e:
                raise InputError(f"{it.id}: {e}") from None
    return out


def _timed_runs(runtime: Runtime, router: Router, item: Item, policy: str, sp: SamplingParams, max_tokens: int,
                repeats: int, parent_tokens, form=None, warmup: int = 1) -> Record:
    """One policy's record on one item: `repeats` runs, each from empty caches (it pays its own prefill, like a
    fresh request), the last one's tokens compared with the parent's. `form`: the item's structured output."""
    from specquant_cli.system import memory

    session = ChatSession(runtime, router, policy, sp, max_tokens)
    if form is not None:
        session.grammar, session.tools = form.grammar, form.tools
    session.prediction = item.prediction
    runs = []
    memory.reset_peak()
    for _ in range(max(1, repeats)):
        _hold_for(session, item, max_tokens, warmup)  # a planner's plan may change between repeats (it learns)
        runtime.reset_caches()
        answer, recs = session.ask(item.prompt, remember=False)
        runs.append((answer, [r.token for r in recs if r.token is not None]))
        if answer.last is not None and answer.last.finish_reason == "interrupted":
            raise KeyboardInterrupt  # Ctrl-C or SIGTERM stops the bench, not just this answer
    answer, tokens = runs[-1]
    if policy == "parent" and parent_tokens is None:
        parent_tokens = tokens  # the parent's own run is its own reference
    rec = _record(item, policy, answer, tokens, runs, parent_tokens, sp)
    last = answer.last
    rec.limit_s = limit.limit_s(runtime.calibration(measure=False), last.prompt_tokens, last.new_tokens,
                                last.parent_prefill_s)
    rec.peak_rss_mb = round(memory.peak_bytes() / 2**20, 1)
    if form is not None and form.grammar is not None:
        rec.structured = True
        finished = answer.last is not None and answer.last.finish_reason == "stop"  # not cut by --max-tokens
        rec.valid = form.grammar.validate(answer.text) is None if finished else None
    return rec


def _hold_for(session: ChatSession, item: Item, max_tokens: int, warmup: int) -> None:
    """The models the next run uses, and no other draft (`hold`), loaded and warmed up before the clock: the policy's
    own, and for a planner the roles of its plan for this item (the draft it picks moves with the prompt and with
    what it has measured)."""
    roles: tuple[str, ...] = ()
    if session.runtime.planner(session.policy) is not None:
        model = session.runtime.tokenizer()
        prompt = model.chat_prompt(session.messages(item.prompt), session.tools)
        predicted = len(session.prediction_tokens(session.prediction))
        roles = session.plan(item.prompt, session.policy, prompt, answer_tokens=max_tokens,
                             prediction=predicted)[1].roles
    hold(session.runtime, session.policy, warmup, roles)


def _tps(policy: str, answer) -> float:
    """Only routed policies need the route to pick their plan, so only their wall time includes the scoring."""
    from specquant_cli.routing.policies import policy_spec

    wall = answer.last.total_s + (answer.route_s if policy_spec(policy).routed else 0.0)
    return answer.last.new_tokens / wall if wall > 0 else 0.0


def _record(item: Item, policy: str, answer, tokens, runs, parent_tokens, sp) -> Record:
    from specquant_cli.system import memory

    s = answer.last
    identical = None
    if sp.greedy and parent_tokens is not None:
        identical = tokens == parent_tokens
    correct = None
    if item.reference is not None:
        correct = extract_answer(answer.text) == item.reference
    return Record(
        item=item.id, category=item.category, policy=policy, tier=answer.route.tier, plan=answer.plan.describe(),
        lossy=answer.plan.lossy, new_tokens=s.new_tokens, prompt_tokens=s.prompt_tokens, total_s=s.total_s,
        tokens_per_s=statistics.mean(_tps(policy, a) for a, _ in runs),
        decode_tokens_per_s=statistics.mean(a.last.decode_tokens_per_s for a, _ in runs), route_s=answer.route_s,
        prefill_s=s.prefill_s, parent_prefill_s=s.parent_prefill_s, draft_prefill_s=s.draft_prefill_s,
        kv_import_s=s.kv_import_s, kv_import=s.kv_import,
        draft_s=s.draft_s, verify_s=s.verify_s, drafted=s.drafted, accepted=s.accepted, parent_calls=s.parent_calls,
        finish_reason=s.finish_reason, identical=identical, correct=correct,
        rss_mb=round(memory.rss_bytes() / 2**20, 1),
        text=answer.text, tokens=list(tokens), levels=dict(s.levels), guard_stop=s.guard_stop, forced=s.forced,
        forced_accepted=s.forced_accepted, repeat_tokens_per_s=[round(_tps(policy, a), 4) for a, _ in runs],
        predicted=bool(item.prediction), prediction_accepted=s.prediction_accepted,
        prediction_rejected=s.prediction_rejected)


def judge_fidelity(runtime: Runtime, router: Router, items: Sequence[Item], records: Sequence[Record],
                   sp: SamplingParams) -> Optional[dict]:
    """After the timed runs: judge every divergence from the parent's greedy answer (bench.fidelity), setting
    each judged record's `fidelity`. None for sampled runs or without the parent's answers to compare with."""
    if not sp.greedy or not any(r.policy == "parent" for r in records):
        return None
    runtime.pool.release([r for r in runtime.pool.loaded() if r != PARENT_ROLE])  # the judge needs the parent alone
    ctx = runtime.pool.context(PARENT_ROLE)
    session = ChatSession(runtime, router, "parent", sp)  # renders a prompt exactly as the timed runs did
    forms = compile_forms(runtime, items)
    prompts = {i.id: ctx.model.chat_prompt(session.messages(i.prompt), forms[i.id].tools if i.id in forms else None)
               for i in items}
    grammars = {k: f.grammar for k, f in forms.items() if f.grammar is not None}
    return fidelity.check(ctx, records, prompts, runtime.costs.gamma, GAMMA_MAX, grammars)
