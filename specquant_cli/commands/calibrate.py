from __future__ import annotations

import typer

from specquant_cli.commands.options import JsonOpt, with_settings
from specquant_cli.console import err, out_json, stderr_reporter
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("calibrate", help="Measure this machine's call costs for a family (the auto policy's cost model); "
                                  "cached in the family folder (in the user cache when that folder "
                                  "is read-only).")(calibrate)


@with_settings("runtime.family", "runtime.ctx", "runtime.threads", "runtime.mmap", "runtime.rpc",
               "runtime.rpc_timeout")
def calibrate(
    force: bool = typer.Option(False, "--force", help="Measure again even when this machine's costs are cached"),
    json_out: bool = JsonOpt,
    *, cfg: Settings,
) -> None:
    from specquant_cli.session import open_session
    from specquant_cli.settings import SessionSettings

    runtime = open_session(SessionSettings.of(cfg), report=stderr_reporter()).runtime
    fam = runtime.family
    try:
        c = runtime.calibration(force=force, require_save=True)  # unsaveable: refused before measuring
    finally:
        runtime.close()
    if json_out:
        out_json(c.to_dict())
        return
    calls = " · ".join(f"{n}: {s * 1000:.1f}" for n, s in sorted(c.parent_call_s.items()) if n in (1, 2, 4, 8, 16))
    err.print(f"{fam.name} on this machine (measured {c.measured_at}):", markup=False)
    err.print(f"  parent call, ms by tokens   {calls}", markup=False)
    for role, s in c.draft_step_s.items():
        err.print(f"  {role} step                    {s * 1000:.1f} ms ({c.draft_ratio(role):.2f}x a parent step)",
                  markup=False)
    for role, curve in c.draft_call_s.items():
        calls = " · ".join(f"{n}: {s * 1000:.1f}" for n, s in sorted(curve.items()) if n in (1, 2, 4, 8))
        err.print(f"  {role} call, ms by tokens{' ' * max(1, 6 - len(role))}{calls}", markup=False)
    if c.deep_pos:
        deep = " · ".join(f"{role} {c.depth_factor(role, 1, c.deep_pos):.2f}x" for role in c.deep_call_s)
        err.print(f"  one-token call after {c.deep_pos} positions: {deep}", markup=False)
    at = c.deep_pos or 64
    for role in c.import_s:
        err.print(f"  {role} KV import of {at} positions {c.import_cost(role, at) * 1000:.1f} ms", markup=False)
    for role, s in c.prefill_token_s.items():
        err.print(f"  {role} prefill per token       {s * 1000:.2f} ms", markup=False)
