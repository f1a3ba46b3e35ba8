"""`specquant bench prompts`: policies interleaved per prompt on one runtime (bench.runner), reported per policy and
category (bench.report), every greedy answer judged against the parent's own (bench.fidelity)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Optional

import typer

from specquant_cli.commands.options import (
    BENCH_MAX_TOKENS,
    CategoriesOpt,
    DatasetOpt,
    JsonFileOpt,
    JsonOpt,
    MarkdownOpt,
    PlotOpt,
    command_line,
    split_list,
    with_settings,
)
from specquant_cli.console import err, out_json, stderr_reporter
from specquant_cli.routing.policies import bench_policies
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("prompts", short_help="Policies side by side on prompt sets",
                help="Policies side by side on the same prompts (the built-in set, Spec-Bench or GSM8K files): "
                     "speed end to end and in decode, fidelity to the parent, acceptance. "
                     "docs/benchmarking.md")(prompts)


@with_settings("decoding.temperature", "decoding.seed", "decoding.gamma", "runtime.family",
               "runtime.parent", "runtime.ctx",
               "runtime.threads", "runtime.mmap", "runtime.rpc", "runtime.rpc_timeout",
               "decoding.draft_memory", "runtime.deterministic")
def prompts(
    dataset: list[Path] = DatasetOpt,
    structured: bool = typer.Option(False, "--structured", help="Add the built-in JSON and tool-call set"),
    edits: bool = typer.Option(False, "--edits", help="Add the built-in code-edit set (each with a prediction)"),
    prediction: str = typer.Option("on", "--prediction", metavar="MODE",
                                   help="Predictions: on, off, wrong (another item's)"),
    categories: Optional[str] = CategoriesOpt,
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="At most N prompts per category"),
    policies: str = typer.Option(",".join(bench_policies()), "--policies", help="Comma-separated policies",
                                 metavar="NAMES", show_default="all"),
    max_tokens: int = typer.Option(BENCH_MAX_TOKENS, "--max-tokens", min=1, help="New tokens per answer"),
    repeats: int = typer.Option(1, "--repeats", min=1, help="Timed runs per prompt and policy"),
    warmup: int = typer.Option(1, "--warmup", min=0, help="Untimed runs per model first"),
    json_out: bool = JsonOpt,
    json_file: Optional[Path] = JsonFileOpt,
    md_out: Optional[Path] = MarkdownOpt,
    plot_out: Optional[Path] = PlotOpt,
    wide: bool = typer.Option(False, "--wide", help="Every column in the table"),
    *, cfg: Settings,
) -> None:
    """Greedy (--temperature 0, the default) is what identical_rate and the fidelity proof need; --seed defaults
    to 0 here, so that a sampled bench repeats."""
    from specquant_cli.bench import datasets, fidelity, report, runner, stamp
    from specquant_cli.decoding.sampling import SamplingParams
    from specquant_cli.family.fetch import INFLATION_NOTE
    from specquant_cli.routing.policies import check_policy
    from specquant_cli.session import open_session
    from specquant_cli.settings import SessionSettings
    from specquant_cli.system import memory
    from specquant_cli.system.hardware import detect

    # Everything that can be checked is checked before a model loads: a long run must not fail at its end.
    names = [check_policy(p) for p in split_list(policies, "--policies", "policy")]
    names = ["parent"] + [p for p in names if p != "parent"]  # the baseline runs first
    report.check_outputs({"--json-file": json_file, "--markdown": md_out, "--plot": plot_out},
                         inputs=[*dataset, *([cfg.config] if cfg.config else [])])
    if plot_out:
        report.check_plot_available()
    cats = split_list(categories, "--categories", "category")
    items = datasets.with_predictions(datasets.load(dataset, cats, limit, structured, edits), prediction)
    facts = detect()
    run_stamp = stamp.take(command_line(), cfg.runtime.threads)  # as the run begins
    session = open_session(SessionSettings.of(cfg, facts=facts), report=stderr_reporter(), warn_ctx=True)
    runtime, router, fam = session.runtime, session.router, session.runtime.family
    for p in names:
        check_policy(p, fam.roles(), fam.siblings())  # before a model loads
    err.print(f"parent: {fam.parent_why}", markup=False)
    # the F16 parent beside a parent of another rendering (the figure users know), run once the parent's own runs
    # are done and their models released: the bench holds one rendering of the parent at a time
    reference = "f16" in fam.renderings() and fam.parent_rendering != "f16"
    datasets.check_lengths(items, router.check_length, session.prediction_tokens)  # before a model loads
    temperature, seed, n_ctx = cfg.decoding.temperature, cfg.decoding.seed or 0, cfg.runtime.ctx
    sp = SamplingParams(temperature=temperature, seed=seed)
    t0 = time.perf_counter()
    total = len(items) * (len(names) + reference)
    try:
        with _progress(total, t0) as step:
            records = runner.run(runtime, router, items, names, max_tokens, sp, repeats, warmup, step)
            if reference:
                runtime.pool.release(runtime.pool.loaded())  # one rendering of the parent at a time
                from specquant_cli.runtime import Runtime

                ref = Runtime.open(fam.bind("f16", "the F16 reference"), n_ctx=runtime.pool.n_ctx,
                                   threads=runtime.pool.threads, facts=facts, mmap=cfg.runtime.mmap)
                try:
                    records += runner.run_reference(ref, router, items, records, max_tokens, sp, repeats, warmup,
                                                    step)
                finally:
                    ref.close()
        with err.status("fidelity: re-scoring divergences from the parent one token at a time"):
            judged = runner.judge_fidelity(runtime, router, items, records, sp)  # after the clock, the parent alone
    finally:
        runtime.close()
    if reference:
        names = [*names[:1], runner.REFERENCE, *names[1:]]
    summary = report.summarize(records, names)
    sets = [*(["structured"] if structured else []), *(["edits"] if edits else []), *map(str, dataset)] or ["builtin"]
    rep = {
        "command": run_stamp["command"],
        "stamp": run_stamp,
        "machine": facts.to_dict(),
        "family": {"name": fam.name, "root": str(fam.root), "provenance": fam.provenance, "caveat": INFLATION_NOTE,
                   "roles": fam.manifest.get("roles", {}),
                   "parent": {"rendering": fam.parent_rendering, "why": fam.parent_why}},
        "config": {"items": len(items), "policies": names, "max_tokens": max_tokens, "temperature": temperature,
                   "seed": seed, "repeats": repeats, "warmup": warmup, "gamma": cfg.decoding.gamma, "n_ctx": n_ctx,
                   "datasets": sets, "categories": cats, "limit": limit, "prediction": prediction},
        "wall_s": round(time.perf_counter() - t0, 1),
        "peak_rss_mb": round(memory.run_peak_bytes() / 2**20, 1),
        "summary": summary,
        "verdict": report.verdict(summary),
        "by_category": report.by_category(records, names),
        "fidelity": judged,
        "records": [r.to_dict() for r in records],
    }
    table = report.rich_table(summary, f"{fam.name}: {len(items)} prompts, {max_tokens} new tokens", wide)
    err.print(report.whole(err, table) if wide else table)  # --wide: never a cell cut
    if rep["verdict"]:
        err.print(rep["verdict"], markup=False, soft_wrap=True)
    for line in report.levels_lines(summary)[1:]:  # acceptance and time per drafting level
        err.print(line, markup=False, soft_wrap=True)
    err.print(f"provenance: {fam.provenance}\ncaveat: {INFLATION_NOTE}", markup=False)
    err.print(f"peak resident memory of the whole run: {rep['peak_rss_mb'] / 1024:.2f} GiB (per policy: the peak "
              "column)", markup=False)
    if warning := fidelity.warning(judged):
        err.print(warning, markup=False, soft_wrap=True)  # one line, however long
    if "q4" not in names and "q4" in fam.roles():
        err.print("note: add q4 to --policies to see each lossless policy's share of q4 alone's speed "
                  "(the lossy alternative)", markup=False)
    failure = report.write_outputs(rep, json_file, md_out, plot_out)  # each writable one is written
    if json_out:
        out_json(rep)
    if failure:
        raise failure


@contextlib.contextmanager
def _progress(total: int, t0: float):
    """A callback that counts one finished run: a redrawn bar on a terminal, one line per run in a log or a pipe."""
    if err.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err) as prog:
            task = prog.add_task("bench", total=total)
            yield lambda r: prog.update(task, advance=1, description=f"{r.item} {r.policy}")
        return
    done = [0]

    def line(r) -> None:
        done[0] += 1
        err.print(f"[{done[0]}/{total} {time.perf_counter() - t0:.0f}s] {r.item} {r.policy}: "
                  f"{r.tokens_per_s:.2f} tok/s, {r.new_tokens} tokens", markup=False)

    yield line
