"""One `llama_model_quantize` call with an importance matrix and per-tensor types, in a process of its own
(as quantize_worker: the parent can kill it on Ctrl-C; it exits when orphaned).

Both arrive through llama-cpp-python 0.3.36's C structs, as llama.h declares them: `imatrix` points to an
array of `llama_model_imatrix_data {name, data, size}` and `tt_overrides` to an array of
`llama_model_tensor_override {pattern, type}`, each ended by an entry whose name/pattern is NULL
(src/llama-quant.cpp copies the first into its map and compiles each pattern as a std::regex searched in
the tensor name, first match wins).

Usage: python -m specquant_cli.family.recipe_worker SPEC.json PARENT_PID
SPEC: {"src", "dst", "ftype" (llama_ftype constant name), "nthread", "imatrix" (imatrix GGUF path or null),
       "overrides": [[regex, type], ...], "output_tensor_type", "token_embedding_type" (type names or null)}"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path


def ggml_type(llama_cpp, name: str) -> int:
    return int(getattr(llama_cpp, f"GGML_TYPE_{name.upper()}"))


def imatrix_array(llama_cpp, path: str):
    """(ctypes array of llama_model_imatrix_data ending in a NULL name, the buffers it points into)."""
    from specquant_cli.family.imatrix import ActivationStats

    means = ActivationStats.load(Path(path)).mean()
    keep = []
    arr = (llama_cpp.llama_model_imatrix_data * (len(means) + 1))()
    for i, (name, v) in enumerate(sorted(means.items())):
        buf = (ctypes.c_float * v.size).from_buffer_copy(v.astype("float32").tobytes())
        keep += [buf, name.encode()]
        arr[i].name = keep[-1]
        arr[i].data = ctypes.cast(buf, ctypes.POINTER(ctypes.c_float))
        arr[i].size = v.size
    arr[len(means)].name = None
    return arr, keep


def overrides_array(llama_cpp, pairs):
    arr = (llama_cpp.llama_model_tensor_override * (len(pairs) + 1))()
    keep = []
    for i, (pattern, t) in enumerate(pairs):
        keep.append(pattern.encode())
        arr[i].pattern = keep[-1]
        arr[i].type = ggml_type(llama_cpp, t)
    arr[len(pairs)].pattern = None
    return arr, keep


def main(argv: list[str]) -> int:
    from specquant_cli.family.quantize_worker import start_worker

    spec_path, parent = argv
    llama_cpp, _log = start_worker(parent)
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, spec["ftype"])
    params.nthread = int(spec.get("nthread") or 0)
    keep = []
    if spec.get("imatrix"):
        arr, bufs = imatrix_array(llama_cpp, spec["imatrix"])
        keep += [arr, bufs]
        params.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    if spec.get("overrides"):
        arr, bufs = overrides_array(llama_cpp, spec["overrides"])
        keep += [arr, bufs]
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    if spec.get("output_tensor_type"):
        params.output_tensor_type = ggml_type(llama_cpp, spec["output_tensor_type"])
    if spec.get("token_embedding_type"):
        params.token_embedding_type = ggml_type(llama_cpp, spec["token_embedding_type"])
    rc = llama_cpp.llama_model_quantize(os.fsencode(spec["src"]), os.fsencode(spec["dst"]), params)
    return 0 if rc == 0 else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
