"""`specquant list`: the families `--family NAME` finds from any folder (family.store: ./models, the models folder
and its index), one line each on stdout — name, parent, draft roles, size on disk, whether this machine has a
calibration of it, where its base came from, folder — with `*` on the default family, the one a command runs when none
is named. `list --found`: the GGUFs on this machine that model references reach (family.refs: the Hugging Face cache,
ollama's store, LM Studio's folder), with size, type and the reference to pass."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from specquant_cli.commands.options import JsonOpt, with_settings
from specquant_cli.console import err, gib, out, out_json, warn
from specquant_cli.settings import Settings

COLUMNS = ("NAME", "PARENT", "DRAFTS", "SIZE", "CALIBRATED", "FROM", "FOLDER")
FOUND_COLUMNS = ("REFERENCE", "TYPE", "SIZE", "PATH")


def register(app: typer.Typer) -> None:
    app.command("list", short_help="List families pulled or quantized",
                help="List the families --family NAME finds from any folder (./models, the models folder and its "
                     "index); * marks the default family, the one a command runs when none is named. --found lists "
                     "the GGUFs in the Hugging Face cache, ollama's store and LM Studio's folder, with the reference "
                     "pull and quantize take.")(list_families)


@with_settings("runtime.models")
def list_families(json_out: bool = JsonOpt,
                  found: bool = typer.Option(False, "--found", help="GGUFs in the HF cache, ollama and LM Studio"),
                  *, cfg: Settings) -> None:
    if found:
        return _list_found(json_out)
    from specquant_cli.family import store
    from specquant_cli.settings import models_dir, resolve

    folder, cwd = models_dir(), store.current_folder()
    found = store.known(folder, cwd, warn=warn)
    given = resolve(["runtime.family", "runtime.threads"], {}, cfg.config)  # the default as set; the calibration's
    default = _default(given, folder, cwd) if found else None
    facts = None
    if found:
        from specquant_cli.system import hardware

        facts = hardware.detect()
    rows = [_row(k, default, facts, given.get("runtime.threads")) for k in found]
    if json_out:
        out_json(rows)
        return
    if not rows:
        where = ", ".join(["./models", *([str(folder)] if folder is not None else [])])
        err.print(f"no families in {where}; fetch one with: specquant pull smollm2-135m", markup=False)
        return
    table = [COLUMNS, *(_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS) - 1)]
    for i, line in enumerate(table):
        mark = "* " if i and rows[i - 1]["default"] else "  "
        out(mark + "  ".join([*(cell.ljust(w) for cell, w in zip(line, widths)), line[-1]]))


def _list_found(json_out: bool) -> None:
    """`list --found`: one line per GGUF a model reference reaches, on stdout; where nothing is found, one stderr
    line naming the places looked in."""
    from specquant_cli.family import refs
    from specquant_cli.settings import model_stores

    stores = model_stores()
    rows = [{"reference": f.reference, "type": f.file_type, "size_bytes": f.size_bytes, "path": str(f.path)}
            for f in refs.found(stores, warn)]
    if json_out:
        out_json(rows)
        return
    if not rows:
        where = [str(stores.hf_cache), str(stores.ollama), *map(str, stores.lmstudio)]
        err.print(f"no GGUF found in {', '.join(where)}", markup=False)
        return
    table = [FOUND_COLUMNS, *((r["reference"], r["type"], gib(r["size_bytes"]), r["path"]) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(FOUND_COLUMNS) - 1)]
    for line in table:
        out("  ".join([*(cell.ljust(w) for cell, w in zip(line, widths)), line[-1]]))


def _default(given: Settings, folder: Optional[Path], cwd: Optional[Path]) -> Optional[str]:
    """The real path of the family a command runs when none is named on its command line (runtime.family as the
    environment or specquant.toml set it, else family.store.default_family); None when there is none."""
    from specquant_cli.errors import SpecquantError
    from specquant_cli.family import store

    ref = given.get("runtime.family")
    try:
        root = store.locate(ref, folder, cwd) if ref is not None else store.default_family(folder, cwd)[0]
    except SpecquantError as e:
        warn(f"{given.given_by('runtime.family')}: {e}" if ref is not None else str(e))
        return None
    return os.path.realpath(root)


def _row(k, default: Optional[str], facts, threads: int) -> dict:
    """One family's JSON object. A family that cannot be read is listed with its problem (and a warning)."""
    from specquant_cli.errors import SpecquantError
    from specquant_cli.family.manifest import Family
    from specquant_cli.family.roles import draft_roles

    row = {"name": k.name, "default": os.path.realpath(k.root) == default, "folder": str(k.root),
           "found_in": k.where, "architecture": None, "n_params": None, "parent": [], "drafts": [],
           "size_bytes": _size(k.root), "calibrated": False, "calibrated_renderings": [], "source": None,
           "problem": None}
    try:
        fam = Family.load(k.root, warn)
        m = fam.manifest
        n = m.get("n_params")
        row.update(parent=[_rendering_type(m["variants"][r], r) for r in fam.renderings()],
                   drafts=draft_roles(fam.roles()),
                   architecture=m.get("architecture") if isinstance(m.get("architecture"), str) else None,
                   n_params=n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None,
                   source=fam.source or None)
        row["calibrated_renderings"] = _calibrated(fam, facts, threads)
        row["calibrated"] = bool(row["calibrated_renderings"])
    except SpecquantError as e:
        row["problem"] = str(e)
        warn(f"{k.name}: {e}")
    return row


def _cells(row: dict) -> tuple[str, ...]:
    """A row's table cells, in COLUMNS' order."""
    n = row["n_params"]
    size = "" if n is None else f" {n / 1e9:.1f}B" if n >= 1e9 else f" {n / 1e6:.0f}M" if n >= 1e6 else \
        f" {n / 1e3:.0f}K"
    if row["problem"]:
        parent, calibrated = "unreadable (see the warning)", "-"
    else:
        parent = f"{row['architecture'] or '?'}{size} {'/'.join(row['parent']) or '-'}"
        calibrated = "yes" if row["calibrated"] else "no"
    return (row["name"], parent, ",".join(row["drafts"]) or "-", gib(row["size_bytes"]), calibrated,
            row["source"] or "-", row["folder"])


def _rendering_type(v, rendering: str) -> str:
    """A parent rendering's weight type: the quantized file's own (Q8_0, ...), else F16 or BF16."""
    own = v.get("file_type") if isinstance(v, dict) else None
    return own if isinstance(own, str) and own else rendering.upper()


def _calibrated(fam, facts, threads: int) -> list[str]:
    """The parent renderings this machine has a valid stored calibration of (at the resolved threads, no RPC)."""
    from specquant_cli.system import calibration_file as cal

    return [r for r in fam.renderings()
            if cal.load(fam.root, cal.fingerprint(facts, threads, None, parent=r)) is not None]


def _size(root: Path) -> int:
    """Bytes of the regular files in the family folder (its models, manifest, calibration, logs)."""
    total = 0
    try:
        entries = list(os.scandir(root))
    except OSError:
        return 0
    for e in entries:
        try:
            if e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    return total
