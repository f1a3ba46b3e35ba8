"""`specquant bench batch`: requests decoding together in one process, per --parallel and policy (bench.batch)."""

from __future__ import annotations

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
    command_line,
    int_list,
    split_list,
    with_settings,
)
from specquant_cli.console import err, out_json
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("batch", short_help="Requests decoding together, in one process",
                help="Requests decoding together in one process (the server's slots, batcher and round pacer, no "
                     "HTTP): for each --requests B and policy, aggregate tok/s, rounds, held calls, and answers "
                     "against the parent's.")(batch)


@with_settings("runtime.family", "runtime.parent", "runtime.ctx", "runtime.threads", "decoding.gamma",
               "serving.prefill_chunk", "runtime.deterministic")
def batch(
    requests: str = typer.Option("1,2,4,8", "--requests", help="Requests decoding together",
                                 metavar="B,…"),
    policies: str = typer.Option("parent,auto", "--policies", help="Comma-separated policies", metavar="NAMES"),
    hold: str = typer.Option("priced", "--hold", help="priced, off, or both: priced,off", metavar="MODES"),
    dataset: list[Path] = DatasetOpt,
    categories: Optional[str] = CategoriesOpt,
    max_tokens: int = typer.Option(BENCH_MAX_TOKENS, "--max-tokens", min=1, max=4096, help="New tokens per answer"),
    repeats: int = typer.Option(1, "--repeats", min=1, max=20, help="Runs per configuration (medians)"),
    json_out: bool = JsonOpt,
    json_file: Optional[Path] = JsonFileOpt,
    md_out: Optional[Path] = MarkdownOpt,
    *, cfg: Settings,
) -> None:
    from specquant_cli.bench import batch as bench_batch
    from specquant_cli.bench import datasets, report, stamp
    from specquant_cli.console import stderr_reporter
    from specquant_cli.errors import InputError
    from specquant_cli.routing.policies import check_policy
    from specquant_cli.session import open_session
    from specquant_cli.settings import MAX_PARALLEL, SessionSettings

    report.check_outputs({"--json-file": json_file, "--markdown": md_out}, inputs=dataset)
    bs = int_list(requests, "--requests", 1, MAX_PARALLEL)
    holds = split_list(hold, "--hold", "hold")
    bad = [h for h in holds if h not in bench_batch.HOLDS]
    if bad:
        raise InputError(f"--hold {hold!r}: {bad[0]!r} is not one of {', '.join(bench_batch.HOLDS)}")
    names = [check_policy(p) for p in split_list(policies, "--policies", "policy")]
    items = datasets.load(dataset, split_list(categories, "--categories", "category"))
    if len(items) < max(bs):
        raise InputError(f"{len(items)} prompts for --requests {max(bs)}: give a larger --dataset")
    run_stamp = stamp.take(command_line(), cfg.runtime.threads)
    session = open_session(SessionSettings.of(cfg, parallel=max(bs)), report=stderr_reporter())
    try:
        fam = session.runtime.family
        for p in names:
            check_policy(p, fam.roles(), fam.siblings())
        session.runtime.calibration()  # measured first when a planner needs it, never inside a run
        session.runtime.pool.ensure([r for p in names for r in _roles(p)])
        session.runtime.load_planner_drafts(names)
        with err.status("bench batch") as status:
            runs = bench_batch.run(session, names, bs, holds, [i.prompt for i in items], max_tokens, repeats,
                                   cfg.serving.prefill_chunk, lambda what: status.update(f"bench batch: {what}"))
    finally:
        session.runtime.close()
    rep = bench_batch.report(runs, {"parallel": bs, "policies": names, "holds": holds, "max_tokens": max_tokens,
                                    "repeats": repeats, "threads": cfg.runtime.threads,
                                    "datasets": [str(d) for d in dataset] or ["builtin"]}, run_stamp, fam)
    err.print(bench_batch.markdown(rep), markup=False)
    failure = report.write_outputs(rep, json_file, md_out, render=bench_batch.markdown)
    if json_out:
        out_json(rep)
    if failure:
        raise failure


def _roles(policy: str) -> list[str]:
    from specquant_cli.routing.policies import all_roles

    return list(all_roles([policy]))
