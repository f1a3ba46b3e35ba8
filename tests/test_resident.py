"""Memory on consumer hardware and the user's own quantized GGUF as parent: a quantized parent kept as it is (and
what is refused), `pull` of a file here, only the roles a plan can use loaded, a draft that does not fit left out of
planning (and said), the bench holding one policy's models at a time and measuring each one's peak, the resident
estimate per plan in doctor, and idle drafts released."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hostile_util import assert_clean_error, snapshot

from specquant_cli.decoding.gamma import verify_shape

from conftest import run_cli


@pytest.fixture
def q8_file(family, tmp_path) -> Path:
    """A copy of the demo family's Q8_0 file: a quantized GGUF of the user's (a copy, since the family made of it
    holds a hard link, and a test changes it)."""
    dst = tmp_path / "mine" / "my-model-Q8_0.gguf"
    dst.parent.mkdir()
    shutil.copy(family.path("q8"), dst)
    return dst


def _chat(family: Path, policy: str, max_tokens: int, prompt: str):
    """A greedy chat answer; `--parent fastest` because the tests pin F16, which a quantized parent's family lacks."""
    return run_cli(["chat", "--parent", "fastest", "--family", str(family), "--policy", policy, "--max-tokens",
                    str(max_tokens), prompt])


def _manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


# -- a quantized parent, as it is --------------------------------------------------------------------------------------
def test_a_quantized_gguf_is_the_parent_as_it_is(q8_file, tmp_path):
    from specquant_cli.fsutil import sha256_file

    out = tmp_path / "fam"
    r = run_cli(["quantize", str(q8_file), "--out", str(out), "--threads", "2"])
    assert r.exit_code == 0, r.stderr
    assert "lossless output is that file's own" in r.stderr and "no model draft" in r.stderr
    m = _manifest(out)
    assert list(m["variants"]) == ["own"]
    own = m["variants"]["own"]
    assert own["file_type"] == "Q8_0" and own["type"] == "q8_0"
    assert sha256_file(out / own["path"]) == sha256_file(q8_file) == own["sha256"]
    assert "lossless relative to that file you run" in m["notes"]["parent"]
    # the parent is that file: the family's parent answers as the file does, and so do its suffix drafts
    a = _chat(out, "parent", 12, "Name three colours.")
    b = _chat(out, "suffix", 12, "Name three colours.")
    assert a.exit_code == 0 and b.exit_code == 0, (a.stderr, b.stderr)
    assert a.stdout == b.stdout and a.stdout.strip()


def test_drafts_are_quantized_from_a_quantized_parent_only_as_asked(q8_file, tmp_path):
    out = tmp_path / "fam"
    before = snapshot(tmp_path)
    r = run_cli(["quantize", str(q8_file), "--out", str(out), "--types", "q4_0"])
    assert_clean_error(r, 1, "is opt-in")
    assert snapshot(tmp_path) == before
    r = run_cli(["quantize", str(q8_file), "--out", str(out), "--types", "q4_0", "--allow-requantize",
                 "--threads", "2"])
    assert r.exit_code == 0, r.stderr
    m = _manifest(out)
    assert set(m["variants"]) == {"own", "q4"} and m["variants"]["q4"]["type"] == "q4_0"
    # lossless against the Q8_0 file: q4 drafts, the file verifies, the greedy answer is the file's own
    p = _chat(out, "parent", 24, "Count from one to ten.")
    s = _chat(out, "spec-q4", 24, "Count from one to ten.")
    assert p.exit_code == 0 and s.exit_code == 0, (p.stderr, s.stderr)
    assert p.stdout == s.stdout


def test_a_quantized_parent_gets_no_16_bit_rendering(q8_file, tmp_path):
    before = snapshot(tmp_path)
    assert_clean_error(run_cli(["quantize", str(q8_file), "--out", str(tmp_path / "f"), "--types", "f16",
                                "--allow-requantize"]), 1, "would not be the file you run")
    assert snapshot(tmp_path) == before


def test_a_parent_of_a_type_llama_cpp_does_not_name_is_refused(q8_file, tmp_path):
    import gguf

    reader = gguf.GGUFReader(str(q8_file), "r+")
    field = reader.fields["general.file_type"]
    field.parts[field.data[0]][0] = 1234
    del reader
    before = snapshot(tmp_path)
    r = run_cli(["quantize", str(q8_file), "--out", str(tmp_path / "f")])
    assert_clean_error(r, 1, "its weights are unknown (1234), not a type specquant takes as a parent")
    assert snapshot(tmp_path) == before


def test_a_split_gguf_is_refused_as_a_base_and_as_a_sibling(tmp_path, family):
    from hostile_util import tiny_llama

    part = tiny_llama(tmp_path / "part-00001-of-00002.gguf", split=(0, 2))
    before = snapshot(tmp_path)
    assert_clean_error(run_cli(["quantize", str(part), "--out", str(tmp_path / "f")]), 1,
                       "part 1 of a model split into 2 files", "llama-gguf-split --merge")
    assert_clean_error(run_cli(["quantize", "--draft-model", str(part), "--out", str(family.root)]), 1,
                       "part 1 of a model split into 2 files")
    assert snapshot(tmp_path) == before


def test_a_parent_changed_on_disk_after_the_family_was_made_is_refused(q8_file, tmp_path):
    out = tmp_path / "fam"
    assert run_cli(["quantize", str(q8_file), "--out", str(out)]).exit_code == 0
    fam_file = out / q8_file.name
    assert os.path.samefile(fam_file, q8_file)  # a hard link: the user's file is the family's
    st = q8_file.stat()
    os.utime(q8_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, or copied: the same content is accepted
    assert run_cli(["doctor", "--parent", "fastest", "--family", str(out)]).exit_code == 0
    with open(q8_file, "r+b") as f:  # the user rewrites their file in place, same size
        f.seek(st.st_size - 64)
        byte = f.read(1)
        f.seek(st.st_size - 64)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(q8_file, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    before = snapshot(out)
    r = run_cli(["chat", "--parent", "fastest", "--family", str(out), "--max-tokens", "4", "hi"])
    assert_clean_error(r, 1, "changed on disk after the family was made")
    assert_clean_error(run_cli(["doctor", "--parent", "fastest", "--family", str(out)]), 1, "changed on disk")
    assert snapshot(out) == before
    # made again of the file as it is now, it checks out
    assert run_cli(["quantize", str(q8_file), "--out", str(out)]).exit_code == 0
    assert run_cli(["doctor", "--parent", "fastest", "--family", str(out)]).exit_code == 0


def test_pull_makes_the_family_of_a_file_here_and_keeps_it(q8_file, tmp_path):
    models = tmp_path / "models"
    r = run_cli(["pull", str(q8_file), "--models-dir", str(models)])
    assert r.exit_code == 0, r.stderr
    said = " ".join(r.stderr.split())  # however the console wraps it
    assert "built" in said and "lossless relative to the file you run" in said, r.stderr
    root = models / "my-model-Q8_0"
    assert list(_manifest(root)["variants"]) == ["own"]
    again = run_cli(["pull", str(q8_file), "--models-dir", str(models)])
    assert again.exit_code == 0 and "nothing rebuilt" in " ".join(again.stderr.split()), again.stderr
    assert_clean_error(run_cli(["pull", str(tmp_path / "gone.gguf"), "--models-dir", str(models)]), 1,
                       "no such model file")


# -- only what a plan can use ------------------------------------------------------------------------------------------
def _costs():
    from specquant_cli.system.calibration import Calibration

    return Calibration({n: 0.08 * verify_shape(n) for n in range(1, 17)}, {"q4": 0.03, "q8": 0.07},
                       {"parent": 0.01, "q4": 0.013, "q8": 0.02}, agreement={"q4": 0.95, "q8": 0.99})


def test_auto_uses_only_drafts_that_can_pay_here():
    """q8's step is 0.88 of the parent's one-token call: no draft length makes it pay, so auto never loads it."""
    from specquant_cli.routing.auto import AutoPlanner, usable_roles

    assert usable_roles(("q4", "q8"), _costs()) == ("q4",)
    assert AutoPlanner().usable(("q8",), _costs()) == ()


def test_auto_loads_no_draft_up_front():
    from specquant_cli.routing.policies import all_roles

    assert all_roles(["auto"]) == ["parent"]
    assert all_roles(["auto", "spec-q8"]) == ["parent", "q8"]


def _small_facts(family, spare: int):
    """This machine's facts with just room for the parent and `spare` bytes beside it."""
    import dataclasses

    from specquant_cli.system.hardware import detect
    from specquant_cli.system.placement import RAM_HEADROOM, need

    parent = need(family.bind("f16"), "parent", 512).total
    return dataclasses.replace(detect(), ram_available=int((parent + spare) / RAM_HEADROOM))


def test_a_draft_that_does_not_fit_is_not_planned_and_the_plan_says_so(family):
    from specquant_cli.session import open_session
    from specquant_cli.settings import SessionSettings

    session = open_session(SessionSettings(family=family.root, n_ctx=512, facts=_small_facts(family, 1 << 20)))
    try:
        _, plan = session.plan("Summarize this: the cat sat on the mat.", "auto")
        left = {d["role"]: d["why"] for d in plan.left_out}
        assert set(left) == {"q4", "q8"}
        assert "does not fit: models parent, q4 need" in left["q4"] and "GiB available" in left["q4"]
        assert plan.drafter in (None, "suffix", "ngram")
        assert "left_out" in plan.to_dict()
    finally:
        session.runtime.close()
    roomy = open_session(SessionSettings(family=family.root, n_ctx=512))
    try:
        assert roomy.plan("Summarize this: the cat sat on the mat.", "auto")[1].left_out == ()
    finally:
        roomy.runtime.close()


def test_doctor_gives_each_plans_resident_estimate_beside_free_memory(family):
    r = run_cli(["doctor", "--family", str(family.root), "--json"])
    assert r.exit_code == 0, r.stderr
    plans = json.loads(r.stdout)["plans"]
    assert plans["parent"]["roles"] == ["parent"] and plans["q4"]["roles"] == ["q4"]
    assert plans["spec-q4"]["bytes"] > plans["parent"]["bytes"] > plans["q4"]["bytes"] > 0
    assert plans["auto"]["roles"][0] == "parent" and all(p["fits"] is True for p in plans.values())
    text = run_cli(["doctor", "--family", str(family.root)])
    assert "resident estimate per plan" in text.stderr


def test_the_bench_holds_one_policys_models_at_a_time(family):
    from specquant_cli.bench.runner import hold
    from specquant_cli.runtime import Runtime

    rt = Runtime.open(family.bind("f16"), n_ctx=512)
    try:
        rt.pool.ensure(["parent", "q8"])
        hold(rt, "spec-q4", warmup=0)
        assert rt.pool.loaded() == ["parent", "q4"]
        hold(rt, "parent", warmup=0)
        assert rt.pool.loaded() == ["parent"]
    finally:
        rt.close()


def test_an_idle_draft_is_released_and_loaded_again_when_a_plan_picks_it(family):
    from specquant_cli.session import open_session
    from specquant_cli.settings import SessionSettings

    session = open_session(SessionSettings(family=family.root, n_ctx=512, policy="spec-q4", max_tokens=12))
    try:
        first = "".join(r.text for r in session.ask("Name a fruit.", remember=False)[1])
        assert "q4" in session.runtime.pool.loaded()
        assert session.runtime.pool.release_idle(idle_s=3600) == []  # used just now
        assert session.runtime.pool.release_idle(idle_s=0.0) == ["q4"]
        assert session.runtime.pool.loaded() == ["parent"]
        again = "".join(r.text for r in session.ask("Name a fruit.", remember=False)[1])
        assert again == first and "q4" in session.runtime.pool.loaded()
    finally:
        session.runtime.close()


def test_peak_resident_memory_starts_again_when_reset():
    import mmap

    from specquant_cli.system import memory

    assert memory.reset_peak()
    base = memory.peak_bytes()
    block = mmap.mmap(-1, 64 << 20)  # anonymous pages of their own, returned to the kernel when closed
    block.write(b"x" * (64 << 20))  # touched: resident
    assert memory.peak_bytes() >= base + (60 << 20)
    block.close()
    assert memory.reset_peak()
    assert memory.peak_bytes() < base + (32 << 20)
    assert memory.run_peak_bytes() >= base + (60 << 20)  # the whole run's peak keeps what the reset cleared


def test_sigterm_stops_the_bench_inside_an_answer(family_dir, tmp_path):
    """A stopped answer ends the bench (exit 130), not just that answer: the runs after it never start."""
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "SPECQUANT_PARENT": "f16", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "specquant_cli.cli", "bench", "prompts", "--family",
                             str(family_dir), "--policies", "parent,spec-q4", "--max-tokens", "256", "--warmup", "0",
                             "--json-file", str(tmp_path / "out.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "[1/" not in line and time.monotonic() < deadline:  # the first run is done: the second has begun
            line = proc.stderr.readline()
        assert "[1/" in line
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "[3/" not in err and "Traceback" not in err and not (tmp_path / "out.json").exists()
