"""A quantized family on disk: manifest, roles -> variant files, provenance, verification.

A family is checked, not trusted: every variant path must be relative and stay inside the family folder
after resolving (no absolute path, no '..', no symlink out); a file's size and GGUF header are checked
before it is used, its sha256 by `verify` (doctor --verify, pull's "present" check).

Updates commit through a journal: new variant files are written under temp names first, then a journal
(`.specquant-commit.json`: the renames and the new manifest) is written atomically, the renames are done
and the manifest replaced. A process killed mid-commit leaves the journal; the next load or quantize
finishes it, so a family folder is always the old family or the new one, complete."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specquant_cli.errors import FamilyError, ModelFileError
from specquant_cli.fsutil import TEMP_RE, fsync_dir, pid_alive, sha256_file, write_json_atomic

MANIFEST = "manifest.json"
JOURNAL = ".specquant-commit.json"
ROLES = ("q4", "q8", "f16")
DEFAULT_FAMILY_DIR = Path("models") / "smollm2-135m"
MAX_MANIFEST_BYTES = 16 << 20  # a manifest is a few KiB; anything this large is not one


def _warn(text: str) -> None:
    from specquant_cli.console import err

    err.print(f"warning: {text}", markup=False)


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
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 at byte {e.start}") from None
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    return data


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
    """Rename finished temp files into place and write the manifest, as one recoverable step."""
    from specquant_cli.interrupts import deferred

    root = Path(root)
    journal = {"pid": os.getpid(), "renames": [[Path(t).name, Path(f).name] for t, f in renames],
               "manifest": manifest}
    with deferred():  # Ctrl-C / SIGTERM wait the few milliseconds this takes; SIGKILL is what the journal is for
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
    fsync_dir(root)
    write_json_atomic(root / MANIFEST, journal["manifest"])
    os.unlink(root / JOURNAL)
    fsync_dir(root)


def _journal_problem(j) -> Optional[str]:
    if not isinstance(j, dict) or not _is_int(j.get("pid")):
        return "no pid"
    if not isinstance(j.get("manifest"), dict) or not isinstance(j["manifest"].get("variants"), dict):
        return "no manifest"
    ren = j.get("renames")
    if not isinstance(ren, list):
        return "no renames"
    for pair in ren:
        if not (isinstance(pair, list) and len(pair) == 2 and all(_plain_name(n) for n in pair)
                and TEMP_RE.match(pair[0])):
            return f"bad rename {pair!r}"
    return None


def recover(root: Path) -> bool:
    """Finish an update that a killed process left mid-commit. True when one was finished."""
    root = Path(root)
    jpath = root / JOURNAL
    if not os.path.lexists(jpath):
        return False
    try:
        j = _read_json_object(jpath)
        why = _journal_problem(j)
    except (OSError, ValueError) as e:
        why = str(e)
    if why:
        try:
            os.unlink(jpath)
        except OSError:
            pass
        _warn(f"{jpath}: ignored an invalid update journal ({why})")
        return False
    if j["pid"] != os.getpid() and pid_alive(j["pid"]):
        raise FamilyError(f"{root} is being updated by process {j['pid']}; try again when it has finished")
    lost = [t for t, f in j["renames"] if not os.path.lexists(root / t) and not os.path.lexists(root / f)]
    if lost:
        os.unlink(jpath)
        _warn(f"{root}: an interrupted update could not be finished ({lost[0]} is gone); "
              "run specquant quantize again")
        return False
    try:
        _roll_forward(root, j)
    except OSError as e:
        raise FamilyError(f"{root}: an interrupted update could not be finished ({e.strerror}); "
                          "run specquant quantize again with write access") from None
    _warn(f"{root}: finished an update that an interrupted process left half done")
    return True


# -- path safety --------------------------------------------------------------------------------------
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


def _check_structure(m: dict, mpath: Path) -> None:
    variants = m.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise FamilyError(f"{mpath}: manifest has no variants (needs \"variants\": {{role: {{...}}}})")
    hp = m.get("hparams", {})
    if not isinstance(hp, dict) or not all(_is_int(v) and v >= 0 for v in hp.values()):
        raise FamilyError(f"{mpath}: manifest \"hparams\" must map names to non-negative integers")
    for key, kind in (("family", str), ("architecture", str), ("base", dict), ("roles", dict)):
        if key in m and not isinstance(m[key], kind):
            raise FamilyError(f"{mpath}: manifest \"{key}\" must be a JSON {'string' if kind is str else 'object'}")


@dataclass
class Family:
    root: Path
    manifest: dict

    @classmethod
    def load(cls, root: Path | str) -> Family:
        root = Path(root)
        if not root.exists():
            raise FamilyError(f"no model family at {root} (no such folder); fetch one with: "
                              "specquant pull smollm2-135m")
        if not root.is_dir():
            raise FamilyError(f"{root}: not a family folder (it is a file)")
        recover(root)
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
    def hparams(self) -> dict:
        return self.manifest.get("hparams", {})

    def roles(self) -> list[str]:
        return [r for r in ROLES if r in self.manifest["variants"]] + \
               [r for r in self.manifest["variants"] if r not in ROLES]

    def variant(self, role: str) -> dict:
        v = self.manifest["variants"].get(role)
        if v is None:
            raise FamilyError(f"family {self.name} has no {role!r} variant (has: {', '.join(self.roles())})")
        if not isinstance(v, dict):
            raise FamilyError(f"family {self.name}: the {role} variant's manifest record is not an object")
        return v

    def problem(self, role: str, hashes: bool = False) -> Optional[str]:
        """Why the `role` variant cannot be used (path, presence, size, GGUF header; sha256 with `hashes`)."""
        from specquant_cli.family.ggufio import header_problem

        v = self.manifest["variants"].get(role)
        if v is None:
            return "its manifest record is null" if role in self.manifest["variants"] else "not in the manifest"
        if not isinstance(v, dict):
            return "its manifest record is not an object"
        full, why = safe_path(self.root, v.get("path"))
        if why:
            return why
        rel, size = v["path"], v.get("size_bytes")
        if not _is_int(size) or size < 0:
            return "its size_bytes is missing or not a non-negative integer"
        try:
            st = os.stat(full)
        except FileNotFoundError:
            return f"{rel} is missing"
        except OSError as e:
            return f"{rel}: {e.strerror}"
        if not stat.S_ISREG(st.st_mode):
            return f"{rel} is not a regular file"
        if st.st_size != size:
            return f"{rel} is {st.st_size} bytes, the manifest says {size} (truncated or replaced)"
        hp = header_problem(full)
        if hp:
            return f"{rel}: {hp}"
        if hashes:
            sha = v.get("sha256")
            if not isinstance(sha, str):
                return "no sha256 recorded"
            if sha256_file(full) != sha:
                return f"{rel}: sha256 differs from the manifest (the file changed or is corrupt)"
        return None

    def path(self, role: str) -> Path:
        """The checked path of a variant's file; FamilyError naming the reason when it cannot be used."""
        self.variant(role)
        why = self.problem(role)
        if why:
            raise FamilyError(f"family {self.name}: {role} variant unusable: {why}; "
                              f"see specquant doctor --family {self.root}")
        return self.root / self.manifest["variants"][role]["path"]

    def size(self, role: str) -> int:
        size = self.variant(role).get("size_bytes")
        if not _is_int(size) or size < 0:
            raise FamilyError(f"family {self.name}: the {role} variant has no valid size_bytes")
        return size

    def check(self, hashes: bool = False, deep: bool = False) -> dict[str, Optional[str]]:
        """role -> problem (None when fine). `deep` parses each GGUF and compares architecture, parameter
        count, type and vocabulary with the manifest and the parent; `hashes` adds sha256."""
        from specquant_cli.family.ggufio import read_info
        from specquant_cli.family.quantize import QUANT_TYPES

        out: dict[str, Optional[str]] = {role: self.problem(role, hashes) for role in self.roles()}
        if not deep:
            return out
        infos = {}
        for role, why in out.items():
            if why is None:
                try:
                    infos[role] = read_info(self.root / self.manifest["variants"][role]["path"])
                except ModelFileError as e:
                    out[role] = str(e)
        parent = infos.get("f16")
        for role, info in infos.items():
            v = self.manifest["variants"][role]
            arch, n_params = self.manifest.get("architecture"), self.manifest.get("n_params")
            want = str(v["type"]).upper() if v.get("type") in QUANT_TYPES else ""  # recipe roles carry a label
            if arch and info.arch != arch:
                out[role] = f"{v['path']}: architecture {info.arch}, the family is {arch}"
            elif _is_int(n_params) and info.n_params != n_params:
                out[role] = f"{v['path']}: {info.n_params} parameters, the family has {n_params}"
            elif want and info.file_type and info.file_type != want:
                out[role] = f"{v['path']}: its weights are {info.file_type}, the manifest says {want}"
            elif parent is not None and role != "f16" and info.vocab_sha256 != parent.vocab_sha256:
                out[role] = f"{v['path']}: its vocabulary differs from the f16 parent's"
        return out

    def verify(self, hashes: bool = True) -> list[str]:
        """Problems found, one line per broken variant (empty when every variant checks out)."""
        return [f"{role}: {why}" for role, why in self.check(hashes=hashes).items() if why]
