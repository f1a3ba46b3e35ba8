"""Bench records -> per-policy and per-category summaries; rich table, markdown, JSON, plot."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from specquant_cli.bench.fidelity import IDENTICAL, NEAR_TIE, UNEXPLAINED
from specquant_cli.errors import InputError, SpecquantError
from specquant_cli.fsutil import atomic_open, check_output_file, same_file, write_json_atomic, write_text_atomic


def _mean(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def summarize(records: Sequence, policies: Sequence[str]) -> list[dict]:
    """One object per policy. speedup = mean tok/s of the policy / mean tok/s of parent, same prompts."""
    by = defaultdict(list)
    for r in records:
        by[r.policy].append(r)
    base = _mean(r.tokens_per_s for r in by.get("parent", []))
    base_dec = _mean(r.decode_tokens_per_s for r in by.get("parent", []))
    q4 = _mean(r.tokens_per_s for r in by.get("q4", []))  # the lossy alternative a user would otherwise run
    q4_dec = _mean(r.decode_tokens_per_s for r in by.get("q4", []))
    f16 = _mean(r.tokens_per_s for r in by.get("parent-f16", []))  # the F16 parent beside a BF16 one
    out = []
    for p in policies:
        rs = by.get(p, [])
        if not rs:
            continue
        tps = _mean(r.tokens_per_s for r in rs)
        dec = _mean(r.decode_tokens_per_s for r in rs)
        imports = [r.kv_import for r in rs if r.kv_import is not None]
        drafted, accepted = sum(r.drafted for r in rs), sum(r.accepted for r in rs)
        new, calls = sum(r.new_tokens for r in rs), sum(r.parent_calls for r in rs)
        busy = sum(r.prefill_s + r.draft_s + r.verify_s for r in rs) or 1.0
        ident = [r.identical for r in rs if r.identical is not None]
        correct = [r.correct for r in rs if r.correct is not None]
        structured = [r for r in rs if getattr(r, "structured", False)]
        valid = [r.valid for r in structured if r.valid is not None]
        out.append({
            "policy": p, "prompts": len(rs), "lossy": any(r.lossy for r in rs),
            "tokens_per_s": round(tps, 3), "speedup": round(tps / base, 4) if base else None,
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
        })
    return out


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
    return {"identical": verdicts.count(IDENTICAL), "near_tie": verdicts.count(NEAR_TIE),
            "unexplained": verdicts.count(UNEXPLAINED)}


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


COLUMNS = ("policy", "tok/s", "speedup", "decode speedup", "share of q4", "× F16 parent", "identical",
           "identical / near-tie / unexplained", "valid", "forced",
           "acceptance", "accepted/call", "draft ms/token", "low/med/high", "accuracy", "draft/verify/prefill",
           "peak RSS")


def _fidelity_cell(counts: Optional[dict]) -> str:
    if counts is None:
        return "–"
    return f"{counts['identical']}/{counts['near_tie']}/{counts['unexplained']}"


def _q4_cell(s: dict) -> str:
    """A lossless policy's speed as a share of `q4` alone's (the lossy alternative), end to end / decode phase."""
    if s["lossy"] or s.get("q4_share") is None:
        return "–"
    return f"{s['q4_share']:.0%} / {s['q4_decode_share']:.0%}" if s.get("q4_decode_share") else f"{s['q4_share']:.0%}"


def _valid_cell(s: dict) -> str:
    """Valid answers of those that finished, and how many were cut by --max-tokens."""
    if not s.get("structured"):
        return "–"
    cut = s["structured"] - s["finished"]
    return f"{_fmt(s['valid_rate'], pct=True)}" + (f" ({cut} cut)" if cut else "")


def rows(summary: list[dict]) -> list[list[str]]:
    out = []
    for s in summary:
        t, sp = s["tiers"], s["time_split"]
        out.append([s["policy"] + (" (lossy)" if s["lossy"] else ""), _fmt(s["tokens_per_s"]),
                    _fmt(s["speedup"], x=True), _fmt(s.get("decode_speedup"), x=True), _q4_cell(s),
                    _fmt(s.get("f16_speedup"), x=True),
                    _fmt(s["identical_rate"], pct=True), _fidelity_cell(s.get("fidelity")),
                    _valid_cell(s), _fmt(s.get("forced_share"), pct=True),
                    _fmt(s["acceptance_rate"], pct=True), _fmt(s["mean_accepted_length"]),
                    _fmt(s.get("draft_ms_per_token")),
                    f"{t['low']:.0%}/{t['medium']:.0%}/{t['high']:.0%}",
                    f"{_fmt(s['accuracy'], pct=True)} (n={s['accuracy_n']})" if s["accuracy_n"] else "–",
                    f"{sp['draft']:.0%}/{sp['verify']:.0%}/{sp['prefill']:.0%}", f"{s['peak_rss_mb']:.0f} MB"])
    return out


def rich_table(summary: list[dict], title: str):
    from rich.table import Table

    t = Table(title=title)
    for c in COLUMNS:
        t.add_column(c, justify="left" if c == "policy" else "right")
    for r in rows(summary):
        t.add_row(*r)
    return t


def markdown(report: dict) -> str:
    lines = [f"# specquant bench: {report['family']['name']}", "",
             f"- command: `{report['command']}`",
             f"- {report['config']['items']} prompts × {len(report['config']['policies'])} policies, "
             f"{report['config']['max_tokens']} new tokens, temperature {report['config']['temperature']}, "
             f"repeats {report['config']['repeats']}",
             f"- machine: {report['machine']['cores_physical']} cores, "
             f"{report['machine']['ram_total'] / 2**30:.1f} GiB RAM, GPUs: "
             f"{', '.join(g['name'] for g in report['machine']['gpus']) or 'none'}",
             f"- provenance: {report['family']['provenance']}",
             f"- caveat: {report['family']['caveat']}",
             f"- fidelity: {noise_line(report.get('fidelity'))}", "", "## All prompts", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(report["summary"])]
    lines += levels_lines(report["summary"])
    lines += divergence_table(report.get("fidelity"))
    for cat, summ in report["by_category"].items():
        lines += ["", f"## {cat}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(r) + " |" for r in rows(summ)]
    return "\n".join(lines) + "\n"


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
