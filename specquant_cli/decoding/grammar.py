"""Constrained decoding: an answer held to a grammar (a JSON schema, any JSON object, or a tool call), through
llguidance — the engine llama.cpp's LLAMA_LLGUIDANCE build uses. Chosen over xgrammar because it is one wheel
with no torch, it builds its tokenizer from the llama.cpp vocabulary we already hold (special tokens included),
its mask for a 150k vocabulary takes ~50 µs on one core, and it says which tokens the grammar forces
(`compute_ff_tokens`): those are proposed as drafts at no draft cost (the engine's jump-forward).

A `Grammar` is compiled once per request (`json_schema`, `json_object`, `tool_calls`) and checked against the
model's vocabulary (`check`); a `Constraint` is one answer's matcher: the mask applies to the parent's choice
(greedy: the best allowed token; sampled: the parent's distribution renormalised over the allowed tokens) and a
draft is cut at its first token the grammar forbids, so a constrained answer is the constrained parent's own.

JSON is written with ", " and ": " between items and keys and no other whitespace (llguidance's
`whitespace_flexible` off): the form models emit most, and one in which every separator and every required key's
name is forced."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from specquant_cli.errors import InputError
from specquant_cli.toolcalls import TOOL_CLOSE, TOOL_OPEN, is_calls, parse

MAX_SCHEMA_BYTES = 128 * 1024  # a schema (or a request's tools together) larger than this is refused
MAX_TOOLS = 128  # OpenAI's limit
INT_RANGE = (-2**63, 2**64 - 1)  # the integers a schema may hold (llguidance reads a schema's numbers as 64-bit)
FORCED_MAX = 32  # forced tokens proposed in one cycle
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_lock = threading.Lock()


def _llg():
    import llguidance

    return llguidance


def limits():
    """Bounds on what one grammar may cost to build and to step (a hostile schema fails inside them)."""
    return _llg().LLParserLimits(max_grammar_size=200_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                 max_lexer_states=100_000, verbose_errors=False)


def tokenizer_for(model):
    """llguidance's tokenizer over `model`'s llama.cpp vocabulary (built once per model, ~1 s at 150k tokens);
    every end-of-generation token ends a finished answer."""
    tok = getattr(model, "_llg_tokenizer", None)
    if tok is None:
        with _lock:
            tok = getattr(model, "_llg_tokenizer", None)
            if tok is None:
                tok = model._llg_tokenizer = _build_tokenizer(model)
    return tok


def _build_tokenizer(model):
    """llguidance.llamacpp.lltokenizer_from_vocab, through llama.cpp's current calls (it uses the deprecated
    llama_token_get_attr): every token's bytes, a control token (or a user-defined one spelled <...>) marked special
    with a leading 0xff, and llama.cpp's own tokenizer for the grammar's text."""
    import ctypes

    import llama_cpp

    tokens = []
    for t in range(model.n_vocab):
        raw = model.piece(t, special=True)
        attr = llama_cpp.llama_vocab_get_attr(model.vocab, t)
        if attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL or (attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
                                                         and raw.startswith(b"<") and raw.endswith(b">")):
            raw = b"\xff" + raw
        tokens.append(raw)
    fptr = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    return _llg().LLTokenizer.from_llamacpp(tokens=tokens, vocab_ptr=model.vocab, tokenize_fptr=fptr,
                                            eos_token=sorted(model.eog_ids), slices=None)


@dataclass(frozen=True)
class Grammar:
    """What an answer must be. `kind`: "json_schema", "json_object" or "tool_calls"; `source`: the llguidance
    grammar; `schema`: what a JSON answer validates against; `tools`: each callable function's parameter schema
    (tool calls, specquant_cli.toolcalls)."""

    kind: str
    source: str
    schema: Optional[dict] = None
    tools: dict = field(default_factory=dict)
    required: bool = True  # tool calls: the answer must call (else it may be text instead)

    def validate(self, text: str) -> Optional[str]:
        """Why `text` is not a complete answer of this grammar's kind (None: it is): JSON that parses and
        validates against the schema, or tool calls each naming a function with arguments valid for it."""

        if self.kind == "tool_calls":
            if not self.required and not is_calls(text):
                return self._json_problem(text, "json_schema") if self.schema is not None else None
            try:
                calls = parse(text)
            except ValueError as e:
                return str(e)
            for c in calls:
                problem = _schema_problem(self.tools.get(c["name"], False), c["arguments"])
                if c["name"] not in self.tools or problem:
                    return f"call of {c['name']!r}: {problem or 'no such function'}"
            return None if calls else "no tool call"
        return self._json_problem(text, self.kind)

    def _json_problem(self, text: str, kind: str) -> Optional[str]:
        import jsonschema

        try:
            value = json.loads(text)
        except ValueError as e:
            return f"not JSON: {e}"
        if not isinstance(value, dict) and kind == "json_object":
            return "not a JSON object"
        try:
            return _schema_problem(self.schema or {}, value)
        except jsonschema.SchemaError as e:
            return f"the schema is invalid: {e.message}"


def _schema_problem(schema, value) -> Optional[str]:
    import jsonschema

    if schema is False:
        return "no schema"
    err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(value))
    return None if err is None else err.message


def _sized(obj: Any, what: str) -> str:
    text = json.dumps(obj, ensure_ascii=False)
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise InputError(f"{what} is larger than {MAX_SCHEMA_BYTES // 1024} KiB")
    return text


def json_schema(schema: Any, what: str = "the schema") -> Grammar:
    """Answers that are JSON valid for `schema` (a JSON Schema object)."""
    if not isinstance(schema, dict):
        raise InputError(f"{what} must be a JSON object")
    _sized(schema, what)
    for pointer, value in _nodes(schema):
        if isinstance(value, int) and not isinstance(value, bool) and not INT_RANGE[0] <= value <= INT_RANGE[1]:
            shown = str(value) if len(str(value)) <= 24 else f"{str(value)[:20]}... ({len(str(value))} digits)"
            raise InputError(f"{what} holds the integer {shown} at {pointer or '/'}: a schema's integers fit in 64 "
                             "bits")
    ref = _ref_cycle(schema)
    if ref is not None:
        raise InputError(f"{what} cannot be followed: its $ref {ref!r} leads back to itself before describing any "
                         "value")
    return Grammar("json_schema", _llg().LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS), schema)


def _nodes(doc: Any):
    """(JSON pointer, value) of every value in `doc`, itself first (iteratively: a schema may nest deep)."""
    todo = [("", doc)]
    while todo:
        pointer, value = todo.pop()
        yield pointer, value
        if isinstance(value, dict):
            todo += [(f"{pointer}/{_escape(k)}", v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            todo += [(f"{pointer}/{i}", v) for i, v in reversed(list(enumerate(value)))]


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _resolve(doc: Any, ref: Any) -> Any:
    """The value a local `$ref` ("#", "#/$defs/X") points at in `doc`; None when it is not local or not there."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node = doc
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _ref_cycle(schema: dict) -> Optional[str]:
    """A `$ref` of `schema` that leads back to itself through `$ref`s and `allOf`s alone, before any keyword that
    describes a value ({"$ref": "#"}, or two $defs naming each other): no JSON value is one; None when there is none.
    (A recursion through a property or an array's items is a tree, and fine.)"""

    def heads(node) -> list[tuple[Optional[str], Any]]:
        if not isinstance(node, dict):
            return []
        out = [(node["$ref"], _resolve(schema, node["$ref"]))] if "$ref" in node else []
        out += [(None, sub) for sub in node.get("allOf") or () if isinstance(node.get("allOf"), list)]
        return [(ref, target) for ref, target in out if isinstance(target, dict)]

    done: set[int] = set()
    for _, start in _nodes(schema):
        if not isinstance(start, dict) or id(start) in done:
            continue
        path, on_path = [(start, iter(heads(start)), None)], {id(start)}
        while path:
            node, edges, _ = path[-1]
            step = next(edges, None)
            if step is None:
                path.pop()
                on_path.discard(id(node))
                done.add(id(node))
                continue
            ref, target = step
            if id(target) in on_path:
                return ref or next((r for _, _, r in reversed(path) if r), "allOf")
            if id(target) not in done:
                path.append((target, iter(heads(target)), ref))
                on_path.add(id(target))
    return None


def schema_file(path, model) -> Grammar:
    """The grammar of the JSON Schema in file `path` (chat --json-schema), checked against `model`'s vocabulary."""
    from specquant_cli.fsutil import read_input_file
    from specquant_cli.inputs import decode_file

    what = f"--json-schema {path}"
    data = read_input_file(path, "--json-schema", "JSON Schema file", MAX_SCHEMA_BYTES)  # a FIFO: refused, not read
    if len(data) > MAX_SCHEMA_BYTES:
        raise InputError(f"{what} is larger than {MAX_SCHEMA_BYTES // 1024} KiB")
    try:
        schema = json.loads(decode_file(data, what))
    except RecursionError:
        raise InputError(f"{what} nests too deep") from None
    except ValueError as e:
        raise InputError(f"{what} is not JSON: {e}") from None
    g = json_schema(schema, what)
    check(g, model)
    return g


def json_object() -> Grammar:
    """Answers that are one JSON object."""
    schema = {"type": "object"}
    return Grammar("json_object", _llg().LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS), schema)


def tool_calls(tools: dict[str, dict], model, required: bool, parallel: bool = True,
               text: Optional[Grammar] = None) -> Grammar:
    """Answers that call the functions `tools` (name -> parameter schema) in the Hermes form (specquant_cli.toolcalls),
    one or (`parallel`) more, each call's arguments the root of its own schema (its `$defs` and `$ref`s resolve
    there); unless `required`, an answer may instead be text — JSON of `text`'s schema when given (a
    response_format beside the tools) — which may begin with any character ("<br>" included) but not with the call's
    opening marker: only the marker opens a call (`_not_opening`)."""
    _sized(tools, "the tools")
    opens, closes = _markers(model)
    bodies = [f"body_{i}: {json.dumps(_call_head(name))} "
              f"%json {json.dumps({'x-guidance': JSON_OPTIONS, **params}, ensure_ascii=False)} \"}}\""
              for i, (name, params) in enumerate(tools.items())]
    if text is not None and text.schema is not None:
        other = f"%json {json.dumps({'x-guidance': JSON_OPTIONS, **text.schema}, ensure_ascii=False)}"
    else:
        other = f"/{_not_opening(TOOL_OPEN)}/"
    lark = (f"start: {'calls' if required else 'calls | other'}\n"
            f"calls: call{' (NL call)*' if parallel else ''} NL?\n"
            f"call: {opens} NL ({' | '.join(f'body_{i}' for i in range(len(tools)))}) NL {closes}\n"
            + "".join(b + "\n" for b in bodies)
            + f"other: {other}\n"
            "NL: \"\\n\"\n")
    return Grammar("tool_calls", _llg().LLMatcher.grammar_from_lark(lark), text.schema if text else None,
                   dict(tools), required)


def _not_opening(marker: str) -> str:
    """A regex of the text that does not begin with `marker`, whitespace aside: empty, or a character that is not
    whitespace and not the marker's first, or the marker's first few characters and then one that departs from it
    (or nothing more: a text may be a mere beginning of the marker, "<to"), and then anything.

    Where the template's marker is a special token (Qwen2.5's `<tool_call>`), that token alone opens a call and text
    cannot hold it; text spelling the marker's characters is refused too, as a client (and `toolcalls.parse`) reading
    the answer could not tell it from a call. Where the marker is plain text (a template without tool support), those
    characters are the call: text that means to begin with them cannot (the one ambiguity, resolved for the call)."""
    anything = "(.|\\n)*"
    chars = [_class_char(c) for c in marker]
    rest = ""  # what may follow the marker's first i characters (i from the last down to 1); none may follow all
    for i in range(len(marker) - 1, 0, -1):
        rest = f"([^{chars[i]}]{anything}{'|' + chars[i] + rest if rest else ''})?"
    return f"\\s*([^\\s{chars[0]}]{anything}|{chars[0]}{rest})?"


def _class_char(c: str) -> str:
    """`c` as it stands for itself in and out of a regex's character class (llguidance's Rust syntax); "<" and ">"
    stay bare (escaped, they are word boundaries)."""
    return "\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c


def _call_head(name: str) -> str:
    """A call's JSON up to its arguments: `{"name": "NAME", "arguments": `."""
    return '{"name": ' + json.dumps(name) + ', "arguments": '


def _markers(model) -> tuple[str, str]:
    """The lark spelling of a call's opening and closing markers: the vocabulary's own tokens when each is one
    special token that prints as its text (Qwen2.5's `<tool_call>`), else the text."""
    tok = tokenizer_for(model)
    ids = [model.tokenize(t, add_bos=False, special=True) for t in (TOOL_OPEN, TOOL_CLOSE)]
    if all(len(i) == 1 and tok.is_special_token(i[0]) and model.piece(i[0]) == t.encode()
           for i, t in zip(ids, (TOOL_OPEN, TOOL_CLOSE))):
        return f"<[{ids[0][0]}]>", f"<[{ids[1][0]}]>"
    return json.dumps(TOOL_OPEN), json.dumps(TOOL_CLOSE)


def check(grammar: Grammar, model) -> None:
    """Refuse a grammar llguidance cannot compile for this vocabulary within `limits` (InputError, one line)."""
    tok = tokenizer_for(model)
    is_error, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar.source, tok, limits=limits())
    if is_error:
        first = (messages[0] if messages else "invalid grammar").strip().splitlines()[0]
        raise InputError(f"the {grammar.kind.replace('_', ' ')} cannot be compiled: {first[:300]}")
    matcher = _llg().LLMatcher(tok, grammar.source, log_level=0, limits=limits())  # what an answer would start from
    if matcher.is_error():
        first = (matcher.get_error() or "no answer can begin").strip().splitlines()[0]
        raise InputError(f"the {grammar.kind.replace('_', ' ')} cannot be followed: {first[:300]}")


class Constraint:
    """One answer's place in its grammar. The engine asks `choose` for the parent's token at each position (the
    chosen token is consumed), `valid_prefix` to cut a draft, `forced` for the tokens the grammar allows alone."""

    def __init__(self, grammar: Grammar, model):
        llg = _llg()
        self.grammar = grammar
        self.n_vocab = model.n_vocab
        self.matcher = llg.LLMatcher(tokenizer_for(model), grammar.source, log_level=0, limits=limits())
        self._problem()

    def _problem(self) -> None:
        if self.matcher.is_error():
            raise InputError(f"the {self.grammar.kind.replace('_', ' ')} cannot be followed: "
                             f"{self.matcher.get_error().splitlines()[0][:300]}")

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next (bool per token id)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        self._problem()
        return np.unpackbits(bits, bitorder="little")[:self.n_vocab].astype(bool)

    def masked(self, row: np.ndarray) -> np.ndarray:
        """`row` (logits) with every token the grammar forbids at -inf."""
        allowed = self.allowed()
        if not allowed.any():
            raise InputError("the grammar allows no token here")
        return np.where(allowed[:row.shape[0]], row, -np.inf)

    def fork(self) -> Constraint:
        """A copy at this place, to walk a draft with (this one stays where it is)."""
        other = object.__new__(Constraint)
        other.grammar, other.n_vocab, other.matcher = self.grammar, self.n_vocab, self.matcher.deep_copy()
        return other

    def advance(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.consume(t)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise InputError(f"token {token} is not allowed by the {self.grammar.kind.replace('_', ' ')} here")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar allows in a row from here (nothing consumed)."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def forced(self, limit: int = FORCED_MAX) -> list[int]:
        """The tokens the grammar allows alone from here (jump-forward), at most `limit`."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())[:limit]

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()
