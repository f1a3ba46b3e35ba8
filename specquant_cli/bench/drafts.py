"""Draft variants side by side (`specquant bench drafts`): size, draft step, agreement with the parent and
perplexity, one model loaded at a time.

- stream: the parent's own greedy continuation (`stream_tokens`) of one chat prompt per category (the first
  `per_category` of each, read as `bench prompts` reads a prompt set), decoded token by token as the `parent`
  policy does (system.calibration.greedy_answer);
- agreement: each variant reads prompt + stream in one batch (teacher forcing, system.calibration.draft_hits, as
  `specquant calibrate` measures it): the share of stream positions where its argmax is the parent's token. A
  greedy draft's proposals are exactly these argmaxes for as long as it has matched, so the same pass gives the
  exact greedy speculative outcome at a fixed draft length γ: acceptance and new tokens per parent call;
- step: ms of one single-token decode after a 64-token prefill (median of `steps`);
- ppl: perplexity on held text (bench/heldout_text.txt, not part of the calibration set), windows of 512.

With `make`, the recipes the family lacks are quantized first (their activation statistics collected when a
recipe needs them), as `specquant calibrate-activations` and `specquant quantize --types` would."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Optional

import numpy as np

from specquant_cli.bench.stamp import markdown_lines

WINDOW = 512
CATEGORIES = "coding,math_reasoning,qa,translation,summarization,rag"


def held_text() -> str:
    return resources.files("specquant_cli.bench").joinpath("heldout_text.txt").read_text(encoding="utf-8")


def spec_outcome(hits: list[bool], gamma: int) -> tuple[int, int, int]:
    """(drafted, accepted, parent calls) of greedy speculative decoding with fixed `gamma` along a stream whose
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


def step_ms(model, prompt: list[int], steps: int, threads: int) -> float:
    from specquant_cli.backend.llama import Context

    ctx = Context(model, n_ctx=len(prompt) + steps + 8, n_batch=max(64, len(prompt)), n_threads=threads)
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


def perplexity(model, tokens: list[int], threads: int) -> float:
    from specquant_cli.backend.llama import Context

    nll, n = 0.0, 0
    for s in range(0, len(tokens) - 1, WINDOW):
        win = tokens[s:s + WINDOW]
        if len(win) < 2:
            break
        ctx = Context(model, n_ctx=len(win) + 8, n_batch=len(win), n_threads=threads)
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


def make_missing(family, roles: Sequence[str], threads: int, say: Callable[[str], None]):
    """Quantize the recipes among `roles` the family lacks (collecting activation statistics first when one needs
    them); the family as it is after."""
    from specquant_cli.family import activations
    from specquant_cli.family import imatrix as im
    from specquant_cli.family.manifest import Family
    from specquant_cli.family.recipes import add_variants
    from specquant_cli.family.variants import RECIPES

    want = [RECIPES[r] for r in roles if r in RECIPES and r not in family.roles()]
    if not want:
        return family
    if any(r.imatrix or r.grade for r in want) and not (family.root / im.IMATRIX_FILE).is_file():
        say(f"collecting activation statistics of {family.name} (built-in calibration set)")
        activations.calibrate_family(family, threads=threads or None,
                                     progress=lambda d, t: say(f"statistics: {d}/{t} tokens"))
        family = Family.load(family.root)
    add_variants(family.root, want, threads=threads, say=say)
    return Family.load(family.root).bind(family.parent_rendering, family.parent_why)


def run(family, roles: Sequence[str], items, stream_tokens: int, gamma: int, steps: int, ppl_tokens: int,
        threads: int, say: Callable[[str], None]) -> dict:
    """The parent's streams, then each of `roles` (the parent first, as the reference) measured in turn."""
    from specquant_cli.backend.llama import Context, Model
    from specquant_cli.family.roles import PARENT_ROLE
    from specquant_cli.system.measure import greedy_answer

    cats = list(dict.fromkeys(i.category for i in items))
    say(f"the parent's streams ({len(items)} prompts x {stream_tokens} tokens)")
    parent = Model(family.path(PARENT_ROLE))
    try:
        prompts = [(i.category, parent.chat_prompt([{"role": "user", "content": i.prompt}])) for i in items]
        n_ctx = max(len(p) for _, p in prompts) + stream_tokens + 8  # one context per model serves every stream
        n_batch = max(512, stream_tokens + 1)  # a stream is scored in one batch
        ctx = Context(parent, n_ctx=n_ctx, n_batch=n_batch, n_threads=threads)
        try:
            streams = [(cat, p, greedy_answer(ctx, p, stream_tokens)) for cat, p in prompts]
        finally:
            ctx.close()
        held = parent.tokenize(held_text(), add_bos=parent.add_bos())[:ppl_tokens]
    finally:
        parent.close()
    step_prompt = streams[0][1][:64]
    variants = [measure_role(family, role, streams, cats, n_ctx, n_batch, gamma, steps, held, step_prompt, threads,
                             say) for role in [PARENT_ROLE, *roles]]
    first = variants[0]["step_ms"]
    for r in variants:
        r["step_vs_parent"] = round(r["step_ms"] / first, 3) if first else None
    return {"categories": cats, "streams": len(streams), "ppl_tokens": len(held), "variants": variants}


def measure_role(family, role: str, streams, cats, n_ctx: int, n_batch: int, gamma: int, steps: int, held,
                 step_prompt, threads: int, say: Callable[[str], None]) -> dict:
    from specquant_cli.backend.llama import Context, Model
    from specquant_cli.system.measure import draft_hits

    say(f"{role}")
    v = family.variant(role)
    m = Model(family.path(role))
    try:
        hits = total = drafted = accepted = calls = 0
        by_cat: dict[str, list[int]] = {c: [0, 0] for c in cats}
        ctx = Context(m, n_ctx=n_ctx, n_batch=n_batch, n_threads=threads)
        try:
            for cat, p, s in streams:
                hs = draft_hits(ctx, p, s) if s else []
                hits, total = hits + sum(hs), total + len(s)
                by_cat[cat][0] += sum(hs)
                by_cat[cat][1] += len(s)
                d, a, c = spec_outcome(hs, gamma)
                drafted, accepted, calls = drafted + d, accepted + a, calls + c
        finally:
            ctx.close()
        return {"role": role, "type": v.get("type"), "size_bytes": family.size(role),
                "bits_per_weight": v.get("bits_per_weight"), "tensor_bits_per_weight": v.get("tensor_bits_per_weight"),
                "step_ms": round(step_ms(m, step_prompt, steps, threads), 3),
                "agreement": round(hits / max(1, total), 4),
                "agreement_by_category": {c: round(h / max(1, n), 4) for c, (h, n) in by_cat.items()},
                "acceptance": round(accepted / max(1, drafted), 4),
                "tokens_per_parent_call": round(total / max(1, calls), 3),
                "ppl": round(perplexity(m, held, threads), 4), "grade": v.get("grade"), "recipe": v.get("recipe")}
    finally:
        m.close()


def markdown(rep: dict) -> str:
    c = rep["config"]
    lines = [f"# Draft variants of {rep['family']} (parent {rep['parent']}; {rep['streams']} streams x "
             f"{c['stream_tokens']} tokens, γ {c['gamma']})", "", f"- command: `{rep['command']}`",
             *markdown_lines(rep.get("stamp")), "",
             f"| role | type | size | bpw | step ms | agreement | accept (γ={c['gamma']}) | tok/call | ppl |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rep["variants"]:
        bpw = "–" if r["bits_per_weight"] is None else f"{r['bits_per_weight']:.2f}"
        lines.append(f"| {r['role']} | {r['type']} | {r['size_bytes'] / 2**20:.0f} MiB | {bpw} | {r['step_ms']:.1f} | "
                     f"{r['agreement']:.1%} | {r['acceptance']:.1%} | {r['tokens_per_parent_call']:.2f} | "
                     f"{r['ppl']:.3f} |")
    lines += ["", "Agreement per category:", "", "| role | " + " | ".join(rep["categories"]) + " |",
              "|---|" + "---|" * len(rep["categories"])]
    for r in rep["variants"]:
        lines.append(f"| {r['role']} | " + " | ".join(f"{r['agreement_by_category'][c]:.1%}" for c in rep["categories"])
                     + " |")
    return "\n".join(lines) + "\n"


def plot(rep: dict, path) -> None:
    """Bits per weight against agreement, a point per draft (labelled with its step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specquant_cli.bench.report import save_figure
    from specquant_cli.family.roles import PARENT_ROLE

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rep["variants"]:
        if r["role"] == PARENT_ROLE or r["bits_per_weight"] is None:
            continue
        ax.scatter(r["bits_per_weight"], r["agreement"], s=60, color="tab:blue")
        ax.annotate(f"{r['role']} ({r['step_ms']:.1f} ms)", (r["bits_per_weight"], r["agreement"]),
                    textcoords="offset points", xytext=(5, 5), fontsize=9)
    ax.set_xlabel("bits per weight (file)")
    ax.set_ylabel("teacher-forced greedy agreement with the parent")
    ax.set_title(f"{rep['family']} drafts: size vs agreement (label: draft step)")
    fig.tight_layout()
    save_figure(fig, path)


def bench_command(rep: dict, dataset: Optional[str]) -> str:
    """The `bench prompts` command that compares the drafts' spec-<role> policies end to end."""
    from specquant_cli.routing.policies import POLICIES

    spec = [f"spec-{r['role']}" for r in rep["variants"][1:] if f"spec-{r['role']}" in POLICIES]
    return (f"specquant bench prompts --family {rep['root']}" + (f" --dataset {dataset}" if dataset else "")
            + f" --categories {','.join(rep['categories'])} --limit 3 --max-tokens 128 --policies "
            + ",".join(["parent", *spec]))
