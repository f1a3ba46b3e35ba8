#!/usr/bin/env python3
"""Router calibration: score a varied prompt set and show, per category, the score spread and tier shares.

    .venv/bin/python scripts/calibrate_router.py [--dataset ../shared/bench/spec_bench.jsonl] [--family DIR]

Defaults in specquant_cli/router.py were set so that short factual questions land low, long multi-entity
analytical prompts land high, and the Spec-Bench categories spread across the three tiers."""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from specquant_cli.session import open_session
from specquant_cli.settings import SessionSettings

FACTUAL = ["What is the capital of France?", "Who wrote Hamlet?", "How many legs does a spider have?",
           "What is 12 times 12?", "When did World War II end?", "What is the boiling point of water?",
           "Name a primary color.", "Translate 'cat' into Spanish."]


def main() -> None:
    here = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default=str(here.parent / "shared" / "bench" / "spec_bench.jsonl"))
    ap.add_argument("--family", default=str(here / "models" / "smollm2-135m"))
    ap.add_argument("--per-category", type=int, default=20)
    ap.add_argument("--config", default=None)
    ap.add_argument("--ctx", type=int, default=32768, help="longest prompt in tokens (the router's limit)")
    a = ap.parse_args()
    cfg = Path(a.config) if a.config else None
    router = open_session(SessionSettings(Path(a.family), a.ctx, router_config=cfg)).router
    rows = defaultdict(list)
    for p in FACTUAL:
        rows["short-factual"].append(router.route(p))
    seen = defaultdict(int)
    for line in open(a.dataset, encoding="utf-8"):
        item = json.loads(line)
        cat = item.get("category", "?")
        if seen[cat] < a.per_category:
            seen[cat] += 1
            rows[cat].append(router.route(item["turns"][0]))
    print("| category | n | score min | median | max | low | medium | high |")
    print("|---|---|---|---|---|---|---|---|")
    for cat, rs in rows.items():
        s = [r.score for r in rs]
        share = {t: sum(r.tier == t for r in rs) / len(rs) for t in ("low", "medium", "high")}
        print(f"| {cat} | {len(rs)} | {min(s):.3f} | {statistics.median(s):.3f} | {max(s):.3f} | "
              f"{share['low']:.0%} | {share['medium']:.0%} | {share['high']:.0%} |")


if __name__ == "__main__":
    main()
