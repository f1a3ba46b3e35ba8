"""GGUF files written from another: a base by dequantizing one (`dequantize_to_float`), an F16 rendering of a BF16
file when, and only when, it is exact (`f16_of_bf16`, `NotExact`), and a smaller network of the same vocabulary by
keeping some of a file's blocks (`cut_layers`)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import numpy as np

from specquant_cli.errors import ModelFileError
from specquant_cli.family.gguf_read import field_value, open_reader
from specquant_cli.family.gguf_types import FTYPE_MOSTLY_BF16, FTYPE_MOSTLY_F16, PROVENANCE_KEY


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
    reader = open_reader(src)
    writer = gguf.GGUFWriter(os.fspath(dst), field_value(reader, "general.architecture"))
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

    reader = open_reader(src)
    writer = gguf.GGUFWriter(os.fspath(dst), field_value(reader, "general.architecture"))
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

    reader = open_reader(src)
    arch = field_value(reader, "general.architecture")
    n_blocks = field_value(reader, f"{arch}.block_count")
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
