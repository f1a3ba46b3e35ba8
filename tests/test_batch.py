"""Several sequences of one llama.cpp context decoding together (decoding.batch), on the real demo family:
each thread's view sees what a context of its own would show, the calls of several threads share rounds,
one thread's failing call leaves the others' answers whole, and KV import works per sequence."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from specquant_cli.backend.llama import Context
from specquant_cli.decoding.batch import Batcher, SeqView
from specquant_cli.decoding.rounds import best_calls, round_price
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
    for b in (4, 8):  # among others the parent's shared round is cheaper per token than one with q4 drafts
        assert "q4" not in (choose(candidates("low", 0.0, ["f16", "q4"], intel.for_batch(b))).drafter or "")
    # At 2 the batch's drafts, in step, are priced per round: their draft calls and verification shared
    two = {c.name: c for c in candidates("low", 0.0, ["f16", "q4"], intel.for_batch(2))}
    calls, gain = best_calls(intel, "q4", 2, 2, 0.9)
    assert (two["q4"].predicted, two["q4"].gamma) == (gain, calls) and 1.0 < gain < alone.predicted


def test_a_round_is_priced_for_the_whole_batch():
    """round_price: m of b sequences drafting in `calls` calls each pay the draft calls on m sequences' tokens
    (the first catching up on two) and one parent call on every sequence's tokens; the others make one token."""
    amd = Calibration({1: 0.079, 2: 0.100, 4: 0.115, 8: 0.151, 16: 0.206}, {"q4": 0.0265},
                      draft_call_s={"q4": {1: 0.0265, 2: 0.045, 4: 0.045, 8: 0.082}})
    assert round_price(amd, "q4", 4, 4, 0, 0.9) == (0.115, 4.0)
    s, t = round_price(amd, "q4", 4, 2, 3, 0.5)
    assert s == pytest.approx(0.045 + 2 * 0.045 + amd.call_s(2 + 2 * 4))
    assert t == pytest.approx(2 + 2 * (1 + 0.5 + 0.25 + 0.125))
    # On this curve drafting pays at 2 sequences, barely at 4, not at 8: the parent's round is already cheap
    assert best_calls(amd, "q4", 2, 2, 0.89)[0] > 0
    assert best_calls(amd, "q4", 8, 8, 0.89) == (0, 1.0)
    assert best_calls(amd, "q4", 8, 8, 0.89)[1] < best_calls(amd, "q4", 2, 2, 0.89)[1]


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


def test_the_hold_is_what_the_pacer_granted(models):
    """The batcher holds the parent's calls as long as the round pacer prices the draft calls it granted
    (RoundPacer.hold_s): nothing drafting, no hold; nothing calibrated, the fixed DEFER_MAX_S."""
    import time

    from specquant_cli.decoding.batch import DEFER_MAX_S, Call
    from specquant_cli.decoding.rounds import HOLD_SLACK, RoundPacer

    cal = Calibration({1: 0.08, 2: 0.08, 4: 0.085, 8: 0.09, 16: 0.1}, {"q4": 0.01}, agreement={"q4": 0.9},
                      draft_call_s={"q4": {1: 0.01, 2: 0.011, 4: 0.012, 8: 0.014}})
    members = [2]
    pacer = RoundPacer(lambda: cal, lambda: members[0])
    assert pacer.hold_s() == 0.0  # nothing drafts yet
    calls = pacer.ask(1, "q4") and pacer.ask(2, "q4")
    assert calls > 0
    assert pacer.hold_s() == pytest.approx((cal.draft_call("q4", 4) + (calls - 1) * cal.draft_call("q4", 2))
                                           * HOLD_SLACK)
    assert RoundPacer(lambda: None, lambda: 2).hold_s() is None
    f16, q4 = Context(models["f16"], 256, n_seq_max=2), Context(models["q4"], 256, n_seq_max=2)
    try:
        now = time.monotonic()
        verify = Call(f16, 0, [1, 2], [0, 1], [1], since=now)
        draft = Call(q4, 1, [3], [0], [0], since=now)
        assert Batcher(hold_s=lambda: 0.0)._split([verify, draft]) == ([verify, draft], [])
        assert Batcher(hold_s=lambda: None).hold_s() == DEFER_MAX_S
        assert Batcher(hold_s=lambda: 5.0)._split([verify, draft]) == ([draft], [verify])
    finally:
        f16.close()
        q4.close()


def test_a_fixed_policy_drafts_where_a_planned_one_rests():
    """Where no draft lowers the batch's time per token, a planned policy's drafts rest (0 calls) and a fixed
    policy's (spec-q4) still draft, at the length that costs the batch least."""
    from specquant_cli.decoding.rounds import RoundPacer

    loses = Calibration({1: 0.08, 2: 0.09, 4: 0.18, 8: 0.36, 16: 0.72}, {"q4": 0.06}, agreement={"q4": 0.9})
    pacer = RoundPacer(lambda: loses, lambda: 4)
    assert pacer.pace(rest=True).ask(1, "q4") == 0
    calls = pacer.pace(rest=False).ask(2, "q4")
    assert calls >= 1 and calls == best_calls(loses, "q4", 4, 2, 0.9, rest=False)[0]
    assert RoundPacer(lambda: loses, lambda: 1).pace(rest=True).ask(1, "q4") is None  # alone: its own γ


def test_a_draft_that_resumes_far_behind_imports_the_parent_cache(models):
    """A model drafter that missed many of the sequence's tokens (it rested, or another source drafted) takes the
    parent's cache instead of decoding the gap, and drafts what it would have drafted after decoding it."""
    from specquant_cli.decoding.drafters import ModelDrafter
    from specquant_cli.decoding.sampling import GREEDY

    f16, q4 = Context(models["f16"], 512), Context(models["q4"], 512)
    imports, decoded = [], []
    real_import, real_decode = q4.import_state, q4.decode
    q4.import_state = lambda state, tokens: imports.append(len(tokens)) or real_import(state, tokens)
    q4.decode = lambda tokens, **kw: decoded.append(len(tokens)) or real_decode(tokens, **kw)
    try:
        seq = models["f16"].tokenize(TEXTS[1], add_bos=False)
        seq += greedy(f16, seq, 30)
        f16.reset()
        f16.sync(seq[:4])
        d = ModelDrafter(q4, "q4", parent=f16)
        d.prepare(seq[:5])
        f16.sync(seq[:-1])  # the parent ran on without the draft
        imports.clear(), decoded.clear()
        draft = d.propose(seq, 3, GREEDY, GREEDY.noise())
        assert imports == [len(seq) - 1]  # the parent's cache of seq[:-1], not a decode of the gap
        assert max(decoded) <= 2 and q4.tokens[:len(seq) - 1] == seq[:-1]
        assert len(draft.tokens) == 3
        d.prepare(seq[:5])  # a draft one token behind decodes that token: an import would cost more
        imports.clear()
        d.propose(seq[:6], 2, GREEDY, GREEDY.noise())
        assert imports == []
    finally:
        f16.close()
        q4.close()


def test_a_paced_draft_prepares_when_first_given_calls(models):
    """Beside other sequences a model drafter may rest for a whole answer: its preparation (the parent's cache
    imported, a catch-up call) waits for the first draft the round pacer gives calls to, and none is made while
    it rests."""
    from specquant_cli.decoding.drafters import ModelDrafter
    from specquant_cli.decoding.rounds import RoundPacer
    from specquant_cli.decoding.sampling import GREEDY

    pays = Calibration({1: 0.08, 2: 0.08, 4: 0.085, 8: 0.09, 16: 0.1}, {"q4": 0.01}, agreement={"q4": 0.9},
                       draft_call_s={"q4": {1: 0.01, 2: 0.011, 4: 0.012, 8: 0.014}})
    loses = Calibration({1: 0.08, 2: 0.09, 4: 0.18, 8: 0.36, 16: 0.72}, {"q4": 0.06}, agreement={"q4": 0.9})
    cal = [loses]
    f16, q4 = Context(models["f16"], 512), Context(models["q4"], 512)
    imports, decoded = [], []
    real_import, real_decode = q4.import_state, q4.decode
    q4.import_state = lambda state, tokens: imports.append(len(tokens)) or real_import(state, tokens)
    q4.decode = lambda tokens, **kw: decoded.append(len(tokens)) or real_decode(tokens, **kw)
    try:
        seq = models["f16"].tokenize(TEXTS[1], add_bos=False) * 4
        f16.sync(seq[:-1])
        d = ModelDrafter(q4, "q4", parent=f16, pacer=RoundPacer(lambda: cal[0], lambda: 2).pace(rest=True))
        assert d.prepare(seq).imported is None and imports == [] and decoded == []
        assert d.propose(seq, 4, GREEDY, GREEDY.noise()).tokens == [] and imports == [] and decoded == []
        cal[0] = pays  # drafting pays now: the first draft imports the parent's cache, then drafts
        draft = d.propose(seq, 4, GREEDY, GREEDY.noise())
        assert imports == [len(seq) - 1] and draft.tokens
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


def _paced_pair(models, pacer, gamma: int = 4):
    """Two sequences drafting with q4 through one batcher and `pacer`: (answers, each drafter's calls per draft,
    the batcher's stats)."""
    from specquant_cli.decoding.drafters import ModelDrafter
    from specquant_cli.decoding.engine import Engine
    from specquant_cli.decoding.gamma import FixedGamma

    f16, q4 = Context(models["f16"], 512, n_seq_max=2, kv_unified=True), \
        Context(models["q4"], 512, n_seq_max=2, kv_unified=True)
    b = Batcher()
    pacer.members = lambda: b.active
    prompts = [models["f16"].tokenize(t, add_bos=False) for t in TEXTS[:2]]
    both = threading.Barrier(2)
    calls: list[list[int]] = [[], []]
    try:
        def run(i):
            with b.member():
                both.wait(60)
                d = ModelDrafter(SeqView(q4, i, b, 256), "q4", pacer=pacer, role="q4")
                eng = Engine(SeqView(f16, i, b, 256), d, FixedGamma(gamma))
                out, seen = [], 0
                for e in eng.generate(prompts[i], N):
                    out.append(e.token)
                    if d.counters["model_calls"] != seen:
                        calls[i].append(d.counters["model_calls"] - seen)
                        seen = d.counters["model_calls"]
                return out

        res, errs = in_threads(run, 2)
        assert not errs
        return res, prompts, calls, b.stats
    finally:
        f16.close()
        q4.close()


class _Pacer:
    """A RoundPacer over a fixed calibration, its members counted by the batcher of the test."""

    def __init__(self, cal):
        from specquant_cli.decoding.rounds import RoundPacer

        self.members = lambda: 1
        self.inner = RoundPacer(lambda: cal, lambda: self.members())

    def ask(self, who, role, position=0):
        return self.inner.ask(who, role, position)

    def observe(self, role, proposed, accepted):
        self.inner.observe(role, proposed, accepted)


def test_paced_drafts_stay_in_step_or_stop_where_the_batch_loses(models):
    """A round pacer gives every sequence drafting with one model the same number of draft calls a cycle (its
    cycles verify together), and none where the calibration says a draft makes the batch slower per token:
    then the sequences run the parent's own steps. Either way each answer is the parent's own."""
    pays = Calibration({1: 0.08, 2: 0.08, 4: 0.085, 8: 0.09, 16: 0.1}, {"q4": 0.01}, agreement={"q4": 0.9},
                       draft_call_s={"q4": {1: 0.01, 2: 0.011, 4: 0.012, 8: 0.014}})
    loses = Calibration({1: 0.08, 2: 0.09, 4: 0.18, 8: 0.36, 16: 0.72}, {"q4": 0.06}, agreement={"q4": 0.9})
    solo = Context(models["f16"], 512)
    try:
        paced = _Pacer(pays)
        res, prompts, calls, stats = _paced_pair(models, paced)
        for i, p in enumerate(prompts):
            solo.reset()
            assert res[i] == greedy(solo, p, N)
        chosen = set(paced.inner.decisions.values())
        assert chosen and 0 not in chosen
        # every draft made at most the calls given (fewer only where the answer or a draft ended early)
        assert max(max(c) for c in calls) <= max(chosen)
        assert stats.widest == 2
        stopped = _Pacer(loses)
        res, prompts, calls, _ = _paced_pair(models, stopped)
        assert set(stopped.inner.decisions.values()) == {0}
        assert calls == [[], []]  # q4 never called: the parent alone, in one shared call a round
        for i, p in enumerate(prompts):
            solo.reset()
            assert res[i] == greedy(solo, p, N)
    finally:
        solo.close()
