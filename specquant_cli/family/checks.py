"""The checks a family's files pass before use: a variant path relative and inside the folder (`safe_path`), the
manifest's structure, and a file's size, GGUF header, type and content fingerprint against its record
(`file_problem`)."""

from __future__ import annotations

import os
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Optional

from specquant_cli.errors import FamilyError, ModelFileError
from specquant_cli.family.manifest_file import is_int
from specquant_cli.family.variants import QUANT_TYPES
from specquant_cli.fsutil import fingerprint, sha256_file


# -- path safety and variant files ---------------------------------------------------------------------
def safe_path(root: Path, rel) -> tuple[Optional[Path], Optional[str]]:
    """(root/rel, None) when `rel` is a relative path that stays inside `root` once resolved, else (None, why)."""
    if not isinstance(rel, str) or not rel.strip():
        return None, "no file path recorded"
    if "\0" in rel:
        return None, "its path contains a NUL byte"
    if os.path.isabs(rel) or rel.startswith(("/", "\\")):
        return None, f"path {rel!r} is absolute; variant paths must be relative to the family folder"
    if ".." in Path(rel).parts or ".." in rel.replace("\\", "/").split("/"):
        return None, f"path {rel!r} climbs out of the family folder ('..')"
    full = Path(root) / rel
    try:
        resolved, inside = full.resolve(), Path(root).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        return None, f"path {rel!r} cannot be resolved ({e})"
    if resolved != inside and inside not in resolved.parents:
        return None, f"path {rel!r} leads out of the family folder through a symbolic link (to {resolved})"
    return full, None


def structure_problem(m: dict) -> Optional[str]:
    variants = m.get("variants")
    if not isinstance(variants, dict) or not variants:
        return "manifest has no variants (needs \"variants\": {role: {...}})"
    hp = m.get("hparams", {})
    if not isinstance(hp, dict) or not all(is_int(v) and v >= 0 for v in hp.values()):
        return "manifest \"hparams\" must map names to non-negative integers"
    for key, kind in (("family", str), ("architecture", str), ("base", dict), ("roles", dict)):
        if key in m and not isinstance(m[key], kind):
            return f"manifest \"{key}\" must be a JSON {'string' if kind is str else 'object'}"
    return None


def check_structure(m: dict, mpath: Path) -> None:
    why = structure_problem(m)
    if why:
        raise FamilyError(f"{mpath}: {why}")


def wanted_type(v: dict) -> str:
    """The file type (general.file_type, as llama.cpp names it) a variant record promises: a sibling's as recorded,
    a quantized variant's from its type; "" for a recipe role (its type is a label)."""
    if isinstance(v.get("file_type"), str):  # a quantized parent's (family.quantize.own_record)
        return v["file_type"]
    sib = v.get("sibling")
    if isinstance(sib, dict):
        return sib["file_type"] if isinstance(sib.get("file_type"), str) else ""
    qtype = v.get("type")
    return qtype.upper() if isinstance(qtype, str) and qtype in QUANT_TYPES else ""


def changed_problem(rel: str, st: os.stat_result) -> str:
    return (f"{rel} changed on disk after the family was made (its content is not the one recorded; modified "
            f"{datetime.fromtimestamp(st.st_mtime, UTC).isoformat(timespec='seconds')}, a time that proves nothing); "
            f"its drafts and calibration were made for the file as it was: specquant quantize FILE --family FOLDER "
            f"makes the family of the file as it is now")


def file_problem(full: Path, rel: str, size: int, want: str, mtime_ns=None, sha=None) -> Optional[str]:
    """Why the file of a variant record cannot be used: presence (the file itself, not a symbolic link), size,
    modification time where the record has one (a quantized parent's: when only it differs, as after a copy or a
    touch, the content is compared with the recorded sha256 instead), GGUF header, file type (a header read). The
    content fingerprint is Family.problem's (after these, which name what is wrong more exactly)."""
    from specquant_cli.family.gguf_read import header_problem
    from specquant_cli.family.gguf_walk import read_file_type

    try:
        st = os.lstat(full)
        if stat.S_ISLNK(st.st_mode):
            return (f"{rel} is a symbolic link (to {os.readlink(full)}), not the file itself: a family holds its own "
                    "files, so that it loads wherever the folder goes; replace the link by a copy of its target")
        st = os.stat(full)
    except FileNotFoundError:
        return f"{rel} is missing"
    except OSError as e:
        return f"{rel}: {e.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{rel} is not a regular file"
    if st.st_size != size:
        return f"{rel} is {st.st_size} bytes, the manifest says {size} (truncated or replaced)"
    if is_int(mtime_ns) and st.st_mtime_ns != mtime_ns and not (isinstance(sha, str) and sha256_file(full) == sha):
        return changed_problem(rel, st)
    hp = header_problem(full)
    if hp:
        return f"{rel}: {hp}"
    try:
        got = read_file_type(full) if want else ""
    except ModelFileError as e:
        return f"{rel}: {str(e).removeprefix(f'{full}: ')}"
    if got and got != want:
        return f"{rel}: its weights are {got}, the manifest says {want}"
    return None


def record_problem(root: Path, variants: dict, key: str, staged: Optional[dict[str, Path]] = None,
                   hashes: bool = False, content: bool = True) -> Optional[str]:
    """Why the variant `key` of a manifest's `variants` cannot be used (path, presence, size, GGUF header and file
    type; then its content: the recorded fingerprint, fsutil.fingerprint, unless `content` is False; sha256 instead
    with `hashes`). A record without a fingerprint (a family made before they were recorded) is checked as it always
    was: size, header and type, and a quantized parent's modification time. `staged`: path -> the file a pending
    commit renames there (the journal's check of the family it will make)."""
    v = variants.get(key)
    if v is None:
        return "its manifest record is null" if key in variants else "not in the manifest"
    if not isinstance(v, dict):
        return "its manifest record is not an object"
    full, why = safe_path(root, v.get("path"))
    if why:
        return why
    rel, size = v["path"], v.get("size_bytes")
    if not is_int(size) or size < 0:
        return "its size_bytes is missing or not a non-negative integer"
    full = staged.get(rel, full) if staged else full
    why = file_problem(full, rel, size, wanted_type(v), v.get("mtime_ns"), v.get("sha256"))
    if why:
        return why
    if not hashes:
        fp = v.get("fingerprint")
        if content and isinstance(fp, str) and fingerprint(full) != fp:
            return changed_problem(rel, os.stat(full))
        return None
    sha = v.get("sha256")
    if not isinstance(sha, str):
        return "no sha256 recorded"
    if sha256_file(full) != sha:
        return f"{rel}: sha256 differs from the manifest (the file changed or is corrupt)"
    return None
