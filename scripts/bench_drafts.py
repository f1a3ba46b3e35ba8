#!/usr/bin/env python3
"""Draft variants: plain Q4_0, imatrix Q4_0, graded ~3.5 / ~3.0 bits, Q4_0 embeddings — size,
draft step time, teacher-forced greedy agreement with the F16 and perplexity on held text.

    .venv/bin/python scripts/bench_drafts.py --family models/qwen2.5-coder-1.5b --make \\
        --json-file drafts.json --markdown drafts.md --plot drafts.png

--make first collects the activation statistics (when the family has none) and quantizes the recipes the
family lacks (q4i, q4s, q4si, q3g, q3g30), as `specquant calibrate-activations` and `specquant quantize --types`
would. Then, one model loaded at a time:

* stream: the F16's own greedy continuation (--stream-tokens) of one chat prompt per Spec-Bench category
  (the first of each of --categories in --dataset, read as `specquant bench` reads it: bench.datasets),
  decoded token by token as `chat --policy parent` does (system.calibration.greedy_answer);
* agreement: each variant reads prompt + stream in one batch (teacher forcing, system.calibration.draft_hits,
  as `specquant calibrate` measures it); the share of stream
  positions where its argmax equals the F16's token. Because a greedy draft's proposals are exactly these
  argmaxes for as long as it has matched, the same pass also gives the exact greedy speculative outcome at a
  fixed draft length (--gamma): acceptance (accepted / drafted) and new tokens per parent call;
* step: milliseconds of one single-token decode after a 64-token prefill (median of --steps);
* ppl: perplexity on held text (scripts/heldout_text.txt, not part of the calibration set), windows of 512.

JSON (--json-file) and markdown (--markdown, also on stdout), a plot of bits per weight vs agreement
(--plot); progress on stderr. At the end it prints the `specquant bench` command that compares the
spec-<role> policies end to end on 6 Spec-Bench categories x 3 prompts."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from specquant_cli.backend.llama import Context, Model
from specquant_cli.bench import datasets
from specquant_cli.errors import InputError
from specquant_cli.family.manifest import Family
from specquant_cli.family.roles import PARENT_ROLE, recipe_roles
from specquant_cli.system.calibration import draft_hits, greedy_answer

REPO = Path(__file__).resolve().parent.parent
ROLES = ("q4", *recipe_roles())  # q4 and every draft recipe
CATEGORIES = "coding,math_reasoning,qa,translation,summarization,rag"
HELD = Path(__file__).with_name("heldout_text.txt")
WINDOW = 512


def log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def load_prompts(dataset: Path, categories: list[str], per_category: int) -> list[tuple[str, str]]:
    """(category, prompt) for the first `per_category` items of each category, in `categories`' order (read as
    `specquant bench` reads a dataset: bench.datasets.load)."""
    try:
        items = datasets.load([dataset], categories, per_category)
    except InputError as e:
        raise SystemExit(str(e)) from None
    return sorted(((i.category, i.prompt) for i in items), key=lambda cp: categories.index(cp[0]))


def spec_outcome(hits: list[bool], gamma: int) -> tuple[int, int, int]:
    """(drafted, accepted, parent calls) of greedy speculative decoding with fixed gamma along a stream whose
    teacher-forced hits (system.calibration.draft_hits) are `hits`."""
    i = drafted = accepted = calls = 0
    while i < len(hits):
        g = min(gamma, len(hits) - i)
        k = 0
        while k < g and hits[i + k]:
            k += 1
        drafted, accepted, calls = drafted + g, accepted + k, calls + 1
        i += k + 1  # the accepted drafts, then the parent's own token
    return drafted, accepted, calls


def step_ms(model: Model, prompt: list[int], steps: int) -> float:
    ctx = Context(model, n_ctx=len(prompt) + steps + 8, n_batch=max(64, len(prompt)))
    try:
        ctx.decode(prompt, logits="last")
        times = []
        for _ in range(steps):
            t = int(np.argmax(ctx.logits(-1)))
            t0 = time.perf_counter()
            ctx.decode([t], logits="last")
            times.append(time.perf_counter() - t0)
        return statistics.median(times[2:] or times) * 1000
    finally:
        ctx.close()


def perplexity(model: Model, tokens: list[int]) -> float:
    nll, n = 0.0, 0
    for s in range(0, len(tokens) - 1, WINDOW):
        win = tokens[s:s + WINDOW]
        if len(win) < 2:
            break
        ctx = Context(model, n_ctx=len(win) + 8, n_batch=len(win))
        try:
            ctx.decode(win, logits="all")
            for i in range(len(win) - 1):
                row = ctx.logits(i).astype(np.float64)
                m = row.max()
                nll += m + math.log(np.exp(row - m).sum()) - row[win[i + 1]]
                n += 1
        finally:
            ctx.close()
    return math.exp(nll / max(1, n))


def make_missing(fam: Family, roles: list[str], threads: int) -> None:
    from specquant_cli.family import imatrix as im
    from specquant_cli.family.recipes import add_variants
    from specquant_cli.family.variants import RECIPES

    want = [RECIPES[r] for r in roles if r in RECIPES]
    if not want:
        return
    if any(r.imatrix or r.grade for r in want) and not (fam.root / im.IMATRIX_FILE).is_file():
        log(f"collecting activation statistics of {fam.name} (built-in calibration set) ...")
        t0 = time.perf_counter()
        im.calibrate_family(fam, threads=threads or None,
                            progress=lambda d, t: log(f"  {d}/{t} tokens ({time.perf_counter() - t0:.0f}s)"))
        fam = Family.load(fam.root)
    add_variants(fam.root, want, threads=threads, say=lambda t: log("  " + t))


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"## Draft variants of {report['family']} ({cfg['streams']} streams x {cfg['stream_tokens']} tokens, "
             f"gamma {cfg['gamma']})", "",
             "| role | type | size | bits/weight | step ms | agreement | acceptance (γ={g}) | tokens / parent call | "
             "ppl |".format(g=cfg["gamma"]),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["variants"]:
        lines.append(f"| {r['role']} | {r['type']} | {r['size_bytes'] / 2**20:.0f} MiB | {r['bits_per_weight']:.2f} | "
                     f"{r['step_ms']:.1f} | {r['agreement']:.1%} | {r['acceptance']:.1%} | "
                     f"{r['tokens_per_parent_call']:.2f} | {r['ppl']:.3f} |")
    lines += ["", "Per category agreement:", "",
              "| role | " + " | ".join(report["categories"]) + " |",
              "|---|" + "---|" * len(report["categories"])]
    for r in report["variants"]:
        lines.append(f"| {r['role']} | " + " | ".join(f"{r['agreement_by_category'][c]:.1%}"
                                                      for c in report["categories"]) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specquant_cli.fsutil import atomic_path

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in report["variants"]:
        if r["role"] == PARENT_ROLE:
            continue
        ax.scatter(r["bits_per_weight"], r["agreement"], s=60, color="tab:blue")
        ax.annotate(f"{r['role']} ({r['step_ms']:.1f} ms)", (r["bits_per_weight"], r["agreement"]),
                    textcoords="offset points", xytext=(5, 5), fontsize=9)
    ax.set_xlabel("bits per weight (file)")
    ax.set_ylabel("teacher-forced greedy agreement with F16")
    ax.set_title(f"{report['family']} drafts: size vs agreement (label: draft step)")
    fig.tight_layout()
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="models/qwen2.5-coder-1.5b")
    ap.add_argument("--roles", default=",".join(ROLES), help="draft roles to measure (f16 is the reference)")
    ap.add_argument("--make", action="store_true", help="collect statistics / quantize the recipes that are missing")
    ap.add_argument("--dataset", default=str(REPO.parent / "shared" / "bench" / "spec_bench.jsonl"))
    ap.add_argument("--categories", default=CATEGORIES)
    ap.add_argument("--per-category", type=int, default=1, help="stream prompts per category")
    ap.add_argument("--stream-tokens", type=int, default=96)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--ppl-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json-file")
    ap.add_argument("--markdown")
    ap.add_argument("--plot")
    args = ap.parse_args()

    if args.threads:
        os.environ["SPECQUANT_THREADS"] = str(args.threads)
    fam = Family.load(args.family)
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    if args.make:
        make_missing(fam, roles, args.threads)
        fam = Family.load(args.family)
    missing = [r for r in roles if r not in fam.roles()]
    if missing:
        raise SystemExit(f"{fam.name} has no {', '.join(missing)} role(s); run with --make, or: specquant quantize "
                         f"{fam.path('f16')} --out {fam.root} --types {','.join(missing)}")
    cats = [c.strip() for c in args.categories.split(",") if c.strip()]
    t_all = time.perf_counter()

    log(f"F16 reference streams ({len(cats) * args.per_category} prompts x {args.stream_tokens} tokens) ...")
    f16 = Model(fam.path(PARENT_ROLE))
    prompts = [(cat, f16.chat_prompt([{"role": "user", "content": text}]))
               for cat, text in load_prompts(Path(args.dataset), cats, args.per_category)]
    n_ctx = max(len(p) for _, p in prompts) + args.stream_tokens + 8  # one context per model serves every stream
    n_batch = max(512, args.stream_tokens + 1)  # a stream is scored in one batch
    ctx = Context(f16, n_ctx=n_ctx, n_batch=n_batch)
    streams = []
    for cat, p in prompts:
        s = greedy_answer(ctx, p, args.stream_tokens)
        streams.append((cat, p, s))
        log(f"  {cat}: prompt {len(p)} tokens, stream {len(s)}")
    ctx.close()
    held = f16.tokenize(HELD.read_text(encoding="utf-8"), add_bos=f16.add_bos())[:args.ppl_tokens]
    step_prompt = streams[0][1][:64]
    f16.close()

    variants = []
    for role in [PARENT_ROLE] + roles:
        t0 = time.perf_counter()
        v = fam.variant(role)
        m = Model(fam.path(role))
        try:
            hits = total = drafted = accepted = calls = 0
            by_cat: dict[str, list[int]] = {c: [0, 0] for c in cats}
            ctx = Context(m, n_ctx=n_ctx, n_batch=n_batch)
            try:
                for cat, p, s in streams:
                    hs = draft_hits(ctx, p, s) if s else []
                    h = sum(hs)
                    hits, total = hits + h, total + len(s)
                    by_cat[cat][0] += h
                    by_cat[cat][1] += len(s)
                    d, a, c = spec_outcome(hs, args.gamma)
                    drafted, accepted, calls = drafted + d, accepted + a, calls + c
            finally:
                ctx.close()
            rec = {
                "role": role, "type": v.get("type"), "size_bytes": fam.size(role),
                "bits_per_weight": v.get("bits_per_weight"), "tensor_bits_per_weight": v.get("tensor_bits_per_weight"),
                "step_ms": round(step_ms(m, step_prompt, args.steps), 3),
                "agreement": round(hits / max(1, total), 4),
                "agreement_by_category": {c: round(h / max(1, n), 4) for c, (h, n) in by_cat.items()},
                "acceptance": round(accepted / max(1, drafted), 4),
                "tokens_per_parent_call": round(total / max(1, calls), 3),
                "ppl": round(perplexity(m, held), 4),
                "grade": v.get("grade"), "recipe": v.get("recipe"),
            }
        finally:
            m.close()
        variants.append(rec)
        log(f"  {role:6} {rec['size_bytes'] / 2**20:7.0f} MiB  step {rec['step_ms']:6.1f} ms  agreement "
            f"{rec['agreement']:.1%}  acceptance {rec['acceptance']:.1%}  ppl {rec['ppl']:.3f}  "
            f"({time.perf_counter() - t0:.0f}s)")

    f16_step = variants[0]["step_ms"]
    for r in variants:
        r["step_vs_f16"] = round(r["step_ms"] / f16_step, 3) if f16_step else None
    report = {
        "family": fam.name, "provenance": fam.provenance, "categories": cats,
        "config": {"streams": len(streams), "stream_tokens": args.stream_tokens, "gamma": args.gamma,
                   "steps": args.steps, "ppl_tokens": len(held), "dataset": args.dataset,
                   "threads": args.threads or None, "cpus": os.cpu_count(), "machine": platform.machine()},
        "imatrix": fam.manifest.get("imatrix"),
        "variants": variants, "wall_s": round(time.perf_counter() - t_all, 1),
    }
    md = markdown(report)
    sys.stdout.write(md)
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if args.markdown:
        Path(args.markdown).write_text(md, encoding="utf-8")
    if args.plot:
        plot(report, Path(args.plot))
    from specquant_cli.routing.policies import POLICIES

    spec = [f"spec-{r}" for r in roles if f"spec-{r}" in POLICIES]
    unregistered = [r for r in roles if f"spec-{r}" not in POLICIES]
    if unregistered:
        log(f"(no spec-<role> policy is registered for {', '.join(unregistered)}: left out of the bench command)")
    pol = ",".join(["parent"] + spec)
    log("\nEnd to end, same prompts for every policy, interleaved (6 Spec-Bench categories x 3 prompts):\n"
        f"  specquant bench --family {fam.root} --dataset {args.dataset} \\\n"
        f"    --categories {','.join(cats)} --limit 3 --max-tokens 128 \\\n"
        f"    --policies {pol} --json-file drafts-bench.json --markdown drafts-bench.md --plot drafts-bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
