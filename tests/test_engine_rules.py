"""Accept/reject rules against scripted logits (the one fake), and the sampling math."""

import numpy as np
import pytest

from fakes import FakeContext, FakeModel, ScriptedDrafter, peaked
from specquant_cli.drafters import NGramDrafter
from specquant_cli.engine import Engine
from specquant_cli.errors import InputError
from specquant_cli.gamma import AdaptiveGamma, FixedGamma, expected_tokens
from specquant_cli.sampling import SamplingParams, probs, speculative_verify
from specquant_cli.stream import generate_text, stream_generate

V, EOG = 16, 15
# The parent continues 1, 2, 3, ... (mod 14) after the prompt: next token = (last + 1) % 14.
counting = lambda toks: peaked((toks[-1] + 1) % 14, V)  # noqa: E731


def make(drafter, gamma=4, fn=counting, max_ctx=512):
    ctx = FakeContext(FakeModel(V, EOG), fn, max_ctx)
    return Engine(ctx, drafter, FixedGamma(gamma)), ctx


def run(engine, prompt=(0,), max_tokens=8):
    return [ev for ev in engine.generate(list(prompt), max_tokens)]


def test_all_accepted_gives_bonus_token():
    eng, ctx = make(ScriptedDrafter([[1, 2, 3, 4]]))
    evs = run(eng, max_tokens=5)
    assert [e.token for e in evs] == [1, 2, 3, 4, 5]
    assert [e.from_draft for e in evs] == [True] * 4 + [False]
    assert eng.stats.drafted == 4 and eng.stats.accepted == 4 and eng.stats.parent_calls == 1
    assert ctx.tokens == [0, 1, 2, 3, 4]  # parent holds all but the pending bonus token


def test_first_rejected_keeps_parent_token():
    eng, ctx = make(ScriptedDrafter([[9, 9, 9], [2, 3]]), gamma=3)
    evs = run(eng, max_tokens=4)
    assert [e.token for e in evs] == [1, 2, 3, 4]
    assert eng.stats.accepted == 2 and eng.stats.drafted == 5 and eng.stats.parent_calls == 2
    assert evs[0].from_draft is False


def test_last_rejected():
    eng, _ = make(ScriptedDrafter([[1, 2, 7]]), gamma=3)
    evs = run(eng, max_tokens=3)
    assert [e.token for e in evs] == [1, 2, 3] and eng.stats.accepted == 2


def test_eog_inside_accepted_draft_stops_there():
    fn = lambda toks: peaked(EOG if toks[-1] == 2 else (toks[-1] + 1) % V, V)  # noqa: E731
    eng, _ = make(ScriptedDrafter([[1, 2, EOG, 5]]), fn=fn)
    evs = run(eng, max_tokens=10)
    assert [e.token for e in evs] == [1, 2, EOG] and evs[-1].eog
    text, toks, last = generate_text(make(ScriptedDrafter([[1, 2, EOG, 5]]), fn=fn)[0], [0], 10)
    assert last.finish_reason == "stop" and EOG not in toks and text == "<1><2>"


def test_max_tokens_inside_draft_caps_the_draft():
    d = ScriptedDrafter([[1, 2, 3, 4, 5, 6, 7, 8]])
    eng, _ = make(d, gamma=8)
    evs = run(eng, max_tokens=3)
    assert [e.token for e in evs] == [1, 2, 3]
    assert eng.stats.drafted == 2  # γ was capped to leave room for the parent's own token


def test_empty_ngram_proposal_is_a_plain_parent_step():
    eng, _ = make(NGramDrafter((3, 2)))
    evs = run(eng, prompt=(0,), max_tokens=4)
    assert [e.token for e in evs] == [1, 2, 3, 4] and eng.stats.drafted == 0 and eng.stats.parent_calls == 4


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    d = NGramDrafter((3, 2))
    assert d.propose([5, 6, 7, 8, 9, 1, 5, 6, 7], 3).tokens == [8, 9, 1]
    assert d.propose([5, 6, 1, 5, 6, 2, 5, 6], 2).tokens == [2, 5]  # latest occurrence wins
    assert d.propose([1, 2, 3], 4).tokens == []
    assert d.propose([4, 4, 4, 4], 2).tokens == [4]


def test_stop_string_inside_accepted_draft():
    eng, _ = make(ScriptedDrafter([[1, 2, 3, 4, 5, 6]]), gamma=6)
    text, toks, last = generate_text(eng, [0], 20, stop=["<3>"])
    assert text == "<1><2>" and last.finish_reason == "stop"


def test_context_overflow_is_refused_before_decoding():
    eng, ctx = make(None, max_ctx=10)
    with pytest.raises(InputError, match="exceeds the context size 10"):
        run(eng, prompt=list(range(8)), max_tokens=5)
    assert ctx.decode_calls == 0


def test_interrupt_ends_with_what_was_produced():
    class Interrupting(ScriptedDrafter):
        def propose(self, seq, n, sp=None, rng=None):
            if self.calls == 2:
                raise KeyboardInterrupt
            return super().propose(seq, n, sp, rng)

    eng, ctx = make(Interrupting([[1, 2], [3, 4], [5]]), gamma=2)
    recs = list(stream_generate(eng, [0], 20))
    assert recs[-1].finish_reason == "interrupted"
    assert "".join(r.text for r in recs) == "<1><2><3><4>" and recs[-1].new_tokens == 4
    # the context is still usable: the next generation re-syncs from the prefix cache
    eng2 = Engine(ctx, None, FixedGamma(0))
    assert [e.token for e in eng2.generate([0, 1, 2, 3, 4], 2)] == [5, 6]


def test_adaptive_gamma_follows_costs_and_acceptance():
    g = AdaptiveGamma(g_max=8)
    for _ in range(30):  # cheap drafts, everything accepted, verify cost flat
        g.update(g.next() or 1, g.next() or 1, 0.001 * (g.next() or 1), 0.1, (g.next() or 1) + 1)
    assert g.next() >= 6
    bad = AdaptiveGamma(g_max=8)
    for _ in range(30):  # drafts as costly as the parent and always rejected
        bad.update(2, 0, 0.2, 0.1, 3)
    assert bad.gamma == 0
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)


# ---- sampling fidelity ----------------------------------------------------------------------------
P_LOGITS = np.log(np.array([0.05, 0.4, 0.05, 0.3, 0.2]))
Q_LOGITS = np.log(np.array([0.3, 0.1, 0.3, 0.1, 0.2]))


def chi2_stat(counts, p):
    exp = p * counts.sum()
    mask = exp > 0
    return float((((counts - exp) ** 2)[mask] / exp[mask]).sum())


def sampled_first_tokens(verify, n=20000, seed=0):
    sp = SamplingParams(temperature=1.0)
    p = probs(P_LOGITS, sp)
    q = probs(Q_LOGITS, sp)
    rng = np.random.default_rng(seed)
    counts = np.zeros(5)
    for _ in range(n):
        d = int(rng.choice(5, p=q))
        k, nxt = verify(lambda j: p, [q], [d], rng)
        counts[d if k == 1 else nxt] += 1
    return counts, p


def test_speculative_sampling_matches_parent_distribution():
    counts, p = sampled_first_tokens(speculative_verify)
    assert chi2_stat(counts, p) < 18.47  # chi-square, 4 dof, p = 0.001


def test_fidelity_test_catches_a_wrong_residual():
    def resample_from_p(p_rows, q_rows, draft, rng):  # common bug: on rejection sample p, not p - q
        p, q, d = p_rows(0), q_rows[0], draft[0]
        if rng.random() < min(1.0, p[d] / q[d]):
            return 1, None
        return 0, int(rng.choice(len(p), p=p))

    counts, p = sampled_first_tokens(resample_from_p)
    assert chi2_stat(counts, p) > 18.47


def test_engine_sampling_two_tokens_follow_the_parent():
    """Joint distribution of two generated tokens through the whole engine, against the exact parent."""
    pl = {0: np.log([0.1, 0.5, 0.1, 0.2, 0.1]), 1: np.log([0.3, 0.1, 0.2, 0.2, 0.2])}
    parent_fn = lambda toks: pl[0] if len(toks) == 1 else pl[1]  # noqa: E731
    draft_fn = lambda toks: np.log([0.2] * 5)  # noqa: E731
    from specquant_cli.drafters import ModelDrafter

    model = FakeModel(5, eog=99)
    counts = np.zeros((5, 5))
    n = 6000
    for seed in range(n):
        sp = SamplingParams(temperature=1.0, seed=seed)
        parent = FakeContext(model, parent_fn)
        drafter = ModelDrafter(FakeContext(model, draft_fn), stop_ids=frozenset({99}))
        eng = Engine(parent, drafter, FixedGamma(2), sp)
        a, b = [e.token for e in eng.generate([0], 2)]
        counts[a, b] += 1
    exact = np.outer(np.exp(pl[0]), np.exp(pl[1])).ravel()
    assert chi2_stat(counts.ravel(), exact) < 52.6  # 24 dof, p = 0.001


def test_seeded_sampling_is_reproducible():
    fn = lambda toks: np.log(np.full(V, 1 / V))  # noqa: E731
    outs = []
    for _ in range(2):
        ctx = FakeContext(FakeModel(V, EOG), fn)
        eng = Engine(ctx, NGramDrafter(), FixedGamma(3), SamplingParams(temperature=0.8, seed=42))
        outs.append([e.token for e in eng.generate([1, 2, 3], 12)])
    assert outs[0] == outs[1]


def test_fallback_drafter_prefers_ngram_and_wakes_the_model_late():
    from specquant_cli.drafters import FallbackDrafter, ModelDrafter

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
    from specquant_cli.drafters import ModelDrafter

    ctx = FakeContext(FakeModel(V, EOG), counting)
    d = ModelDrafter(ctx, "fake", window=3)
    seq = list(range(10))
    d.prepare(seq)
    assert ctx.tokens == [7, 8, 9]
    assert d.propose(seq + [10], 2, SamplingParams(), None).tokens == [11, 12]
    assert ctx.tokens[:4] == [7, 8, 9, 10]


def test_verify_cost_prior_scales_from_the_nearest_measured_size():
    g = AdaptiveGamma()
    g.t_verify = {5: 0.2}
    assert g._verify_cost(5) == 0.2
    assert g._verify_cost(1) == pytest.approx(0.2 / 1.8)
    assert g._verify_cost(9) == pytest.approx(0.2 * 2.2 / 1.8)


def test_common_prefix_matches_a_plain_scan():
    import random
    import types

    from specquant_cli.llama import Context

    rnd = random.Random(0)
    for _ in range(2000):
        cached = [rnd.randint(0, 3) for _ in range(rnd.randint(0, 12))]
        new = cached[:rnd.randint(0, len(cached))] + [rnd.randint(0, 3) for _ in range(rnd.randint(0, 5))]
        want = next((i for i, (a, b) in enumerate(zip(cached, new)) if a != b), min(len(cached), len(new)))
        assert Context.common_prefix(types.SimpleNamespace(tokens=cached), new) == want
