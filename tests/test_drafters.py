"""Drafters: n-gram lookup, model drafter window and KV import, the fallback drafter (scripted contexts)."""

from specquant_cli.decoding.drafters import NGramDrafter
from specquant_cli.decoding.sampling import SamplingParams

from fakes import FakeContext, FakeModel, peaked

V, EOG = 16, 15
counting = lambda toks: peaked((toks[-1] + 1) % 14, V)  # noqa: E731


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    d = NGramDrafter((3, 2))
    assert d.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 3).tokens == [8, 9, 1]
    assert d.propose([5, 6, 1, 5, 6, 2, 5, 6], 2).tokens == [2, 5]  # latest occurrence wins
    assert d.propose([1, 2, 3], 4).tokens == []
    assert d.propose([4, 4, 4, 4], 2).tokens == [4]


def test_fallback_drafter_prefers_ngram_and_wakes_the_model_late():
    from specquant_cli.decoding.drafters import FallbackDrafter, ModelDrafter

    model = FakeModel(V, EOG)
    draft_ctx = FakeContext(model, counting)
    fb = FallbackDrafter(NGramDrafter((3,)), ModelDrafter(draft_ctx, "fake"), activate_after=4)
    prompt = [1, 2, 3, 9, 1, 2]
    fb.prepare(prompt)
    assert draft_ctx.decode_calls == 0  # no draft prefill up front
    assert fb.propose(prompt + [3], 2, SamplingParams(), None).tokens == [9, 1]  # n-gram hit
    assert fb.propose(prompt + [5], 2, SamplingParams(), None).tokens == []  # miss, model still asleep
    long = prompt + [5, 6, 7, 8]
    assert fb.propose(long, 2, SamplingParams(), None).tokens == [9, 10]  # model drafts after 4 new tokens
    assert draft_ctx.decode_calls >= 1


def test_model_drafter_window_bounds_the_draft_prefill():
    from specquant_cli.decoding.drafters import ModelDrafter

    ctx = FakeContext(FakeModel(V, EOG), counting)
    d = ModelDrafter(ctx, "fake", window=3)
    seq = list(range(10))
    d.prepare(seq)
    assert ctx.tokens == [7, 8, 9]
    assert d.propose(seq + [10], 2, SamplingParams(), None).tokens == [11, 12]
    assert ctx.tokens[:4] == [7, 8, 9, 10]
