"""The γ policies: adaptive draft length from measured costs and acceptance."""

import pytest

from specquant_cli.decoding.gamma import AdaptiveGamma, FixedGamma, expected_tokens
from specquant_cli.decoding.protocols import CycleOutcome


def outcome(proposed, accepted, draft_s, verify_s):
    return CycleOutcome(proposed, accepted, 0, draft_s, verify_s, proposed + 1)


def test_adaptive_gamma_follows_costs_and_acceptance():
    g = AdaptiveGamma(g_max=8)
    for _ in range(30):  # cheap drafts, everything accepted, verify cost flat
        n = g.draft_length() or 1
        g.update(outcome(n, n, 0.001 * n, 0.1))
    assert g.draft_length() >= 6
    bad = AdaptiveGamma(g_max=8)
    for _ in range(30):  # drafts as costly as the parent and always rejected
        bad.update(outcome(2, 0, 0.2, 0.1))
    assert bad.gamma == 0
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)


def test_draft_length_is_pure_and_probes_after_idle_cycles():
    g = AdaptiveGamma(g_max=8, probe_every=3)
    for _ in range(10):
        g.update(outcome(2, 0, 0.2, 0.1))
    assert g.gamma == 0
    idle = 0
    while g.draft_length() == 0:
        assert g.draft_length() == g.draft_length() == 0  # asking twice changes nothing
        g.update(outcome(0, 0, 0.0, 0.1))
        idle += 1
    assert idle <= 3 and g.draft_length() == 1  # the probe: one token, once
    g.update(outcome(1, 0, 0.2, 0.1))
    assert g.draft_length() == 0


def test_fixed_gamma_ignores_outcomes():
    g = FixedGamma(3)
    g.update(outcome(3, 0, 1.0, 1.0))
    assert g.draft_length() == 3


def test_verify_cost_prior_scales_from_the_nearest_measured_size():
    g = AdaptiveGamma()
    g.t_verify = {5: 0.2}
    assert g._verify_cost(5) == 0.2
    assert g._verify_cost(1) == pytest.approx(0.2 / 1.8)
    assert g._verify_cost(9) == pytest.approx(0.2 * 2.2 / 1.8)
