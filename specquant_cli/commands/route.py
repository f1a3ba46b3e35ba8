from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from specquant_cli.commands.options import ConfigOpt, FamilyOpt, JsonOpt, PolicyOpt, load_family
from specquant_cli.console import err, out_json
from specquant_cli.inputs import read_prompt


def register(app: typer.Typer) -> None:
    app.command("route", help="Score a prompt's complexity and show the tier and plan it routes to.")(route)


def route(
    prompt: Optional[list[str]] = typer.Argument(None, help="The prompt; '-' (or no PROMPT) reads stdin",
                                                 show_default=False),
    family: Optional[Path] = FamilyOpt,
    policy: str = PolicyOpt,
    config: Optional[Path] = ConfigOpt,
    json_out: bool = JsonOpt,
) -> None:
    from specquant_cli.routing.policies import check_policy, plan_for
    from specquant_cli.routing.router import Router, load_config
    from specquant_cli.runtime import Runtime

    check_policy(policy)
    text = read_prompt(prompt)
    fam = load_family(family)
    router = Router(load_config(config), Runtime(fam).count_tokens)
    r = router.route(text)
    plan = plan_for(policy, r.tier)
    if json_out:
        out_json({"tier": r.tier, "score": r.score, "features": r.features, "contributions": r.contributions,
                  "plan": plan.to_dict(), "thresholds": {"low_max": router.config.low_max,
                                                         "medium_max": router.config.medium_max}})
        return
    t = Table(title=f"route: {r.tier} (score {r.score:.3f})")
    for col in ("feature", "value", "contribution"):
        t.add_column(col)
    for k, v in r.features.items():
        t.add_row(k, str(v), f"{r.contributions[k]:.3f}" if k in r.contributions else "")
    err.print(t)
    err.print(f"thresholds: low < {router.config.low_max} <= medium < {router.config.medium_max} <= high")
    err.print(f"plan ({policy}): {plan.describe()}")
