#!/usr/bin/env python3
"""What an idle conversation's cells cost the others in one unified KV cache, as docs/serve.md reports it (why serve
parks idle slots): a sequence at 1,500 positions times a one-token and a 32-token call alone, then with another
sequence of 2,400 idle positions held beside it, then after that one is cleared. Two rounds; each figure the mean of
the faster half of its timings. Prints one JSON line per round.

    .venv/bin/python scripts/idle_cells.py models/qwen2.5-coder-1.5b/qwen2.5-coder-1.5b-bf16.gguf --threads 2
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specquant_cli.backend.context import Context  # noqa: E402
from specquant_cli.backend.model import Model  # noqa: E402

ACTIVE, IDLE = 1500, 2400


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = Model(args.gguf)
    rng = random.Random(1)
    toks = [rng.randrange(200, min(30000, model.n_vocab)) for _ in range(ACTIVE + IDLE + 64)]
    ctx = Context(model, n_ctx=8 * 4096, n_batch=512, n_threads=args.threads, n_seq_max=8, kv_unified=True)

    def fill(seq: int, start: int, n: int) -> None:
        for i in range(0, n, 512):
            k = min(512, n - i)
            ctx.decode_at(toks[start + i:start + i + k], list(range(i, i + k)), [(seq,)] * k, [])

    def call_ms(size: int, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ctx.decode_at(toks[-size:], list(range(ACTIVE, ACTIVE + size)), [(1,)] * size, [size - 1])
            times.append(time.perf_counter() - t0)
            ctx.remove(1, ACTIVE, -1)
        times.sort()
        half = times[:max(1, repeats // 2)]
        return round(1000 * sum(half) / len(half), 1)

    for r in range(args.rounds):
        ctx.remove(0, 0, -1)
        ctx.remove(1, 0, -1)
        fill(1, 0, ACTIVE)
        alone = (call_ms(1, 12), call_ms(32, 6))
        fill(0, ACTIVE, IDLE)  # an idle conversation's cells, beside the active sequence's
        beside = (call_ms(1, 12), call_ms(32, 6))
        ctx.remove(0, 0, -1)
        cleared = (call_ms(1, 12), call_ms(32, 6))
        print(json.dumps({"round": r + 1, "positions": ACTIVE, "idle_cells": IDLE,
                          "one_token_ms": {"alone": alone[0], "idle_beside": beside[0], "cleared": cleared[0]},
                          "32_tokens_ms": {"alone": alone[1], "idle_beside": beside[1], "cleared": cleared[1]}}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
