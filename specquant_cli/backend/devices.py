"""The devices this llama.cpp build registered (ggml's registry), and whether one of them is a local GPU."""

from __future__ import annotations

import ctypes

from specquant_cli.backend.log import init_backend

GPU_DEVICE_TYPES = (1, 2)  # ggml_backend_dev_type: GGML_BACKEND_DEVICE_TYPE_GPU, _IGPU


def backend_devices() -> list[tuple[str, int]]:
    """(name, ggml_backend_dev_type) of every device this llama.cpp build registered (ggml's registry)."""
    from llama_cpp import llama_cpp as lib_mod

    init_backend()
    lib = lib_mod._lib  # libllama; the ggml symbols resolve through its dependencies
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes, lib.ggml_backend_dev_get.restype = [ctypes.c_size_t], ctypes.c_void_p
    lib.ggml_backend_dev_type.argtypes, lib.ggml_backend_dev_type.restype = [ctypes.c_void_p], ctypes.c_int
    lib.ggml_backend_dev_name.argtypes, lib.ggml_backend_dev_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    devs = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
    return [((lib.ggml_backend_dev_name(d) or b"?").decode("utf-8", "replace"), lib.ggml_backend_dev_type(d))
            for d in devs]


def gpu_offload_supported() -> bool:
    """A GPU backend is built in. (llama_supports_gpu_offload is also true for an RPC-only build, whose
    "devices" are remote workers, not a local GPU.)"""
    return any(kind in GPU_DEVICE_TYPES for _, kind in backend_devices())
