"""Sibling draft models: a smaller model of the same vocabulary as the parent (another network: Qwen2.5-Coder-0.5B
beside the 1.5B), recorded in the family as a draft role (`add_sibling`, from `quantize --draft-model` and `pull`).

A sibling is accepted only when it speaks exactly the parent's vocabulary (family.vocab: token count, every token's
text and type, the special tokens; the first difference is named), is no bigger than the parent and is not the
parent's own file (nor any variant's). Any GGUF type is accepted (its header's type borne out by its weights): a draft
never decides what is said. Its file is copied (hard-linked where it can be; a symbolic link given is the file it
names, never stored as a link) into the family folder and committed with the new manifest through the family's
journal (family.journal.commit), so a refused or interrupted addition leaves the family as it was. Its record carries
a `sibling` object — its architecture, parameter count, file type, hyperparameters, where it came from — and the rest
of specquant reads it through `Family.siblings()` and `Family.hparams_of(role)` (which reads its KV cache's
hyperparameters from the file's own header, not from the record). A sibling never imports the
parent's KV cache (another network's layout): it prefills the prompt itself, and every plan and figure counts that."""

from __future__ import annotations

import os
import re
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Optional

from specquant_cli.errors import InputError
from specquant_cli.family import journal
from specquant_cli.family.gguf_read import read_info, split_problem
from specquant_cli.family.gguf_types import GGUFInfo, type_problem
from specquant_cli.family.lock import family_lock
from specquant_cli.family.manifest import Family
from specquant_cli.family.manifest_file import WarnFn, silent
from specquant_cli.family.roles import PARENT_ROLE, RESERVED, ROLE_RE, ROLE_RULE, builtin_draft_roles
from specquant_cli.family.variants import QUANT_TYPES, variant_record
from specquant_cli.family.vocab import read_vocab, vocab_difference
from specquant_cli.fsutil import fit_name, remove_stale, same_file, sha256_file

DEFAULT_SIBLING_ROLE = "sibling"


def check_role_name(role: str) -> str:
    """A name for a sibling role: spelled like a role, not a type, a built-in role or a draft recipe's role."""
    if not ROLE_RE.match(role or "") or role in QUANT_TYPES or role in RESERVED:
        raise InputError(f"--draft-role {role!r}: {ROLE_RULE}")
    if role in builtin_draft_roles():
        raise InputError(f"--draft-role {role!r}: the role of a draft recipe; pick another name")
    return role


def check_sibling_role(role: str, family: Family) -> str:
    """check_role_name, and not one of the family's variants of its own base (a sibling of that name is replaced
    only with --force)."""
    check_role_name(role)
    v = family.manifest["variants"].get(role)
    if v is not None and not (isinstance(v, dict) and isinstance(v.get("sibling"), dict)):
        raise InputError(f"--draft-role {role}: the family's {role} variant is one of its own base; pick another name")
    return role


def check_sibling(parent: Path, draft: Path) -> GGUFInfo:
    """The sibling file's header, once it checks out against the parent's file (or the base it is made from): a
    readable, complete GGUF (any type), the parent's vocabulary exactly, and no more parameters than the parent.
    InputError (one line) else."""
    draft = Path(draft)
    info = read_info(draft)  # ModelFileError: missing, not a GGUF, a FIFO, truncated or corrupt, a split's part
    why = split_problem(info) or type_problem(info)
    if why:
        raise InputError(f"--draft-model {why}")
    if same_file(parent, draft) or (os.path.getsize(parent) == os.path.getsize(draft)
                                    and sha256_file(parent) == sha256_file(draft)):
        raise InputError(f"--draft-model {draft}: is the parent's own file ({Path(parent).name}); a sibling draft is "
                         "a smaller model of the parent's vocabulary")
    why = vocab_difference(read_vocab(parent), read_vocab(draft), "sibling")
    if why:
        raise InputError(f"--draft-model {draft}: not the parent's vocabulary ({why}); a draft must speak it exactly")
    p_info = read_info(parent)
    if info.n_params > p_info.n_params:
        raise InputError(f"--draft-model {draft}: {info.n_params / 1e6:.0f}M parameters, more than the parent's "
                         f"{p_info.n_params / 1e6:.0f}M; a sibling draft must be smaller than the parent")
    return info


def sibling_file_name(role: str, draft: Path) -> str:
    """`<role>-<the file's own name>` (characters other than letters, digits, '.', '_' and '-' replaced; a name too long
    for the file system shortened, fsutil.fit_name)."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(draft).name)
    return fit_name(f"{role}-{stem}" if stem.endswith(".gguf") else f"{role}-{stem}.gguf")


def add_sibling(root: Path, draft: Path, role: str = DEFAULT_SIBLING_ROLE, *, source: Optional[str] = None,
                provenance: Optional[str] = None, force: bool = False,
                warn: Optional[WarnFn] = None) -> tuple[dict, bool]:
    """Record `draft` as the sibling role `role` of the family at `root`: checked (check_sibling), copied into the
    folder and committed with the new manifest in one journaled step. Returns (manifest, added now); a sibling of
    that role with the same content is kept as it is (False). `source`/`provenance`: where the file came from, as
    the manifest and the README tell it (default: the path it was added from)."""
    from specquant_cli.family.quantize import check_disk
    from specquant_cli.family.staging import stage_copy

    warn = warn or silent
    root = Path(root)
    with family_lock(root):
        family = Family.load(root, warn)
        remove_stale(root)
        check_sibling_role(role, family)
        old = family.manifest["variants"].get(role)
        dst = root / sibling_file_name(role, draft)
        taken = journal.names_in_use(family.manifest, but=role)
        if dst.name in taken:
            raise InputError(f"--draft-model {draft}: it would be copied to {dst.name}, a file the family already "
                             "uses; rename it or pick another --draft-role")
        check_sibling(family.path(PARENT_ROLE), draft)  # refused in one line before anything is copied
        sha = sha256_file(draft)
        if old is not None and old.get("sha256") == sha and family.problem(role, hashes=True) is None:
            return family.manifest, False
        for other, v in family.manifest["variants"].items():
            if other != role and isinstance(v, dict) and v.get("sha256") == sha:
                raise InputError(f"--draft-model {draft}: is the family's own {other} variant ({v.get('path')}); a "
                                 "sibling draft is another, smaller model of the parent's vocabulary")
        if old is not None and not force:
            raise InputError(f"--draft-role {role}: the family has a sibling {role} already ({old.get('path')}); "
                             "pass --force to replace it")
        check_disk(root, Path(draft).stat().st_size)
        held: list[Path] = []
        try:  # the copy is what is checked and recorded (the file given may change meanwhile)
            tmp = stage_copy(Path(draft), dst, keep=held.append)
            info = check_sibling(family.path(PARENT_ROLE), tmp)
            if sha256_file(tmp) != sha:
                raise InputError(f"--draft-model {draft}: changed while it was being copied; nothing was added")
            record = variant_record(tmp, f"sibling-{(info.file_type or info.weight_type).lower()}", role,
                                    info.n_params, dst.name, datetime.now(UTC), sha,
                                    extra={"sibling": _sibling_record(info, source or str(draft), provenance)})
            manifest = dict(family.manifest)
            manifest["variants"] = {**family.manifest["variants"], role: record}
            manifest["roles"] = {**(family.manifest.get("roles") or {}), role: record["type"]}
            journal.commit(root, [(tmp, dst)], manifest)
        except InputError as e:  # the checks name the file given, not our temp copy
            raise InputError(str(e).replace(str(held[0]) if held else "\0", str(draft))) from None
        finally:
            for t in held:
                t.unlink(missing_ok=True)
        _remove_replaced(root, old, manifest, warn)
    return manifest, True


def _remove_replaced(root: Path, old: Optional[dict], manifest: dict, warn: WarnFn) -> None:
    """The file of the sibling record `old` that the new manifest replaced: removed only when it is a plain GGUF
    file name of this folder that nothing in the new manifest uses (a record is not trusted to name it)."""
    name = old.get("path") if isinstance(old, dict) else None
    if not isinstance(name, str) or "/" in name or not name.endswith(".gguf") or name in journal.names_in_use(manifest):
        return
    path = root / name
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        warn(f"{path}: the replaced sibling's file could not be removed ({e.strerror}); remove it by hand")


def _sibling_record(info: GGUFInfo, source: str, provenance: Optional[str]) -> dict:
    return {"architecture": info.arch, "name": info.name, "n_params": info.n_params,
            "file_type": info.file_type or info.weight_type, "hparams": info.hparams, "source": source,
            "provenance": provenance or info.provenance or "user-supplied sibling model; origin not recorded"}
