"""The γ policies: adaptive draft length from measured costs and acceptance."""

import pytest

from specquant_cli.decoding.gamma import AdaptiveGamma, FixedGamma, expected_tokens
from specquant_cli.decoding.protocols import CycleOutcome


def outcome(proposed, accepted, draft_s, verify_s):
    return CycleOutcome(proposed, accepted, 0, draft_s, verify_s, proposed + 1)


def test_adaptive_gamma_follows_costs_and_acceptance():
    g = AdaptiveGamma(gamma_max=8)
    for _ in range(30):  # cheap drafts, everything accepted, verify cost flat
        n = g.draft_length() or 1
        g.update(outcome(n, n, 0.001 * n, 0.1))
    assert g.draft_length() >= 6
    bad = AdaptiveGamma(gamma_max=8)
    for _ in range(30):  # drafts as costly as the parent and always rejected
        bad.update(outcome(2, 0, 0.2, 0.1))
    assert bad.gamma == 0
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)


def test_draft_length_is_pure_and_probes_after_idle_cycles():
    g = AdaptiveGamma(gamma_max=8, probe_every=3)
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


def test_a_calibrated_prior_survives_one_bad_cycle():
    """Measured on the 1.5B family (Spec-Bench 123): one early cycle that kept 1 of 4 drafts took a weak prior
    to gamma 0 for the rest of the answer; a prior from the calibration's 256 tokens keeps drafting."""
    from specquant_cli.decoding.gamma import CALIBRATED_PRIOR_COUNTS, PRIOR_PSEUDO_COUNTS

    costs = {1: 0.057, 2: 0.095, 3: 0.100, 4: 0.112, 5: 0.124, 6: 0.13, 7: 0.14, 8: 0.15, 9: 0.157}

    def after_one_bad_cycle(counts):
        g = AdaptiveGamma(gamma_max=8, alpha_prior=0.92, verify_prior=costs, draft_prior=0.023, prior_counts=counts)
        g.update(CycleOutcome(4, 1, 0, 0.093, 0.124, 5))
        return g

    assert after_one_bad_cycle(PRIOR_PSEUDO_COUNTS).gamma == 0
    strong = after_one_bad_cycle(CALIBRATED_PRIOR_COUNTS)
    assert strong.gamma >= 2 and strong.alpha > 0.85
    for _ in range(6):  # but a draft that keeps failing is still switched off
        strong.update(CycleOutcome(strong.draft_length() or 1, 0, 0, 0.05, 0.1, 3))
    assert strong.gamma == 0
