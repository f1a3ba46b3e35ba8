"""Draft recipes: variants quantized with an importance matrix, per-tensor types or smaller embeddings, added
to an existing family as ordinary roles (the other roles of the manifest are kept).

| role    | recipe                                                                                  |
|---------|-----------------------------------------------------------------------------------------|
| `q4i`   | Q4_0 with the activation importance matrix (llama.cpp's imatrix-weighted rounding)     |
| `q4s`   | Q4_0 with token embeddings and output at Q4_0 too (`token_embedding_type`, `output_tensor_type`) |
| `q4si`  | `q4s` with the importance matrix                                                         |
| `q3g`   | graded to ~3.5 bits per weight (family.grade), imatrix-weighted                          |
| `q3g30` | graded to ~3.0 bits per weight                                                           |

`specquant quantize BASE --types q4_0 --grade 3.2 --role NAME` makes any other graded variant."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Optional

from specquant_cli.errors import FamilyError, InputError, LlamaError, ModelFileError, ResourceError
from specquant_cli.family import grade as grading
from specquant_cli.family.roles import PARENT_ROLE, check_role
from specquant_cli.family.variants import LADDER, QUANT_TYPES, RECIPES, Recipe, variant_record
from specquant_cli.settings import cores

ProgressFn = Callable[[str, int, int], None]  # (stage label, done, total)
LOG = "quantize.log"


def default_role(bpw: float) -> str:
    return f"q{int(bpw)}g{round(bpw * 10):02d}"


def split_types(types: str, grade: Optional[float] = None, role: Optional[str] = None,
                ladder: Optional[str] = None) -> tuple[list[str], list[Recipe]]:
    """--types into plain type names (for quantize_family) and recipes (named roles, or one --grade variant)."""

    names = [s.strip().lower() for s in types.split(",") if s.strip()]
    plain = [n for n in names if n not in RECIPES]
    lad = grading.parse_ladder(ladder) if ladder else None
    recipes = [replace(RECIPES[n], ladder=lad) if lad and RECIPES[n].grade else RECIPES[n]
               for n in names if n in RECIPES]
    if grade is None:
        if role is not None:
            raise InputError("--role names the role of a --grade variant; pass --grade BPW too")
        if lad:
            raise InputError("--ladder applies to graded variants (--grade, or q3g/q3g30 in --types)")
        return plain, recipes
    if len(plain) != 1 or plain[0] not in QUANT_TYPES or plain[0] in ("f16", "bf16"):
        raise InputError(f"--grade {grade:g}: give one quantized base type in --types, e.g. --types q4_0 --grade "
                         f"{grade:g} (recipes known by name: {', '.join(RECIPES)})")
    if not 1.5 <= grade <= 16:
        raise InputError(f"--grade {grade:g}: bits per weight between 1.5 and 16")
    r = Recipe(check_role(default_role(grade) if role is None else role), base=plain[0], imatrix=True, grade=grade,
               ladder=lad or LADDER, help=f"graded precision, ~{grade:g} bits per weight, imatrix-weighted")
    return [], recipes + [r]


def _ftype(base: str) -> str:

    q = QUANT_TYPES.get(base)
    if q is None or base in ("f16", "bf16"):
        raise InputError(f"recipe base {base!r} is not a quantized type")
    return q.ftype_const


def _run_worker(spec: dict, dst_tmp: Path, expected: int, label: str, log_fd: int,
                progress: Optional[ProgressFn]) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
        json.dump(spec, f)
    from specquant_cli.family.staging import run_child

    cmd = [sys.executable, "-m", "specquant_cli.family.recipe_worker", f.name, str(os.getpid())]
    try:
        rc = run_child(cmd, log_fd, dst_tmp, lambda n: progress and progress(label, n, expected))
    finally:
        os.unlink(f.name)
    if rc != 0:
        raise LlamaError(f"llama_model_quantize failed for {label} (exit code {rc}); see {LOG}")


def _record(path: Path, recipe: Recipe, n_params: int, name: str, sha: str) -> dict:
    """The recipe variant's manifest record: family.variants.variant_record plus its tensor bits and recipe."""
    return variant_record(path, recipe.label, recipe.role, n_params, name, datetime.now(UTC), sha,
                          {"tensor_bits_per_weight": round(grading.tensor_bpw(path), 3), "recipe": recipe.to_dict()})


def _up_to_date(family, recipe: Recipe, imatrix_sha: Optional[str]) -> bool:
    v = family.manifest.get("variants", {}).get(recipe.role)
    return (isinstance(v, dict) and v.get("recipe") == recipe.to_dict() and family.problem(recipe.role) is None
            and (not recipe.imatrix or v.get("imatrix", {}).get("sha256") == imatrix_sha))


def add_variants(out_dir: Path, recipes: Sequence[Recipe], *, base: Optional[Path] = None,
                 imatrix_path: Optional[Path] = None, threads: int = 0, force: bool = False,
                 progress: Optional[ProgressFn] = None, say: Optional[Callable[[str], None]] = None,
                 warn: Optional[Callable[[str], None]] = None) -> dict:
    """Quantize each recipe from the family's F16 base and commit it as a role of the family (with the grading
    plan beside it, `<family>-<role>.plan.json`). A role whose file, recipe and imatrix match is kept. A line
    per role made goes to `say`, warnings (an interrupted update finished) to `warn`; none by default."""
    from specquant_cli.family import activations, journal
    from specquant_cli.family import imatrix as im
    from specquant_cli.family.gguf_read import read_info
    from specquant_cli.family.manifest import Family
    from specquant_cli.family.manifest_file import read_existing
    from specquant_cli.family.staging import open_log
    from specquant_cli.fsutil import create_temp, remove_stale, same_file, sha256_file
    from specquant_cli.names import MANIFEST

    say = say or (lambda _t: None)
    root = Path(out_dir)
    if not (root / MANIFEST).is_file():
        raise FamilyError(f"no family at {root}: make one first (specquant quantize BASE --out {root} "
                          "--types q4_0,q8_0,f16), then add draft recipes to it")
    journal.recover(root, warn)
    remove_stale(root)
    family = Family.load(root, warn)
    src = family.path(PARENT_ROLE)
    if base is not None and not same_file(Path(base), src):
        base_sha = family.manifest.get("base", {}).get("sha256")
        if sha256_file(Path(base)) != base_sha:
            raise InputError(f"{base} is not the base of the family at {root}; recipes quantize the family's own "
                             "parent (quantize the family from this base first)")
    info = read_info(src)
    if not info.is_float:
        raise ModelFileError(f"{src}: the family's f16 role is not a float model")
    imatrix_file, imatrix_rec, importance = None, None, None
    if any(r.imatrix or r.grade is not None for r in recipes):
        imatrix_file, imatrix_rec = activations.family_imatrix(family, imatrix_path)
        imatrix_rec = {**imatrix_rec, "sha256": imatrix_rec.get("sha256") or sha256_file(imatrix_file)}
    threads = threads or cores()
    stem = family.name
    for recipe in recipes:
        _ftype(recipe.base)
        if not force and _up_to_date(family, recipe, imatrix_rec and imatrix_rec["sha256"]):
            say(f"{recipe.role}: up to date, kept")
            continue
        plan = None
        spec = {"src": os.fspath(src), "ftype": _ftype(recipe.base), "nthread": threads,
                "imatrix": os.fspath(imatrix_file) if (recipe.imatrix and imatrix_file) else None,
                "overrides": [], "output_tensor_type": recipe.embeddings, "token_embedding_type": recipe.embeddings}
        if recipe.grade is not None:
            if importance is None:
                importance = im.ActivationStats.load(imatrix_file).mean()
            plan = grading.plan(src, importance, recipe.grade, recipe.base, recipe.ladder, threads,
                                progress=lambda d, t, r=recipe.role: progress and progress(f"{r} (grading)", d, t))
            spec["overrides"] = plan.overrides()
            say(f"{recipe.role}: planned {plan.bpw:.3f} bits per weight (reachable {plan.min_bpw:.2f}.."
                f"{plan.max_bpw:.2f}): " + ", ".join(f"{n} {t}" for t, n in plan.counts().items()))
        expected_bpw = plan.bpw if plan else grading.type_bits(recipe.base) + 0.3
        expected = int(info.n_params * expected_bpw / 8)
        if shutil.disk_usage(root).free < expected * 1.1 + (16 << 20):
            raise ResourceError(f"not enough disk in {root} for the {recipe.role} variant "
                                f"(~{expected / 2**30:.2f} GiB)")
        dst = root / f"{stem}-{recipe.role}.gguf"
        plan_dst = root / f"{stem}-{recipe.role}.plan.json"
        fd, tmp = create_temp(dst)
        os.close(fd)
        staged = [tmp]
        try:
            spec["dst"] = os.fspath(tmp)
            log_fd = open_log(root)
            try:
                _run_worker(spec, tmp, expected, recipe.role, log_fd, progress)
            finally:
                os.close(log_fd)
            from specquant_cli.family.staging import check_output

            size = check_output(tmp, recipe.role, root / LOG)
            if progress:
                progress(recipe.role, size, size)
            rec = _record(tmp, recipe, info.n_params, dst.name, sha256_file(tmp))
            renames = [(tmp, dst)]
            if recipe.imatrix:
                rec["imatrix"] = {"sha256": imatrix_rec["sha256"],
                                  "calibration_sha256": imatrix_rec.get("calibration", {}).get("sha256")}
            if plan is not None:
                d = plan.to_dict()
                rec["grade"] = {k: d[k] for k in ("target_bpw", "planned_bpw", "reachable_bpw", "type_counts",
                                                  "most_sensitive")}
                rec["grade"]["plan_file"] = plan_dst.name
                pfd, ptmp = create_temp(plan_dst)
                staged.append(ptmp)
                with open(pfd, "w", encoding="utf-8") as f:
                    json.dump({"role": recipe.role, "recipe": recipe.to_dict(), **d}, f, indent=1)
                renames.append((ptmp, plan_dst))
            manifest, why = read_existing(root)  # the latest manifest: others may have changed it meanwhile
            if manifest is None:
                raise FamilyError(f"{root}: the manifest went away while quantizing ({why or 'missing'})")
            manifest.setdefault("variants", {})[recipe.role] = rec
            manifest.setdefault("roles", {})[recipe.role] = recipe.label
            notes = manifest.get("notes") if isinstance(manifest.get("notes"), dict) else {}
            notes[recipe.role] = recipe.help + "; a draft role (spec-" + recipe.role + ")"
            manifest["notes"] = notes
            journal.commit(root, renames, manifest)
            family = Family.load(root, warn)
            say(f"{recipe.role}: {rec['size_bytes'] / 2**20:.1f} MiB, {rec['bits_per_weight']:.3f} bits per weight "
                f"({rec['tensor_bits_per_weight']:.3f} in tensor data) -> {dst.name}")
        finally:
            for t in staged:
                t.unlink(missing_ok=True)
    return family.manifest
