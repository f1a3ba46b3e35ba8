"""`specquant bench route`: the router's scores and tiers over a prompt set (bench.routes)."""

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
    command_line,
    split_list,
    with_settings,
)
from specquant_cli.console import err, out_json
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("route", short_help="The router's scores over a prompt set",
                help="The router over a prompt set: per category, the spread of complexity scores and each tier's "
                     "share (no model is loaded).")(route)


@with_settings("runtime.family", "runtime.ctx")
def route(
    dataset: list[Path] = DatasetOpt,
    categories: Optional[str] = CategoriesOpt,
    limit: Optional[int] = typer.Option(20, "--limit", min=1, help="At most N prompts per category"),
    json_out: bool = JsonOpt,
    json_file: Optional[Path] = JsonFileOpt,
    md_out: Optional[Path] = MarkdownOpt,
    *, cfg: Settings,
) -> None:
    from specquant_cli.bench import datasets, report, routes, stamp
    from specquant_cli.session import open_session
    from specquant_cli.settings import SessionSettings

    report.check_outputs({"--json-file": json_file, "--markdown": md_out}, inputs=[*dataset, *([cfg.config] if
                                                                                          cfg.config else [])])
    items = datasets.load(dataset, split_list(categories, "--categories", "category"), limit)
    run_stamp = stamp.take(command_line(), None, models_here=False)  # no model runs: the router reads text
    router = open_session(SessionSettings.of(cfg)).router
    datasets.check_lengths(items, router.check_length)
    with err.status(f"bench route: scoring {len(items)} prompts"):
        rows = routes.score(router, items)
    rep = {"command": run_stamp["command"], "stamp": run_stamp,
           "config": {"datasets": [str(d) for d in dataset] or ["builtin"], "categories": categories, "limit": limit},
           "thresholds": {"low_max": router.config.low_max, "medium_max": router.config.medium_max}, "rows": rows}
    err.print(routes.markdown(rep), markup=False)
    failure = report.write_outputs(rep, json_file, md_out, render=routes.markdown)
    if json_out:
        out_json(rep)
    if failure:
        raise failure
