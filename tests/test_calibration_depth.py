"""The calibration's draft call curves, calls deep in the context and KV imports: what a stored entry may
hold, how the figures are read (depth_factor, draft_call, import_cost), and one real measurement on the
demo family (small contexts: one deep, one too small to go deep)."""

from __future__ import annotations

import json

import pytest

from specquant_cli.decoding.gamma import verify_shape
from specquant_cli.system import calibration as cal
from specquant_cli.system import measure
from specquant_cli.system.calibration import Calibration
from specquant_cli.system.calibration_file import SCHEMA, entry_problem

PARENT = {n: 0.01 * (1 + 0.1 * (n - 1)) for n in range(1, 17)}  # a parent call on n tokens, after 64 positions
Q4 = {n: 0.002 * (1 + 0.2 * (n - 1)) for n in range(1, 9)}


def deep_cal() -> Calibration:
    """Calls after 1024 positions: the parent's 1.5x / 1.3x / 1.1x its figures at 64 (sizes 1, 4, 8)."""
    return Calibration(PARENT, {"q4": Q4[1]}, draft_call_s={"q4": dict(Q4)},
                       deep_call_s={"parent": {1: 1.5 * PARENT[1], 4: 1.3 * PARENT[4], 8: 1.1 * PARENT[8]},
                                    "q4": {1: 2.0 * Q4[1], 4: 2.0 * Q4[4], 8: 2.0 * Q4[8]}},
                       deep_pos=1024, import_s={"q4": {64: 0.001, 1024: 0.009}})


def stored(c: Calibration) -> dict:
    """An entry as the calibration file holds it (string keys)."""
    return json.loads(json.dumps(c.to_dict()))


# -- stored entries --------------------------------------------------------------------------------------
def test_a_measured_entry_round_trips():
    entry = stored(deep_cal())
    assert entry_problem(entry) is None
    back = Calibration.from_dict(entry)
    assert back.draft_call_s == deep_cal().draft_call_s and back.deep_call_s == deep_cal().deep_call_s
    assert back.deep_pos == 1024 and back.import_s == {"q4": {64: 0.001, 1024: 0.009}}


def _put(*path_and_value):
    *path, value = path_and_value

    def mutate(entry):
        d = entry
        for p in path[:-1]:
            d = d[p]
        d[path[-1]] = value
    return mutate


def _drop(name):
    return lambda entry: entry.pop(name)


BAD = {  # name -> (mutation, a phrase of the reason)
    "draft-call-nan": (_put("draft_call_s", "q4", "3", float("nan")), "q4 draft_call_s[3] is nan"),
    "draft-call-negative": (_put("draft_call_s", "q4", "2", -1.0), "q4 draft_call_s[2] -1 s is not a timing"),
    "draft-call-size-0": (_put("draft_call_s", "q4", "0", 0.01), "q4 draft_call_s has the size '0', not one of 1..8"),
    "draft-call-size-9": (_put("draft_call_s", "q4", "9", 0.01), "q4 draft_call_s has the size '9'"),
    "draft-call-not-a-curve": (_put("draft_call_s", "q4", [0.1]), "q4 draft_call_s is a JSON array, not an object"),
    "draft-call-bad-role": (_put("draft_call_s", "Q 4!", {"1": 0.01}), "draft_call_s names the role 'Q 4!'"),
    "draft-calls-missing": (_drop("draft_call_s"), "draft_call_s missing"),
    "deep-call-absurd": (_put("deep_call_s", "parent", "4", 1e9), "parent deep_call_s[4] 1e+09 s is not a timing"),
    "deep-call-size-2": (_put("deep_call_s", "parent", "2", 0.01),
                         "parent deep_call_s has the size '2', not one of 1, 4, 8"),
    "deep-call-size-text": (_put("deep_call_s", "parent", "x1", 0.01), "parent deep_call_s has the size 'x1'"),
    "deep-calls-a-list": (_put("deep_call_s", []), "deep_call_s is a JSON array, not an object"),
    "deep-pos-negative": (_put("deep_pos", -1), "deep_pos -1 is not a position"),
    "deep-pos-fraction": (_put("deep_pos", 10.5), "deep_pos 10.5 is not a position"),
    "deep-pos-huge": (_put("deep_pos", 1 << 40), "deep_pos"),
    "deep-pos-text": (_put("deep_pos", "1024"), "deep_pos is a JSON string, not a number"),
    "deep-pos-boolean": (_put("deep_pos", True), "deep_pos is a JSON boolean, not a number"),
    "deep-calls-without-pos": (_put("deep_pos", 0), "deep_call_s holds timings but deep_pos is 0"),
    "import-zero": (_put("import_s", "q4", "64", 0), "q4 import_s[64] 0 s is not a timing"),
    "import-string": (_put("import_s", "q4", "64", "fast"), "q4 import_s[64] is a string, not a number"),
    "import-beyond-deep": (_put("import_s", "q4", "5000", 0.01), "q4 import_s has the size '5000'"),
    "import-bad-role": (_put("import_s", "../q4", {"64": 0.01}), "import_s names the role '../q4'"),
    "imports-missing": (_drop("import_s"), "import_s missing"),
    "far-calls-without-pos": (_put("far_call_s", {"parent": {"1": 0.02}}), "far_call_s holds timings but far_pos is 0"),
    "far-pos-not-beyond-deep": (_put("far_pos", 1024), "far_pos 1024 is not beyond deep_pos 1024"),
    "far-pos-fraction": (_put("far_pos", 2560.5), "far_pos 2560.5 is not a position"),
    "far-pos-text": (_put("far_pos", "2560"), "far_pos is a JSON string, not a number"),
    "far-call-size-2": (_put("far_call_s", {"parent": {"2": 0.02}}), "parent far_call_s has the size '2'"),
    "far-calls-a-list": (_put("far_call_s", []), "far_call_s is a JSON array, not an object"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_new_field_is_refused_naming_it(case):
    mutate, phrase = BAD[case]
    entry = stored(deep_cal())
    mutate(entry)
    why = entry_problem(entry)
    assert why is not None and phrase in why, why


def test_an_entry_of_the_previous_schema_lacks_the_new_fields():
    entry = stored(deep_cal())
    for k in ("draft_call_s", "deep_call_s", "deep_pos", "import_s"):
        del entry[k]
    assert "draft_call_s, deep_call_s, deep_pos, import_s missing" in entry_problem(entry)
    assert SCHEMA == 8  # 7: the parent measured deep up to 64 tokens (DEEP_PARENT_SIZES); 8: CPU attention unfused


def test_an_entry_stored_before_the_far_calls_loads_without_them():
    entry = stored(deep_cal())
    del entry["far_call_s"], entry["far_pos"]
    assert entry_problem(entry) is None
    back = Calibration.from_dict(entry)
    assert back.far_pos == 0 and back.far_call_s == {}
    assert back.depth_factor("parent", 1, 2048) == deep_cal().depth_factor("parent", 1, 2048)


def far_cal() -> Calibration:
    """deep_cal, and the parent's calls after 2560 positions: 1.8x / 1.5x (sizes 1, 4), 1.0x (size 8: below its deep
    factor, noise)."""
    c = deep_cal()
    c.far_call_s = {"parent": {1: 1.8 * PARENT[1], 4: 1.5 * PARENT[4], 8: 1.0 * PARENT[8]}}
    c.far_pos = 2560
    return c


def test_a_far_depth_bends_the_line_beyond_the_deep_one():
    c = far_cal()
    assert entry_problem(stored(c)) is None
    back = Calibration.from_dict(stored(c))
    assert back.far_pos == 2560 and back.far_call_s == c.far_call_s
    for pos in (0, 64, 500, 1024):  # up to the deep position: as before
        assert c.depth_factor("parent", 1, pos) == deep_cal().depth_factor("parent", 1, pos)
    assert c.depth_factor("parent", 1, 2560) == pytest.approx(1.8)
    assert c.depth_factor("parent", 1, 1792) == pytest.approx(1.65)  # half way between 1.5 and 1.8
    assert c.depth_factor("parent", 1, 4096) == pytest.approx(2.1)  # extrapolated along the far piece
    assert deep_cal().depth_factor("parent", 1, 4096) == pytest.approx(1 + 0.5 * (4096 - 64) / (1024 - 64))
    assert c.depth_factor("parent", 4, 2560) == pytest.approx(1.5)
    assert c.depth_factor("parent", 8, 2560) == pytest.approx(1.1)  # never below the deep factor
    assert c.depth_factor("q4", 4, 2560) == deep_cal().depth_factor("q4", 4, 2560)  # the drafts: no far figures
    assert c.for_batch(2).depth_factor("parent", 1, 2560) == pytest.approx(1.8)
    assert c.call_s_at(1, 2560) == pytest.approx(1.8 * PARENT[1])


def test_the_far_position_needs_room_beyond_the_deep_one():
    assert measure.far_position(4096, cal.DEEP_POS) == cal.FAR_POS
    assert measure.far_position(2048, cal.DEEP_POS) == 2048 - max(cal.DEEP_PARENT_SIZES) - 8
    assert measure.far_position(1500, cal.DEEP_POS) == 0  # under FAR_MIN beyond the deep position
    assert measure.far_position(4096, 0) == 0  # nothing measured deep


def test_a_long_verify_call_deep_in_the_context_is_priced_from_its_own_size():
    """A 25-token call after 1024 positions: between the measured 16- and 32-token factors (1.4x, 1.5x), not the 8-token
    call's 1.1x carried beyond it."""
    c = deep_cal()
    c.parent_call_s.update({24: 0.033, 32: 0.041})
    c.deep_call_s["parent"].update({16: 1.4 * PARENT[16], 32: 1.5 * 0.041})
    assert 1.4 < c.depth_factor("parent", 25, 1024) < 1.5
    assert c.at(1024).verify_cost(25) > deep_cal().at(1024).verify_cost(25)
    assert entry_problem(stored(c)) is None


# -- depth_factor ------------------------------------------------------------------------------------------
def test_depth_factor_is_exact_at_the_measured_points():
    c = deep_cal()
    assert c.depth_factor("parent", 1, 1024) == pytest.approx(1.5)
    assert c.depth_factor("parent", 4, 1024) == pytest.approx(1.3)
    assert c.depth_factor("parent", 8, 1024) == pytest.approx(1.1)
    assert c.depth_factor("q4", 4, 1024) == pytest.approx(2.0)
    for n in (1, 4, 8):
        assert c.depth_factor("parent", n, cal.PREFILL_TOKENS) == 1.0


def test_depth_factor_is_linear_in_position_and_between_sizes():
    c = deep_cal()
    mid = (cal.PREFILL_TOKENS + 1024) // 2
    assert c.depth_factor("parent", 1, mid) == pytest.approx(1.25)
    assert c.depth_factor("parent", 1, 2 * 1024 - cal.PREFILL_TOKENS) == pytest.approx(2.0)  # extrapolated
    assert c.depth_factor("parent", 2, 1024) == pytest.approx(1.5 + (1.3 - 1.5) / 3)  # between sizes 1 and 4
    assert c.depth_factor("parent", 6, 1024) == pytest.approx(1.2)  # between 4 and 8
    assert c.depth_factor("parent", 16, 1024) == pytest.approx(1.1)  # beyond 8: the nearest
    assert c.call_s_at(4, 1024) == pytest.approx(1.3 * c.call_s(4))
    assert c.call_s_at(4, 10) == c.call_s(4)


def test_depth_factor_is_one_when_not_measured_and_never_below():
    assert Calibration(PARENT).depth_factor("parent", 4, 4000) == 1.0
    assert deep_cal().depth_factor("q8", 4, 4000) == 1.0  # no deep figures for this role
    faster = Calibration(PARENT, deep_call_s={"parent": {1: 0.5 * PARENT[1]}}, deep_pos=1024)  # noise
    assert faster.depth_factor("parent", 1, 4000) == 1.0
    assert all(deep_cal().depth_factor("parent", n, p) >= 1.0 for n in (1, 3, 8, 16) for p in (0, 10, 64, 500, 9000))


def test_depth_factor_of_a_batch_view_reads_one_sequence_alone():
    c = deep_cal()
    view = c.for_batch(2)
    assert view.depth_factor("parent", 4, 1024) == pytest.approx(1.3)
    assert view.call_s_at(2, 1024) == pytest.approx(view.call_s(2) * 1.3)  # the batch's call: 4 tokens


# -- draft_call, import_cost ---------------------------------------------------------------------------------
def test_draft_call_reads_the_curve_and_extends_it_linearly():
    c = deep_cal()
    assert c.draft_call("q4", 5) == Q4[5]
    slope = (Q4[8] - Q4[4]) / 4
    assert c.draft_call("q4", 12) == pytest.approx(Q4[8] + 4 * slope)
    assert c.draft_call("q8", 3) is None


def test_draft_call_falls_back_to_the_step_for_older_data():
    old = Calibration(PARENT, {"q4": 0.003})
    assert old.draft_call("q4", 1) == pytest.approx(0.003)
    assert old.draft_call("q4", 6) == pytest.approx(0.003 * verify_shape(6))
    assert old.draft_call("q8", 6) is None


def test_import_cost_is_linear_through_the_measured_lengths():
    c = deep_cal()
    assert c.import_cost("q4", 64) == pytest.approx(0.001)
    assert c.import_cost("q4", 1024) == pytest.approx(0.009)
    assert c.import_cost("q4", 544) == pytest.approx(0.005)
    assert c.import_cost("q8", 100) is None
    one = Calibration(PARENT, import_s={"q4": {64: 0.002}})
    assert one.import_cost("q4", 128) == pytest.approx(0.004)


class _Parent:
    def __init__(self):
        self.tokens = []

    def sync(self, tokens, logits="last"):
        self.tokens = list(tokens)

    def export_state(self, seq=0):
        return (b"state", 5)

    def reset(self):
        self.tokens = []


class _RefusingDraft:
    def __init__(self):
        self.tokens, self.resets = [], 0

    def import_state(self, state, tokens):
        self.tokens = []
        return False

    def reset(self):
        self.tokens, self.resets = [], self.resets + 1


def test_a_refused_import_stores_nothing_and_leaves_the_draft_reset():
    ctxs = {"parent": _Parent(), "q4": _RefusingDraft()}
    ticks = []
    got = measure._time_imports(ctxs.__getitem__, "parent", ["q4"], [[1] * 64, [2] * 300], ticks.append)
    assert got == {} and ctxs["q4"].tokens == [] and ctxs["q4"].resets >= 1
    assert len(ticks) == 2 and ctxs["parent"].tokens == []


# -- a real measurement ------------------------------------------------------------------------------------
@pytest.fixture
def quick(monkeypatch):
    """The measurement's rounds and agreement pass cut down: these tests are about the new figures."""
    monkeypatch.setattr(measure, "REPEATS", 1)
    monkeypatch.setattr(measure, "AGREEMENT_PROMPTS", measure.AGREEMENT_PROMPTS[:1])
    monkeypatch.setattr(measure, "AGREEMENT_TOKENS", 8)


def _measure(models, n_ctx: int):
    from specquant_cli.backend.llama import Context

    ctxs = {role: Context(models["f16" if role == "parent" else role], n_ctx) for role in ("parent", "q8", "q4")}
    ticks = []
    try:
        c = measure.measure(ctxs.__getitem__, "parent", ["q8", "q4"], lambda what, i, n: ticks.append((i, n)))
        left = {role: ctx.n_past for role, ctx in ctxs.items()}
        return c, ticks, ctxs["parent"].n_ctx, left
    finally:
        for ctx in ctxs.values():
            ctx.close()


def _ticks_ok(ticks):
    total = ticks[-1][1]
    assert [i for i, _ in ticks] == list(range(1, total + 1)) and {n for _, n in ticks} == {total}


def test_a_real_measurement_goes_deep_in_a_512_context(models, quick):
    c, ticks, n_ctx, left = _measure(models, 512)
    _ticks_ok(ticks)
    assert entry_problem(json.loads(json.dumps(c.to_dict()))) is None
    assert c.deep_pos == min(cal.DEEP_POS, n_ctx - cal.MAX_BATCH - 8) == 488
    for role in ("q8", "q4"):
        assert sorted(c.draft_call_s[role]) == list(range(1, cal.DRAFT_BATCH + 1))
        assert all(v > 0 for v in c.draft_call_s[role].values())
        curve = [c.draft_call_s[role][n] for n in range(1, cal.DRAFT_BATCH + 1)]
        assert curve == sorted(curve)  # monotone
        assert sorted(c.import_s[role]) == [cal.PREFILL_TOKENS, 488] and all(v > 0 for v in c.import_s[role].values())
    for role in ("q8", "q4"):
        assert sorted(c.deep_call_s[role]) == list(cal.DEEP_SIZES) and all(v > 0 for v in c.deep_call_s[role].values())
    # the parent's verify calls up to 64 tokens, those the 512-token context has room for after 488 positions
    assert sorted(c.deep_call_s["parent"]) == [n for n in cal.DEEP_PARENT_SIZES if 488 + n <= n_ctx]
    assert 16 in c.deep_call_s["parent"] and all(v > 0 for v in c.deep_call_s["parent"].values())
    assert c.depth_factor("parent", 4, 488) >= 1.0 and c.import_cost("q4", 300) > 0
    assert c.far_pos == 0 and c.far_call_s == {}  # no room beyond the deep position
    assert left["q8"] == left["q4"] == 0  # the drafts' contexts reset after the imports and the agreement pass


def test_a_real_measurement_goes_far_in_a_2048_context(models, quick):
    c, ticks, n_ctx, left = _measure(models, 2048)
    _ticks_ok(ticks)
    assert entry_problem(json.loads(json.dumps(c.to_dict()))) is None
    assert c.deep_pos == cal.DEEP_POS and c.far_pos == measure.far_position(n_ctx, cal.DEEP_POS) > c.deep_pos
    assert sorted(c.far_call_s) == ["parent"] and sorted(c.far_call_s["parent"]) == list(cal.DEEP_PARENT_SIZES)
    assert all(v > 0 for v in c.far_call_s["parent"].values())
    assert c.depth_factor("parent", 64, c.far_pos) >= c.depth_factor("parent", 64, c.deep_pos) >= 1.0
    assert sorted(c.import_s["q4"]) == [cal.PREFILL_TOKENS, cal.DEEP_POS]  # imports: as before
    assert left["q8"] == left["q4"] == 0


def test_a_real_measurement_skips_the_deep_calls_in_a_256_context(models, quick):
    c, ticks, n_ctx, _ = _measure(models, 256)
    _ticks_ok(ticks)
    assert n_ctx - cal.MAX_BATCH - 8 < cal.DEEP_MIN
    assert c.deep_pos == 0 and c.deep_call_s == {} and c.far_pos == 0
    assert {r: sorted(s) for r, s in c.import_s.items()} == {"q8": [cal.PREFILL_TOKENS], "q4": [cal.PREFILL_TOKENS]}
    assert sorted(c.draft_call_s["q4"]) == list(range(1, cal.DRAFT_BATCH + 1))
    assert c.depth_factor("parent", 8, 200) == 1.0
    assert entry_problem(json.loads(json.dumps(c.to_dict()))) is None
