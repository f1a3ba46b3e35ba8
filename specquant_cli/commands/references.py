"""Model references at the command edge (family.refs): a GGUF argument or option that is written `hf:…`,
`ollama:…` or `lmstudio:…` becomes a local GGUF path for the command's body, with the reference and where the file
came from; a path stays a path. The stores are read from the environment here (settings.model_stores), once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specquant_cli.console import err


@dataclass(frozen=True)
class Model:
    """A GGUF the command runs on: its local `path`, and for a reference the reference written out in full, the
    family name it suggests and its provenance (None for a path given as a path)."""

    path: Path
    reference: Optional[str] = None
    name: Optional[str] = None
    provenance: Optional[str] = None


def is_reference(given) -> bool:
    from specquant_cli.family.refs import is_reference

    return given is not None and is_reference(str(given))


@contextlib.contextmanager
def local_model(given, work: Optional[Path] = None) -> Iterator[Optional[Model]]:
    """`given` (a path, a reference, or None) as a Model for as long as the block runs; a reference located first
    (a Hugging Face file downloaded into its cache when it is not there, an ollama blob's digest checked; one
    InputError line naming the reference else). `work`: where a work folder may go (family.refs.local_file)."""
    if given is None or not is_reference(given):
        yield None if given is None else Model(Path(given))
        return
    from specquant_cli.family import refs
    from specquant_cli.settings import model_stores

    located = refs.locate(str(given), model_stores())
    err.print(f"{located.reference}: {located.files[0]}" + (f" (and {len(located.files) - 1} more parts)"
                                                              if len(located.files) > 1 else ""), markup=False)
    with refs.local_file(located, work) as path:
        yield Model(path, located.reference, located.name, located.provenance)


def say_draft_candidates(parent: Path, family: str) -> None:
    """On stderr, the smaller models of the parent's vocabulary found on this machine (family.refs.draft_candidates),
    each with the command that adds it as a sibling draft."""
    from specquant_cli.family.refs import draft_candidates
    from specquant_cli.settings import model_stores

    for f in draft_candidates(parent, model_stores(), lambda t: None):
        err.print(f"  draft candidate: {f.reference} ({f.file_type}, {f.size_bytes / 2**30:.2f} GiB, the parent's "
                  f"vocabulary): specquant quantize --family {family} --draft-model {f.reference}", markup=False)
