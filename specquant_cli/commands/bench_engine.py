"""`specquant bench engine`: the parent against each drafter and draft length, with the engine's overhead
(bench.engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from specquant_cli.commands.options import JsonOpt, command_line, int_list, split_list, with_settings
from specquant_cli.console import err, out_json
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("engine", help="The engine itself: the parent alone against each drafter (a draft role, ngram, "
                               "suffix) at each draft length and adaptive, greedy, every run from empty caches; "
                               "speed, acceptance, identical answers, and the overhead over the llama.cpp calls "
                               "it made.")(engine)


@with_settings("runtime.family", "runtime.parent", "runtime.ctx", "runtime.threads")
def engine(
    drafters: str = typer.Option("q4,q8,ngram", "--drafters", help="Comma-separated drafters: draft roles of "
                                 "the family, ngram, suffix"),
    gammas: str = typer.Option("2,4,6", "--gammas", help="Comma-separated fixed draft lengths (each drafter also "
                               "runs adaptive)"),
    max_tokens: int = typer.Option(96, "--max-tokens", min=1, max=4096),
    prompts: int = typer.Option(5, "--prompts", min=1, max=5, help="How many of the built-in code and "
                                "explanation prompts"),
    json_out: bool = JsonOpt,
    json_file: Optional[Path] = typer.Option(None, "--json-file", help="Write the JSON report to FILE"),
    md_out: Optional[Path] = typer.Option(None, "--markdown", help="Write the tables as markdown to FILE"),
    *, cfg: Settings,
) -> None:
    from specquant_cli.bench import engine as bench_engine
    from specquant_cli.bench import report
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
    with err.status("bench engine") as status:
        measured = bench_engine.run(fam, names, gs, max_tokens, prompts, cfg.runtime.ctx, cfg.runtime.threads,
                                    lambda what: status.update(f"bench engine: {what}"))
    rep = bench_engine.report(fam, measured, {"drafters": names, "gammas": gs, "max_tokens": max_tokens,
                                              "n_ctx": cfg.runtime.ctx, "threads": cfg.runtime.threads},
                              command_line(), facts.to_dict())
    err.print(bench_engine.markdown(rep), markup=False)
    failure = report.write_outputs(rep, json_file, md_out, render=bench_engine.markdown)
    if json_out:
        out_json(rep)
    if failure:
        raise failure
