"""A long prompt beside a running stream (`specquant bench prefill`): for each --prefill-chunk value a server is
started fresh (`serve --parallel 2`, bench.sides), stream A counts to 200, and after A's STREAM_MARK-th piece
request B sends a long prompt that shares nothing with A. Measured: B's time to its first token, and A's gaps
between pieces while B is prefilled (from the mark until B's first piece and half a second more) against A's
gaps before it. A prefill chunk of N tokens makes every round of the batch pay at most an N-token call beside
the running streams: smaller chunks keep A's gaps short and make B's prefill take more rounds."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from specquant_cli.bench.stamp import markdown_lines

STREAM_MARK = 15  # A's pieces before B is sent
A_MAX_TOKENS = 160
B_MAX_TOKENS = 4
AFTER_B_S = 0.5  # gaps of A this long after B's first piece still count as during its prefill
COUNT = "Count from 1 to 200, one number per line."


@dataclass
class Gaps:
    """One chunk's run: A's piece times, when B was sent and when its first piece came."""

    a: list[float] = field(default_factory=list)  # when each of A's pieces came (time.perf_counter)
    b_sent: Optional[float] = None
    b_first: Optional[float] = None
    error: Optional[str] = None

    def summary(self) -> dict:
        if self.error or self.b_sent is None or self.b_first is None or len(self.a) < 3:
            return {"error": self.error or "B never answered or A gave too few pieces"}
        gaps = [(t, t - p) for p, t in zip(self.a, self.a[1:])]
        during = [g for t, g in gaps if self.b_sent < t <= self.b_first + AFTER_B_S]
        before = [g for t, g in gaps if t <= self.b_sent]
        return {"b_ttft_s": round(self.b_first - self.b_sent, 3), "a_gaps_during": len(during),
                "a_gap_max_s": round(max(during), 3) if during else None,
                "a_gap_mean_s": round(statistics.fmean(during), 4) if during else None,
                "a_gap_mean_before_s": round(statistics.fmean(before), 4) if before else None}


def _stream(url: str, messages: list[dict], max_tokens: int, on_piece: Callable[[float], None]) -> None:
    """One streamed greedy chat completion; on_piece(time) for each content piece."""
    import httpx

    body = {"model": "x", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}")
            for line in resp.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                for ch in chunk.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        on_piece(time.perf_counter())


def measure(url: str, b_prompt: str) -> Gaps:
    """A and B against the server at `url`, as the module says."""
    g = Gaps()
    marked = threading.Event()

    def a() -> None:
        def piece(t: float) -> None:
            g.a.append(t)
            if len(g.a) == STREAM_MARK + 1:
                marked.set()

        _stream(url, [{"role": "user", "content": COUNT}], A_MAX_TOKENS, piece)
        marked.set()  # A ended before its mark: B goes now, and the summary says too few pieces

    def b() -> None:
        marked.wait()
        g.b_sent = time.perf_counter()

        def piece(t: float) -> None:
            if g.b_first is None:
                g.b_first = t

        _stream(url, [{"role": "system", "content": "Unrelated preface. " + b_prompt},
                      {"role": "user", "content": "Summarize rule 3."}], B_MAX_TOKENS, piece)

    errors = []

    def guarded(fn):
        def run():
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - the run's error, named in its row
                errors.append(f"{type(e).__name__}: {e}")
                marked.set()
        return run

    threads = [threading.Thread(target=guarded(f)) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    g.error = errors[0] if errors else None
    return g


def run(setup, chunks: Sequence[int], policy: str, b_tokens: int, say: Callable[[str], None]) -> list[dict]:
    """Each chunk value on a server of its own (bench.sides), one at a time: a row per chunk."""
    from specquant_cli.bench import sides
    from specquant_cli.bench.load import system_prompt

    b_prompt = system_prompt(b_tokens)
    rows = []
    for n in chunks:
        c = sides.Contender(f"--prefill-chunk {n}", "specquant", policy, (("serving.prefill_chunk", n),))
        server = sides.start(c, setup, say)
        try:
            sides.warm(server.url, "x")
            rows.append({"prefill_chunk": n, **measure(server.url, b_prompt).summary()})
        finally:
            sides.stop(server)
        say(f"--prefill-chunk {n}: " + _line(rows[-1]))
    return rows


def _line(r: dict) -> str:
    if "error" in r:
        return r["error"]
    return (f"B's TTFT {r['b_ttft_s']:.2f} s; A's gaps during B's prefill: {r['a_gaps_during']}, max "
            f"{r['a_gap_max_s']} s, mean {r['a_gap_mean_s']} s; before it: mean {r['a_gap_mean_before_s']} s")


def markdown(rep: dict) -> str:
    c = rep["config"]
    lines = [f"# A long prompt beside a running stream: {rep['family']} (parent {rep['parent']})", "",
             f"- command: `{rep['command']}`", *markdown_lines(rep.get("stamp")),
             f"- serve --parallel 2 --policy {c['policy']}, {rep['threads']} threads; A counts to 200, after its "
             f"{STREAM_MARK}th piece B sends a ~{c['b_tokens']}-token prompt sharing nothing with A", "",
             "| chunk | B's TTFT s | A's gaps in B's prefill | max gap s | mean gap s | mean gap before s |",
             "|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        if "error" in r:
            lines.append(f"| {r['prefill_chunk']} | {r['error']} | | | | |")
        else:
            lines.append(f"| {r['prefill_chunk']} | {r['b_ttft_s']:.2f} | {r['a_gaps_during']} | {r['a_gap_max_s']} | "
                         f"{r['a_gap_mean_s']} | {r['a_gap_mean_before_s']} |")
    return "\n".join(lines) + "\n"
