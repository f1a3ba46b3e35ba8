"""What a family variant is: the quantization types llama.cpp makes (`QUANT_TYPES`), the draft recipes
(`RECIPES`: a role made by a recipe of types, importance weighting and grading; family.recipes makes them)
and the record of one variant in the manifest (`variant_record`). Imported by family.roles, manifest,
quantize, recipes and grade alike (it imports none of them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Optional

from specquant_cli.fsutil import fingerprint, sha256_file


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


# Default ladder. K-quants from 4 bits up are left out on purpose: on a family whose F16 base was
# dequantized from Q4_K_M (qwen2.5-coder-1.5b), Q4_K/Q6_K reproduce the origin's grid almost exactly, and a
# draft graded into them would agree with the base for that reason only (see the q4 role's note). Q4_0
# also has the CPU's fastest (repacked) kernels.
LADDER = ("q2_k", "q3_k", "q4_0", "q5_0", "q8_0")


@dataclass(frozen=True)
class Recipe:
    role: str
    base: str = "q4_0"  # llama_ftype of the file, and the type of quantizable tensors the plan does not grade
    imatrix: bool = False
    grade: Optional[float] = None  # target bits per weight (tensor data over all weights)
    embeddings: Optional[str] = None  # token_embd / output type
    ladder: tuple[str, ...] = LADDER
    help: str = ""

    @property
    def label(self) -> str:
        """The manifest's `type` for the role."""
        if self.grade is not None:
            return f"graded-{self.grade:g}bpw"
        return "+".join([self.base] + (["imatrix"] if self.imatrix else [])
                        + ([f"embd-{self.embeddings}"] if self.embeddings else []))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("help")
        d["ladder"] = list(self.ladder) if self.grade is not None else None
        return d


RECIPES = {r.role: r for r in (
    Recipe("q4i", imatrix=True, help="Q4_0 weighted by the activation importance matrix"),
    Recipe("q4s", embeddings="q4_0", help="Q4_0 with token embeddings and output at Q4_0 too"),
    Recipe("q4si", imatrix=True, embeddings="q4_0", help="q4s weighted by the activation importance matrix"),
    Recipe("q3g", imatrix=True, grade=3.5, help="graded precision, ~3.5 bits per weight, imatrix-weighted"),
    Recipe("q3g30", imatrix=True, grade=3.0, help="graded precision, ~3.0 bits per weight, imatrix-weighted"),
)}


def variant_record(path: Path, type_name: str, role: str, n_params: int, name: str,
                   created: Optional[datetime] = None, sha: Optional[str] = None, extra: Optional[dict] = None) -> dict:
    """The manifest's record of the variant file at `path` (committed under `name` in the family folder):
    its type and role, size, bits per weight over `n_params`, sha256 (`sha` when already known), content
    fingerprint (fsutil.fingerprint: what every load checks), creation time (`created`, else the file's mtime) and
    the llama-cpp-python that made it; then `extra` (a recipe's own keys)."""
    import llama_cpp

    st = path.stat()
    return {
        "type": type_name, "role": role, "path": name, "size_bytes": st.st_size,
        "bits_per_weight": round(st.st_size * 8 / max(1, n_params), 3), "sha256": sha or sha256_file(path),
        "fingerprint": fingerprint(path),
        "created": (created or datetime.fromtimestamp(st.st_mtime, UTC)).isoformat(timespec="seconds"),
        "llama_cpp_python": llama_cpp.__version__,
        **(extra or {}),
    }
