"""`specquant bench`'s subcommands on the small family: each runs for real, reports what it measured (the figures
are benchmarks, never asserted as speeds here) and refuses bad input in one line. `bench prompts` and `bench load`
have their own files (test_bench.py, test_loadtest*.py)."""

from __future__ import annotations

import json

import pytest

from specquant_cli.bench.stamp import markdown_lines

from conftest import run_cli


def _ok(args, tmp_path):
    out = tmp_path / "rep.json"
    md = tmp_path / "rep.md"
    r = run_cli(["bench", *args, "--json", "--json-file", str(out), "--markdown", str(md)])
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    assert json.loads(out.read_text()) == rep and md.read_text().startswith("# ")
    assert rep["command"].startswith("specquant")  # this process's arguments (pytest's, in-process)
    st = rep["stamp"]  # what makes the figures reproducible, in every report, at the top of every markdown
    assert set(st) == {"specquant", "commit", "python", "llama_cpp_python", "cpu", "threads", "mode", "date",
                       "command"}
    assert st["command"] == rep["command"] and st["cpu"] and st["date"].endswith("+00:00")
    assert md.read_text().split("\n")[3] == markdown_lines(st)[0]
    return rep, md.read_text(), r.stderr


def test_the_bench_group_lists_its_subcommands():
    r = run_cli(["bench", "--help"])
    assert r.exit_code == 0
    for sub in ("prompts", "load", "batch", "calls", "logits", "engine", "prefill", "drafts", "rpc", "route"):
        assert sub in r.stdout


def test_loadtest_names_where_it_went():
    r = run_cli(["loadtest", "--url", "http://127.0.0.1:1", "--conversations", "2"])
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.strip() == ("error: 'specquant loadtest' is now 'specquant bench load' (the same options; the "
                                "report goes to stdout with --json, to a file with --json-file)")


def test_calls_measures_each_role_in_a_child_at_each_depth(family_dir, tmp_path):
    rep, md, _ = _ok(["calls", "--family", str(family_dir), "--roles", "parent,q4", "--sizes", "1,4", "--reps", "1",
                      "--positions", "16,80"], tmp_path)
    assert list(rep["roles"]) == ["f16", "q4"]  # the parent as its bound rendering (the tests pin F16)
    for role, r in rep["roles"].items():
        assert set(r["depth_call_s"]) == {"16", "80"}, role
        assert r["call_s"] == r["depth_call_s"]["16"]  # the first depth's curve, as before depths
        for curve in r["depth_call_s"].values():
            assert set(curve) == {"1", "4"} and all(v > 0 for v in curve.values()), role
        assert r["prefill_token_s"] > 0
    assert rep["config"] == {"sizes": [1, 4], "reps": 1, "position": 16, "positions": [16, 80],
                             "threads": rep["config"]["threads"]}
    rows = [ln for ln in md.splitlines() if ln.startswith("| f16 | f16 |") or ln.startswith("| q4 |")]
    assert [ln.split(" | ")[2] for ln in rows] == ["16", "80", "16", "80"]  # a row per role and depth
    assert rows[0].split(" | ")[-2] == "1.00–1.00"  # the first depth against itself


def test_logits_compares_each_way_a_row_is_computed_against_one_token_at_a_time(family_dir, tmp_path):
    rep, md, _ = _ok(["logits", "--family", str(family_dir), "--positions", "8", "--other-threads", "1"], tmp_path)
    [(role, r)] = rep["models"].items()
    assert role == "f16" and r["answer_tokens"] == 8 and r["prompt_tokens"] > 8
    cases = {c["case"]: c for c in r["cases"]}
    assert {"reference again", "verify batch", "restored prefix", "prefill chunks of 7", "prefill split at 50%",
            "beside a slot"} <= set(cases)
    control = cases["reference again"]
    assert control["rows"] == control["bit_equal"] == control["top_same"] == 8 and control["max_diff"] == 0.0
    assert cases["verify batch"]["rows"] == sum(n * len([o for o in (0, 5, 17) if o + n <= 8]) for n in (2, 4, 8))
    for c in r["cases"]:
        assert c["rows"] and 0 <= c["bit_equal"] <= c["rows"] and c["max_diff"] >= 0, c
        assert (c["bit_equal"] == c["rows"]) == (c["max_diff"] == 0.0), c
    assert "| reference again | 8 | 8/8 | 0 | 8/8 |" in md


@pytest.mark.parametrize("args, needle", [
    (["--roles", "nope"], "--roles: 'nope' is no role of smollm2-135m"),
    (["--sizes", "0"], "--sizes '0': '0' is no whole number from 1 to 512"),
    (["--sizes", "1,x"], "'x' is no whole number"),
    (["--positions", "64,0"], "--positions '64,0': '0' is no whole number from 1 to 65536"),
])
def test_calls_refuses_bad_input_in_one_line(family_dir, args, needle):
    r = run_cli(["bench", "calls", "--family", str(family_dir), *args])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr


def test_engine_runs_each_drafter_and_length_against_the_parent(family_dir, tmp_path):
    rep, md, _ = _ok(["engine", "--family", str(family_dir), "--drafters", "q4,ngram", "--gammas", "2",
                      "--max-tokens", "8", "--prompts", "1"], tmp_path)
    names = [c["config"] for c in rep["configs"]]
    assert names == ["parent", "q4 g=2", "q4 adaptive", "ngram g=2", "ngram adaptive"]
    for c in rep["configs"]:
        assert c["identical"] == c["runs"] == 1, c  # greedy speculative decoding is the parent's own
        assert c["tokens_per_s"] > 0
    assert {x["model"] for x in rep["cost_ms"]} == {"f16", "q4"}
    r = run_cli(["bench", "engine", "--family", str(family_dir), "--drafters", "q9"])
    assert r.exit_code == 1 and "--drafters: 'q9' is no draft role" in r.stderr


def test_drafts_measures_agreement_step_and_perplexity(family_dir, tmp_path):
    rep, md, err = _ok(["drafts", "--family", str(family_dir), "--roles", "q4", "--categories", "qa",
                        "--stream-tokens", "12", "--steps", "3", "--ppl-tokens", "40"], tmp_path)
    assert [v["role"] for v in rep["variants"]] == ["parent", "q4"]
    parent, q4 = rep["variants"]
    assert parent["agreement"] == 1.0  # the parent agrees with its own stream
    assert 0 <= q4["agreement"] <= 1 and q4["ppl"] > 1 and q4["step_ms"] > 0
    assert rep["categories"] == ["qa"] and "specquant bench prompts --family" in err
    r = run_cli(["bench", "drafts", "--family", str(family_dir), "--roles", "q3g"])
    assert r.exit_code == 1 and "has no q3g role" in r.stderr and "--make" in r.stderr


def test_route_scores_a_prompt_set_per_category(family_dir, tmp_path):
    rep, md, _ = _ok(["route", "--family", str(family_dir), "--categories", "qa,code", "--limit", "3"], tmp_path)
    assert rep["stamp"]["threads"] is None  # no model runs
    cats = [r["category"] for r in rep["rows"]]
    assert cats[0] == "short-factual" and set(cats[1:]) == {"qa", "code"}
    for r in rep["rows"]:
        assert r["score_min"] <= r["score_median"] <= r["score_max"]
        assert sum(r["tiers"].values()) == pytest.approx(1.0)


def test_prefill_reports_the_gaps_per_chunk(family_dir, tmp_path):
    rep, md, _ = _ok(["prefill", "--family", str(family_dir), "--prefill-chunk", "32", "--prompt-tokens", "200",
                      "--ctx", "1024"], tmp_path)
    (row,) = rep["rows"]
    assert row["prefill_chunk"] == 32 and "error" not in row, row
    assert row["b_ttft_s"] > 0 and row["a_gaps_during"] >= 1 and row["a_gap_max_s"] >= row["a_gap_mean_s"] > 0


def test_rpc_measures_local_and_remote_parents(family_dir, tmp_path):
    rep, md, _ = _ok(["rpc", "--family", str(family_dir), "--max-tokens", "6", "--prompts", "1", "--reps", "1",
                      "--delays", "0", "--worker-threads", "1"], tmp_path)
    assert list(rep["placements"]) == ["local", "1 worker", "2 workers"] and list(rep["delays"]) == ["0"]
    assert rep["answers_differing_from_local"] == []  # greedy output through the workers is the local one
    assert rep["delays"]["0"]["spec_q4_tok_s"] > 0


def test_servers_side_by_side_each_fresh_with_repeats(family_dir, tmp_path):
    rep, md, err = _ok(["load", "--servers", "parent,suffix", "--repeat", "2", "--family", str(family_dir),
                        "--parallel", "2", "--conversations", "2", "--concurrency", "2", "--max-tokens", "6",
                        "--ctx", "1024"], tmp_path)
    assert [r["server"] for r in rep["runs"]] == ["parent", "suffix", "parent", "suffix"]  # in turn
    for row in rep["servers"]:
        assert row["runs"] == 2 and row["fidelity"]["judged"] == 4 and row["fidelity"]["unexplained"] == 0
        assert row["command"].startswith("specquant serve --family") and "--parallel 2" in row["command"]
    assert rep["servers"][0]["vs_first"] == 1.0
    assert rep["servers"][0]["plans"] == {"parent alone": 4}
    assert "| parent |" in md and "| suffix |" in md


@pytest.mark.parametrize("args, needle", [
    (["--servers", "parent,llama:plain"], "--servers llama:plain: give llama-server's path with --llama-server"),
    (["--servers", "parent,parent"], "a server named twice"),
    (["--servers", "nope"], "'nope' is no policy"),
    (["--url", "http://127.0.0.1:1", "--repeat", "2"], "--repeat applies to --servers"),
])
def test_servers_refuse_bad_input_in_one_line(family_dir, args, needle):
    r = run_cli(["bench", "load", "--family", str(family_dir), *args])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr


def test_batch_runs_requests_together_with_and_without_the_hold(family_dir, tmp_path):
    rep, md, _ = _ok(["batch", "--family", str(family_dir), "--requests", "1,2", "--policies", "parent,spec-q4",
                      "--hold", "priced,off", "--max-tokens", "8"], tmp_path)
    keys = [(r["parallel"], r["policy"], r["hold"]) for r in rep["rows"]]
    assert keys == [(b, p, h) for b in (1, 2) for p in ("parent", "spec-q4") for h in ("priced", "off")]
    for r in rep["rows"]:
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["rounds"] > 0
        assert r["identical"] == r["answers"] == r["parallel"], r  # greedy: the parent's own answers
    two = next(r for r in rep["rows"] if (r["parallel"], r["policy"], r["hold"]) == (2, "spec-q4", "off"))
    assert two["held_calls"] == 0  # without the hold nothing waits beside a draft call
    r = run_cli(["bench", "batch", "--family", str(family_dir), "--hold", "sometimes"])
    assert r.exit_code == 1 and "--hold 'sometimes': 'sometimes' is not one of priced, off" in r.stderr
