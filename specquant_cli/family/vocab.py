"""A GGUF's vocabulary read in full (`read_vocab`: every token's text and type, the special tokens, the tokenizer
model) and compared with another's (`vocab_difference`): a sibling draft model is accepted only when it speaks
exactly the parent's vocabulary, and the first token that differs is named when it does not.

Read from the header with bounds-checked reads over a memory map (a hostile file cannot make it read past the
end); 150k tokens take a fraction of a second."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from specquant_cli.errors import ModelFileError
from specquant_cli.family.ggufio import MAX_METADATA_BYTES, header_problem

TOKENS = "tokenizer.ggml.tokens"
TYPES = "tokenizer.ggml.token_type"
MODEL = "tokenizer.ggml.model"
PRE = "tokenizer.ggml.pre"
SPECIAL_SUFFIX = "_token_id"  # tokenizer.ggml.bos_token_id, eos, eot, eom, pad, unk, sep, mask, fim_* ...
TOKEN_TYPE_NAMES = {1: "normal", 2: "unknown", 3: "control", 4: "user-defined", 5: "unused", 6: "byte"}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class Vocab:
    path: Path
    tokens: list[bytes]
    types: list[int]  # empty when the file records none
    special: dict[str, int] = field(default_factory=dict)  # "bos" -> id, from tokenizer.ggml.<name>_token_id
    model: str = ""
    pre: str = ""


class _Reader:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf) or self.pos + n > MAX_METADATA_BYTES:
            raise ModelFileError(f"{self.path}: truncated or corrupt GGUF (metadata runs past the end of the file)")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        return self.take(self.scalar("<Q"))

    def value(self, vtype: int, key: str):
        """A metadata value: a scalar, a str, or a list (arrays of strings as bytes, of scalars as numbers)."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string().decode("utf-8", "replace")
        if vtype != _ARRAY:
            raise ModelFileError(f"{self.path}: truncated or corrupt GGUF (metadata {key!r} has type {vtype})")
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if etype == _STRING:
            if count * 8 > len(self.buf) - self.pos:
                raise ModelFileError(f"{self.path}: truncated or corrupt GGUF (array {key!r} runs past the end)")
            return [self.string() for _ in range(count)]
        if etype not in _SCALARS:
            raise ModelFileError(f"{self.path}: truncated or corrupt GGUF (array {key!r} of type {etype})")
        fmt = _SCALARS[etype]
        raw = self.take(struct.calcsize(fmt) * count)
        return list(struct.unpack(f"<{count}{fmt[1:]}", raw)) if key == TYPES else None


def read_vocab(path: Path) -> Vocab:
    """The vocabulary of the GGUF at `path`; ModelFileError (one line) when it is no GGUF or has no vocabulary."""
    path = Path(path)
    why = header_problem(path)
    if why:
        raise ModelFileError(f"{path}: {why}")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            r = _Reader(buf, path)
            r.take(4)
            _, _, n_kv = struct.unpack("<IQQ", r.take(20))
            kv = {}
            for _ in range(n_kv):
                key = r.string().decode("utf-8", "replace")
                kv[key] = r.value(r.scalar("<I"), key)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read it ({e.strerror})") from None
    except struct.error:
        raise ModelFileError(f"{path}: truncated or corrupt GGUF (metadata runs past the end of the file)") from None
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
