"""Bench records -> per-policy and per-category summaries; rich table, markdown, JSON, plot."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, Optional

from specquant_cli.bench import fidelity
from specquant_cli.bench.fidelity import IDENTICAL, NEAR_TIE, UNEXPLAINED
from specquant_cli.errors import InputError, SpecquantError
from specquant_cli.fsutil import atomic_open, check_output_file, same_file, write_json_atomic, write_text_atomic

REFERENCE = "parent-f16"  # the F16 rendering alone, beside a parent of another rendering: the speed users know


def _mean(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def summarize(records: Sequence, policies: Sequence[str]) -> list[dict]:
    """One object per policy. speedup = mean tok/s of the policy / mean tok/s of parent, same prompts."""
    by = defaultdict(list)
    for r in records:
        by[r.policy].append(r)
    base = _mean(r.tokens_per_s for r in by.get("parent", []))
    base_sd = _repeat_sd(by.get("parent", []))
    base_dec = _mean(r.decode_tokens_per_s for r in by.get("parent", []))
    q4 = _mean(r.tokens_per_s for r in by.get("q4", []))  # the lossy alternative a user would otherwise run
    q4_dec = _mean(r.decode_tokens_per_s for r in by.get("q4", []))
    f16 = _mean(r.tokens_per_s for r in by.get(REFERENCE, []))  # the F16 parent beside a BF16 one
    out = []
    for p in policies:
        rs = by.get(p, [])
        if not rs:
            continue
        tps = _mean(r.tokens_per_s for r in rs)
        dec = _mean(r.decode_tokens_per_s for r in rs)
        sd = _repeat_sd(rs)
        imports = [r.kv_import for r in rs if r.kv_import is not None]
        drafted, accepted = sum(r.drafted for r in rs), sum(r.accepted for r in rs)
        new, calls = sum(r.new_tokens for r in rs), sum(r.parent_calls for r in rs)
        busy = sum(r.prefill_s + r.draft_s + r.verify_s for r in rs) or 1.0
        ident = [r.identical for r in rs if r.identical is not None]
        correct = [r.correct for r in rs if r.correct is not None]
        structured = [r for r in rs if getattr(r, "structured", False)]
        valid = [r.valid for r in structured if r.valid is not None]
        predicted = [r for r in rs if getattr(r, "predicted", False)]
        out.append({
            "policy": p, "prompts": len(rs), "lossy": any(r.lossy for r in rs),
            "tokens_per_s": round(tps, 3), "speedup": round(tps / base, 4) if base else None,
            # with --repeats: the spread of the policy's mean tok/s over the repeats, and of its speedup (the two
            # spreads combined, as hyperfine does); None with one run
            "tokens_per_s_sd": None if sd is None else round(sd, 3),
            "speedup_sd": round(_ratio_sd(tps, sd, base, base_sd), 4) if base and sd is not None and base_sd
            is not None else None,
            "decode_tokens_per_s": round(dec, 3), "decode_speedup": round(dec / base_dec, 4) if base_dec else None,
            "q4_share": round(tps / q4, 4) if q4 else None,
            "f16_speedup": round(tps / f16, 4) if f16 else None,
            "q4_decode_share": round(dec / q4_dec, 4) if q4_dec else None,
            "kv_import_rate": round(sum(imports) / len(imports), 4) if imports else None,
            "identical_rate": round(sum(ident) / len(ident), 4) if ident else None,
            "fidelity": fidelity_counts(rs),
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "mean_accepted_length": round(new / calls, 3) if calls else None,
            "tiers": {t: round(sum(r.tier == t for r in rs) / len(rs), 3) for t in ("low", "medium", "high")},
            "accuracy": round(sum(correct) / len(correct), 4) if correct else None,
            "accuracy_n": len(correct),
            "peak_rss_mb": max(r.peak_rss_mb or r.rss_mb for r in rs),
            "parent_prefill_share": round(sum(r.parent_prefill_s for r in rs)
                                          / max(1e-9, sum(r.total_s for r in rs)), 3),
            "time_split": {"prefill": round(sum(r.prefill_s for r in rs) / busy, 3),
                           "draft": round(sum(r.draft_s for r in rs) / busy, 3),
                           "verify": round(sum(r.verify_s for r in rs) / busy, 3)},
            "new_tokens": new,
            # what drafting cost per generated token: the draft models' calls and their own catch-up on the prompt
            # (a sibling's prefill, a KV import), in ms
            "draft_ms_per_token": round(1000 * sum(r.draft_s + r.draft_prefill_s + r.kv_import_s for r in rs) / new, 2)
            if new and drafted else None,
            "levels": _levels(rs, drafted, accepted),
            "guard_stops": sum(r.guard_stop is not None for r in rs),
            # structured output: of the answers that finished (not cut by --max-tokens), those valid for their
            # schema or tools; the share of the tokens that the grammar forced (proposed free, the parent's picks)
            "valid_rate": round(sum(valid) / len(valid), 4) if valid else None,
            "finished": len(valid), "structured": len(structured),
            "forced_share": round(sum(r.forced_accepted for r in structured) / new, 4) if new and structured
            else None,
            # Predicted Outputs: the items sent with a prediction, its tokens the parent kept and those it did not
            "predicted": len(predicted),
            "prediction_accepted": sum(r.prediction_accepted for r in predicted) if predicted else None,
            "prediction_rejected": sum(r.prediction_rejected for r in predicted) if predicted else None,
            **_limit(rs),
        })
    return out


def _limit(rs: Sequence) -> dict:
    """The verify limit (bench.limit) over a policy's records: its speed (the mean of the items' tokens per second,
    as `tokens_per_s`) and the policy's share of it (the limit's time over the policy's, summed over the items, each
    policy's time as its tok/s counts it); None where an item has no limit (no calibration, an empty answer)."""
    if not rs or any(r.limit_s is None or not r.tokens_per_s for r in rs):
        return {"verify_limit_tokens_per_s": None, "verify_limit_share": None}
    return {"verify_limit_tokens_per_s": round(statistics.mean(r.new_tokens / r.limit_s for r in rs), 3),
            "verify_limit_share": round(sum(r.limit_s for r in rs) / sum(r.new_tokens / r.tokens_per_s for r in rs),
                                        3)}


def _repeat_sd(rs: Sequence) -> Optional[float]:
    """The standard deviation, over the repeats, of the mean tok/s of `rs` (one policy's records) in each repeat;
    None with fewer than two repeats."""
    runs = [r.repeat_tokens_per_s for r in rs]
    n = min((len(x) for x in runs), default=0)
    if n < 2:
        return None
    return statistics.stdev(statistics.mean(x[k] for x in runs) for k in range(n))


def _ratio_sd(a: float, sd_a: float, b: float, sd_b: float) -> float:
    """The standard deviation of a / b from those of a and b (first-order error propagation)."""
    return (a / b) * ((sd_a / a) ** 2 + (sd_b / b) ** 2) ** 0.5 if a and b else 0.0


def _levels(rs: Sequence, drafted: int, accepted: int) -> Optional[dict]:
    """Acceptance and time at each drafting level, when a second level ran: level 1 is the parent verifying the
    draft, level 2 the draft model verifying the suffix proposals for its own steps."""
    tot: dict = defaultdict(float)
    for r in rs:
        for k, v in (r.levels or {}).items():
            tot[k] += v
    if not tot.get("model_calls"):
        return None
    return {"level1_acceptance": round(accepted / drafted, 4) if drafted else None,
            "level2_acceptance": round(tot["level2_accepted"] / tot["level2_proposed"], 4)
            if tot["level2_proposed"] else None,
            "level2_proposed": int(tot["level2_proposed"]), "level2_accepted": int(tot["level2_accepted"]),
            "draft_model_calls": int(tot["model_calls"]),
            "draft_tokens_per_model_call": round(drafted / tot["model_calls"], 3) if drafted else None,
            "verify_s": round(sum(r.verify_s for r in rs), 3), "draft_model_s": round(tot["model_s"], 3),
            "level2_lookup_s": round(tot["lookup_s"], 3),
            # a chain's lowest level is a sibling model: its calls and seconds (within level2_lookup_s)
            "level2_model_calls": int(tot["level2_model_calls"]) if "level2_model_calls" in tot else None,
            "level2_model_s": round(tot["level2_model_s"], 3) if "level2_model_calls" in tot else None}


def fidelity_counts(records: Sequence) -> Optional[dict]:
    """How many of a policy's judged answers are identical to the parent's, near-ties, unexplained (None: none
    judged: sampled, lossy, or no parent run)."""
    verdicts = [r.fidelity for r in records if r.fidelity is not None]
    if not verdicts:
        return None
    from specquant_cli.settings import deterministic

    return {"identical": verdicts.count(IDENTICAL), "near_tie": verdicts.count(NEAR_TIE),
            "unexplained": verdicts.count(UNEXPLAINED), **({"exact": True} if deterministic() else {})}


def by_category(records: Sequence, policies: Sequence[str]) -> dict[str, list[dict]]:
    cats = defaultdict(list)
    for r in records:
        cats[r.category].append(r)
    return {c: summarize(rs, policies) for c, rs in sorted(cats.items())}


def _fmt(v, pct=False, x=False) -> str:
    if v is None:
        return "–"
    if pct:
        return f"{v:.1%}"
    if x:
        return f"{v:.2f}x"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _q4_cell(key: str) -> Callable[[dict], str]:
    """A lossless policy's speed as a share of `q4` alone's (the lossy alternative): end to end (`q4_share`) or in
    the decode phase (`q4_decode_share`)."""
    return lambda s: "–" if s["lossy"] or s.get(key) is None else f"{s[key]:.0%}"


def _valid_cell(s: dict) -> str:
    """Valid answers of those that finished, and how many were cut by --max-tokens."""
    if not s.get("structured"):
        return "–"
    cut = s["structured"] - s["finished"]
    return f"{_fmt(s['valid_rate'], pct=True)}" + (f" ({cut} cut)" if cut else "")


def _accuracy_cell(s: dict) -> str:
    """Right answers of the items with a reference."""
    return f"{round(s['accuracy'] * s['accuracy_n'])}/{s['accuracy_n']}" if s.get("accuracy_n") else "–"


def _prediction_cell(s: dict) -> str:
    """The predictions' tokens the parent kept / those it verified and did not keep (accepted / rejected)."""
    return f"{s['prediction_accepted']}/{s['prediction_rejected']}" if s.get("predicted") else "–"


def _peak_cell(s: dict) -> str:
    return f"{s['peak_rss_mb'] / 1024:.1f}G"  # GiB, as ls -h and top write it


def _tiers_cell(s: dict) -> str:
    t = s["tiers"]
    return f"{t['low']:.0%}/{t['medium']:.0%}/{t['high']:.0%}"


def _split_cell(s: dict) -> str:
    sp = s["time_split"]
    return f"{sp['draft']:.0%}/{sp['verify']:.0%}/{sp['prefill']:.0%}"


class Column(NamedTuple):
    """A column of the policy table: its header, its cell for one policy's summary, and when it shows: always (no
    `holds`, not `wide`), when some row holds its data (`holds`), or with --wide only (`wide`). --wide shows all."""

    header: str
    cell: Callable[[dict], str]
    holds: Optional[Callable[[dict], bool]] = None
    wide: bool = False


def _has(key: str) -> Callable[[dict], bool]:
    return lambda s: s.get(key) is not None


COLUMNS = (
    Column("policy", lambda s: s["policy"] + (" (lossy)" if s["lossy"] else "")),
    Column("tok/s", lambda s: _fmt(s["tokens_per_s"])),
    Column("± sd", lambda s: _fmt(s.get("tokens_per_s_sd")), holds=_has("tokens_per_s_sd")),  # --repeats > 1
    Column("× parent", lambda s: _fmt(s["speedup"], x=True)),
    Column("decode", lambda s: _fmt(s.get("decode_speedup"), x=True)),  # the speedup after the parent's prefill
    Column("× F16", lambda s: _fmt(s.get("f16_speedup"), x=True), holds=_has("f16_speedup")),  # parent-f16 ran
    Column("of q4", _q4_cell("q4_share"), holds=_has("q4_share")),  # q4 ran
    Column("of q4 decode", _q4_cell("q4_decode_share"), wide=True),
    Column("identical", lambda s: _fmt(s["identical_rate"], pct=True), wide=True),
    Column(fidelity.header(False), lambda s: fidelity.cell(s.get("fidelity"))),  # against the parent's answers
    Column("valid", _valid_cell, holds=lambda s: bool(s.get("structured"))),  # structured items ran
    Column("forced", lambda s: _fmt(s.get("forced_share"), pct=True), holds=lambda s: bool(s.get("structured"))),
    Column("prediction acc/rej", _prediction_cell, holds=lambda s: bool(s.get("predicted"))),  # predictions sent
    Column("accept", lambda s: _fmt(s["acceptance_rate"], pct=True)),
    Column("tok/call", lambda s: _fmt(s["mean_accepted_length"])),  # tokens per parent call
    Column("of limit", lambda s: _fmt(s.get("verify_limit_share")), wide=True),  # of the verify limit (bench.limit)
    Column("draft ms/tok", lambda s: _fmt(s.get("draft_ms_per_token")), wide=True),
    Column("low/med/high", _tiers_cell, wide=True),
    Column("accuracy", _accuracy_cell, holds=lambda s: bool(s.get("accuracy_n"))),  # items with references
    Column("draft/verify/prefill", _split_cell, wide=True),
    Column("peak", _peak_cell),  # the policy's peak resident size
)


def columns(summary: Sequence[dict], wide: bool = False) -> list[Column]:
    """The columns a table of `summary` shows: the default ones and each conditional one some row holds data for;
    every column when `wide`. Verdicts judged in the deterministic mode are headed as such (bench.fidelity.shown)."""
    exact = any((s.get("fidelity") or {}).get("exact") for s in summary)
    return [c._replace(header=fidelity.header(True)) if exact and c.header == fidelity.header(False) else c
            for c in COLUMNS if wide or (not c.wide and (c.holds is None or any(c.holds(s) for s in summary)))]


def rows(summary: Sequence[dict], cols: Optional[Sequence[Column]] = None) -> list[list[str]]:
    """A row of cells per policy, under `cols` (default: `columns(summary)`)."""
    cols = columns(summary) if cols is None else cols
    return [[c.cell(s) for c in cols] for s in summary]


def rich_table(summary: list[dict], title: str, wide: bool = False):
    """The policy table for the terminal: compact (no vertical rules, one space between columns), every cell on one
    line; the default columns fit 100 columns for a typical run."""
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, padding=0, show_edge=False)
    cols = columns(summary, wide)
    for c in cols:
        t.add_column(c.header, justify="left" if c.header == "policy" else "right", no_wrap=True)
    for r in rows(summary, cols):
        t.add_row(*r)
    return t


def whole(console, table):
    """`table` rendered at the width it takes with every cell whole, wider than `console` when it must be (a --wide
    table is never cut; a console that soft-wraps prints the lines as they are)."""
    from rich.segment import Segments

    width = console.measure(table, options=console.options.update_width(1 << 14)).maximum
    return Segments(console.render(table, console.options.update_width(width)))


def verdict(summary: Sequence[dict]) -> Optional[str]:
    """One line under the table, as hyperfine ends: the fastest lossless policy against the parent (± the spread
    with --repeats, the decode phase, its answers against the parent's), and any lossy policy faster than it, said
    to be lossy. None when nothing but the parent ran."""
    by = {s["policy"]: s for s in summary}
    if "parent" not in by:
        return None
    others = [s for s in summary if s["policy"] not in ("parent", REFERENCE) and s.get("speedup") is not None]
    lossless = [s for s in others if not s["lossy"]]
    if not others:
        return None
    if not lossless:
        best = max(others, key=lambda s: s["speedup"])
        return f"{best['policy']} ran {_times(best)} as fast as parent, but is lossy (its answers are not the parent's)"
    best = max(lossless, key=lambda s: s["speedup"])
    line = f"{best['policy']} ran {_times(best)} as fast as parent"
    if best.get("decode_speedup") is not None:
        line += f" (decode {best['decode_speedup']:.2f}x)"
    f = best.get("fidelity")
    if f:
        judged = f["identical"] + f["near_tie"] + f["unexplained"]
        line += f", {f['identical']}/{judged} answers identical"
        line += "".join(f", {n} {name}" for name, n in fidelity.shown(f)[1:] if n)
    else:
        line += ", answers not judged against the parent's"
    faster = [s for s in others if s["lossy"] and s["speedup"] > best["speedup"]]
    line += "".join(f"; {s['policy']} ran {_times(s)} but is lossy" for s in faster)
    return line


def _times(s: dict) -> str:
    if s.get("speedup_sd") is not None:
        return f"{s['speedup']:.2f} ± {s['speedup_sd']:.2f}x"
    return f"{s['speedup']:.2f}x"


def _md_table(summary: Sequence[dict], wide: bool = False) -> list[str]:
    cols = columns(summary, wide)
    return (["| " + " | ".join(c.header for c in cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(r) + " |" for r in rows(summary, cols)])


def markdown(report: dict) -> str:
    from specquant_cli.bench.stamp import markdown_lines

    lines = [f"# specquant bench: {report['family']['name']}", "",
             f"- command: `{report['command']}`", *markdown_lines(report.get("stamp")),
             f"- {report['config']['items']} prompts × {len(report['config']['policies'])} policies, "
             f"{report['config']['max_tokens']} new tokens, temperature {report['config']['temperature']}, "
             f"repeats {report['config']['repeats']}",
             f"- machine: {report['machine']['cores_physical']} cores, "
             f"{report['machine']['ram_total'] / 2**30:.1f} GiB RAM, GPUs: "
             f"{', '.join(g['name'] for g in report['machine']['gpus']) or 'none'}",
             f"- provenance: {report['family']['provenance']}",
             f"- caveat: {report['family']['caveat']}",
             f"- fidelity: {noise_line(report.get('fidelity'))}", "", "## All prompts", ""]
    lines += _md_table(report["summary"])
    if report.get("verdict"):
        lines += ["", report["verdict"]]
    lines += limit_lines(report["summary"])
    lines += levels_lines(report["summary"])
    lines += divergence_table(report.get("fidelity"))
    for cat, summ in report["by_category"].items():
        lines += ["", f"## {cat}", ""] + _md_table(summ)
    lines += ["", "## All prompts, every column", ""] + _md_table(report["summary"], wide=True)
    return "\n".join(lines) + "\n"


def limit_lines(summary: Sequence[dict]) -> list[str]:
    """The verify limit (bench.limit) with the parent's own prefill, against the parent, and each lossless drafting
    policy's share of it; nothing when no calibration priced it."""
    by = {s["policy"]: s for s in summary}
    parent = by.get("parent")
    if parent is None or parent.get("verify_limit_tokens_per_s") is None:
        return []
    shares = ", ".join(f"{s['policy']} {s['verify_limit_share']:.2f}" for s in summary if not s["lossy"]
                       and s["policy"] not in ("parent", REFERENCE) and s.get("verify_limit_share") is not None)
    return ["", f"Verify limit (a drafter always right, at no cost: each answer's prefill, then the parent's calls "
                f"priced at their depth): {parent['verify_limit_tokens_per_s']:.2f} tok/s, "
                f"{parent['verify_limit_tokens_per_s'] / parent['tokens_per_s']:.2f}x the parent"
                + (f"; share of it reached: {shares}" if shares else "")]


def levels_lines(summary: list[dict]) -> list[str]:
    """For each policy that drafted with a second level: the acceptance and the time at each level."""
    out = []
    for s in summary:
        lv = s.get("levels")
        if not lv:
            continue
        l2 = "–" if lv["level2_acceptance"] is None else f"{lv['level2_acceptance']:.1%}"
        sibling = lv.get("level2_model_calls") is not None
        lower = (f"the draft verifies its sibling's proposals ({lv['level2_model_calls']} sibling calls, "
                 f"{lv['level2_model_s']:.1f} s)") if sibling else "the draft verifies suffix proposals"
        out.append(f"- `{s['policy']}` drafting levels: level 1 (the parent verifies the draft) acceptance "
                   f"{_fmt(lv['level1_acceptance'], pct=True)}, verify {lv['verify_s']:.1f} s; level 2 ({lower}) "
                   f"acceptance {l2} ({lv['level2_accepted']}/{lv['level2_proposed']}), "
                   f"{lv['draft_model_calls']} draft calls for {_fmt(lv['draft_tokens_per_model_call'])} drafted "
                   f"tokens each, draft model {lv['draft_model_s']:.1f} s, proposals {lv['level2_lookup_s']:.2f} s")
    return [""] + out if out else []


def noise_line(fid: Optional[dict]) -> str:
    """The measured batch-vs-single noise and the near-tie bound it gives (bench.fidelity)."""
    if fid is None:
        return "not judged (sampled run, or no parent run)"
    n = fid["noise"]
    return (f"the parent's batched vs one-at-a-time top-2 margin differs by at most {n['max_margin_diff']:.3g} "
            f"(p99 {n['p99_margin_diff']:.3g}; any logit: {n['max_logit_diff']:.3g}) over {n['rows']} rows; "
            f"near-tie bound {n['bound']:.3g} ({n['safety_factor']:g}× the max)")


DIVERGENCE_COLUMNS = ("item", "policy", "position", "parent token", "policy token", "parent's top 2", "margin",
                      "single-step pick", "verdict")


def divergence_table(fid: Optional[dict]) -> list[str]:
    """One row per answer that differs from the parent's, with the evidence for its verdict."""
    if not fid or not fid["divergences"]:
        return []
    lines = ["", "## Divergences from the parent", "", "| " + " | ".join(DIVERGENCE_COLUMNS) + " |",
             "|" + "---|" * len(DIVERGENCE_COLUMNS)]
    for d in fid["divergences"]:
        cells = [d["item"], d["policy"], d["position"], d["parent_token"], d["policy_token"],
                 f"{d['top1']}, {d['top2']}", f"{d['margin']:.4g}", d["single_step_pick"], d["verdict"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError("--plot needs matplotlib, which is not installed; install it with: "
                         "pip install 'specquant[plot]'") from None


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in summary:
        if s["speedup"] is None:
            continue
        y = s["identical_rate"] if s["identical_rate"] is not None else 0.0
        ax.scatter(s["speedup"], y, s=60, color="tab:red" if s["lossy"] else "tab:blue")
        ax.annotate(s["policy"], (s["speedup"], y), textcoords="offset points", xytext=(5, 5), fontsize=9)
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("speedup over parent (F16 alone)")
    ax.set_ylabel("identical-output rate (greedy)")
    ax.set_ylim(-0.05, 1.1)
    ax.set_title("specquant policies: speed vs fidelity (red = lossy)")
    fig.tight_layout()
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    """A matplotlib figure as a PNG at `path`, written atomically (no partial file), and closed."""
    import matplotlib.pyplot as plt

    try:
        with atomic_open(Path(path), "wb") as f:
            fig.savefig(f, format="png", dpi=120)
    finally:
        plt.close(fig)


def check_outputs(outputs: dict[str, Optional[Path]], inputs: Sequence[Path] = ()) -> None:
    """Before a long run: every output file can be written, none is an input, no two are the same file."""
    given = {opt: Path(p) for opt, p in outputs.items() if p is not None}
    for opt, p in given.items():
        for i in inputs:
            if same_file(p, i):
                raise InputError(f"{opt} {p} is an input ({i}); refusing to overwrite it")
        check_output_file(p, opt)
    seen: dict[Path, str] = {}
    for opt, p in given.items():
        key = p.resolve()
        if key in seen:
            raise InputError(f"{opt} and {seen[key]} name the same file {p}")
        seen[key] = opt


def write_outputs(report: dict, json_out: Optional[Path], md_out: Optional[Path], plot_out: Optional[Path] = None,
                  render=None, draw=None) -> Optional[SpecquantError]:
    """Write every requested output that can be written; the error naming those that failed, else None. `render`
    (report -> markdown) and `draw` (report, path -> a PNG) are the subcommand's; a prompt-set report's by default."""
    render = render or markdown
    draw = draw or (lambda rep, p: plot(rep["summary"], p))
    jobs = [("--json-file", json_out, lambda p: write_json_atomic(p, report)),
            ("--markdown", md_out, lambda p: write_text_atomic(p, render(report))),
            ("--plot", plot_out, lambda p: draw(report, p))]
    failed, written = [], []
    for opt, path, write in jobs:
        if path is None:
            continue
        try:
            write(Path(path))
            written.append(f"{opt} {path}")
        except (OSError, SpecquantError) as e:
            failed.append(f"{opt} {path} ({getattr(e, 'strerror', None) or e})")
    if not failed:
        return None
    return SpecquantError(f"could not write {'; '.join(failed)}"
                          + (f"; written: {', '.join(written)}" if written else ""))
