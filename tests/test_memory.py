"""The drafting memory shared by every request of a scope, the second drafting level, and the rate guard."""

from __future__ import annotations

import random
import threading
import tracemalloc
from typing import Optional

import numpy as np
import pytest

from specquant_cli.decoding.drafters import ModelDrafter
from specquant_cli.decoding.gamma import GUARD_MIN_CYCLES, FixedGamma, RateGuard
from specquant_cli.decoding.memory import BYTES_PER_TOKEN, DraftMemory, Recorder, tokens_for
from specquant_cli.decoding.protocols import CycleOutcome
from specquant_cli.decoding.sampling import GREEDY, SamplingParams
from specquant_cli.decoding.suffix import SuffixDrafter

from fakes import FakeContext, FakeModel, peaked


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
    for _ in range(40):  # many evictions: the index is rebuilt several times
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


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
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
    return ModelDrafter(ctx, p_min=p_min, lower=lower), ctx


def _chain(start: int, n: int) -> list[int]:
    out = [start]
    for _ in range(n - 1):
        out.append((out[-1] * 5 + 3) % V)
    return out


@pytest.mark.parametrize("memory", ["agrees", "disagrees", "empty"])
def test_the_stacked_draft_is_the_models_own(memory):
    seq = [7, 11, 13]
    plain_ctx = FakeContext(FakeModel(V, eog=V - 1), _rule)
    want = ModelDrafter(plain_ctx).propose(seq, 8, GREEDY, GREEDY.noise()).tokens
    chain = _chain(13, 10)
    wrong = [(t + 1) % V for t in chain[2:]]  # the same context, then other tokens than the model picks
    remembered = {"agrees": [1, 2, *chain], "disagrees": [1, 11, *chain[:2], *wrong], "empty": None}
    d, ctx = _stacked(remembered[memory])
    got = d.propose(seq, 8, GREEDY, GREEDY.noise()).tokens
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

    want = ModelDrafter(FakeContext(FakeModel(V, eog=V - 1), soft)).propose(seq, 6, sp, sp.noise()).tokens
    mem = DraftMemory()
    Recorder(mem).start([1, 2, *_chain(13, 10)])
    d = ModelDrafter(FakeContext(FakeModel(V, eog=V - 1), soft),
                     lower=SuffixDrafter(7, verify_cost=flat, memory=mem, record=False))
    assert d.propose(seq, 6, sp, sp.noise()).tokens == want


def test_the_next_draft_continues_from_a_consistent_cache():
    d, ctx = _stacked([1, 2, *_chain(13, 12)])
    seq = [7, 11, 13]
    first = d.propose(seq, 4, GREEDY, GREEDY.noise()).tokens
    seq2 = seq + first[:2] + [60]  # the parent kept two and said 60
    second = d.propose(seq2, 4, GREEDY, GREEDY.noise()).tokens
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


# -- pricing: the second level, the context position, the KV import -----------------------------------------
def _costs(q4_batch: Optional[dict] = None, deep: Optional[dict] = None, imports: Optional[dict] = None):
    from specquant_cli.decoding.gamma import expected_tokens, verify_shape
    from specquant_cli.system.calibration import Calibration

    c = Calibration({n: 0.06 * verify_shape(n) for n in range(1, 17)}, {"q4": 0.025}, {"parent": 0.008, "q4": 0.005},
                    {"q4": 0.9}, {"q4": [expected_tokens(0.9, g) for g in range(1, 16)]}, {"q4": 0.045})
    c.draft_call_s = {"q4": q4_batch} if q4_batch else {}
    if deep:
        c.deep_call_s, c.deep_pos = deep, 1024
    c.import_s = imports or {}
    return c


CHEAP_BATCH = {1: 0.025, 2: 0.03, 3: 0.032, 4: 0.034, 5: 0.036, 6: 0.038, 7: 0.04, 8: 0.042}
STEEP_BATCH = {n: 0.025 * n for n in range(1, 9)}


def test_the_second_level_is_priced_from_the_drafts_batch_curve():
    from specquant_cli.routing import auto

    assert auto.stacked_step(_costs(), "q4", 0.8) is None  # no batch curve measured: not offered
    assert auto.stacked_step(_costs(CHEAP_BATCH), "q4", 0.0) == 1.0  # nothing to copy: a plain step
    assert auto.stacked_step(_costs(CHEAP_BATCH), "q4", 0.8) < 0.7
    assert auto.stacked_step(_costs(STEEP_BATCH), "q4", 0.8) == 1.0  # a call per token either way: no gain

    def by(c, copy):
        return {x.name: x for x in auto.candidates("medium", copy, ("parent", "q4"), c)}

    plain, cheap, steep = by(_costs(), 0.8), by(_costs(CHEAP_BATCH), 0.8), by(_costs(STEEP_BATCH), 0.8)
    # Where the batch curve is measured the two-level form replaces the plain one: never predicted below it,
    # above it where proposals are cheap to verify, equal where they are not (the lower level then proposes
    # nothing: it sizes each proposal from the same curve).
    assert "stacked-q4" not in plain and "q4" not in cheap and "suffix+q4" not in cheap
    assert cheap["stacked-q4"].predicted > plain["q4"].predicted * 1.1
    assert cheap["suffix+stacked-q4"].predicted > plain["suffix+q4"].predicted
    assert steep["stacked-q4"].predicted == pytest.approx(plain["q4"].predicted)


def test_plans_are_priced_at_the_answers_context_position():
    from specquant_cli.routing import auto

    # Deep in the context the parent's one-token call costs 2x, its 8-token call 1.2x, the draft's step 1.1x:
    # drafting pays more there.
    c = _costs(CHEAP_BATCH, deep={"parent": {1: 0.12, 4: 0.06 * 1.8 * 1.2, 8: 0.06 * 2.1 * 1.2},
                                  "q4": {1: 0.0275, 4: 0.034 * 1.1, 8: 0.042 * 1.1}})
    near = {x.name: x.predicted for x in auto.candidates("medium", 0.0, ("parent", "q4"), c, position=64)}
    far = {x.name: x.predicted for x in auto.candidates("medium", 0.0, ("parent", "q4"), c, position=1024)}
    assert far["stacked-q4"] > near["stacked-q4"] and far["parent"] == near["parent"] == 1.0
    deep = c.at(1024)
    assert deep.parent_call_s[1] == pytest.approx(0.12) and deep.draft_step_s["q4"] == pytest.approx(0.0275)
    assert c.at(10) is c


def test_a_long_prompts_import_is_charged_to_a_short_answer():
    from specquant_cli.routing import auto

    c = _costs(imports={"q4": {64: 0.01, 1024: 0.5}})
    long_answer = {x.name: x.predicted for x in auto.candidates("medium", 0.0, ("parent", "q4"), c, prompt_tokens=1024,
                                                                answer_tokens=512)}
    short_answer = {x.name: x.predicted for x in auto.candidates("medium", 0.0, ("parent", "q4"), c,
                                                                 prompt_tokens=1024, answer_tokens=8)}
    assert short_answer["q4"] < long_answer["q4"] and short_answer["suffix"] == long_answer["suffix"]
