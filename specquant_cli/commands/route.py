from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from specquant_cli.commands.options import CHAT_MAX_TOKENS, JsonOpt, int_list, with_settings
from specquant_cli.console import err, out_json, stderr_reporter
from specquant_cli.inputs import read_prompt
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("route", short_help="Show the tier and plan of a prompt",
                help="Score a prompt's complexity and show the tier and plan it routes to (no model runs).")(route)


# The calibration a plan is priced with depends on the threads and the RPC workers: route takes them too.
@with_settings("decoding.policy", "runtime.family", "runtime.parent", "runtime.ctx", "runtime.threads", "runtime.rpc")
def route(
    prompt: Optional[list[str]] = typer.Argument(None, help="The prompt; '-' or none reads stdin", show_default=False),
    max_tokens: int = typer.Option(CHAT_MAX_TOKENS, "--max-tokens", min=0,
                                   help="Answer length the plans are priced over (0: none)"),
    batch: str = typer.Option("1", "--batch", help="Batch sizes to plan for, e.g. 1,2,4", metavar="B,…"),
    json_out: bool = JsonOpt,
    *, cfg: Settings,
) -> None:
    from specquant_cli.session import open_session
    from specquant_cli.settings import SessionSettings

    policy = cfg.decoding.policy
    text = read_prompt(prompt)
    # a prompt longer than the context (--ctx, as chat's) is refused before spaCy reads it
    session = open_session(SessionSettings.of(cfg), report=stderr_reporter())
    runtime, router = session.runtime, session.router
    # routing loads no model weights: the auto policy uses the cached calibration, or priors without one
    sizes = int_list(batch, "--batch", 1, 64)
    plans = {}
    for b in sizes:
        r, plans[b] = session.plan(text, measure=False, answer_tokens=max_tokens, batch=b)
    plan = plans[sizes[0]]
    calibrated = runtime.calibration(measure=False) is not None
    unfit = [d for d in plan.left_out if d["role"] in plan.roles]  # the plan's own roles (the parent's, say)
    if unfit:
        err.print(f"warning: this plan will not fit in this machine's memory: {unfit[0]['role']} "
                  f"{unfit[0]['why']}", markup=False)
    if json_out:
        out_json({"tier": r.tier, "score": r.score, "features": r.features, "contributions": r.contributions,
                  "plan": plan.to_dict(), "fits": not unfit, "calibrated": calibrated,
                  **({"by_batch": {str(b): p.to_dict() for b, p in plans.items()}} if len(sizes) > 1 else {}),
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
    for d in plan.left_out:
        err.print(f"left out: {d['role']} ({d['why']})", markup=False)
    for b, p in list(plans.items())[1:]:
        err.print(f"batch of {b}: {p.describe()}" + (f" — {p.why}" if p.why else ""), markup=False)
