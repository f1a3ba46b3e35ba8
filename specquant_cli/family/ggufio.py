"""Reading and checking GGUF files with `gguf`, and making an F16 base by dequantizing one."""

from __future__ import annotations

import os
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
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
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


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:
        return None


def read_info(path: Path) -> GGUFInfo:
    """Parse and check a GGUF file; raise ModelFileError with one line on anything wrong."""
    import gguf

    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: no general.architecture in GGUF metadata")
    known = set(gguf.MODEL_ARCH_NAMES.values())
    if arch not in known:
        raise ModelFileError(f"{path}: architecture {arch!r} is not one llama.cpp knows")
    types: dict[str, int] = {}
    n_params = 0
    for t in reader.tensors:
        n_params += int(t.n_elements)
        if len(t.shape) >= 2 and int(np.prod(t.shape[1:])) > 1:
            name = t.tensor_type.name
            types[name] = types.get(name, 0) + 1
    weight_type = max(types, key=types.get) if types else "F32"
    ft = _field(reader, "general.file_type")
    try:
        name = gguf.LlamaFileType(int(ft)).name if ft is not None else ""
        file_type = name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        file_type = ""
    hp = {}
    for k in ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
              "context_length", "attention.key_length", "attention.value_length"):
        v = _field(reader, f"{arch}.{k}")
        if isinstance(v, (int, np.integer)):
            hp[k] = int(v)
    return GGUFInfo(
        path=Path(path), arch=arch, name=str(_field(reader, "general.name") or Path(path).stem),
        n_params=n_params, tensor_types=types, weight_type=weight_type, file_type=file_type, hparams=hp,
        provenance=_field(reader, PROVENANCE_KEY), chat_template=_field(reader, "tokenizer.chat_template"),
    )


def kv_cache_bytes(hparams: dict[str, int], n_ctx: int, bytes_per_elem: int = 2) -> int:
    """K and V caches for n_ctx positions (f16 by default), from the GGUF's hyperparameters."""
    n_layer = hparams.get("block_count", 0)
    n_head = max(1, hparams.get("attention.head_count", 1))
    n_kv = hparams.get("attention.head_count_kv", n_head)
    head_dim = hparams.get("attention.key_length") or hparams.get("embedding_length", 0) // n_head
    return 2 * n_layer * n_ctx * n_kv * head_dim * bytes_per_elem


def dequantize_to_f16(src: Path, dst: Path, provenance: str,
                      progress: Optional[Callable[[int, int], None]] = None) -> None:
    """Write `dst` as an F16 GGUF with all of `src`'s metadata; 1-D tensors (norms, biases) stay F32.

    Streams tensor by tensor, so memory holds one dequantized tensor at a time.
    The caller owns atomicity (pass a temporary `dst`)."""
    import gguf

    reader = _reader(src)
    arch = _field(reader, "general.architecture")
    writer = gguf.GGUFWriter(os.fspath(dst), arch)
    skip = {"general.architecture", "general.file_type", "general.quantization_version", PROVENANCE_KEY}
    for f in reader.fields.values():
        if f.name in skip or f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    writer.add_file_type(FTYPE_MOSTLY_F16)
    writer.add_string(PROVENANCE_KEY, provenance)

    plan = []
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy order
        dtype = np.float32 if len(t.shape) == 1 or int(np.prod(t.shape[1:])) == 1 else np.float16
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(t.name, shape, np.dtype(dtype), nbytes)
        plan.append((t, dtype, nbytes))
    total = sum(p[2] for p in plan)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    done = 0
    for t, dtype, nbytes in plan:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape))
        writer.write_tensor_data(np.ascontiguousarray(arr.reshape(shape).astype(dtype, copy=False)))
        done += nbytes
        if progress:
            progress(done, total)
    writer.close()
