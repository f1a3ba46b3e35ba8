import json
import statistics

import pytest

from specquant_cli.bench.datasets import builtin, extract_answer, final_answer, load
from specquant_cli.bench.fidelity import NOISE_SAFETY_FACTOR
from specquant_cli.settings import cores

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
    import os

    rep, _, _ = report
    assert set(rep) >= {"command", "machine", "family", "config", "summary", "by_category", "fidelity", "records"}
    assert "dequantized" in rep["family"]["provenance"] and rep["family"]["caveat"]
    assert rep["machine"]["cores_logical"] == os.cpu_count()
    assert [s["policy"] for s in rep["summary"]] == ["parent", "spec-q4"]
    for s in rep["summary"]:
        assert set(s) >= {"policy", "tokens_per_s", "speedup", "identical_rate", "acceptance_rate",
                          "mean_accepted_length", "tiers", "accuracy", "peak_rss_mb", "time_split"}
    assert len(rep["records"]) == 2 * 2 and {r["category"] for r in rep["records"]} == {"qa", "math"}
    assert set(rep["by_category"]) == {"qa", "math"}
    st = rep["stamp"]
    assert set(st) == {"specquant", "commit", "python", "llama_cpp_python", "cpu", "threads", "mode", "date",
                       "command"}
    assert st["command"] == rep["command"] and st["threads"] == cores() and st["cpu"]
    assert rep["verdict"].startswith("spec-q4 ran ") and "as fast as parent" in rep["verdict"]
    assert rep["verdict"].endswith("2/2 answers identical")


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
    assert "| ident/tie/unexpl |" in md and "| parent | " in md and " | 2/0/0 | " in md
    assert f"near-tie bound {noise['bound']:.3g}" in md and "## Divergences" not in md
    assert "unexplained divergence" not in err


def _cells(summary, header, wide=True) -> dict:
    """policy -> its cell under `header` in the table of `summary` (every column when `wide`)."""
    from specquant_cli.bench.report import columns, rows

    cols = columns(summary, wide)
    k = [c.header for c in cols].index(header)
    return {s["policy"]: r[k] for s, r in zip(summary, rows(summary, cols))}


def test_sampled_summary_has_no_fidelity_cells(report):
    rep, _, _ = report
    sampled = [{**s, "fidelity": None} for s in rep["summary"]]
    assert list(_cells(sampled, "ident/tie/unexpl", wide=False).values()) == ["–", "–"]
    assert list(_cells(rep["summary"], "ident/tie/unexpl", wide=False).values()) == ["2/0/0", "2/0/0"]


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


def test_the_table_the_verdict_and_the_stamp_on_screen_and_in_markdown(report):
    rep, md, err = report
    assert rep["verdict"] in err and rep["verdict"] in md
    header = next(line for line in err.splitlines() if line.startswith("policy "))
    assert header.split() == ["policy", "tok/s", "×", "parent", "decode", "ident/tie/unexpl", "accept", "tok/call",
                              "accuracy", "peak"]  # the math item has a reference: accuracy shows
    assert "low/med/high" not in err and "draft/verify/prefill" not in err
    assert md.splitlines()[3].startswith(f"- run: specquant {rep['stamp']['specquant']}")
    assert "## All prompts, every column" in md and "| low/med/high |" in md


def test_wide_shows_every_column_on_screen(family_dir, monkeypatch):
    from specquant_cli.console import err

    monkeypatch.setattr(err, "width", 100)
    r = run_cli(["bench", "prompts", "--family", str(family_dir), "--categories", "qa", "--limit", "1", "--policies",
                 "parent,spec-q4", "--max-tokens", "4", "--warmup", "0", "--wide"])
    assert r.exit_code == 0, r.stderr
    header = next(line for line in r.stderr.splitlines() if line.startswith("policy "))
    assert "low/med/high" in header and " ".join(header.split()).endswith("draft/verify/prefill peak")
    lines = r.stderr.splitlines()
    table = lines[lines.index(header) - 1:lines.index(header) + 4]  # the title, the header, the rule, two rows
    assert [t.split()[0] for t in table[3:]] == ["parent", "spec-q4"]
    assert len(header) > 100 and not any("…" in t for t in table)


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
    from specquant_cli.bench.report import levels_lines, summarize

    levels = {"level2_proposed": 8, "level2_accepted": 6, "model_calls": 5, "model_s": 0.15, "lookup_s": 0.01}
    recs = [_rec("parent", 10, 12), _rec("q4", 30, 40, lossy=True), _rec("spec-q4", 15, 20, drafted=10, accepted=9),
            _rec("stacked-q4", 18, 24, levels=levels, drafted=10, accepted=9)]
    summ = {s["policy"]: s for s in summarize(recs, ["parent", "q4", "spec-q4", "stacked-q4"])}
    assert summ["spec-q4"]["q4_share"] == pytest.approx(0.5) and summ["spec-q4"]["q4_decode_share"] == 0.5
    share, decode = _cells(list(summ.values()), "of q4"), _cells(list(summ.values()), "of q4 decode")
    assert share["parent"] == "33%" and share["stacked-q4"] == "60%" and share["q4"] == "–"
    assert decode["parent"] == "30%" and decode["stacked-q4"] == "60%" and decode["q4"] == "–"
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
    assert summ["parent"]["f16_speedup"] == pytest.approx(  # of tok/s rounded to 3 places: a relative bound
        summ["parent"]["tokens_per_s"] / summ["parent-f16"]["tokens_per_s"], rel=5e-3)
    assert [r["policy"] for r in rep["records"]] == ["parent", "spec-q4", "parent-f16"]
    r = run_cli(["bench", "prompts", "--family", str(family_dir), "--categories", "qa", "--limit", "1", "--parent",
                 "f16", "--policies", "parent", "--max-tokens", "4", "--warmup", "0", "--json-file", str(out)])
    assert r.exit_code == 0 and [s["policy"] for s in json.loads(out.read_text())["summary"]] == ["parent"]


# -- the policy table, its verdict and the run's stamp ---------------------------------------------------------------

def _typical(repeats=1, policies=("parent", "parent-f16", "auto", "q4", "spec-q4", "spec-sibling"), items=12,
             correct=True, fid="identical"):
    """A run's records as `bench prompts` would keep them: every policy on `items` prompts, the draft ones drafting,
    q4 lossy, each record's tok/s over `repeats` runs (made to spread), half the answers right when `correct`."""
    from specquant_cli.bench.runner import Record

    speed = {"parent": 10.12, "parent-f16": 9.5, "auto": 12.7, "q4": 31.2, "spec-q4": 13.3, "spec-sibling": 14.4,
             "spec-chain-sibling-q4": 14.1}
    out = []
    for i in range(items):
        for p in policies:
            lossy, drafts = p == "q4", p not in ("parent", "parent-f16", "q4")
            runs = [speed[p] * (1 + 0.01 * k) for k in range(repeats)]
            out.append(Record(
                item=f"i{i}", category="qa", policy=p, tier="low", plan="p", lossy=lossy, new_tokens=128,
                prompt_tokens=40, total_s=128 / speed[p], tokens_per_s=statistics.mean(runs),
                decode_tokens_per_s=1.2 * speed[p], route_s=0.0, prefill_s=0.1, parent_prefill_s=0.1,
                draft_prefill_s=0.0, kv_import_s=0.0, kv_import=None, draft_s=0.2 if drafts else 0.0, verify_s=0.3,
                drafted=100 if drafts else 0, accepted=77 if drafts else 0, parent_calls=40, finish_reason="length",
                identical=None if lossy else True, correct=(i % 2 == 0) if correct else None, rss_mb=1.0, text="",
                fidelity=None if lossy else fid, peak_rss_mb=10950.4, repeat_tokens_per_s=runs))
    return out


def _render(summary, width=100, wide=False, soft_wrap=True) -> list[str]:
    """The table as the stderr console prints it (soft_wrap as `console.err`), one string per line."""
    import io

    from rich.console import Console

    from specquant_cli.bench.report import rich_table, whole

    con = Console(file=io.StringIO(), width=width, record=True, soft_wrap=soft_wrap, color_system=None)
    table = rich_table(summary, "qwen2.5-coder-1.5b: 12 prompts, 128 new tokens", wide)
    con.print(whole(con, table) if wide else table)
    return con.export_text().rstrip("\n").split("\n")


@pytest.mark.parametrize("repeats", [1, 3])
@pytest.mark.parametrize("soft_wrap", [True, False])
def test_the_default_table_fits_100_columns_with_no_cell_cut(repeats, soft_wrap):
    """parent, parent-f16, auto, q4, spec-q4 and a sibling policy, accuracy and (with repeats) the spread: every
    cell whole, every row one line of at most 100 characters."""
    from specquant_cli.bench.report import summarize

    names = ["parent", "parent-f16", "auto", "q4", "spec-q4", "spec-sibling"]
    summ = summarize(_typical(repeats), names)
    lines = _render(summ, soft_wrap=soft_wrap)
    assert not any("…" in line for line in lines), "\n".join(lines)
    assert max(len(line) for line in lines) <= 100
    body = lines[3:]  # the title, the header, the rule
    assert len(body) == len(names), "\n".join(lines)
    for line, s in zip(body, summ):
        assert line.startswith(s["policy"]) and line.endswith("10.7G")  # the whole row on its line
    assert lines[1].split() == ["policy", "tok/s", *(["±", "sd"] if repeats > 1 else []), "×", "parent", "decode",
                                "×", "F16", "of", "q4", "ident/tie/unexpl", "accept", "tok/call", "accuracy", "peak"]
    auto = body[names.index("auto")].split()
    assert "12/0/0" in auto and "77.0%" in auto and "3.20" in auto and "6/12" in auto and "1.25x" in auto


def test_conditional_columns_appear_only_with_their_data():
    from specquant_cli.bench.report import columns, summarize

    def headers(recs, names):
        return [c.header for c in columns(summarize(recs, names))]

    default = ["policy", "tok/s", "× parent", "decode", "ident/tie/unexpl", "accept", "tok/call", "peak"]
    assert headers(_typical(policies=("parent", "auto"), correct=False), ["parent", "auto"]) == default
    assert headers(_typical(policies=("parent", "auto")), ["parent", "auto"]) == [*default[:-1], "accuracy", "peak"]
    with_f16 = headers(_typical(policies=("parent", "parent-f16", "auto"), correct=False),
                       ["parent", "parent-f16", "auto"])
    assert with_f16 == [*default[:4], "× F16", *default[4:]]
    with_q4 = headers(_typical(policies=("parent", "q4"), correct=False), ["parent", "q4"])
    assert with_q4 == [*default[:4], "of q4", *default[4:]]
    repeated = headers(_typical(3, policies=("parent", "auto"), correct=False), ["parent", "auto"])
    assert repeated == ["policy", "tok/s", "± sd", *default[2:]]
    structured = summarize(_typical(policies=("parent", "auto"), correct=False), ["parent", "auto"])
    for s in structured:
        s.update(structured=2, finished=1, valid_rate=1.0, forced_share=0.25)
    assert [c.header for c in columns(structured)] == [*default[:5], "valid", "forced", *default[5:]]
    assert _cells(structured, "valid", wide=False)["auto"] == "100.0% (1 cut)"
    assert _cells(structured, "forced", wide=False)["auto"] == "25.0%"


def test_wide_shows_every_column_whole():
    from specquant_cli.bench.report import COLUMNS, columns, summarize

    summ = summarize(_typical(policies=("parent", "auto"), correct=False), ["parent", "auto"])
    assert columns(summ, wide=True) == list(COLUMNS)
    headers = [c.header for c in COLUMNS]
    for h in ("low/med/high", "draft ms/tok", "draft/verify/prefill", "identical", "× F16", "of q4", "± sd", "valid",
              "forced", "accuracy"):
        assert h in headers and h not in [c.header for c in columns(summ)]
    lines = _render(summ, width=100, wide=True)
    assert not any("…" in line for line in lines) and max(map(len, lines)) > 100  # wider than the console, whole
    assert "low/med/high" in lines[1] and "draft/verify/prefill" in lines[1]
    auto = lines[4].split()
    assert "100%/0%/0%" in auto and "33%/50%/17%" in auto  # tiers; draft/verify/prefill of 0.2 + 0.3 + 0.1 s


def test_the_spread_over_repeats_and_of_the_speedup():
    from specquant_cli.bench.report import summarize

    summ = {s["policy"]: s for s in summarize(_typical(3, policies=("parent", "auto")), ["parent", "auto"])}
    runs = {p: [v * (1 + 0.01 * k) for k in range(3)] for p, v in (("parent", 10.12), ("auto", 12.7))}
    sd = {p: statistics.stdev(r) for p, r in runs.items()}
    mean = {p: statistics.mean(r) for p, r in runs.items()}
    assert summ["auto"]["tokens_per_s_sd"] == pytest.approx(sd["auto"], abs=1e-3)
    ratio = mean["auto"] / mean["parent"]
    assert summ["auto"]["speedup_sd"] == pytest.approx(
        ratio * ((sd["auto"] / mean["auto"]) ** 2 + (sd["parent"] / mean["parent"]) ** 2) ** 0.5, abs=1e-4)
    one = summarize(_typical(1, policies=("parent", "auto")), ["parent", "auto"])
    assert all(s["tokens_per_s_sd"] is None and s["speedup_sd"] is None for s in one)


def test_the_verdict_names_the_fastest_lossless_policy():
    from specquant_cli.bench.report import summarize, verdict

    names = ["parent", "parent-f16", "auto", "q4", "spec-q4", "spec-sibling"]
    assert verdict(summarize(_typical(), names)) == (
        "spec-sibling ran 1.42x as fast as parent (decode 1.42x), 12/12 answers identical; q4 ran 3.08x but is lossy")
    assert verdict(summarize(_typical(3), names)).startswith("spec-sibling ran 1.42 ± 0.02x as fast as parent")
    ties = summarize(_typical(policies=("parent", "auto"), fid="near-tie"), ["parent", "auto"])
    assert verdict(ties) == "auto ran 1.25x as fast as parent (decode 1.25x), 0/12 answers identical, 12 near-tie"
    sampled = summarize(_typical(policies=("parent", "auto"), fid=None), ["parent", "auto"])
    assert verdict(sampled).endswith("answers not judged against the parent's")
    lossy = summarize(_typical(policies=("parent", "q4")), ["parent", "q4"])
    assert verdict(lossy) == "q4 ran 3.08x as fast as parent, but is lossy (its answers are not the parent's)"
    assert verdict(summarize(_typical(policies=("parent", "parent-f16")), ["parent", "parent-f16"])) is None


def test_cpu_model_from_cpuinfo(tmp_path):
    from specquant_cli.system.hardware import cpu_model

    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags\t\t: avx2\n\n"
                   "processor\t: 1\nmodel name\t: AMD EPYC 7B13\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd\nCPU part\t: 0xd0c\n\nHardware\t: BCM2835\n"
                   "Model\t\t: Raspberry Pi 4 Model B Rev 1.4\n")
    assert cpu_model(str(x86)) == "AMD EPYC 7B13"
    assert cpu_model(str(arm)) == "BCM2835"
    assert cpu_model(str(tmp_path / "none")) != ""  # platform's answer, or "unknown"


def _git(root, *args):
    import subprocess

    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(root), "PATH": __import__("os").environ["PATH"]})


def test_the_commit_of_the_checkout_the_package_runs_from(tmp_path, monkeypatch):
    import shutil
    import subprocess

    from specquant_cli.bench.stamp import git_commit

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    assert git_commit(tmp_path) is None  # no repository
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-q", "-m", "one")
    sha = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    assert git_commit(tmp_path) == sha
    (tmp_path / "new.txt").write_text("untracked\n")
    assert git_commit(tmp_path) == sha  # an untracked file leaves it clean
    (tmp_path / "a.txt").write_text("two\n")
    assert git_commit(tmp_path) == f"{sha}-dirty"
    (tmp_path / "site").mkdir()
    assert git_commit(tmp_path / "site") is None  # an installed copy inside another repository is no checkout
    monkeypatch.setenv("PATH", str(tmp_path / "site"))
    assert git_commit(tmp_path) is None  # no git: no commit, and no error


def test_the_stamp_of_a_run():
    import platform

    from specquant_cli import __version__
    from specquant_cli.bench.stamp import markdown_lines, take
    from specquant_cli.settings import environment, set_deterministic

    st = take("specquant bench route", 4)
    assert set(st) == {"specquant", "commit", "python", "llama_cpp_python", "cpu", "threads", "mode", "date",
                       "command"}
    assert st["specquant"] == __version__ and st["python"] == platform.python_version() and st["threads"] == 4
    assert st["command"] == "specquant bench route" and st["llama_cpp_python"] and st["cpu"]
    assert st["date"].endswith("+00:00") and st["date"][:2] == "20"
    (line,) = markdown_lines(st)
    assert line.startswith(f"- run: specquant {__version__}") and ", 4 threads, default mode; " in line
    assert st["cpu"] in line and st["mode"] == "default" and markdown_lines(None) == []
    before = environment._resolved_deterministic[:]
    set_deterministic(True)  # as `--deterministic` resolves it: the run's mode is stamped (bench rows name theirs)
    try:
        assert take("x", 2)["mode"] == "deterministic" and ", 2 threads, deterministic mode; " in markdown_lines(
            take("x", 2))[0]
        assert take("x", None, models_here=False)["mode"] is None  # a server's mode is its own
    finally:
        environment._resolved_deterministic[:] = before
