"""Family roles (family.roles) and the draft-role extension point: a family that gains a role — one more
record in its manifest, nothing else — drafts with it (`spec-<role>`, auto's candidates) once it is opened."""

import json

import pytest

from specquant_cli.errors import InputError
from specquant_cli.family import roles


def test_parent_first_whatever_the_names():
    assert roles.ordered(["d35", "q8", "x", "f16", "q4", "d35"]) == ["f16", "q4", "q8", "d35", "x"]
    assert roles.ordered(["q4", "bf16", "parent", "f16"]) == ["parent", "f16", "bf16", "q4"]
    assert roles.draft_roles(["a1", "f16", "q4", "bf16", "parent"]) == ["q4", "a1"]
    assert roles.builtin_draft_roles()[:2] == roles.STANDARD_DRAFTS


def test_recipe_roles_come_from_the_recipe_table():
    from specquant_cli.decoding.registry import DRAFTERS
    from specquant_cli.family.variants import RECIPES
    from specquant_cli.routing.policies import POLICIES

    assert roles.recipe_roles() == tuple(RECIPES)
    for r in RECIPES:  # each recipe drafts and has its spec-<role> policy, from that one table
        assert DRAFTERS[r].roles == (r,) and f"suffix+{r}" in DRAFTERS and POLICIES[f"spec-{r}"].drafter == r


@pytest.mark.parametrize("bad", ["", "Q9", "9a", "q4", "f16", "bf16", "parent", "q4_0", "a-b", "x" * 33])
def test_a_new_role_name_is_checked(bad):
    with pytest.raises(InputError, match="--role"):
        roles.check_role(bad)


def test_check_role_accepts_a_new_name():
    assert roles.check_role("d35") == "d35"


@pytest.fixture
def d35_family(family):
    """The demo family with one more role, `d35` (it sorts before f16), on q4's file: nothing is written."""
    from specquant_cli.family.manifest import Family

    m = json.loads((family.root / "manifest.json").read_text())
    m["variants"]["d35"] = dict(m["variants"]["q4"])
    return Family(family.root, m)


def test_a_new_draft_role_is_one_manifest_row(d35_family):
    """Opening the family registers its role drafters (one call); policies and planners then see the role, and
    the F16 stays the parent wherever the new role's name sorts."""
    from specquant_cli.decoding.registry import DRAFTERS
    from specquant_cli.routing.policies import all_roles, plan_for
    from specquant_cli.runtime import Runtime

    assert "d35" not in DRAFTERS
    assert d35_family.roles()[0] == "parent"
    rt = Runtime.open(d35_family)
    try:
        assert "d35" in rt.pool.draft_roles and DRAFTERS["d35"].roles == ("d35",) and "suffix+d35" in DRAFTERS
        assert plan_for("spec-d35", "low").roles == ["parent", "d35"]
        assert all_roles(["spec-d35", "parent"]) == ["parent", "d35"]
    finally:
        rt.close()


def test_a_new_draft_role_drafts_losslessly(d35_family):
    from specquant_cli.decoding.sampling import SamplingParams
    from specquant_cli.routing.router import Router
    from specquant_cli.runtime import Runtime
    from specquant_cli.session import ChatSession

    rt = Runtime.open(d35_family, n_ctx=512)
    try:
        session = ChatSession(rt, Router(), "parent", SamplingParams(), max_tokens=16)
        texts = {}
        for policy in ("parent", "spec-d35"):
            answer, records = session.ask_messages([{"role": "user", "content": "Name three primary colors."}],
                                                   policy=policy)
            last = list(records)[-1]
            texts[policy] = answer.text
        assert texts["spec-d35"] == texts["parent"] and last.drafted > 0
    finally:
        rt.close()


def test_looking_a_spec_role_up_registers_nothing(d35_family):
    from specquant_cli.decoding.registry import DRAFTERS
    from specquant_cli.routing.policies import policy_spec

    before = dict(DRAFTERS)
    assert policy_spec("spec-d35").drafter == "d35"
    assert DRAFTERS == before
