"""`specquant bench calls`: each role's call-cost curve (bench.calls), a child process per role."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from specquant_cli.commands.options import JsonFileOpt, JsonOpt, MarkdownOpt, PlotOpt, split_list, with_settings
from specquant_cli.console import err, out_json
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("calls", short_help="Each role's call cost on 1 to 64 tokens, per depth",
                help="Each role's call cost: one llama.cpp call on 1, 2, 4, … 64 tokens (every row's logits, as a "
                     "verification asks) after each depth of context, and the prefill per prompt token, a child "
                     "process per role.")(calls)


@with_settings("runtime.family", "runtime.parent", "runtime.threads", "runtime.deterministic")
def calls(
    roles: Optional[str] = typer.Option(None, "--roles", help="Comma-separated roles", metavar="NAMES",
                                        show_default="all"),
    sizes: str = typer.Option("1,2,4,8,16,32,64", "--sizes", help="Tokens per call", metavar="N,…"),
    reps: int = typer.Option(7, "--repeats", "--reps", min=1, max=101, help="Timings per size (the median counts)"),
    positions: str = typer.Option("64,1024", "--positions", metavar="N,…",
                                  help="Context depths, a curve each"),
    json_out: bool = JsonOpt,
    json_file: Optional[Path] = JsonFileOpt,
    md_out: Optional[Path] = MarkdownOpt,
    plot_out: Optional[Path] = PlotOpt,
    *, cfg: Settings,
) -> None:
    from specquant_cli.bench import calls as bench_calls
    from specquant_cli.bench import report, stamp
    from specquant_cli.commands.options import command_line, int_list, load_family
    from specquant_cli.errors import InputError
    from specquant_cli.family.roles import PARENT_ROLE
    from specquant_cli.session import bind_parent
    from specquant_cli.settings import SessionSettings
    from specquant_cli.system.hardware import detect

    report.check_outputs({"--json-file": json_file, "--markdown": md_out, "--plot": plot_out})
    if plot_out:
        report.check_plot_available()
    ns = int_list(sizes, "--sizes", 1, 512)
    depths = int_list(positions, "--positions", 1, 1 << 16)
    facts = detect()
    fam = bind_parent(load_family(cfg.runtime.family), SessionSettings.of(cfg, facts=facts))
    names = split_list(roles, "--roles", "role") or fam.roles()
    for r in names:
        if r != PARENT_ROLE and r not in fam.roles():
            raise InputError(f"--roles: {r!r} is no role of {fam.name} ({', '.join(fam.roles())})")
    names = [fam.parent_rendering if r == PARENT_ROLE else r for r in names]
    threads = cfg.runtime.threads
    run_stamp = stamp.take(command_line(), threads)
    with err.status("bench calls") as status:
        curves = bench_calls.run(fam, names, ns, reps, depths, threads,
                                 lambda role: status.update(f"bench calls: {role} ({fam.variant(role)['type']})"))
    rep = bench_calls.report(fam, curves, ns, reps, depths, threads, run_stamp, facts.to_dict())
    err.print(bench_calls.markdown(rep), markup=False)
    failure = report.write_outputs(rep, json_file, md_out, plot_out, render=bench_calls.markdown,
                                   draw=bench_calls.plot)
    if json_out:
        out_json(rep)
    if failure:
        raise failure
