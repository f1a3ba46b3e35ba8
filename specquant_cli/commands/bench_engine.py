"""`specquant bench engine`: the parent against each drafter and draft length, with the engine's overhead
(bench.engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from specquant_cli.commands.options import (
    BENCH_MAX_TOKENS,
    JsonFileOpt,
    JsonOpt,
    MarkdownOpt,
    command_line,
    int_list,
    split_list,
    with_settings,
)
from specquant_cli.console import err, out_json
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("engine", short_help="The engine per drafter and draft length",
                help="The engine itself: the parent alone against each drafter at each draft length and adaptive, "
                     "greedy, from empty caches; speed, acceptance, identity, and the overhead over llama.cpp's "
                     "calls.")(engine)


@with_settings("runtime.family", "runtime.parent", "runtime.ctx", "runtime.threads", "runtime.deterministic")
def engine(
    drafters: str = typer.Option("q4,q8,ngram", "--drafters", help="Draft roles, ngram, suffix",
                                 metavar="NAMES"),
    gammas: str = typer.Option("2,4,6", "--gammas", help="Fixed draft lengths (adaptive runs too)", metavar="N,…"),
    max_tokens: int = typer.Option(BENCH_MAX_TOKENS, "--max-tokens", min=1, max=4096, help="New tokens per answer"),
    prompts: int = typer.Option(5, "--prompts", min=1, max=5, help="How many of the built-in prompts"),
    json_out: bool = JsonOpt,
    json_file: Optional[Path] = JsonFileOpt,
    md_out: Optional[Path] = MarkdownOpt,
    *, cfg: Settings,
) -> None:
    from specquant_cli.bench import engine as bench_engine
    from specquant_cli.bench import report, stamp
    from specquant_cli.commands.options import load_family
    from specquant_cli.errors import InputError
    from specquant_cli.family.roles import PARENT_ROLE
    from specquant_cli.session import bind_parent
    from specquant_cli.settings import SessionSettings
    from specquant_cli.system.hardware import detect

    report.check_outputs({"--json-file": json_file, "--markdown": md_out})
    names = split_list(drafters, "--drafters", "drafter")
    gs = int_list(gammas, "--gammas", 1, 16)
    facts = detect()
    fam = bind_parent(load_family(cfg.runtime.family), SessionSettings.of(cfg, facts=facts))
    for d in names:
        if d not in bench_engine.DRAFT_FREE and (d == PARENT_ROLE or d not in fam.roles()):
            raise InputError(f"--drafters: {d!r} is no draft role of {fam.name} "
                             f"({', '.join(r for r in fam.roles() if r != PARENT_ROLE)}) nor "
                             f"{' or '.join(bench_engine.DRAFT_FREE)}")
    run_stamp = stamp.take(command_line(), cfg.runtime.threads)
    with err.status("bench engine") as status:
        measured = bench_engine.run(fam, names, gs, max_tokens, prompts, cfg.runtime.ctx, cfg.runtime.threads,
                                    lambda what: status.update(f"bench engine: {what}"))
    rep = bench_engine.report(fam, measured, {"drafters": names, "gammas": gs, "max_tokens": max_tokens,
                                              "n_ctx": cfg.runtime.ctx, "threads": cfg.runtime.threads},
                              run_stamp, facts.to_dict())
    err.print(bench_engine.markdown(rep), markup=False)
    failure = report.write_outputs(rep, json_file, md_out, render=bench_engine.markdown)
    if json_out:
        out_json(rep)
    if failure:
        raise failure
