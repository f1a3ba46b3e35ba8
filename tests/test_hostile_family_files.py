"""Nothing cut is called complete, no family broken by a link, nothing on disk trusted on its word.

By class: a draft model given through a symbolic link is stored as the file it names (the family loads, moved or
not) and a link inside a family is refused; plans count the parent itself in the fit, and a reason's numbers read
as not fitting; /health lists only the KV caches loaded now; every input path is opened one way (a FIFO, a device, a
folder refused in one line, never read or waited on); a family's files are checked by content (a fingerprint), not by
a modification time the user can set back; a header's claimed type is borne out by the weights; re-quantizing never
gives a draft of the parent's own bits; a sibling's hyperparameters come from its file; the parent's own file is no
sibling; and the messages of a deep dataset line (tests/test_hostile_inputs.py), a long sibling name, a chain with its
roles swapped, a split's later part, and a family made again or pulled over another.

Real files throughout: tiny GGUFs quantized by llama.cpp's own quantizer (backend.tiny), the real demo family where a
model must load, the CLI in-process (CliRunner) or as a subprocess, a real server driven by the `openai` client."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hostile_util import assert_clean_error, claim_file_type, cli, copy_family, snapshot, tiny_llama

from conftest import REPO

# A tiny network big enough that its files pass the fingerprint's first MiB (its sampled blocks are used).
SHAPE = {"dim": 256, "ff": 512, "layers": 4, "vocab": 1024}


def _manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def _edit(root: Path, fn) -> None:
    m = _manifest(root)
    fn(m)
    (root / "manifest.json").write_text(json.dumps(m, indent=1))


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """Real GGUFs: an F16 base and its Q8_0 and Q4_0 files (llama.cpp's quantizer), a Q8_0 of another network of the
    same shape (same size: what rewrites the first in place), a smaller network of the same vocabulary (a sibling),
    and a family of the base named `demo` (the name a pull gives), in a folder of another name."""
    from specquant_cli.family.quantize import parse_types, quantize_family

    d = tmp_path_factory.mktemp("family-files")
    base = tiny_llama(d / "base-f16.gguf", **SHAPE)
    other = tiny_llama(d / "other-f16.gguf", seed=7, **SHAPE)
    quantize_family(base, d / "q", parse_types("q8_0,q4_0"), threads=1)
    quantize_family(other, d / "o", parse_types("q8_0"), threads=1)
    sibling = tiny_llama(d / "small-f16.gguf", seed=3, **{**SHAPE, "layers": 2})
    quantize_family(base, d / "fam", parse_types("q4_0,q8_0,f16"), threads=1, family_name="demo")
    return {"base": base, "q8": d / "q" / "q-q8_0.gguf", "q4": d / "q" / "q-q4_0.gguf",
            "other_q8": d / "o" / "o-q8_0.gguf", "sibling": sibling, "fam": d / "fam"}


@pytest.fixture
def fam(made, tmp_path) -> Path:
    return copy_family(made["fam"], tmp_path / "fam")


@pytest.fixture
def mine(made, tmp_path) -> Path:
    """The user's own Q8_0 file (a copy: the family made of it holds a hard link, and a test changes it)."""
    (tmp_path / "mine").mkdir()
    return Path(shutil.copy(made["q8"], tmp_path / "mine" / "my-model-Q8_0.gguf"))


# -- data loss: a link is never stored in a family ---------------------------------------------------------------------
@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_a_draft_model_given_through_a_link_is_stored_as_the_file_it_names(fam, made, tmp_path, how):
    from specquant_cli.family.manifest import Family

    (tmp_path / "models").mkdir()
    real = Path(shutil.copy(made["sibling"], tmp_path / "models" / "small.gguf"))
    link = tmp_path / "small-link.gguf"
    link.symlink_to("models/small.gguf" if how == "relative" else real)
    r = cli(["quantize", "--draft-model", link, "--out", fam])
    assert r.exit_code == 0, r.stderr
    stored = fam / _manifest(fam)["variants"]["sibling"]["path"]
    assert not stored.is_symlink() and stored.is_file()
    assert Family.load(fam).problem("sibling") is None
    moved = fam.rename(tmp_path / "elsewhere")  # the family goes on loading wherever it goes
    real.unlink()  # and whatever becomes of the file it was added from
    assert Family.load(moved).check() == {r: None for r in Family.load(moved).stored_roles()}
    assert cli(["doctor", "--family", moved]).exit_code == 0


def test_a_quantized_parent_given_through_a_link_is_stored_as_its_file(mine, tmp_path):
    from specquant_cli.family.manifest import Family

    link = tmp_path / "link.gguf"
    link.symlink_to(os.path.relpath(mine, tmp_path))
    out = tmp_path / "fam"
    assert cli(["quantize", link, "--out", out]).exit_code == 0
    own = out / _manifest(out)["variants"]["own"]["path"]
    assert not own.is_symlink() and own.is_file()
    moved = out.rename(tmp_path / "moved")
    assert Family.load(moved).problem("own") is None


def test_a_link_inside_a_family_is_refused_with_one_line(fam):
    q8 = fam / _manifest(fam)["variants"]["q8"]["path"]
    q8.rename(fam / "kept-aside.bin")
    q8.symlink_to("kept-aside.bin")  # inside the folder: it resolves, but it is not the file
    before = snapshot(fam)
    assert_clean_error(cli(["doctor", "--family", fam]), 1, "q8: ", "is a symbolic link", "not the file itself")
    assert snapshot(fam) == before


# -- wrong: a plan that cannot run here says so ------------------------------------------------------------------------
def _facts_with(ram_available: int):
    import dataclasses

    from specquant_cli.system.hardware import detect

    return dataclasses.replace(detect(), ram_available=ram_available)


def test_a_reason_s_numbers_read_as_not_fitting(fam):
    """Placement may take 90 % of what is available: the reason gives that usable share, never a need below the
    number it is compared with."""
    import re

    from specquant_cli.errors import ResourceError
    from specquant_cli.family.manifest import Family
    from specquant_cli.system.placement import RAM_HEADROOM, need, require_fit

    family = Family.load(fam)
    total = need(family, "parent", 512).total
    facts = _facts_with(int(total / (RAM_HEADROOM + 0.05)))  # fits the available memory, not its usable share
    with pytest.raises(ResourceError) as e:
        require_fit(facts, family, ["parent"], 512)
    m = re.search(r"need ~([\d.]+) GiB of RAM, more than the ([\d.]+) GiB usable here \(90% of ([\d.]+) GiB "
                  r"available\)", str(e.value))
    assert m, str(e.value)
    assert float(m.group(1)) > float(m.group(2)) and float(m.group(3)) >= float(m.group(1))


def test_route_counts_the_parent_in_the_fit(family_dir, monkeypatch):
    from specquant_cli.family.manifest import Family
    from specquant_cli.system import hardware
    from specquant_cli.system.placement import need

    parent = need(Family.load(family_dir).bind("f16"), "parent", 4096).total
    small = _facts_with(parent // 4)
    monkeypatch.setattr(hardware, "detect", lambda *a, **k: small)
    r = cli(["route", "--family", family_dir, "--json", "Summarize this: the cat sat on the mat."])
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    left = {d["role"]: d["why"] for d in out["plan"]["left_out"]}
    assert "parent" in left and "more than the" in left["parent"] and "GiB usable here" in left["parent"]
    assert out["fits"] is False
    assert "warning: this plan will not fit in this machine's memory: parent does not fit" in " ".join(r.stderr.split())
    # a fixed policy's plan says it too
    r = cli(["route", "--family", family_dir, "--json", "--policy", "parent", "hello"])
    assert r.exit_code == 0 and json.loads(r.stdout)["fits"] is False, r.stderr


def test_health_lists_only_the_kv_caches_loaded_now(family_dir):
    """A draft released after idling (the idle time shortened to 1 s in the server's process) leaves /health's list."""
    import re

    import httpx
    import openai

    code = ("import sys; import specquant_cli.runtime.pool as pool; pool.IDLE_RELEASE_S = 1.0; "
            "sys.argv = ['specquant'] + sys.argv[1:]; from specquant_cli.cli import main; main()")
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--port", "0", "--threads", "1", "--family",
                             str(family_dir), "--parallel", "1", "--policy", "spec-q4", "--policies",
                             "parent,spec-q4", "--ctx", "1024"], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(120) and proc.poll() is None, "".join(lines)
        url = "http://127.0.0.1:" + re.search(r"listening on http://127\.0\.0\.1:(\d+)", "".join(lines)).group(1)
        assert set(httpx.get(url + "/health", timeout=10).json()["kv"]) == {"parent", "q4"}
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        time.sleep(1.5)  # q4 idles past its release time
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           extra_body={"specquant_policy": "parent"})
        assert r.choices[0].message.content is not None
        assert set(httpx.get(url + "/health", timeout=10).json()["kv"]) == {"parent"}
        # asked for again, it is loaded again and listed again
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"specquant_policy": "spec-q4"})
        assert set(httpx.get(url + "/health", timeout=10).json()["kv"]) == {"parent", "q4"}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- hang: one way every input path is opened --------------------------------------------------------------------------
def _within(fn, fifo: Path, seconds: float = 10.0):
    """fn() run in a thread: what it returned or raised, or AssertionError when it blocked (the FIFO is then opened
    for writing and closed, so that the blocked reader returns)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
        raise AssertionError(f"blocked on the FIFO {fifo}")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _input_readers():
    from specquant_cli.bench import datasets
    from specquant_cli.decoding.grammar import schema_file
    from specquant_cli.family.activations import calibration_tokens
    from specquant_cli.family.imatrix import check_option_imatrix

    return {"--json-schema": (lambda p: schema_file(p, None), "not a JSON Schema file"),
            "--dataset": (lambda p: datasets.load([p]), "not a dataset file"),
            "--calibration": (lambda p: calibration_tokens(None, p), "not a text file"),
            "--imatrix": (check_option_imatrix, "not a GGUF file")}


@pytest.mark.parametrize("option", ["--json-schema", "--dataset", "--calibration", "--imatrix"])
@pytest.mark.parametrize("kind", ["FIFO", "character device", "folder"])
def test_an_input_that_is_no_regular_file_is_refused_at_once(tmp_path, option, kind):
    from specquant_cli.errors import InputError

    read, what = _input_readers()[option]
    path = {"FIFO": tmp_path / "pipe", "character device": Path("/dev/zero"), "folder": tmp_path}[kind]
    if kind == "FIFO":
        os.mkfifo(path)
    with pytest.raises(InputError) as e:
        _within(lambda: read(path), path)
    assert str(e.value) == f"{option} {path}: is a {kind}, {what}"


@pytest.mark.slow
def test_chat_with_a_fifo_as_json_schema_is_refused_not_hung(family_dir, tmp_path):
    fifo = tmp_path / "schema.json"
    os.mkfifo(fifo)
    try:
        r = subprocess.run([sys.executable, "-m", "specquant_cli", "chat", "--family", str(family_dir), "--json-schema",
                            str(fifo), "--max-tokens", "4", "hi"], cwd=REPO, capture_output=True, text=True,
                           timeout=120, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:  # (subprocess.run has killed it)
        raise AssertionError("chat --json-schema blocked on a FIFO") from None
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"error: --json-schema {fifo}: is a FIFO, not a JSON Schema file" in r.stderr


@pytest.mark.parametrize("kind", ["FIFO", "character device"])
def test_pull_of_a_fifo_or_a_device_names_what_it_is(tmp_path, kind):
    path = tmp_path / "model.gguf" if kind == "FIFO" else Path("/dev/null")
    if kind == "FIFO":
        os.mkfifo(path)
    before = snapshot(tmp_path)
    assert_clean_error(cli(["pull", path, "--models-dir", tmp_path / "models"]), 1,
                       f"{path}: is a {kind}, not a GGUF file")
    assert snapshot(tmp_path) == before


# -- silent: a family's files are checked by content -------------------------------------------------------------------
def test_a_quantized_parent_rewritten_in_place_with_its_time_put_back_is_refused(mine, made, tmp_path):
    from specquant_cli.family.manifest import Family

    out = tmp_path / "fam"
    assert cli(["quantize", mine, "--out", out]).exit_code == 0
    assert os.path.samefile(out / mine.name, mine)  # a hard link: the user's file is the family's
    st = mine.stat()
    assert made["other_q8"].stat().st_size == st.st_size
    with open(mine, "r+b") as f:  # the user writes another model over it, in place, the same size
        f.write(made["other_q8"].read_bytes())
    os.utime(mine, ns=(st.st_atime_ns, st.st_mtime_ns))  # and sets its modification time back
    assert mine.stat().st_mtime_ns == st.st_mtime_ns and mine.stat().st_size == st.st_size
    assert "changed on disk after the family was made" in (Family.load(out).problem("own") or "")
    before = snapshot(out)
    assert_clean_error(cli(["doctor", "--parent", "fastest", "--family", out]), 1, "changed on disk")
    assert snapshot(out) == before


def test_a_change_past_the_first_mib_is_caught_too(mine, tmp_path):
    from specquant_cli.family.manifest import Family

    out = tmp_path / "fam"
    assert cli(["quantize", mine, "--out", out]).exit_code == 0
    st = mine.stat()
    assert st.st_size > 2 << 20
    with open(mine, "r+b") as f:  # the last block: one byte of the weights
        f.seek(st.st_size - 100)
        byte = f.read(1)
        f.seek(st.st_size - 100)
        f.write(bytes([byte[0] ^ 0x5A]))
    os.utime(mine, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "changed on disk" in (Family.load(out).problem("own") or "")


def test_a_family_without_fingerprints_still_loads(fam):
    """A manifest written before fingerprints were recorded: checked as it always was (size, header, type)."""
    from specquant_cli.family.manifest import Family

    _edit(fam, lambda m: [v.pop("fingerprint", None) for v in m["variants"].values()])
    f = Family.load(fam)
    assert f.check() == {r: None for r in f.stored_roles()}
    assert cli(["doctor", "--family", fam, "--verify"]).exit_code == 0


def test_a_header_claiming_more_bits_than_the_weights_hold_is_refused(made, tmp_path):
    liar = claim_file_type(Path(shutil.copy(made["q4"], tmp_path / "liar-Q8_0.gguf")), 7)  # 7: MOSTLY_Q8_0
    before = snapshot(tmp_path)
    assert_clean_error(cli(["quantize", liar, "--out", tmp_path / "fam"]), 1,
                       "its header says Q8_0 (general.file_type), but its weights are mostly Q4_0")
    assert snapshot(tmp_path) == before


def test_a_sibling_whose_header_claims_other_weights_is_refused(fam, made, tmp_path):
    from specquant_cli.family.quantize import parse_types, quantize_family

    quantize_family(made["sibling"], tmp_path / "s", parse_types("q4_0"), threads=1)
    liar = claim_file_type(tmp_path / "s" / "s-q4_0.gguf", 1)  # 1: MOSTLY_F16
    before = snapshot(fam)
    assert_clean_error(cli(["quantize", "--draft-model", liar, "--out", fam]), 1, "its header says F16")
    assert snapshot(fam) == before


def test_requantizing_never_gives_a_draft_of_the_parents_bits(mine, tmp_path):
    out = tmp_path / "fam"
    before = snapshot(tmp_path)
    assert_clean_error(cli(["quantize", mine, "--out", out, "--types", "q8_0", "--allow-requantize"]), 1,
                       "--types q8_0", "must have fewer bits")
    assert snapshot(tmp_path) == before
    r = cli(["quantize", mine, "--out", out, "--types", "q8_0,q4_0", "--allow-requantize", "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    assert "--types q8_0: skipped" in " ".join(r.stderr.split())
    assert set(_manifest(out)["variants"]) == {"own", "q4"}


def test_a_siblings_hyperparameters_come_from_its_file(fam, made):
    from specquant_cli.family.gguf_read import read_info
    from specquant_cli.family.gguf_walk import kv_cache_bytes
    from specquant_cli.family.manifest import Family
    from specquant_cli.system.placement import need

    assert cli(["quantize", "--draft-model", made["sibling"], "--out", fam]).exit_code == 0
    real = read_info(made["sibling"]).hparams
    assert real["block_count"] == 2
    _edit(fam, lambda m: m["variants"]["sibling"]["sibling"]["hparams"].update(block_count=1, embedding_length=1))
    _edit(fam, lambda m: m["hparams"].update(block_count=1))  # the family's own record too
    f = Family.load(fam)
    assert f.hparams_of("sibling") == real
    assert f.hparams_of("q4") == read_info(fam / _manifest(fam)["variants"]["q4"]["path"]).hparams
    assert need(f, "sibling", 1024).kv_bytes == kv_cache_bytes(real, 1024) > 0


@pytest.mark.parametrize("how", ["same file", "a copy"])
def test_the_parents_own_file_is_no_sibling(fam, tmp_path, how):
    parent = fam / _manifest(fam)["variants"]["f16"]["path"]
    given = parent if how == "same file" else Path(shutil.copy(parent, tmp_path / "copy.gguf"))
    before = snapshot(fam)
    assert_clean_error(cli(["quantize", "--draft-model", given, "--out", fam]), 1, "own")
    assert snapshot(fam) == before


def test_the_parents_own_file_is_no_sibling_beside_a_base_either(made, tmp_path):
    before = snapshot(tmp_path)
    assert_clean_error(cli(["quantize", made["base"], "--out", tmp_path / "fam", "--draft-model", made["base"]]), 1,
                       "is the parent's own file")
    assert snapshot(tmp_path) == before


# -- unclear messages --------------------------------------------------------------------------------------------------
def test_a_sibling_with_a_very_long_file_name_is_added(fam, made, tmp_path):
    from specquant_cli.family.manifest import Family

    long = Path(shutil.copy(made["sibling"], tmp_path / ("s" * 240 + ".gguf")))
    r = cli(["quantize", "--draft-model", long, "--out", fam])
    assert r.exit_code == 0, r.stderr
    name = _manifest(fam)["variants"]["sibling"]["path"]
    assert name.startswith("sibling-sss") and name.endswith(".gguf") and len(name) <= 232
    assert Family.load(fam).problem("sibling") is None


def test_a_chain_with_its_roles_swapped_is_refused_before_loading(fam, made):
    assert cli(["quantize", "--draft-model", made["sibling"], "--out", fam]).exit_code == 0
    line = assert_clean_error(cli(["route", "--family", fam, "--policy", "spec-chain-q4-sibling", "hi"]), 1,
                              "the roles are the wrong way round", "spec-chain-sibling-q4")
    assert len(line) < 400 and "known:" not in line
    line = assert_clean_error(cli(["route", "--family", fam, "--policy", "spec-chain-q8-q4", "hi"]), 1,
                              "'q8' is not a sibling model of this family", "spec-chain-sibling-q4")
    assert len(line) < 400


def _split_part(path: Path, no: int, count: int, tensors: bool = True) -> Path:
    """A part llama-gguf-split writes after the first: split.no, split.count and split.tensors.count its only
    metadata, then its tensors (a metadata-only part: none)."""
    kv = b""
    for key, vtype, fmt, value in (("split.no", 2, "<H", no), ("split.count", 2, "<H", count),
                                   ("split.tensors.count", 5, "<i", 12)):
        kv += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + struct.pack(fmt, value)
    info = b""
    if tensors:
        name = b"blk.3.ffn_down.weight"
        info = struct.pack("<Q", len(name)) + name + struct.pack("<I", 2) + struct.pack("<QQ", 64, 64) \
            + struct.pack("<IQ", 0, 0)  # F32, at offset 0
    head = b"GGUF" + struct.pack("<IQQ", 3, 1 if tensors else 0, 3) + kv + info
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + (b"\0" * 64 * 64 * 4 if tensors else b""))
    return path


@pytest.mark.parametrize("case", ["part 2", "metadata-only part 1"])
def test_a_split_part_is_named_with_the_merge_hint(tmp_path, fam, case):
    if case == "part 2":
        part = _split_part(tmp_path / "model-00002-of-00003.gguf", 1, 3)
        needles = ("part 2 of a model split into 3 files",
                   f"llama-gguf-split --merge {tmp_path / 'model-00001-of-00003.gguf'} merged.gguf")
    else:
        part = _split_part(tmp_path / "model-00001-of-00002.gguf", 0, 2, tensors=False)
        needles = ("part 1 of a model split into 2 files", "llama-gguf-split --merge")
    before = snapshot(tmp_path)
    assert_clean_error(cli(["quantize", part, "--out", tmp_path / "out"]), 1, *needles)
    assert_clean_error(cli(["quantize", "--draft-model", part, "--out", fam]), 1, *needles)
    assert snapshot(tmp_path) == before


# -- also seen: a family made again keeps its name and its folder clean; pull replaces no other family -----------------
def test_quantize_force_keeps_the_familys_name_and_leaves_no_orphan(fam, made):
    assert _manifest(fam)["family"] == "demo" and fam.name == "fam"
    r = cli(["quantize", made["base"], "--force", "--out", fam, "--types", "q4_1,q8_0,f16", "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    m = _manifest(fam)
    assert m["family"] == "demo"
    named = {v["path"] for v in m["variants"].values()}
    assert named == {"demo-q4_1.gguf", "demo-q8_0.gguf", "base-f16.gguf"}  # the F16 base is placed as itself
    assert {p.name for p in fam.glob("*.gguf")} == named  # the replaced q4_0 file went with its record
    assert cli(["doctor", "--family", fam, "--verify"]).exit_code == 0


def test_quantize_never_removes_the_users_own_file(mine, made, tmp_path):
    """A family made of a quantized file inside its folder, then made of another base: the user's file stays."""
    folder = mine.parent
    assert cli(["quantize", mine, "--out", folder]).exit_code == 0
    sha = hashlib.sha256(mine.read_bytes()).hexdigest()
    r = cli(["quantize", made["base"], "--force", "--out", folder, "--types", "q4_0,f16", "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    assert mine.is_file() and hashlib.sha256(mine.read_bytes()).hexdigest() == sha


def test_pull_does_not_replace_another_family_without_force(made, tmp_path):
    models = tmp_path / "models"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = Path(shutil.copy(made["q8"], tmp_path / "a" / "mine.gguf"))
    second = Path(shutil.copy(made["other_q8"], tmp_path / "b" / "mine.gguf"))
    assert cli(["pull", first, "--models-dir", models]).exit_code == 0
    before = snapshot(tmp_path)
    line = assert_clean_error(cli(["pull", second, "--models-dir", models]), 1, "holds another family",
                              "pass --force to replace it")
    assert str(models / "mine") in line
    assert snapshot(tmp_path) == before
    r = cli(["pull", second, "--models-dir", models, "--force"])
    assert r.exit_code == 0, r.stderr
    assert _manifest(models / "mine")["base"]["sha256"] == hashlib.sha256(second.read_bytes()).hexdigest()
