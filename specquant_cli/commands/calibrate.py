from __future__ import annotations

import typer

from specquant_cli.commands.options import JsonOpt, with_settings
from specquant_cli.console import err, out_json, stderr_reporter
from specquant_cli.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("calibrate", short_help="Measure this machine's costs for auto",
                help="Measure this machine's call costs for a family (the auto policy's cost model); cached in the "
                     "family folder, or in the user cache when that folder is read-only.")(calibrate)


@with_settings("runtime.family", "runtime.parent", "runtime.ctx", "runtime.threads", "runtime.mmap", "runtime.rpc",
               "runtime.rpc_timeout", "runtime.deterministic")
def calibrate(
    force: bool = typer.Option(False, "--force", help="Measure again even when cached"),
    json_out: bool = JsonOpt,
    *, cfg: Settings,
) -> None:
    from specquant_cli.session import open_session
    from specquant_cli.settings import SessionSettings
    from specquant_cli.system.renderings import describe, score

    settings = SessionSettings.of(cfg)
    fam, c = _measured(open_session(settings, report=stderr_reporter()).runtime, force)
    why = fam.parent_why
    if c.renderings and cfg.runtime.parent == "fastest":
        best = min(c.renderings, key=lambda r: score(c.renderings[r]))
        why = f"{best}, the faster here as calibrated ({describe(c.renderings)})"
        if best != fam.parent_rendering:  # the prior's pick measured slower: the faster one is calibrated too
            err.print(f"parent: {best} measured faster ({describe(c.renderings)}); calibrating it", markup=False)
            fam, c = _measured(open_session(settings, family=fam.bind(best, why), report=stderr_reporter()).runtime,
                               force)
    if json_out:
        out_json({**c.to_dict(), "parent": {"rendering": fam.parent_rendering, "why": why}})
        return
    calls = " · ".join(f"{n}: {s * 1000:.1f}" for n, s in sorted(c.parent_call_s.items())
                       if n in (1, 2, 4, 8, 16, 32, 64))
    err.print(f"{fam.name} on this machine (measured {c.measured_at}):", markup=False)
    err.print(f"  parent: {why}", markup=False)
    if c.renderings:
        err.print(f"  renderings compared: {describe(c.renderings)}", markup=False)
    err.print(f"  parent call, ms by tokens   {calls}", markup=False)
    for role, s in c.draft_step_s.items():
        err.print(f"  {role + ' step':<28}{s * 1000:.1f} ms ({c.draft_ratio(role):.2f}x a parent step)", markup=False)
    for role, curve in c.draft_call_s.items():
        calls = " · ".join(f"{n}: {s * 1000:.1f}" for n, s in sorted(curve.items()) if n in (1, 2, 4, 8))
        err.print(f"  {role + ' call, ms by tokens':<28}{calls}", markup=False)
    if c.agreement:
        siblings = fam.siblings()
        agree = " · ".join(f"{role} {a:.1%}" + (" (sibling)" if role in siblings else "")
                           for role, a in c.agreement.items())
        err.print(f"  {'agreement with the parent':<28}{agree}", markup=False)
    if c.deep_pos:
        deep = " · ".join(f"{role} {c.depth_factor(role, 1, c.deep_pos):.2f}x" for role in c.deep_call_s)
        err.print(f"  one-token call after {c.deep_pos} positions: {deep}", markup=False)
        curve = c.deep_call_s.get("parent", {})
        if len(curve) > 1:
            deep = " · ".join(f"{n}: {s * 1000:.1f} ({s / c.call_s(n):.2f}x)" for n, s in sorted(curve.items()))
            err.print(f"  parent call after {c.deep_pos} positions, ms by tokens  {deep}", markup=False)
    far = c.far_call_s.get("parent", {})
    if c.far_pos and far:
        far = " · ".join(f"{n}: {s * 1000:.1f} ({s / c.call_s(n):.2f}x)" for n, s in sorted(far.items()))
        err.print(f"  parent call after {c.far_pos} positions, ms by tokens  {far}", markup=False)
    at = c.deep_pos or 64
    for role in c.import_s:
        err.print(f"  {role} KV import of {at} positions {c.import_cost(role, at) * 1000:.1f} ms", markup=False)
    for role, s in c.prefill_token_s.items():
        err.print(f"  {role + ' prefill per token':<28}{s * 1000:.2f} ms", markup=False)


def _measured(runtime, force: bool):
    """(the runtime's bound family, its calibration measured or read), the runtime closed after. A stored one measured
    before the parent's long calls were (system.calibration.LONG_CALLS), or before its far calls were
    (system.calibration.FAR_POS) where the context has room for them, is measured again: a session plans a copied
    answer within the calls measured, and prices an agent's deep calls by them."""
    from specquant_cli.system.calibration import LONG_CALLS, PREFILL_TOKENS
    from specquant_cli.system.measure import far_position

    try:
        c = runtime.calibration(force=force, require_save=True)  # unsaveable: refused first
        n_ctx = runtime.pool.n_ctx
        missing = (f"parent calls of up to {max(LONG_CALLS)} tokens"
                   if c.longest_call < max(LONG_CALLS) and n_ctx >= PREFILL_TOKENS + max(LONG_CALLS) else
                   f"the parent's calls after {far_position(n_ctx, c.deep_pos)} positions"
                   if not c.far_pos and far_position(n_ctx, c.deep_pos) else None)
        if missing:
            err.print(f"calibration: stored before {missing} were measured; measuring again", markup=False)
            c = runtime.calibration(force=True, require_save=True)
        return runtime.family, c
    finally:
        runtime.close()
