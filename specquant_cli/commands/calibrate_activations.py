from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from specquant_cli.commands.options import JsonOpt, load_family, with_settings
from specquant_cli.console import err, out_json
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("calibrate-activations", short_help="Collect an importance matrix for draft recipes",
                help="Collect the F16's activation statistics (an importance matrix) over a calibration text; "
                     "stored as imatrix.gguf in the family folder for the q4i/q3g draft recipes of "
                     "quantize.")(calibrate_activations)


@with_settings("runtime.family", "runtime.threads")
def calibrate_activations(
    calibration: Optional[Path] = typer.Option(None, "--calibration",
                                               help="UTF-8 text to calibrate on",
                                               show_default="built-in", metavar="FILE"),
    tokens: int = typer.Option(4096, "--tokens", min=16, help="Calibration tokens at most"),
    chunk: int = typer.Option(512, "--chunk", min=32, max=8192, help="Tokens per forward pass"),
    json_out: bool = JsonOpt,
    *, cfg: Settings,
) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specquant_cli.family.activations import calibrate_family

    fam = load_family(cfg.runtime.family)
    threads = cfg.runtime.threads
    t0 = time.perf_counter()
    if not err.is_terminal:  # a log, not a terminal: one plain line per chunk instead of a live bar
        def line(done: int, total: int) -> None:
            err.print(f"activations of {fam.name} f16: {done}/{total} tokens ({time.perf_counter() - t0:.0f}s)",
                      markup=False)

        rec = calibrate_family(fam, calibration, tokens, chunk, threads, line)
    else:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                      TimeElapsedColumn(), console=err, transient=False) as prog:
            task = prog.add_task(f"activations of {fam.name} f16", total=None)

            def progress(done: int, total: int) -> None:
                prog.update(task, completed=done, total=total)

            rec = calibrate_family(fam, calibration, tokens, chunk, threads, progress)
    if json_out:
        out_json(rec)
        return
    err.print(f"{rec['entries']} weight matrices, {rec['tokens']} tokens in {rec['chunks']} chunks of "
              f"{rec['chunk_size']} ({time.perf_counter() - t0:.1f}s) -> {fam.root / rec['file']}", markup=False)
    err.print(f"  calibration {rec['calibration']['source']} sha256 {rec['calibration']['sha256'][:16]}…",
              markup=False)
