"""The drafting memory shared by every request of a scope, the second drafting level, and the rate guard."""

from __future__ import annotations

import random
import threading
import tracemalloc

import numpy as np
import pytest

from fakes import FakeContext, FakeModel, peaked
from specquant_cli.decoding.drafters import ModelDrafter, StackedDrafter
from specquant_cli.decoding.gamma import GUARD_MIN_CYCLES, FixedGamma, RateGuard
from specquant_cli.decoding.memory import BYTES_PER_TOKEN, DraftMemory, Recorder, tokens_for
from specquant_cli.decoding.protocols import CycleOutcome
from specquant_cli.decoding.sampling import GREEDY, SamplingParams
from specquant_cli.decoding.suffix import SuffixDrafter


def flat(n: int) -> float:
    return 1.0


# -- one memory, many requests ---------------------------------------------------------------------------------
def test_one_requests_answer_drafts_for_another():
    mem = DraftMemory()
    a, b = SuffixDrafter(verify_cost=flat, memory=mem), SuffixDrafter(verify_cost=flat, memory=mem)
    a.prepare([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # request A's prompt + answer, as its slot saw them
    b.prepare([50, 51, 2, 3, 4])  # request B, another slot, shares nothing with A but this run
    assert b.propose([50, 51, 2, 3, 4], 4).tokens == [5, 6, 7, 8]


def test_a_private_memory_shares_nothing():
    a, b = SuffixDrafter(verify_cost=flat), SuffixDrafter(verify_cost=flat)
    a.prepare([1, 2, 3, 4, 5, 6, 7, 8])
    b.prepare([50, 2, 3, 4])
    assert b.propose([50, 2, 3, 4], 4).tokens == []


def test_a_reader_writes_nothing():
    mem = DraftMemory()
    reader = SuffixDrafter(verify_cost=flat, memory=mem, record=False)
    reader.prepare([1, 2, 3, 4, 5, 6])
    assert reader.propose([1, 2, 3, 4, 5, 6, 1, 2, 3], 3).tokens == []
    assert mem.use()["tokens"] == 0


def test_the_budget_holds_and_the_least_recently_used_goes_first():
    mem = DraftMemory(max_tokens=100)
    docs = [[1000 * d + i for i in range(40)] for d in range(3)]
    recs = [Recorder(mem) for _ in docs]
    recs[0].start(docs[0])
    recs[1].start(docs[1])
    length, cands = mem.match(docs[0][:10])  # doc 0 drafts something: it is now used more recently than doc 1
    mem.walk(cands, 4, 0.0)
    recs[2].start(docs[2])  # 120 tokens > 100: one document goes
    use = mem.use()
    assert use["tokens"] <= 100 and use["evicted"] == 1
    assert mem.match(docs[1][:10])[0] == 0  # the least recently used one is gone
    assert mem.match(docs[0][:10])[0] >= 3 and mem.match(docs[2][:10])[0] >= 3


def test_eviction_rebuilds_the_index_and_matches_stay_right():
    mem = DraftMemory(max_tokens=200)
    rng = random.Random(0)
    kept = []
    for d in range(40):  # many evictions: the index is rebuilt several times
        doc = [rng.randrange(50_000) for _ in range(60)]
        Recorder(mem).start(doc)
        kept.append(doc)
    assert mem.use()["tokens"] <= 200 and mem.use()["evicted"] >= 36
    last = kept[-1]
    d = SuffixDrafter(verify_cost=flat, memory=mem, record=False)
    assert d.propose(last[:20], 5).tokens == last[20:25]
    assert mem._entries <= 2 * max(1, mem._live) + 6 * 60  # dead entries do not pile up


def test_a_document_being_written_is_never_evicted():
    mem = DraftMemory(max_tokens=0)  # budget 0: each answer drafts from itself alone
    d = SuffixDrafter(verify_cost=flat, memory=mem)
    seq = [9, 1, 2, 3, 4, 5, 9, 1, 2, 3]
    d.prepare(seq)
    assert d.propose(seq, 2).tokens == [4, 5]


def test_the_memory_is_safe_under_concurrent_requests():
    mem = DraftMemory(max_tokens=3000)
    errors = []

    def slot(seed: int) -> None:
        rng = random.Random(seed)
        d = SuffixDrafter(verify_cost=flat, memory=mem)
        try:
            for _ in range(30):
                seq = [rng.randrange(40) for _ in range(30)]
                d.prepare(seq)
                for _ in range(20):
                    seq += d.propose(seq, 4).tokens or [rng.randrange(40)]
        except Exception as e:  # noqa: BLE001 - the test reports any
            errors.append(e)

    threads = [threading.Thread(target=slot, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert mem.use()["tokens"] <= 3000


def test_the_ram_estimate_per_token_is_an_upper_bound():
    rng = random.Random(1)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mem = DraftMemory(max_tokens=10**9)
    for _ in range(100):  # 20 k tokens of text with repeats, like prompts and answers
        base = [rng.randrange(30_000) for _ in range(100)]
        Recorder(mem).start(base + [t if rng.random() < 0.7 else rng.randrange(30_000) for t in base])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert used / mem.use()["tokens"] <= BYTES_PER_TOKEN
    assert tokens_for(64) * BYTES_PER_TOKEN <= 64 << 20


# -- the second drafting level ---------------------------------------------------------------------------------
V = 64


def _rule(tokens) -> np.ndarray:
    return peaked((tokens[-1] * 5 + 3) % V, V)


def _stacked(memory_seq=None, p_min=None):
    mem = DraftMemory()
    if memory_seq is not None:
        Recorder(mem).start(memory_seq)
    lower = SuffixDrafter(7, verify_cost=flat, memory=mem, record=False)
    ctx = FakeContext(FakeModel(V, eog=V - 1), _rule)
    return StackedDrafter(ctx, lower, p_min=p_min), ctx


def _chain(start: int, n: int) -> list[int]:
    out = [start]
    for _ in range(n - 1):
        out.append((out[-1] * 5 + 3) % V)
    return out


@pytest.mark.parametrize("memory", ["agrees", "disagrees", "empty"])
def test_the_stacked_draft_is_the_models_own(memory):
    seq = [7, 11, 13]
    plain_ctx = FakeContext(FakeModel(V, eog=V - 1), _rule)
    want = ModelDrafter(plain_ctx).propose(seq, 8, GREEDY, GREEDY.uniforms()).tokens
    chain = _chain(13, 10)
    wrong = [(t + 1) % V for t in chain[2:]]  # the same context, then other tokens than the model picks
    remembered = {"agrees": [1, 2, *chain], "disagrees": [1, 11, *chain[:2], *wrong], "empty": None}
    d, ctx = _stacked(remembered[memory])
    got = d.propose(seq, 8, GREEDY, GREEDY.uniforms()).tokens
    assert got == want
    assert ctx.tokens == seq + got[:len(ctx.tokens) - len(seq)]  # the cache holds what it says, no more
    c = d.counters
    if memory == "agrees":
        assert c["level2_accepted"] > 0 and c["model_calls"] < plain_ctx.decode_calls
    elif memory == "disagrees":
        assert c["level2_proposed"] > 0 and c["level2_accepted"] == 0
    else:
        assert c["level2_proposed"] == 0 and c["model_calls"] == plain_ctx.decode_calls


def test_a_sampled_stacked_draft_is_the_models_own_sample():
    sp = SamplingParams(temperature=0.8, seed=3)
    seq = [7, 11, 13]

    def soft(tokens):
        row = np.zeros(V, dtype=np.float32)
        row[(tokens[-1] * 5 + 3) % V] = 2.0
        row[(tokens[-1] * 7 + 1) % V] = 1.5
        return row

    want = ModelDrafter(FakeContext(FakeModel(V, eog=V - 1), soft)).propose(seq, 6, sp, sp.uniforms()).tokens
    mem = DraftMemory()
    Recorder(mem).start([1, 2, *_chain(13, 10)])
    d = StackedDrafter(FakeContext(FakeModel(V, eog=V - 1), soft), SuffixDrafter(7, verify_cost=flat, memory=mem,
                                                                                   record=False))
    assert d.propose(seq, 6, sp, sp.uniforms()).tokens == want


def test_the_next_draft_continues_from_a_consistent_cache():
    d, ctx = _stacked([1, 2, *_chain(13, 12)])
    seq = [7, 11, 13]
    first = d.propose(seq, 4, GREEDY, GREEDY.uniforms()).tokens
    seq2 = seq + first[:2] + [60]  # the parent kept two and said 60
    second = d.propose(seq2, 4, GREEDY, GREEDY.uniforms()).tokens
    assert second == _chain((60 * 5 + 3) % V, 4)
    assert ctx.tokens[:len(seq2)] == seq2


# -- the rate guard --------------------------------------------------------------------------------------------
def _cycle(proposed, accepted, draft_s, verify_s):
    return CycleOutcome(proposed, accepted, 0, draft_s, verify_s, proposed + 1)


def test_a_slow_answer_goes_on_with_the_parent_alone():
    g = RateGuard(FixedGamma(4), lambda pos: 0.1, position=100)  # the parent: 10 tokens/s
    for _ in range(GUARD_MIN_CYCLES):
        assert g.draft_length() == 4
        g.update(_cycle(4, 0, 0.2, 0.15))  # 1 token per 0.35 s: 2.9 tokens/s
    assert g.draft_length() == 0 and g.tripped_at == GUARD_MIN_CYCLES


def test_a_fast_answer_keeps_drafting():
    g = RateGuard(FixedGamma(4), lambda pos: 0.1, position=100)
    for _ in range(3 * GUARD_MIN_CYCLES):
        g.update(_cycle(4, 4, 0.1, 0.15))  # 5 tokens per 0.25 s
    assert g.draft_length() == 4 and g.tripped_at is None


def test_the_guard_compares_with_parent_steps_measured_in_the_same_answer():
    # The calibration says 0.1 s a step, but this machine is now twice as slow: the answer's plain parent
    # steps say so, and a draft that is 1.5x those steps goes on.
    g = RateGuard(FixedGamma(4), lambda pos: 0.1, position=0)
    g.update(_cycle(0, 0, 0.0, 0.2))
    g.update(_cycle(0, 0, 0.0, 0.2))
    for _ in range(2 * GUARD_MIN_CYCLES):
        g.update(_cycle(4, 2, 0.2, 0.2))  # 3 tokens per 0.4 s: 7.5 tokens/s, the parent now 5
    assert g.tripped_at is None


def test_the_guard_prices_the_parent_at_the_answers_position():
    seen = []
    g = RateGuard(FixedGamma(4), lambda pos: seen.append(pos) or 0.1, position=500)
    for _ in range(GUARD_MIN_CYCLES):
        g.update(_cycle(4, 4, 0.1, 0.1))
    assert seen and seen[0] == 500 + 5 * GUARD_MIN_CYCLES
