"""What a family variant is: the quantization types llama.cpp makes (`QUANT_TYPES`) and the record of one
variant in the manifest (`variant_record`). Imported by family.manifest, family.quantize and family.recipes
alike (it imports none of them)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Optional

from specquant_cli.fsutil import sha256_file


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


def variant_record(path: Path, type_name: str, role: str, n_params: int, name: str,
                   created: Optional[datetime] = None, sha: Optional[str] = None, extra: Optional[dict] = None) -> dict:
    """The manifest's record of the variant file at `path` (committed under `name` in the family folder):
    its type and role, size, bits per weight over `n_params`, sha256 (`sha` when already known), creation
    time (`created`, else the file's mtime) and the llama-cpp-python that made it; then `extra` (a
    recipe's own keys)."""
    import llama_cpp

    st = path.stat()
    return {
        "type": type_name, "role": role, "path": name, "size_bytes": st.st_size,
        "bits_per_weight": round(st.st_size * 8 / max(1, n_params), 3), "sha256": sha or sha256_file(path),
        "created": (created or datetime.fromtimestamp(st.st_mtime, UTC)).isoformat(timespec="seconds"),
        "llama_cpp_python": llama_cpp.__version__,
        **(extra or {}),
    }
