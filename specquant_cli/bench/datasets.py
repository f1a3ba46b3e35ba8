"""Prompt sets in the Spec-Bench question format, and final-answer extraction for GSM8K-style items."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional

from specquant_cli.errors import InputError

ANSWER_HINT = "\nEnd your answer with '#### ' followed by the final number."
_NUM = r"-?\$?\d[\d,]*(?:\.\d+)?"


@dataclass
class Item:
    id: str
    category: str
    prompt: str
    reference: Optional[str] = None  # final answer (after '#### '), when the item has one


def final_answer(reference: str) -> Optional[str]:
    m = re.search(r"####\s*(" + _NUM + ")", reference)
    return normalize_number(m.group(1)) if m else None


def normalize_number(s: str) -> str:
    s = s.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        v = float(s)
    except ValueError:
        return s
    return str(int(v)) if v == int(v) else repr(v)


def extract_answer(text: str) -> Optional[str]:
    """The model's final number: after '#### ' when present, else the last number in the text."""
    m = re.search(r"####\s*(" + _NUM + ")", text)
    if m:
        return normalize_number(m.group(1))
    nums = re.findall(_NUM, text)
    return normalize_number(nums[-1]) if nums else None


def _items(lines: Iterable[str], source: str) -> list[Item]:
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            prompt = d["turns"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise InputError(f"{source}:{n}: not a Spec-Bench question (needs 'turns': [prompt, ...])") from None
        ref = d.get("reference") or []
        answer = final_answer(ref[0]) if ref and isinstance(ref[0], str) else None
        if answer is not None:
            prompt += ANSWER_HINT
        out.append(Item(f"{Path(source).stem}:{d.get('question_id', n)}", d.get("category", "uncategorized"),
                        prompt, answer))
    return out


def builtin() -> list[Item]:
    text = resources.files("specquant_cli.bench").joinpath("prompts.jsonl").read_text(encoding="utf-8")
    return _items(text.splitlines(), "builtin")


def load(files: Sequence[Path], categories: Optional[Sequence[str]] = None, limit: Optional[int] = None) \
        -> list[Item]:
    """Items from files (or the built-in set), filtered by category, at most `limit` per category."""
    items: list[Item] = []
    if not files:
        items = builtin()
    for f in files:
        try:
            items += _items(Path(f).read_text(encoding="utf-8").splitlines(), str(f))
        except OSError as e:
            raise InputError(f"{f}: cannot read dataset ({e.strerror})") from None
    if categories:
        known = {i.category for i in items}
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise InputError(f"no items in category {unknown[0]!r}; categories: {', '.join(sorted(known))}")
        items = [i for i in items if i.category in categories]
    if limit:
        per: dict[str, int] = {}
        kept = []
        for i in items:
            if per.get(i.category, 0) < limit:
                per[i.category] = per.get(i.category, 0) + 1
                kept.append(i)
        items = kept
    if not items:
        raise InputError("no benchmark items selected")
    return items
