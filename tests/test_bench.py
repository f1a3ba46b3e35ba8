import json
import statistics

import pytest

from specquant_cli.bench.datasets import builtin, extract_answer, final_answer, load
from specquant_cli.bench.fidelity import NOISE_SAFETY_FACTOR

from conftest import run_cli


@pytest.fixture(scope="module")
def report(family_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    r = run_cli(["bench", "prompts", "--family", str(family_dir), "--categories", "qa,math", "--limit", "1",
                 "--policies", "parent,spec-q4", "--max-tokens", "16", "--warmup", "1",
                 "--json-file", str(out / "b.json"), "--markdown", str(out / "b.md")])
    assert r.exit_code == 0, r.stderr
    assert r.stdout == ""  # the table goes to stderr
    return json.loads((out / "b.json").read_text()), (out / "b.md").read_text(), r.stderr


def test_json_schema(report):
    rep, _, _ = report
    assert set(rep) >= {"command", "machine", "family", "config", "summary", "by_category", "fidelity", "records"}
    assert "dequantized" in rep["family"]["provenance"] and rep["family"]["caveat"]
    import os

    assert rep["machine"]["cores_logical"] == os.cpu_count()
    assert [s["policy"] for s in rep["summary"]] == ["parent", "spec-q4"]
    for s in rep["summary"]:
        assert set(s) >= {"policy", "tokens_per_s", "speedup", "identical_rate", "acceptance_rate",
                          "mean_accepted_length", "tiers", "accuracy", "peak_rss_mb", "time_split"}
    assert len(rep["records"]) == 2 * 2 and {r["category"] for r in rep["records"]} == {"qa", "math"}
    assert set(rep["by_category"]) == {"qa", "math"}


def test_fidelity_columns_and_noise_figures(report):
    """Greedy, lossless and identical: every answer judged identical, the noise measured, no warning."""
    rep, md, err = report
    for s in rep["summary"]:
        assert s["fidelity"] == {"identical": 2, "near_tie": 0, "unexplained": 0}
    assert all(r["fidelity"] == "identical" and r["tokens"] for r in rep["records"])
    noise, divergences = rep["fidelity"]["noise"], rep["fidelity"]["divergences"]
    assert divergences == [] and noise["rows"] > 0 and noise["safety_factor"] == NOISE_SAFETY_FACTOR
    assert 0 <= noise["p99_margin_diff"] <= noise["max_margin_diff"] <= 2 * noise["max_logit_diff"]
    assert noise["bound"] == pytest.approx(NOISE_SAFETY_FACTOR * noise["max_margin_diff"])
    assert "| identical / near-tie / unexplained |" in md and "| parent | " in md and " | 2/0/0 | " in md
    assert f"near-tie bound {noise['bound']:.3g}" in md and "## Divergences" not in md
    assert "unexplained divergence" not in err


def test_sampled_summary_has_no_fidelity_cells(report):
    from specquant_cli.bench.report import COLUMNS, rows

    rep, _, _ = report
    sampled = [{**s, "fidelity": None} for s in rep["summary"]]
    col = COLUMNS.index("identical / near-tie / unexplained")
    assert [r[col] for r in rows(sampled)] == ["–", "–"]
    assert [r[col] for r in rows(rep["summary"])] == ["2/0/0", "2/0/0"]


def test_sampled_runs_are_not_judged():
    from specquant_cli.bench.runner import judge_fidelity
    from specquant_cli.decoding.sampling import SamplingParams

    assert judge_fidelity(None, None, [], [], SamplingParams(temperature=0.7)) is None  # loads nothing


def test_speedup_is_the_ratio_of_measured_means(report):
    rep, _, _ = report
    tps = {p: statistics.mean(r["tokens_per_s"] for r in rep["records"] if r["policy"] == p)
           for p in ("parent", "spec-q4")}
    summ = {s["policy"]: s for s in rep["summary"]}
    assert summ["parent"]["speedup"] == pytest.approx(1.0)
    assert summ["spec-q4"]["speedup"] == pytest.approx(tps["spec-q4"] / tps["parent"], rel=1e-3)
    assert summ["spec-q4"]["tokens_per_s"] == pytest.approx(tps["spec-q4"], rel=1e-3)
    for r in rep["records"]:
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["total_s"], rel=0.05)


def test_lossless_policy_is_identical_under_greedy(report):
    rep, _, _ = report
    summ = {s["policy"]: s for s in rep["summary"]}
    assert summ["spec-q4"]["identical_rate"] == 1.0
    assert summ["spec-q4"]["acceptance_rate"] > 0
    texts = {}
    for r in rep["records"]:
        texts.setdefault(r["item"], set()).add(r["text"])
    assert all(len(t) == 1 for t in texts.values())


def test_accuracy_counts_math_items(report):
    rep, md, _ = report
    summ = {s["policy"]: s for s in rep["summary"]}
    math = [r for r in rep["records"] if r["category"] == "math"]
    for r in math:  # correctness is the extracted answer against the reference, recomputed here
        ref = next(i.reference for i in builtin() if i.id == r["item"])
        assert r["correct"] == (extract_answer(r["text"]) == ref)
    parent = next(r for r in math if r["policy"] == "parent")
    assert summ["parent"]["accuracy_n"] == 1 and summ["parent"]["accuracy"] == float(parent["correct"])
    assert "## math" in md and "| parent |" in md and "provenance" in md


def test_gsm8k_reference_extraction():
    assert final_answer("Allen is 99 now.\n#### 109") == "109"
    assert final_answer("He pays 1,250 dollars.\n#### 1,250") == "1250"
    assert final_answer("no final answer here") is None


def test_model_answer_extraction():
    assert extract_answer("So the answer is 42.") == "42"
    assert extract_answer("First 3 apples, then 4 more: 7 apples in total.\n#### 7") == "7"
    assert extract_answer("It costs $1,200.50 in total") == "1200.5"
    assert extract_answer("The total is 18.0") == "18"
    assert extract_answer("#### 12 (we also saw 99)") == "12"
    assert extract_answer("no numbers") is None


def test_shared_datasets_load(tmp_path):
    items = builtin()
    assert len(items) >= 24 and {i.category for i in items} >= {"qa", "math", "code", "summarization",
                                                                  "translation", "instruction"}
    f = tmp_path / "g.jsonl"
    f.write_text('{"question_id": 1, "category": "math", "turns": ["1+1?"], "reference": ["#### 2"]}\n'
                 '{"question_id": 2, "category": "qa", "turns": ["Hi?", "More?"]}\n')
    got = load([f], ["math"], None)
    assert len(got) == 1 and got[0].reference == "2" and got[0].prompt.startswith("1+1?")


def test_bad_dataset_and_category_are_one_line(tmp_path, family_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no turns"}\n')
    r = run_cli(["bench", "prompts", "--family", str(family_dir), "--dataset", str(bad)])
    assert r.exit_code == 1 and "not a Spec-Bench question" in r.stderr and r.stderr.count("\n") == 1
    r = run_cli(["bench", "prompts", "--family", str(family_dir), "--categories", "poetry"])
    assert r.exit_code == 1 and "no items in category 'poetry'" in r.stderr


def test_plot_without_matplotlib_is_a_clear_message(tmp_path, family_dir, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    r = run_cli(["bench", "prompts", "--family", str(family_dir), "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 1 and "pip install 'specquant[plot]'" in r.stderr
    assert not (tmp_path / "p.png").exists()


def test_plot_writes_a_png(report, tmp_path):
    pytest.importorskip("matplotlib")  # installed by the test extra; skipped only outside scripts/test.sh
    from specquant_cli.bench.report import plot

    rep, _, _ = report
    out = tmp_path / "speed.png"
    plot(rep["summary"], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def _rec(policy, tps, dec, lossy=False, levels=None, drafted=0, accepted=0):
    from specquant_cli.bench.runner import Record

    return Record(item="i", category="c", policy=policy, tier="low", plan="p", lossy=lossy, new_tokens=10,
                  prompt_tokens=5, total_s=10 / tps, tokens_per_s=tps, decode_tokens_per_s=dec, route_s=0.0,
                  prefill_s=0.1, parent_prefill_s=0.1, draft_prefill_s=0.0, kv_import_s=0.0, kv_import=None,
                  draft_s=0.2, verify_s=0.3, drafted=drafted, accepted=accepted, parent_calls=3, finish_reason="length",
                  identical=None, correct=None, rss_mb=1.0, text="", levels=levels or {})


def test_every_lossless_policy_shows_its_share_of_q4_and_its_drafting_levels():
    from specquant_cli.bench.report import COLUMNS, levels_lines, rows, summarize

    levels = {"level2_proposed": 8, "level2_accepted": 6, "model_calls": 5, "model_s": 0.15, "lookup_s": 0.01}
    recs = [_rec("parent", 10, 12), _rec("q4", 30, 40, lossy=True), _rec("spec-q4", 15, 20, drafted=10, accepted=9),
            _rec("stacked-q4", 18, 24, levels=levels, drafted=10, accepted=9)]
    summ = {s["policy"]: s for s in summarize(recs, ["parent", "q4", "spec-q4", "stacked-q4"])}
    assert summ["spec-q4"]["q4_share"] == pytest.approx(0.5) and summ["spec-q4"]["q4_decode_share"] == 0.5
    col = COLUMNS.index("share of q4")
    cells = {r[0]: r[col] for r in rows(list(summ.values()))}
    assert cells["parent"] == "33% / 30%" and cells["stacked-q4"] == "60% / 60%" and cells["q4 (lossy)"] == "–"
    lv = summ["stacked-q4"]["levels"]
    assert lv["level1_acceptance"] == 0.9 and lv["level2_acceptance"] == 0.75 and lv["draft_model_calls"] == 5
    assert summ["spec-q4"]["levels"] is None
    assert any("stacked-q4` drafting levels" in line and "6/8" in line for line in levels_lines(list(summ.values())))
    no_q4 = summarize(recs[:1] + recs[2:], ["parent", "spec-q4"])
    assert all(s["q4_share"] is None for s in no_q4)


def test_a_bf16_parent_is_benched_beside_the_f16_parent(family_dir, tmp_path):
    """Where the parent that serves is BF16 and the family has an F16 rendering, the bench runs the F16 parent
    alone beside it (the figure users know), says which rendering is the parent, and prices every policy
    against both."""
    out = tmp_path / "b.json"
    r = run_cli(["bench", "prompts", "--family", str(family_dir), "--categories", "qa", "--limit", "1", "--parent",
                 "bf16", "--policies", "parent,spec-q4", "--max-tokens", "8", "--warmup", "0", "--json-file", str(out)])
    assert r.exit_code == 0, r.stderr
    rep = json.loads(out.read_text())
    assert rep["family"]["parent"] == {"rendering": "bf16", "why": "bf16, as asked (--parent)"}
    assert "parent: bf16, as asked" in r.stderr
    summ = {s["policy"]: s for s in rep["summary"]}
    assert list(summ) == ["parent", "parent-f16", "spec-q4"]
    assert summ["parent-f16"]["f16_speedup"] == 1.0
    assert summ["parent"]["f16_speedup"] == pytest.approx(summ["parent"]["tokens_per_s"]
                                                           / summ["parent-f16"]["tokens_per_s"], abs=1e-3)
    assert [r["policy"] for r in rep["records"]] == ["parent", "spec-q4", "parent-f16"]
    r = run_cli(["bench", "prompts", "--family", str(family_dir), "--categories", "qa", "--limit", "1", "--parent",
                 "f16", "--policies", "parent", "--max-tokens", "4", "--warmup", "0", "--json-file", str(out)])
    assert r.exit_code == 0 and [s["policy"] for s in json.loads(out.read_text())["summary"]] == ["parent"]
