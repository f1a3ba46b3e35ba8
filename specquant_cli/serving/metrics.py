"""`GET /metrics`: the server's figures in Prometheus' text format.

Each `Metrics` owns a registry of its own (never prometheus_client's global one), so several servers can
live in one process. The app opens one `Observation` per generation request when it arrives and hands it
every record it takes from the job; the observation fills the counters and histograms and is ended once with
the request's outcome:

    served     the whole answer went out
    cancelled  the client went away first (or its stream was never read)
    failed     the job ended with an error (a prompt too long, an engine error, the server stopping)
    rejected   refused before a job was queued: a 4xx on the body or the policy, 429 queue full

Times are time.monotonic seconds from the request's arrival at its route. A record is one token's text
(`decoding.stream` yields one per token; text held back for a possible stop string comes with a later one),
so the inter-token latency is measured per token, between consecutive records that carry text as the app
takes them from the job; tokens accepted from one draft arrive together, so it shows the short gaps inside
a draft beside the longer gaps of a parent call. The requests running and queued, and the prompt cache's
figures, are read from the service when Prometheus scrapes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from specquant_cli.serving.schemas import ApiError

PREFIX = "specquant_"
CONTENT_TYPE = CONTENT_TYPE_LATEST
OUTCOMES = ("served", "cancelled", "failed", "rejected")
# Buckets for a CPU server: a long prompt's prefill can take a minute, a parent call on a big model seconds.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
LATENCY_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0)
# The prompt cache's figures (Service.prompt_cache_status keys): counters, then gauges.
CACHE_COUNTERS = {"hits": "Prompts whose prefix the prompt cache held",
                  "misses": "Prompts whose prefix the prompt cache did not hold",
                  "evictions": "Entries the prompt cache dropped to stay within its budget",
                  "restored_tokens": "Prompt tokens restored from the prompt cache instead of decoded",
                  "copied_tokens": "Prompt tokens obtained by copying another sequence's prefix"}
CACHE_GAUGES = {"bytes": "Bytes the prompt cache holds",
                "budget_bytes": "Bytes the prompt cache may hold",
                "entries": "Entries the prompt cache holds"}


class WorkerStatus(Protocol):
    def status(self) -> dict: ...


class Observed(Protocol):
    """What the scrape-time collector reads of a service (serving.service.Service)."""

    worker: WorkerStatus

    def prompt_cache_status(self) -> Optional[dict]: ...


class Metrics:
    """The server's metrics, in a registry of their own; `render()` is the body of GET /metrics."""

    def __init__(self, svc: Observed, policies: Sequence[str] = ()):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "requests", "Generation requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of the generations", registry=r)
        self.prefill_tokens = Counter(PREFIX + "prefill_tokens", "Prompt tokens the parent decoded (the rest "
                                      "came from its cache; the last prompt token decodes with the first step)",
                                      registry=r)
        self.generated_tokens = Counter(PREFIX + "generated_tokens", "Tokens generated", registry=r)
        self.drafted = Counter(PREFIX + "drafted_tokens", "Tokens drafted, by policy", ["policy"], registry=r)
        self.accepted = Counter(PREFIX + "accepted_tokens", "Drafted tokens the parent accepted, by policy",
                                ["policy"], registry=r)
        self.prediction = Counter(PREFIX + "prediction_tokens", "Tokens of requests' predictions (Predicted Outputs) "
                                  "the parent verified, by whether it kept them", ["kept"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "From a request's arrival to its first text",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Between consecutive tokens' text of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.latency = Histogram(PREFIX + "e2e_request_latency_seconds", "From a served request's arrival to its "
                                 "last text", buckets=LATENCY_BUCKETS, registry=r)
        for outcome in OUTCOMES:  # every series exists from the start, at 0
            self.requests.labels(outcome)
        for kept in ("accepted", "rejected"):
            self.prediction.labels(kept)
        for policy in policies:
            self.drafted.labels(policy)
            self.accepted.labels(policy)
        r.register(ServiceCollector(svc))

    def observe(self, clock: Callable[[], float] = time.monotonic) -> Observation:
        """A new request's observation, its arrival now."""
        return Observation(self, clock)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Observation:
    """One generation request from arrival to end, as the app sees it. `end` counts once; later calls are
    ignored (the guard's catch-all ends what nothing else did)."""

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.monotonic):
        self._m = metrics
        self._clock = clock
        self.arrival = clock()
        self._text_at: Optional[float] = None  # when the previous text came
        self._answer = None
        self._last = None  # the latest record (its stats are cumulative)
        self.outcome: Optional[str] = None

    def record(self, answer, rec) -> None:
        """A record taken from the job. An answer without any text has its first "text" at its last record."""
        self._answer, self._last = answer, rec
        if not rec.text and (rec.finish_reason is None or self._text_at is not None):
            return
        t = self._clock()
        if self._text_at is None:
            self._m.ttft.observe(t - self.arrival)
        else:
            self._m.itl.observe(t - self._text_at)
        self._text_at = t

    def end(self, outcome: str) -> None:
        """Count the request with `outcome` (one of OUTCOMES) and what it generated, served or not."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        m = self._m
        m.requests.labels(outcome).inc()
        rec = self._last
        if rec is not None:
            m.prompt_tokens.inc(rec.prompt_tokens)
            m.prefill_tokens.inc(rec.prefill_tokens)
            m.generated_tokens.inc(rec.new_tokens)
            m.drafted.labels(self._answer.plan.policy).inc(rec.drafted)
            m.accepted.labels(self._answer.plan.policy).inc(rec.accepted)
            m.prediction.labels("accepted").inc(rec.prediction_accepted)
            m.prediction.labels("rejected").inc(rec.prediction_rejected)
        if outcome == "served":
            m.latency.observe(self._clock() - self.arrival)


def outcome_of(error: BaseException) -> str:
    """The outcome of a request that a job's error (or an exception) ended."""
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    if isinstance(error, ApiError) and error.code == "client_disconnected":
        return "cancelled"
    return "failed"


class ServiceCollector:
    """What the service says when Prometheus scrapes: requests running and queued, and the prompt cache's
    figures (none while `prompt_cache_status()` is None: no cache)."""

    def __init__(self, svc: Observed):
        self._svc = svc

    def collect(self) -> Iterator[Metric]:
        status = self._svc.worker.status()
        yield GaugeMetricFamily(PREFIX + "requests_running", "Requests generating now", value=status["running"])
        yield GaugeMetricFamily(PREFIX + "requests_queued", "Requests waiting for a slot", value=status["queued"])
        cache = self._svc.prompt_cache_status()
        if cache is None:
            return
        yield from cache_metrics(cache)


def cache_metrics(cache: dict[str, Any]) -> Iterator[Metric]:
    name = PREFIX + "prompt_cache_"
    for key, doc in CACHE_COUNTERS.items():
        yield CounterMetricFamily(name + key, doc, value=cache[key])  # exported as name_total
    for key, doc in CACHE_GAUGES.items():
        yield GaugeMetricFamily(name + key, doc, value=cache[key])
