"""The verify limit (bench.limit): an answer's time when every draft is right and costs nothing, priced call by call
at each call's depth from the calibration, and how bench prompts reports a policy's share of it."""

from __future__ import annotations

import pytest

from specquant_cli.bench import limit
from specquant_cli.system.calibration import Calibration

# a parent call on n tokens after 64 positions: 100 ms and 10 ms a token more, so longer calls pay best
NEAR = {n: 0.1 + 0.01 * (n - 1) for n in (*range(1, 17), 24, 32, 48, 64)}


def test_a_perfect_drafter_takes_the_longest_call_that_pays_and_never_more_than_is_left():
    cal = Calibration(dict(NEAR))
    # 1 token from the prefill, then 64 + 64 + 2 in three calls
    assert limit.decode_s(cal, 64, 131) == pytest.approx(2 * NEAR[64] + NEAR[2])
    assert limit.decode_s(cal, 64, 1) == 0.0  # the prefill made the only token
    assert limit.limit_s(cal, 64, 131, 1.5) == pytest.approx(1.5 + 2 * NEAR[64] + NEAR[2])
    assert limit.limit_s(None, 64, 131, 1.5) is None and limit.limit_s(cal, 64, 0, 1.5) is None


def test_calls_deep_in_the_context_cost_what_the_depth_aware_curve_says():
    """Long calls cost 2x after 1024 positions, one-token calls 1.1x: deep in a context the answer costs more, the
    limit follows the curve call by call, and where long calls stop paying it takes shorter ones."""
    deep = Calibration(dict(NEAR), deep_call_s={"parent": {1: 1.1 * NEAR[1], 8: 1.4 * NEAR[8], 64: 2.0 * NEAR[64]}},
                       deep_pos=1024)

    def by_hand(pos, left):  # the best tokens per second at each call's depth, no more than is left
        s = 0.0
        while left:
            n = max((k for k in range(1, 65) if k <= left), key=lambda k: (k / deep.call_s_at(k, pos), k))
            s, pos, left = s + deep.call_s_at(n, pos), pos + n, left - n
        return s

    near, far = limit.decode_s(deep, 64, 129), limit.decode_s(deep, 1024, 129)
    assert near == pytest.approx(by_hand(64, 128)) and far == pytest.approx(by_hand(1024, 128))
    assert near < 2.1 * NEAR[64] and far > 1.5 * near
    assert limit.decode_s(Calibration(dict(NEAR)), 1024, 129) == pytest.approx(2 * NEAR[64])  # nothing measured deep


def _rec(policy, new, tps, limit_s, lossy=False):
    from specquant_cli.bench.runner import Record

    return Record(item=f"i{new}", category="c", policy=policy, tier="low", plan="p", lossy=lossy, new_tokens=new,
                  prompt_tokens=500, total_s=new / tps, tokens_per_s=tps, decode_tokens_per_s=tps, route_s=0.0,
                  prefill_s=1.0, parent_prefill_s=1.0, draft_prefill_s=0.0, kv_import_s=0.0, kv_import=None,
                  draft_s=0.0, verify_s=1.0, drafted=0, accepted=0, parent_calls=1, finish_reason="stop",
                  identical=True, correct=None, rss_mb=1.0, text="", fidelity="identical", limit_s=limit_s)


def test_the_report_gives_each_policy_its_share_of_the_limit_time_weighted():
    from specquant_cli.bench.report import _md_table, columns, limit_lines, summarize

    recs = [_rec("parent", 100, 10.0, 2.5), _rec("parent", 300, 10.0, 7.5),  # 10 s and 30 s; the limit 40 tok/s
            _rec("auto", 100, 20.0, 2.5), _rec("auto", 300, 40.0, 7.5),  # 5 s and 7.5 s
            _rec("q4", 100, 30.0, None, lossy=True), _rec("q4", 300, 30.0, None, lossy=True)]
    summ = {s["policy"]: s for s in summarize(recs, ["parent", "auto", "q4"])}
    assert summ["parent"]["verify_limit_tokens_per_s"] == 40.0 and summ["parent"]["verify_limit_share"] == 0.25
    assert summ["auto"]["verify_limit_share"] == pytest.approx(10.0 / 12.5)
    assert summ["q4"]["verify_limit_share"] is None  # not priced (no calibration): no figure, not a zero
    line = " ".join(limit_lines(list(summ.values())))
    assert "40.00 tok/s, 4.00x the parent" in line and "auto 0.80" in line and "q4" not in line
    assert "of limit" not in [c.header for c in columns(list(summ.values()))]  # a wide column: the default fits 100
    wide = _md_table(list(summ.values()), wide=True)
    col = wide[0].split(" | ").index("of limit")
    assert [row.split(" | ")[col] for row in wide[2:]] == ["0.25", "0.80", "–"]
    assert limit_lines([{**s, "verify_limit_tokens_per_s": None} for s in summ.values()]) == []


def _run(name, requests):
    """A side-by-side run of `name` whose requests (ttft, e2e, prompt tokens, output tokens) went one at a time."""
    from specquant_cli.bench.answer import RequestResult
    from specquant_cli.bench.sides import Contender, Run

    results = [RequestResult(conversation=0, turn=k, messages=[], ok=True, ttft_s=t, e2e_s=e, prompt_tokens=p,
                             output_tokens=n) for k, (t, e, p, n) in enumerate(requests)]
    return Run(Contender(name, "specquant", name), 1, results, {})


def test_a_replayed_servers_share_of_the_limit_counts_its_own_time_to_the_first_token():
    from specquant_cli.bench import sides

    cal = Calibration(dict(NEAR))
    at_limit = 2.0 + limit.decode_s(cal, 64, 129) + 3.0 + limit.decode_s(cal, 300, 65)
    fast = _run("auto", [(2.0, 4.0, 64, 129), (3.0, 6.0, 300, 65)])
    assert sides.limit_share([fast], cal) == round(at_limit / 10.0, 3)
    assert sides.limit_share([fast], None) is None
    unsaid = _run("llama:plain", [(2.0, 4.0, None, 129)])  # a server that did not say its prompt tokens
    assert sides.limit_share([unsaid], cal) is None
    rows = [{"server": s, "kind": "specquant", "runs": 1, "output_tokens_per_s": 10.0, "vs_first": 1.0,
             "wall_s": 10.0, "ttft_p50_s": 2.0, "itl_p50_s": 0.1, "fidelity": None, "prediction": None,
             "cached_share": None, "plans": {}, "verify_limit_share": share}
            for s, share in (("parent", 0.21), ("auto", 0.94), ("llama:plain", None))]
    rep = {"config": {"scenario": "multi-turn", "conversations": 1, "turns": 2, "max_tokens": 64, "concurrency": 1},
           "servers": rows, "parallel": 1, "command": "specquant bench load", "family": "f", "parent": "bf16",
           "threads": 2, "runs": []}
    line = [x for x in sides.markdown(rep).splitlines() if x.startswith("Share of the verify limit")]
    assert len(line) == 1 and line[0].endswith(": parent 0.21; auto 0.94.")
