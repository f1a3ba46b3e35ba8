"""A quantized family on disk (`Family`): its manifest's roles -> variant files, provenance, and verification.

A family is checked, not trusted (family.checks): every variant path must be relative and stay inside the family
folder after resolving (no absolute path, no '..', no symlink out), and name the file itself (a symbolic link is
refused: the family must load once the folder is moved); a file's size, GGUF header, file type (general.file_type
against the record's type) and content fingerprint (fsutil.fingerprint, recorded at creation: a few MiB at fixed
offsets, not the modification time, which anyone can set back) are checked before it is used, its sha256 by
`verify` (doctor --verify, pull's "present" check). A record made before fingerprints were recorded is checked as
it was (size, header, type, a quantized parent's modification time): such a family loads as before. A manifest
that gives a key twice is refused (family.manifest_file). Loading first finishes an update a killed process left
half done (family.journal)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from specquant_cli.errors import FamilyError, ModelFileError
from specquant_cli.family.checks import check_structure, record_problem, safe_path, wanted_type
from specquant_cli.family.journal import recover
from specquant_cli.family.manifest_file import WarnFn, is_int, read_json_object
from specquant_cli.family.roles import PARENT_ROLE, RENDERINGS, ordered
from specquant_cli.names import MANIFEST


@dataclass
class Family:
    """A family folder and its manifest. `parent`: the rendering (`f16` or `bf16`, one the manifest holds) that the
    role `parent` names here — bound once per session (`bind`, from system.renderings.decide); None: the default
    rendering (`default_rendering`). Every role-taking method reads `parent` as that rendering's variant."""

    root: Path
    manifest: dict
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
            manifest = read_json_object(mpath)
        except (OSError, ValueError) as e:
            raise FamilyError(f"{mpath}: unreadable manifest ({getattr(e, 'strerror', None) or e})") from None
        check_structure(manifest, mpath)
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
        return record_problem(self.root, self.manifest["variants"], self._key(role), hashes=hashes, content=content)

    def siblings(self) -> list[str]:
        """The sibling roles: smaller models of the parent's vocabulary that draft with their own KV cache
        (family.siblings; their record carries a "sibling" object: architecture, parameters, hyperparameters)."""
        return [r for r, v in self.manifest["variants"].items()
                if isinstance(v, dict) and isinstance(v.get("sibling"), dict)]

    def hparams_of(self, role: str) -> dict:
        """The hyperparameters of `role`'s network (what its KV cache is sized from), read from its file's header
        (gguf_walk.read_hparams: a sibling's are its own network's), never from the manifest's copy; the manifest's only
        while the file cannot be read (then it cannot be loaded either, and says why when asked)."""
        from specquant_cli.family.gguf_walk import read_hparams

        v = self.manifest["variants"].get(self._key(role))
        full, why = safe_path(self.root, v.get("path")) if isinstance(v, dict) else (None, "no record")
        if not why:
            try:
                return read_hparams(full)
            except ModelFileError:
                pass
        sib = v.get("sibling") if isinstance(v, dict) else None
        hp = sib.get("hparams") if isinstance(sib, dict) else None
        if isinstance(hp, dict) and all(is_int(x) and x >= 0 for x in hp.values()):
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
        if not is_int(size) or size < 0:
            raise FamilyError(f"family {self.name}: the {role} variant has no valid size_bytes")
        return size

    def check(self, hashes: bool = False, deep: bool = False) -> dict[str, Optional[str]]:
        """role -> problem (None when fine). `deep` parses each GGUF and compares architecture, parameter
        count, type and vocabulary with the manifest and the parent; `hashes` adds sha256."""
        from specquant_cli.family.gguf_read import read_info

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
            want = wanted_type(v)
            if arch and info.arch != arch:
                out[role] = f"{v['path']}: architecture {info.arch}, the family is {arch}"
            elif is_int(n_params) and info.n_params != n_params:
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
