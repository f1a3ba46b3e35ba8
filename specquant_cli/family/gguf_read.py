"""A GGUF file read and checked before it is taken: gguf's parser behind a bounds-checked cursor over the header
(`read_metadata`), a whole file's metadata and tensor extents (`read_info`, `GGUFInfo`), and a part of a split model
named as the part it is, with the merge command (`split_problem`)."""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from specquant_cli.errors import ModelFileError
from specquant_cli.family.gguf_types import (
    ARRAY_TYPE,
    GGUF_MAGIC,
    HPARAM_KEYS,
    PROVENANCE_KEY,
    SCALAR_FORMATS,
    STRING_TYPE,
    GGUFInfo,
    ftype_name,
)
from specquant_cli.fsutil import input_problem


def open_reader(path: Path):
    import gguf

    path = Path(path)
    why = input_problem(path, "GGUF file")
    if why:
        raise ModelFileError(f"{path}: {why}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read it ({e.strerror})") from None
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    problem = header_problem(path)
    if problem:
        raise ModelFileError(f"{path}: truncated or corrupt GGUF ({problem})")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on corrupt headers
        raise ModelFileError(f"{path}: truncated or corrupt GGUF, gguf cannot parse it "
                             f"({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size or not reader.tensors:
        raise ModelFileError(f"{path}: truncated GGUF (tensor data ends at byte {end}, file has {size})")
    return reader


def header_problem(path: Path) -> Optional[str]:
    """A cheap check of a GGUF header (magic, version, counts): the reason it is not a GGUF, else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError as e:
        return f"cannot read it ({e.strerror})"
    if head[:4] != GGUF_MAGIC:
        return f"not a GGUF file (magic {head[:4]!r})"
    if len(head) < 24:
        return "truncated GGUF header"
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if version not in (2, 3):
        return f"unsupported GGUF version {version}"
    if not 0 < n_tensors < 1 << 20 or n_kv >= 1 << 20:
        return f"implausible GGUF header ({n_tensors} tensors, {n_kv} metadata keys)"
    return None


def field_value(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:
        return None
MAX_METADATA_BYTES = 1 << 30


@dataclass
class _Tensor:
    name: str
    shape: tuple[int, ...]  # as stored: ne0 first
    type_id: int
    offset: int


@dataclass
class _Header:
    kv: dict  # key -> scalar or str; arrays of strings -> their sha256 (a fingerprint), other arrays -> None
    tensors: list[_Tensor]
    data_start: int


class _Cursor:
    """Bounds-checked reads over a GGUF's header (a hostile file cannot make it read past the end). Arrays are
    skipped (strings fingerprinted), except those of the keys in `keep`: returned whole (strings as bytes)."""

    def __init__(self, buf, path: Path, keep: frozenset[str] = frozenset()):
        self.buf, self.pos, self.path, self.keep = buf, 0, path, keep

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf) or self.pos + n > MAX_METADATA_BYTES:
            raise ModelFileError(f"{self.path}: truncated or corrupt GGUF (metadata runs past the end of the file)")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        return self.take(self.scalar("<Q"))

    def value(self, vtype: int, key: str):
        if vtype in SCALAR_FORMATS:
            return self.scalar(SCALAR_FORMATS[vtype])
        if vtype == STRING_TYPE:
            return self.string().decode("utf-8", "replace")
        if vtype != ARRAY_TYPE:
            raise ModelFileError(f"{self.path}: truncated or corrupt GGUF (metadata {key!r} has type {vtype})")
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if etype in SCALAR_FORMATS:
            fmt = SCALAR_FORMATS[etype]
            raw = self.take(struct.calcsize(fmt) * count)
            return list(struct.unpack(f"<{count}{fmt[1:]}", raw)) if key in self.keep else None
        if etype != STRING_TYPE:
            raise ModelFileError(f"{self.path}: truncated or corrupt GGUF (array {key!r} of type {etype})")
        if key in self.keep:
            if count * 8 > len(self.buf) - self.pos:  # each string takes 8 bytes at least
                raise ModelFileError(f"{self.path}: truncated or corrupt GGUF (array {key!r} runs past the end)")
            return [self.string() for _ in range(count)]
        h = hashlib.sha256()
        for _ in range(count):
            h.update(self.string())
            h.update(b"\0")
        return h.hexdigest()


def _parse_header(path: Path, keep: frozenset[str] = frozenset()) -> tuple[_Header, int]:
    """GGUF metadata and tensor infos without reading tensor data: (header, file size). Fast even for a
    vocabulary of 150k tokens, where `gguf.GGUFReader` takes seconds. The arrays of the keys in `keep` are read
    whole (_Cursor)."""
    import mmap

    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf, path, keep)
        c.take(4)
        _, n_tensors, n_kv = struct.unpack("<IQQ", c.take(20))
        kv = {}
        for _ in range(n_kv):
            key = c.string().decode("utf-8", "replace")
            kv[key] = c.value(c.scalar("<I"), key)
        tensors = []
        for _ in range(n_tensors):
            name = c.string().decode("utf-8", "replace")
            n_dims = c.scalar("<I")
            if n_dims > 8:
                raise ModelFileError(f"{path}: truncated or corrupt GGUF (tensor {name!r} has {n_dims} dimensions)")
            shape = tuple(c.scalar("<Q") for _ in range(n_dims))
            tensors.append(_Tensor(name, shape, c.scalar("<I"), c.scalar("<Q")))
        align = kv.get("general.alignment", 32)
        align = align if isinstance(align, int) and align > 0 else 32
        data_start = -(-c.pos // align) * align
    return _Header(kv, tensors, data_start), size


def read_metadata(path: Path, keep: frozenset[str] = frozenset()) -> dict:
    """A GGUF's metadata (key -> value; the arrays of `keep` whole, other arrays fingerprinted or None), its header
    checked first; ModelFileError (one line) on anything wrong."""
    path = Path(path)
    problem = header_problem(path)
    if problem:
        raise ModelFileError(f"{path}: {problem}")
    try:
        return _parse_header(path, keep)[0].kv
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read it ({e.strerror})") from None


def read_info(path: Path) -> GGUFInfo:
    """Parse and check a GGUF file's header (magic, version, metadata, tensor infos, tensor data within the
    file); raise ModelFileError with one line on anything wrong. Reads no tensor data."""
    import gguf

    path = Path(path)
    why = input_problem(path, "GGUF file")
    if why:
        raise ModelFileError(f"{path}: {why}")
    problem = header_problem(path)
    if problem and problem.startswith(("not a GGUF", "cannot read")):
        raise ModelFileError(f"{path}: {problem}" + (", expected b'GGUF'" if problem.startswith("not") else ""))
    if problem:
        split = _split_part(path)  # a split's metadata-only part holds no tensor: named as the part it is
        raise ModelFileError(split or f"{path}: truncated or corrupt GGUF ({problem})")
    try:
        header, size = _parse_header(path)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read it ({e.strerror})") from None
    kv = header.kv
    split = _split_message(path, _count(kv.get("split.no"), 0), _count(kv.get("split.count"), 1))
    if split:  # before anything else: a part after the first holds no architecture, no vocabulary
        raise ModelFileError(split)
    arch = kv.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: no general.architecture in GGUF metadata")
    if arch not in set(gguf.MODEL_ARCH_NAMES.values()):
        raise ModelFileError(f"{path}: architecture {arch!r} is not one llama.cpp knows")
    types: dict[str, int] = {}
    elements: dict[str, int] = {}
    blocks: dict[str, int] = {}
    n_params, end = 0, 0
    for t in header.tensors:
        try:
            qtype = gguf.GGMLQuantizationType(t.type_id)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelFileError(f"{path}: truncated or corrupt GGUF (tensor {t.name!r} has unknown type "
                                 f"{t.type_id})") from None
        n = int(np.prod(t.shape, dtype=object)) if t.shape else 1
        n_params += n
        end = max(end, header.data_start + t.offset + n // block * type_size)
        if len(t.shape) >= 2 and int(np.prod(t.shape[1:], dtype=object)) > 1:
            types[qtype.name] = types.get(qtype.name, 0) + 1
            elements[qtype.name] = elements.get(qtype.name, 0) + n
            if t.name.startswith("blk.") and t.shape[0] % 32 == 0:
                blocks[qtype.name] = blocks.get(qtype.name, 0) + n
    if end > size or not header.tensors:
        raise ModelFileError(f"{path}: truncated GGUF (tensor data ends at byte {end}, file has {size})")
    weight_type = max(types, key=types.get) if types else "F32"
    file_type = ftype_name(kv.get("general.file_type"))
    hp = {}
    for k in HPARAM_KEYS:
        v = kv.get(f"{arch}.{k}")
        if isinstance(v, int) and not isinstance(v, bool):
            hp[k] = v

    def text(key: str) -> Optional[str]:
        v = kv.get(key)
        return v if isinstance(v, str) else None

    return GGUFInfo(
        path=path, arch=arch, name=text("general.name") or path.stem,
        n_params=n_params, tensor_types=types, weight_elements=elements, weight_type=weight_type,
        file_type=file_type, hparams=hp,
        provenance=text(PROVENANCE_KEY), chat_template=text("tokenizer.chat_template"),
        vocab_sha256=kv.get("tokenizer.ggml.tokens") if isinstance(kv.get("tokenizer.ggml.tokens"), str) else None,
        split=(_count(kv.get("split.no"), 0), _count(kv.get("split.count"), 1)), block_elements=blocks,
    )


def _count(v, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default


def split_problem(info: GGUFInfo) -> Optional[str]:
    """Why a GGUF cut into parts (llama-gguf-split) is not taken as one model file, else None."""
    return _split_message(info.path, *info.split)


_PART_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def _split_message(path: Path, no: int, count: int) -> Optional[str]:
    """The one line for part `no` (from 0) of a model split into `count` files: what it is and how to merge it (the
    merge starts from the first part: named after llama-gguf-split's own `-00001-of-0000N.gguf`)."""
    if count <= 1:
        return None
    first = Path(path)
    m = _PART_RE.search(first.name)
    if m:
        first = first.with_name(first.name[:m.start(1)] + f"{1:05d}" + first.name[m.end(1):])
    elif no:
        first = first.with_name("FIRST-PART.gguf")
    return (f"{path}: part {no + 1} of a model split into {count} files (llama-gguf-split); merge them into one "
            f"file first: llama-gguf-split --merge {first} merged.gguf")


def _split_part(path: Path) -> Optional[str]:
    """_split_message of a file whose header holds no tensor (a split's metadata-only part), else None."""
    try:
        header, _ = _parse_header(path)
    except (OSError, ModelFileError, struct.error, ValueError):
        return None
    kv = header.kv
    return _split_message(path, _count(kv.get("split.no"), 0), _count(kv.get("split.count"), 1))
