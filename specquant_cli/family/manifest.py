"""A quantized family on disk: manifest, roles -> variant files, provenance, verification.

A family is checked, not trusted: every variant path must be relative and stay inside the family folder
after resolving (no absolute path, no '..', no symlink out), and name the file itself (a symbolic link is
refused: the family must load once the folder is moved); a file's size, GGUF header, file type
(general.file_type against the record's type) and content fingerprint (fsutil.fingerprint, recorded at creation: a
few MiB at fixed offsets, not the modification time, which anyone can set back) are checked before it is used, its
sha256 by `verify` (doctor --verify, pull's "present" check). A record made before fingerprints were recorded is
checked as it was (size, header, type, a quantized parent's modification time): such a family loads as before. A
manifest that gives a key twice is refused.

Updates commit through a journal, holding the family's lock (flock on `.specquant.lock`; the kernel drops it
when its holder dies): new variant files are written under temp names first, then a journal
(`.specquant-commit.json`: the renames and the new manifest) is written atomically, the renames are done,
the old manifest kept as `manifest.json.prev` and the new one written. A process killed mid-commit leaves
the journal; the next load or quantize that finds the lock free verifies it (every rename one of our temp
files into a name the new manifest uses, every variant of the new manifest usable) and finishes it, or sets
it aside as `.specquant-commit.json.unusable`; so a family folder is always the old family or the new one,
complete.

Why one file of ~600 lines: the checks on reading and the journal's commit and recovery are one protocol over
the same files under the same lock; kept together they can be read against each other."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Optional

from specquant_cli.errors import FamilyError, ModelFileError
from specquant_cli.family.roles import PARENT_ROLE, RENDERINGS, ordered
from specquant_cli.family.variants import QUANT_TYPES
from specquant_cli.fsutil import TEMP_RE, fingerprint, fsync_dir, sha256_file, write_bytes_atomic, write_json_atomic
from specquant_cli.names import JOURNAL, LOCK, MANIFEST, PREV_MANIFEST, RESERVED, UNUSABLE_JOURNAL  # noqa: F401

MAX_MANIFEST_BYTES = 16 << 20  # a manifest is a few KiB; anything this large is not one


WarnFn = Callable[[str], None]  # a warning's text (the command edge prints it as "warning: …")


def silent(text: str) -> None:
    pass


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _read_json_object(path: Path) -> dict:
    """A JSON object from a regular file (not through a symlink); ValueError/OSError otherwise."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ValueError("it is a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    if st.st_size > MAX_MANIFEST_BYTES:
        raise ValueError(f"{st.st_size} bytes, too large for a manifest")
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"), object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 at byte {e.start}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    return data


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json's object_pairs_hook: a key given twice is refused (json.loads would keep the last silently)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def read_existing(root: Path) -> tuple[Optional[dict], Optional[str]]:
    """(manifest, None) when `root` holds a readable manifest object; (None, why) when one is there but
    unusable; (None, None) when there is none."""
    p = Path(root) / MANIFEST
    if not os.path.lexists(p):
        return None, None
    try:
        return _read_json_object(p), None
    except (OSError, ValueError) as e:
        return None, str(getattr(e, "strerror", None) or e)


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


# -- the family's lock: held while committing (and by quantize for its whole run) -----------------------
_held: dict[tuple, list] = {}  # (dev, inode, thread) of a lock file this process holds -> [fd, depth]
_held_guard = threading.Lock()
class LockUnavailable(FamilyError):
    """The lock file cannot be opened (a read-only folder): no update can be made here, nor be under way
    from this user."""


_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _open_lock(root: Path) -> int:
    path = root / LOCK
    try:
        fd = os.open(path, _LOCK_FLAGS, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FamilyError(f"{path} is a symbolic link; refusing to lock through it (remove it)") from None
        try:  # a read-only folder: an existing lock file can still be locked
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            raise LockUnavailable(f"{root}: cannot open the family's lock {LOCK} ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FamilyError(f"{path} is not a regular file; remove it")
    return fd


def _same_inode(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _acquire(root: Path) -> tuple[tuple, bool]:
    """(key, taken now) for the family's lock; FamilyError when another process holds it."""
    for _ in range(64):
        fd = _open_lock(root)
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, threading.get_ident())
        with _held_guard:
            if key in _held:  # this thread holds it already: re-entrant
                os.close(fd)
                _held[key][1] += 1
                return key, False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FamilyError(f"{root} is being updated by another process (it holds {LOCK}); "
                                  "try again when it has finished") from None
            raise FamilyError(f"{root}: cannot lock the family ({e.strerror})") from None
        if _same_inode(fd, root / LOCK):  # not a file its last holder removed while we opened it
            with _held_guard:
                _held[key] = [fd, 1]
            return key, True
        os.close(fd)
    raise FamilyError(f"{root}: cannot lock the family (its lock file keeps changing)")


def _release(root: Path, key: tuple) -> None:
    with _held_guard:
        entry = _held[key]
        entry[1] -= 1
        if entry[1]:
            return
        del _held[key]
    with contextlib.suppress(OSError):  # removed while held, so a folder is left as it was found
        os.unlink(root / LOCK)
    os.close(entry[0])  # the kernel releases the lock here, as it does when its holder dies, however


@contextlib.contextmanager
def family_lock(root: Path) -> Iterator[None]:
    """Hold the family folder's update lock (flock on its .specquant.lock, re-entrant within a thread).
    FamilyError when another process holds it. The kernel releases it when its holder dies."""
    root = Path(root)
    key, _ = _acquire(root)
    try:
        yield
    finally:
        _release(root, key)


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
    from specquant_cli.family.ggufio import header_problem

    if kind == "plan":
        try:
            _read_json_object(src)
        except (OSError, ValueError) as e:
            return f"{name}: not a grading plan ({getattr(e, 'strerror', None) or e})"
        return None
    why = header_problem(src)
    size = m["imatrix"].get("size_bytes")
    if not why and _is_int(size) and src.stat().st_size != size:
        why = f"{src.stat().st_size} bytes, the manifest says {size}"
    return f"{name}: {why}" if why else None


def _journal_problem(root: Path, j) -> Optional[str]:
    """Why a journal cannot be rolled forward: every rename a temp file of ours into a name the new manifest
    uses, and the new manifest complete (the parent there, every variant usable once the renames are done)."""
    m = j.get("manifest")
    if not isinstance(m, dict):
        return "no manifest"
    why = _structure_problem(m)
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
    future = Family(root, m, files)
    for role in future.stored_roles():
        why = future.problem(role)
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
        j = _read_json_object(root / JOURNAL)
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


def _structure_problem(m: dict) -> Optional[str]:
    variants = m.get("variants")
    if not isinstance(variants, dict) or not variants:
        return "manifest has no variants (needs \"variants\": {role: {...}})"
    hp = m.get("hparams", {})
    if not isinstance(hp, dict) or not all(_is_int(v) and v >= 0 for v in hp.values()):
        return "manifest \"hparams\" must map names to non-negative integers"
    for key, kind in (("family", str), ("architecture", str), ("base", dict), ("roles", dict)):
        if key in m and not isinstance(m[key], kind):
            return f"manifest \"{key}\" must be a JSON {'string' if kind is str else 'object'}"
    return None


def _check_structure(m: dict, mpath: Path) -> None:
    why = _structure_problem(m)
    if why:
        raise FamilyError(f"{mpath}: {why}")


def _wanted_type(v: dict) -> str:
    """The file type (general.file_type, as llama.cpp names it) a variant record promises: a sibling's as recorded,
    a quantized variant's from its type; "" for a recipe role (its type is a label)."""
    if isinstance(v.get("file_type"), str):  # a quantized parent's (family.quantize.own_record)
        return v["file_type"]
    sib = v.get("sibling")
    if isinstance(sib, dict):
        return sib["file_type"] if isinstance(sib.get("file_type"), str) else ""
    qtype = v.get("type")
    return qtype.upper() if isinstance(qtype, str) and qtype in QUANT_TYPES else ""


def _changed(rel: str, st: os.stat_result) -> str:
    return (f"{rel} changed on disk after the family was made (its content is not the one recorded; modified "
            f"{datetime.fromtimestamp(st.st_mtime, UTC).isoformat(timespec='seconds')}, a time that proves nothing); "
            f"its drafts and calibration were made for the file as it was: specquant quantize FILE --family FOLDER "
            f"makes the family of the file as it is now")


def _file_problem(full: Path, rel: str, size: int, want: str, mtime_ns=None, sha=None) -> Optional[str]:
    """Why the file of a variant record cannot be used: presence (the file itself, not a symbolic link), size,
    modification time where the record has one (a quantized parent's: when only it differs, as after a copy or a
    touch, the content is compared with the recorded sha256 instead), GGUF header, file type (a header read). The
    content fingerprint is Family.problem's (after these, which name what is wrong more exactly)."""
    from specquant_cli.family.ggufio import header_problem, read_file_type

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
    if _is_int(mtime_ns) and st.st_mtime_ns != mtime_ns and not (isinstance(sha, str) and sha256_file(full) == sha):
        return _changed(rel, st)
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


@dataclass
class Family:
    """A family folder and its manifest. `parent`: the rendering (`f16` or `bf16`, one the manifest holds) that the
    role `parent` names here — bound once per session (`bind`, from system.renderings.decide); None: the default
    rendering (`default_rendering`). Every role-taking method reads `parent` as that rendering's variant."""

    root: Path
    manifest: dict
    staged: dict[str, Path] = field(default_factory=dict)  # path -> the file a pending commit renames there
    parent: Optional[str] = None
    parent_why: str = ""  # why `parent` is the rendering bound (system.renderings.ParentChoice.why)

    @classmethod
    def load(cls, root: Path | str, warn: Optional[WarnFn] = None) -> Family:
        """The family at `root`, after finishing an update a killed process left half done (`recover`, which
        warns through `warn`)."""
        root = Path(root)
        if not root.exists():
            raise FamilyError(f"no model family at {root} (no such folder); fetch one with: "
                              "specquant pull smollm2-135m")
        if not root.is_dir():
            raise FamilyError(f"{root}: not a family folder (it is a file)")
        recover(root, warn)
        mpath = root / MANIFEST
        if not os.path.lexists(mpath):
            raise FamilyError(f"no model family at {root} (missing {MANIFEST}); "
                              f"fetch one with: specquant pull smollm2-135m")
        try:
            manifest = _read_json_object(mpath)
        except (OSError, ValueError) as e:
            raise FamilyError(f"{mpath}: unreadable manifest ({getattr(e, 'strerror', None) or e})") from None
        _check_structure(manifest, mpath)
        return cls(root, manifest)

    @property
    def name(self) -> str:
        name = self.manifest.get("family")
        return name if isinstance(name, str) and name else self.root.name

    @property
    def provenance(self) -> str:
        p = self.manifest.get("base", {}).get("provenance", "")
        return p if isinstance(p, str) else ""

    @property
    def source(self) -> str:
        """Where the base came from, as given: a model reference (hf:…, ollama:…, lmstudio:…), a file's path or a
        demo family's name; "" when the family recorded none (made before it was recorded)."""
        base = self.manifest.get("base")
        s = base.get("source", "") if isinstance(base, dict) else ""
        return s if isinstance(s, str) else ""

    @property
    def hparams(self) -> dict:
        return self.manifest.get("hparams", {})

    def renderings(self) -> list[str]:
        """The parent's renderings the manifest holds (f16 first, then bf16)."""
        return [r for r in RENDERINGS if r in self.manifest["variants"]]

    def default_rendering(self) -> Optional[str]:
        """The rendering `parent` names when none is bound: F16 when the family has it (the reference), else BF16."""
        have = self.renderings()
        return have[0] if have else None

    @property
    def parent_rendering(self) -> Optional[str]:
        return self.parent or self.default_rendering()

    def bind(self, rendering: str, why: str = "") -> Family:
        """This family with `rendering` as its parent, for the reason `why` (FamilyError when the manifest has no
        such rendering)."""
        if rendering not in self.renderings():
            have = ", ".join(self.renderings()) or "none"
            raise FamilyError(f"family {self.name} has no {rendering} rendering of its parent (it has: {have})")
        return replace(self, parent=rendering, parent_why=why)

    def _key(self, role: str) -> str:
        """The manifest key of `role`: the bound rendering for `parent`."""
        return (self.parent_rendering or role) if role == PARENT_ROLE else role

    def roles(self) -> list[str]:
        """The family's roles as plans name them: `parent` first (standing for its renderings), then the drafts
        (family.roles.ordered)."""
        stored = self.manifest["variants"]
        return ordered([PARENT_ROLE if r in RENDERINGS else r for r in stored])

    def stored_roles(self) -> list[str]:
        """Every variant the manifest records, the renderings included (what is checked, listed, hashed)."""
        return ordered(self.manifest["variants"])

    def variant(self, role: str) -> dict:
        key = self._key(role)
        v = self.manifest["variants"].get(key)
        if v is None:
            raise FamilyError(f"family {self.name} has no {role!r} variant (has: {', '.join(self.stored_roles())})")
        if not isinstance(v, dict):
            raise FamilyError(f"family {self.name}: the {key} variant's manifest record is not an object")
        return v

    def problem(self, role: str, hashes: bool = False, content: bool = True) -> Optional[str]:
        """Why the `role` variant cannot be used (path, presence, size, GGUF header and file type; then its content:
        the recorded fingerprint, fsutil.fingerprint, unless `content` is False; sha256 instead with `hashes`). A record
        without a fingerprint (a family made before they were recorded) is checked as it always was: size, header and
        type, and a quantized parent's modification time."""
        key = self._key(role)
        v = self.manifest["variants"].get(key)
        if v is None:
            return "its manifest record is null" if key in self.manifest["variants"] else "not in the manifest"
        if not isinstance(v, dict):
            return "its manifest record is not an object"
        full, why = safe_path(self.root, v.get("path"))
        if why:
            return why
        rel, size = v["path"], v.get("size_bytes")
        if not _is_int(size) or size < 0:
            return "its size_bytes is missing or not a non-negative integer"
        full = self.staged.get(rel, full)
        why = _file_problem(full, rel, size, _wanted_type(v), v.get("mtime_ns"), v.get("sha256"))
        if why:
            return why
        if not hashes:
            fp = v.get("fingerprint")
            if content and isinstance(fp, str) and fingerprint(full) != fp:
                return _changed(rel, os.stat(full))
            return None
        sha = v.get("sha256")
        if not isinstance(sha, str):
            return "no sha256 recorded"
        if sha256_file(full) != sha:
            return f"{rel}: sha256 differs from the manifest (the file changed or is corrupt)"
        return None

    def siblings(self) -> list[str]:
        """The sibling roles: smaller models of the parent's vocabulary that draft with their own KV cache
        (family.siblings; their record carries a "sibling" object: architecture, parameters, hyperparameters)."""
        return [r for r, v in self.manifest["variants"].items()
                if isinstance(v, dict) and isinstance(v.get("sibling"), dict)]

    def hparams_of(self, role: str) -> dict:
        """The hyperparameters of `role`'s network (what its KV cache is sized from), read from its file's header
        (ggufio.read_hparams: a sibling's are its own network's), never from the manifest's copy; the manifest's only
        while the file cannot be read (then it cannot be loaded either, and says why when asked)."""
        from specquant_cli.family.ggufio import read_hparams

        v = self.manifest["variants"].get(self._key(role))
        full, why = safe_path(self.root, v.get("path")) if isinstance(v, dict) else (None, "no record")
        if not why:
            try:
                return read_hparams(self.staged.get(v["path"], full))
            except ModelFileError:
                pass
        sib = v.get("sibling") if isinstance(v, dict) else None
        hp = sib.get("hparams") if isinstance(sib, dict) else None
        if isinstance(hp, dict) and all(_is_int(x) and x >= 0 for x in hp.values()):
            return hp
        return self.hparams

    def path(self, role: str) -> Path:
        """The checked path of a variant's file; FamilyError naming the reason when it cannot be used."""
        v = self.variant(role)
        why = self.problem(role)
        if why:
            raise FamilyError(f"family {self.name}: {self._key(role)} variant unusable: {why}; "
                              f"see specquant doctor --family {self.root}")
        return self.root / v["path"]

    def size(self, role: str) -> int:
        size = self.variant(role).get("size_bytes")
        if not _is_int(size) or size < 0:
            raise FamilyError(f"family {self.name}: the {role} variant has no valid size_bytes")
        return size

    def check(self, hashes: bool = False, deep: bool = False) -> dict[str, Optional[str]]:
        """role -> problem (None when fine). `deep` parses each GGUF and compares architecture, parameter
        count, type and vocabulary with the manifest and the parent; `hashes` adds sha256."""
        from specquant_cli.family.ggufio import read_info

        out: dict[str, Optional[str]] = {role: self.problem(role, hashes, content=not deep)
                                         for role in self.stored_roles()}
        if not deep:
            return out
        infos = {}
        for role, why in out.items():
            if why is None:
                try:
                    infos[role] = read_info(self.root / self.manifest["variants"][role]["path"])
                except ModelFileError as e:
                    out[role] = str(e)
        parent = next((infos[r] for r in RENDERINGS if r in infos), None)
        for role, info in infos.items():
            v = self.manifest["variants"][role]
            own = v.get("sibling") if isinstance(v.get("sibling"), dict) else self.manifest
            arch, n_params = own.get("architecture"), own.get("n_params")
            want = _wanted_type(v)
            if arch and info.arch != arch:
                out[role] = f"{v['path']}: architecture {info.arch}, the family is {arch}"
            elif _is_int(n_params) and info.n_params != n_params:
                out[role] = f"{v['path']}: {info.n_params} parameters, the family has {n_params}"
            elif want and info.file_type and info.file_type != want:
                out[role] = f"{v['path']}: its weights are {info.file_type}, the manifest says {want}"
            elif parent is not None and info.vocab_sha256 != parent.vocab_sha256:
                out[role] = f"{v['path']}: its vocabulary differs from the parent's"
        for role in infos:  # the content last: a file replaced by another is named by what differs first
            if out[role] is None and not hashes:
                out[role] = self.problem(role)
        return out

    def verify(self, hashes: bool = True) -> list[str]:
        """Problems found, one line per broken variant (empty when every variant checks out)."""
        return [f"{role}: {why}" for role, why in self.check(hashes=hashes).items() if why]
