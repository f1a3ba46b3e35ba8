"""Base GGUF -> quantized variants through llama.cpp's own quantizer (`llama_model_quantize`)."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Optional

from specquant_cli.errors import InputError, LlamaError, ModelFileError, ResourceError
from specquant_cli.family import manifest as fam
from specquant_cli.family.ggufio import GGUFInfo, read_info
from specquant_cli.fsutil import atomic_path, sha256_file


@dataclass(frozen=True)
class QuantType:
    name: str
    ftype_const: str  # name of the llama_ftype constant in llama_cpp
    bpw: float  # typical bits per weight, for the disk estimate
    role: str  # family role it fills


QUANT_TYPES = {q.name: q for q in [
    QuantType("q4_0", "LLAMA_FTYPE_MOSTLY_Q4_0", 4.55, "q4"),
    QuantType("q4_1", "LLAMA_FTYPE_MOSTLY_Q4_1", 5.05, "q4"),
    QuantType("q4_k_s", "LLAMA_FTYPE_MOSTLY_Q4_K_S", 4.6, "q4"),
    QuantType("q4_k_m", "LLAMA_FTYPE_MOSTLY_Q4_K_M", 4.9, "q4"),
    QuantType("q5_k_m", "LLAMA_FTYPE_MOSTLY_Q5_K_M", 5.7, "q5"),
    QuantType("q6_k", "LLAMA_FTYPE_MOSTLY_Q6_K", 6.6, "q6"),
    QuantType("q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0", 8.5, "q8"),
    QuantType("f16", "LLAMA_FTYPE_MOSTLY_F16", 16.0, "f16"),
    QuantType("bf16", "LLAMA_FTYPE_MOSTLY_BF16", 16.0, "bf16"),
]}
DEFAULT_TYPES = ("q4_k_m", "q8_0", "f16")
ProgressFn = Callable[[str, int, int], None]  # (type name, bytes written, expected bytes)


def parse_types(spec: str | Sequence[str]) -> list[QuantType]:
    names = [s.strip().lower() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not names:
        raise InputError("no quantization types given")
    unknown = [n for n in names if n not in QUANT_TYPES]
    if unknown:
        raise InputError(f"unknown type {unknown[0]!r}; valid types: {', '.join(QUANT_TYPES)}")
    roles = [QUANT_TYPES[n].role for n in names]
    dup = {r for r in roles if roles.count(r) > 1}
    if dup:
        raise InputError(f"two types fill the same role {sorted(dup)[0]!r}: pick one of them")
    return [QUANT_TYPES[n] for n in dict.fromkeys(names)]


def estimate_bytes(info: GGUFInfo, q: QuantType) -> int:
    # Embedding/output tensors are kept at higher precision by llama.cpp: 10 % + 16 MiB margin.
    return int(info.n_params * q.bpw / 8 * 1.10) + (16 << 20)


def check_base(info: GGUFInfo, allow_requantize: bool) -> None:
    if not info.is_float and not allow_requantize:
        raise ModelFileError(
            f"{info.path}: base is already quantized ({info.weight_type}); quantizing it again loses quality"
            " on top of the first quantization. Use an F16/BF16/F32 base, or pass --allow-requantize")


def check_disk(out_dir: Path, needed: int) -> None:
    free = shutil.disk_usage(out_dir).free
    if needed > free:
        raise ResourceError(f"not enough disk in {out_dir}: need ~{needed / 2**30:.2f} GiB, "
                            f"{free / 2**30:.2f} GiB free")


def _run_quantize(src: Path, dst: Path, q: QuantType, threads: int, allow_requantize: bool) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, q.ftype_const)
    params.nthread = threads
    params.allow_requantize = allow_requantize
    rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), params)
    if rc != 0:
        raise LlamaError(f"llama_model_quantize failed for {q.name} (code {rc}); see quantize.log")


def quantize_one(src: Path, dst: Path, q: QuantType, expected: int, threads: int,
                 allow_requantize: bool, progress: Optional[ProgressFn]) -> None:
    """Quantize to a temp file in a worker thread, report its growing size, rename on success."""
    with atomic_path(dst) as tmp:
        err: list[BaseException] = []

        def work():
            try:
                _run_quantize(src, tmp, q, threads, allow_requantize)
            except BaseException as e:  # surfaced in the calling thread
                err.append(e)

        t = threading.Thread(target=work, name=f"quantize-{q.name}", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
            if progress:
                progress(q.name, tmp.stat().st_size if tmp.exists() else 0, expected)
        if err:
            raise err[0]
        if not tmp.exists() or tmp.stat().st_size == 0:
            raise LlamaError(f"llama_model_quantize wrote nothing for {q.name}; see quantize.log")
        if progress:
            progress(q.name, tmp.stat().st_size, tmp.stat().st_size)


def _place_base(base: Path, out_dir: Path) -> Path:
    """The f16 variant of an F16 base is the base itself, kept inside the family folder."""
    if base.resolve().parent == out_dir.resolve():
        return base
    dst = out_dir / base.name
    if dst.exists():
        return dst
    with atomic_path(dst) as tmp:
        try:
            os.link(base, tmp)
        except OSError:
            shutil.copyfile(base, tmp)
    return dst


def variant_record(path: Path, q: QuantType, n_params: int, out_dir: Path) -> dict:
    import llama_cpp

    size = path.stat().st_size
    return {
        "type": q.name, "role": q.role, "path": os.path.relpath(path, out_dir), "size_bytes": size,
        "bits_per_weight": round(size * 8 / max(1, n_params), 3), "sha256": sha256_file(path),
        "created": datetime.fromtimestamp(path.stat().st_mtime, UTC).isoformat(timespec="seconds"),
        "llama_cpp_python": llama_cpp.__version__,
    }


def quantize_family(base: Path, out_dir: Path, types: Sequence[QuantType], *, threads: int = 0,
                    force: bool = False, allow_requantize: bool = False, family_name: Optional[str] = None,
                    provenance: Optional[str] = None, notes: Optional[dict] = None,
                    progress: Optional[ProgressFn] = None) -> dict:
    """Make every requested variant of `base` in `out_dir` and write `manifest.json`. Returns the manifest."""
    from specquant_cli.backend.llama import llama_log_to

    base = Path(base)
    info = read_info(base)
    check_base(info, allow_requantize)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = family_name or out_dir.name
    base_is_f16 = info.weight_type == "F16" and info.is_float
    todo, needed = [], 0
    for q in types:
        dst = out_dir / f"{stem}-{q.name}.gguf"
        if q.name == "f16" and base_is_f16:
            needed += 0 if base.resolve().parent == out_dir.resolve() else info.path.stat().st_size
            continue
        if dst.exists() and not force:
            continue
        todo.append((q, dst))
        needed += estimate_bytes(info, q)
    check_disk(out_dir, needed)

    threads = threads or os.cpu_count() or 1
    with llama_log_to(out_dir / "quantize.log"):
        for q, dst in todo:
            if dst.exists():
                dst.unlink()
            quantize_one(base, dst, q, estimate_bytes(info, q), threads, allow_requantize, progress)
    base_in_family = _place_base(base, out_dir)
    variants = {}
    for q in types:
        path = base_in_family if (q.name == "f16" and base_is_f16) else out_dir / f"{stem}-{q.name}.gguf"
        variants[q.role] = variant_record(path, q, info.n_params, out_dir)
    manifest = fam.build_manifest(stem, info, base_in_family, out_dir, variants,
                                  provenance or info.provenance, notes or {})
    fam.write_manifest(out_dir, manifest)
    return manifest

