"""The GGUF format's types: what a file is (`GGUFInfo`), the value types of its header, its file types as llama.cpp
names them (`ftype_name`), and its tensor types in bits: what each type stores per weight (`type_bits`), what a
file's weights average (`weight_bits`) against what its general.file_type claims (`claimed_bits`), and whether they
bear the claim out (`type_problem`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

GGUF_MAGIC = b"GGUF"
FLOAT_TYPES = {"F32", "F16", "BF16"}
PROVENANCE_KEY = "specquant.provenance"
# llama_ftype values for float files (llama.h): ALL_F32 = 0, MOSTLY_F16 = 1, MOSTLY_BF16 = 32.
FTYPE_MOSTLY_F16 = 1
FTYPE_MOSTLY_BF16 = 32


@dataclass
class GGUFInfo:
    path: Path
    arch: str
    name: str
    n_params: int
    tensor_types: dict[str, int]  # type name -> count of 2-D+ tensors
    weight_elements: dict[str, int]  # type name -> weights held in 2-D+ tensors of that type
    weight_type: str  # most common type among 2-D+ tensors
    file_type: str  # general.file_type as llama.cpp names it (Q4_K_M, F16, ...), "" when absent
    hparams: dict[str, int] = field(default_factory=dict)
    provenance: Optional[str] = None
    chat_template: Optional[str] = None
    vocab_sha256: Optional[str] = None  # fingerprint of tokenizer.ggml.tokens: variants of a family share it
    split: tuple[int, int] = (0, 1)  # (split.no, split.count): a model llama-gguf-split cut into several files
    # type name -> weights held in the blocks' (blk.*) 2-D+ tensors whose rows fit a quantized block (a multiple of
    # 32): what a file type writes its main tensors as (token_embd and output are kept at more bits by every type,
    # and a row no block fits is F16 under every type)
    block_elements: dict[str, int] = field(default_factory=dict)

    @property
    def is_float(self) -> bool:
        return set(self.tensor_types) <= FLOAT_TYPES


SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING_TYPE, ARRAY_TYPE = 8, 9


# The tensor type each general.file_type is made of (its other tensors: more bits, or a fallback of more bits where
# a row does not fit the type's block): what the weights must mostly be for the header's claim to hold.
_MAIN_TYPE = {"Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K", "Q5_K_M": "Q5_K", "Q5_K_S": "Q5_K", "Q3_K_M": "Q3_K",
              "Q3_K_S": "Q3_K", "Q3_K_L": "Q3_K", "Q2_K_S": "Q2_K", "F32": "F32"}
TYPE_SLACK = 0.9  # a file's weights may average this share of its claimed type's bits (no fallback ever has fewer)


def type_bits(name: str) -> Optional[float]:
    """Bits per weight of a ggml tensor type (Q8_0: 8.5), None for one gguf does not know."""
    import gguf

    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    except KeyError:
        return None
    return size * 8 / block


def weight_bits(info: GGUFInfo) -> Optional[float]:
    """The mean bits per weight of the file's 2-D+ tensors, by what their types store (None: none known)."""
    known = {t: n for t, n in info.weight_elements.items() if type_bits(t) is not None}
    total = sum(known.values())
    return sum(type_bits(t) * n for t, n in known.items()) / total if total else None


def claimed_bits(file_type: str) -> Optional[float]:
    """Bits per weight of the tensor type a general.file_type is mostly made of (Q4_K_M: Q4_K's 4.5)."""
    return type_bits(_MAIN_TYPE.get(file_type, file_type)) if file_type else None


def type_problem(info: GGUFInfo) -> Optional[str]:
    """Why the header's claimed type (general.file_type) is not what the file's weights are, else None: weights of
    fewer bits than that type ever stores, or blocks mostly of more bits than it ever writes them in (`_more_bits`;
    a header edited, or written by a tool that got it wrong). A type the header does not name, or a claim gguf
    cannot price, is no problem here."""
    want, got = claimed_bits(info.file_type), weight_bits(info)
    if want is None or got is None:
        return None
    if got < want * TYPE_SLACK:
        most = max(info.weight_elements, key=info.weight_elements.get)
        return (f"{info.path}: its header says {info.file_type} (general.file_type), but its weights are mostly "
                f"{most} ({got:.2f} bits per weight on average, {info.file_type} stores {want:.2f}): the header does "
                "not describe the file; refusing to record it as what it is not")
    return _more_bits(info)


# Where a tensor's rows do not fit a type's block, llama.cpp's quantizer writes it in this type instead
# (llama_tensor_get_type's fallback; F16 where no quantized block fits: left out of GGUFInfo.block_elements).
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0",
             **dict.fromkeys(("Q2_K", "Q3_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S",
                              "IQ1_M"), "IQ4_NL")}


def _more_bits(info: GGUFInfo) -> Optional[str]:
    """Why the file's blocks are mostly of a type of more bits than its claimed type writes them in (its main type,
    or that type's fallback), else None: a header saying Q4_K_M over Q8_0 weights would have the parent recorded,
    priced and drafted for as the smaller file it is not. Only the blocks' weights count: every type keeps
    token_embd and output, and some of a block's tensors (attn_v, ffn_down), at more bits, but never most of them."""
    main = _MAIN_TYPE.get(info.file_type, info.file_type)
    most_bits = max(type_bits(main) or 0.0, type_bits(_FALLBACK.get(main, main)) or 0.0)
    if not info.block_elements or not most_bits:
        return None
    most = max(info.block_elements, key=info.block_elements.get)
    got = type_bits(most)
    if got is None or got <= most_bits:
        return None
    return (f"{info.path}: its header says {info.file_type} (general.file_type), but its weights are mostly {most} "
            f"({got:.2f} bits per weight; {info.file_type} writes a model's blocks in {most_bits:.2f} at most): the "
            "header does not describe the file; refusing to record it as what it is not")


def ftype_name(ft) -> str:
    """A general.file_type value as llama.cpp names it (Q4_K_M, F16, ...); "" when absent, `unknown (N)` for a value
    llama.cpp does not name."""
    import gguf

    if not isinstance(ft, int) or isinstance(ft, bool):
        return ""
    try:
        return gguf.LlamaFileType(ft).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"unknown ({ft})"

# The hyperparameters a family records of each network (GGUFInfo.hparams, Family.hparams_of): `<arch>.<key>`.
HPARAM_KEYS = ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv", "context_length",
               "attention.key_length", "attention.value_length")
