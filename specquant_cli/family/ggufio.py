"""Reading and checking GGUF files with `gguf`; making a base by dequantizing one (`dequantize_to_float`), an
F16 rendering of a BF16 file when, and only when, it is exact (`f16_of_bf16`), and a smaller network of the same
vocabulary by keeping some of a file's blocks (`cut_layers`).

What a file is checked for before it is taken: a whole GGUF (`read_info`: header, metadata, tensor extents; a part
of a split model named as the part it is, with the merge command), of the type its header claims (`type_problem`:
the weights bear out general.file_type), its hyperparameters read from its own header (`read_hparams`).

Why one file of ~700 lines: every reader here walks the same format (gguf's parser, the bounds-checked cursor, the
walks that skip values undecoded), and the writers copy what those readers read; kept together, an offset or a type
code is defined once and each reader can be read against the others."""

from __future__ import annotations

import hashlib
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from specquant_cli.errors import ModelFileError
from specquant_cli.fsutil import input_problem

GGUF_MAGIC = b"GGUF"
FLOAT_TYPES = {"F32", "F16", "BF16"}
PROVENANCE_KEY = "specquant.provenance"
# llama_ftype values for float files (llama.h): ALL_F32 = 0, MOSTLY_F16 = 1, MOSTLY_BF16 = 32.
FTYPE_MOSTLY_F16 = 1
FTYPE_MOSTLY_BF16 = 32


@dataclass
class GGUFInfo:
    path: Path
    arch: str
    name: str
    n_params: int
    tensor_types: dict[str, int]  # type name -> count of 2-D+ tensors
    weight_elements: dict[str, int]  # type name -> weights held in 2-D+ tensors of that type
    weight_type: str  # most common type among 2-D+ tensors
    file_type: str  # general.file_type as llama.cpp names it (Q4_K_M, F16, ...), "" when absent
    hparams: dict[str, int] = field(default_factory=dict)
    provenance: Optional[str] = None
    chat_template: Optional[str] = None
    vocab_sha256: Optional[str] = None  # fingerprint of tokenizer.ggml.tokens: variants of a family share it
    split: tuple[int, int] = (0, 1)  # (split.no, split.count): a model llama-gguf-split cut into several files
    # type name -> weights held in the blocks' (blk.*) 2-D+ tensors whose rows fit a quantized block (a multiple of
    # 32): what a file type writes its main tensors as (token_embd and output are kept at more bits by every type,
    # and a row no block fits is F16 under every type)
    block_elements: dict[str, int] = field(default_factory=dict)

    @property
    def is_float(self) -> bool:
        return set(self.tensor_types) <= FLOAT_TYPES


def _reader(path: Path):
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


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:
        return None


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
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
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string().decode("utf-8", "replace")
        if vtype != _ARRAY:
            raise ModelFileError(f"{self.path}: truncated or corrupt GGUF (metadata {key!r} has type {vtype})")
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if etype in _SCALARS:
            fmt = _SCALARS[etype]
            raw = self.take(struct.calcsize(fmt) * count)
            return list(struct.unpack(f"<{count}{fmt[1:]}", raw)) if key in self.keep else None
        if etype != _STRING:
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


# The tensor type each general.file_type is made of (its other tensors: more bits, or a fallback of more bits where
# a row does not fit the type's block): what the weights must mostly be for the header's claim to hold.
_MAIN_TYPE = {"Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K", "Q5_K_M": "Q5_K", "Q5_K_S": "Q5_K", "Q3_K_M": "Q3_K",
              "Q3_K_S": "Q3_K", "Q3_K_L": "Q3_K", "Q2_K_S": "Q2_K", "F32": "F32"}
TYPE_SLACK = 0.9  # a file's weights may average this share of its claimed type's bits (no fallback ever has fewer)


def type_bits(name: str) -> Optional[float]:
    """Bits per weight of a ggml tensor type (Q8_0: 8.5), None for one gguf does not know."""
    import gguf

    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    except KeyError:
        return None
    return size * 8 / block


def weight_bits(info: GGUFInfo) -> Optional[float]:
    """The mean bits per weight of the file's 2-D+ tensors, by what their types store (None: none known)."""
    known = {t: n for t, n in info.weight_elements.items() if type_bits(t) is not None}
    total = sum(known.values())
    return sum(type_bits(t) * n for t, n in known.items()) / total if total else None


def claimed_bits(file_type: str) -> Optional[float]:
    """Bits per weight of the tensor type a general.file_type is mostly made of (Q4_K_M: Q4_K's 4.5)."""
    return type_bits(_MAIN_TYPE.get(file_type, file_type)) if file_type else None


def type_problem(info: GGUFInfo) -> Optional[str]:
    """Why the header's claimed type (general.file_type) is not what the file's weights are, else None: weights of
    fewer bits than that type ever stores, or blocks mostly of more bits than it ever writes them in (`_more_bits`;
    a header edited, or written by a tool that got it wrong). A type the header does not name, or a claim gguf
    cannot price, is no problem here."""
    want, got = claimed_bits(info.file_type), weight_bits(info)
    if want is None or got is None:
        return None
    if got < want * TYPE_SLACK:
        most = max(info.weight_elements, key=info.weight_elements.get)
        return (f"{info.path}: its header says {info.file_type} (general.file_type), but its weights are mostly "
                f"{most} ({got:.2f} bits per weight on average, {info.file_type} stores {want:.2f}): the header does "
                "not describe the file; refusing to record it as what it is not")
    return _more_bits(info)


# Where a tensor's rows do not fit a type's block, llama.cpp's quantizer writes it in this type instead
# (llama_tensor_get_type's fallback; F16 where no quantized block fits: left out of GGUFInfo.block_elements).
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0",
             **dict.fromkeys(("Q2_K", "Q3_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S",
                              "IQ1_M"), "IQ4_NL")}


def _more_bits(info: GGUFInfo) -> Optional[str]:
    """Why the file's blocks are mostly of a type of more bits than its claimed type writes them in (its main type,
    or that type's fallback), else None: a header saying Q4_K_M over Q8_0 weights would have the parent recorded,
    priced and drafted for as the smaller file it is not. Only the blocks' weights count: every type keeps
    token_embd and output, and some of a block's tensors (attn_v, ffn_down), at more bits, but never most of them."""
    main = _MAIN_TYPE.get(info.file_type, info.file_type)
    most_bits = max(type_bits(main) or 0.0, type_bits(_FALLBACK.get(main, main)) or 0.0)
    if not info.block_elements or not most_bits:
        return None
    most = max(info.block_elements, key=info.block_elements.get)
    got = type_bits(most)
    if got is None or got <= most_bits:
        return None
    return (f"{info.path}: its header says {info.file_type} (general.file_type), but its weights are mostly {most} "
            f"({got:.2f} bits per weight; {info.file_type} writes a model's blocks in {most_bits:.2f} at most): the "
            "header does not describe the file; refusing to record it as what it is not")


def ftype_name(ft) -> str:
    """A general.file_type value as llama.cpp names it (Q4_K_M, F16, ...); "" when absent, `unknown (N)` for a value
    llama.cpp does not name."""
    import gguf

    if not isinstance(ft, int) or isinstance(ft, bool):
        return ""
    try:
        return gguf.LlamaFileType(ft).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"unknown ({ft})"


_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SCALAR_BYTES = {t: struct.calcsize(f) for t, f in _SCALARS.items()}
FILE_TYPE_KEY = b"general.file_type"


def _skip_value(buf, pos: int, vtype: int) -> int:
    """The offset after a metadata value at `pos`, without decoding it (struct.error past the end)."""
    if vtype in _SCALAR_BYTES:
        return pos + _SCALAR_BYTES[vtype]
    if vtype == _STRING:
        return pos + 8 + _U64.unpack_from(buf, pos)[0]
    if vtype != _ARRAY:
        raise ValueError(f"metadata value of type {vtype}")
    etype, count = _U32.unpack_from(buf, pos)[0], _U64.unpack_from(buf, pos + 4)[0]
    pos += 12
    if etype in _SCALAR_BYTES:
        return pos + _SCALAR_BYTES[etype] * count
    if etype != _STRING:
        raise ValueError(f"array of type {etype}")
    if count * 8 > len(buf) - pos:  # each string takes 8 bytes at least
        raise ValueError("array past the end")
    unpack = _U64.unpack_from
    for _ in range(count):
        pos += unpack(buf, pos)[0] + 8
    return pos


def read_file_type(path: Path) -> str:
    """general.file_type of a GGUF whose header_problem() is None, as ftype_name() names it ("" when absent):
    the metadata is walked only up to that key, values skipped undecoded (a few ms for a 49k-token vocabulary).
    ModelFileError when the metadata runs past the end of the file."""
    return _walked(Path(path), _file_types, _walk_to_file_type)


_file_types: dict[tuple, str] = {}  # (dev, inode, size, mtime, ctime) -> file type: a file read once per process


def _walked(path: Path, cache: dict, walk):
    """`walk(buf)` of the GGUF at `path` mapped, once per file state ((dev, inode, size, mtime, ctime) -> result in
    `cache`, at most 64 kept). ModelFileError when the file cannot be read or its metadata runs past its end."""
    import mmap

    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if ident not in cache:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                    if len(cache) >= 64:
                        cache.clear()
                    cache[ident] = walk(buf)
            return cache[ident]
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read it ({e.strerror})") from None
    except (struct.error, ValueError):
        raise ModelFileError(f"{path}: truncated or corrupt GGUF (metadata runs past the end of the file)") from None

# The hyperparameters a family records of each network (GGUFInfo.hparams, Family.hparams_of): `<arch>.<key>`.
HPARAM_KEYS = ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv", "context_length",
               "attention.key_length", "attention.value_length")
_ARCH_KEY = b"general.architecture"


def read_hparams(path: Path) -> dict[str, int]:
    """The hyperparameters of the GGUF at `path` (HPARAM_KEYS, as read_info gives them), read from its header: the
    metadata walked with values skipped undecoded, as read_file_type does (milliseconds for a 150k-token
    vocabulary), once per file state. What memory estimates size a KV cache from: the file's own header, never a
    manifest's copy. ModelFileError when the file cannot be read or its metadata runs past its end."""
    path = Path(path)
    why = input_problem(path, "GGUF file") or header_problem(path)
    if why:
        raise ModelFileError(f"{path}: {why}")
    return dict(_walked(path, _hparams, _walk_hparams))


_hparams: dict[tuple, dict[str, int]] = {}


def _walk_hparams(buf) -> dict[str, int]:
    n_kv, pos = _U64.unpack_from(buf, 16)[0], 24
    arch, ints = None, {}
    for _ in range(n_kv):
        n = _U64.unpack_from(buf, pos)[0]
        key, pos = bytes(buf[pos + 8:pos + 8 + n]), pos + 8 + n
        vtype, pos = _U32.unpack_from(buf, pos)[0], pos + 4
        if key == _ARCH_KEY and vtype == _STRING:
            size = _U64.unpack_from(buf, pos)[0]
            arch = bytes(buf[pos + 8:pos + 8 + size]).decode("utf-8", "replace")
        elif vtype in (0, 2, 4, 10, 1, 3, 5, 11) and b"." in key:  # an integer scalar
            ints[key.decode("utf-8", "replace")] = struct.unpack_from(_SCALARS[vtype], buf, pos)[0]
        pos = _skip_value(buf, pos, vtype)
        if pos > len(buf):
            raise ValueError("past the end")
    if arch is None:
        return {}
    return {k: ints[f"{arch}.{k}"] for k in HPARAM_KEYS if f"{arch}.{k}" in ints}


def _walk_to_file_type(buf) -> str:
    n_kv, pos = _U64.unpack_from(buf, 16)[0], 24
    for _ in range(n_kv):
        n = _U64.unpack_from(buf, pos)[0]
        key, pos = buf[pos + 8:pos + 8 + n], pos + 8 + n
        vtype, pos = _U32.unpack_from(buf, pos)[0], pos + 4
        if key == FILE_TYPE_KEY and vtype in (4, 5):  # uint32 / int32
            return ftype_name(struct.unpack_from(_SCALARS[vtype], buf, pos)[0])
        pos = _skip_value(buf, pos, vtype)
        if pos > len(buf):
            raise ValueError("past the end")
    return ""


def kv_cache_bytes(hparams: dict[str, int], n_ctx: int, bytes_per_elem: int = 2) -> int:
    """K and V caches for n_ctx positions (f16 by default), from the GGUF's hyperparameters."""
    n_layer = hparams.get("block_count", 0)
    n_head = max(1, hparams.get("attention.head_count", 1))
    n_kv = hparams.get("attention.head_count_kv", n_head)
    head_dim = hparams.get("attention.key_length") or hparams.get("embedding_length", 0) // n_head
    return 2 * n_layer * n_ctx * n_kv * head_dim * bytes_per_elem


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to BF16 (to nearest, ties to even), as their uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) as float32 values (exact)."""
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def on_both_grids(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to F16's grid, then BF16's: every result is exactly representable in both
    formats (an F16 value rounded to 8 significant bits stays on F16's grid), so a BF16 file of them has an
    exact F16 rendering. Returns BF16 bit patterns."""
    return bf16_bits(np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32))


def _is_weight(t) -> bool:
    """A tensor written at 16 bits (2-D and up); 1-D tensors (norms, biases) stay F32."""
    return not (len(t.shape) == 1 or int(np.prod(t.shape[1:])) == 1)


def _copy_metadata(reader, writer, ftype: int, provenance: str) -> None:
    import gguf

    skip = {"general.architecture", "general.file_type", "general.quantization_version", PROVENANCE_KEY}
    for f in reader.fields.values():
        if f.name in skip or f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    writer.add_file_type(ftype)
    writer.add_string(PROVENANCE_KEY, provenance)


def dequantize_to_float(src: Path, dst: Path, provenance: str, rendering: str = "f16",
                        progress: Optional[Callable[[int, int], None]] = None) -> None:
    """Write `dst` as an F16 (`rendering` "f16") or BF16 ("bf16") GGUF of `src`'s dequantized weights, with all
    of its metadata; 1-D tensors (norms, biases) stay F32. A BF16 rendering holds each weight rounded to F16's
    grid, then BF16's (`on_both_grids`), so `f16_of_bf16` makes an exact F16 copy of it: both renderings hold
    the same weights.

    Streams tensor by tensor, so memory holds one dequantized tensor at a time.
    The caller owns atomicity (pass a temporary `dst`)."""
    import gguf

    if rendering not in ("f16", "bf16"):
        raise ValueError(f"rendering {rendering!r}: f16 or bf16")
    reader = _reader(src)
    writer = gguf.GGUFWriter(os.fspath(dst), _field(reader, "general.architecture"))
    _copy_metadata(reader, writer, FTYPE_MOSTLY_F16 if rendering == "f16" else FTYPE_MOSTLY_BF16, provenance)
    plan = []
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy order
        weight = _is_weight(t)
        dtype = np.dtype(np.float32 if not weight else np.float16 if rendering == "f16" else np.uint16)
        raw = gguf.GGMLQuantizationType.BF16 if weight and rendering == "bf16" else None
        nbytes = int(np.prod(shape)) * dtype.itemsize
        writer.add_tensor_info(t.name, shape, dtype, nbytes, raw_dtype=raw)
        plan.append((t, shape, weight, nbytes))
    total = sum(p[3] for p in plan)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    done = 0
    for t, shape, weight, nbytes in plan:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        if not weight:
            out = arr.astype(np.float32, copy=False)
        elif rendering == "f16":
            out = arr.astype(np.float16)
        else:
            out = on_both_grids(arr)
        writer.write_tensor_data(np.ascontiguousarray(out))
        done += nbytes
        if progress:
            progress(done, total)
    writer.close()


class NotExact(ModelFileError):
    """A BF16 file whose F16 rendering would round some weights (out of F16's range or below its precision)."""


def f16_of_bf16(src: Path, dst: Path, provenance: str,
                progress: Optional[Callable[[int, int], None]] = None) -> None:
    """Write `dst` as the F16 rendering of the BF16 file `src`: every BF16 tensor widened and narrowed to F16,
    checked value by value to come back to the same BF16 number (NaN stays NaN); other tensors copied as they
    are. NotExact, naming the first tensor that does not come back and how many of its values, when the
    rendering would not be exact: then no F16 rendering is made. The caller owns atomicity."""
    import gguf

    reader = _reader(src)
    writer = gguf.GGUFWriter(os.fspath(dst), _field(reader, "general.architecture"))
    _copy_metadata(reader, writer, FTYPE_MOSTLY_F16, provenance)
    bf16 = gguf.GGMLQuantizationType.BF16
    plan = []
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        if t.tensor_type == bf16:
            writer.add_tensor_info(t.name, shape, np.dtype(np.float16), int(np.prod(shape)) * 2)
        else:
            data = np.asarray(t.data)
            writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes,
                                   raw_dtype=None if data.dtype in (np.float32, np.float16) else t.tensor_type)
        plan.append(t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total, done = sum(int(t.n_bytes) for t in plan), 0
    with np.errstate(over="ignore"):
        for t in plan:
            if t.tensor_type == bf16:
                values = bf16_values(np.asarray(t.data).reshape(-1).view(np.uint16))
                half = values.astype(np.float16)
                back = half.astype(np.float32)
                bad = ~((back == values) | (np.isnan(back) & np.isnan(values)))
                if bad.any():
                    raise NotExact(f"{src}: tensor {t.name}: {int(bad.sum())} of {values.size} weights are outside "
                                   f"F16's range or precision (e.g. {float(values[bad][0]):.6g})")
                writer.write_tensor_data(half.reshape(tuple(int(x) for x in reversed(t.shape))))
            else:
                writer.write_tensor_data(np.asarray(t.data))
            done += int(t.n_bytes)
            if progress:
                progress(done, total)  # bytes of the source read, as the other steps report bytes
    writer.close()


_BLOCK = re.compile(r"blk\.(\d+)\.")


def cut_layers(src: Path, dst: Path, keep: tuple[int, ...], provenance: str) -> None:
    """Write `dst` as `src` with only the blocks `keep` (in that order, renumbered from 0), every other tensor and
    all metadata as they are (block_count set to len(keep)), tensors copied byte for byte in their own types: a
    smaller network of the same vocabulary, embeddings and head. The caller owns atomicity."""
    import gguf

    reader = _reader(src)
    arch = _field(reader, "general.architecture")
    n_blocks = _field(reader, f"{arch}.block_count")
    if not keep or len(set(keep)) != len(keep) or not all(0 <= i < (n_blocks or 0) for i in keep):
        raise ModelFileError(f"{src}: cannot keep blocks {list(keep)} of its {n_blocks}")
    new_index = {old: new for new, old in enumerate(keep)}
    writer = gguf.GGUFWriter(os.fspath(dst), arch)
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", f"{arch}.block_count", PROVENANCE_KEY):
            continue
        vtype = f.types[0]
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY
                             else None)
    writer.add_block_count(len(keep))
    writer.add_string(PROVENANCE_KEY, provenance)
    kept = []
    for t in reader.tensors:
        m = _BLOCK.match(t.name)
        if m and int(m.group(1)) not in new_index:
            continue
        name = f"blk.{new_index[int(m.group(1))]}.{t.name[m.end():]}" if m else t.name
        data = np.asarray(t.data)
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes,
                               raw_dtype=None if data.dtype in (np.float32, np.float16) else t.tensor_type)
        kept.append(data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in kept:
        writer.write_tensor_data(data)
    writer.close()
