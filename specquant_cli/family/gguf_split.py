"""A model cut into parts by llama-gguf-split (`NAME-00001-of-00003.gguf` …), as a Hugging Face repository often
publishes a big one: the parts' names (`parts_of`), and the parts merged back into one GGUF (`merge`), as
`llama-gguf-split --merge` writes it, so a family holds one file. The first part carries the metadata; every part
carries `split.*` keys and its share of the tensors, copied byte for byte in their own types."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import numpy as np

from specquant_cli.errors import ModelFileError

PART = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def parts_of(name: str) -> Optional[list[str]]:
    """The names of every part of the split model whose part `name` is (`X-00002-of-00003.gguf` -> the three), in
    order; None when `name` is not so named."""
    m = PART.match(name)
    if not m or int(m["count"]) < 1:
        return None
    count = int(m["count"])
    return [f"{m['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def merge(parts: Sequence[Path], dst: Path) -> None:
    """Write `dst` as one GGUF of the split model whose parts, in order, are `parts`: the first part's metadata
    without the split keys, then every part's tensors as they are. ModelFileError (one line) when a part is not the
    part its place says, or the tensors do not add up to what the first part announces. The caller owns atomicity
    (a temporary `dst`)."""
    import gguf

    readers = []
    for i, p in enumerate(parts):
        try:
            r = gguf.GGUFReader(os.fspath(p), "r")
        except (ValueError, OSError, IndexError) as e:
            raise ModelFileError(f"{p}: not a readable GGUF part ({e})") from None
        no, count = _value(r, "split.no"), _value(r, "split.count")
        if no != i or count != len(parts):
            raise ModelFileError(f"{p}: holds part {no if no is None else no + 1} of {count}, expected part {i + 1} "
                                 f"of {len(parts)}")
        readers.append(r)
    first = readers[0]
    arch = _value(first, "general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{parts[0]}: no general.architecture; not the first part of a model")
    writer = gguf.GGUFWriter(os.fspath(dst), arch)
    for f in first.fields.values():
        if f.name.startswith("GGUF.") or f.name in (*SPLIT_KEYS, "general.architecture"):
            continue
        vtype = f.types[0]
        writer.add_key_value(f.name, f.contents(), vtype,
                             sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    tensors = [t for r in readers for t in r.tensors]
    announced = _value(first, "split.tensors.count")
    if isinstance(announced, int) and announced != len(tensors):
        raise ModelFileError(f"{parts[0]}: announces {announced} tensors, its parts hold {len(tensors)}")
    for t in tensors:
        data = np.asarray(t.data)
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes,
                               raw_dtype=None if data.dtype in (np.float32, np.float16) else t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        writer.write_tensor_data(np.asarray(t.data))
    writer.close()


def _value(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except (ValueError, IndexError):
        return None
