"""Model stores laid out as their tools lay them out, built by the tests from a GGUF of their own: ollama's
(manifests/registry.ollama.ai/library/NAME/TAG naming its layers by digest, blobs/sha256-<hex>), the Hugging Face
cache (models--OWNER--REPO/blobs, snapshots/<commit>/FILE as relative symbolic links to the blobs, refs/main) and
LM Studio's folder (PUBLISHER/REPO/FILE.gguf)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

MODEL = "application/vnd.ollama.image.model"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def place(src: Path, dst: Path) -> Path:
    """dst holding src's content: a hard link where the filesystem allows (the tests' GGUFs are 100+ MB)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


def ollama_model(root: Path, name: str, tag: str, gguf: Path, layers=None, digest=None) -> Path:
    """Add NAME:TAG to the ollama store at root: the GGUF as the model layer's blob, a template and params layer
    beside it; `layers` replaces the layer list, `digest` the model layer's recorded digest. Returns the blob."""
    hexdigest = sha256(gguf)
    blob = root / "blobs" / f"sha256-{hexdigest}"
    if not blob.exists():
        place(gguf, blob)
    template = b"{{ .Prompt }}"
    th = hashlib.sha256(template).hexdigest()
    (root / "blobs" / f"sha256-{th}").write_bytes(template)
    if layers is None:
        layers = [{"mediaType": MODEL, "digest": f"sha256:{digest or hexdigest}", "size": gguf.stat().st_size},
                  {"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{th}",
                   "size": len(template)}]
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": f"sha256:{th}",
                           "size": len(template)},
                "layers": layers}
    path = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return blob


def hf_repo(cache: Path, repo: str, files: dict[str, Path], commit: str = "a" * 40) -> Path:
    """Add the repository `repo` at `commit` (refs/main) to the Hugging Face cache at `cache`, holding `files`
    (name in the repository -> a local file): each a blob named by its sha256, linked from the snapshot."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snap = folder / "snapshots" / commit
    for name, src in files.items():
        blob = folder / "blobs" / sha256(src)
        if not blob.exists():
            place(src, blob)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    return snap


def lmstudio_model(root: Path, publisher: str, repo: str, name: str, gguf: Path) -> Path:
    return place(gguf, root / publisher / repo / name)


def split_gguf(src: Path, folder: Path, stem: str, count: int = 2) -> list[Path]:
    """src cut into `count` parts as llama-gguf-split cuts it: the metadata and split keys in the first part, the
    split keys in every part, the tensors shared out in order."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src), "r")
    arch = reader.fields["general.architecture"].contents()
    tensors = list(reader.tensors)
    share = -(-len(tensors) // count)
    paths = []
    for i in range(count):
        path = folder / f"{stem}-{i + 1:05d}-of-{count:05d}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        if i == 0:
            for f in reader.fields.values():
                if f.name.startswith("GGUF.") or f.name == "general.architecture":
                    continue
                vt = f.types[0]
                w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY
                                else None)
        w.add_uint16("split.no", i)
        w.add_uint16("split.count", count)
        w.add_int32("split.tensors.count", len(tensors))
        mine = tensors[i * share:(i + 1) * share]
        for t in mine:
            data = np.asarray(t.data)
            w.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes,
                              raw_dtype=None if data.dtype in (np.float32, np.float16) else t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in mine:
            w.write_tensor_data(np.asarray(t.data))
        w.close()
        paths.append(path)
    return paths
