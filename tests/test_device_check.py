"""The GPU device check, prepared here: the set-up's refusal of a CUDA build without nvcc, the models the check makes
(a cut of a real GGUF, a random model of any shape), the self-test's GPU leg, and the check's CPU run end to end
(scripts/device_check.sh --cpu --quick: the same steps the device runs, with CUDA off)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import FAMILY_DIR, REPO


def _bash(script: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=120)


# -- the set-up ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "cuda"), [("-DGGML_CUDA=on", True), ("-DGGML_VULKAN=on -DGGML_CUDA=ON", True),
                                              ("-DGGML_CUDA:BOOL=1", True), ("-DGGML_CUDA=yes", True),
                                              ("-DGGML_CUDA=off", False), ("-DGGML_CUDA=0", False),
                                              ("-DGGML_VULKAN=on", False), ("", False)])
def test_wants_cuda_reads_cmake_truth(flags, cuda):
    r = _bash(f'source scripts/_build.sh; wants_cuda "{flags}"')
    assert (r.returncode == 0) is cuda, r.stderr


def _fake_repo(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the set-up scripts in a folder of their own, with a .venv whose python only records that it was
    called: the set-up run there can build nothing, whatever it does."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("_setup.sh", "_build.sh"):
        shutil.copy(REPO / "scripts" / name, repo / "scripts" / name)
    shutil.copy(REPO / "pyproject.toml", repo / "pyproject.toml")
    calls = tmp_path / "python-calls"
    venv_py = repo / ".venv" / "bin" / "python"
    venv_py.parent.mkdir(parents=True)
    venv_py.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\nexit 1\n')
    venv_py.chmod(0o755)
    return repo, calls


def test_setup_refuses_cuda_without_nvcc_before_touching_the_venv(tmp_path):
    repo, calls = _fake_repo(tmp_path)
    before = sorted((p.relative_to(repo), p.stat().st_mtime_ns) for p in (repo / ".venv").rglob("*"))
    bin_dir = tmp_path / "bin"  # a PATH with bash and the basics, and no nvcc
    bin_dir.mkdir()
    for tool in ("bash", "cat", "sha256sum", "cut", "grep", "uname", "dirname", "cc", "tr"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    r = subprocess.run(["bash", str(repo / "scripts" / "_setup.sh")], capture_output=True, text=True, timeout=60,
                       env={"PATH": str(bin_dir), "HOME": str(tmp_path), "SPECQUANT_CMAKE_ARGS": "-DGGML_CUDA=on",
                            "CUDA_PATH": str(tmp_path / "no-cuda")})  # not this machine's /usr/local/cuda
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "SPECQUANT_CMAKE_ARGS" in lines[0] and "no nvcc" in lines[0], r.stderr
    assert not calls.exists()  # nothing of the environment was run, let alone rebuilt
    assert sorted((p.relative_to(repo), p.stat().st_mtime_ns) for p in (repo / ".venv").rglob("*")) == before


def test_setup_goes_on_to_the_build_when_nvcc_is_there(tmp_path):
    """The same run with an nvcc at $CUDACXX passes the check (and stops at the recording python instead)."""
    repo, calls = _fake_repo(tmp_path)
    nvcc = _fake_nvcc(tmp_path)
    r = subprocess.run(["bash", str(repo / "scripts" / "_setup.sh")], capture_output=True, text=True, timeout=60,
                       env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CUDACXX": str(nvcc),
                            "CUDA_PATH": str(tmp_path / "no-cuda"), "SPECQUANT_CMAKE_ARGS": "-DGGML_CUDA=on"})
    assert "no nvcc" not in r.stderr
    assert calls.exists()


def _fake_nvcc(tmp_path: Path) -> Path:
    nvcc = tmp_path / "cuda" / "nvcc"
    nvcc.parent.mkdir(exist_ok=True)
    nvcc.write_text("#!/bin/sh\nexit 0\n")
    nvcc.chmod(0o755)
    return nvcc


def test_the_cuda_check_refuses_a_machine_without_nvcc_or_gpu(tmp_path):
    """scripts/device_check.sh without --cpu: one line and exit 1 where there is no nvcc, or no NVIDIA GPU."""
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "CUDA_PATH": str(tmp_path / "no-cuda"), "OUT": str(out)}
    r = _bash("bash scripts/device_check.sh", env)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no nvcc found" in r.stderr, r.stderr
    r = _bash("bash scripts/device_check.sh", {**env, "CUDACXX": str(_fake_nvcc(tmp_path))})
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no NVIDIA GPU here" in r.stderr, r.stderr
    assert not out.exists()  # refused before anything was made


# -- the models -----------------------------------------------------------------------------------------------------
def test_cut_layers_keeps_the_blocks_asked_for_renumbered(tmp_path):
    import gguf

    from specquant_cli.backend.tiny import write_tiny_llama
    from specquant_cli.errors import ModelFileError
    from specquant_cli.family.gguf_read import read_info
    from specquant_cli.family.gguf_types import PROVENANCE_KEY
    from specquant_cli.family.gguf_write import cut_layers

    src = write_tiny_llama(tmp_path / "four.gguf", layers=4, layer_gain=0.5)
    dst = tmp_path / "cut.gguf"
    cut_layers(src, dst, (0, 3), "kept 0 and 3")
    info = read_info(dst)
    assert info.hparams["block_count"] == 2 and info.provenance == "kept 0 and 3"
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    old = {t.name: np.asarray(t.data) for t in a.tensors}
    new = {t.name: np.asarray(t.data) for t in b.tensors}
    assert sorted(new) == sorted(n for n in old if not n.startswith(("blk.2.", "blk.3.")))  # blk.3 is blk.1 now
    assert np.array_equal(new["blk.1.ffn_up.weight"], old["blk.3.ffn_up.weight"])
    assert np.array_equal(new["token_embd.weight"], old["token_embd.weight"])
    assert b.fields[PROVENANCE_KEY].contents() == "kept 0 and 3"
    with pytest.raises(ModelFileError, match="cannot keep blocks"):
        cut_layers(src, tmp_path / "bad.gguf", (0, 4), "x")


def test_random_model_has_its_shape_and_wanders(tmp_path):
    """The demo-shape model, small: llama.cpp loads the qwen2 layout (Q/K/V biases, 2 KV heads, its own head), and a
    greedy answer wanders from token to token instead of repeating one."""
    from specquant_cli.backend.llama import Context, Model, llama_log_to
    from specquant_cli.backend.tiny import Shape, write_random_model
    from specquant_cli.decoding.engine import Engine
    from specquant_cli.decoding.stream import generate_text
    from specquant_cli.family.gguf_read import read_info

    shape = Shape(arch="qwen2", dim=128, layers=2, heads=4, kv_heads=2, ff=256, vocab=1024, qkv_bias=True)
    path = write_random_model(tmp_path / "r.gguf", shape)
    info = read_info(path)
    assert info.arch == "qwen2" and info.n_params == shape.n_params
    assert info.hparams["attention.head_count_kv"] == 2 and info.hparams["block_count"] == 2
    with llama_log_to(None), Model(path) as m:
        ctx = Context(m, n_ctx=128, n_threads=1)
        tokens = generate_text(Engine(ctx), list(range(3, 19)), 16)[1]
        ctx.close()
    assert len(tokens) == 16 and len(set(tokens)) >= 8


def test_demo_shape_is_the_demo_parents():
    """Qwen2.5-Coder-1.5B's widths and counts (1.54B parameters with a tied head; its own head adds vocab x dim)."""
    from specquant_cli.bench.device import DEMO_SHAPE

    s = DEMO_SHAPE
    assert (s.arch, s.dim, s.layers, s.heads, s.kv_heads, s.ff, s.vocab) == ("qwen2", 1536, 28, 12, 2, 8960, 151936)
    assert round((s.n_params - s.vocab * s.dim) / 1e9, 2) == 1.54


# -- the self-test's GPU leg --------------------------------------------------------------------------------------
def test_selftest_child_checks_the_gpu_leg_against_the_cpu(tmp_path):
    """On this CPU build a "GPU" decode keeps every layer on the CPU, so the two legs agree exactly; the agreement
    rule still runs, and the child names no GPU here."""
    from specquant_cli.backend import selftest_child
    from specquant_cli.backend.llama import llama_log_to
    from specquant_cli.backend.tiny import write_tiny_llama

    with llama_log_to(None):
        base = write_tiny_llama(tmp_path / "b.gguf", dim=256, ff=512, vocab=512, scale=0.05, merges=("<t1> <t2>",))
        assert selftest_child._check_type("q8_0", base, tmp_path, gpu=True) is None
        assert selftest_child.gpu_names() == []


def test_selftest_records_the_gpu_the_child_names():
    from specquant_cli.backend import selftest

    assert selftest._gpu_of("gpu CUDA0\nok f16\nok bf16\n") == "CUDA0"
    assert selftest._gpu_of("ok f16\n") is None
    r = selftest.Result(key="k", ok=True, types={t: "ok" for t in selftest.TYPES}, gpu="CUDA0")
    assert r.to_dict()["gpu"] == "CUDA0"


# -- the check's steps and report -----------------------------------------------------------------------------------
def test_a_failed_build_is_reported_with_every_step_skipped(tmp_path):
    from specquant_cli.bench import device

    env = {"build": {"state": "failed after 42 s: nvcc fatal: unsupported gpu architecture", "seconds": 42}}
    rc = device.run(tmp_path / "out", tmp_path / "work", "cuda", True, 100, env, None, None)
    rep = json.loads((tmp_path / "out" / device.REPORT).read_text())
    assert rc == 1 and rep["verdict"] == "fail"
    assert {s["status"] for s in rep["steps"].values()} == {"skipped"}
    assert "did not build" in rep["steps"]["selftest"]["why"]
    md = (tmp_path / "out" / device.SUMMARY).read_text()
    assert "failed after 42 s" in md and "| selftest | skipped |" in md


def test_no_time_left_skips_the_steps_instead_of_starting_them(tmp_path):
    from specquant_cli.bench import device

    rc = device.run(tmp_path / "out", tmp_path / "work", "cpu", True, 0, {}, None, None)
    rep = json.loads((tmp_path / "out" / device.REPORT).read_text())
    assert rc == 1 and all(s["status"] == "skipped" for s in rep["steps"].values())
    assert "s left" in rep["steps"]["selftest"]["why"]


# What specquant depends on that the device's Python does not have (its package list: docs/gpu.md), and gguf and
# diskcache, which travel as wheels: the check must run without importing any of the former. (pydantic is absent
# there too, but typer here needs it; where the device's typer does too, the check runs its steps in process.)
NOT_ON_DEVICE = ("spacy", "thinc", "en_core_web_sm", "fastapi", "starlette", "uvicorn", "llguidance", "jsonschema",
                 "openai", "selenium")
BLOCKER = f"""import sys
class _NotOnDevice:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {NOT_ON_DEVICE!r}:
            raise ImportError(f"{{name}} is not on the GPU device")
sys.meta_path.insert(0, _NotOnDevice())
"""


@pytest.mark.slow  # every step on real models: about a minute on 2 cores
def test_device_check_script_runs_on_the_cpu(tmp_path):
    """scripts/device_check.sh --cpu --quick: every step, as the device runs them, with CUDA off and none of the
    packages the device lacks importable; the JSON and markdown reports say what each found."""
    from specquant_cli.bench import device

    assert (FAMILY_DIR / "manifest.json").is_file()
    out, work, site = tmp_path / "out", tmp_path / "work", tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    r = subprocess.run(["bash", "scripts/device_check.sh", "--cpu", "--quick", "--budget", "600"], cwd=REPO,
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OUT": str(out), "SPECQUANT_DEVICE_WORK": str(work), "PYTHONPATH": str(site)})
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((out / "device-check.json").read_text())
    assert rep["verdict"] == "pass" and rep["mode"] == "cpu"
    steps = rep["steps"]
    # "cut": the smollm2 cut made here, when build/device (scripts/device_prepare.sh) does not hold it already
    assert [s for s in steps if s != "cut"] == ["selftest", "models-cut", "identity-cut", "models-demo", "doctor",
                                                 "calls", "identity-demo"]
    assert all(s["status"] == "ok" for s in steps.values()), steps
    assert steps["selftest"]["selftest"]["ok"] and steps["selftest"]["selftest"]["gpu"] is None
    # the command line, as users run it
    assert (steps["selftest"]["via"], steps["doctor"]["via"]) == ("specquant doctor --selftest", "specquant doctor")
    assert set(steps["doctor"]["doctor"]["placements"]) >= {"parent", "parent+q4", "parent+q8"}
    rows = steps["calls"]["rows"]
    assert set(rows) == {"parent@cpu", "q8@cpu", "q4@cpu"}
    assert all(set(row["call_s"]) == {"1", "2", "4", "8", "16"} for row in rows.values())
    assert set(steps["calls"]["c"]) == {"q8@cpu", "q4@cpu"}
    for key in ("identity-cut", "identity-demo"):
        runs = steps[key]["runs"]
        assert [(x["drafter"], x["drafts_on"]) for x in runs] == [("q8", "cpu"), ("q4", "cpu"), ("ngram", "-")]
        assert all(x["unexplained"] == 0 and x["answers"] == device.QUICK.prompts for x in runs)
        assert sum(x["drafted"] for x in runs) > 0
    md = (out / "device-check.md").read_text()
    assert "# GPU device check (cpu, quick): pass" in md and "## Call costs" in md and "## Greedy identity" in md
    assert "verdict: pass" in r.stdout
