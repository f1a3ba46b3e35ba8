"""References to models where they already live, taken wherever a GGUF path is (`pull`, `quantize`,
`--draft-model`):

- `hf:OWNER/REPO:QUANT` and `hf:OWNER/REPO/FILE.gguf` (llama.cpp's `-hf` convention): a file of a Hugging Face
  repository through huggingface_hub — its cache, its token, offline when HF_HUB_OFFLINE says so; a split model's
  parts fetched whole and merged into one file (family.hub);
- `ollama:NAME[:TAG]`: the model layer of a tag in ollama's store, its digest checked (family.ollama);
- `lmstudio:PUBLISHER/REPO[/FILE]`: a GGUF in LM Studio's models folder (family.lmstudio).

`locate` turns a reference into the files it names (`Located`), `local_file` into one GGUF path to hand to the rest
of specquant: the store's own file where it is one (a family adopts it as a hard link where the filesystem allows,
else a copy), a symbolic link of a readable name to an ollama blob (in a work folder of ours), or the merged parts
of a split model. Nothing in those stores is ever written, moved or deleted. `found` lists every GGUF the
references reach on this machine (`specquant list --found`). Every problem is one InputError naming the reference."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

from specquant_cli.errors import InputError, SpecquantError
from specquant_cli.family.located import FORMS, Found, Located, Progress
from specquant_cli.settings import ModelStores

__all__ = ["FORMS", "Found", "Located", "found", "is_reference", "local_file", "locate"]

SCHEMES = ("hf", "ollama", "lmstudio")


def is_reference(text: str) -> bool:
    """`text` is written as a reference (`hf:`, `ollama:`, `lmstudio:`), not as a path or a demo family's name."""
    scheme, sep, _ = str(text).partition(":")
    return bool(sep) and scheme in SCHEMES


def locate(text: str, stores: ModelStores, progress: Optional[Progress] = None) -> Located:
    """The files the reference `text` names (a Hugging Face file downloaded into its cache first, unless it is there
    already); InputError naming the reference and the problem."""
    scheme, _, rest = str(text).partition(":")
    if scheme == "hf":
        from specquant_cli.family import hub

        return hub.locate(text, rest, stores, progress)
    if scheme == "ollama":
        from specquant_cli.family import ollama

        return ollama.locate(text, rest, stores)
    if scheme == "lmstudio":
        from specquant_cli.family import lmstudio

        return lmstudio.locate(text, rest, stores)
    raise InputError(f"{text}: not a model reference; one of {FORMS}")


def found(stores: ModelStores, warn: Callable[[str], None]) -> list[Found]:
    """Every GGUF the references reach on this machine, store by store (a store that cannot be read: a warning)."""
    from specquant_cli.family import hub, lmstudio, ollama

    out: list[Found] = []
    for lister in (hub.found, ollama.found, lmstudio.found):
        out += lister(stores, warn)
    return out


@contextlib.contextmanager
def local_file(located: Located, work: Optional[Path] = None) -> Iterator[Path]:
    """One GGUF path for what `located` names, for as long as the block runs: a store's own file when its name
    says what it is; else (an ollama blob, named by its digest) a symbolic link of the family's name to it, in a work
    folder of ours; a split model's parts merged into one file there. `work`: where that folder goes (beside the
    family, so a merged file is linked into it rather than copied); the system's temp folder when None. Errors from
    the block that name the work file name the reference instead."""
    from specquant_cli.family import gguf_split

    first = located.files[0]
    if len(located.files) == 1 and first.name.endswith(".gguf"):
        with _naming(located.reference, (str(first),)):
            yield first
        return
    if work is not None:
        work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work, prefix=f".fetch-{os.getpid()}-ref-") as tmp:
        path = Path(tmp) / f"{located.name}.gguf"
        if len(located.files) == 1:
            path.symlink_to(first)
        else:
            gguf_split.merge(located.files, path)
        with _naming(located.reference, (str(path), tmp)):
            yield path


@contextlib.contextmanager
def _naming(reference: str, paths: tuple[str, ...]) -> Iterator[None]:
    """An error raised in the block that names one of `paths` names the reference instead (longest path first)."""
    try:
        yield
    except SpecquantError as e:
        text = str(e)
        for p in sorted(paths, key=len, reverse=True):
            text = text.replace(p, reference)
        if text == str(e):
            raise
        raise type(e)(text) from None


def draft_candidates(parent: Path, stores: ModelStores, warn: Callable[[str], None]) -> list[Found]:
    """The GGUFs found (`found`) that could draft for the parent file `parent`: whole files (not a split model's
    part) of no more parameters than it, speaking its vocabulary token for token (family.vocab), not the parent's
    own file nor a copy of it; smallest first. family.siblings checks them again when one is added."""
    from specquant_cli.family.gguf_read import read_info
    from specquant_cli.family.vocab import read_vocab, vocab_difference
    from specquant_cli.fsutil import same_file

    try:
        mine, vocab = read_info(parent), read_vocab(parent)
        size = os.path.getsize(parent)
    except (SpecquantError, OSError):
        return []
    out = []
    for f in found(stores, warn):
        try:
            if same_file(f.path, parent) or f.size_bytes == size:
                continue
            info = read_info(f.path)
            if info.n_params <= mine.n_params and vocab_difference(vocab, read_vocab(f.path)) is None:
                out.append(f)
        except (SpecquantError, OSError):
            continue
    return sorted(out, key=lambda f: f.size_bytes)
