"""Code fences end a copy's drafts (decoding.fences, decoding.suffix): an answer that rewrites a fenced file from its
prompt is drafted up to the fence that closes its block, not on into the instructions that follow the file in the
prompt, and right after it closes the block nothing is drafted unless the copy went on through the fence; a fence is
one at the start of a line only ("in one ```python block" within a sentence is none). The real vocabulary of the test
family; every draft judged against the answer as the parent would (the oracle of tests/test_copying.py)."""

from __future__ import annotations

import pytest
from test_copying import flat_ish, oracle

from specquant_cli.backend.model import Model
from specquant_cli.decoding.fences import Count, Fences
from specquant_cli.decoding.suffix import SuffixDrafter

FILE = "".join(f"def step_{i}(value, scale={i + 2}):\n    \"\"\"Scale by {i + 2}, then shift by {3 * i + 1}.\"\"\"\n"
               f"    return value * scale + {3 * i + 1}\n\n\n" for i in range(6))
PROMPT = ("Here is steps.py:\n```python\n" + FILE + "```\n\nRename nothing and reply with the complete updated file in "
          "one ```python block and nothing else.\nassistant\n")  # the answer starts a line, as a chat template's


@pytest.fixture(scope="module")
def vocab(family_dir):
    model = Model(next(family_dir.glob("*q8_0.gguf")), vocab_only=True)
    yield model
    model.close()


def fences(model):
    return Fences(model.backtick_pieces, model.piece)


def tokens(model, text):
    return model.tokenize(text, add_bos=False)


def text(model, ids):
    return b"".join(model.piece(t) for t in ids)


def test_a_fence_starts_a_line_and_one_within_a_sentence_is_none(vocab):
    f, t = fences(vocab), (lambda s: tokens(vocab, s))
    opened = t("Reply in one ```python block.\n```python\nx = 1\n")
    assert f.room(t("Reply in one ```python block.\n"), t("```python\nx = 1\n"), False) == len(t("```python\nx = 1\n"))
    draft = t("y = 2\n```\n\nThanks.")
    cut = f.room(opened, draft, False)
    assert 0 < cut < len(draft) and b"`" not in b"".join(vocab.piece(x) for x in draft[:cut])
    inline = t("y = 2  # not a fence: ```x``` here\nz = 3\n")
    assert f.room(opened, inline, False) == len(inline)
    closed = opened + t("```")
    assert f.room(closed, t("\n\nThanks."), False) == 0  # right after the block closes
    assert f.room(closed, t("\n\nThanks."), True) == len(t("\n\nThanks."))  # the copy went on through the fence


def test_a_count_carried_through_an_answer_agrees_with_one_from_scratch(vocab):
    f = fences(vocab)
    prompt = tokens(vocab, PROMPT)
    head = tokens(vocab, "```python\n" + FILE)
    # the closing fence in two tokens, as a vocabulary may split it ("``" then "`\n"): a count may stop between them
    seq = prompt + head + tokens(vocab, "``") + tokens(vocab, "`\n") + tokens(vocab, "Done.")
    draft, count = tokens(vocab, "\n```\n\nRename nothing"), Count()
    split = len(prompt) + len(head)
    assert f.room(seq[:split], draft, False) == 1  # the block is open: the draft's fence would close it
    assert f.room(seq, draft, False) == len(draft)  # the split fence closed it: the draft's opens another
    for end in range(len(prompt), len(seq) + 1):  # an answer growing a token a draft
        assert f.room(seq[:end], draft, False, count) == f.room(seq[:end], draft, False)
        assert count.n == end
    # another, longer sequence (a block opened and closed before the same text): counted afresh
    other = tokens(vocab, "Prose.\n```\ncode\n```\n") + seq + tokens(vocab, " end")
    assert f.room(other, draft, False, count) == f.room(other, draft, False)


def answer_and_close(model):
    """The answer (the file, fenced, then a word of its own) and the index of its closing fence's first token."""
    head = tokens(model, "```python\n" + FILE)
    return head + tokens(model, "```\nDone."), len(head)


def test_a_copy_stops_before_the_fence_that_closes_the_answer_s_block(vocab):
    prompt = tokens(vocab, PROMPT)
    answer, close = answer_and_close(vocab)
    calls, drafts = oracle(SuffixDrafter(verify_cost=flat_ish, fences=fences(vocab)), prompt, answer)
    assert sum(len(d) for _, d in drafts) > len(FILE) // 8  # it copied the file
    assert not any(b"`" in text(vocab, d) for _, d in drafts)  # never the fence (the opening one is the first token)
    after = [d for pos, d in drafts if pos > close]
    assert after and not after[0]  # right after the block closed: the parent's own step
    # without the fences, a draft runs on into the fence and the prompt's text after its file
    _, plain = oracle(SuffixDrafter(verify_cost=flat_ish), prompt, answer)
    assert any(b"`" in text(vocab, d) for _, d in plain)


def test_a_copy_that_repeats_the_fence_and_what_follows_drafts_on_through_it(vocab):
    source = "```python\n" + FILE + "```\n\nThat was the first file; the second one follows below, unchanged.\n"
    prompt = tokens(vocab, "Repeat this exactly:\n" + source + "assistant\n")
    answer = tokens(vocab, source)
    calls, drafts = oracle(SuffixDrafter(verify_cost=flat_ish, fences=fences(vocab)), prompt, answer)
    plain_calls, _ = oracle(SuffixDrafter(verify_cost=flat_ish), prompt, answer)
    assert calls <= plain_calls + 1  # one call more at most: the fence is the parent's bonus token, then on
