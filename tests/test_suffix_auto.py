"""The suffix drafter (draft-free, cross-request memory) and the auto policy's choice."""

import json

import pytest

from specquant_cli.decoding.protocols import CycleOutcome
from specquant_cli.decoding.suffix import SuffixDrafter
from specquant_cli.routing import auto
from specquant_cli.system.calibration import Calibration

from conftest import run_cli

CODE = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


def flat_cost(n):  # a parent call costs the same for any size: long drafts are free to verify
    return 1.0


def test_suffix_proposes_the_continuation_of_the_longest_match():
    d = SuffixDrafter(verify_cost=flat_cost)
    seq = CODE + [99] + CODE[:4]
    d.prepare(seq)
    got = d.propose(seq, 16).tokens
    assert len(got) >= 4 and got[:8] == CODE[4:4 + len(got)]  # (a long draft reads on into the sequence itself)
    assert d.propose([1, 2, 3], 8).tokens == []  # nothing seen: no draft


def test_suffix_remembers_earlier_requests():
    d = SuffixDrafter(verify_cost=flat_cost)
    d.prepare([5] + CODE)  # an earlier request (prompt + answer)
    new = [7, 7] + CODE[:5]
    d.prepare(new)
    got = d.propose(new, 16).tokens
    assert len(got) >= 4 and got == CODE[5:5 + len(got)]


def test_suffix_follows_the_majority_continuation():
    d = SuffixDrafter(verify_cost=flat_cost)
    seq = [1, 2, 3, 4, 50, 0, 1, 2, 3, 4, 60, 0, 1, 2, 3, 4, 60, 0, 1, 2, 3, 4]
    d.prepare(seq)
    assert d.propose(seq, 1).tokens == [60]


def test_suffix_draft_length_follows_cost_and_measured_acceptance():
    expensive = lambda n: 1.0 + 0.5 * (n - 1)  # noqa: E731  each verified token costs half a step
    d = SuffixDrafter(verify_cost=expensive)
    seq = CODE + [99] + CODE[:3]
    d.prepare(seq)
    first = len(d.propose(seq, 32).tokens)
    for _ in range(20):  # every draft of this match length rejected at once
        d.propose(seq, 32)
        d.feedback(seq, CycleOutcome(max(first, 1), 0, 0, 0.0, 0.1, first + 1))
    assert len(d.propose(seq, 32).tokens) < max(first, 1)


def test_suffix_long_match_gets_a_long_draft():
    d = SuffixDrafter(verify_cost=flat_cost)
    long = list(range(100, 160))
    seq = long + [1] + long[:20]
    d.prepare(seq)
    assert len(d.propose(seq, 32).tokens) >= 24  # (the tie margin prefers a slightly shorter draft)


def cal(step_ratio, calls=None):
    calls = calls or {n: 0.1 * (1 + 0.1 * (n - 1)) for n in range(1, 17)}
    return Calibration(calls, {"q4": 0.1 * step_ratio, "q8": 0.1 * step_ratio}, {})


def test_auto_never_picks_a_plan_predicted_below_the_parent():
    cands = auto.candidates("medium", 0.0, ("parent", "q4", "q8"), cal(step_ratio=2.0))
    best = auto.choose(cands)
    assert all(c.predicted <= 1.0 for c in cands if c.drafter in ("q4", "q8"))
    assert best.drafter in (None, "suffix") and best.predicted >= 1.0  # draft-free costs nothing unmatched


def test_auto_model_drafts_need_a_margin_over_the_parent():
    barely = [auto.Candidate("parent", None, 1.0, 0, ""), auto.Candidate("q4", "q4", 1.03, 3, "", needs=1.08)]
    assert auto.choose(barely).drafter is None


def test_auto_picks_a_cheap_accurate_draft():
    best = auto.choose(auto.candidates("medium", 0.0, ("parent", "q4", "q8"), cal(step_ratio=0.2)))
    assert best.drafter in ("q4", "q8", "suffix+q4", "suffix+q8") and best.predicted > 1.0


def test_auto_follows_what_the_session_measured():
    state = auto.AutoState()
    for _ in range(10):
        state.observe("medium", "q4", 0.7)
        state.observe("medium", "suffix+q4", 0.7)
        state.observe("medium", "q8", 0.7)
        state.observe("medium", "suffix+q8", 0.7)
    cands = auto.candidates("medium", 0.0, ("parent", "q4", "q8"), cal(step_ratio=0.2), state)
    assert auto.choose(cands).drafter in (None, "suffix")  # measured slow drafts lose to their priors
    assert {c.source for c in cands if c.drafter not in (None, "suffix")} == {"session"}


def test_auto_weighs_a_recipe_draft_only_once_it_is_measured():
    c = cal(step_ratio=0.4)
    roles = ("parent", "q4", "q8", "q3g")
    names = [x.name for x in auto.candidates("medium", 0.3, roles, c)]
    assert "q3g" not in names and "suffix+q3g" not in names  # no prior for a recipe: never a guess
    c.draft_step_s["q3g"] = 0.1 * 0.2  # measured: half q4's step at the same agreement
    cands = auto.candidates("medium", 0.3, roles, c)
    by = {x.name: x for x in cands}
    assert by["q3g"].predicted > by["q4"].predicted and by["q3g"].model
    assert by["suffix+q3g"].predicted > by["suffix+q4"].predicted and not by["suffix+q3g"].model
    assert auto.choose(cands).name in ("q3g", "suffix+q3g")
    assert "q3g" not in [x.name for x in auto.candidates("medium", 0.3, ("parent", "q4"), c)]  # not in the family


def test_auto_plan_for_a_recipe_draft_loads_it_and_adapts_its_length():
    from specquant_cli.routing.plan import PlanContext
    from specquant_cli.routing.policies import plan_for

    c = cal(step_ratio=0.9)
    c.draft_step_s["q4i"] = 0.1 * 0.15
    plan = plan_for("auto", "medium", PlanContext("auto", "medium", 0.0, ("parent", "q4", "q8", "q4i"), c))
    assert plan.drafter in ("q4i", "suffix+q4i") and plan.roles == ["parent", "q4i"]
    assert plan.gamma_policy == ("calibrated" if plan.drafter == "q4i" else "capped")  # a mix adapts inside the drafter
    plan = plan_for("auto", "medium", PlanContext("auto", "medium", 0.9, ("parent", "q4", "q8", "q4i"), c))
    assert plan.drafter == "suffix+q4i" and plan.gamma_policy == "capped" and plan.roles == ["parent", "q4i"]


def test_a_recipe_draft_must_clearly_beat_q4():
    c = cal(step_ratio=0.4)
    c.draft_step_s["q4i"] = c.draft_step_s["q4"] * 0.99  # predicted about 1 % better: within the noise
    cands = auto.candidates("medium", 0.0, ("parent", "q4", "q4i"), c)
    by = {x.name: x for x in cands}
    assert by["q4i"].predicted > by["q4"].predicted and by["q4i"].needs > by["q4i"].predicted
    assert auto.choose(cands).name in ("q4", "suffix+q4")
    c.draft_step_s["q4i"] = c.draft_step_s["q4"] * 0.5  # clearly cheaper: it wins
    assert auto.choose(auto.candidates("medium", 0.0, ("parent", "q4", "q4i"), c)).name in ("q4i", "suffix+q4i")


def test_copy_potential_is_higher_for_repetitive_long_context():
    assert auto.copy_potential(list(range(50))) < auto.copy_potential(CODE * 40)


def test_route_json_shows_every_candidate_and_why(family_dir):
    r = run_cli(["route", "--json", "--family", str(family_dir), "Summarize: " + "the cat sat on the mat. " * 40])
    assert r.exit_code == 0, r.stderr
    plan = json.loads(r.stdout)["plan"]
    names = [c["plan"] for c in plan["candidates"]]
    assert "parent" in names and "suffix" in names and plan["why"]
    preds = [c["predicted_speedup"] for c in plan["candidates"]]
    assert preds == sorted(preds, reverse=True)


@pytest.mark.parametrize("policy", ["auto", "suffix"])
def test_auto_and_suffix_are_lossless(family_dir, policy):
    args = ["chat", "--family", str(family_dir), "--max-tokens", "32", "--json",
            "Repeat this list exactly: apple, banana, cherry, apple, banana, cherry."]
    parent = json.loads(run_cli(args + ["--policy", "parent"]).stdout)
    r = run_cli(args + ["--policy", policy])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["text"] == parent["text"]


def test_expected_run_tokens_counts_runs_of_agreement():
    from specquant_cli.system.measure import expected_run_tokens

    hits = [True, True, False, True]  # runs from each position: 2, 1, 0, 1
    assert expected_run_tokens(hits, 3) == [1 + 3 / 4, 1 + 4 / 4, 1 + 4 / 4]
    assert expected_run_tokens([[True, True], [True]], 2) == pytest.approx([2.0, 1 + 4 / 3], abs=1e-4)


def test_draft_cycle_pays_the_catch_up_pair_only_after_full_accepts():
    c = Calibration({1: 0.1}, {"q4": 0.01}, {}, {}, {"q4": [2.0, 2.5]}, {"q4": 0.016})
    # g=1: p_full = E(1) - 1 = 1.0 -> one pair; g=2: p_full = 0.5 -> half a pair, half a step, + 1 step
    assert c.draft_cycle("q4", 1) == pytest.approx(0.16)
    assert c.draft_cycle("q4", 2) == pytest.approx((0.5 * 0.016 + 0.5 * 0.01 + 0.01) / 0.1)


def test_calibration_cache_keeps_other_machines_and_drops_older_schemas(tmp_path):
    from specquant_cli.system import calibration_file as cal

    here = {"schema": cal.SCHEMA, "cpu": "here", "cores": 2}
    there = {**here, "cpu": "elsewhere"}
    old = {**here, "schema": cal.SCHEMA - 1}
    (tmp_path / cal.CALIBRATION_FILE).write_text(json.dumps({
        cal.key_of(there): Calibration({1: 0.2}).to_dict(),
        cal.key_of(old): Calibration({1: 0.3}).to_dict(), "not json": {}}))
    cal.save(tmp_path, here, Calibration({1: 0.1, 2: 0.15}, left_out=["q3g"]))
    data = json.loads((tmp_path / cal.CALIBRATION_FILE).read_text())
    assert set(data) == {cal.key_of(here), cal.key_of(there)}
    got = cal.load(tmp_path, here)
    assert got.parent_call_s == {1: 0.1, 2: 0.15} and got.left_out == ["q3g"]
    assert cal.load(tmp_path, old) is None
