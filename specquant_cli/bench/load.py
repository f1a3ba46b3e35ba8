"""A load benchmark for any OpenAI-compatible server (`specquant bench load`): conversations sent as streamed greedy
chat completions, timed per request, summarized as latency percentiles, throughput and goodput.

The pieces, each usable alone:
- `system_prompt(tokens)`: a deterministic long system prompt (an assistant policy of numbered rules), so that two
  servers benchmarked apart see the very same prompts.
- `conversations(...)`: the scenario as data: who says what, in which turn, with which system prompt.
- `arrival_times(n, rate, seed)`: Poisson arrivals (exponential gaps), seeded and reproducible.
- `run(...)`: the load itself (asyncio + httpx): conversations start at their arrival time, at most
  `concurrency` in flight; turn k of a conversation carries every earlier turn and the server's own answers.
- `summarize(...)`, `percentiles(...)`, `goodput(...)`: the report's figures from the per-request timings.
- after the run, bench.fidelity.judge: the parent alone answers every request's exact messages here (one token per
  call) and every served answer is classified: identical, near-tie, unexplained.

Measured per request, as vLLM's `benchmark_serving.py` does: TTFT from sending the request to the first content
piece (queueing and prefill included), inter-token latencies between consecutive content pieces (a speculative
server may stream several tokens in one piece: its gaps are per piece, not per token), end to end, and the
output tokens (the server's `usage`, else the pieces counted).

No server is trusted: every body is read chunk by chunk within a cap (an event-stream line, one answer's stream,
an error's or GET /v1/models' body; compressed ones inflated step by step within the same caps), every request has
a deadline for the whole of it (and the run one, with --deadline), the answer is over at [DONE] or soon after its
finish_reason, and an answer longer than max_tokens allows (more pieces, more characters, a larger usage) fails
(one request: bench.answer). Each of these is the request's error, never an exception; a failed request counts
toward no figure."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from specquant_cli.bench.answer import (  # noqa: F401 (RequestResult, Target, normal_url: a load's parts, named here)
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    IDENTITY,
    RequestResult,
    Target,
    normal_url,
    stream_chat,
)
from specquant_cli.bench.bounded import (
    MAX_BODY_BYTES,
    Refused,
    brief,
    error_text,
    read_body,
    size_text,
)
from specquant_cli.bench.replay import with_answers
from specquant_cli.bench.stamp import markdown_lines
from specquant_cli.errors import InputError, SpecquantError

SCENARIOS = ("single", "multi-turn", "shared-system")
DEFAULT_SYSTEM_TOKENS = 800
CHARS_PER_TOKEN = 4.0  # English prose in a BPE vocabulary: about four characters a token
PERCENTILES = (50, 95, 99)
DEFAULT_TTFT_TARGET_S = 10.0  # sensible on a CPU; a GPU server would be held to far less
DEFAULT_ITL_TARGET_S = 1.0
PROBE_TIMEOUT_S = 30.0  # GET /v1/models, all of it
MAX_MODEL_ID_CHARS = 256  # the model id taken from GET /v1/models


# -- the prompts ---------------------------------------------------------------------------------------------------

_TOPICS = ("billing questions", "account security", "shipping and delivery", "product returns",
           "technical troubleshooting", "privacy requests", "accessibility needs", "complaints",
           "feature requests", "scheduling", "data exports", "partner integrations")
_RULES = (
    "When a customer asks about {topic}, first restate the question in one sentence so they know it was understood.",
    "Never promise a refund, credit or deadline for {topic} that this policy does not name; say who can decide it.",
    "For {topic}, ask at most one clarifying question at a time, and only when the answer changes what you do.",
    "Keep answers about {topic} short: lead with the answer, then at most three supporting points.",
    "If a message about {topic} contains personal data the task does not need, do not repeat it back.",
    "Escalate {topic} to a human agent when the customer asks twice, or when safety or money is at stake.",
    "Use plain words for {topic}; explain any term a customer may not know the first time you use it.",
    "When you are unsure about {topic}, say so, and say what you would need to know to be sure.",
)


def system_prompt(tokens: int) -> str:
    """A long assistant policy document of numbered rules, about `tokens` tokens (four characters a token), the
    same text for the same `tokens` on every machine (no randomness: the rules are picked by their number)."""
    if tokens < 1:
        raise InputError(f"--system-tokens {tokens}: expected a positive number of tokens")
    budget = int(tokens * CHARS_PER_TOKEN)
    head = ("You are the support assistant of Example Corp. Follow this policy in every answer. The rules are "
            "numbered; when two rules disagree, the lower number wins.\n\n")
    parts, size, n = [head], len(head), 0
    while size < budget:
        n += 1
        rule = _RULES[(n - 1) % len(_RULES)].format(topic=_TOPICS[((n - 1) // len(_RULES)) % len(_TOPICS)])
        line = f"Rule {n}. {rule}\n"
        parts.append(line)
        size += len(line)
    return "".join(parts).rstrip("\n")


@dataclass(frozen=True)
class Conversation:
    """One conversation: its user turns, sent one after another, each with the conversation so far."""

    index: int
    questions: tuple[str, ...]
    system: Optional[str] = None
    predictions: tuple[Optional[str], ...] = ()  # each question's `prediction` (Predicted Outputs), when it has one
    # a replayed trace (bench.replay): each turn's messages as recorded, with the server's own answers to earlier
    # turns in place of the recorded ones (bench.replay.with_answers; `questions` unused), and each turn's other
    # recorded fields sent with them (tools, tool_choice)
    fixed: tuple[tuple[dict, ...], ...] = ()
    fields: tuple[dict, ...] = ()

    @property
    def turns(self) -> int:
        return len(self.fixed) if self.fixed else len(self.questions)


def replayed(turns: Sequence[Sequence[dict]], predictions: Sequence[Optional[str]] = (),
             fields: Sequence[dict] = ()) -> list[Conversation]:
    """A recorded trace (bench.replay) as one conversation: each turn's messages (and its tools, tool_choice) as
    recorded, in order."""
    if not turns:
        raise InputError("no requests to replay")
    return [Conversation(0, (), None, tuple(predictions), tuple(tuple(m) for m in turns), tuple(fields))]


def conversations(scenario: str, questions: Sequence[str], count: int, turns: int,
                  system: Optional[str] = None, predictions: Sequence[Optional[str]] = ()) -> list[Conversation]:
    """`count` conversations of `turns` user turns each (`single`: one turn), taking the questions in order and
    starting over when they run out; `shared-system`: every conversation begins with `system`. `predictions`: each
    question's prediction (None for one without), sent with it."""
    if scenario not in SCENARIOS:
        raise InputError(f"--scenario {scenario!r}: expected one of {', '.join(SCENARIOS)}")
    if not questions:
        raise InputError("no questions to send")
    if scenario == "single" and turns != 1:
        raise InputError(f"--turns {turns}: the single scenario sends one turn per conversation "
                         "(use --scenario multi-turn or shared-system)")
    if scenario == "shared-system" and not system:
        raise InputError("the shared-system scenario needs a system prompt")
    out = []
    for c in range(count):
        picks = [(c * turns + k) % len(questions) for k in range(turns)]
        qs = tuple(questions[i] for i in picks)
        ps = tuple(predictions[i] for i in picks) if predictions else ()
        out.append(Conversation(c, qs, system if scenario == "shared-system" else None, ps))
    return out


def arrival_times(n: int, rate: Optional[float], seed: int = 0) -> list[float]:
    """Offsets (seconds from the start) at which `n` conversations start: a Poisson process of `rate` per second
    (exponential gaps from a generator seeded with `seed`, the first at 0), or all at 0 when `rate` is None."""
    if rate is None:
        return [0.0] * n
    if not rate > 0 or not math.isfinite(rate):
        raise InputError(f"--rate {rate}: expected a positive number of requests per second")
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


# -- the load ------------------------------------------------------------------------------------------------------

def client_timeout(seconds: float):
    """Seconds one read (and connecting, at most 10) may take; a whole request's deadline is stream_chat's."""
    import httpx

    return httpx.Timeout(seconds, connect=min(seconds, 10.0))


async def _probe(client, url: str, headers: dict, need_model: bool, deadline_s: float = PROBE_TIMEOUT_S
                 ) -> Optional[str]:
    """GET /v1/models: the first model's id. An unreachable server is an error; so is a refusal, an answer over
    MAX_BODY_BYTES or none within `deadline_s` when the model id is needed (the body is read bounded)."""
    import httpx

    where = f"GET {url}/v1/models"
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream("GET", url + "/v1/models", headers={**headers, **IDENTITY}) as resp:
                status = resp.status_code
                body, cut = await read_body(resp)
    except TimeoutError:
        raise SpecquantError(f"{where}: no full answer within {deadline_s:g} s") from None
    except Refused as e:
        raise SpecquantError(f"{where}: {e}") from None
    except (httpx.HTTPError, httpx.StreamError, httpx.InvalidURL, OSError) as e:
        raise SpecquantError(f"cannot reach the server at {url} ({type(e).__name__}: {brief(str(e)) or 'no answer'})"
                             ) from None
    if status != 200:
        if need_model:
            raise SpecquantError(f"{where}: {error_text(status, body, cut)}"
                                 + (" (give --api-key)" if status == 401 else "")
                                 + ("; name the model with --model" if status != 401 else ""))
        return None
    if cut:
        if need_model:
            raise SpecquantError(f"{where}: an answer over {size_text(MAX_BODY_BYTES)}; name the model with --model")
        return None
    try:
        model = json.loads(body)["data"][0]["id"]
        if not isinstance(model, (str, int)) or not 0 < len(str(model)) <= MAX_MODEL_ID_CHARS:
            raise TypeError
        return str(model)
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
        if need_model:
            raise SpecquantError(f"{where} listed no model; name it with --model") from None
        return None


def find_model(url: str, api_key: Optional[str], model: Optional[str], timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """The model to ask for: `model`, else the first id of GET /v1/models. Either way the server must answer,
    all of it within `timeout_s`."""
    import httpx

    async def go():
        async with httpx.AsyncClient(timeout=client_timeout(timeout_s)) as client:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            return await _probe(client, url, headers, model is None, timeout_s)

    found = asyncio.run(go())
    return model if model is not None else found


async def _run(target: Target, convs: Sequence[Conversation], starts: Sequence[float], concurrency: Optional[int],
               on_result: Optional[Callable[[RequestResult], None]], deadline_s: Optional[float] = None
               ) -> tuple[list[RequestResult], float]:
    import httpx

    clock = time.perf_counter
    results: list[RequestResult] = []
    limit = concurrency or len(convs)
    gate = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=client_timeout(target.timeout_s), limits=limits) as client:
        t0 = clock()
        run_end = None if deadline_s is None else t0 + deadline_s

        def too_late(at: float) -> bool:
            return run_end is not None and at >= run_end

        async def converse(conv: Conversation, start: float) -> None:
            if too_late(t0 + start):
                return  # it would arrive after the run's deadline: never sent
            await asyncio.sleep(max(0.0, t0 + start - clock()))
            async with gate:
                history: list[dict] = [{"role": "system", "content": conv.system}] if conv.system else []
                answered: list[tuple[Sequence[dict], Optional[str]]] = []  # replayed turns: (recorded, answer)
                for k in range(conv.turns):
                    if too_late(clock()):
                        return  # no request starts after the run's deadline
                    messages = with_answers(conv.fixed[k], answered) if conv.fixed else \
                        [*history, {"role": "user", "content": conv.questions[k]}]
                    r = RequestResult(conv.index, k, messages, conv.predictions[k] if conv.predictions else None,
                                      start_s=clock() - t0, fields=dict(conv.fields[k]) if conv.fields else {})
                    await stream_chat(client, target, r, clock, run_end)
                    results.append(r)
                    if on_result:
                        on_result(r)
                    if not r.ok:
                        return  # the next turn needs this one's answer
                    history = [*messages, {"role": "assistant", "content": r.text}]
                    if conv.fixed:
                        answered.append((conv.fixed[k], r.text if r.finish_reason != "tool_calls" else None))

        await asyncio.gather(*(converse(c, s) for c, s in zip(convs, starts)))
        wall = clock() - t0
    results.sort(key=lambda r: (r.conversation, r.turn))
    return results, wall


def run(target: Target, convs: Sequence[Conversation], starts: Sequence[float], concurrency: Optional[int] = None,
        on_result: Optional[Callable[[RequestResult], None]] = None, deadline_s: Optional[float] = None
        ) -> tuple[list[RequestResult], float]:
    """Every conversation, each starting at its offset in `starts` with at most `concurrency` in flight (None: no
    cap); its turns one after another. (results ordered by conversation and turn, wall seconds). A failed request
    ends its conversation. With `deadline_s` the run ends then: no request starts after it, and those in flight
    are cancelled and fail (DEADLINE_ERROR); the turns never sent are not in the results.
    Ctrl-C cancels every request in flight (their connections closed) and propagates."""
    return asyncio.run(_run(target, convs, starts, concurrency, on_result, deadline_s))


# -- the figures ---------------------------------------------------------------------------------------------------

def percentile(values: Sequence[float], p: float) -> Optional[float]:
    """The p-th percentile, linearly interpolated between the closest ranks (numpy's default); None when empty."""
    xs = sorted(values)
    if not xs:
        return None
    rank = (len(xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def percentiles(values: Sequence[float]) -> dict:
    """{n, mean, p50, p95, p99, max} of `values` in seconds (None figures when there are none)."""
    xs = list(values)
    out = {"n": len(xs), "mean": _r(statistics.fmean(xs)) if xs else None}
    for p in PERCENTILES:
        out[f"p{p}"] = _r(percentile(xs, p))
    out["max"] = _r(max(xs)) if xs else None
    return out


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 6)


def meets(r: RequestResult, ttft_target: float, itl_target: float) -> bool:
    """A request counts toward goodput when it succeeded, its TTFT is within `ttft_target` and its mean
    inter-token latency within `itl_target` (an answer of one piece has no gap, and meets the latter)."""
    if not r.ok or r.ttft_s is None or r.ttft_s > ttft_target:
        return False
    m = r.mean_itl_s
    return m is None or m <= itl_target


def goodput(results: Sequence[RequestResult], wall_s: float, ttft_target: float, itl_target: float,
            planned: Optional[int] = None) -> dict:
    """Requests meeting both targets: how many, their share of the requests planned (default: those sent; a
    turn never sent because an earlier one failed met no target), and per second of the run."""
    good = sum(meets(r, ttft_target, itl_target) for r in results)
    total = planned if planned is not None else len(results)
    return {"ttft_target_s": ttft_target, "itl_target_s": itl_target, "requests": good,
            "share": round(good / total, 4) if total else None,
            "requests_per_s": round(good / wall_s, 4) if wall_s > 0 else None}


def summarize(results: Sequence[RequestResult], wall_s: float, ttft_target: float = DEFAULT_TTFT_TARGET_S,
              itl_target: float = DEFAULT_ITL_TARGET_S, planned: Optional[int] = None) -> dict:
    """The run's figures: counts, throughput, goodput, and TTFT (all, first turns, later turns), inter-token
    latency (every gap of every request, pooled), end to end and output tokens per request as percentiles."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "requests": {"planned": planned if planned is not None else len(results), "sent": len(results),
                     "succeeded": len(ok), "failed": len(results) - len(ok),
                     "no_content": sum(r.ttft_s is None for r in ok)},
        "wall_s": round(wall_s, 3),
        "request_throughput": round(len(ok) / wall_s, 4) if wall_s > 0 else None,
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / wall_s, 3) if wall_s > 0 else None,
        "tokens_from": sorted({r.tokens_from for r in ok}),
        "goodput": goodput(results, wall_s, ttft_target, itl_target, planned),
        "ttft_s": percentiles(ttft),
        "ttft_first_turn_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None and r.turn == 0]),
        "ttft_later_turns_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None and r.turn > 0]),
        "itl_s": percentiles([x for r in ok for x in r.itl_s]),
        "e2e_s": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "output_tokens_per_request": percentiles([float(r.output_tokens) for r in ok]),
        # Predicted Outputs: the requests sent with a prediction, and the tokens of theirs the server said it kept
        # and did not keep (None: it said nothing of them)
        # prompt tokens the server took from its cache (usage.prompt_tokens_details.cached_tokens; None: not said)
        "prompt_tokens": _total(r.prompt_tokens for r in ok),
        "cached_tokens": _total(r.cached_tokens for r in ok),
        "predicted": sum(r.prediction is not None for r in ok),
        "prediction_accepted": _total(r.prediction_accepted for r in ok if r.prediction is not None),
        "prediction_rejected": _total(r.prediction_rejected for r in ok if r.prediction is not None),
    }


def _total(counts) -> Optional[int]:
    """The sum of the counts a server reported; None when it reported none."""
    said = [c for c in counts if c is not None]
    return sum(said) if said else None


# -- the report ----------------------------------------------------------------------------------------------------

def _ms(x: Optional[float]) -> str:
    return "–" if x is None else f"{1000 * x:.0f}"


def markdown(report: dict) -> str:
    c, s = report["config"], report["summary"]
    g, n = s["goodput"], s["requests"]
    share = "–" if g["share"] is None else f"{g['share']:.0%}"
    lines = [f"# specquant bench load: {report['server']['model']} at {report['server']['url']}", "",
             f"- command: `{report['command']}`", *markdown_lines(report.get("stamp")),
             f"- scenario {c['scenario']}: {c['conversations']} conversations × {c['turns']} turns, "
             f"{c['max_tokens']} max tokens, " + (f"Poisson arrivals at {c['rate']}/s (seed {c['seed']})"
                                                  if c["rate"] else f"{c['concurrency']} in flight")
             + (f", a shared system prompt of ~{c['system_tokens']} tokens" if c["scenario"] == "shared-system"
                else ""),
             f"- requests: {n['succeeded']} succeeded, {n['failed']} failed of {n['planned']} planned; wall "
             f"{s['wall_s']:.1f} s",
             f"- throughput: {s['request_throughput']} requests/s, {s['output_tokens_per_s']} output tokens/s "
             f"({s['output_tokens']} tokens)",
             f"- goodput (TTFT ≤ {g['ttft_target_s']:g} s and mean ITL ≤ {g['itl_target_s']:g} s): "
             f"{g['requests']} requests ({share}), {g['requests_per_s']} per second",
             "", "| latency (ms) | n | mean | p50 | p95 | p99 | max |", "|---|---|---|---|---|---|---|"]
    for key, name in (("ttft_s", "TTFT"), ("ttft_first_turn_s", "TTFT, first turns"),
                      ("ttft_later_turns_s", "TTFT, later turns"), ("itl_s", "inter-token"),
                      ("e2e_s", "end to end")):
        p = s[key]
        lines.append(f"| {name} | {p['n']} | {_ms(p['mean'])} | {_ms(p['p50'])} | {_ms(p['p95'])} | "
                     f"{_ms(p['p99'])} | {_ms(p['max'])} |")
    f = report.get("fidelity")
    if report.get("fidelity_error"):
        lines += ["", f"Fidelity: not judged ({report['fidelity_error']})."]
    if f:
        from specquant_cli.bench import fidelity

        lines += ["", f"Fidelity against the parent alone ({report['fidelity_family']}): "
                      + ", ".join(f"{n} {name}" for name, n in fidelity.shown(f)) + f" of {f['judged']}"
                      + (f" ({f['not_judged']} not: a forced tool call)" if f.get("not_judged") else "")
                      + ("." if f.get("exact") else f"; near-tie bound {f['noise']['bound']:.3g}.")]
    return "\n".join(lines) + "\n"
