"""`specquant bench drafts`: draft variants' size, step, agreement with the parent and perplexity (bench.drafts)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from specquant_cli.commands.options import (
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
from specquant_cli.console import err, out_json
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("drafts", short_help="Draft variants: size, step, agreement",
                help="Draft variants side by side: size, draft step, teacher-forced agreement with the parent, "
                     "perplexity on held text; --make quantizes the recipes the family lacks first.")(drafts)


@with_settings("runtime.family", "runtime.parent", "runtime.threads", "decoding.gamma", "runtime.deterministic")
def drafts(
    roles: Optional[str] = typer.Option(None, "--roles", help="Comma-separated draft roles", metavar="NAMES",
                                        show_default="every draft"),
    make: bool = typer.Option(False, "--make", help="Quantize the recipes among --roles it lacks first"),
    dataset: list[Path] = DatasetOpt,
    categories: Optional[str] = CategoriesOpt,
    per_category: int = typer.Option(1, "--per-category", min=1, max=100, help="Stream prompts per category"),
    stream_tokens: int = typer.Option(96, "--stream-tokens", min=1, max=4096,
                                      help="Tokens of each of the parent's streams"),
    steps: int = typer.Option(24, "--steps", min=3, max=1000, help="Timed single-token steps per variant"),
    ppl_tokens: int = typer.Option(1024, "--ppl-tokens", min=2, max=1 << 16,
                                   help="Held-text tokens for the perplexity"),
    json_out: bool = JsonOpt,
    json_file: Optional[Path] = JsonFileOpt,
    md_out: Optional[Path] = MarkdownOpt,
    plot_out: Optional[Path] = PlotOpt,
    *, cfg: Settings,
) -> None:
    from specquant_cli.bench import datasets, report, stamp
    from specquant_cli.bench import drafts as bench_drafts
    from specquant_cli.commands.options import load_family
    from specquant_cli.errors import InputError
    from specquant_cli.family.roles import PARENT_ROLE, recipe_roles
    from specquant_cli.session import bind_parent
    from specquant_cli.settings import SessionSettings

    report.check_outputs({"--json-file": json_file, "--markdown": md_out, "--plot": plot_out}, inputs=dataset)
    if plot_out:
        report.check_plot_available()
    fam = bind_parent(load_family(cfg.runtime.family), SessionSettings.of(cfg))
    drafts_of = [r for r in fam.roles() if r != PARENT_ROLE]
    names = split_list(roles, "--roles", "role") or (["q4", *recipe_roles()] if make else drafts_of)
    if PARENT_ROLE in names:
        raise InputError("--roles: the parent is the reference, measured first; name draft roles")
    items = datasets.load(dataset, split_list(categories, "--categories", "category"), per_category)
    say = lambda line: err.print(f"bench drafts: {line}", markup=False)  # noqa: E731
    run_stamp = stamp.take(command_line(), cfg.runtime.threads)
    if make:
        fam = bench_drafts.make_missing(fam, names, cfg.runtime.threads, say)
    missing = [r for r in names if r not in fam.roles()]
    if missing:
        raise InputError(f"{fam.name} has no {', '.join(missing)} role(s); add --make, or run: specquant quantize "
                         f"--types {','.join(missing)} for the family")
    gamma = cfg.decoding.gamma  # the draft length of the implied speculative outcome
    measured = bench_drafts.run(fam, names, items, stream_tokens, gamma, steps, ppl_tokens, cfg.runtime.threads, say)
    rep = {"command": run_stamp["command"], "stamp": run_stamp, "family": fam.name, "root": str(fam.root),
           "parent": fam.parent_rendering, "provenance": fam.provenance, "imatrix": fam.manifest.get("imatrix"),
           "config": {"stream_tokens": stream_tokens, "gamma": gamma, "steps": steps, "ppl_tokens": ppl_tokens,
                      "threads": cfg.runtime.threads, "datasets": [str(d) for d in dataset] or ["builtin"]},
           **measured}
    err.print(bench_drafts.markdown(rep), markup=False)
    err.print("End to end, the same prompts for every policy:\n  "
              + bench_drafts.bench_command(rep, str(dataset[0]) if dataset else None), markup=False)
    failure = report.write_outputs(rep, json_file, md_out, plot_out, render=bench_drafts.markdown,
                                   draw=bench_drafts.plot)
    if json_out:
        out_json(rep)
    if failure:
        raise failure
