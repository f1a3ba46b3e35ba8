"""A GGUF's vocabulary read in full (`read_vocab`: every token's text and type, the special tokens, the tokenizer
model) and compared with another's (`vocab_difference`): a sibling draft model is accepted only when it speaks
exactly the parent's vocabulary, and the first token that differs is named when it does not.

Read from the header with gguf_read's bounds-checked reads over a memory map (a hostile file cannot make it read past
the end); 150k tokens take a fraction of a second."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from specquant_cli.errors import ModelFileError
from specquant_cli.family.gguf_read import read_metadata

TOKENS = "tokenizer.ggml.tokens"
TYPES = "tokenizer.ggml.token_type"
MODEL = "tokenizer.ggml.model"
PRE = "tokenizer.ggml.pre"
SPECIAL_SUFFIX = "_token_id"  # tokenizer.ggml.bos_token_id, eos, eot, eom, pad, unk, sep, mask, fim_* ...
TOKEN_TYPE_NAMES = {1: "normal", 2: "unknown", 3: "control", 4: "user-defined", 5: "unused", 6: "byte"}


@dataclass
class Vocab:
    path: Path
    tokens: list[bytes]
    types: list[int]  # empty when the file records none
    special: dict[str, int] = field(default_factory=dict)  # "bos" -> id, from tokenizer.ggml.<name>_token_id
    model: str = ""
    pre: str = ""


def read_vocab(path: Path) -> Vocab:
    """The vocabulary of the GGUF at `path`; ModelFileError (one line) when it is no GGUF or has no vocabulary."""
    path = Path(path)
    kv = read_metadata(path, frozenset({TOKENS, TYPES}))
    tokens = kv.get(TOKENS)
    if not isinstance(tokens, list) or not tokens:
        raise ModelFileError(f"{path}: no vocabulary ({TOKENS}) in its metadata")
    types = kv.get(TYPES) if isinstance(kv.get(TYPES), list) else []
    special = {k.removeprefix("tokenizer.ggml.").removesuffix(SPECIAL_SUFFIX): v for k, v in kv.items()
               if k.startswith("tokenizer.ggml.") and k.endswith(SPECIAL_SUFFIX) and isinstance(v, int)}
    text = (lambda k: kv[k] if isinstance(kv.get(k), str) else "")
    return Vocab(path, tokens, types, special, text(MODEL), text(PRE))


def _show(v: Vocab, i: int) -> str:
    text = v.tokens[i].decode("utf-8", "replace") if i < len(v.tokens) else None
    kind = TOKEN_TYPE_NAMES.get(v.types[i], str(v.types[i])) if i < len(v.types) else None
    return f"{text!r}" + (f" ({kind})" if kind else "")


def vocab_difference(parent: Vocab, other: Vocab, what: str = "draft") -> Optional[str]:
    """Why `other` does not speak `parent`'s vocabulary — the tokenizer model, the token count, the first token
    whose text or type differs, a special token (bos, eos, eot, pad, ...) set differently — else None."""
    if parent.model != other.model:
        return f"tokenizer model differs: parent {parent.model!r}, {what} {other.model!r}"
    if len(parent.tokens) != len(other.tokens):
        return f"token counts differ: parent {len(parent.tokens)}, {what} {len(other.tokens)}"
    for v, who in ((parent, "the parent's"), (other, f"the {what}'s")):
        if v.types and len(v.types) != len(v.tokens):
            return f"{who} token types are {len(v.types)} for {len(v.tokens)} tokens"
    types = bool(parent.types) and bool(other.types)
    for i, (a, b) in enumerate(zip(parent.tokens, other.tokens)):
        if a != b or (types and parent.types[i] != other.types[i]):
            return f"token {i} differs: parent {_show(parent, i)}, {what} {_show(other, i)}"
    if bool(parent.types) != bool(other.types):
        return f"token types: {'the parent' if parent.types else 'the ' + what} records them, the other does not"
    for name in sorted(set(parent.special) | set(other.special)):
        a, b = parent.special.get(name), other.special.get(name)
        if a != b:
            return f"special token {name} differs: parent {a if a is not None else 'none'}, " \
                   f"{what} {b if b is not None else 'none'}"
    return None
