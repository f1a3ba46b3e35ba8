from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from specquant_cli.commands.options import JsonOpt, remember_family, with_settings
from specquant_cli.console import byte_progress, err, gib, out_json
from specquant_cli.errors import InputError
from specquant_cli.settings import Settings, settings_table

# --family names the family made or added to here, as it names the family run elsewhere (runtime.family's option:
# spelled in its declaration alone); never taken from SPECQUANT_FAMILY or specquant.toml, which name the one to run.
FAMILY_FLAG = settings_table()["runtime.family"].flag


def register(app: typer.Typer) -> None:
    app.command("quantize", short_help="Make a family of a base GGUF",
                help="Make a family of a base GGUF: a float base (F16/BF16/F32) quantized into drafts with "
                     "llama.cpp, or a quantized GGUF kept as it is as the parent; add a sibling draft model with "
                     "--draft-model. docs/models.md")(quantize)


@with_settings("runtime.models", "runtime.threads")
def quantize(
    base: Optional[Path] = typer.Argument(None, help="A float GGUF or a quantized one kept as the parent; a file or a "
                                          "reference",
                                          metavar="[BASE]"),
    family: Optional[str] = typer.Option(None, FAMILY_FLAG, metavar="NAME|DIR", show_default="the base's name",
                                         help="The family to make or add to"),  # as typed: ./x is a path, x a name
    out: Optional[Path] = typer.Option(None, "--out", hidden=True,
                                       help="The family's folder (the old spelling of --family; a path as given)"),
    draft_model: Optional[Path] = typer.Option(
        None, "--draft-model", help="Add a smaller model of its vocabulary (file or reference)"),
    draft_role: str = typer.Option("sibling", "--draft-role", help="Role name of the --draft-model"),
    types: Optional[str] = typer.Option(
        None, "--types", help="Types and recipes to add", metavar="TYPES",
        show_default="q4_k_m,q8_0"),
    grade: Optional[float] = typer.Option(None, "--grade",
                                          help="A graded variant of this many bits per weight",
                                          metavar="BPW"),
    role: Optional[str] = typer.Option(None, "--role", help="Role name of the --grade variant [default: q<B>g<BB>]"),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", help="Importance matrix", metavar="FILE",
                                           show_default="the family's"),
    ladder: Optional[str] = typer.Option(None, "--ladder", help="Types a graded variant may use",
                                         show_default="q2_k to q8_0"),
    force: bool = typer.Option(False, "--force", help="Rewrite variants that exist"),
    allow_requantize: bool = typer.Option(False, "--allow-requantize",
                                          help="Quantize drafts from a quantized BASE too"),
    json_out: bool = JsonOpt,
    *, cfg: Settings,
) -> None:
    from specquant_cli.commands.references import local_model
    from specquant_cli.settings import models_dir

    work = models_dir()  # where an ollama blob's named link or a split model's merged file is made for the run
    with local_model(base, work) as b, local_model(draft_model, work) as d:
        _quantize(b, family, out, d, draft_role, types, grade, role, imatrix, ladder, force, allow_requantize,
                  json_out, cfg)


def _quantize(b, family: Optional[str], out: Optional[Path], d, draft_role: str, types: Optional[str],
              grade: Optional[float], role: Optional[str], imatrix: Optional[Path], ladder: Optional[str], force: bool,
              allow_requantize: bool, json_out: bool, cfg: Settings) -> None:
    """quantize's body, on the BASE and --draft-model as local files (`b`, `d`: commands.references.Model, or None)."""
    import os

    threads = cfg.runtime.threads
    base = b.path if b is not None else None
    draft_model = d.path if d is not None else None
    if out is not None and family is not None:
        raise typer.BadParameter("give the family once: --out is the old spelling of --family", param_hint="'--out'")
    if base is None:
        if draft_model is None or (out is None and family is None):
            raise typer.BadParameter("give a BASE model, or --draft-model with --family FAMILY to add a sibling draft "
                                     "to an existing family", param_hint="'BASE'")
        return _add_sibling(out if out is not None else _located(family), d, draft_role, force, json_out)
    if draft_model is not None:  # a bad sibling is refused before anything is quantized
        from specquant_cli.family.siblings import check_sibling

        _check_draft_role(draft_role)
        check_sibling(base, draft_model)
    from specquant_cli.family.gguf_read import read_info
    from specquant_cli.family.quantize import default_types, parse_types, quantize_family
    from specquant_cli.family.recipes import add_variants, split_types

    if types is None and grade is None:
        split_types("", None, role, ladder)  # --role or --ladder without --grade: refused as with any --types
        info = read_info(base)
        plain, recipes, qtypes = [], [], default_types(info, allow_requantize)
    else:
        plain, recipes = split_types(types if types is not None else "", grade, role, ladder)
        qtypes = parse_types(plain) if plain or not recipes else []  # neither: parse_types names the empty --types
        info = read_info(base)
    if recipes and not info.is_float:
        raise InputError(f"--types {','.join(r.role for r in recipes)}: a draft recipe is made from a float base; "
                         f"{base} is quantized ({info.file_type or info.weight_type})")
    stem = b.name or base.stem
    for suffix in ("-f16", ".f16", "-bf16", ".bf16"):
        stem = stem.removesuffix(suffix)
    out_dir = out if out is not None else _target(family, stem, cfg)
    by_name = out is None and (family is None or _is_plain_name(family))
    _check_name_free(out_dir, force)
    if recipes and imatrix is not None:  # before any plain type is quantized: a bad one fails first, in one line
        from specquant_cli.family.imatrix import check_option_imatrix

        check_option_imatrix(imatrix)
    t0 = time.perf_counter()
    with byte_progress() as prog:
        tasks: dict[str, int] = {}

        def progress(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = prog.add_task(f"quantize {name}", total=total)
            prog.update(tasks[name], completed=done, total=max(total, done))

        if qtypes or not info.is_float:  # a quantized base is placed as the parent, drafts or none
            manifest = quantize_family(base, out_dir, qtypes, threads=threads, force=force,
                                       allow_requantize=allow_requantize, progress=progress, f16_if_exact=types is None,
                                       replace_other=force or not by_name, provenance=b.provenance,
                                       source=b.reference or os.path.abspath(base),
                                       warn=lambda t: prog.console.print(f"warning: {t}", markup=False))
        if recipes:
            manifest = add_variants(out_dir, recipes, base=base, imatrix_path=imatrix, threads=threads, force=force,
                                    progress=progress, say=lambda t: prog.console.print(t, markup=False),
                                    warn=lambda t: prog.console.print(f"warning: {t}", markup=False))
    if draft_model is not None:
        from specquant_cli.family.siblings import add_sibling

        manifest, _ = add_sibling(out_dir, draft_model, draft_role, force=force, warn=_warn, source=d.reference,
                                  provenance=d.provenance)
    err.print(f"{info.arch} base, {info.n_params / 1e6:.0f}M params -> {out_dir} in {time.perf_counter() - t0:.1f}s")
    if not info.is_float:
        _say_quantized_parent(base, info, manifest)
    if b.reference is not None and draft_model is None and not any(
            isinstance(v, dict) and "sibling" in v for v in manifest["variants"].values()):
        from specquant_cli.commands.references import say_draft_candidates

        say_draft_candidates(base, manifest.get("family") or out_dir.name)
    _print_variants(manifest, json_out)
    remember_family(out_dir)


def _located(family: str) -> Path:
    """The existing family --family names (family.store.locate: a folder, or a name found from any folder)."""
    from specquant_cli.family import store
    from specquant_cli.settings import models_dir

    return store.locate(family, models_dir(), store.current_folder())


def _target(family: Optional[str], stem: str, cfg: Settings) -> Path:
    """The folder a new family is made in (family.store.target): --family's, else the base's name in the models
    folder (a checkout's ./models without --models), that folder checked first when it is the setting's."""
    from specquant_cli.commands.options import check_models_folder
    from specquant_cli.family import store
    from specquant_cli.settings import models_dir

    if family is None or _is_plain_name(family):
        check_models_folder(cfg)
    return store.target(family, stem, models_dir(), store.current_folder(), cfg.runtime.models is not None)


def _is_plain_name(family: str) -> bool:
    """--family is a name (store.is_name), not a folder here holding a family: the family it reaches, found or new,
    is the name's, not a folder the user gave, so another family there is replaced only with --force."""
    from specquant_cli.family import store

    return store.is_name(family) and not store.is_family(family)


def _check_name_free(out_dir: Path, force: bool) -> None:
    """A new family takes its folder's name only when no other family known has it (store.holder: the index keeps
    one folder per name, and --family NAME would run the other one), unless --force: then the name runs the new
    one, and the other keeps its folder (store.remember says so)."""
    from specquant_cli.family import store
    from specquant_cli.settings import models_dir

    if force or store.is_family(out_dir):
        return
    other = store.holder(out_dir, models_dir(), store.current_folder())
    if other is not None:
        raise InputError(f"the name {other.name} is taken: {other.root} holds the family {other.name} (made from "
                         f"{store.made_from(other.root)}); pass --force to give the name to this family (that one then "
                         f"runs by its folder), or make this one in a folder of another name")


def _say_quantized_parent(base: Path, info, manifest: dict) -> None:
    """A family of a quantized parent: what lossless means for it, and how it gets a model draft when it has none."""
    from specquant_cli.family.own import parent_type
    from specquant_cli.family.roles import draft_roles

    err.print(f"parent: {base.name} ({parent_type(info)}) as it is: lossless output is that file's own", markup=False)
    if not draft_roles(manifest["variants"]):
        _warn("the family has no model draft, so only draft-free policies speed it up (auto plans suffix drafts); "
              "add a smaller model of its vocabulary with --draft-model SMALL.gguf, or quantize drafts from it with "
              "--allow-requantize")


def _warn(text: str) -> None:
    err.print(f"warning: {text}", markup=False)


def _print_variants(manifest: dict, json_out: bool) -> None:
    """Each variant's record (read from disk on the add-a-sibling path: any field may be missing or odd)."""
    for role, v in manifest["variants"].items():
        v = v if isinstance(v, dict) else {}
        size, bpw = v.get("size_bytes"), v.get("bits_per_weight")
        err.print(f"  {role:4} {v.get('type')!s:7} {gib(size) if isinstance(size, int) else '?'}  "
                  f"{f'{bpw:.2f}' if isinstance(bpw, (int, float)) else '?'} bpw  {v.get('path')}", markup=False)
    if json_out:
        out_json(manifest)


def _add_sibling(family: Path, d, role: str, force: bool, json_out: bool) -> None:
    """`quantize --draft-model FILE --family FAMILY` without a base: the sibling added to the family as it is (and
    the family to the index of families, not made the default). `d`: the draft (commands.references.Model)."""
    from specquant_cli.family.siblings import add_sibling

    _check_draft_role(role)
    manifest, added = add_sibling(family, d.path, role, force=force, warn=_warn, source=d.reference,
                                  provenance=d.provenance)
    sib = manifest["variants"][role].get("sibling") or {}
    n = sib.get("n_params")
    err.print(f"{'added' if added else 'already there:'} sibling draft {role} ({sib.get('architecture')}, "
              f"{f'{n / 1e6:.0f}M' if isinstance(n, int) else '?'} params, {sib.get('file_type')}) -> {family}",
              markup=False)
    _print_variants(manifest, json_out)
    remember_family(family, default=False)


def _check_draft_role(role: str) -> None:
    """--draft-role names no drafter of another kind (ngram, suffix) and is spelled as a role should be."""
    from specquant_cli.decoding.registry import sibling_name_problem
    from specquant_cli.family.siblings import check_role_name

    check_role_name(role)
    why = sibling_name_problem(role)
    if why:
        raise InputError(f"--draft-role {why}")
