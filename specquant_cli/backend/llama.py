"""A thin adapter over llama.cpp (llama-cpp-python's low-level API), one name to import it by.

One small class per llama.cpp resource, each in a module of its own: `Model` (weights + vocabulary:
backend.model) and `Context` (KV cache + batch: backend.context); the backend's start and its log (backend.log)
and its devices (backend.devices). Return codes become exceptions; the free order of model, context and batch is
kept by their owners. This module hands their public names on."""

from specquant_cli.backend.context import Context, PrefixCache, check_threads, common_prefix
from specquant_cli.backend.devices import GPU_DEVICE_TYPES, backend_devices, gpu_offload_supported
from specquant_cli.backend.log import init_backend, llama_log_to, log_target_problem, set_log_file
from specquant_cli.backend.model import META_BUF_BYTES, PIECE_BUF_BYTES, Detokenizer, Model, check_same_vocab

__all__ = ["GPU_DEVICE_TYPES", "META_BUF_BYTES", "PIECE_BUF_BYTES", "Context", "Detokenizer", "Model", "PrefixCache",
           "backend_devices", "check_same_vocab", "check_threads", "common_prefix", "gpu_offload_supported",
           "init_backend", "llama_log_to", "log_target_problem", "set_log_file"]
