"""Reading and checking GGUF files with `gguf`; making a base by dequantizing one (`dequantize_to_float`) and
an F16 rendering of a BF16 file when, and only when, it is exact (`f16_of_bf16`)."""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from specquant_cli.errors import ModelFileError

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
    weight_type: str  # most common type among 2-D+ tensors
    file_type: str  # general.file_type as llama.cpp names it (Q4_K_M, F16, ...), "" when absent
    hparams: dict[str, int] = field(default_factory=dict)
    provenance: Optional[str] = None
    chat_template: Optional[str] = None
    vocab_sha256: Optional[str] = None  # fingerprint of tokenizer.ggml.tokens: variants of a family share it
    split: tuple[int, int] = (0, 1)  # (split.no, split.count): a model llama-gguf-split cut into several files

    @property
    def is_float(self) -> bool:
        return set(self.tensor_types) <= FLOAT_TYPES


def _reader(path: Path):
    import gguf

    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if not path.is_file():
        raise ModelFileError(f"{path}: not a file")
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
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if not path.is_file():
        raise ModelFileError(f"{path}: not a file")
    problem = header_problem(path)
    if problem and problem.startswith(("not a GGUF", "cannot read")):
        raise ModelFileError(f"{path}: {problem}" + (", expected b'GGUF'" if problem.startswith("not") else ""))
    if problem:
        raise ModelFileError(f"{path}: truncated or corrupt GGUF ({problem})")
    try:
        header, size = _parse_header(path)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read it ({e.strerror})") from None
    kv = header.kv
    arch = kv.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: no general.architecture in GGUF metadata")
    if arch not in set(gguf.MODEL_ARCH_NAMES.values()):
        raise ModelFileError(f"{path}: architecture {arch!r} is not one llama.cpp knows")
    types: dict[str, int] = {}
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
    if end > size or not header.tensors:
        raise ModelFileError(f"{path}: truncated GGUF (tensor data ends at byte {end}, file has {size})")
    weight_type = max(types, key=types.get) if types else "F32"
    file_type = ftype_name(kv.get("general.file_type"))
    hp = {}
    for k in ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
              "context_length", "attention.key_length", "attention.value_length"):
        v = kv.get(f"{arch}.{k}")
        if isinstance(v, int) and not isinstance(v, bool):
            hp[k] = v

    def text(key: str) -> Optional[str]:
        v = kv.get(key)
        return v if isinstance(v, str) else None

    return GGUFInfo(
        path=path, arch=arch, name=text("general.name") or path.stem,
        n_params=n_params, tensor_types=types, weight_type=weight_type, file_type=file_type, hparams=hp,
        provenance=text(PROVENANCE_KEY), chat_template=text("tokenizer.chat_template"),
        vocab_sha256=kv.get("tokenizer.ggml.tokens") if isinstance(kv.get("tokenizer.ggml.tokens"), str) else None,
        split=(_count(kv.get("split.no"), 0), _count(kv.get("split.count"), 1)),
    )


def _count(v, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else default


def split_problem(info: GGUFInfo) -> Optional[str]:
    """Why a GGUF cut into parts (llama-gguf-split) is not taken as one model file, else None."""
    no, count = info.split
    if count <= 1:
        return None
    return (f"{info.path}: part {no + 1} of a model split into {count} files (llama-gguf-split); merge them into one "
            f"file first: llama-gguf-split --merge {info.path} merged.gguf")


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
    import mmap

    path = Path(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if ident not in _file_types:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                    if len(_file_types) >= 64:
                        _file_types.clear()
                    _file_types[ident] = _walk_to_file_type(buf)
            return _file_types[ident]
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read it ({e.strerror})") from None
    except (struct.error, ValueError):
        raise ModelFileError(f"{path}: truncated or corrupt GGUF (metadata runs past the end of the file)") from None


_file_types: dict[tuple, str] = {}  # (dev, inode, size, mtime, ctime) -> file type: a file read once per process


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
