"""The prefix logic shared by the real context and the scripted one."""

import random

from specquant_cli.backend.llama import common_prefix

from fakes import FakeContext, FakeModel, peaked


def test_common_prefix_matches_a_plain_scan():
    rnd = random.Random(0)
    for _ in range(2000):
        cached = [rnd.randint(0, 3) for _ in range(rnd.randint(0, 12))]
        new = cached[:rnd.randint(0, len(cached))] + [rnd.randint(0, 3) for _ in range(rnd.randint(0, 5))]
        want = next((i for i, (a, b) in enumerate(zip(cached, new)) if a != b), min(len(cached), len(new)))
        assert common_prefix(cached, new) == want


def test_sync_reuses_the_prefix_and_redecodes_the_last_token_for_logits():
    ctx = FakeContext(FakeModel(8, 7), lambda toks: peaked(0, 8))
    assert ctx.sync([1, 2, 3, 4]) == 4
    assert ctx.sync([1, 2, 5]) == 1 and ctx.tokens == [1, 2, 5]
    assert ctx.sync([1, 2, 5]) == 1  # fully cached: the last token again, so logits exist
    assert ctx.sync([1, 2, 5], logits="none") == 0
