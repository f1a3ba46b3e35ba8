"""Base GGUF -> quantized variants through llama.cpp's own quantizer (`llama_model_quantize`): one update of a
family, from the plan of its steps (keep, build, derive, place) to the commit of the files staged for it
(family.staging)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Optional

from specquant_cli.errors import InputError, ModelFileError, ResourceError
from specquant_cli.family import journal
from specquant_cli.family.gguf_read import read_info
from specquant_cli.family.gguf_types import GGUFInfo
from specquant_cli.family.lock import family_lock
from specquant_cli.family.manifest_file import WarnFn, read_existing, silent
from specquant_cli.family.own import LOSSLESS_NOTE, OWN_TYPE, check_base, own_record, parent_type, requantize_types
from specquant_cli.family.roles import OWN, RENDERINGS
from specquant_cli.family.staging import (
    DEFAULT_PROVENANCE,
    LOG,
    MAX_THREADS,
    ProgressFn,
    derive_f16,
    open_log,
    quantize_one,
    stage_copy,
)
from specquant_cli.family.variants import QUANT_TYPES, QuantType, variant_record  # noqa: F401  (QuantType: named here too)
from specquant_cli.fsutil import (
    check_folder_writable,
    commit_temp,
    fit_name,
    remove_stale,
    same_file,
    sha256_file,
)
from specquant_cli.names import CALIBRATION, JOURNAL, MANIFEST
from specquant_cli.settings import cores

UNUSABLE_MANIFEST = "manifest.json.unusable"


def parse_types(spec: str | Sequence[str]) -> list[QuantType]:
    names = [s.strip().lower() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not names:
        raise InputError(f"--types: no quantization type given; valid types: {', '.join(QUANT_TYPES)}")
    unknown = [n for n in names if n not in QUANT_TYPES]
    if unknown:
        raise InputError(f"--types: unknown type {unknown[0]!r}; valid types: {', '.join(QUANT_TYPES)}")
    roles = [QUANT_TYPES[n].role for n in names]
    dup = {r for r in roles if roles.count(r) > 1}
    if dup:
        raise InputError(f"--types: two types fill the same role {sorted(dup)[0]!r}: pick one of them")
    return [QUANT_TYPES[n] for n in dict.fromkeys(names)]


def estimate_bytes(info: GGUFInfo, q: QuantType) -> int:
    # Embedding/output tensors are kept at higher precision by llama.cpp: 10 % + 16 MiB margin.
    return int(info.n_params * q.bpw / 8 * 1.10) + (16 << 20)


def check_disk(out_dir: Path, needed: int) -> None:
    free = shutil.disk_usage(out_dir).free
    if needed > free:
        raise ResourceError(f"not enough disk in {out_dir}: need ~{needed / 2**30:.2f} GiB, "
                            f"{free / 2**30:.2f} GiB free")


@dataclass
class Step:
    q: QuantType
    dst: Path  # final path in the family folder
    # keep (an existing file checked and adopted) | build (quantize) | place (link/copy the base in) |
    # derive (the F16 rendering of a BF16 base, made only when exact: gguf_write.f16_of_bf16)
    action: str


def base_rendering(info: GGUFInfo) -> Optional[str]:
    """The rendering a base is itself: `f16` for an F16 base, `bf16` for a BF16 one, `own` for a quantized one (the
    parent as it is); None for F32, which every 16-bit rendering would round."""
    if not info.is_float:
        return OWN
    return {"F16": "f16", "BF16": "bf16"}.get(info.weight_type)


def default_types(info: GGUFInfo, allow_requantize: bool = False) -> list[QuantType]:
    """`quantize`'s types when none are given: the standard drafts and the parent's renderings this base has
    exactly — an F16 base is kept F16 (never rounded to BF16), a BF16 base is kept BF16 and given an F16
    rendering too when that is exact (quantize_family's `f16_if_exact`), an F32 base is rounded to F16. A quantized
    base is the parent as it is (`own`), with, under `allow_requantize`, the standard drafts of fewer bits per weight
    than it has (quantize_family adds its own step to any types)."""
    from specquant_cli.family.variants import DEFAULT_TYPES

    drafts = [n for n in DEFAULT_TYPES if QUANT_TYPES[n].role not in RENDERINGS]
    if not info.is_float:
        bpw = info.path.stat().st_size * 8 / max(1, info.n_params)
        return [QUANT_TYPES[n] for n in drafts if allow_requantize and QUANT_TYPES[n].bpw < bpw * 0.9]
    extra = ["bf16", "f16"] if base_rendering(info) == "bf16" else ["f16"]
    return [QUANT_TYPES[n] for n in (*drafts, *extra)]


def check_renderings(info: GGUFInfo, types: Sequence[QuantType]) -> None:
    """The renderings asked of this base are exact ones: no BF16 of an F16 base (BF16 keeps 8 significant bits
    of F16's 11), and not both of an F32 base (two roundings would hold different weights, and the parent's
    output would depend on which one this machine picks)."""
    asked = [q.name for q in types if q.name in RENDERINGS]
    own = base_rendering(info)
    if own == OWN:
        return  # check_base: a quantized base gets no 16-bit rendering
    if own == "f16" and "bf16" in asked:
        raise InputError(f"--types bf16: the base {info.path} is F16; rounding it to BF16 would change its weights "
                         "(BF16 keeps 8 significant bits, F16 11), so an F16 base is never rounded: leave bf16 out")
    if own is None and info.is_float and len(asked) > 1:
        raise InputError(f"--types {','.join(asked)}: the base {info.path} is {info.weight_type}; each 16-bit "
                         "rendering rounds it differently, so a family holds one: pick f16 or bf16")


def existing_problem(dst: Path, q: QuantType, info: GGUFInfo) -> Optional[str]:
    """Why a file already at `dst` cannot be adopted as the `q` variant of `info`'s base, else None."""
    if dst.is_symlink():
        return "it is a symbolic link"
    try:
        got = read_info(dst)
    except ModelFileError as e:
        return str(e).removeprefix(f"{dst}: ")
    if got.arch != info.arch:
        return f"architecture {got.arch}, the base is {info.arch}"
    if got.n_params != info.n_params:
        return f"{got.n_params} parameters, the base has {info.n_params}"
    if got.file_type and got.file_type != q.name.upper():
        return f"its weights are {got.file_type}, not {q.name}"
    if got.vocab_sha256 != info.vocab_sha256:
        return "its vocabulary differs from the base's"
    return None


def _same_content(a: Path, b: Path, b_sha: str) -> bool:
    if not a.is_file() or a.is_symlink():
        return False
    return same_file(a, b) or (a.stat().st_size == b.stat().st_size and sha256_file(a) == b_sha)


def plan_steps(base: Path, info: GGUFInfo, out_dir: Path, stem: str, types: Sequence[QuantType], force: bool,
               base_sha: str, rebuild_all: bool, warn: WarnFn) -> list[Step]:
    """What to do per type: keep a valid existing file, build it, place the base in the folder as its own
    rendering, or derive the F16 rendering of a BF16 base."""
    base_inside = base.resolve().parent == out_dir.resolve()
    own = base_rendering(info)
    for name in (MANIFEST, LOG, JOURNAL):
        if os.path.lexists(out_dir / name) and same_file(out_dir / name, base):
            raise InputError(f"the base {base} is the family's own {name}; refusing to overwrite an input")
    steps = []
    for q in types:
        if q.name == own:
            if base_inside:
                steps.append(Step(q, out_dir / Path(os.path.realpath(base)).name, "keep"))
                continue
            dst = out_dir / fit_name(base.name)
            steps.append(Step(q, dst, "keep" if _same_content(dst, base, base_sha) else "place"))
            continue
        dst = out_dir / fit_name(f"{stem}-{q.name}.gguf")
        if os.path.lexists(dst) and same_file(dst, base):
            raise InputError(f"output {dst} is the input base itself; choose another --out, or other --types")
        make = "derive" if q.name == "f16" and own == "bf16" else "build"
        if not os.path.lexists(dst) or force or rebuild_all:
            steps.append(Step(q, dst, make))
            continue
        why = existing_problem(dst, q, info)
        if why:
            warn(f"{dst}: {why}; rebuilding it")
        steps.append(Step(q, dst, make if why else "keep"))
    for s in steps:
        if s.dst.is_dir() and not s.dst.is_symlink():
            raise InputError(f"{s.dst} is a folder where the {s.q.name} variant goes; move it away first")
    names = [s.dst.name for s in steps]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise InputError(f"two variants would be written to the same file {dup}; rename the base or pick other --types")
    return steps


def _warn_without_parent(steps: list, old: Optional[dict], warn: WarnFn) -> None:
    """A family without its parent (every draft verifies against it, lossless output is its own) runs no policy
    until one is added: said before anything is quantized, when neither these types nor the folder's family of
    the same base have it (a family may be built a type at a time)."""
    old_variants = old.get("variants") if old and isinstance(old.get("variants"), dict) else {}
    if {s.q.role for s in steps} & set(RENDERINGS) or set(old_variants) & set(RENDERINGS):
        return
    have = ",".join(s.q.name for s in steps)
    warn(f"--types {have} makes a family without its parent (an f16 or bf16 rendering of the base): no policy runs "
         f"on it, and doctor reports it broken, until quantize --types f16 (or bf16, for a BF16 base) adds it")


def build_manifest(old: Optional[dict], same_base: bool, name: str, info: GGUFInfo, base_file: str, base_sha: str,
                   base_size: int, variants: dict, provenance: Optional[str], notes: Optional[dict],
                   warn: WarnFn, source: Optional[str] = None) -> dict:
    """The new manifest. What specquant does not own is kept from the old one (unknown keys, notes, a
    recorded provenance of the same base, and the variants of other roles made from the same base). `source`: where
    the base came from (a model reference, a path), recorded as the base's `source` (else the same base's kept)."""
    old = old or {}
    old_variants = old.get("variants") if isinstance(old.get("variants"), dict) else {}
    old_base = old.get("base") if same_base and isinstance(old.get("base"), dict) else {}
    kept = {}
    for role, rec in old_variants.items():
        if role in variants:
            if same_base and isinstance(rec, dict):  # keys of the record we do not own survive
                variants[role] = {**rec, **variants[role]}
        elif same_base:
            kept[role] = rec
        else:
            warn(f"dropping the {role} variant from the manifest: it was made from another base")
    old_prov = old_base.get("provenance")
    prov = provenance or (old_prov if isinstance(old_prov, str) and old_prov else None) or info.provenance \
        or DEFAULT_PROVENANCE
    old_notes = old.get("notes")
    if isinstance(old_notes, dict):
        new_notes = {**old_notes, **(notes or {})}
    elif old_notes is None:
        new_notes = dict(notes or {})
    else:
        new_notes = {"previous": old_notes, **notes} if notes else old_notes
    all_variants = {**variants, **kept}
    m = dict(old)
    m.update({
        "schema": 1,
        "family": name,
        "architecture": info.arch,
        "n_params": info.n_params,
        "hparams": info.hparams,
        "base": {**old_base, "file": base_file, "sha256": base_sha, "size_bytes": base_size,
                 "type": info.weight_type, "provenance": prov, **({"source": source} if source else {})},
        "roles": {role: v.get("type") for role, v in all_variants.items() if isinstance(v, dict)},
        "variants": all_variants,
        "notes": new_notes,
    })
    return m


def _family_name(manifest: Optional[dict]) -> Optional[str]:
    """The family name a manifest records, when it can also begin the family's file names (one plain name: letters,
    digits, '.', '_', '-', not starting with '.'); None otherwise."""
    name = (manifest or {}).get("family")
    if isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", name):
        return name
    return None


def _set_aside(mpath: Path, why: str, warn: WarnFn) -> None:
    """A manifest we cannot read is not ours to throw away: it is kept beside the new one."""
    if mpath.is_symlink():
        warn(f"{mpath}: unusable ({why}); the link is replaced, its target left alone")
        return
    aside = mpath.with_name(UNUSABLE_MANIFEST)
    held: list[Path] = []
    try:
        commit_temp(stage_copy(mpath, aside, keep=held.append), aside)
    finally:
        for t in held:
            t.unlink(missing_ok=True)  # gone once renamed: only an interrupted copy is removed here
    warn(f"{mpath}: unusable ({why}); kept as {UNUSABLE_MANIFEST}, a new one is written")


def _stager(staged: list, step: Step) -> Callable[[Path], None]:
    """The `keep` of quantize_one, derive_f16 and stage_copy that files a finished temp under its step."""
    return lambda tmp: staged.append((tmp, step))


def quantize_family(base: Path, out_dir: Path, types: Sequence[QuantType], *, threads: int = 0,
                    force: bool = False, allow_requantize: bool = False, family_name: Optional[str] = None,
                    provenance: Optional[str] = None, notes: Optional[dict] = None, source: Optional[str] = None,
                    progress: Optional[ProgressFn] = None, warn: Optional[WarnFn] = None,
                    out_label: str = "--out", f16_if_exact: bool = False, replace_other: bool = True) -> dict:
    """Make every requested variant of `base` in `out_dir` and write `manifest.json`. Returns the manifest.

    Nothing in `out_dir` changes until every new file is complete: new variants are written under temp
    names, then committed together with the manifest (family.journal.commit). Existing files are
    checked (GGUF parse, architecture, parameter count, type, vocabulary) before they are adopted. Warnings
    go to `warn` (none by default; the command edge prints them); progress to `progress`.

    The parent's renderings: the base's own is placed as it is; the F16 rendering of a BF16 base is made only
    when every weight comes back exactly (else InputError naming the tensor, or with `f16_if_exact` a warning
    and no F16 rendering); an F16 base is never rounded to BF16 (check_renderings).

    The family keeps its name (the manifest's) when it is made again of the same base; files of variants the new
    manifest no longer names are removed (remove_dropped). A folder holding a family of another base is rebuilt,
    unless `replace_other` is False: InputError then, and nothing changes. `source`: where the base came from (a
    model reference, a path), recorded in the manifest's base."""
    warn = warn or silent
    base = Path(base)
    info = read_info(base)
    check_base(info, types, allow_requantize)
    check_renderings(info, types)
    types = requantize_types(info, types, warn)
    if base_rendering(info) == OWN and OWN_TYPE not in types:  # a quantized base is always its family's parent
        types = [*types, OWN_TYPE]
        notes = {**(notes or {}), "parent": LOSSLESS_NOTE.format(file=base.name, type=parent_type(info))}
    if not 0 <= threads <= MAX_THREADS:
        raise InputError(f"--threads {threads}: must be between 0 (all cores) and {MAX_THREADS}")
    out_dir = check_folder_writable(Path(out_dir), out_label, create=True)
    with family_lock(out_dir):  # one update of a folder at a time; FamilyError while another runs
        journal.recover(out_dir, warn)
        remove_stale(out_dir)
        old, unusable = read_existing(out_dir)
        base_sha = sha256_file(base)
        old_base = old.get("base") if old and isinstance(old.get("base"), dict) else {}
        same_base = old is not None and old_base.get("sha256") == base_sha
        rebuild_all = old is not None and bool(old_base.get("sha256")) and not same_base
        stem = family_name or (_family_name(old) if same_base else None) or out_dir.resolve().name
        if rebuild_all and not replace_other:
            raise InputError(f"{out_dir} holds another family ({_family_name(old) or 'unnamed'}, made from "
                             f"{old_base.get('file') or 'another base'}, not from {base.name}); pass --force to "
                             "replace it, or make this one in another folder")
        if rebuild_all:
            warn(f"{out_dir} holds a family made from another base; rebuilding every variant")
        steps = plan_steps(base, info, out_dir, stem, types, force, base_sha, rebuild_all, warn)

        builds = [s for s in steps if s.action == "build"]
        needed_derive = sum(estimate_bytes(info, s.q) for s in steps if s.action == "derive")
        needed = sum(estimate_bytes(info, s.q) for s in builds) + needed_derive
        needed += sum(info.path.stat().st_size for s in steps if s.action == "place"
                      and base.stat().st_dev != out_dir.stat().st_dev)
        check_disk(out_dir, needed)
        _warn_without_parent(steps, old if same_base else None, warn)
        threads = threads or cores()
        staged: list[tuple[Path, Step]] = []
        try:
            if builds:
                log_fd = open_log(out_dir)  # this run's log only (the previous run's is replaced)
                try:
                    for s in builds:
                        quantize_one(base, s.dst, s.q, estimate_bytes(info, s.q), threads, allow_requantize,
                                     log_fd, progress, keep=_stager(staged, s))
                finally:
                    os.close(log_fd)
            for s in [s for s in steps if s.action == "derive"]:
                if derive_f16(base, s.dst, f16_if_exact, warn, progress, keep=_stager(staged, s)) is None:
                    steps.remove(s)
            for s in steps:
                if s.action == "place":
                    stage_copy(base, s.dst, keep=_stager(staged, s))
            now = datetime.now(UTC)
            variants = {}
            for s in steps:
                tmp = next((t for t, st in staged if st is s), None)
                of_base = s.q.name == base_rendering(info) and s.action in ("keep", "place")
                sha = base_sha if of_base else None
                kind = parent_type(info).lower() if s.q is OWN_TYPE else s.q.name
                variants[s.q.role] = variant_record(tmp or s.dst, kind, s.q.role, info.n_params, s.dst.name,
                                                    now if tmp else None, sha,
                                                    own_record(tmp or s.dst, info) if s.q is OWN_TYPE else None)
            own = next((s for s in steps if s.q.name == base_rendering(info) and s.action in ("keep", "place")), None)
            base_file = own.dst.name if own else str(base)
            manifest = build_manifest(old, same_base, stem, info, base_file, base_sha, base.stat().st_size, variants,
                                      provenance, notes, warn, source)
            if unusable:
                _set_aside(out_dir / MANIFEST, unusable, warn)
            journal.commit(out_dir, [(t, s.dst) for t, s in staged], manifest)
            removed = journal.remove_dropped(out_dir, old, manifest, spare=base, warn=warn)
            if removed:
                warn(f"removed {', '.join(removed)} from {out_dir}: the files of variants the manifest no longer names")
            if rebuild_all:  # another base's measured costs (a quantized parent's are its file's): measured again
                (out_dir / CALIBRATION).unlink(missing_ok=True)
        finally:
            for t, _ in staged:
                t.unlink(missing_ok=True)
    return manifest
