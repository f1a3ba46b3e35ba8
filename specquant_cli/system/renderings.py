"""Which rendering of the parent serves on this machine.

A family's parent is its base written exactly at 16 bits, as F16 (`f16`), BF16 (`bf16`) or both; both hold the
same weights (`quantize` makes the F16 rendering of a BF16 base only when it is exact), so the choice changes
speed, not what is said — except where the two formats' arithmetic parts a near-tie (README: "The parent's
rendering"). On 2 cores every multi-token parent call is compute-bound; ggml multiplies BF16 weights with
`vdpbf16ps` (32 multiply-adds an instruction) where the CPU has BF16 dot products, and widens F16 weights to
F32 first (16): on the AMD EPYC (Zen 4) kind the 1.5B family's BF16 parent prefilled in 5.3 ms/token against
F16's 8.3 (`specquant calibrate`).

`decide` is called once per session, before any model loads (session.open_session, serve's sizing, doctor):
the rendering asked for (`--parent f16|bf16`), else the family's only one, else F16 on a CPU without BF16 dot
products, else the faster in this machine's stored comparison (system.calibration measures both renderings
back to back when it calibrates such a family), else BF16 until that comparison exists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specquant_cli.errors import FamilyError, InputError
from specquant_cli.family.manifest import Family
from specquant_cli.family.roles import OWN
from specquant_cli.system import calibration_file as cal
from specquant_cli.system.calibration import PREFILL_TOKENS

# The build's CPU features (llama_print_system_info) that give ggml BF16 dot products, and the CPU flags that name them.
BF16_FEATURES = {"AVX512_BF16": "avx512_bf16", "AMX_BF16": "amx_bf16", "ARM_BF16": "bf16"}


@dataclass(frozen=True)
class ParentChoice:
    rendering: str  # f16 | bf16 | own
    why: str  # one line, for doctor, calibrate and bench
    source: str  # flag | family | machine (as settings name their sources)
    comparison: Optional[dict] = None  # the stored timings the choice was made from, if any

    def to_dict(self) -> dict:
        return {"rendering": self.rendering, "why": self.why, "source": self.source, "comparison": self.comparison}


def bf16_dot(facts) -> Optional[str]:
    """The BF16 dot-product instructions both this CPU and the installed llama.cpp build have (avx512_bf16,
    amx_bf16, bf16 on ARM), or None."""
    built = set((getattr(facts, "build", None) or {}).get("cpu_features", []))
    flags = getattr(facts, "cpu_flags", {}) or {}
    for feature, flag in BF16_FEATURES.items():
        if feature in built and flags.get(flag, True):  # a flag hardware.CPU_FLAGS does not read counts as there
            return flag
    return None


def score(timings: dict) -> float:
    """One rendering's cost in the comparison: the measured prefill (PREFILL_TOKENS tokens) plus one call of each
    measured size (the mix of a prompt and its verify calls)."""
    return timings.get("prefill_token_s", 0.0) * PREFILL_TOKENS + sum(timings.get("call_s", {}).values())


def describe(comparison: dict) -> str:
    """`bf16 prefill 9.5 against f16 18.2 ms/token, 16-token call 243 against 391 ms` for a stored comparison."""
    ranked = sorted(comparison, key=lambda r: score(comparison[r]))
    a, b = ranked[0], ranked[-1]
    ta, tb = comparison[a], comparison[b]
    top = max(set(ta.get("call_s", {})) & set(tb.get("call_s", {})), default=None)
    text = (f"{a} prefill {ta['prefill_token_s'] * 1e3:.1f} against {b} {tb['prefill_token_s'] * 1e3:.1f} ms/token")
    if top is not None:
        text += f", {top}-token call {ta['call_s'][top] * 1e3:.0f} against {tb['call_s'][top] * 1e3:.0f} ms"
    return text


def decide(family: Family, wanted: str = "fastest", facts=None, threads: Optional[int] = None,
           rpc: Optional[list[str]] = None) -> ParentChoice:
    """The parent's rendering for a session on this machine (see the module's docstring)."""
    have = family.renderings()
    if not have:
        raise FamilyError(f"family {family.name} has no parent (no f16, bf16 or own variant); see specquant doctor "
                          f"--family {family.root}")
    if wanted != "fastest":
        if wanted not in have:
            raise InputError(f"--parent {wanted}: the family {family.name} has no {wanted} rendering (it has: "
                             f"{', '.join(have)})")
        return ParentChoice(wanted, f"{wanted}, as asked (--parent)", "flag")
    if have == [OWN]:
        v = family.manifest["variants"][OWN]
        kind = v.get("file_type") or v.get("type")
        return ParentChoice(OWN, f"own: the quantized file {v.get('path')} ({kind}) as it is, so output is lossless "
                            "relative to the file you run", "family")
    if len(have) == 1:
        return ParentChoice(have[0], f"{have[0]}, the family's only rendering of its base", "family")
    if facts is None:
        from specquant_cli.system.hardware import detect

        facts = detect()
    stored = stored_comparison(family, facts, threads, rpc)
    if stored:
        best = min(stored, key=lambda r: score(stored[r]))
        return ParentChoice(best, f"{best}, the faster here as calibrated ({describe(stored)})", "machine", stored)
    if rpc:
        return ParentChoice("f16", "f16: the parent runs on RPC workers whose BF16 support is not known here, and no "
                            "calibration compared the renderings (--parent bf16 chooses it)", "machine")
    dot = bf16_dot(facts)
    if dot is None:
        return ParentChoice("f16", "f16: this CPU (or build) has no BF16 dot products (avx512_bf16, AMX-BF16, ARM "
                            "bf16), so F16's kernels are the faster", "machine")
    return ParentChoice("bf16", f"bf16: this CPU multiplies BF16 ({dot}); not yet calibrated here (specquant "
                        "calibrate times both renderings and keeps the faster)", "machine")


def stored_comparison(family: Family, facts, threads: Optional[int], rpc: Optional[list[str]]) -> Optional[dict]:
    """The latest comparison of the family's renderings stored for this machine (in either rendering's entry), or
    None."""
    best = None
    for r in family.renderings():
        c = cal.load(family.root, cal.fingerprint(facts, threads, rpc, parent=r))
        if c is not None and len(c.renderings) > 1 and (best is None or c.measured_at > best.measured_at):
            best = c
    return dict(best.renderings) if best is not None else None
