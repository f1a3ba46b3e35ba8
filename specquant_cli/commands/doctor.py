from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from specquant_cli.commands.options import FAMILY_ENV, FamilyOpt, JsonOpt, load_family
from specquant_cli.console import err, gib, out_json


def register(app: typer.Typer) -> None:
    app.command("doctor", help="What this machine can run: GPUs (NVML), host (psutil), and a placement plan.")(doctor)


def doctor(
    family: Optional[Path] = FamilyOpt,
    n_ctx: int = typer.Option(4096, "--ctx", min=256, help="Context size the plan reserves KV cache for"),
    json_out: bool = JsonOpt,
) -> None:
    from specquant_cli.system import hardware
    from specquant_cli.system.placement import family_plans

    facts = hardware.detect()
    report = {"hardware": facts.to_dict(), "advice": hardware.advice(facts)}
    if family is not None or os.environ.get(FAMILY_ENV):
        fam = load_family(family)
        report["family"] = {"name": fam.name, "root": str(fam.root), "provenance": fam.provenance}
        report["placements"] = family_plans(facts, fam, n_ctx)
        from specquant_cli.system import calibration as cal

        c = cal.load(fam.root, cal.fingerprint(facts))
        report["calibration"] = c.to_dict() if c else None
    if json_out:
        out_json(report)
        return
    _render(report)


def _render(report: dict) -> None:
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
    err.print(t)
    if report.get("advice"):
        err.print(f"[yellow]advice:[/] {report['advice']}")
    if "placements" in report:
        p = Table(title=f"placement for {report['family']['name']}")
        for col in ("models", "mode", "n_gpu_layers", "RAM", "VRAM", "fits RAM", "why"):
            p.add_column(col)
        for name, pl in report["placements"].items():
            p.add_row(name, pl["mode"], ", ".join(f"{k}={v}" for k, v in pl["gpu_layers"].items()),
                      gib(pl["ram_bytes"]), gib(pl["vram_bytes"]), "yes" if pl["fits_ram"] else "[red]no[/]",
                      pl["reason"])
        err.print(p)
        err.print(f"provenance: {report['family']['provenance']}")
        c = report.get("calibration")
        if c:
            calls = " · ".join(f"{n}: {s * 1000:.0f}" for n, s in c["parent_call_s"].items()
                               if int(n) in (1, 2, 4, 8, 16))
            steps = ", ".join(f"{r} {s * 1000:.0f}" for r, s in c["draft_step_s"].items())
            err.print(f"calibration ({c['measured_at']}): parent call ms by tokens {calls}; draft step ms {steps}",
                      markup=False)
        else:
            err.print("calibration: none for this machine yet (specquant calibrate, or the first auto answer)")
