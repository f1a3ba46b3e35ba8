"""Hardware facts (NVML for GPUs, psutil for the host) and a pure placement planner."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Optional

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "f16c", "fma", "neon")
REINSTALL_HINT = 'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python'
VRAM_RESERVE = 512 << 20  # CUDA context, scratch buffers
COMPUTE_OVERHEAD = 256 << 20  # compute buffers per model, RAM or VRAM


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


def detect(nvml=None) -> Facts:
    import psutil

    from specquant_cli.llama import gpu_offload_supported

    gpus, status = detect_gpus(nvml)
    vm = psutil.virtual_memory()
    return Facts(gpus=gpus, gpu_status=status, ram_total=int(vm.total), ram_available=int(vm.available),
                 cores_physical=psutil.cpu_count(logical=False) or os.cpu_count() or 1,
                 cores_logical=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
                 cpu_flags=cpu_flags(), gpu_offload=gpu_offload_supported())


def advice(facts: Facts) -> Optional[str]:
    if facts.gpus and not facts.gpu_offload:
        return f"a GPU is present but this llama-cpp-python is CPU-only; reinstall with: {REINSTALL_HINT}"
    return None


@dataclass
class ModelNeed:
    """What one model of a plan needs: weights, KV cache, and its layer count (for partial offload)."""
    role: str
    weight_bytes: int
    kv_bytes: int
    n_layers: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes + COMPUTE_OVERHEAD


@dataclass
class Placement:
    mode: str  # gpu | hybrid | cpu
    gpu_layers: dict[str, int] = field(default_factory=dict)  # role -> n_gpu_layers (-1 = all)
    ram_bytes: int = 0  # what stays in host memory
    vram_bytes: int = 0
    fits_ram: bool = True
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def plan(facts: Facts, parent: ModelNeed, draft: Optional[ModelNeed] = None) -> Placement:
    """Pure function: hardware facts + what the models need -> where each one runs."""
    models = [parent] + ([draft] if draft else [])
    usable = 0
    if facts.gpus and facts.gpu_offload:
        usable = max(0, max(g.free_bytes for g in facts.gpus) - VRAM_RESERVE)
    ram_ok = lambda b: b <= facts.ram_available * 0.9  # noqa: E731
    if usable and sum(m.total for m in models) <= usable:
        return Placement("gpu", {m.role: -1 for m in models}, 0, sum(m.total for m in models), True,
                         "parent and draft fit in free VRAM with their KV caches")
    if usable and parent.total <= usable:
        ram = draft.total if draft else 0
        return Placement("hybrid", {parent.role: -1, **({draft.role: 0} if draft else {})}, ram, parent.total,
                         ram_ok(ram), "parent on GPU, draft on CPU: both together do not fit in VRAM")
    if usable and parent.n_layers:
        per_layer = parent.weight_bytes / parent.n_layers
        n = int((usable - parent.kv_bytes - COMPUTE_OVERHEAD) // per_layer)
        if n >= 1:
            n = min(n, parent.n_layers)
            vram = int(n * per_layer) + parent.kv_bytes + COMPUTE_OVERHEAD
            ram = parent.total - int(n * per_layer) + (draft.total if draft else 0)
            return Placement("hybrid", {parent.role: n, **({draft.role: 0} if draft else {})}, ram, vram,
                             ram_ok(ram), f"parent partly offloaded ({n}/{parent.n_layers} layers), draft on CPU")
    ram = sum(m.total for m in models)
    why = "no usable GPU" if not usable else "the parent does not fit in VRAM"
    if facts.gpus and not facts.gpu_offload:
        why = "llama-cpp-python is built without GPU offload"
    return Placement("cpu", {m.role: 0 for m in models}, ram, 0, ram_ok(ram), f"CPU only: {why}")
