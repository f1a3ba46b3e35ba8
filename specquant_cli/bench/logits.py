"""Where a row's numbers depend on how it was computed (`specquant bench logits`): the parent's logits for the same
positions of the same text, computed one token at a time after a prefill in one batch (the reference), and again

- inside a verification batch of 2 to 64 tokens, at several offsets into the text;
- after the prefix was restored from a saved state (what the prompt cache stores, in memory or on disk: the same bytes);
- after a prefill split at other chunk boundaries (a prompt cache hit prefills the rest from where the hit ends);
- beside another sequence's tokens in one batch (a server's slots decoding together);
- with another thread count.

A control (the reference's way again, in a fresh context) shows the comparison itself is sound. Each case is reported
as bit-equal or not, the largest difference of a logit, and whether the top token is the same at
every position: what "the parent's own answer" can and cannot promise on this build, this CPU and this model. Greedy
output differs only where a difference reaches the top two tokens (a near-tie); bit-equal rows cannot differ at all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from specquant_cli.bench.stamp import markdown_lines

TEXT = ("The bisect module keeps a list in sorted order without sorting it again after each insertion. "
        "def insort_right(a, x, lo=0, hi=None, *, key=None):\n    if lo < 0:\n        raise ValueError('lo must be "
        "non-negative')\n    if hi is None:\n        hi = len(a)\n    while lo < hi:\n        mid = (lo + hi) // 2\n"
        "        if x < a[mid]:\n            hi = mid\n        else:\n            lo = mid + 1\n    a.insert(lo, x)\n")
ANSWER_TOKENS = 64  # positions compared after the prompt
BATCHES = (2, 4, 8, 16, 32, 64)
OFFSETS = (0, 5, 17)
CHUNKS = (1, 7, 64)  # other prefill chunk sizes than one batch
SPLIT_AT = (0.5, 0.9)  # a prefill that stops there first (a prompt cache hit of that much of the prompt)


@dataclass
class Case:
    name: str
    what: str
    rows: int = 0
    bit_equal: int = 0
    max_diff: float = 0.0
    top_same: int = 0
    error: Optional[str] = None

    def add(self, got: np.ndarray, ref: np.ndarray) -> None:
        self.rows += 1
        self.bit_equal += bool(np.array_equal(got, ref))
        self.max_diff = max(self.max_diff, float(np.max(np.abs(got.astype(np.float64) - ref))))
        self.top_same += int(np.argmax(got)) == int(np.argmax(ref))

    def to_dict(self) -> dict:
        return {"case": self.name, "what": self.what, "rows": self.rows, "bit_equal": self.bit_equal,
                "max_diff": self.max_diff, "top_same": self.top_same, **({"error": self.error} if self.error else {})}


def run(path: str, threads: int, prompt_text: str = TEXT, answer_tokens: int = ANSWER_TOKENS,
        progress: Optional[Callable[[str], None]] = None, other_threads: Optional[int] = None) -> dict:
    """The cases for the model at `path` on `threads` llama.cpp threads (and `other_threads` for the thread case):
    {"prompt_tokens", "answer_tokens", "cases": [Case.to_dict()]}."""
    from specquant_cli.backend.llama import Context, Model

    say = progress or (lambda _: None)
    with Model(path) as m:
        prompt = m.tokenize(prompt_text, add_bos=m.add_bos())
        n_ctx = 2 * (len(prompt) + answer_tokens + 8)

        def fresh(n_seq: int = 1, n_threads: int = threads, n_batch: int = 512) -> Context:
            return Context(m, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, n_seq_max=n_seq,
                           kv_unified=n_seq > 1)

        say("reference: one token at a time")
        ref_ctx = fresh()
        text, ref = _reference(ref_ctx, prompt, answer_tokens)
        cases: list[Case] = []
        try:
            say("the reference again")
            c = Case("reference again", "the reference's way again in a fresh context (the control: always bit-equal)")
            again = fresh()
            try:
                for got, want in zip(_reference(again, prompt, answer_tokens, text)[1], ref):
                    c.add(got, want)
            finally:
                again.close()
            cases.append(c)
            cases.append(_batches(ref_ctx, prompt, text, ref, say))
            cases.append(_restored(ref_ctx, fresh, prompt, text, ref, say))
            cases += _chunked(fresh, prompt, text, ref, say)
            cases.append(_beside(fresh, prompt, text, ref, say))
            if other_threads and other_threads != threads:
                say(f"{other_threads} threads")
                n = f"{other_threads} thread{'s' if other_threads != 1 else ''}"
                c = Case(n, f"the reference's way on {n}, not {threads}")
                other = fresh(n_threads=other_threads)
                try:
                    _, rows = _reference(other, prompt, answer_tokens, text)
                    for got, want in zip(rows, ref):
                        c.add(got, want)
                finally:
                    other.close()
                cases.append(c)
        finally:
            ref_ctx.close()
    return {"prompt_tokens": len(prompt), "answer_tokens": len(text), "cases": [c.to_dict() for c in cases]}


def _reference(ctx, prompt: list[int], n: int, text: Optional[Sequence[int]] = None):
    """(the answer's tokens, each answer position's logits): the prompt prefilled in one batch, then one token at a
    time — greedy from the logits unless `text` gives the tokens to feed."""
    ctx.reset()
    ctx.decode(prompt[:-1], logits="none")
    out, rows, last = [], [], prompt[-1]
    for i in range(n):
        ctx.decode([last], logits="last")
        row = ctx.logits(-1).copy()
        rows.append(row)
        last = int(text[i]) if text is not None else int(np.argmax(row))
        out.append(last)
    return out, rows


def _batches(ctx, prompt: list[int], text: list[int], ref: list[np.ndarray], say) -> Case:
    """Each answer position scored inside a verification batch of n tokens starting `offset` tokens in."""
    c = Case("verify batch", f"inside a batch of {BATCHES[0]}–{BATCHES[-1]} tokens at offsets "
                             f"{', '.join(map(str, OFFSETS))} (a verification)")
    seq = prompt + text
    base = len(prompt) - 1  # the batch opens with the token before the first answer position
    held = ctx.export_state(0)  # the reference's cache: each batch starts from it, not from the last batch's rows
    for n in BATCHES:
        say(f"verify batch of {n}")
        for off in OFFSETS:
            if off + n > len(text):
                continue
            if not ctx.import_state(held, seq[:base + len(text)]):
                c.error = "llama.cpp refused the reference's saved state"
                return c
            ctx.rewind(base + off)
            ctx.decode(seq[base + off:base + off + n], logits="all")
            for j in range(n):
                c.add(ctx.logits(j).copy(), ref[off + j])
    return c


def _restored(ctx, fresh, prompt: list[int], text: list[int], ref: list[np.ndarray], say) -> Case:
    """The prompt's state saved from one context and loaded into a fresh one (the prompt cache's bytes), then the
    answer one token at a time."""
    say("restored prefix")
    c = Case("restored prefix", "after the prompt's state was saved and loaded (the prompt cache, RAM or disk)")
    ctx.rewind(len(prompt) - 1)  # positions before the answer: the reference's prefill, no batch wrote them
    state = ctx.export_state(0)
    other = fresh()
    try:
        if not other.import_state(state, prompt[:-1]):
            c.error = "llama.cpp refused the saved state"
            return c
        rows = _continue(other, prompt[-1], text)
        for got, want in zip(rows, ref):
            c.add(got, want)
    finally:
        other.close()
    return c


def _continue(ctx, last: int, text: Sequence[int]) -> list[np.ndarray]:
    """The answer's positions' logits, one token a call, from a context holding the prompt less its `last` token."""
    rows = []
    for tok in [last, *text[:-1]]:
        ctx.decode([tok], logits="last")
        rows.append(ctx.logits(-1).copy())
    return rows


def _chunked(fresh, prompt: list[int], text: list[int], ref: list[np.ndarray], say) -> list[Case]:
    """The prompt prefilled in chunks of other sizes, or in two parts (a prompt-cache hit, then the rest)."""
    cases = []
    ways = [(f"prefill chunks of {k}", f"the prompt prefilled {k} token{'s' * (k > 1)} a call", [k])
            for k in CHUNKS] + \
           [(f"prefill split at {int(100 * f)}%", f"the prompt prefilled as {int(100 * f)}% then the rest "
             "(a prompt cache hit)", f) for f in SPLIT_AT]
    for name, what, how in ways:
        say(name)
        c = Case(name, what)
        ctx = fresh()
        try:
            body = prompt[:-1]
            if isinstance(how, list):
                for i in range(0, len(body), how[0]):
                    ctx.decode(body[i:i + how[0]], logits="none")
            else:
                cut = max(1, int(len(body) * how))
                ctx.decode(body[:cut], logits="none")
                ctx.decode(body[cut:], logits="none")
            rows = _continue(ctx, prompt[-1], text)
            for got, want in zip(rows, ref):
                c.add(got, want)
        finally:
            ctx.close()
        cases.append(c)
    return cases


def _beside(fresh, prompt: list[int], text: list[int], ref: list[np.ndarray], say) -> Case:
    """The answer one token a call, beside another sequence decoding as a server's second slot does: in the same
    call (one shared cache), or in the deterministic mode in a cache of its own, the two calls in turn
    (runtime.pool.ModelPool.own_caches)."""
    from specquant_cli.settings import deterministic

    say("beside another sequence")
    if deterministic():
        return _beside_own(fresh, prompt, text, ref)
    c = Case("beside a slot", "each call also decoding another sequence's token (two slots of one server)")
    ctx = fresh(n_seq=2)
    try:
        body = prompt[:-1]
        ctx.decode(body, logits="none")
        other = list(reversed(body))
        ctx.decode_at(other, list(range(len(other))), [(1,)] * len(other), [])
        seq = [prompt[-1], *text[:-1]]
        for i, tok in enumerate(seq):
            pos = len(body) + i
            ctx.decode_at([tok, other[i % len(other)]], [pos, len(other) + i], [(0,), (1,)], [0, 1])
            c.add(ctx.logits(0).copy(), ref[i])
    finally:
        ctx.close()
    return c


def _beside_own(fresh, prompt: list[int], text: list[int], ref: list[np.ndarray]) -> Case:
    c = Case("beside a slot", "another sequence decoding in a cache of its own between this one's calls (two slots "
             "of one server in the deterministic mode)")
    ctx, other_ctx = fresh(), fresh()
    try:
        body = prompt[:-1]
        ctx.decode(body, logits="none")
        other = list(reversed(body))
        other_ctx.decode(other, logits="none")
        for i, tok in enumerate([prompt[-1], *text[:-1]]):
            ctx.decode([tok], logits="last")
            c.add(ctx.logits(-1).copy(), ref[i])
            other_ctx.decode([other[i % len(other)]], logits="last")
    finally:
        ctx.close()
        other_ctx.close()
    return c


def report(family, results: dict[str, dict], threads: int, stamp: dict, machine: dict) -> dict:
    return {"command": stamp["command"], "stamp": stamp, "machine": machine,
            "family": {"name": family.name, "root": str(family.root), "parent": family.parent_rendering},
            "threads": threads, "models": results}  # the mode the rows were computed in: the stamp's


def markdown(rep: dict) -> str:
    lines = [f"# Logits by how they were computed: {rep['family']['name']}", "",
             f"- command: `{rep['command']}`", *markdown_lines(rep.get("stamp")),
             f"- {rep['threads']} threads; the reference: the prompt prefilled in one batch, then one token at a time; "
             "each case's rows against the reference's at the same positions", ""]
    for role, r in rep["models"].items():
        if "error" in r:
            lines += [f"## {role}: {r['error']}", ""]
            continue
        lines += [f"## {role} ({r['prompt_tokens']} prompt tokens, {r['answer_tokens']} positions)", "",
                  "| case | rows | bit-equal | largest logit difference | same top token | how |",
                  "|---|---|---|---|---|---|"]
        for c in r["cases"]:
            if c.get("error"):
                lines.append(f"| {c['case']} | – | – | – | – | {c['error']} |")
                continue
            lines.append(f"| {c['case']} | {c['rows']} | {c['bit_equal']}/{c['rows']} | {c['max_diff']:.3g} | "
                         f"{c['top_same']}/{c['rows']} | {c['what']} |")
        lines.append("")
    return "\n".join(lines)
