"""`ollama:NAME[:TAG]`: the model layer of a tag in ollama's local store, read as ollama lays it out —
`manifests/registry.ollama.ai/library/NAME/TAG`, a JSON manifest whose layers name their media type and digest, and
`blobs/sha256-<hex>`, the layers' content. The model layer's blob is the GGUF; its sha256 is checked against the
digest (streamed) before it is used. A name with a namespace (`USER/NAME`) or a host (`HOST/USER/NAME`, e.g.
`hf.co/OWNER/REPO`) is found under that host and namespace. The store is only read."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from specquant_cli.errors import InputError
from specquant_cli.family.located import Found, Located, family_name, gguf_type
from specquant_cli.settings import ModelStores

REGISTRY = "registry.ollama.ai"
LIBRARY = "library"
DEFAULT_TAG = "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"
NAME_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
MANIFEST_LIMIT = 1 << 20  # a manifest is a few hundred bytes


def parse(text: str, rest: str) -> tuple[str, str, str, str]:
    """(host, namespace, name, tag) of `ollama:[[HOST/]NAMESPACE/]NAME[:TAG]`; InputError when malformed."""
    path, _, tag = rest.partition(":")
    parts = path.split("/") if path else []
    tag = tag or DEFAULT_TAG
    if not 1 <= len(parts) <= 3 or not all(NAME_PART.match(p) for p in [*parts, tag]):
        raise InputError(f"{text}: malformed ollama reference; write ollama:NAME or ollama:NAME:TAG "
                         "(e.g. ollama:llama3.2:1b)")
    host, ns = (REGISTRY, LIBRARY) if len(parts) == 1 else (REGISTRY, parts[0]) if len(parts) == 2 else parts[:2]
    return host, ns, parts[-1], tag


def reference(host: str, ns: str, name: str, tag: str) -> str:
    """The shortest reference of a manifest: library models by name, others with their namespace (and host)."""
    path = name if (host, ns) == (REGISTRY, LIBRARY) else f"{ns}/{name}" if host == REGISTRY else \
        f"{host}/{ns}/{name}"
    return f"ollama:{path}:{tag}"


def locate(text: str, rest: str, stores: ModelStores) -> Located:
    host, ns, name, tag = parse(text, rest)
    root = _store(text, stores)
    folder = root / "manifests" / host / ns / name
    manifest = folder / tag
    if not manifest.is_file():
        tags = sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
        if tags:
            raise InputError(f"{text}: ollama has no tag {tag} of {name} in {root}; its tags: {', '.join(tags)}")
        raise InputError(f"{text}: no model {name} in ollama's store {root}; pull it with ollama first "
                         f"(ollama pull {name}:{tag}), or see specquant list --found")
    blob, digest = model_blob(text, root, manifest)
    check_digest(text, blob, digest)
    ref = reference(host, ns, name, tag)
    return Located(ref, _family_name(name, tag), (blob,),
                   f"ollama {ref.removeprefix('ollama:')}: the model layer sha256:{digest} of {root}, used as it is")


def _store(text: str, stores: ModelStores) -> Path:
    root = stores.ollama
    if root is None or not (root / "manifests").is_dir():
        raise InputError(f"{text}: no ollama store at {root or '~/.ollama/models'} (set OLLAMA_MODELS to where "
                         "ollama keeps its models)")
    return root


def model_blob(text: str, root: Path, manifest: Path) -> tuple[Path, str]:
    """The model layer's blob and digest (hex) named by the manifest file; InputError when it names none, or is no
    manifest."""
    try:
        with open(manifest, "rb") as f:
            raw = f.read(MANIFEST_LIMIT + 1)
        data = json.loads(raw) if len(raw) <= MANIFEST_LIMIT else None
    except (OSError, ValueError, RecursionError) as e:
        raise InputError(f"{text}: its manifest {manifest} cannot be read ({getattr(e, 'strerror', None) or e})") \
            from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list):
        raise InputError(f"{text}: its manifest {manifest} is not an ollama manifest (no layers)")
    models = [x for x in layers if isinstance(x, dict) and x.get("mediaType") == MODEL_LAYER]
    if not models:
        kinds = sorted({str(x.get("mediaType")) for x in layers if isinstance(x, dict)})
        raise InputError(f"{text}: its manifest has no model layer ({MODEL_LAYER}); it holds "
                         f"{', '.join(kinds) or 'no layers'}")
    m = DIGEST.match(str(models[0].get("digest", "")))
    if not m:
        raise InputError(f"{text}: its model layer's digest {models[0].get('digest')!r} is not a sha256 digest")
    blob = root / "blobs" / f"sha256-{m[1]}"
    if not blob.is_file():
        raise InputError(f"{text}: the blob of its model layer is missing ({blob}); pull it again with ollama")
    return blob, m[1]


def check_digest(text: str, blob: Path, digest: str) -> None:
    """The blob's sha256 is the digest its manifest names (read in chunks: a model is gigabytes)."""
    h = hashlib.sha256()
    try:
        with open(blob, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    except OSError as e:
        raise InputError(f"{text}: its blob {blob} cannot be read ({e.strerror})") from None
    if h.hexdigest() != digest:
        raise InputError(f"{text}: digest mismatch: the blob {blob.name} holds sha256 {h.hexdigest()[:16]}…, its "
                         f"manifest names {digest[:16]}…; the store is damaged (pull it again with ollama)")


def _family_name(name: str, tag: str) -> str:
    return family_name(name if tag == DEFAULT_TAG else f"{name}-{tag}")


def found(stores: ModelStores, warn: Callable[[str], None]) -> list[Found]:
    """Every tag in the store whose manifest names a model layer whose blob is there (digests not read: that is
    `pull`'s check)."""
    root = stores.ollama
    if root is None or not (root / "manifests").is_dir():
        return []
    out = []
    for dirpath, _, files in os.walk(root / "manifests"):
        rel = Path(dirpath).relative_to(root / "manifests").parts
        if len(rel) != 3:
            continue
        for tag in sorted(files):
            ref = reference(*rel, tag)
            try:
                blob, _ = model_blob(ref, root, Path(dirpath) / tag)
            except InputError:
                continue
            out.append(Found(ref, blob, blob.stat().st_size, gguf_type(blob)))
    return sorted(out, key=lambda f: f.reference)
