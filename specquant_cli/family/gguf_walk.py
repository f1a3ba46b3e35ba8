"""Fast walks of a GGUF header that skip values undecoded, each file read once per process: its general.file_type
(`read_file_type`), its hyperparameters (`read_hparams`), and the KV cache they size (`kv_cache_bytes`)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from specquant_cli.errors import ModelFileError
from specquant_cli.family.gguf_read import header_problem
from specquant_cli.family.gguf_types import ARRAY_TYPE, HPARAM_KEYS, SCALAR_FORMATS, STRING_TYPE, ftype_name
from specquant_cli.fsutil import input_problem

_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SCALAR_BYTES = {t: struct.calcsize(f) for t, f in SCALAR_FORMATS.items()}
FILE_TYPE_KEY = b"general.file_type"


def _skip_value(buf, pos: int, vtype: int) -> int:
    """The offset after a metadata value at `pos`, without decoding it (struct.error past the end)."""
    if vtype in _SCALAR_BYTES:
        return pos + _SCALAR_BYTES[vtype]
    if vtype == STRING_TYPE:
        return pos + 8 + _U64.unpack_from(buf, pos)[0]
    if vtype != ARRAY_TYPE:
        raise ValueError(f"metadata value of type {vtype}")
    etype, count = _U32.unpack_from(buf, pos)[0], _U64.unpack_from(buf, pos + 4)[0]
    pos += 12
    if etype in _SCALAR_BYTES:
        return pos + _SCALAR_BYTES[etype] * count
    if etype != STRING_TYPE:
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
        if key == _ARCH_KEY and vtype == STRING_TYPE:
            size = _U64.unpack_from(buf, pos)[0]
            arch = bytes(buf[pos + 8:pos + 8 + size]).decode("utf-8", "replace")
        elif vtype in (0, 2, 4, 10, 1, 3, 5, 11) and b"." in key:  # an integer scalar
            ints[key.decode("utf-8", "replace")] = struct.unpack_from(SCALAR_FORMATS[vtype], buf, pos)[0]
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
            return ftype_name(struct.unpack_from(SCALAR_FORMATS[vtype], buf, pos)[0])
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
