"""`specquant bench logits`: the parent's logits for the same positions computed each way a request can compute them
(bench.logits), against one token at a time: bit-equal or not, per case."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from specquant_cli.commands.options import JsonFileOpt, JsonOpt, MarkdownOpt, split_list, with_settings
from specquant_cli.console import err, out_json
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("logits", short_help="Are logits bit-equal in every batch and cache state",
                help="The parent's logits for the same positions computed one token at a time, inside verification "
                     "batches, after a restored prefix, after other prefill chunks, beside another sequence and on "
                     "other threads: bit-equal or not, the largest difference, the same top token.")(logits)


@with_settings("runtime.family", "runtime.parent", "runtime.threads", "runtime.deterministic")
def logits(
    roles: Optional[str] = typer.Option(None, "--roles", help="Comma-separated roles", metavar="NAMES",
                                        show_default="the parent"),
    positions: int = typer.Option(64, "--positions", min=2, max=256, help="Answer positions compared"),
    other_threads: int = typer.Option(1, "--other-threads", min=0, max=512,
                                      help="Threads of the thread case (0: none)"),
    json_out: bool = JsonOpt,
    json_file: Optional[Path] = JsonFileOpt,
    md_out: Optional[Path] = MarkdownOpt,
    *, cfg: Settings,
) -> None:
    from specquant_cli.bench import logits as bench_logits
    from specquant_cli.bench import report, stamp
    from specquant_cli.commands.options import command_line, load_family
    from specquant_cli.errors import InputError
    from specquant_cli.family.roles import PARENT_ROLE
    from specquant_cli.session import bind_parent
    from specquant_cli.settings import SessionSettings
    from specquant_cli.system.hardware import detect

    report.check_outputs({"--json-file": json_file, "--markdown": md_out})
    facts = detect()
    fam = bind_parent(load_family(cfg.runtime.family), SessionSettings.of(cfg, facts=facts))
    names = split_list(roles, "--roles", "role") or [PARENT_ROLE]
    for r in names:
        if r != PARENT_ROLE and r not in fam.roles():
            raise InputError(f"--roles: {r!r} is no role of {fam.name} ({', '.join(fam.roles())})")
    names = [fam.parent_rendering if r == PARENT_ROLE else r for r in names]
    threads = cfg.runtime.threads
    run_stamp = stamp.take(command_line(), threads)
    results = {}
    with err.status("bench logits") as status:
        for role in names:
            results[role] = bench_logits.run(str(fam.path(role)), threads, answer_tokens=positions,
                                             other_threads=other_threads or None,
                                             progress=lambda what, r=role: status.update(f"bench logits: {r}: {what}"))
    rep = bench_logits.report(fam, results, threads, run_stamp, facts.to_dict())
    err.print(bench_logits.markdown(rep), markup=False)
    failure = report.write_outputs(rep, json_file, md_out, None, render=bench_logits.markdown)
    if json_out:
        out_json(rep)
    if failure:
        raise failure
