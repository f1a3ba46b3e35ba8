"""Sampling: the exact truncations of `probs`, and the speculative rules' fidelity (statistical, seeded)."""

import numpy as np
import pytest

from specquant_cli.decoding.drafters import NGramDrafter
from specquant_cli.decoding.engine import Engine
from specquant_cli.decoding.gamma import FixedGamma
from specquant_cli.decoding.sampling import Noise, SamplingParams, coupled_verify, probs, sample

from fakes import FakeContext, FakeModel

V, EOG = 16, 15


# ---- sampling fidelity ----------------------------------------------------------------------------
P_LOGITS = np.log(np.array([0.05, 0.4, 0.05, 0.3, 0.2]))
Q_LOGITS = np.log(np.array([0.3, 0.1, 0.3, 0.1, 0.2]))


def chi2_stat(counts, p):
    exp = p * counts.sum()
    mask = exp > 0
    return float((((counts - exp) ** 2)[mask] / exp[mask]).sum())


def sampled_first_tokens(verify, n=20000, seed=0):
    """The first token kept after a one-token draft sampled from q, over n seeds: its counts, and p."""
    sp = SamplingParams(temperature=1.0)
    p = probs(P_LOGITS, sp)
    q = probs(Q_LOGITS, sp)
    counts = np.zeros(5)
    for s in range(n):
        u = Noise(seed * n + s)
        d = sample(q, u.at(0, q.shape[0]))  # the draft samples its token with the parent's noise (coupled)
        k, nxt = verify(lambda j: p, [d], u.at)
        counts[d if k == 1 else nxt] += 1
    return counts, p


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
def test_coupled_sampling_matches_parent_distribution():
    counts, p = sampled_first_tokens(coupled_verify)
    assert chi2_stat(counts, p) < 18.47  # chi-square, 4 dof, p = 0.001


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
def test_fidelity_test_catches_a_wrong_rule():
    def keep_every_draft(p_rows, draft, u):  # a broken verifier: whatever the draft says
        p = p_rows(len(draft))
        return len(draft), sample(p, u(len(draft), p.shape[0]))

    counts, p = sampled_first_tokens(keep_every_draft)
    assert chi2_stat(counts, p) > 18.47


def test_a_coupled_draft_is_kept_as_often_as_it_agrees_with_the_parent():
    """With the same number for both, a draft from q equals the parent's sample from p far more often than two
    independent samples would (sum p*q): the acceptance of coupled sampling."""
    counts, p = np.zeros(2), probs(P_LOGITS, SamplingParams(temperature=1.0))
    q = probs(Q_LOGITS, SamplingParams(temperature=1.0))
    for s in range(5000):
        u = Noise(s)
        k, _ = coupled_verify(lambda j: p, [sample(q, u.at(0, q.shape[0]))], u.at)
        counts[k] += 1
    assert counts[1] / counts.sum() > float((p * q).sum()) + 0.05


def test_a_seeded_answer_is_the_same_whatever_drafts():
    """The token at a position is the parent's sample with that position's number: a seeded answer does not
    depend on the drafter (none, n-gram, a model), nor on what it proposed before."""
    fn = lambda toks: np.log(np.linspace(1, 2, V) / np.linspace(1, 2, V).sum())  # noqa: E731
    from specquant_cli.decoding.drafters import ModelDrafter

    outs = set()
    for drafter in (None, NGramDrafter(), ModelDrafter(FakeContext(FakeModel(V, 99), lambda t: np.zeros(V)),
                                                       stop_ids=frozenset({99}))):
        ctx = FakeContext(FakeModel(V, EOG), fn)
        eng = Engine(ctx, drafter, FixedGamma(3 if drafter else 0), SamplingParams(temperature=0.9, seed=7))
        outs.add(tuple(e.token for e in eng.generate([1, 2, 3], 16)))
    assert len(outs) == 1


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
def test_engine_sampling_two_tokens_follow_the_parent():
    """Joint distribution of two generated tokens through the whole engine, against the exact parent."""
    pl = {0: np.log([0.1, 0.5, 0.1, 0.2, 0.1]), 1: np.log([0.3, 0.1, 0.2, 0.2, 0.2])}
    parent_fn = lambda toks: pl[0] if len(toks) == 1 else pl[1]  # noqa: E731
    draft_fn = lambda toks: np.log([0.2] * 5)  # noqa: E731
    from specquant_cli.decoding.drafters import ModelDrafter

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


def test_top_k_keeps_exactly_the_k_largest_renormalised():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    got = probs(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(got, [0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7], rtol=1e-12)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # mlx-lm's test_apply_top_p, transposed: sorted probs 0.5, 0.3, 0.15, 0.05
    logits = np.log(np.array([0.15, 0.5, 0.05, 0.3]))
    got = probs(logits, SamplingParams(temperature=1.0, top_p=0.75))
    np.testing.assert_allclose(got, [0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8], rtol=1e-9)
    got = probs(logits, SamplingParams(temperature=1.0, top_p=0.85))
    np.testing.assert_allclose(got, [0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95], rtol=1e-9)
    got = probs(logits, SamplingParams(temperature=1.0, top_p=0.3))
    np.testing.assert_allclose(got, [0.0, 1.0, 0.0, 0.0])


def test_top_p_after_top_k_is_taken_within_the_top_k_distribution():
    logits = np.log(np.array([0.15, 0.5, 0.05, 0.3]))
    # top-k 2 leaves 0.5/0.8 = 0.625 and 0.3/0.8 = 0.375; top-p 0.6 keeps only the first
    got = probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6))
    np.testing.assert_allclose(got, [0.0, 1.0, 0.0, 0.0])
    got = probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.7))
    np.testing.assert_allclose(got, [0.0, 0.625, 0.0, 0.375], rtol=1e-9)


def test_top_p_beyond_the_candidate_window_falls_back_to_a_full_sort():
    from specquant_cli.decoding.sampling import TOP_P_CANDIDATES

    n = TOP_P_CANDIDATES * 2
    got = probs(np.zeros(n), SamplingParams(temperature=1.0, top_p=0.75))
    assert (got > 0).sum() == int(np.ceil(0.75 * n)) and got.sum() == pytest.approx(1.0)
