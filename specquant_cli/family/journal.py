"""A family's updates, committed through a journal under its lock: new variant files are written under temp names
first, then a journal (`.specquant-commit.json`: the renames and the new manifest) is written atomically, the
renames are done, the old manifest kept as `manifest.json.prev` and the new one written (`commit`). A process killed
mid-commit leaves the journal; the next load or quantize that finds the lock free verifies it (every rename one of
our temp files into a name the new manifest uses, every variant of the new manifest usable) and finishes it, or sets
it aside as `.specquant-commit.json.unusable` (`recover`); so a family folder is always the old family or the new
one, complete. Also what a commit leaves behind: the names in use, the files of dropped variants."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Optional

from specquant_cli.errors import FamilyError
from specquant_cli.family.checks import record_problem, structure_problem
from specquant_cli.family.lock import LockUnavailable, family_lock
from specquant_cli.family.manifest_file import MAX_MANIFEST_BYTES, WarnFn, is_int, read_json_object, silent
from specquant_cli.family.roles import RENDERINGS, ordered
from specquant_cli.fsutil import TEMP_RE, fsync_dir, write_bytes_atomic, write_json_atomic
from specquant_cli.names import JOURNAL, MANIFEST, PREV_MANIFEST, RESERVED, UNUSABLE_JOURNAL


# -- commit journal ---------------------------------------------------------------------------------
def _plain_name(n) -> bool:
    return isinstance(n, str) and n not in ("", ".", "..") and "/" not in n and "\0" not in n and os.sep not in n


def commit(root: Path, renames: list[tuple[Path, Path]], manifest: dict) -> None:
    """Rename finished temp files into place and write the manifest, as one recoverable step, holding the
    family's lock (FamilyError when another process holds it: nothing is changed then)."""
    from specquant_cli.interrupts import deferred

    root = Path(root)
    journal = {"pid": os.getpid(), "renames": [[Path(t).name, Path(f).name] for t, f in renames],
               "manifest": manifest}
    # Ctrl-C / SIGTERM wait the milliseconds this takes; SIGKILL is what the journal is for
    with family_lock(root), deferred():
        try:
            write_json_atomic(root / JOURNAL, journal)
        except OSError as e:
            raise FamilyError(f"{root}: cannot write the update journal ({e.strerror}); nothing was changed") \
                from None
        try:
            _roll_forward(root, journal)
        except OSError as e:
            raise FamilyError(f"{root}: the update stopped half way ({e.strerror}); its journal "
                              f"{JOURNAL} lets the next command that can write here finish it") from None


def _roll_forward(root: Path, journal: dict) -> None:
    for tmp, final in journal["renames"]:
        if os.path.lexists(root / tmp):
            os.replace(root / tmp, root / final)
            if os.path.lexists(root / tmp):  # both were links to one file: rename(2) then leaves both
                os.unlink(root / tmp)
    fsync_dir(root)
    _keep_previous(root, journal["manifest"])
    write_json_atomic(root / MANIFEST, journal["manifest"])
    os.unlink(root / JOURNAL)
    fsync_dir(root)


def _keep_previous(root: Path, new: dict) -> None:
    """The manifest about to be replaced, kept as manifest.json.prev (unless it already is the new one: a commit
    that died after writing it is being finished)."""
    mpath = root / MANIFEST
    try:
        st = os.lstat(mpath)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
        return
    data = mpath.read_bytes()
    try:
        if json.loads(data) == new:
            return
    except (ValueError, RecursionError):
        pass
    write_bytes_atomic(root / PREV_MANIFEST, data)


# -- recovery: a journal is verified, never trusted ---------------------------------------------------------
def _rename_problem(root: Path, pair, files: dict[str, Path]) -> Optional[str]:
    """Why one [temp, final] pair of a journal cannot be done; records final -> the file that will be there."""
    if not (isinstance(pair, list) and len(pair) == 2 and all(_plain_name(n) for n in pair)):
        return f"bad rename {pair!r}"
    tmp, final = pair
    m = TEMP_RE.match(tmp)
    if not m or m.group("name") != final or TEMP_RE.match(final) or final in RESERVED:
        return f"bad rename {tmp!r} -> {final!r}"
    if final in files:
        return f"{final} is renamed to twice"
    src = root / tmp if os.path.lexists(root / tmp) else root / final  # else renamed already
    try:
        st = os.lstat(src)
    except OSError:
        return f"{tmp} is gone"
    if not stat.S_ISREG(st.st_mode):
        return f"{src.name} is not a regular file"
    files[final] = src
    return None


def _named_files(m: dict) -> dict[str, str]:
    """Files a manifest names besides the variants: name -> kind (imatrix, plan)."""
    named = {}
    imx = m.get("imatrix")
    if isinstance(imx, dict) and isinstance(imx.get("file"), str):
        named[imx["file"]] = "imatrix"
    for v in m["variants"].values():
        grade = v.get("grade") if isinstance(v, dict) else None
        if isinstance(grade, dict) and isinstance(grade.get("plan_file"), str):
            named[grade["plan_file"]] = "plan"
    return named


def _other_file_problem(m: dict, name: str, kind: str, src: Path) -> Optional[str]:
    from specquant_cli.family.gguf_read import header_problem

    if kind == "plan":
        try:
            read_json_object(src)
        except (OSError, ValueError) as e:
            return f"{name}: not a grading plan ({getattr(e, 'strerror', None) or e})"
        return None
    why = header_problem(src)
    size = m["imatrix"].get("size_bytes")
    if not why and is_int(size) and src.stat().st_size != size:
        why = f"{src.stat().st_size} bytes, the manifest says {size}"
    return f"{name}: {why}" if why else None


def _journal_problem(root: Path, j) -> Optional[str]:
    """Why a journal cannot be rolled forward: every rename a temp file of ours into a name the new manifest
    uses, and the new manifest complete (the parent there, every variant usable once the renames are done)."""
    m = j.get("manifest")
    if not isinstance(m, dict):
        return "no manifest"
    why = structure_problem(m)
    if why:
        return f"its manifest: {why}"
    if not any(r in m["variants"] for r in RENDERINGS):
        return f"its manifest has no parent ({' or '.join(RENDERINGS)} variant)"
    renames = j.get("renames")
    if not isinstance(renames, list):
        return "no renames"
    files: dict[str, Path] = {}
    for pair in renames:
        why = _rename_problem(root, pair, files)
        if why:
            return why
    for role in ordered(m["variants"]):
        why = record_problem(root, m["variants"], role, files)
        if why:
            return f"its {role} variant: {why}"
    named = _named_files(m)
    variant_paths = {v.get("path") for v in m["variants"].values()}
    for final, src in files.items():
        if final in variant_paths:
            continue
        if final not in named:
            return f"it renames a file to {final}, which its manifest does not name"
        why = _other_file_problem(m, final, named[final], src)
        if why:
            return why
    return None


def _set_aside(root: Path, why: str, warn: WarnFn) -> None:
    """An unusable journal is not obeyed nor thrown away: kept as .specquant-commit.json.unusable."""
    try:
        os.replace(root / JOURNAL, root / UNUSABLE_JOURNAL)
        kept = f"kept as {UNUSABLE_JOURNAL}"
    except OSError as e:
        kept = f"it could not be moved aside: {e.strerror}"
    warn(f"{root / JOURNAL}: ignored an invalid update journal ({why}); the family is unchanged, {kept}")


def _read_journal(root: Path) -> tuple[Optional[dict], Optional[str]]:
    try:
        j = read_json_object(root / JOURNAL)
    except (OSError, ValueError) as e:
        return None, str(getattr(e, "strerror", None) or e)
    return j, _journal_problem(root, j)


def recover(root: Path, warn: Optional[WarnFn] = None) -> bool:
    """Finish an update that a killed process left mid-commit, once its journal checks out. True when one was
    finished (said through `warn`, as is a journal ignored). FamilyError while another process holds the
    family's lock (its update is under way)."""
    root = Path(root)
    warn = warn or silent
    if not os.path.lexists(root / JOURNAL):
        return False
    try:
        with family_lock(root):
            if not os.path.lexists(root / JOURNAL):  # its writer finished it meanwhile
                return False
            j, why = _read_journal(root)
            if why:
                _set_aside(root, why, warn)
                return False
            try:
                _roll_forward(root, j)
            except OSError as e:
                raise FamilyError(f"{root}: an interrupted update could not be finished ({e.strerror}); "
                                  "run specquant quantize again with write access") from None
    except LockUnavailable as e:
        return _cannot_recover(root, e, warn)
    warn(f"{root}: finished an update that an interrupted process left half done")
    return True


def _cannot_recover(root: Path, e: LockUnavailable, warn: WarnFn) -> bool:
    """A folder we cannot write: an invalid journal is ignored (left there), a valid one is an error."""
    _, why = _read_journal(root)
    if why:
        warn(f"{root / JOURNAL}: ignored an invalid update journal ({why}); the family is unchanged, the journal "
              f"left there (the folder cannot be written)")
        return False
    raise FamilyError(f"{e}: an interrupted update cannot be finished; run specquant quantize again with "
                      "write access") from None


# -- the files a manifest names, and those it no longer does ------------------------------------------------
def names_in_use(manifest: dict, but: str = "") -> set[str]:
    """The family folder's file names a manifest uses (every variant's but `but`'s, the imatrix, grading plans) and
    its own files."""
    names = set(RESERVED)
    variants = manifest.get("variants") if isinstance(manifest.get("variants"), dict) else {}
    for role, v in variants.items():
        if role != but and isinstance(v, dict) and isinstance(v.get("path"), str):
            names.add(v["path"])
    imx = manifest.get("imatrix")
    if isinstance(imx, dict) and isinstance(imx.get("file"), str):
        names.add(imx["file"])
    for v in variants.values():
        grade = v.get("grade") if isinstance(v, dict) else None
        if isinstance(grade, dict) and isinstance(grade.get("plan_file"), str):
            names.add(grade["plan_file"])
    return names


def remove_dropped(root: Path, old: Optional[dict], new: dict, spare: Optional[Path] = None,
                   warn: Optional[WarnFn] = None) -> list[str]:
    """Remove the files of `old`'s variant records that the committed manifest `new` no longer names (a variant
    replaced by a file of another name, or dropped): only what the family made itself — a plain GGUF file name of
    this folder, a regular file (a link is never followed) — and never the base the user gave (the record of the
    old base's content or of the quantized parent as it is: when it lies in the folder, it is the user's own file;
    nor `spare`, the base given now). Returns the names removed; one that cannot be is a warning."""
    from specquant_cli.family.roles import OWN

    if not isinstance(old, dict) or not isinstance(old.get("variants"), dict):
        return []
    base = old.get("base") if isinstance(old.get("base"), dict) else {}
    used, removed = names_in_use(new), []
    for role, v in old["variants"].items():
        name = v.get("path") if isinstance(v, dict) else None
        if not _plain_name(name) or not name.endswith(".gguf") or name in used or role == OWN \
                or (base.get("sha256") and v.get("sha256") == base.get("sha256")):
            continue
        path = Path(root) / name
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or (spare is not None and os.path.exists(spare)
                                                and os.path.samefile(path, spare)):
                continue
            os.unlink(path)
            removed.append(name)
        except FileNotFoundError:
            continue
        except OSError as e:
            (warn or silent)(f"{path}: the file of the dropped {role} variant could not be removed ({e.strerror}); "
                             "remove it by hand")
    if removed:
        fsync_dir(Path(root))
    return removed
