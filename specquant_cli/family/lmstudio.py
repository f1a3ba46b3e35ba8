"""`lmstudio:PUBLISHER/REPO[/FILE]`: a GGUF in LM Studio's models folder, laid out as LM Studio lays it out —
`PUBLISHER/REPO/FILE.gguf` under `~/.lmstudio/models` (older versions: `~/.cache/lm-studio/models`; LMSTUDIO_MODELS
names another). Without FILE the repository's one model file is meant (its `mmproj-*` vision projector is no model);
a split model is taken whole, its first part named. The folder is only read."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from specquant_cli.errors import InputError
from specquant_cli.family import gguf_split
from specquant_cli.family.located import Found, Located, family_name, gguf_type
from specquant_cli.settings import ModelStores

PART = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9 ._+@()-]*$")


def parse(text: str, rest: str) -> tuple[str, str, str]:
    """(publisher, repo, file or '') of `lmstudio:PUBLISHER/REPO[/FILE]`; InputError when malformed."""
    parts = rest.split("/")
    if len(parts) not in (2, 3) or not all(PART.match(p) and p not in (".", "..") for p in parts) or \
            (len(parts) == 3 and not parts[2].endswith(".gguf")):
        raise InputError(f"{text}: malformed LM Studio reference; write lmstudio:PUBLISHER/REPO or "
                         "lmstudio:PUBLISHER/REPO/FILE.gguf")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else ""


def locate(text: str, rest: str, stores: ModelStores) -> Located:
    publisher, repo, name = parse(text, rest)
    roots = [r for r in stores.lmstudio if r.is_dir()]
    if not roots:
        shown = ", ".join(map(str, stores.lmstudio)) or "~/.lmstudio/models"
        raise InputError(f"{text}: no LM Studio models folder ({shown}); set LMSTUDIO_MODELS to where LM Studio keeps "
                         "its models")
    folder = next((r / publisher / repo for r in roots if (r / publisher / repo).is_dir()), None)
    if folder is None:
        raise InputError(f"{text}: no {publisher}/{repo} in {', '.join(map(str, roots))}; see specquant list --found")
    models = _models(folder)
    if not name:
        if len(models) != 1:
            raise InputError(f"{text}: {folder} holds {len(models)} model files ({', '.join(models) or 'none'}); "
                             "name one: lmstudio:PUBLISHER/REPO/FILE.gguf")
        name = models[0]
    parts = gguf_split.parts_of(name)
    files = [folder / p for p in (parts or [name])]
    missing = [f.name for f in files if not f.is_file()]
    if missing and not parts:
        raise InputError(f"{text}: no {name} in {folder}; its model files: {', '.join(models) or 'none'}")
    if missing:
        raise InputError(f"{text}: a part of the split model is missing: {missing[0]} (of {len(parts)}) in {folder}")
    ref = f"lmstudio:{publisher}/{repo}/{files[0].name}"
    stem = (gguf_split.PART.match(files[0].name)["stem"] if parts else files[0].name.removesuffix(".gguf"))
    return Located(ref, family_name(stem), tuple(files), f"LM Studio {publisher}/{repo}/{files[0].name} in "
                   f"{folder.parent.parent}, used as it is")


def _models(folder: Path) -> list[str]:
    """The model files of a repository folder: GGUFs other than vision projectors and later split parts."""
    out = []
    for p in sorted(folder.iterdir()):
        m = gguf_split.PART.match(p.name)
        if p.is_file() and p.name.endswith(".gguf") and not p.name.startswith("mmproj") and \
                (m is None or int(m["no"]) == 1):
            out.append(p.name)
    return out


def found(stores: ModelStores, warn: Callable[[str], None]) -> list[Found]:
    out = []
    for root in stores.lmstudio:
        if not root.is_dir():
            continue
        for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
            for name in _models(folder):
                parts = gguf_split.parts_of(name) or [name]
                files = [folder / p for p in parts]
                if not all(f.is_file() for f in files):
                    continue
                ref = f"lmstudio:{folder.parent.name}/{folder.name}/{name}"
                out.append(Found(ref, files[0], sum(f.stat().st_size for f in files), gguf_type(files[0])))
    return out
