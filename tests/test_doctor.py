import json
import types

import pytest

from specquant_cli.system import hardware, placement
from specquant_cli.system.hardware import GPU, Facts
from specquant_cli.system.placement import ModelNeed, place

from conftest import run_cli

GiB = 1 << 30


def facts(free_vram=None, offload=True, ram=16 * GiB):
    gpus = [GPU(0, "Fake RTX", 24 * GiB, free_vram, "550.1")] if free_vram is not None else []
    return Facts(gpus=gpus, gpu_status="ok" if gpus else "none", ram_total=ram, ram_available=ram,
                 cores_physical=8, cores_logical=16, cpu_flags={}, gpu_offload=offload)


PARENT = ModelNeed("f16", 3 * GiB, GiB // 8, 28)
DRAFT = ModelNeed("q4", GiB, GiB // 8, 28)


def test_plan_gpu_when_both_fit():
    p = place(facts(free_vram=10 * GiB), PARENT, DRAFT)
    assert p.mode == "gpu" and p.gpu_layers == {"f16": -1, "q4": -1} and p.ram_bytes == 0


def test_plan_hybrid_parent_on_gpu_draft_on_cpu():
    p = place(facts(free_vram=4 * GiB), PARENT, DRAFT)
    assert p.mode == "hybrid" and p.gpu_layers == {"f16": -1, "q4": 0}
    assert p.ram_bytes == DRAFT.total and p.fits_ram


def test_plan_hybrid_partial_offload_computes_layers():
    p = place(facts(free_vram=2 * GiB), PARENT, DRAFT)
    assert p.mode == "hybrid" and p.gpu_layers["q4"] == 0
    n = p.gpu_layers["f16"]
    per_layer = PARENT.weight_bytes / PARENT.n_layers
    usable = 2 * GiB - placement.VRAM_RESERVE
    assert 1 <= n < 28
    assert n * per_layer + PARENT.kv_bytes + placement.COMPUTE_OVERHEAD <= usable
    assert (n + 1) * per_layer + PARENT.kv_bytes + placement.COMPUTE_OVERHEAD > usable


def test_plan_cpu_without_gpu_and_with_cpu_only_build():
    assert place(facts(), PARENT, DRAFT).mode == "cpu"
    p = place(facts(free_vram=20 * GiB, offload=False), PARENT, DRAFT)
    assert p.mode == "cpu" and "without GPU offload" in p.reason
    assert hardware.advice(facts(free_vram=20 * GiB, offload=False)).endswith(hardware.REINSTALL_HINT)


def test_plan_reports_ram_shortfall():
    p = place(facts(ram=2 * GiB), PARENT, DRAFT)
    assert p.mode == "cpu" and not p.fits_ram


class _Mem:
    total, free = 24 * GiB, 20 * GiB


def fake_pynvml(count=1, fail_init=None):
    m = types.SimpleNamespace()
    m.shutdowns = 0

    def init():
        if fail_init:
            raise fail_init

    m.nvmlInit = init
    m.nvmlShutdown = lambda: setattr(m, "shutdowns", m.shutdowns + 1)
    m.nvmlSystemGetDriverVersion = lambda: b"550.54"
    m.nvmlDeviceGetCount = lambda: count
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: f"NVIDIA GeForce RTX 4090 #{h}"
    m.nvmlDeviceGetMemoryInfo = lambda h: _Mem()
    return m


def test_detect_gpus_through_fake_nvml():
    nv = fake_pynvml(count=2)
    gpus, status = hardware.detect_gpus(nv)
    assert status == "ok" and len(gpus) == 2 and nv.shutdowns == 1
    assert gpus[1].name.endswith("#1") and gpus[0].free_bytes == 20 * GiB and gpus[0].driver == "550.54"


def test_detect_gpus_without_driver_is_not_an_error():
    gpus, status = hardware.detect_gpus(fake_pynvml(fail_init=RuntimeError("NVML Shared Library Not Found")))
    assert gpus == [] and "no NVIDIA driver" in status
    assert hardware.detect_gpus(fake_pynvml(count=0)) == ([], "driver present, no GPU")


def test_doctor_real_machine_reports_cpu_placement(family_dir):
    r = run_cli(["doctor", "--json", "--family", str(family_dir)])
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    hw = rep["hardware"]
    import os

    import psutil

    assert hw["ram_total"] == psutil.virtual_memory().total and hw["cores_logical"] == os.cpu_count()
    assert hw["cpu_flags"] == hardware.cpu_flags()  # parsed from /proc/cpuinfo, not a fixed answer
    gpus, _ = hardware.detect_gpus()
    assert [g["name"] for g in hw["gpus"]] == [g.name for g in gpus]  # whatever NVML sees here
    usable = bool(gpus) and hw["gpu_offload"]
    modes = {p["mode"] for p in rep["placements"].values()}
    assert modes == {"cpu"} if not usable else "cpu" not in modes or len(modes) > 1
    assert set(rep["placements"]) >= {"parent+q4", "parent+q8", "parent"}
    assert all(p["fits_ram"] for p in rep["placements"].values())


def test_doctor_human_form_goes_to_stderr(family_dir):
    r = run_cli(["doctor", "--family", str(family_dir)])
    assert r.exit_code == 0 and r.stdout == ""
    assert "placement for smollm2-135m" in r.stderr and "parent+q4" in r.stderr


def test_doctor_missing_family_is_one_line():
    r = run_cli(["doctor", "--family", "/nonexistent/fam"])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "specquant pull" in r.stderr


def test_require_fit_places_parent_and_draft_together(family):
    from specquant_cli.errors import ResourceError
    from specquant_cli.system.placement import require_fit

    pl = require_fit(facts(free_vram=20 * GiB), family, ["parent", "q4"], 4096)
    assert pl.mode == "gpu" and pl.gpu_layers == {"parent": -1, "q4": -1}
    pl = require_fit(facts(), family, ["parent", "q4", "q8"], 4096)
    assert pl.mode == "cpu" and pl.gpu_layers["parent"] == 0
    with pytest.raises(ResourceError, match="GiB available"):
        require_fit(facts(ram=GiB // 4), family, ["parent", "q4"], 4096)


def test_a_role_named_before_f16_is_never_placed_as_the_parent(family, tmp_path):
    """Roles come to placement in any order (a sorted list put `d35` first): the F16 is the parent all the
    same, so on a GPU that holds one model it is the F16 that gets it."""
    from specquant_cli.family.manifest import Family
    from specquant_cli.routing.policies import all_roles
    from specquant_cli.system.placement import require_fit

    m = json.loads((family.root / "manifest.json").read_text())
    m["variants"]["d35"] = dict(m["variants"]["q4"])
    fam = Family(family.root, m)  # the same files, one more role record (nothing written)
    parent_only = placement.need(fam, "parent", 4096).total + placement.VRAM_RESERVE + GiB // 16  # not both
    for roles in (["d35", "parent"], ["parent", "d35"]):
        pl = require_fit(facts(free_vram=parent_only), fam, roles, 4096)
        assert pl.mode == "hybrid" and pl.gpu_layers == {"parent": -1, "d35": 0}, (roles, pl)
    assert all_roles(["parent", "spec-q4", "spec-q8"])[0] == "parent"


def test_doctor_shows_only_the_settings_not_at_their_default_unless_all(tmp_path):
    """The settings table lists what was given or decided here; --all lists every setting; --json keeps them all."""
    env = {"SPECQUANT_GAMMA": "7", "COLUMNS": "200"}
    r = run_cli(["doctor", "--ctx", "2048"], env=env)
    assert r.exit_code == 0, r.stderr
    assert "decoding.gamma" in r.stderr and "SPECQUANT_GAMMA" in r.stderr  # every setting's view: given by a variable
    assert "runtime.ctx" in r.stderr and "--ctx" in r.stderr
    assert "serving.port" not in r.stderr and "not at their default" in r.stderr
    r = run_cli(["doctor", "--ctx", "2048", "--all"], env=env)
    assert r.exit_code == 0 and "serving.port" in r.stderr and "serving.queue" in r.stderr
    r = run_cli(["doctor", "--ctx", "2048", "--json"], env=env)
    settings = json.loads(r.stdout)["settings"]
    assert settings["serving.port"]["source"] == "default" and settings["runtime.ctx"]["source"] == "flag"
    assert settings["decoding.gamma"] == {"value": 7, "source": "env", "from": "SPECQUANT_GAMMA"}
