"""What a model reference (family.refs) comes to: the files it names (`Located`), a GGUF it reaches on this machine
(`Found`), and the helpers every store's module shares."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specquant_cli.errors import SpecquantError

FORMS = "hf:OWNER/REPO:QUANT, hf:OWNER/REPO/FILE.gguf, ollama:NAME[:TAG], lmstudio:PUBLISHER/REPO[/FILE]"
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Located:
    """The files a reference names. `reference`: the reference written out in full (what `list --found` prints and a
    family records); `name`: the family's name when it makes one; `files`: one GGUF, or a split model's parts in
    order; `provenance`: where the files came from, as the manifest tells it."""

    reference: str
    name: str
    files: tuple[Path, ...]
    provenance: str


@dataclass(frozen=True)
class Found:
    """A GGUF a reference reaches: its reference, its path (a split model's first part), its size (all parts) and
    its type as its header names it."""

    reference: str
    path: Path
    size_bytes: int
    file_type: str


def family_name(text: str) -> str:
    """A family name made of a reference's words: letters, digits, '.', '_' and '-' kept, anything else '-'."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")
    return name or "model"


def gguf_type(path: Path) -> str:
    """A GGUF's type as its header names it (general.file_type, else its main weights' type); '?' when unreadable."""
    from specquant_cli.family.gguf_read import read_info
    from specquant_cli.family.gguf_walk import read_file_type

    try:
        return read_file_type(path) or read_info(path).weight_type or "?"
    except (SpecquantError, OSError):
        return "?"
