"""The engine itself (`specquant bench engine`): the parent alone against each drafter at each draft length, greedy,
on a few code and explanation prompts, every run from empty caches; and the engine's overhead — its wall time over
the time of the llama.cpp calls it made, priced two ways: as timed where they happened (in-run) and by a separate
median-of-5 timing of each call size (the cost model a plan is made from).

Each run's calls are counted by (model, tokens, logits kept) through a spy on each context's decode (the call
itself runs unchanged). Runs are interleaved per prompt, so the VM's drift falls on every configuration alike."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from specquant_cli.bench.stamp import markdown_lines

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring and two examples.",
    "Explain what a hash table is and how collisions are handled.",
    "Write a bash script that prints the ten largest files under the current directory.",
    "What is the difference between a process and a thread? Answer in a short paragraph.",
    "Refactor this code to use a list comprehension:\nresult = []\nfor x in range(20):\n    if x % 3 == 0:\n"
    "        result.append(x * x)\nprint(result)",
]
DRAFT_FREE = ("ngram", "suffix")  # drafters without a model


class CallLog:
    """Counts every decode of the contexts it spies on, by (model, tokens, logits mode), and the seconds inside."""

    def __init__(self):
        self.calls: Counter = Counter()
        self.seconds = 0.0

    def spy(self, ctx, name: str) -> None:
        inner = ctx.decode

        def decode(tokens, logits="last"):
            self.calls[(name, len(tokens), logits)] += 1
            t0 = time.perf_counter()
            try:
                return inner(tokens, logits)
            finally:
                self.seconds += time.perf_counter() - t0

        ctx.decode = decode

    def clear(self) -> None:
        self.calls.clear()
        self.seconds = 0.0


@dataclass
class Config:
    name: str
    drafter: Optional[str]  # a role, "ngram", or None: the parent alone
    gamma: object  # an int, or "adaptive"


@dataclass
class RunResult:
    tokens_per_s: float
    total_s: float
    acceptance: float
    mean_accepted_length: float
    identical: bool
    decode_s: float
    calls: Counter = field(default_factory=Counter)


def configs(drafters: Sequence[str], gammas: Sequence[int]) -> list[Config]:
    out = [Config("parent", None, 0)]
    for d in drafters:
        out += [Config(f"{d} g={g}", d, g) for g in gammas] + [Config(f"{d} adaptive", d, "adaptive")]
    return out


def run(family, drafters: Sequence[str], gammas: Sequence[int], max_tokens: int, n_prompts: int, n_ctx: int,
        threads: int, progress: Optional[Callable[[str], None]] = None) -> dict:
    """Every configuration on every prompt, interleaved per prompt; then each call size the runs made, timed
    alone. Returns {"results": {config: [RunResult]}, "cost": {(model, tokens, mode): s}}."""
    from specquant_cli.backend.llama import Context, Model
    from specquant_cli.decoding.drafters import ModelDrafter, NGramDrafter
    from specquant_cli.decoding.engine import Engine
    from specquant_cli.decoding.gamma import AdaptiveGamma, FixedGamma
    from specquant_cli.decoding.stream import generate_text
    from specquant_cli.decoding.suffix import SuffixDrafter

    parent = family.parent_rendering
    roles = [parent] + [d for d in dict.fromkeys(drafters) if d not in DRAFT_FREE]
    models = {r: Model(family.path(r)) for r in roles}
    ctxs = {r: Context(m, n_ctx, n_threads=threads) for r, m in models.items()}
    try:
        log = CallLog()
        for r, c in ctxs.items():
            log.spy(c, r)
        prompts = [models[parent].chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS[:n_prompts]]
        cfgs = configs(drafters, gammas)

        def engine(c: Config):
            if c.drafter is None:
                return Engine(ctxs[parent])
            d = NGramDrafter() if c.drafter == "ngram" else SuffixDrafter() if c.drafter == "suffix" else \
                ModelDrafter(ctxs[c.drafter], c.drafter)
            return Engine(ctxs[parent], d, AdaptiveGamma() if c.gamma == "adaptive" else FixedGamma(c.gamma))

        for r in ctxs:  # warm-up: every model decodes once before the clock
            generate_text(Engine(ctxs[r]), prompts[0], 8)
        results: dict[str, list[RunResult]] = {c.name: [] for c in cfgs}
        for i, p in enumerate(prompts):
            ref = None
            for c in cfgs:
                if progress:
                    progress(f"prompt {i + 1}/{len(prompts)}: {c.name}")
                for ctx in ctxs.values():
                    ctx.reset()  # every run pays its own prefill, like a fresh request
                log.clear()
                _, toks, last = generate_text(engine(c), p, max_tokens)
                ref = toks if c.drafter is None else ref
                results[c.name].append(RunResult(last.tokens_per_s, last.total_s, last.acceptance_rate,
                                                 last.mean_accepted_length, toks == ref, log.seconds,
                                                 Counter(log.calls)))
        if progress:
            progress("each call size alone")
        prefix = prompts[0] + models[parent].tokenize(" def f(x):\n    return x * 2\n" * 60, add_bos=False)
        cost = {}
        for role in ctxs:
            for mode in ("all", "last", "none"):
                need = sorted({n for rs in results.values() for r in rs for (m, n, lm) in r.calls
                               if m == role and lm == mode})
                if need:
                    for n, t in _micro(ctxs[role], prefix[:max(need) + 8], need, mode).items():
                        cost[(role, n, mode)] = t
        return {"results": results, "cost": cost, "parent": parent, "prompts": len(prompts)}
    finally:
        for c in ctxs.values():
            c.close()
        for m in models.values():
            m.close()


def _micro(ctx, prefix: list[int], sizes, logits: str, reps: int = 5) -> dict[int, float]:
    """Median seconds of one decode of n tokens at the end of `prefix`."""
    ctx.reset()
    ctx.sync(prefix, logits="none")
    base = ctx.n_past
    out = {}
    for n in sizes:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            ctx.decode(prefix[-n:] if n <= len(prefix) else prefix * n, logits=logits)
            ts.append(time.perf_counter() - t0)
            ctx.rewind(base)
        out[n] = statistics.median(ts)
    return out


def report(family, measured: dict, config: dict, stamp: dict, machine: dict) -> dict:
    """Per configuration: mean tok/s, speedup over the parent, acceptance, mean accepted length, identical
    answers, the overhead over the in-run call time and over the cost model; the component costs."""
    results, cost = measured["results"], measured["cost"]
    base = statistics.mean(r.tokens_per_s for r in results["parent"])
    rows = []
    for name, rs in results.items():
        tps = statistics.mean(r.tokens_per_s for r in rs)
        predicted = [sum(k * cost[key] for key, k in r.calls.items()) for r in rs]
        rows.append({"config": name, "tokens_per_s": round(tps, 3), "speedup": round(tps / base, 4),
                     "acceptance": None if name == "parent" else round(statistics.mean(r.acceptance for r in rs), 4),
                     "mean_accepted_length": round(statistics.mean(r.mean_accepted_length for r in rs), 3),
                     "identical": sum(r.identical for r in rs), "runs": len(rs),
                     "overhead_in_run": round(statistics.mean(r.total_s / r.decode_s - 1 for r in rs), 4),
                     "overhead_cost_model": round(statistics.mean(r.total_s / p - 1
                                                                  for r, p in zip(rs, predicted)), 4)})
    return {"command": stamp["command"], "stamp": stamp, "machine": machine,
            "family": {"name": family.name, "root": str(family.root), "parent": measured["parent"],
                       "provenance": family.provenance},
            "config": {**config, "prompts": measured["prompts"]}, "configs": rows,
            "cost_ms": [{"model": m, "tokens": n, "logits": lm, "ms": round(1000 * t, 3)}
                        for (m, n, lm), t in sorted(cost.items())]}


def markdown(rep: dict) -> str:
    c = rep["config"]
    lines = [f"# Engine benchmark: {rep['family']['name']} (parent {rep['family']['parent']}), greedy, "
             f"{c['prompts']} prompts x {c['max_tokens']} new tokens", "", f"- command: `{rep['command']}`",
             *markdown_lines(rep.get("stamp")),
             f"- provenance: {rep['family']['provenance']}", "",
             "| config | tok/s | × parent | accept | tok/call | identical | overhead in-run | overhead model |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rep["configs"]:
        acc = "–" if r["acceptance"] is None else f"{r['acceptance']:.1%}"
        lines.append(f"| {r['config']} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | {acc} | "
                     f"{r['mean_accepted_length']:.2f} | {r['identical']}/{r['runs']} | {r['overhead_in_run']:+.1%} "
                     f"| {r['overhead_cost_model']:+.1%} |")
    lines += ["", "Component costs (ms, median of 5; * = logits for every token, as a verification asks):", ""]
    models = dict.fromkeys(x["model"] for x in rep["cost_ms"])
    for m in models:
        row = ", ".join(f"{x['tokens']}{'*' if x['logits'] == 'all' else ''}: {x['ms']:.1f}" for x in rep["cost_ms"]
                        if x["model"] == m)
        lines.append(f"- {m}: {row}")
    lines += ["", "In-run overhead: wall time over the time inside llama.cpp's decode calls of that run. Cost-model "
              "overhead: wall time over the same calls priced by each size's separate timing; the VM's drift between "
              "minutes makes that column the noisier one."]
    return "\n".join(lines) + "\n"
