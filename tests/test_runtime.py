"""The runtime's three parts on the real demo family: the model pool loads per role and releases, the cost
model turns the calibration into the γ policy a plan names, the drafter cache keeps a persistent drafter
per policy (its scope) and builds the rest fresh; and a serving slot is a Runtime of the same parts over
a view of the shared pool, with its own drafters and planners and the costs a batch sees."""

from __future__ import annotations

import pytest

from specquant_cli.decoding.batch import SeqView
from specquant_cli.decoding.gamma import AdaptiveGamma, FixedGamma
from specquant_cli.errors import ResourceError
from specquant_cli.routing.plan import Plan
from specquant_cli.runtime import Runtime
from specquant_cli.runtime.costs import BatchCosts
from specquant_cli.serving.slots import SlotPool, Slots
from specquant_cli.system.calibration import Calibration

INTEL = Calibration({1: 0.167, 2: 0.167, 4: 0.192, 8: 0.275, 16: 0.417}, {"q4": 0.065}, agreement={"q4": 0.9})


@pytest.fixture
def rt(family):
    r = Runtime.open(family, n_ctx=512)
    yield r
    r.close()


def test_the_pool_loads_per_role_and_releases(rt):
    assert rt.pool.loaded() == []
    rt.pool.ensure(["parent", "q4"])
    assert rt.pool.loaded() == ["parent", "q4"]
    assert rt.pool.context("q4") is rt.pool.context("q4")
    rt.pool.release(["q4"])
    assert rt.pool.loaded() == ["parent"]
    assert "q4" in rt.plannable_roles()  # not loaded, but it fits beside the parent


def test_persistent_drafters_are_kept_per_policy_and_shared_inside_one(rt):
    cache = rt.drafters
    assert cache.drafter("suffix", "parent", "suffix") is cache.drafter("suffix", "parent", "suffix")
    assert cache.drafter("suffix", "parent", "auto") is not cache.drafter("suffix", "parent", "suffix")
    mixed = cache.drafter("suffix+q4", "parent", "auto")  # built fresh each time; its suffix half is the scope's
    assert mixed is not cache.drafter("suffix+q4", "parent", "auto")
    assert mixed.first is cache.drafter("suffix", "parent", "auto")
    assert "q4" in rt.pool.loaded()  # the drafter cache loaded the role its drafter needs


@pytest.mark.parametrize("budget", [None, 0])
def test_a_second_level_reads_the_memory_its_answers_are_written_to(rt, budget):
    """Beside a first-level suffix drafter the second level reads that drafter's memory (with no memory shared,
    --draft-memory 0, its private one); alone it writes and reads the scope's."""
    cache = rt.drafters.with_models(rt.pool, rt.costs)
    cache.memory_tokens = cache.memory_tokens if budget is None else budget
    mixed = cache.drafter("suffix+stacked-q4", "parent", "auto")
    assert mixed.then.lower.memory is mixed.first.memory and mixed.then.lower.recorder is None
    alone = cache.drafter("stacked-q4", "parent", "stacked-q4")
    assert alone.lower.recorder is not None
    if budget is None:
        assert alone.lower.memory is cache.memory("stacked-q4")


def test_the_cost_model_builds_the_gamma_policy_a_plan_names(rt):
    rt.costs._calibration = INTEL  # this machine's costs, as if read from the family folder
    plan = Plan("p", None, "parent", "q4", "fixed")
    assert isinstance(rt.costs.gamma_policy(plan), FixedGamma)
    assert rt.costs.gamma_policy(Plan("p", None, "parent", "suffix", "capped", gamma_cap=12)).draft_length() == 12
    calibrated = rt.costs.gamma_policy(Plan("p", None, "parent", "q4", "calibrated"))
    assert isinstance(calibrated, AdaptiveGamma)
    assert rt.costs.verify_cost()(8) == pytest.approx(0.275 / 0.167)
    assert rt.costs.batch == 1


def test_a_slot_is_a_runtime_over_a_view_of_the_shared_pool(family):
    shared = Runtime.open(family, n_ctx=256, parallel=4)
    try:
        shared.pool.ensure(["parent", "q4"])
        shared.costs._calibration = INTEL
        slots = Slots(shared, 4)
        in_flight = [3]
        slots.in_flight = lambda: in_flight[0]
        slot = slots.runtimes[2]
        assert isinstance(slot.pool, SlotPool) and isinstance(slot.costs, BatchCosts)
        view = slot.pool.context("parent")
        assert isinstance(view, SeqView) and view.seq == 2 and view.ctx is shared.pool.context("parent")
        with pytest.raises(ResourceError, match="q8 not loaded"):
            slot.pool.ensure(["q8"])  # a slot never loads: the shared pool did, before serving
        assert slot.plannable_roles() == ("parent", "q4")  # q8 would fit, but only what is loaded is plannable
        # The costs one of the requests in flight sees, and a planner per batch size (they learn apart).
        assert slot.calibration().parent_call_s == INTEL.for_batch(3).parent_call_s
        auto3 = slot.planner("auto")
        in_flight[0] = 1
        assert slot.calibration() is INTEL and slot.costs.batch == 1
        assert slot.planner("auto") is not auto3 and slot.planner("auto") is slot.planner("auto")
        in_flight[0] = 9  # never more than the slots
        assert slot.costs.batch == 4
        # Its own drafters (each with its own cursor and acceptance estimates), over one drafting memory per
        # policy that every slot reads and writes; another policy's memory is another.
        mine = slot.drafters.drafter("suffix", "parent", "suffix")
        other = slots.runtimes[1].drafters.drafter("suffix", "parent", "suffix")
        assert mine is not other and mine.memory is other.memory
        assert mine.memory is shared.drafters.drafter("suffix", "parent", "suffix").memory
        assert mine.memory is not slot.drafters.drafter("suffix", "parent", "auto").memory
        slot.close()  # resets its sequence; the shared models stay loaded
        assert shared.pool.loaded() == ["parent", "q4"]
    finally:
        shared.close()
