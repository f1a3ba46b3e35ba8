"""GET /metrics: the Metrics object over a fake service (exact figures from a fake clock and hand-made records),
then a real `specquant serve` driven by the `openai` client and scraped with prometheus_client's parser."""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_serve import COUNTING, KEY, LONG, N, ServerProc, wait_for

from specquant_cli.serving.metrics import (
    CACHE_COUNTERS,
    CACHE_GAUGES,
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    TTFT_BUCKETS,
    Metrics,
    outcome_of,
)
from specquant_cli.serving.schemas import ApiError
from specquant_cli.serving.worker import disconnected, shutting_down

CACHE = {"enabled": True, "budget_bytes": 1 << 30, "bytes": 12345, "entries": 3, "hits": 7, "misses": 2,
         "evictions": 1, "restored_tokens": 900, "copied_tokens": 40, "dir": None}


class FakeWorker:
    def __init__(self, running: int = 0, queued: int = 0):
        self.running, self.queued = running, queued

    def status(self) -> dict:
        return {"busy": False, "running": self.running, "parallel": 2, "queued": self.queued, "max_queue": 8}


class FakeService:
    """What the collector reads of a Service: the worker's status and the prompt cache's figures."""

    def __init__(self, cache: dict | None = None, running: int = 0, queued: int = 0):
        self.worker = FakeWorker(running, queued)
        self.cache = cache

    def prompt_cache_status(self) -> dict | None:
        return self.cache


def parse(text: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of a /metrics body."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def names(samples: dict) -> set[str]:
    return {name for name, _ in samples}


def rec(text: str, *, prompt=10, prefill=9, new=1, drafted=0, accepted=0, finish=None):
    return SimpleNamespace(text=text, prompt_tokens=prompt, prefill_tokens=prefill, new_tokens=new,
                           drafted=drafted, accepted=accepted, finish_reason=finish, prediction_accepted=0,
                           prediction_rejected=0)


def answer(policy: str):
    return SimpleNamespace(plan=SimpleNamespace(policy=policy))


def clock(*times: float):
    it = iter(times)
    return lambda: next(it)


# -- the Metrics object -------------------------------------------------------------------------------

def test_gauges_and_cache_figures_are_read_from_the_service_at_scrape_time():
    svc = FakeService(dict(CACHE), running=1, queued=2)
    m = Metrics(svc)
    s = parse(m.render().decode())
    assert value(s, "specquant_requests_running") == 1 and value(s, "specquant_requests_queued") == 2
    for key in CACHE_COUNTERS:
        assert value(s, f"specquant_prompt_cache_{key}_total") == CACHE[key]
    for key in CACHE_GAUGES:
        assert value(s, f"specquant_prompt_cache_{key}") == CACHE[key]
    svc.worker.queued, svc.cache["hits"] = 0, 8  # read anew on the next scrape
    s = parse(m.render().decode())
    assert value(s, "specquant_requests_queued") == 0 and value(s, "specquant_prompt_cache_hits_total") == 8


def test_no_prompt_cache_no_cache_metrics():
    s = parse(Metrics(FakeService(None)).render().decode())
    assert not any(n.startswith("specquant_prompt_cache") for n in names(s))
    assert value(s, "specquant_requests_running") == 0


def test_every_outcome_and_offered_policy_starts_at_zero():
    s = parse(Metrics(FakeService(), ["parent", "paper"]).render().decode())
    for outcome in ("served", "cancelled", "failed", "rejected"):
        assert value(s, "specquant_requests_total", outcome=outcome) == 0
    for policy in ("parent", "paper"):
        assert value(s, "specquant_drafted_tokens_total", policy=policy) == 0
        assert value(s, "specquant_accepted_tokens_total", policy=policy) == 0


def test_two_servers_in_one_process_keep_their_own_registries():
    a, b = Metrics(FakeService()), Metrics(FakeService())
    a.observe().end("rejected")
    assert value(parse(a.render().decode()), "specquant_requests_total", outcome="rejected") == 1
    assert value(parse(b.render().decode()), "specquant_requests_total", outcome="rejected") == 0


def test_an_observation_times_first_text_each_later_text_and_the_whole_request():
    m = Metrics(FakeService())
    # arrival 100; texts at 101.5, 101.75, (an empty record: held back, no time read), 102.5; end 103
    obs = m.observe(clock(100.0, 101.5, 101.75, 102.5, 103.0))
    a = answer("paper")
    obs.record(a, rec("Hel", new=1))
    obs.record(a, rec("lo", new=2, drafted=4, accepted=1))
    obs.record(a, rec("", new=3, drafted=4, accepted=2))
    obs.record(a, rec("!", new=4, drafted=8, accepted=3, finish="length"))
    obs.end("served")
    obs.end("cancelled")  # the guard's catch-all after the end: ignored
    s = parse(m.render().decode())
    assert value(s, "specquant_requests_total", outcome="served") == 1
    assert value(s, "specquant_requests_total", outcome="cancelled") == 0
    assert value(s, "specquant_time_to_first_token_seconds_count") == 1
    assert value(s, "specquant_time_to_first_token_seconds_sum") == pytest.approx(1.5)
    assert value(s, "specquant_time_to_first_token_seconds_bucket", le="1.0") == 0
    assert value(s, "specquant_time_to_first_token_seconds_bucket", le="2.0") == 1
    assert value(s, "specquant_inter_token_latency_seconds_count") == 2
    assert value(s, "specquant_inter_token_latency_seconds_sum") == pytest.approx(1.0)
    assert value(s, "specquant_inter_token_latency_seconds_bucket", le="0.5") == 1  # 0.25 s; 0.75 s above
    assert value(s, "specquant_e2e_request_latency_seconds_count") == 1
    assert value(s, "specquant_e2e_request_latency_seconds_sum") == pytest.approx(3.0)
    assert value(s, "specquant_prompt_tokens_total") == 10  # once per request, from its last record
    assert value(s, "specquant_prefill_tokens_total") == 9
    assert value(s, "specquant_generated_tokens_total") == 4
    assert value(s, "specquant_drafted_tokens_total", policy="paper") == 8
    assert value(s, "specquant_accepted_tokens_total", policy="paper") == 3


def test_an_empty_answer_has_its_first_token_time_at_its_last_record():
    m = Metrics(FakeService())
    obs = m.observe(clock(0.0, 0.3, 0.4))
    obs.record(answer("parent"), rec("", new=1, finish="stop"))
    obs.end("served")
    s = parse(m.render().decode())
    assert value(s, "specquant_time_to_first_token_seconds_sum") == pytest.approx(0.3)
    assert value(s, "specquant_inter_token_latency_seconds_count") == 0


def test_a_cancelled_request_counts_what_it_generated_but_no_latency():
    m = Metrics(FakeService())
    obs = m.observe(clock(0.0, 1.0, 2.0))
    obs.record(answer("ngram"), rec("a", prompt=20, prefill=3, new=5, drafted=6, accepted=4))
    obs.end("cancelled")
    s = parse(m.render().decode())
    assert value(s, "specquant_requests_total", outcome="cancelled") == 1
    assert value(s, "specquant_generated_tokens_total") == 5 and value(s, "specquant_prefill_tokens_total") == 3
    assert value(s, "specquant_drafted_tokens_total", policy="ngram") == 6
    assert value(s, "specquant_e2e_request_latency_seconds_count") == 0


def test_outcome_of_a_job_error():
    assert outcome_of(disconnected()) == "cancelled"
    assert outcome_of(asyncio.CancelledError()) == "cancelled"
    assert outcome_of(shutting_down()) == "failed"
    assert outcome_of(ApiError(400, "too long", code="invalid_request")) == "failed"
    assert outcome_of(RuntimeError("boom")) == "failed"


def test_buckets_span_a_cpu_server():
    assert TTFT_BUCKETS[-1] >= 60 and ITL_BUCKETS[0] <= 0.005 and ITL_BUCKETS[-1] >= 10
    assert LATENCY_BUCKETS[-1] >= 600
    for b in (TTFT_BUCKETS, ITL_BUCKETS, LATENCY_BUCKETS):
        assert list(b) == sorted(set(b))


# -- a real server ------------------------------------------------------------------------------------

AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def metrics_server(family_dir):
    s = ServerProc(["--family", str(family_dir), "--api-key", KEY, "--parallel", "1", "--queue", "1",
                    "--policy", "paper", "--policies", "paper,parent"])
    yield s
    s.stop()


def scrape(server) -> dict[tuple, float]:
    r = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def chat(server, **kw):
    return server.client().chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": PROMPT}],
                                                   max_tokens=N, temperature=0, **kw)


@pytest.mark.slow
def test_metrics_count_what_the_client_saw(metrics_server):
    s0 = scrape(metrics_server)
    r1 = chat(metrics_server)  # the default policy: paper
    s1 = scrape(metrics_server)
    chunks = list(chat(metrics_server, stream=True, stream_options={"include_usage": True},
                       extra_body={"specquant_policy": "parent"}))
    s2 = scrape(metrics_server)

    texts = [c for c in chunks if c.choices and c.choices[0].delta.content]
    usage2, info2 = chunks[-1].usage, chunks[-2].model_extra["specquant"]
    info1 = r1.model_extra["specquant"]
    assert delta(s2, s0, "specquant_requests_total", outcome="served") == 2
    for outcome in ("cancelled", "failed", "rejected"):
        assert delta(s2, s0, "specquant_requests_total", outcome=outcome) == 0
    assert delta(s2, s0, "specquant_prompt_tokens_total") == r1.usage.prompt_tokens + usage2.prompt_tokens
    assert delta(s2, s0, "specquant_generated_tokens_total") == r1.usage.completion_tokens + usage2.completion_tokens
    assert r1.usage.completion_tokens > 1 and usage2.completion_tokens > 1
    # the server's first prompt is decoded but for its last token (fed with the first step); the same prompt
    # again is all in the slot's KV cache
    assert delta(s1, s0, "specquant_prefill_tokens_total") == r1.usage.prompt_tokens - 1
    assert delta(s2, s1, "specquant_prefill_tokens_total") == 0

    assert info1["policy"] == "paper" and info1["drafted"] > 0 and info2["policy"] == "parent"
    assert delta(s2, s0, "specquant_drafted_tokens_total", policy="paper") == info1["drafted"]
    assert delta(s2, s0, "specquant_accepted_tokens_total", policy="paper") == info1["accepted"]
    assert value(s2, "specquant_drafted_tokens_total", policy="parent") == 0  # the parent alone drafts nothing
    assert value(s2, "specquant_accepted_tokens_total", policy="parent") == 0

    for name in ("specquant_time_to_first_token_seconds", "specquant_e2e_request_latency_seconds"):
        assert delta(s2, s0, name + "_count") == 2
        assert delta(s2, s0, name + "_bucket", le="+Inf") == 2
        assert 0 < delta(s2, s0, name + "_sum") < 60
    assert delta(s2, s0, "specquant_e2e_request_latency_seconds_sum") > \
        delta(s2, s0, "specquant_time_to_first_token_seconds_sum")
    itl = "specquant_inter_token_latency_seconds_count"
    assert delta(s2, s1, itl) == len(texts) - 1  # one gap between each two text chunks of the stream
    assert 1 <= delta(s1, s0, itl) <= r1.usage.completion_tokens
    assert value(s2, "specquant_requests_running") == 0 and value(s2, "specquant_requests_queued") == 0


def _long_stream(server):
    """A streamed completion of LONG tokens by the parent, read until it is known to be generating."""
    stream = server.client().completions.create(model="m", prompt=COUNTING, max_tokens=LONG, temperature=0,
                                                stream=True, extra_body={"specquant_policy": "parent"})
    it = iter(stream)
    for _ in range(3):
        next(it)
    return stream


@pytest.mark.slow
def test_running_queued_rejected_and_cancelled(metrics_server):
    s0 = scrape(metrics_server)
    with pytest.raises(openai.BadRequestError):
        chat(metrics_server, extra_body={"specquant_policy": "no-such-policy"})
    stream = _long_stream(metrics_server)
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(chat, metrics_server)  # waits behind the stream
        assert wait_for(lambda: value(scrape(metrics_server), "specquant_requests_queued") == 1)
        with pytest.raises(openai.RateLimitError):
            chat(metrics_server)
        s1 = scrape(metrics_server)
        stream.close()  # the queued request now runs
        assert queued.result(timeout=60).usage.completion_tokens > 0
    assert wait_for(lambda: delta(scrape(metrics_server), s0, "specquant_requests_total", outcome="cancelled") == 1)
    s2 = scrape(metrics_server)
    assert value(s1, "specquant_requests_running") == 1 and value(s1, "specquant_requests_queued") == 1
    assert delta(s2, s0, "specquant_requests_total", outcome="rejected") == 2  # the unknown policy, the 429
    assert delta(s2, s0, "specquant_requests_total", outcome="served") == 1
    assert delta(s2, s0, "specquant_requests_total", outcome="failed") == 0
    assert delta(s2, s0, "specquant_e2e_request_latency_seconds_count") == 1  # the served one only
    assert delta(s2, s0, "specquant_time_to_first_token_seconds_count") == 2  # the stream had its first text
    assert value(s2, "specquant_requests_running") == 0 and value(s2, "specquant_requests_queued") == 0


@pytest.mark.slow
def test_metrics_need_the_api_key_and_health_does_not(metrics_server):
    url = metrics_server.url
    assert httpx.get(url + "/metrics", timeout=10).status_code == 401
    assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    s = scrape(metrics_server)
    expected = {"specquant_requests_total", "specquant_prompt_tokens_total", "specquant_prefill_tokens_total",
                "specquant_generated_tokens_total", "specquant_drafted_tokens_total",
                "specquant_accepted_tokens_total", "specquant_requests_running", "specquant_requests_queued",
                *(f"specquant_{h}_seconds_{part}" for h, part in itertools.product(
                    ("time_to_first_token", "inter_token_latency", "e2e_request_latency"), ("count", "sum", "bucket")))}
    assert expected <= names(s)
