"""Prompt sets in the Spec-Bench question format, and final-answer extraction for GSM8K-style items."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Optional

from specquant_cli.errors import InputError
from specquant_cli.fsutil import read_input_file
from specquant_cli.inputs import decode_input

ANSWER_HINT = "\nEnd your answer with '#### ' followed by the final number."
_NUM = r"-?\$?\d[\d,]*(?:\.\d+)?"


@dataclass
class Item:
    id: str
    category: str
    prompt: str
    reference: Optional[str] = None  # final answer (after '#### '), when the item has one
    # structured output, as OpenAI's request spells it: {"response_format": ...} or {"tools": [...], "tool_choice": ..}
    form: Optional[dict] = None
    prediction: Optional[str] = None  # the text the answer is expected to resemble (OpenAI's `prediction` content)
    where: str = ""  # the file and line it was read from ("FILE:LINE"; "builtin:3" for a built-in set's)

    def named(self) -> str:
        """The item as an error names it: where it was read, and its id."""
        return f"{self.where} (item {self.id})" if self.where else self.id


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


def _question_problem(d) -> Optional[str]:
    """Why a parsed line is not a usable Spec-Bench question, else None."""
    if not isinstance(d, dict):
        return f"a JSON {type(d).__name__}, not an object"
    turns = d.get("turns")
    if not isinstance(turns, list) or not turns:
        return "needs 'turns': [prompt, ...] with at least one prompt"
    if not isinstance(turns[0], str):
        return f"turns[0] is {json.dumps(turns[0])}, not a string"
    if not turns[0].strip():
        return "turns[0] is empty or whitespace only"
    if "category" in d and (not isinstance(d["category"], str) or not d["category"].strip()):
        return "'category' must be a non-empty string"
    if "reference" in d and d["reference"] is not None and not isinstance(d["reference"], list):
        return "'reference' must be a list"
    if "response_format" in d and not isinstance(d["response_format"], dict):
        return "'response_format' must be an object (OpenAI's response_format)"
    if "tools" in d and not isinstance(d["tools"], list):
        return "'tools' must be a list (OpenAI's function tools)"
    if "prediction" in d and d["prediction"] is not None and not isinstance(d["prediction"], str):
        return "'prediction' must be a string (the text the answer is expected to resemble)"
    qid = d.get("question_id")
    if qid is not None and (isinstance(qid, bool) or not isinstance(qid, (str, int))):
        return "'question_id' must be a string or an integer"
    for key, value in d.items():  # JSON can escape half a surrogate pair ("\ud800"); UTF-8, and a tokenizer, cannot
        try:
            json.dumps({key: value}, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return f"{key!r} holds a lone surrogate (half of a \\uD800-\\uDFFF pair), which is not valid Unicode"
    return None


MAX_DEPTH = 64  # arrays and objects nested deeper in one line are refused (serving.app.MAX_JSON_DEPTH's bound)


def depth(data) -> int:
    """How deep arrays and objects nest in a parsed JSON value, counted without recursion (stops past MAX_DEPTH)."""
    deepest, stack = 0, [(data, 1)]
    while stack and deepest <= MAX_DEPTH:
        value, level = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((c, level + 1) for c in children)
    return deepest


def json_lines(lines: Iterable[str], source: str, hint: str = "") -> Iterator[tuple[int, object]]:
    """(line number, the parsed value) of each non-blank JSON line, within MAX_DEPTH levels (as a request's body is
    bounded: serving.app); one that is not JSON or nests deeper is refused naming its line, `hint` after the problem."""
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{n}"
        too_deep = InputError(f"{where}: nested deeper than {MAX_DEPTH} levels (arrays or objects inside one "
                              f"another){hint}")
        try:
            d = json.loads(line)
        except RecursionError:
            raise too_deep from None
        except ValueError as e:
            raise InputError(f"{where}: not JSON ({e.args[0].split(':')[0]}){hint}") from None
        if depth(d) > MAX_DEPTH:
            raise too_deep
        yield n, d


def _items(lines: Iterable[str], source: str) -> list[Item]:
    out = []
    for n, d in json_lines(lines, source, "; a Spec-Bench question is one object per line with 'turns': [prompt, ...]"):
        where = f"{source}:{n}"
        why = _question_problem(d)
        if why:
            raise InputError(f"{where}: not a Spec-Bench question: {why}")
        prompt = d["turns"][0]
        ref = d.get("reference") or []
        answer = final_answer(ref[0]) if ref and isinstance(ref[0], str) else None
        if answer is not None:
            prompt += ANSWER_HINT
        form = {k: d[k] for k in ("response_format", "tools", "tool_choice", "parallel_tool_calls") if k in d}
        out.append(Item(f"{Path(source).stem}:{d.get('question_id', n)}", d.get("category", "uncategorized"),
                        prompt, answer, form or None, d.get("prediction") or None, where=where))
    return out


PREDICTION_MODES = ("on", "off", "wrong")


def with_predictions(items: Sequence[Item], mode: str) -> list[Item]:
    """The items with their predictions as `mode` says: "on", their own; "off", none; "wrong", each one's replaced by
    the next item's that has another one: a deliberately wrong prediction. An item left with none under "wrong" (no
    other item has another prediction to give it) is an InputError naming it: its row would say nothing wrong."""
    if mode not in PREDICTION_MODES:
        raise InputError(f"--prediction {mode!r}: expected one of {', '.join(PREDICTION_MODES)}")
    if mode == "on":
        return list(items)
    if mode == "off":
        return [replace(it, prediction=None) for it in items]
    items = list(items)
    out = []
    for i, it in enumerate(items):
        others = (q.prediction for q in items[i + 1:] + items[:i] if q.prediction and q.prediction != it.prediction)
        wrong = next(others, None)
        if wrong is None:
            why = "no item has a prediction" if not any(q.prediction for q in items) else \
                f"no other item has a different prediction to give {it.named()}"
            raise InputError(f"--prediction wrong: {why}; a wrong prediction is another item's, so it needs at least "
                             "two items with different predictions, as --edits has")
        out.append(replace(it, prediction=wrong))
    return out


def check_lengths(items: Sequence[Item], check: Callable[[str], object],
                  check_prediction: Optional[Callable[[str], object]] = None) -> None:
    """Run the router's cheap length check on every prompt, and `check_prediction` (the session's: it refuses one
    longer than the context) on every prediction, before any model loads (naming the item: its file, line and id)."""
    for it in items:
        try:
            check(it.prompt)
            if it.prediction and check_prediction is not None:
                check_prediction(it.prediction)
        except InputError as e:
            raise InputError(f"{it.named()}: {e}") from None


# Prompt sets shipped in the package and selectable by name (`--dataset spec-bench`), where no file of that name
# is here; their origin and licences: bench/NOTICE-datasets.txt.
NAMED = {"spec-bench": "spec-bench", "gsm8k": "gsm8k"}


def builtin(name: str = "prompts") -> list[Item]:
    """A built-in set: "prompts" (chat, code, maths, ...), "structured" (JSON extraction and tool calls) or "edits"
    (small changes to excerpts of the Python standard library's source, CPython 3.11, PSF License: each answer is the
    whole excerpt changed, and the excerpt is its prediction); or a named set (NAMED): "spec-bench" (the 480
    Spec-Bench questions) or "gsm8k" (80 GSM8K test problems with their answers)."""
    text = resources.files("specquant_cli.bench").joinpath(f"{name}.jsonl").read_text(encoding="utf-8")
    return _items(text.splitlines(), "builtin" if name == "prompts" else name)


def load(files: Sequence[Path], categories: Optional[Sequence[str]] = None, limit: Optional[int] = None,
         structured: bool = False, edits: bool = False) -> list[Item]:
    """Items from files (or the built-in set), filtered by category, at most `limit` per category; `structured`,
    `edits`: the built-in structured-output set, the built-in code-edit set too (instead of the built-in prompts when
    no file is given)."""
    items: list[Item] = [*(builtin("structured") if structured else []), *(builtin("edits") if edits else [])]
    if not files and not structured and not edits:
        items = builtin()
    for f in files:
        if str(f) in NAMED and not Path(f).exists():  # a set shipped in the package, by name
            items += builtin(NAMED[str(f)])
            continue
        raw = read_input_file(f, "--dataset", "dataset file")  # a FIFO or a device: refused, never read
        text = decode_input(raw, f"dataset {f}")
        items += _items(text.split("\n"), str(f))  # \n only, like every JSON-lines reader
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
