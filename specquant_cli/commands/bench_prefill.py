"""`specquant bench prefill`: a running stream's gaps while a long prompt is prefilled beside it, per --prefill-chunk
(bench.prefill)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from specquant_cli.commands.options import JsonFileOpt, JsonOpt, MarkdownOpt, command_line, int_list, with_settings
from specquant_cli.console import err, out_json
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("prefill", short_help="A long prompt's prefill beside a stream",
                help="A long prompt beside a running stream, a server started fresh for each --prefill-chunk "
                     "value: the long prompt's time to its first token and the stream's gaps during it.")(prefill)


@with_settings("runtime.family", "runtime.parent", "runtime.ctx", "runtime.threads", "decoding.policy",
               "runtime.deterministic")
def prefill(
    chunks: str = typer.Option("512,128,64", "--prefill-chunk", help="Prefill chunks to compare",
                               metavar="N,…"),
    b_tokens: int = typer.Option(1200, "--prompt-tokens", min=64, max=32768,
                                 help="Approximate length of the long prompt"),
    json_out: bool = JsonOpt,
    json_file: Optional[Path] = JsonFileOpt,
    md_out: Optional[Path] = MarkdownOpt,
    *, cfg: Settings,
) -> None:
    from specquant_cli.bench import prefill as bench_prefill
    from specquant_cli.bench import report, sides, stamp
    from specquant_cli.commands.options import load_family
    from specquant_cli.errors import InputError
    from specquant_cli.routing.policies import check_policy
    from specquant_cli.session import bind_parent
    from specquant_cli.settings import SessionSettings

    report.check_outputs({"--json-file": json_file, "--markdown": md_out})
    ns = int_list(chunks, "--prefill-chunk", 1, 4096)
    policy = check_policy(cfg.decoding.policy)
    fam = bind_parent(load_family(cfg.runtime.family), SessionSettings.of(cfg))
    if b_tokens + 64 > cfg.runtime.ctx:
        raise InputError(f"--prompt-tokens {b_tokens} does not fit --ctx {cfg.runtime.ctx}; raise --ctx")
    setup = sides.Setup(fam, 2, cfg.runtime.ctx, cfg.runtime.threads)
    run_stamp = stamp.take(command_line(), cfg.runtime.threads)
    rows = bench_prefill.run(setup, ns, policy, b_tokens, lambda line: err.print(f"bench prefill: {line}",
                                                                                 markup=False))
    rep = {"command": run_stamp["command"], "stamp": run_stamp, "family": fam.name, "parent": fam.parent_rendering,
           "threads": cfg.runtime.threads, "config": {"chunks": ns, "policy": policy, "b_tokens": b_tokens},
           "rows": rows}
    err.print(bench_prefill.markdown(rep), markup=False)
    failure = report.write_outputs(rep, json_file, md_out, render=bench_prefill.markdown)
    if json_out:
        out_json(rep)
    if failure:
        raise failure
