"""Extension by registration: a drafter and a policy added from here, through the public registries only,
run through `chat --policy` and `bench` without any other file knowing about them."""

import json

import pytest

from specquant_cli.decoding.drafters import DrafterBase
from specquant_cli.decoding.protocols import Draft
from specquant_cli.decoding.registry import DRAFTERS, DrafterSpec, register_drafter
from specquant_cli.routing.policies import POLICIES, PolicySpec, markdown_table, plan_for, register_policy

from conftest import REPO, run_cli


class RepeatDrafter(DrafterBase):
    """Proposes the token that ended the sequence, n times: cheap, often wrong, never harmful."""

    name = "test-repeat"

    source = "suffix"

    def __init__(self):
        self.proposals = 0

    def propose(self, seq, n, sp=None, noise=None):
        self.proposals += 1
        return Draft([seq[-1]] * n)


@pytest.fixture
def registered():
    built = []

    def build(host, target):
        built.append(RepeatDrafter())
        return built[-1]

    register_drafter(DrafterSpec("test-repeat", (), build, help="test only"))
    register_policy(PolicySpec("test-repeat", "test only: repeat drafts", drafter="test-repeat", in_bench=False))
    yield built  # conftest's _registries takes both rows out again


def test_registered_policy_plans_from_the_table(registered):
    plan = plan_for("test-repeat", "high")
    assert plan.drafter == "test-repeat" and plan.roles == ["parent"] and not plan.lossy


def test_registered_drafter_runs_through_chat_and_is_lossless(registered, family_dir):
    args = ["chat", "--family", str(family_dir), "--max-tokens", "24", "--json", "Name three primary colors."]
    parent = json.loads(run_cli(args + ["--policy", "parent"]).stdout)
    r = run_cli(args + ["--policy", "test-repeat"])
    assert r.exit_code == 0, r.stderr
    mine = json.loads(r.stdout)
    assert mine["text"] == parent["text"] and mine["route"]["policy"] == "test-repeat"
    assert mine["stats"]["drafted"] > 0 and registered and registered[-1].proposals > 0


def test_registered_drafter_runs_through_bench(registered, family_dir):
    r = run_cli(["bench", "prompts", "--family", str(family_dir), "--categories", "qa", "--limit", "1",
                 "--max-tokens", "12", "--policies", "parent,test-repeat", "--warmup", "0", "--json"])
    assert r.exit_code == 0, r.stderr
    summ = {s["policy"]: s for s in json.loads(r.stdout)["summary"]}
    assert summ["test-repeat"]["identical_rate"] == 1.0 and summ["test-repeat"]["acceptance_rate"] is not None


def test_unknown_drafter_is_refused_at_registration():
    from specquant_cli.errors import InputError

    with pytest.raises(InputError, match="unknown drafter"):
        register_policy(PolicySpec("broken", "x", drafter="no-such-drafter"))
    assert "broken" not in POLICIES


def test_the_policy_table_of_the_docs_is_generated_from_the_registry():
    table = markdown_table()
    assert table in (REPO / "docs" / "policies.md").read_text(encoding="utf-8"), \
        "docs/policies.md's policy table is not the registry's; run python -m specquant_cli.reference"


def test_spec_of_any_draft_role_is_a_policy():
    """`spec-<role>` works for a role outside the registry (quantize --grade BPW --role NAME makes one)."""
    from specquant_cli.errors import InputError
    from specquant_cli.routing.policies import check_policy, plan_for, policy_spec

    before = set(DRAFTERS)
    spec = policy_spec("spec-zz9")
    assert spec.drafter == "zz9" and not spec.lossy and "spec-zz9" not in POLICIES  # the table stays as it is
    assert plan_for("spec-zz9", "low").roles == ["parent", "zz9"]
    for bad in ("spec-ngram", "spec-suffix", "spec-f16", "spec-bf16", "spec-parent", "spec-Bad!", "fastest", "spec-"):
        with pytest.raises(InputError, match="unknown policy"):
            check_policy(bad)
    assert set(DRAFTERS) == before  # looking policies up registers nothing (no suffix+ngram, no zz9)


class AlternatingPlanner:
    """Test-only planner: q4 drafts for one prompt, the parent alone for the next; it hears every answer."""

    def __init__(self):
        self.observed = []

    def plan(self, ctx):
        from specquant_cli.routing.plan import Plan

        draft = "q4" if len(self.observed) % 2 == 0 else None
        return Plan(ctx.policy, ctx.tier, "parent", draft, "fixed" if draft else "none", why="alternating")

    def observe(self, answer):
        self.observed.append((answer.plan.drafter, answer.last.new_tokens))


def test_a_registered_planner_plans_and_hears_every_answer(family):
    """A planner is one class plus one table row; the session keeps one per policy, so it learns across
    answers, and its plans run losslessly like any other."""
    from specquant_cli.routing.router import Router
    from specquant_cli.runtime import Runtime
    from specquant_cli.session import ChatSession

    register_policy(PolicySpec("test-planner", "test only: alternating plans", planner=AlternatingPlanner,
                               roles=("q4",), in_bench=False))
    rt = Runtime.open(family, n_ctx=512)
    try:
        session = ChatSession(rt, Router(), "test-planner", max_tokens=12)
        texts = []
        for _ in range(3):
            answer, records = session.ask("Name three primary colors.", remember=False)
            list(records)
            texts.append(answer.text)
        planner = rt.planner("test-planner")
        assert [d for d, _ in planner.observed] == ["q4", None, "q4"] and len(set(texts)) == 1
        assert rt.planner("test-planner") is planner and rt.planner("parent") is None
    finally:
        rt.close()


def test_only_the_policy_table_names_the_auto_policy():
    """Nothing outside the policy table (and the planner it names) asks whether a policy is "auto"."""
    hits = [p.relative_to(REPO).as_posix() for p in (REPO / "specquant_cli").rglob("*.py")
            if '"auto"' in p.read_text(encoding="utf-8")]
    hits.sort()
    # decoding/forms.py spells OpenAI's tool_choice "auto" (the model may call a tool), not the policy
    assert hits == ["specquant_cli/decoding/forms.py", "specquant_cli/routing/policies.py"]
