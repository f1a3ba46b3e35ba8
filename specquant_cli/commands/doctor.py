from __future__ import annotations

from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from specquant_cli.commands.options import JsonOpt, load_family, warn_above_trained_ctx, with_settings
from specquant_cli.console import err, gib, out_json
from specquant_cli.family.roles import PARENT_ROLE
from specquant_cli.settings import Settings, decide_cache_ram, resolve_all


def register(app: typer.Typer) -> None:
    app.command("doctor", short_help="Check this machine, the build and a family",
                help="What this machine can run: hardware (NVML, psutil), the llama.cpp build, the settings that "
                     "differ from the defaults (--all: every one), and a family's files and plans.")(doctor)


@with_settings("runtime.family", "runtime.parent", "runtime.ctx", "runtime.threads", "runtime.rpc",
               "runtime.rpc_timeout")
def doctor(
    verify: bool = typer.Option(False, "--verify", help="Check each family file's sha256 too"),
    run_selftest: bool = typer.Option(False, "--selftest", help="Run the build's self-test again (exit 1 on failure)"),
    all_settings: bool = typer.Option(False, "--all", help="List every setting, not only those changed"),
    json_out: bool = JsonOpt,
    *, cfg: Settings,
) -> None:
    """--ctx is the context the placement plan reserves KV cache for. The report's "settings" are every
    setting as this command line, the environment and specquant.toml resolve it, and where each came from."""
    from specquant_cli.backend import selftest
    from specquant_cli.system import hardware
    from specquant_cli.system.placement import family_placements

    facts = hardware.detect()
    if run_selftest:
        err.print("self-test of this llama.cpp build on this CPU (in child processes):", markup=False)
        st = selftest.run(on_type=lambda t, outcome: err.print(f"  {t:5} {outcome}", markup=False))
    else:
        st = selftest.cached()
    facts.build["selftest"] = st.to_dict() if st else None
    report = {"hardware": facts.to_dict(), "advice": hardware.advice(facts),
              "settings": decide_cache_ram(resolve_all(cfg), facts.ram_available).to_dict()}
    broken: dict[str, str] = {}
    n_ctx, rpc_endpoints = cfg.runtime.ctx, cfg.runtime.rpc or []
    if cfg.runtime.family is not None:
        from specquant_cli.errors import FamilyError

        fam = load_family(cfg.runtime.family)
        warn_above_trained_ctx(fam, n_ctx)
        # every variant checked (path inside the folder, size, GGUF parse, type, vocabulary; sha256 with --verify)
        checks = fam.check(hashes=verify, deep=True)
        if not fam.renderings():  # no draft verifies, nothing is lossless: a family that runs no policy
            checks[PARENT_ROLE] = ("missing: the family has no parent (an f16 or bf16 rendering of its base, or the "
                                   "quantized file itself), which every draft verifies against; specquant quantize "
                                   "BASE --types f16 --family FOLDER adds it")
        else:
            from specquant_cli.system.renderings import decide

            choice = decide(fam, cfg.runtime.parent, facts, cfg.runtime.threads, rpc_endpoints)
            fam = fam.bind(choice.rendering, choice.why)
            report["parent"] = choice.to_dict()
            if cfg.runtime.parent == "fastest":
                decided = resolve_all(cfg).decided("runtime.parent", choice.rendering, choice.why)
                report["settings"] = decide_cache_ram(decided, facts.ram_available).to_dict()
        broken = {role: why for role, why in checks.items() if why}
        report["family"] = {"name": fam.name, "root": str(fam.root), "provenance": fam.provenance,
                            "source": fam.source or None, "draft_candidates": _draft_candidates(fam),
                            "sha256_verified": verify,
                            "variants": {role: {"ok": why is None, "problem": why} for role, why in checks.items()}}
        try:
            report["placements"] = family_placements(facts, fam, n_ctx)
        except FamilyError:  # a record too broken to plan with: reported below
            report["placements"] = {}
        from specquant_cli.system import calibration_file as cal

        c = cal.load(fam.root, cal.fingerprint(facts, cfg.runtime.threads, rpc_endpoints, parent=fam.parent_rendering))
        report["calibration"] = c.to_dict() if c else None
        if not broken:
            report["plans"] = _plans(facts, fam, c, n_ctx)
    remote = _rpc_report(rpc_endpoints, report.get("family") and fam, n_ctx)
    if remote:
        report["rpc"] = remote
    if json_out:
        out_json(report)
    else:
        _render(report, all_settings)
    if st is not None and not st.ok:
        from specquant_cli.errors import LlamaError

        raise LlamaError(st.error or "the llama.cpp self-test failed")
    if remote and remote.get("fits") is False:
        from specquant_cli.errors import ResourceError

        raise ResourceError(remote["problem"])
    if broken:
        from specquant_cli.errors import FamilyError

        raise FamilyError(f"family {report['family']['name']}: {len(broken)} of {len(report['family']['variants'])} "
                          "variants broken: " + "; ".join(f"{role}: {why}" for role, why in broken.items()))


def _draft_candidates(fam) -> list[dict]:
    """For a family adopted from a model reference (hf:, ollama:, lmstudio:) without a sibling: the smaller models
    of its parent's vocabulary found on this machine (family.refs.draft_candidates), as --draft-model candidates."""
    from specquant_cli.family.refs import draft_candidates, is_reference
    from specquant_cli.settings import model_stores

    if not is_reference(fam.source) or fam.siblings() or not fam.renderings():
        return []
    found = draft_candidates(fam.path(PARENT_ROLE), model_stores(), lambda t: None)
    return [{"reference": f.reference, "type": f.file_type, "size_bytes": f.size_bytes} for f in found]


def _plans(facts, fam, calibration, n_ctx: int) -> dict:
    """The resident estimate of each plan the family can run (system.placement.plan_residents): the parent alone, a
    planner's policy (auto) with the drafts this machine's calibration lets it use (Planner.usable; every draft until
    it is calibrated), each draft beside the parent, each standard draft alone (lossy)."""
    from specquant_cli.family.roles import STANDARD_DRAFTS, draft_roles
    from specquant_cli.routing.policies import POLICIES
    from specquant_cli.system.placement import plan_residents

    drafts = draft_roles(fam.roles())
    planned = {name: [PARENT_ROLE, *(spec.planner().usable(drafts, calibration) if calibration else drafts)]
               for name, spec in POLICIES.items() if spec.planner is not None}
    plans = {"parent": [PARENT_ROLE], **planned,
             **{f"spec-{d}": [PARENT_ROLE, d] for d in drafts}, **{d: [d] for d in STANDARD_DRAFTS if d in drafts}}
    return plan_residents(facts, fam, plans, n_ctx)


def _rpc_report(endpoints: list[str], fam, n_ctx: int) -> Optional[dict]:
    """The --rpc workers' memory (probed; a worker that is down is an error), and with a family, the parent's
    layers over them (split by free memory) and whether it fits."""
    from specquant_cli.errors import ResourceError
    from specquant_cli.family.roles import PARENT_ROLE
    from specquant_cli.system import rpc

    if not endpoints:
        return None
    workers = rpc.probe_all(endpoints)
    rep: dict = {"workers": [{"endpoint": w.endpoint, "free_bytes": w.free, "total_bytes": w.total}
                             for w in workers]}
    if fam:
        from specquant_cli.system.placement import need

        parent = need(fam, PARENT_ROLE, n_ctx)
        shares = rpc.split_for(workers)
        layers = [round(parent.n_layers * s) for s in shares]
        rep["plan"] = {"parent": fam.parent_rendering, "parent_bytes": parent.total,
                       "layers": {w.endpoint: n for w, n in zip(workers, layers)},
                       "local": [r for r in fam.roles() if r != PARENT_ROLE]}
        try:
            rpc.require_remote_fit(workers, parent.total, f"the parent ({fam.parent_rendering})")
            rep["fits"] = True
        except ResourceError as e:
            rep["fits"], rep["problem"] = False, str(e)
    return rep


def _render_rpc(r: dict) -> None:
    t = Table(title="RPC workers (the parent runs there)")
    for col in ("endpoint", "free", "total", "parent layers"):
        t.add_column(col)
    layers = r.get("plan", {}).get("layers", {})
    for w in r["workers"]:
        t.add_row(w["endpoint"], gib(w["free_bytes"]), gib(w["total_bytes"]), str(layers.get(w["endpoint"], "-")))
    err.print(t)
    if "plan" in r:
        p = r["plan"]
        verdict = "fits" if r["fits"] else f"[red]does not fit[/]: {escape(r['problem'])}"
        err.print(f"plan: parent ({gib(p['parent_bytes'])} with KV cache) on the workers, "
                  f"{', '.join(p['local']) or 'nothing'} here: {verdict}")


def _render(report: dict, all_settings: bool = False) -> None:
    hw = report["hardware"]
    t = Table(title="hardware", show_header=False)
    if hw["gpus"]:
        for g in hw["gpus"]:
            t.add_row(f"GPU {g['index']}", f"{g['name']}: {gib(g['free_bytes'])} free of {gib(g['total_bytes'])}, "
                                          f"driver {g['driver']}")
    else:
        t.add_row("GPU", f"none ({hw['gpu_status']})")
    t.add_row("llama.cpp GPU offload", "yes" if hw["gpu_offload"] else "no (CPU build)")
    t.add_row("RAM", f"{gib(hw['ram_available'])} available of {gib(hw['ram_total'])}")
    t.add_row("cores", f"{hw['cores_physical']} physical, {hw['cores_logical']} logical")
    t.add_row("CPU features", " ".join(k for k, v in hw["cpu_flags"].items() if v) or "none of interest")
    _render_build(t, hw["build"])
    err.print(t)
    if report.get("advice"):
        err.print(f"[yellow]advice:[/] {report['advice']}")
    _render_settings(report["settings"], all_settings)
    if report.get("rpc"):
        _render_rpc(report["rpc"])
    if "placements" in report:
        p = Table(title=f"placement for {report['family']['name']}")
        for col in ("models", "mode", "n_gpu_layers", "RAM", "VRAM", "fits RAM", "why"):
            p.add_column(col)
        for name, pl in report["placements"].items():
            p.add_row(name, pl["mode"], ", ".join(f"{k}={v}" for k, v in pl["gpu_layers"].items()),
                      gib(pl["ram_bytes"]), gib(pl["vram_bytes"]), "yes" if pl["fits_ram"] else "[red]no[/]",
                      pl["reason"])
        err.print(p)
        v = Table(title=f"variants of {report['family']['name']}"
                        + (" (sha256 verified)" if report["family"]["sha256_verified"] else ""))
        for col in ("role", "status"):
            v.add_column(col)
        for role, st in report["family"]["variants"].items():
            v.add_row(role, "ok" if st["ok"] else f"[red]broken[/]: {escape(st['problem'])}")
        err.print(v)
        err.print(f"provenance: {report['family']['provenance']}")
        for c in report["family"]["draft_candidates"]:
            err.print(f"draft candidate: {c['reference']} ({c['type']}, {gib(c['size_bytes'])}; the parent's "
                      f"vocabulary): quantize --family {report['family']['name']} --draft-model {c['reference']}",
                      markup=False)
        if report.get("parent"):
            err.print(f"parent: {report['parent']['why']}", markup=False)
        if report.get("plans"):
            _render_plans(report["plans"], report["hardware"]["ram_available"])
        c = report.get("calibration")
        if c:
            calls = " · ".join(f"{n}: {s * 1000:.0f}" for n, s in c["parent_call_s"].items()
                               if int(n) in (1, 2, 4, 8, 16))
            steps = ", ".join(f"{r} {s * 1000:.0f}" for r, s in c["draft_step_s"].items())
            err.print(f"calibration ({c['measured_at']}): parent call ms by tokens {calls}; draft step ms {steps}",
                      markup=False)
        else:
            err.print("calibration: none for this machine yet (specquant calibrate, or the first auto answer)")


def _render_settings(settings: dict, all_settings: bool) -> None:
    """The settings table: those not at their default (given, or decided by this machine), or with --all every one."""
    shown = {k: v for k, v in settings.items() if all_settings or v["source"] != "default"}
    if not shown:
        err.print("settings: every one at its default (doctor --all lists them)", markup=False)
        return
    title = "settings" if all_settings else f"settings not at their default ({len(shown)} of {len(settings)}; --all)"
    s = Table(title=f"{title}: specquant.toml < SPECQUANT_* < flags; machine: decided here")
    for col in ("setting", "value", "from"):
        s.add_column(col)
    for key, v in shown.items():
        s.add_row(key, escape(str(v["value"])), escape(v["source"] + (f" ({v['from']})" if "from" in v else "")))
    err.print(s)


def _render_plans(plans: dict, available: int) -> None:
    t = Table(title=f"resident estimate per plan (weights + KV cache + compute), RAM available {gib(available)}")
    for col in ("plan", "models", "resident", "fits"):
        t.add_column(col)
    for name, p in plans.items():
        t.add_row(name, ", ".join(p["roles"]), gib(p["bytes"]),
                  "yes" if p["fits"] else "[red]no[/]: a planner does not pick it here")
    err.print(t)


def _render_build(t: Table, b: dict) -> None:
    t.add_row("llama.cpp build", f"llama-cpp-python {b['llama_cpp_python']}: "
                                 + (" ".join(b["cpu_features"]) or "no CPU features reported"))
    t.add_row("build kernels", f"AMX {'in' if b['amx'] else 'left out'}, CPU repack {'on' if b['repack'] else 'off'},"
                               f" RPC {'yes' if b['rpc'] else 'no'}")
    st = b.get("selftest")
    if st is None:
        t.add_row("self-test", "not run yet for this build and CPU (doctor --selftest; the first model load runs it)")
    elif st["ok"]:
        on = f" on the CPU and the GPU ({st['gpu']})" if st.get("gpu") else ""
        t.add_row("self-test", f"passed: {', '.join(st['types'])}{on} ({st['seconds']:.1f} s, {st['at']})")
    else:
        t.add_row("self-test", f"[red]failed[/]: {escape(st['error'] or '')}")
