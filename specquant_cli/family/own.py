"""A quantized GGUF as its family's parent (`quantize my-model-Q8_0.gguf`): most users hold a model as one
quantized file, not as a 16-bit base. The file is the parent as it is (role `own`, placed in the family folder as a
hard link where it can be, else a copy; never rewritten), so every lossless policy is lossless relative to the file
the user runs. Drafts are quantized from it only as asked (`--allow-requantize`: it rounds a model already rounded),
or come as a sibling model (`--draft-model`). What is checked of such a base, and what its manifest record holds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from specquant_cli.errors import InputError, ModelFileError
from specquant_cli.family.gguf_read import split_problem
from specquant_cli.family.gguf_types import GGUFInfo, claimed_bits, type_problem, weight_bits
from specquant_cli.family.roles import OWN, RENDERINGS
from specquant_cli.family.variants import QUANT_TYPES, QuantType

# The quantized GGUFs specquant takes as a parent: llama.cpp's usual types from 4 bits up, as general.file_type
# names them.
PARENT_QUANT_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_0", "Q5_1", "Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1",
                      "IQ4_NL", "IQ4_XS")
# The same, as a file's most common weight type names them (a file without general.file_type: Q4_K_M holds Q4_K).
PARENT_WEIGHT_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q5_1", "Q4_K", "Q4_0", "Q4_1", "IQ4_NL", "IQ4_XS")
OWN_TYPE = QuantType(OWN, "", 0.0, OWN)  # the quantized parent's step in quantize_family: its file placed as it is
LOSSLESS_NOTE = ("the parent is the quantized file {file} ({type}) as given, never rewritten: every lossless policy "
                 "is lossless relative to that file you run, not to the 16-bit model it was quantized from")


def check_base(info: GGUFInfo, types: Sequence[QuantType], allow_requantize: bool) -> None:
    """A base is one file (not a part of a split model) whose header's type is what its weights are (gguf_types.
    type_problem: a type is recorded, and a parent described, only once the weights bear it out); a quantized one is
    of a type specquant takes as a parent, and drafts are quantized from it (`types` other than its own) only as asked
    (`--allow-requantize`)."""
    why = split_problem(info) or type_problem(info)
    if why:
        raise ModelFileError(why)
    if info.is_float:
        return
    kind = parent_type(info)
    if kind not in (PARENT_QUANT_TYPES if info.file_type else PARENT_WEIGHT_TYPES):
        raise ModelFileError(
            f"{info.path}: its weights are {kind or 'of a type llama.cpp does not name'}, not a type specquant takes "
            f"as a parent: an F16, BF16 or F32 base, or a quantized GGUF of {', '.join(PARENT_QUANT_TYPES)}")
    asked = [q.name for q in types if q.role != OWN]
    rounded = [n for n in asked if n in RENDERINGS]
    if rounded:
        raise InputError(f"--types {rounded[0]}: the base {info.path} is quantized ({kind}); a 16-bit rendering of it "
                         "would not be the file you run: the file itself is the parent")
    if asked and not allow_requantize:
        raise InputError(f"--types {','.join(asked)}: quantizing drafts from the quantized parent {info.path} ({kind}) "
                         "is opt-in, since it rounds an already rounded model: pass --allow-requantize (the parent "
                         "itself is never rewritten), or give a smaller model of its vocabulary as --draft-model")


def parent_bits(info: GGUFInfo) -> float:
    """Bits per weight of a quantized parent's type, as the draft types are priced (variants.QUANT_TYPES; a type
    they do not name: what its main tensor type stores, gguf_types.claimed_bits)."""
    kind = parent_type(info)
    q = QUANT_TYPES.get(kind.lower())
    return q.bpw if q is not None else (claimed_bits(kind) or weight_bits(info) or 0.0)


def requantize_types(info: GGUFInfo, types: Sequence[QuantType], warn: Callable[[str], None]) -> list[QuantType]:
    """`types` without the drafts that would not be smaller than the quantized parent `info` (as many bits per weight
    or more: no faster to run, and no draft at all of a Q8_0 parent quantized to Q8_0 again), each one skipped with a
    warning; InputError when every draft asked is such a one. A float base's types are all kept."""
    if info.is_float:
        return list(types)
    bits, kind = parent_bits(info), parent_type(info)
    drafts = [q for q in types if q.role != OWN]
    dropped = [q for q in drafts if q.bpw >= bits]
    if dropped and len(dropped) == len(drafts):
        raise InputError(f"--types {','.join(q.name for q in dropped)}: the parent {info.path.name} is {kind} "
                         f"(~{bits:g} bits per weight); a draft quantized from it must have fewer bits, or it is no "
                         "faster than the parent: pick smaller types (e.g. q4_0), or give a smaller model of its "
                         "vocabulary as --draft-model")
    for q in dropped:
        warn(f"--types {q.name}: skipped; a {q.name} draft (~{q.bpw:g} bits per weight) is no smaller than the parent "
             f"{info.path.name} ({kind}, ~{bits:g}), so it could never be faster than the parent")
    return [q for q in types if q not in dropped]


def parent_type(info: GGUFInfo) -> str:
    """A quantized base's type as llama.cpp names it (general.file_type, else its most common weight type)."""
    return info.file_type or info.weight_type


def own_record(path: Path, info: GGUFInfo) -> dict:
    """What a quantized parent's record holds beyond a variant's: its type as llama.cpp names it (check_base has
    borne it out by the weights; checked on every load, as a sibling's), and its modification time: when it differs
    the full sha256 is compared, and every load compares the content fingerprint (variants.variant_record) whatever the
    time says, so that a file changed in place (the user's own, when the family holds a hard link to it) is one clear
    error instead of answers from other weights."""
    return {"file_type": parent_type(info), "mtime_ns": path.stat().st_mtime_ns}
