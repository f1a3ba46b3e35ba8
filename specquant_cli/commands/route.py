from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from specquant_cli.commands.options import ConfigOpt, CtxOpt, FamilyOpt, JsonOpt, PolicyOpt, RpcOpt
from specquant_cli.console import err, out_json, stderr_reporter
from specquant_cli.inputs import read_prompt


def register(app: typer.Typer) -> None:
    app.command("route", help="Score a prompt's complexity and show the tier and plan it routes to.")(route)


def route(
    prompt: Optional[list[str]] = typer.Argument(None, help="The prompt; '-' (or no PROMPT) reads stdin",
                                                 show_default=False),
    family: Optional[Path] = FamilyOpt,
    policy: str = PolicyOpt,
    config: Optional[Path] = ConfigOpt,
    n_ctx: int = CtxOpt,
    json_out: bool = JsonOpt,
    rpc: Optional[str] = RpcOpt,
) -> None:
    from specquant_cli.routing.policies import check_policy
    from specquant_cli.session import open_session
    from specquant_cli.settings import SessionSettings

    check_policy(policy)
    text = read_prompt(prompt)
    # a prompt longer than the context (--ctx, as chat's) is refused before spaCy reads it
    session = open_session(SessionSettings(family, n_ctx, policy=policy, router_config=config),
                           report=stderr_reporter())
    runtime, router = session.runtime, session.router
    # routing loads no model weights: the auto policy uses the cached calibration, or priors without one
    r, plan = session.plan(text, measure=False)
    calibrated = runtime.calibration(measure=False) is not None
    if json_out:
        out_json({"tier": r.tier, "score": r.score, "features": r.features, "contributions": r.contributions,
                  "plan": plan.to_dict(), "calibrated": calibrated,
                  "thresholds": {"low_max": router.config.low_max, "medium_max": router.config.medium_max}})
        return
    t = Table(title=f"route: {r.tier} (score {r.score:.3f})")
    for col in ("feature", "value", "contribution"):
        t.add_column(col)
    for k, v in r.features.items():
        t.add_row(k, str(v), f"{r.contributions[k]:.3f}" if k in r.contributions else "")
    err.print(t)
    err.print(f"thresholds: low < {router.config.low_max} <= medium < {router.config.medium_max} <= high")
    err.print(f"plan ({policy}): {plan.describe()}")
    for c in plan.candidates:
        err.print(f"  {c['plan']:10} predicted {c['predicted_speedup']:.2f}x ({c['source']}): {c['why']}", markup=False)
    if plan.why:
        err.print(f"why: {plan.why}" + ("" if calibrated else " (uncalibrated: run specquant calibrate)"),
                  markup=False)
