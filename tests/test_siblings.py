"""Sibling draft models: a smaller network of the parent's vocabulary as a draft role (`quantize --draft-model`), its
checks (vocabulary token for token, size, a whole GGUF), and the plans it drafts in — alone for the parent, and as the
lowest level of a chain where q4 verifies its proposals and the parent verifies q4's — lossless greedy and sampled.

The sibling of the small demo family is a real smaller network of the same vocabulary: smollm2-135m's Q8_0 file with
only its first blocks (tests/hostile_util.rewrite_gguf); mismatching, bigger and broken files are made the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hostile_util import assert_clean_error, link_family, rewrite_gguf, snapshot

from specquant_cli.backend.llama import Context
from specquant_cli.decoding.drafters import ModelDrafter, ModelLevel
from specquant_cli.decoding.engine import Engine
from specquant_cli.decoding.gamma import FixedGamma
from specquant_cli.decoding.sampling import SamplingParams
from specquant_cli.decoding.stream import generate_text
from specquant_cli.family.vocab import read_vocab, vocab_difference

from conftest import own_samples, run_cli, sampled_verdict

KEEP = 16  # of smollm2-135m's 30 blocks: a smaller network that still agrees with the parent now and then
PROMPTS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
           "def fibonacci(n):\n    # complete this Python function", "Name the planets of the solar system in order."]
MAX_NEW = 32


@pytest.fixture(scope="module")
def files(family_dir, tmp_path_factory) -> dict[str, Path]:
    """Real GGUFs made from the demo family's Q8_0 file: a sibling, a bigger model, two other vocabularies."""
    d = tmp_path_factory.mktemp("siblings")
    q8 = family_dir / json.loads((family_dir / "manifest.json").read_text())["variants"]["q8"]["path"]
    return {"small": rewrite_gguf(q8, d / "small.gguf", keep_layers=KEEP),
            "bigger": rewrite_gguf(q8, d / "bigger.gguf", extra_layers=2),
            "one_token": rewrite_gguf(q8, d / "one-token.gguf", keep_layers=KEEP, tokens={1000: "zzzz"}),
            "fewer": rewrite_gguf(q8, d / "fewer.gguf", keep_layers=KEEP, drop_tokens=16)}


@pytest.fixture
def fam(family_dir, tmp_path) -> Path:
    return link_family(family_dir, tmp_path / "fam")


@pytest.fixture(scope="module")
def with_sibling(family_dir, files, tmp_path_factory) -> Path:
    """A copy of the demo family (its F16 parent and q4: fewer roles to calibrate) with the small sibling added
    through the command line."""
    root = link_family(family_dir, tmp_path_factory.mktemp("with-sibling") / "fam", roles=("f16", "q4"))
    r = run_cli(["quantize", "--draft-model", str(files["small"]), "--out", str(root)])
    assert r.exit_code == 0, r.output
    return root


def test_the_vocabulary_check_names_the_first_token_that_differs(family_dir, files):
    parent = read_vocab(family_dir / "smollm2-135m-f16.gguf")
    assert vocab_difference(parent, read_vocab(files["small"])) is None
    why = vocab_difference(parent, read_vocab(files["one_token"]), "sibling")
    assert why.startswith("token 1000 differs") and "'zzzz'" in why, why
    assert vocab_difference(parent, read_vocab(files["fewer"])) == "token counts differ: parent 49152, draft 49136"


def test_a_sibling_is_recorded_with_its_own_network(with_sibling, files):
    from specquant_cli.family.manifest import Family

    f = Family.load(with_sibling)
    assert f.siblings() == ["sibling"] and "sibling" in f.roles()
    rec = f.variant("sibling")
    assert rec["sibling"]["n_params"] < json.loads((with_sibling / "manifest.json").read_text())["n_params"]
    assert f.hparams_of("sibling")["block_count"] == KEEP and f.hparams_of("q4")["block_count"] == 30
    assert f.check(hashes=True, deep=True) == {r: None for r in f.stored_roles()}
    # added again from the same file: nothing changes
    before = snapshot(with_sibling)
    r = run_cli(["quantize", "--draft-model", str(files["small"]), "--out", str(with_sibling)])
    assert r.exit_code == 0 and "already there" in r.output, r.output
    assert snapshot(with_sibling) == before


@pytest.mark.parametrize(("which", "needle"), [
    ("one_token", "token 1000 differs: parent"),
    ("fewer", "token counts differ: parent 49152, sibling 49136"),
    ("bigger", "more than the parent's"),
    ("truncated", "truncated"),
    ("not_gguf", "not a GGUF file"),
    ("missing", "no such file"),
])
def test_a_bad_sibling_is_refused_in_one_line_and_the_family_left_as_it_was(fam, files, tmp_path, which, needle):
    bad = {"truncated": tmp_path / "cut.gguf", "not_gguf": tmp_path / "noise.gguf",
           "missing": tmp_path / "nowhere.gguf"}.get(which, files.get(which))
    if which == "truncated":
        data = files["small"].read_bytes()
        bad.write_bytes(data[:len(data) // 2])
    elif which == "not_gguf":
        bad.write_bytes(b"\x00" * 4096)
    before = snapshot(fam)
    r = run_cli(["quantize", "--draft-model", str(bad), "--out", str(fam)])
    assert_clean_error(r, 1, needle)
    assert snapshot(fam) == before


@pytest.mark.parametrize(("role", "needle"), [("q8", "a role name starts"), ("Big", "a role name starts"),
                                              ("q4_0", "a role name starts"), ("suffix", "names the suffix drafter"),
                                              ("ngram", "names the ngram drafter"), ("q4i", "a draft recipe")])
def test_a_sibling_role_name_is_checked(fam, files, role, needle):
    before = snapshot(fam)
    assert_clean_error(run_cli(["quantize", "--draft-model", str(files["small"]), "--out", str(fam), "--draft-role",
                                role]), 1, needle)
    assert snapshot(fam) == before


def test_quantize_without_a_base_needs_a_draft_model_and_a_family(fam):
    assert_clean_error(run_cli(["quantize", "--out", str(fam)]), 2, "give a BASE model")


def test_a_sibling_missing_at_load_time_is_one_line(family_dir, files, tmp_path):
    root = link_family(family_dir, tmp_path / "fam")
    assert run_cli(["quantize", "--draft-model", str(files["small"]), "--out", str(root)]).exit_code == 0
    rec = json.loads((root / "manifest.json").read_text())["variants"]["sibling"]
    (root / rec["path"]).unlink()
    r = run_cli(["chat", "--family", str(root), "--policy", "spec-sibling", "--max-tokens", "4", "Hi"])
    assert_clean_error(r, 1, f"{rec['path']} is missing")


@pytest.fixture(scope="module")
def ctxs(models, files):
    from specquant_cli.backend.llama import Model

    small = Model(files["small"])
    out = {role: Context(m, n_ctx=1024) for role, m in models.items()}
    out["sibling"] = Context(small, n_ctx=1024)
    yield out
    out["sibling"].close()
    small.close()


@pytest.fixture(scope="module")
def prompts(models):
    return [models["f16"].chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def parent_outputs(ctxs, prompts):
    eng = Engine(ctxs["f16"])
    return [generate_text(eng, p, MAX_NEW)[1] for p in prompts]


def _chain(ctxs, parent=True):
    low = ModelDrafter(ctxs["sibling"], "sibling")
    return ModelDrafter(ctxs["q4"], "chain-sibling-q4", parent=ctxs["f16"] if parent else None,
                        lower=ModelLevel(low, lambda n: 1.0 + 0.1 * (n - 1)))


@pytest.mark.parametrize("drafter", ["sibling", "chain"])
def test_greedy_answers_are_the_parents_own(ctxs, prompts, parent_outputs, drafter):
    from test_engine_real import assert_parent_answers

    d = _chain(ctxs) if drafter == "chain" else ModelDrafter(ctxs["sibling"], "sibling")
    eng = Engine(ctxs["f16"], d, FixedGamma(4), first_alone=True)
    assert assert_parent_answers(eng, ctxs["f16"], prompts, parent_outputs) > 0
    if drafter == "chain":  # the sibling proposed, q4 kept some of it (running totals over the four answers)
        levels = d.counters
        assert levels["level2_model_calls"] > 0 and levels["level2_accepted"] > 0, levels


@pytest.mark.parametrize("drafter", ["sibling", "chain"])
def test_a_seeded_sample_is_the_parents_own(models, ctxs, drafter):
    """Every token the parent's own sample for its seed (one token a call), whichever levels drafted it."""
    content = "Tell me a short story."
    samples = own_samples(models["f16"], content, 1234, 24)
    d = _chain(ctxs) if drafter == "chain" else ModelDrafter(ctxs["sibling"], "sibling")
    eng = Engine(ctxs["f16"], d, FixedGamma(4), SamplingParams(temperature=0.9, seed=1234), first_alone=True)
    text = generate_text(eng, models["f16"].chat_prompt([{"role": "user", "content": content}]), 24)[0]
    assert sampled_verdict(text, samples) in ("identical", "near-tie"), text
    assert eng.stats.drafted > 0


def test_the_sibling_policies_run_from_the_command_line(with_sibling):
    """spec-sibling and the chain through chat, as the parent answers (greedy)."""
    args = ["chat", "--family", str(with_sibling), "--max-tokens", "24", "--json", "Name three colors."]
    want = json.loads(run_cli([*args, "--policy", "parent"]).stdout)["text"]
    for policy in ("spec-sibling", "spec-chain-sibling-q4"):
        r = run_cli([*args, "--policy", policy])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["text"] == want, policy


# -- planning: auto weighs the sibling with its own prefill charged, and the chain where it makes q4 cheaper --------
def _registered_sibling():
    from specquant_cli.decoding.registry import register_family_drafters

    register_family_drafters(["parent", "q4", "q8", "sibling"], ["sibling"])


def _costs(sibling_step: float, q4_call_growth: float = 0.1):
    from specquant_cli.system.calibration import Calibration

    c = Calibration({n: 0.1 * (1 + 0.1 * (n - 1)) for n in range(1, 17)},
                    {"q4": 0.04, "q8": 0.08, "sibling": sibling_step},
                    {"parent": 0.01, "q4": 0.012, "q8": 0.02, "sibling": 0.004},
                    agreement={"q4": 0.9, "q8": 0.95, "sibling": 0.85})
    c.draft_call_s = {"q4": {n: 0.04 * (1 + q4_call_growth * (n - 1)) for n in range(1, 9)},
                      "sibling": {n: sibling_step * (1 + 0.3 * (n - 1)) for n in range(1, 9)}}
    c.import_s = {"q4": {64: 0.001, 1024: 0.006}}
    return c


def test_auto_charges_a_siblings_own_prefill():
    from specquant_cli.routing import auto

    _registered_sibling()
    roles = ("parent", "q4", "q8", "sibling")
    short = {c.name: c for c in auto.candidates("medium", 0.0, roles, _costs(0.01), prompt_tokens=50,
                                               answer_tokens=128)}
    long = {c.name: c for c in auto.candidates("medium", 0.0, roles, _costs(0.01), prompt_tokens=3000,
                                              answer_tokens=128)}
    # (their batch curves are measured: each runs in its two-level form)
    assert short["stacked-sibling"].predicted > short["stacked-q4"].predicted  # a quarter of q4's step
    assert long["stacked-sibling"].predicted < long["stacked-q4"].predicted  # 3000 tokens of its own prefill: 12 s
    assert "sibling" not in auto.choose(list(long.values())).name


def test_auto_prices_the_chain_only_where_the_sibling_makes_q4s_step_cheaper():
    from specquant_cli.routing import auto

    _registered_sibling()
    roles = ("parent", "q4", "q8", "sibling")
    flat = {c.name: c for c in auto.candidates("medium", 0.0, roles, _costs(0.005, q4_call_growth=0.05))}
    assert "chain-sibling-q4" in flat and flat["chain-sibling-q4"].predicted > flat["stacked-q4"].predicted
    steep = {c.name: c for c in auto.candidates("medium", 0.0, roles, _costs(0.03, q4_call_growth=1.0))}
    assert "chain-sibling-q4" not in steep  # a q4 call on 1 + k tokens costs 1 + k steps: nothing to gain
    assert auto.chain_step(_costs(0.03, q4_call_growth=1.0), "sibling", "q4")[0] >= 1.0


def test_a_chain_policy_names_both_roles_before_the_family_is_opened():
    from specquant_cli.errors import InputError
    from specquant_cli.routing.policies import check_policy, plan_for

    plan = plan_for("spec-chain-sibling-q4", "medium")
    assert plan.roles == ["parent", "q4", "sibling"] and plan.gamma_policy == "calibrated"
    assert check_policy("spec-chain-sibling-q4", ["parent", "q4", "sibling"])
    with pytest.raises(InputError, match="no 'sibling' variant"):
        check_policy("spec-chain-sibling-q4", ["parent", "q4", "q8"])


def test_calibrate_measures_the_sibling_and_route_weighs_it_per_batch_size(with_sibling):
    """The sibling's step, call curve, prefill and agreement are measured (no KV import: another network), and auto
    lists its plans for one sequence and for batches of 2 and 4, each with why."""
    r = run_cli(["calibrate", "--family", str(with_sibling), "--threads", "2", "--json"])
    assert r.exit_code == 0, r.output
    c = json.loads(r.stdout)
    assert c["draft_step_s"]["sibling"] > 0 and c["prefill_token_s"]["sibling"] > 0
    assert 0 <= c["agreement"]["sibling"] <= 1 and "sibling" in c["draft_call_s"]
    assert "sibling" not in c["import_s"] and "q4" in c["import_s"]
    r = run_cli(["route", "--family", str(with_sibling), "--threads", "2", "--max-tokens", "64", "--batch", "1,2,4",
                 "--json", "Write a Python function that reverses a list."])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert set(out["by_batch"]) == {"1", "2", "4"}
    for plan in out["by_batch"].values():
        names = {c["plan"] for c in plan["candidates"]}
        assert {"sibling", "q4"} <= names or {"stacked-sibling", "stacked-q4"} <= names, names
        assert plan["why"]


def test_two_clients_at_once_draft_with_the_sibling_and_get_the_parents_answers(with_sibling, parent_judge):
    """serve --parallel 2 with the sibling drafting for both sequences (spec-sibling's calls go to the batcher's
    rounds like any draft's), and the chain: every answer is the parent's own, or parts from it only at a proven
    near-tie."""
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import KEY, PROMPTS, N, ServerProc, ask

    from specquant_cli.bench import fidelity

    s = ServerProc(["--family", str(with_sibling), "--parallel", "2", "--policies",
                    "spec-sibling,spec-chain-sibling-q4", "--policy", "spec-sibling", "--api-key", KEY])
    try:
        jobs = [(p, pol) for pol in ("spec-sibling", "spec-chain-sibling-q4") for p in PROMPTS[:3]]
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda j: ask(s.client(), j[0], extra_body={"specquant_policy": j[1]}), jobs))
        verdicts = [parent_judge(p, text, N) for (p, _), text in zip(jobs, got)]
        assert all(got) and fidelity.UNEXPLAINED not in verdicts, list(zip(jobs, got, verdicts))
        assert s.health()["failed"] == 0
    finally:
        s.stop()


def test_a_sibling_is_checked_before_a_base_is_quantized(family_dir, files, tmp_path):
    out = tmp_path / "new"
    r = run_cli(["quantize", str(family_dir / "smollm2-135m-f16.gguf"), "--out", str(out), "--types", "q8_0",
                 "--draft-model", str(files["one_token"])])
    assert_clean_error(r, 1, "token 1000 differs")
    assert not (out / "manifest.json").exists() and not list(out.glob("*.gguf"))


def test_replacing_a_sibling_removes_only_its_own_old_file(family_dir, files, tmp_path):
    """--force replaces the sibling; a record naming another variant's file (a hostile manifest) never gets that
    file removed, and a copy that would land on a file the family uses is refused."""
    root = link_family(family_dir, tmp_path / "fam")
    assert run_cli(["quantize", "--draft-model", str(files["small"]), "--out", str(root)]).exit_code == 0
    m = json.loads((root / "manifest.json").read_text())
    first = m["variants"]["sibling"]["path"]
    smaller = rewrite_gguf(files["small"], tmp_path / "smaller.gguf", keep_layers=KEEP // 2)
    assert_clean_error(run_cli(["quantize", "--draft-model", str(smaller), "--out", str(root)]), 1, "--force")
    assert run_cli(["quantize", "--draft-model", str(smaller), "--out", str(root), "--force"]).exit_code == 0
    assert not (root / first).exists() and (root / "sibling-smaller.gguf").exists()
    m = json.loads((root / "manifest.json").read_text())
    m["variants"]["sibling"]["path"] = m["variants"]["q8"]["path"]  # hostile: the sibling "is" the q8 file
    m["variants"]["sibling"]["sha256"] = "0" * 64
    (root / "manifest.json").write_text(json.dumps(m))
    r = run_cli(["quantize", "--draft-model", str(files["small"]), "--out", str(root), "--force"])
    assert r.exit_code == 0, r.output
    assert (root / m["variants"]["q8"]["path"]).exists()  # never removed
    clash = rewrite_gguf(files["small"], tmp_path / "135m-q8_0.gguf", keep_layers=KEEP)  # -> smollm2-135m-q8_0.gguf
    before = snapshot(root)
    assert_clean_error(run_cli(["quantize", "--draft-model", str(clash), "--out", str(root), "--draft-role",
                                "smollm2"]), 1, "a file the family already uses")
    assert snapshot(root) == before
