"""Writes that cannot lose data: quantize against hostile bases, options, folders and planted files.

Tiny fabricated GGUFs keep every run well under a second. Each refusal is one line with exit 1 (usage
errors 2) and leaves the family folder exactly as it was; each accepted run leaves a family that verifies
(size, header, sha256), with nothing partial beside it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hostile_util import assert_clean_error, cli, copy_family, snapshot, temps, tiny_llama

from specquant_cli.family.manifest import Family
from specquant_cli.fsutil import sha256_file

TYPES = "q4_0,q8_0,f16"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    (root / "a").mkdir()
    (root / "b").mkdir()
    return tiny_llama(root / "a" / "tiny-f16.gguf", seed=0), tiny_llama(root / "b" / "tiny-f16.gguf", seed=1)


@pytest.fixture(scope="module")
def built(bases, tmp_path_factory):
    out = tmp_path_factory.mktemp("built") / "fam"
    r = cli(["quantize", bases[0], "--out", out, "--types", TYPES, "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    return out


@pytest.fixture
def fam(built, tmp_path):
    return copy_family(built, tmp_path / "fam")


def quantize(base, out, *extra, types=TYPES):
    return cli(["quantize", base, "--out", out, "--types", types, "--threads", "1", *extra])


def assert_family_ok(root: Path) -> Family:
    f = Family.load(root)
    assert f.verify(hashes=True) == [], f.verify()
    assert temps(root) == []
    return f


# -- bases that are not usable: refused, nothing written --------------------------------------------
def _bad_bases(tmp: Path, good: Path, q8: Path):
    data = good.read_bytes()
    head = bytearray(data[:24])
    (tmp / "text.gguf").write_text("just some text, not a model\n")
    (tmp / "empty.gguf").write_bytes(b"")
    (tmp / "ten.gguf").write_bytes(data[:10])
    (tmp / "half.gguf").write_bytes(data[: len(data) // 2])
    v99 = bytearray(data)
    v99[4:8] = (99).to_bytes(4, "little")
    (tmp / "v99.gguf").write_bytes(bytes(v99))
    huge = bytearray(data)
    huge[8:16] = (1 << 40).to_bytes(8, "little")
    (tmp / "huge.gguf").write_bytes(bytes(huge))
    (tmp / "garbage.gguf").write_bytes(bytes(head) + bytes(range(256)) * 50)
    (tmp / "adir.gguf").mkdir()
    (tmp / "dangling.gguf").symlink_to(tmp / "nowhere.gguf")
    os.mkfifo(tmp / "fifo.gguf")
    tiny_llama(tmp / "alien.gguf", arch="nonsense")
    tiny_llama(tmp / "part.gguf", split=(0, 3))
    return [
        ("text.gguf", "not a GGUF file"),
        ("empty.gguf", "not a GGUF file (magic b''"),
        ("ten.gguf", "truncated GGUF header"),
        ("half.gguf", "truncated"),
        ("v99.gguf", "unsupported GGUF version 99"),
        ("huge.gguf", "implausible GGUF header"),
        ("garbage.gguf", "truncated"),
        ("adir.gguf", "is a folder, not a GGUF file"),
        ("missing.gguf", "no such file"),
        ("dangling.gguf", "no such file"),
        ("fifo.gguf", "is a FIFO, not a GGUF file"),
        ("alien.gguf", "architecture 'nonsense' is not one llama.cpp knows"),
        (q8, "a 16-bit rendering of it would not be the file you run"),  # --types f16 of a quantized base
        ("part.gguf", "part 1 of a model split into 3 files (llama-gguf-split); merge them"),
    ]


@pytest.mark.parametrize("i", range(14))
def test_unusable_base_is_refused_and_nothing_written(tmp_path, bases, built, i):
    cases = _bad_bases(tmp_path, bases[0], built / "fam-q8_0.gguf")
    name, needle = cases[i]
    out = tmp_path / "out"
    before = snapshot(tmp_path)
    assert_clean_error(quantize(tmp_path / name, out), 1, needle)
    assert snapshot(tmp_path) == before and not out.exists()


# -- bad options and output folders ------------------------------------------------------------------
def _opt_cases(tmp: Path):
    (tmp / "afile").write_text("x")
    return [
        (["--types", ""], "--types: no quantization type given"),
        (["--types", " , ,"], "--types: no quantization type given"),
        (["--types", "q4_k_m,q3_weird"], "--types: unknown type 'q3_weird'"),
        (["--types", "q4_0,q4_k_m"], "two types fill the same role 'q4'"),
        (["--out", tmp / "afile"], "--out " + str(tmp / "afile") + ": not a folder"),
        (["--out", tmp / "afile" / "sub"], "cannot create the folder (Not a directory)"),
    ]


@pytest.mark.parametrize("i", range(6))
def test_bad_option_refused(tmp_path, bases, i):
    extra, needle = _opt_cases(tmp_path)[i]
    before = snapshot(tmp_path)
    args = ["quantize", bases[0], "--threads", "1"]
    if "--out" not in extra:
        args += ["--out", tmp_path / "out"]
    assert_clean_error(cli(args + extra), 1, needle)
    assert snapshot(tmp_path) == before


def test_read_only_out_folder(tmp_path, bases):
    """A folder nothing can be created in: mode 555 for a user; for root, who writes through any mode, the
    immutable attribute (chattr +i), which root's writes meet too."""
    out = tmp_path / "ro"
    out.mkdir()
    root = os.geteuid() == 0
    if root:
        r = subprocess.run(["chattr", "+i", str(out)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"root, and this file system takes no immutable attribute: {r.stderr.strip()}")
    else:
        out.chmod(0o555)
    try:
        assert_clean_error(quantize(bases[0], out), 1, "not writable")
        assert list(out.iterdir()) == []
    finally:
        subprocess.run(["chattr", "-i", str(out)]) if root else out.chmod(0o755)


def test_planted_log_symlink_is_refused(fam, tmp_path, bases):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (fam / "quantize.log").unlink()
    (fam / "quantize.log").symlink_to(victim)
    before = snapshot(fam)
    assert_clean_error(quantize(bases[0], fam, "--force"), 1, "quantize.log is a symbolic link")
    assert victim.read_text() == "precious\n" and snapshot(fam) == before


# -- an output that is an input is refused, the input intact -------------------------------------------
# A variant written over its base is one of the base's own type: a draft of as many bits as its quantized parent,
# refused (family.own.requantize_types) before the folder is looked at; plan_steps' same-file check stays behind it.
REQUANTIZED_TO_ITSELF = "a draft quantized from it must have fewer bits"

def test_output_equal_to_the_input_is_refused(fam):
    src = fam / "fam-q8_0.gguf"
    sha, before = sha256_file(src), snapshot(fam)
    r = quantize(src, fam, "--allow-requantize", "--force", types="q8_0")
    assert_clean_error(r, 1, REQUANTIZED_TO_ITSELF)
    assert sha256_file(src) == sha and snapshot(fam) == before


def test_output_hardlinked_to_the_input_is_refused(fam, tmp_path):
    link = tmp_path / "elsewhere.gguf"
    os.link(fam / "fam-q4_0.gguf", link)
    before = snapshot(fam)
    assert_clean_error(quantize(link, fam, "--allow-requantize", "--force", types="q4_0"), 1, REQUANTIZED_TO_ITSELF)
    assert snapshot(fam) == before


def test_output_reached_through_a_symlinked_folder_is_refused(fam, tmp_path):
    (tmp_path / "alias").symlink_to(fam)
    before = snapshot(fam)
    r = quantize(tmp_path / "alias" / "fam-q8_0.gguf", fam, "--allow-requantize", "--force", types="q8_0")
    assert_clean_error(r, 1, REQUANTIZED_TO_ITSELF)
    assert snapshot(fam) == before


def test_base_that_is_the_family_manifest_is_refused(tmp_path, bases):
    out = tmp_path / "fam"
    out.mkdir()
    shutil.copy(bases[0], out / "manifest.json")
    before = snapshot(tmp_path)
    assert_clean_error(quantize(out / "manifest.json", out), 1, "family's own manifest.json")
    assert snapshot(tmp_path) == before


# -- existing files are checked before adoption; bad ones rebuilt, never trusted --------------------------
def _four_bytes(fam, tmp):
    (fam / "fam-q8_0.gguf").write_bytes(b"GGUF")
    return "fam-q8_0.gguf"


def _truncated_f16(fam, tmp):  # the f16 variant is a copy of the base, placed in the folder
    p = fam / "tiny-f16.gguf"
    data = p.read_bytes()
    p.unlink()  # a hard link of the base: replace, do not write through it
    p.write_bytes(data[: len(data) // 3])
    return "tiny-f16.gguf"


def _q8_as_q4(fam, tmp):
    (fam / "fam-q4_0.gguf").unlink()
    shutil.copy(fam / "fam-q8_0.gguf", fam / "fam-q4_0.gguf")
    return "fam-q4_0.gguf"


def _foreign(fam, tmp):
    from specquant_cli.family.quantize import parse_types, quantize_family

    other = tiny_llama(tmp / "x-f16.gguf", token_prefix="x")
    quantize_family(other, tmp / "xfam", parse_types("q8_0"), threads=1)
    shutil.copy(tmp / "xfam" / "xfam-q8_0.gguf", fam / "fam-q8_0.gguf")
    return "fam-q8_0.gguf"


def _symlink_to_victim(fam, tmp):
    victim = tmp / "victim.gguf"
    shutil.copy(fam / "fam-q8_0.gguf", victim)
    (fam / "fam-q8_0.gguf").unlink()
    (fam / "fam-q8_0.gguf").symlink_to(victim)
    return "fam-q8_0.gguf"


@pytest.mark.parametrize("breaker,warning", [
    (_four_bytes, "truncated or corrupt GGUF (truncated GGUF header)"),
    (_truncated_f16, None),
    (_q8_as_q4, "its weights are Q8_0, not q4_0"),
    (_foreign, "its vocabulary differs from the base's"),
    (_symlink_to_victim, "it is a symbolic link"),
], ids=["four-bytes", "truncated-f16", "q8-as-q4", "foreign-vocab", "symlink"])
def test_bad_existing_file_is_rebuilt_not_adopted(fam, tmp_path, bases, breaker, warning):
    name = breaker(fam, tmp_path)
    victim_before = (tmp_path / "victim.gguf").read_bytes() if (tmp_path / "victim.gguf").exists() else None
    r = quantize(bases[0], fam)
    assert r.exit_code == 0, r.stderr
    if warning:
        assert f"{name}: {warning}; rebuilding it" in r.stderr
    f = assert_family_ok(fam)
    assert not (fam / name).is_symlink()
    assert f.manifest["variants"][{"tiny-f16.gguf": "f16", "fam-q4_0.gguf": "q4"}.get(name, "q8")]["size_bytes"] > 1000
    if victim_before is not None:
        assert (tmp_path / "victim.gguf").read_bytes() == victim_before


def test_valid_existing_files_are_kept(fam, bases):
    before = {p.name: p.stat().st_mtime_ns for p in fam.glob("*.gguf")}
    r = quantize(bases[0], fam)
    assert r.exit_code == 0 and "warning" not in r.stderr, r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in fam.glob("*.gguf")} == before
    assert_family_ok(fam)


def test_new_base_rebuilds_every_variant(fam, bases):
    old = {p.name: sha256_file(p) for p in fam.glob("fam-*.gguf")}
    r = quantize(bases[1], fam)
    assert r.exit_code == 0 and "made from another base; rebuilding every variant" in r.stderr, r.stderr
    f = assert_family_ok(fam)
    assert all(sha256_file(fam / n) != s for n, s in old.items())
    assert f.manifest["base"]["sha256"] == sha256_file(bases[1])


# -- the manifest keeps what it does not own ------------------------------------------------------------
@pytest.mark.parametrize("force", [False, True], ids=["rerun", "force"])
def test_manifest_keeps_notes_provenance_and_unknown_keys(fam, bases, force):
    m = json.loads((fam / "manifest.json").read_text())
    m["notes"] = {"mine": "hand-written note"}
    m["base"]["provenance"] = "converted by hand from the original safetensors"
    m["provenance_detail"] = {"who": "me"}
    m["variants"]["q8"]["comment"] = "keep me"
    (fam / "manifest.json").write_text(json.dumps(m))
    r = quantize(bases[0], fam, *(["--force"] if force else []))
    assert r.exit_code == 0, r.stderr
    new = assert_family_ok(fam).manifest
    assert new["notes"]["mine"] == "hand-written note"
    assert new["base"]["provenance"] == "converted by hand from the original safetensors"
    assert new["provenance_detail"] == {"who": "me"} and new["variants"]["q8"]["comment"] == "keep me"


def test_other_roles_of_the_same_base_are_kept(fam, bases):
    r = quantize(bases[0], fam, "--force", types="q8_0")
    assert r.exit_code == 0, r.stderr
    assert set(assert_family_ok(fam).manifest["variants"]) == {"q4", "q8", "f16"}


def test_unusable_manifest_is_kept_aside_not_lost(fam, bases):
    (fam / "manifest.json").write_text("{ my own notes, not JSON")
    r = quantize(bases[0], fam)
    assert r.exit_code == 0 and "kept as manifest.json.unusable" in r.stderr, r.stderr
    assert (fam / "manifest.json.unusable").read_text() == "{ my own notes, not JSON"
    assert_family_ok(fam)


def test_manifest_symlink_is_replaced_not_written_through(fam, tmp_path, bases):
    victim = tmp_path / "victim.json"
    victim.write_text('{"precious": true}')
    (fam / "manifest.json").unlink()
    (fam / "manifest.json").symlink_to(victim)
    r = quantize(bases[0], fam)
    assert r.exit_code == 0, r.stderr
    assert victim.read_text() == '{"precious": true}' and not (fam / "manifest.json").is_symlink()
    assert_family_ok(fam)


# -- planted symlinks at temp names, stale temp files ----------------------------------------------------
@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
def test_planted_temp_name_symlinks_are_never_followed(fam, tmp_path, bases):
    """The old temp names were predictable (.NAME.PID.part); links planted there must not be written."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    pid = os.getpid()  # the CLI runs in this process
    for name in ("manifest.json", "fam-q8_0.gguf", "fam-q4_0.gguf", ".specquant-commit.json"):
        (fam / f".{name}.{pid}.part").symlink_to(victim)
    r = quantize(bases[0], fam, "--force")
    assert r.exit_code == 0, r.stderr
    assert victim.read_text() == "precious\n"
    assert Family.load(fam).verify() == []


def test_bench_outputs_never_write_through_planted_links(tmp_path):
    from specquant_cli.bench import report

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / f".out.json.{os.getpid()}.part").symlink_to(victim)
    (tmp_path / "out.md").symlink_to(victim)
    rep = {"command": "c", "machine": {"cores_physical": 1, "ram_total": 1, "gpus": []},
           "family": {"name": "t", "provenance": "p", "caveat": "c"}, "summary": [], "by_category": {},
           "config": {"items": 0, "policies": [], "max_tokens": 1, "temperature": 0.0, "repeats": 1}}
    assert report.write_outputs(rep, tmp_path / "out.json", tmp_path / "out.md", None) is None
    assert victim.read_text() == "precious\n"
    assert json.loads((tmp_path / "out.json").read_text())["command"] == "c"
    assert not (tmp_path / "out.md").is_symlink()


def test_stale_temp_files_of_dead_processes_are_removed(fam, bases):
    dead = 999999
    (fam / f".fam-q8_0.gguf.{dead}.0badc0de.part").write_bytes(b"x" * 1000)
    (fam / f".manifest.json.{dead}.part").write_text("{}")  # the old naming
    (fam / f".fetch-{dead}-abc").mkdir()
    (fam / f".fetch-{dead}-abc" / "origin.gguf").write_bytes(b"y" * 100)
    live = fam / f".fam-q4_0.gguf.{os.getppid()}.0123abcd.part"  # a live process's: not ours to remove
    live.write_bytes(b"z")
    r = quantize(bases[0], fam)
    assert r.exit_code == 0, r.stderr
    assert temps(fam) == [live.name]


# -- failures and interrupts inside the run leave the old family ------------------------------------------
def test_failed_second_build_leaves_the_old_family(fam, bases, monkeypatch):
    from specquant_cli.family import quantize as q

    monkeypatch.setitem(q.QUANT_TYPES, "q8_0", q.QuantType("q8_0", "LLAMA_FTYPE_NO_SUCH_TYPE", 8.5, "q8"))
    before = snapshot(fam)
    r = quantize(bases[1], fam)
    assert_clean_error(r, 1, "llama_model_quantize failed for q8_0")
    after = snapshot(fam)
    assert {k: v for k, v in after.items() if k != "quantize.log"} == \
        {k: v for k, v in before.items() if k != "quantize.log"}


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
def test_interrupt_at_commit_leaves_old_family_and_no_temps(fam, bases, monkeypatch):
    from specquant_cli.family import journal

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(journal, "commit", boom)
    before = snapshot(fam)
    r = quantize(bases[1], fam)
    assert r.exit_code == 130 and r.stderr.strip().endswith("interrupted"), r.stderr
    after = snapshot(fam)
    assert {k: v for k, v in after.items() if k != "quantize.log"} == \
        {k: v for k, v in before.items() if k != "quantize.log"}


def test_not_enough_disk_refuses_before_writing(fam, bases, monkeypatch):
    import collections

    from specquant_cli.family import quantize as q

    usage = collections.namedtuple("usage", "total used free")(10 << 30, 10 << 30, 1 << 10)
    monkeypatch.setattr(q.shutil, "disk_usage", lambda p: usage)
    before = snapshot(fam)
    assert_clean_error(quantize(bases[1], fam), 1, "not enough disk")
    assert snapshot(fam) == before


# -- pull: a rebuild happens beside the old family, which it replaces only at the commit --------------------
@pytest.fixture
def fake_registry(bases, tmp_path_factory, monkeypatch):
    """`pull tiny`: its 'wheel' is a tiny Q4_1 GGUF (no network): what fetch_origin would have extracted."""
    from specquant_cli.family import fetch
    from specquant_cli.family.quantize import parse_types, quantize_family

    root = tmp_path_factory.mktemp("registry")
    quantize_family(bases[0], root / "o", parse_types("q4_1"), threads=1)
    origin = root / "o" / "o-q4_1.gguf"

    def fetch_origin(spec, workdir, progress=None):
        dst = Path(workdir) / "origin.gguf"
        shutil.copy(origin, dst)
        return dst, "tiny-origin 1.0"

    spec = fetch.FamilySpec(name="tiny", packages=("tiny-origin",), origin_type="Q4_1", q4_type="q4_0",
                            description="test", member_pattern=r"x$", notes={"q4": "q4_0"})
    monkeypatch.setitem(fetch.FAMILIES, "tiny", spec)
    monkeypatch.setattr(fetch, "fetch_origin", fetch_origin)
    return spec


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
def test_pull_builds_checks_and_rebuilds_a_damaged_family(fake_registry, tmp_path):
    r = cli(["pull", "tiny", "--models-dir", tmp_path, "--threads", "1"])
    assert r.exit_code == 0 and "built" in r.stderr, r.stderr
    fam = tmp_path / "tiny"
    f = assert_family_ok(fam)
    assert set(f.manifest["variants"]) == {"q4", "q8", "f16", "bf16"} and "Q4_1" in f.provenance
    r = cli(["pull", "tiny", "--models-dir", tmp_path])
    assert r.exit_code == 0 and "present and verified" in r.stderr
    p = fam / "tiny-q8_0.gguf"
    p.write_bytes(p.read_bytes()[:-1] + b"\1")  # same size, different content: only sha256 sees it
    r = cli(["pull", "tiny", "--models-dir", tmp_path, "--threads", "1"])
    assert r.exit_code == 0 and "built" in r.stderr, r.stderr
    assert_family_ok(fam)


@pytest.mark.slow  # a child process or a statistical run: seconds (the quick loop stays under a minute)
def test_interrupted_pull_leaves_the_old_family(fake_registry, tmp_path, monkeypatch):
    from specquant_cli.family import journal

    assert cli(["pull", "tiny", "--models-dir", tmp_path, "--threads", "1"]).exit_code == 0
    fam = tmp_path / "tiny"
    before = snapshot(fam)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(journal, "commit", boom)
    r = cli(["pull", "tiny", "--models-dir", tmp_path, "--force", "--threads", "1"])
    assert r.exit_code == 130 and r.stderr.strip().endswith("interrupted")
    after = snapshot(fam)
    assert {k: v for k, v in after.items() if k != "quantize.log"} == \
        {k: v for k, v in before.items() if k != "quantize.log"}  # no work folder, no temp file left


@pytest.mark.parametrize("kind", ["file", "under-a-file"])
def test_pull_models_dir_that_is_not_a_folder(fake_registry, tmp_path, kind):
    (tmp_path / "afile").write_text("x")
    d = tmp_path / "afile" if kind == "file" else tmp_path / "afile" / "sub"
    before = snapshot(tmp_path)
    assert_clean_error(cli(["pull", "tiny", "--models-dir", d]), 1, "--models-dir")
    assert snapshot(tmp_path) == before
