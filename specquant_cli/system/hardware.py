"""Hardware facts: NVML for GPUs, psutil for the host, /proc/cpuinfo for CPU features."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Optional

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "f16c", "fma", "neon")
REINSTALL_HINT = 'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python'


@dataclass
class GPU:
    index: int
    name: str
    total_bytes: int
    free_bytes: int
    driver: str


@dataclass
class Facts:
    gpus: list[GPU]
    gpu_status: str  # why there is no GPU, or "ok"
    ram_total: int
    ram_available: int
    cores_physical: int
    cores_logical: int
    cpu_flags: dict[str, bool]
    gpu_offload: bool  # the installed llama-cpp-python can offload
    build: dict = field(default_factory=dict)  # what the installed llama.cpp was built with (build_features)

    def to_dict(self) -> dict:
        return asdict(self)


def detect_gpus(nvml=None) -> tuple[list[GPU], str]:
    """GPUs through NVML. No library, no driver or no device is the normal CPU state, not an error."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return [], "pynvml not installed"
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return [], f"no NVIDIA driver ({type(e).__name__})"
    try:
        drv = nvml.nvmlSystemGetDriverVersion()
        drv = drv.decode() if isinstance(drv, bytes) else str(drv)
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(h)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(GPU(i, name.decode() if isinstance(name, bytes) else str(name),
                            int(mem.total), int(mem.free), drv))
        return gpus, "ok" if gpus else "driver present, no GPU"
    except Exception as e:
        return [], f"NVML error ({type(e).__name__}: {e})"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> dict[str, bool]:
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return {k: (k in have or (k == "neon" and "asimd" in have)) for k in CPU_FLAGS}
    except OSError:
        pass
    return {k: False for k in CPU_FLAGS}


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's name as the kernel gives it (x86 `model name`, else an ARM board's `Hardware` or `Model`), else
    what Python's platform module knows ("unknown" when nothing does)."""
    import platform

    found: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                key = key.strip()
                if sep and value.strip() and key in ("model name", "Hardware", "Model") and key not in found:
                    found[key] = value.strip()
    except OSError:
        pass
    for key in ("model name", "Hardware", "Model"):
        if key in found:
            return found[key]
    return platform.processor() or platform.machine() or "unknown"


def detect(nvml=None) -> Facts:
    import psutil

    from specquant_cli.backend.llama import gpu_offload_supported

    gpus, status = detect_gpus(nvml)
    vm = psutil.virtual_memory()
    return Facts(gpus=gpus, gpu_status=status, ram_total=int(vm.total), ram_available=int(vm.available),
                 cores_physical=psutil.cpu_count(logical=False) or os.cpu_count() or 1,
                 cores_logical=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
                 cpu_flags=cpu_flags(), gpu_offload=gpu_offload_supported(), build=build_features())


def parse_system_info(text: str) -> dict[str, bool]:
    """llama_print_system_info's `CPU : SSE3 = 1 | AVX = 1 | ... | REPACK = 1 |` as {feature: on}."""
    feats: dict[str, bool] = {}
    for part in text.replace("\n", "|").split("|"):
        name, eq, value = part.rpartition("=")
        name = name.split(":")[-1].strip()
        if eq and name and value.strip().isdigit():
            feats[name] = value.strip() != "0"
    return feats


def build_features() -> dict:
    """The installed llama.cpp as it reports itself: its CPU features (llama_print_system_info), whether
    ggml's AMX and repack kernels are in, RPC and GPU offload support."""
    import llama_cpp

    from specquant_cli.backend.llama import backend_devices, init_backend

    init_backend()
    text = llama_cpp.llama_print_system_info()
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)
    feats = parse_system_info(text)
    return {"llama_cpp_python": getattr(llama_cpp, "__version__", "?"), "system_info": text.strip(),
            "cpu_features": [k for k, v in feats.items() if v], "amx": any(feats.get(k) for k in feats
                                                                              if k.startswith("AMX")),
            "repack": bool(feats.get("REPACK")), "rpc": bool(llama_cpp.llama_supports_rpc()),
            "devices": [name for name, _ in backend_devices()]}


def advice(facts: Facts) -> Optional[str]:
    if facts.gpus and not facts.gpu_offload:
        return f"a GPU is present but this llama-cpp-python is CPU-only; reinstall with: {REINSTALL_HINT}"
    return None
