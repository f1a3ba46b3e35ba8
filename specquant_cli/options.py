"""Reusable option types and input helpers for the commands."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from specquant_cli.errors import FamilyError, InputError

FamilyOpt = typer.Option(None, "--family", help="Family folder (default: models/smollm2-135m)")
PolicyOpt = typer.Option("paper", "--policy", help="paper, parent, spec-q4, spec-q8, ngram, adaptive, "
                                                  "quasar (lossy), q4 (lossy), q8 (lossy)")
ConfigOpt = typer.Option(None, "--config", help="Router config (TOML, [router] table); default ./specquant.toml")


def load_family(path: Optional[Path]):
    from specquant_cli.family import DEFAULT_FAMILY_DIR, Family

    root = path or DEFAULT_FAMILY_DIR
    try:
        return Family.load(root)
    except FamilyError:
        if path is None:
            raise FamilyError(f"no model family at {root}; fetch the demo family with: specquant pull smollm2-135m") \
                from None
        raise


def decode_input(data: bytes) -> str:
    """Input must be UTF-8: invalid bytes are refused (not replaced), so no prompt is silently altered."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"input is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                         "convert it first, e.g. with iconv -t UTF-8") from None


def stdin_is_tty() -> bool:
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


def read_stdin() -> str:
    stream = getattr(sys.stdin, "buffer", None)
    data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8")
    return decode_input(data)


def read_prompt(prompt: Optional[str], allow_empty: bool = False) -> str:
    """PROMPT, then piped stdin after it when both are given; '-' means stdin."""
    parts = []
    if prompt is not None and prompt != "-":
        parts.append(prompt)
    if prompt == "-" or not stdin_is_tty():
        piped = read_stdin()
        if piped.strip():
            parts.append(piped)
    text = "\n\n".join(p.strip("\n") for p in parts)
    if not text.strip() and not allow_empty:
        raise InputError("empty prompt: give PROMPT or pipe text on stdin")
    return text
