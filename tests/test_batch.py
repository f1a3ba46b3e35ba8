"""Several sequences of one llama.cpp context decoding together (decoding.batch), on the real demo family:
each thread's view sees what a context of its own would show, the calls of several threads share rounds,
one thread's failing call leaves the others' answers whole, and KV import works per sequence."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from specquant_cli.backend.llama import Context
from specquant_cli.decoding.batch import Batcher, SeqView
from specquant_cli.errors import LlamaError
from specquant_cli.system.calibration import Calibration

TEXTS = ["The capital of France is", "def fib(n):\n", "Once upon a time", "1, 2, 3, 4,"]
N = 12


def greedy(ctx, prompt: list[int], n: int) -> list[int]:
    ctx.sync(prompt)
    out = []
    for _ in range(n):
        t = int(np.argmax(ctx.logits(-1)))
        out.append(t)
        ctx.decode([t])
    return out


def in_threads(fn, k: int) -> list:
    res, errs = [None] * k, []

    def run(i):
        try:
            res[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(k)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    return res, errs


@pytest.fixture(scope="module")
def parent(models):
    return models["f16"]


@pytest.fixture(scope="module")
def prompts(parent):
    return [parent.tokenize(t, add_bos=False) for t in TEXTS]


@pytest.fixture(scope="module")
def alone(parent, prompts):
    ctx = Context(parent, 512)
    out = []
    for p in prompts:
        ctx.reset()
        out.append(greedy(ctx, p, N))
    ctx.close()
    return out


def test_threads_decoding_together_get_what_each_would_alone_and_share_rounds(parent, prompts, alone):
    shared = Context(parent, 512 * 4, n_seq_max=4)
    b = Batcher()

    def one(i):
        with b.member():
            return greedy(SeqView(shared, i, b, 512), prompts[i], N)

    got, errs = in_threads(one, 4)
    assert not errs
    assert got == alone
    assert b.stats.widest >= 2  # some rounds carried several threads' calls
    assert b.stats.rounds < b.stats.calls
    shared.close()


def test_one_sequence_failing_leaves_the_others_whole(parent, prompts, alone):
    shared = Context(parent, 512 * 4, n_seq_max=4)
    b = Batcher()
    broken = SeqView(shared, 3, b, 10**6)  # believes it has room llama.cpp never gave its sequence
    broken.decode(list(range(100, 600)), logits="none")

    def one(i):
        with b.member():
            if i == 3:
                with pytest.raises(LlamaError):
                    broken.decode(list(range(100, 200)))
                return None
            return greedy(SeqView(shared, i, b, 512), prompts[i], N)

    got, errs = in_threads(one, 4)
    assert not errs
    assert got[:3] == alone[:3]
    shared.close()


def test_kv_import_per_sequence(parent, prompts, alone):
    """Sequence 2 of one shared context exports its cache into sequence 1 of another: the importer then
    continues as if it had decoded the prompt itself."""
    a, c = Context(parent, 512 * 4, n_seq_max=4), Context(parent, 512 * 4, n_seq_max=4)
    b = Batcher()
    src, dst = SeqView(a, 2, b, 512), SeqView(c, 1, b, 512)
    p = prompts[0]
    src.decode(p[:-1], logits="none")
    assert dst.import_state(src.export_state(), p[:-1])
    assert dst.tokens == p[:-1]
    assert greedy(dst, p, N) == alone[0]  # sync decodes the last prompt token on top of the import
    a.close()
    c.close()


def test_a_context_shorter_than_asked_is_refused_per_sequence(parent):
    shared = Context(parent, 64 * 2, n_seq_max=2)
    view = SeqView(shared, 1, Batcher(), 64)
    with pytest.raises(Exception, match="context full"):
        view.decode(list(range(100, 170)))
    shared.close()


def test_batch_costs_are_shared_shares_of_the_parent_curve():
    c = Calibration({1: 0.167, 2: 0.167, 4: 0.192, 8: 0.275, 16: 0.417}, {"q4": 0.065})
    v = c.for_batch(8)
    assert v.parent_call_s[1] == pytest.approx(0.275 / 8)
    assert v.parent_call_s[2] == pytest.approx(0.417 / 8)
    assert v.verify_cost(2) == pytest.approx(0.417 / 0.275)
    # A draft step is not shared: concurrent requests' drafts do not line up, so each costs what it does alone.
    assert v.draft_step_s == c.draft_step_s and v.draft_pair_s == c.draft_pair_s
    assert v.draft_ratio("q4") == pytest.approx(0.065 / (0.275 / 8))
    assert c.for_batch(1) is c and v.single is c and v.batch == 8
    assert "single" not in c.to_dict()  # a view's link to its lone costs is never stored


def test_the_calibrated_curve_decides_how_many_run_together_and_auto_plans_for_the_batch():
    from specquant_cli.routing.auto import candidates, choose
    from specquant_cli.serving.slots import best_parallel

    intel = Calibration({1: 0.167, 2: 0.167, 4: 0.192, 8: 0.275, 16: 0.417}, {"q4": 0.065}, agreement={"q4": 0.9})
    flat = Calibration({1: 0.1, 2: 0.2, 4: 0.4, 8: 0.8, 16: 1.6})  # a call costs per token: batching never pays
    assert best_parallel(intel.call_s) == 8
    assert best_parallel(flat.call_s) == 1
    alone = choose(candidates("low", 0.0, ["f16", "q4"], intel))
    assert "q4" in alone.drafter  # alone, a q4 draft pays on this curve
    for b in (2, 4, 8):  # among others the parent's shared step is cheaper than a lone model draft step
        assert "q4" not in (choose(candidates("low", 0.0, ["f16", "q4"], intel.for_batch(b))).drafter or "")


def test_parent_calls_wait_for_the_draft_steps_beside_them(models):
    """With a verify (parent) call and draft calls waiting together, the round runs the draft steps and holds
    the parent call, so the drafting requests reach their verification together and share one parent call;
    a held call runs at the latest DEFER_MAX_S after it came."""
    import time

    from specquant_cli.decoding.batch import DEFER_MAX_S, Call

    f16, q4 = Context(models["f16"], 256, n_seq_max=2), Context(models["q4"], 256, n_seq_max=2)
    try:
        b = Batcher()
        now = time.monotonic()
        verify = Call(f16, 0, [1, 2], [0, 1], [1], since=now)
        draft = Call(q4, 1, [3], [0], [0], since=now)
        run, held = b._split([verify, draft])
        assert run == [draft] and held == [verify]
        assert b._split([verify]) == ([verify], [])  # nothing drafting beside it: it runs
        late = Call(f16, 0, [1, 2], [0, 1], [1], since=now - DEFER_MAX_S)
        assert b._split([late, draft]) == ([late, draft], [])  # held long enough: it runs with them
    finally:
        f16.close()
        q4.close()


def test_drafting_sequences_share_their_parent_calls(models):
    """Two sequences that draft with q4 and verify with the parent, in threads through one batcher (its parent
    calls held while draft steps wait beside them, whenever the two fall out of step): the answers are what
    each gets alone, and nothing waits for ever."""
    f16, q4 = Context(models["f16"], 512, n_seq_max=2, kv_unified=True), \
        Context(models["q4"], 512, n_seq_max=2, kv_unified=True)
    b = Batcher()
    prompts = [models["f16"].tokenize(t, add_bos=False) for t in TEXTS[:2]]
    both = threading.Barrier(2)  # both are members before either decodes: they meet in rounds
    try:
        def run(i):
            from specquant_cli.decoding.drafters import ModelDrafter
            from specquant_cli.decoding.engine import Engine
            from specquant_cli.decoding.gamma import FixedGamma

            with b.member():
                both.wait(60)
                eng = Engine(SeqView(f16, i, b, 256), ModelDrafter(SeqView(q4, i, b, 256)), FixedGamma(3))
                return [e.token for e in eng.generate(prompts[i], N)]

        res, errs = in_threads(run, 2)
        assert not errs
        solo = Context(models["f16"], 512)
        for i, p in enumerate(prompts):
            solo.reset()
            assert res[i] == greedy(solo, p, N)
        solo.close()
        assert b.stats.widest == 2  # the two met in rounds
    finally:
        f16.close()
        q4.close()
