"""A quantized family on disk: manifest, roles -> variant files, provenance, verification."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specquant_cli.errors import FamilyError
from specquant_cli.fsutil import sha256_file, write_json_atomic

MANIFEST = "manifest.json"
ROLES = ("q4", "q8", "f16")
DEFAULT_FAMILY_DIR = Path("models") / "smollm2-135m"


def build_manifest(name: str, info, base_path: Path, out_dir: Path, variants: dict,
                   provenance: Optional[str], notes: dict) -> dict:
    return {
        "schema": 1,
        "family": name,
        "architecture": info.arch,
        "n_params": info.n_params,
        "hparams": info.hparams,
        "base": {
            "file": str(base_path.relative_to(out_dir)) if base_path.parent.resolve() == out_dir.resolve()
            else str(base_path),
            "sha256": variants.get("f16", {}).get("sha256") if info.weight_type == "F16" else sha256_file(base_path),
            "size_bytes": base_path.stat().st_size,
            "type": info.weight_type,
            "provenance": provenance or "user-supplied base; origin not recorded",
        },
        "roles": {role: v["type"] for role, v in variants.items()},
        "variants": variants,
        "notes": notes,
    }


def write_manifest(out_dir: Path, manifest: dict) -> None:
    write_json_atomic(Path(out_dir) / MANIFEST, manifest)


@dataclass
class Family:
    root: Path
    manifest: dict

    @classmethod
    def load(cls, root: Path | str) -> Family:
        root = Path(root)
        mpath = root / MANIFEST
        if not mpath.is_file():
            raise FamilyError(f"no model family at {root} (missing {MANIFEST}); "
                              f"fetch one with: specquant pull smollm2-135m")
        try:
            manifest = json.loads(mpath.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise FamilyError(f"{mpath}: unreadable manifest ({e})") from None
        if not isinstance(manifest.get("variants"), dict):
            raise FamilyError(f"{mpath}: manifest has no variants")
        return cls(root, manifest)

    @property
    def name(self) -> str:
        return self.manifest.get("family", self.root.name)

    @property
    def provenance(self) -> str:
        return self.manifest.get("base", {}).get("provenance", "")

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
        return v

    def path(self, role: str) -> Path:
        p = self.root / self.variant(role)["path"]
        if not p.is_file():
            raise FamilyError(f"family {self.name}: {role} file {p} is missing; run specquant pull or quantize again")
        return p

    def size(self, role: str) -> int:
        return int(self.variant(role)["size_bytes"])

    def verify(self, hashes: bool = True) -> list[str]:
        """Problems found (empty when every variant matches its recorded size and sha256)."""
        problems = []
        for role, v in self.manifest["variants"].items():
            p = self.root / v["path"]
            if not p.is_file():
                problems.append(f"{role}: {p} missing")
            elif p.stat().st_size != v["size_bytes"]:
                problems.append(f"{role}: size {p.stat().st_size} != {v['size_bytes']}")
            elif hashes and sha256_file(p) != v["sha256"]:
                problems.append(f"{role}: sha256 differs")
        return problems
