"""`specquant bench`: where measuring lives, one subcommand a measurement, each a thin edge over bench/.

- `prompts`: policies side by side on prompt sets (Spec-Bench, GSM8K, the built-in set), in one process;
- `load`: streamed conversations against an OpenAI-compatible server, or servers started fresh side by side, or a
  recorded trace replayed (`--replay`);
- `record`: a pass-through proxy that records a real client's requests as a trace;
- `batch`: requests decoding together in one process (the server's slots and batcher, no HTTP);
- `calls`: each role's call-cost curve (a parent or draft call on 1..64 tokens at each depth, prefill per token);
- `logits`: the parent's logits computed each way a request can (batches, restored prefixes, chunks, slots): bit-equal?
- `engine`: the engine per drafter and draft length, against the cost its own calls predict;
- `prefill`: a running stream's gaps while a long prompt is prefilled beside it, per --prefill-chunk;
- `drafts`: draft variants' size, step, agreement with the parent and perplexity;
- `rpc`: the parent local against llama.cpp RPC workers on loopback, and speculation against added delay;
- `route`: the router's scores and tiers over a prompt set.

Every subcommand: progress on stderr, a table on stderr, the report as JSON with --json (stdout) or --json-file,
markdown with --markdown; nothing that is no data on stdout."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    from specquant_cli.commands import (
        bench_batch,
        bench_calls,
        bench_drafts,
        bench_engine,
        bench_load,
        bench_logits,
        bench_prefill,
        bench_prompts,
        bench_record,
        bench_route,
        bench_rpc,
    )

    PANELS = {"Measure": (bench_prompts, bench_load, bench_record, bench_drafts, bench_route),  # for users first
              "Diagnostics": (bench_calls, bench_logits, bench_engine, bench_prefill, bench_batch, bench_rpc)}

    from specquant_cli.commands.options import SpecquantGroup

    group = typer.Typer(cls=SpecquantGroup, no_args_is_help=True,
                        context_settings={"help_option_names": ["-h", "--help"]},
                        help="Measure policies on prompt sets and servers under load; the diagnostics measure one "
                             "part (call costs, the engine, prefill, batches, RPC). docs/benchmarking.md")
    for panel, mods in PANELS.items():
        for mod in mods:
            mod.register(group)
            group.registered_commands[-1].rich_help_panel = panel
    app.add_typer(group, name="bench", short_help="Measure speed, fidelity and load")
    app.command("loadtest", hidden=True, add_help_option=False,
                context_settings={"ignore_unknown_options": True, "allow_extra_args": True})(_moved)


def _moved() -> None:
    """`specquant loadtest`, before the bench subcommands: one line saying where it went."""
    from specquant_cli.errors import InputError

    raise InputError("'specquant loadtest' is now 'specquant bench load' (the same options; the report goes to "
                     "stdout with --json, to a file with --json-file)")
