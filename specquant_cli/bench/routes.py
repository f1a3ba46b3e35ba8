"""The router over a prompt set (`specquant bench route`): per category, the spread of complexity scores and the
share of each tier — what the router's weights and thresholds were set against (short factual questions land
low, long multi-entity analytical prompts high, Spec-Bench's categories spread over the three tiers)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

from specquant_cli.bench.stamp import markdown_lines
from specquant_cli.names import TIERS

# Short factual questions, scored as a category of their own beside the prompt set's.
FACTUAL = ["What is the capital of France?", "Who wrote Hamlet?", "How many legs does a spider have?",
           "What is 12 times 12?", "When did World War II end?", "What is the boiling point of water?",
           "Name a primary color.", "Translate 'cat' into Spanish."]


def score(router, items: Sequence, factual: bool = True) -> list[dict]:
    """A row per category (the short factual questions first): prompts, score min / median / max, tier shares."""
    routes = defaultdict(list)
    if factual:
        routes["short-factual"] = [router.route(p) for p in FACTUAL]
    for it in items:
        routes[it.category].append(router.route(it.prompt))
    rows = []
    for cat, rs in routes.items():
        s = [r.score for r in rs]
        rows.append({"category": cat, "prompts": len(rs), "score_min": round(min(s), 4),
                     "score_median": round(statistics.median(s), 4), "score_max": round(max(s), 4),
                     "tiers": {t: round(sum(r.tier == t for r in rs) / len(rs), 4) for t in TIERS}})
    return rows


def markdown(rep: dict) -> str:
    lines = [f"# Router scores: {rep['config']['datasets']}", "", f"- command: `{rep['command']}`",
             *markdown_lines(rep.get("stamp")),
             f"- thresholds: low < {rep['thresholds']['low_max']} <= medium < {rep['thresholds']['medium_max']} <= "
             "high", "", "| category | n | score min | median | max | " + " | ".join(TIERS) + " |",
             "|---|---|---|---|---|" + "---|" * len(TIERS)]
    for r in rep["rows"]:
        lines.append(f"| {r['category']} | {r['prompts']} | {r['score_min']:.3f} | {r['score_median']:.3f} | "
                     f"{r['score_max']:.3f} | " + " | ".join(f"{r['tiers'][t]:.0%}" for t in TIERS) + " |")
    return "\n".join(lines) + "\n"
