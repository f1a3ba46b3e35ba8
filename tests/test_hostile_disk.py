"""What is on disk is checked, not trusted: a planted or damaged commit journal is verified before anything
is rolled forward (else set aside, the family untouched), the family's lock is an OS lock (a live unrelated
pid locks nothing; a dead holder's lock is free), duplicate JSON keys are refused, a variant file swapped
for another type's is refused at load, and thread counts are bounded (1 .. 4 x logical cores).

Runs on a copy of the demo family whose GGUFs are hard links to the real ones (no test writes into a GGUF in
place: files are replaced by rename), with the real CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hostile_util import assert_clean_error, cli

from specquant_cli.names import JOURNAL, LOCK, MANIFEST, PREV_MANIFEST, UNUSABLE_JOURNAL
from specquant_cli.settings import cores

from conftest import REPO

STEM = "smollm2-135m"
Q4, Q8, F16 = f"{STEM}-q4_k_m.gguf", f"{STEM}-q8_0.gguf", f"{STEM}-f16.gguf"
CORES = cores()
LIMIT = 4 * CORES


# -- a copy of the demo family: GGUFs hard-linked, everything else copied ----------------------------------
@pytest.fixture(scope="module")
def demo(family_dir):
    """The real family, checked unchanged (sizes, inodes, mtimes) once this module is done with it."""
    def stamp():
        return {p.name: (p.stat().st_size, p.stat().st_ino, p.stat().st_mtime_ns) for p in family_dir.iterdir()
                if p.suffix == ".gguf" or p.name == MANIFEST}  # others may measure with it (calibration.json)

    before = stamp()
    yield family_dir
    assert stamp() == before


@pytest.fixture
def fam(demo, tmp_path):
    dst = tmp_path / "fam"
    dst.mkdir()
    for p in demo.iterdir():
        if p.suffix == ".gguf":
            try:
                os.link(p, dst / p.name)
                continue
            except OSError:
                pass
        shutil.copy2(p, dst / p.name)
    return dst


_sha: dict[tuple, str] = {}


def snapshot(root: Path) -> dict[str, tuple]:
    """hostile_util.snapshot, with the sha256 of a big file remembered per (inode, size, mtime): the GGUFs here
    are hard links of the same few files (no test writes into one; a write would change its mtime)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel, st = str(p.relative_to(root)), p.lstat()
            if p.is_symlink():
                out[rel] = ("link", 0, os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", 0, "")
            elif not p.is_file():
                out[rel] = ("special", 0, "")
            else:
                key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                if key not in _sha or st.st_size < 1 << 20:
                    _sha[key] = hashlib.sha256(p.read_bytes()).hexdigest()
                out[rel] = ("file", st.st_size, _sha[key])
    return out


def put(dst: Path, src: Path) -> None:
    """`dst` becomes a new directory entry for `src`'s content (never a write into the file at `dst`)."""
    tmp = dst.with_name(dst.name + ".put")
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def manifest_of(root: Path) -> dict:
    return json.loads((root / MANIFEST).read_text())


def write_text_manifest(root: Path, text: str) -> None:
    (root / MANIFEST).unlink()  # a copy, but never write through a name that could be a link
    (root / MANIFEST).write_text(text)


def write_manifest(root: Path, m: dict) -> None:
    write_text_manifest(root, json.dumps(m))


def temp_for(root: Path, final: str, src: Path | None = None, pid: int = 999999, rnd: str = "0123abcd") -> str:
    """A temp file of ours (TEMP_RE) for `final`, holding `src`'s content; returns its name."""
    name = f".{final}.{pid}.{rnd}.part"
    if src is not None:
        put(root / name, src)
    return name


def doctor(root: Path, env=None):
    return cli(["doctor", "--family", root, "--json"], env=env)


def lines(text: str, prefix: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(prefix)]


def without(snap: dict, *names: str) -> dict:
    return {k: v for k, v in snap.items() if k not in names}


# -- 1. planted journals: verified, set aside when they do not check out, the family untouched ----------------
def _j(manifest=None, renames=(), **extra):
    return {"pid": 999999, "renames": [list(r) for r in renames], "manifest": manifest, **extra}


def _empty_variants(root):
    return _j({"variants": {}})


def _no_parent(root):
    m = manifest_of(root)
    for rendering in ("f16", "bf16"):
        m["variants"].pop(rendering, None)
    return _j(m)


def _parent_null(root):
    m = manifest_of(root)
    m["variants"]["f16"] = None
    return _j(m)


def _rename_non_temp(root):
    return _j(manifest_of(root), [(Q8, Q4)])


def _rename_outside(root):
    return _j(manifest_of(root), [(temp_for(root, "x.gguf", root / Q8), "../x.gguf")])


def _rename_absolute(root):
    return _j(manifest_of(root), [(temp_for(root, "x.gguf", root / Q8), "/tmp/x.gguf")])


def _temp_of_another_name(root):  # a temp file of Q8 renamed over Q4
    m = manifest_of(root)
    m["variants"]["q4"].update(size_bytes=(root / Q8).stat().st_size, type="q8_0")
    return _j(m, [(temp_for(root, Q8, root / Q8), Q4)])


def _rename_over_manifest(root):
    return _j(manifest_of(root), [(temp_for(root, MANIFEST, root / Q8), MANIFEST)])


def _rename_over_lock(root):
    return _j(manifest_of(root), [(temp_for(root, LOCK, root / Q8), LOCK)])


def _rename_over_log(root):  # a real GGUF temp file, to a name the manifest does not use
    return _j(manifest_of(root), [(temp_for(root, "quantize.log", root / Q8), "quantize.log")])


def _rename_twice(root):
    a = temp_for(root, Q8, root / Q8, pid=999998)
    b = temp_for(root, Q8, root / Q8, pid=999997)
    return _j(manifest_of(root), [(a, Q8), (b, Q8)])


def _temp_missing(root):
    m = manifest_of(root)
    m["variants"]["q8"]["path"] = "new-q8.gguf"
    return _j(m, [(temp_for(root, "new-q8.gguf"), "new-q8.gguf")])


def _temp_missing_old_final(root):  # the temp file is gone and the old file is still at its final name
    m = manifest_of(root)
    m["variants"]["q8"].update(size_bytes=(root / Q4).stat().st_size, type="q4_k_m")
    return _j(m, [(temp_for(root, Q8), Q8)])


def _temp_not_gguf(root):  # same size as the record says, zeros
    name = temp_for(root, Q8)
    with open(root / name, "wb") as f:
        f.truncate((root / Q8).stat().st_size)
    return _j(manifest_of(root), [(name, Q8)])


def _temp_truncated(root):
    name = temp_for(root, Q8)
    with open(root / Q8, "rb") as f:
        (root / name).write_bytes(f.read(4096))
    return _j(manifest_of(root), [(name, Q8)])


def _temp_symlink_out(root):
    outside = root.parent / "outside.gguf"
    put(outside, root / Q8)
    name = temp_for(root, Q8)
    (root / name).symlink_to(outside)
    return _j(manifest_of(root), [(name, Q8)])


def _temp_folder(root):
    name = temp_for(root, Q8)
    (root / name).mkdir()
    return _j(manifest_of(root), [(name, Q8)])


def _variant(**kw):
    def build(root):
        m = manifest_of(root)
        m["variants"]["q8"].update(**kw)
        return _j(m)
    return build


def _type_mismatch(root):
    m = manifest_of(root)
    m["variants"]["q4"]["type"] = "q8_0"
    return _j(m)


def _hparams(root):
    m = manifest_of(root)
    m["hparams"] = {"block_count": "many"}
    return _j(m)


def _imatrix(size_delta=0):
    def build(root):
        name = temp_for(root, "imatrix.gguf", root / Q4)
        m = manifest_of(root)
        m["imatrix"] = {"file": "imatrix.gguf", "size_bytes": (root / Q4).stat().st_size + size_delta}
        return _j(m, [(name, "imatrix.gguf")])
    return build


def _recipe(plan_text='{"role": "q4i"}'):
    """What quantize --types q4i commits: the recipe's GGUF and its grading plan."""
    def build(root):
        gguf, plan = f"{STEM}-q4i.gguf", f"{STEM}-q4i.plan.json"
        g = temp_for(root, gguf, root / Q4)
        p = temp_for(root, plan)
        (root / p).write_text(plan_text)
        m = manifest_of(root)
        m["variants"]["q4i"] = {**m["variants"]["q4"], "type": "q4i", "path": gguf, "grade": {"plan_file": plan}}
        return _j(m, [(g, gguf), (p, plan)])
    return build


JOURNALS = [
    ("empty-variants", _empty_variants, "manifest has no variants"),
    ("manifest-null", lambda r: _j(None), "no manifest"),
    ("no-parent", _no_parent, "has no parent (f16 or bf16 or own variant)"),
    ("parent-null", _parent_null, "its f16 variant: its manifest record is null"),
    ("renames-not-a-list", lambda r: {**_j(manifest_of(r)), "renames": "all"}, "no renames"),
    ("rename-non-temp", _rename_non_temp, "bad rename"),
    ("rename-outside", _rename_outside, "bad rename"),
    ("rename-absolute", _rename_absolute, "bad rename"),
    ("temp-of-another-name", _temp_of_another_name, "bad rename"),
    ("rename-over-manifest", _rename_over_manifest, "bad rename"),
    ("rename-over-lock", _rename_over_lock, "bad rename"),
    ("rename-over-log", _rename_over_log, "to quantize.log, which its manifest does not name"),
    ("rename-twice", _rename_twice, "is renamed to twice"),
    ("temp-missing", _temp_missing, "is gone"),
    ("temp-missing-old-final", _temp_missing_old_final, "the manifest says"),
    ("temp-not-gguf", _temp_not_gguf, "not a GGUF file"),
    ("temp-truncated", _temp_truncated, "the manifest says"),
    ("temp-symlink-out", _temp_symlink_out, "is not a regular file"),
    ("temp-folder", _temp_folder, "is not a regular file"),
    ("variant-dotdot", _variant(path="../../../etc/passwd"), "its q8 variant: path '../../../etc/passwd' climbs out"),
    ("variant-absolute", _variant(path="/etc/passwd"), "is absolute"),
    ("variant-size", _variant(size_bytes=12345), "bytes, the manifest says 12345"),
    ("variant-missing", _variant(path="gone.gguf"), "gone.gguf is missing"),
    ("variant-type", _type_mismatch, "its weights are Q4_K_M, the manifest says Q8_0"),
    ("hparams", _hparams, "\"hparams\" must map names"),
    ("imatrix-size", _imatrix(1), "imatrix.gguf: "),
    ("plan-not-json", _recipe("{plan"), "q4i.plan.json: not a grading plan"),
]


@pytest.mark.parametrize("build,needle", [j[1:] for j in JOURNALS], ids=[j[0] for j in JOURNALS])
def test_planted_journal_is_set_aside_not_obeyed(fam, build, needle):
    text = json.dumps(build(fam))
    (fam / JOURNAL).write_text(text)
    before = snapshot(fam)
    r = doctor(fam)
    assert r.exit_code == 0, r.stderr  # the family, untouched, is fine
    warnings = lines(r.stderr, "warning:")
    assert len(warnings) == 1 and "ignored an invalid update journal" in warnings[0], r.stderr
    assert needle in warnings[0] and UNUSABLE_JOURNAL in warnings[0], (needle, warnings[0])
    assert not lines(r.stderr, "error:") and "Traceback" not in r.stderr
    after = snapshot(fam)
    assert without(after, UNUSABLE_JOURNAL) == without(before, JOURNAL)  # the lock file is gone again too
    assert (fam / UNUSABLE_JOURNAL).read_text() == text
    assert doctor(fam).stderr == ""  # set aside once: the next command is quiet


RAW_JOURNALS = [
    ("not-json", "{not json", "Expecting property name"),
    ("a-list", "[1, 2]", "a JSON list, not an object"),
    ("dup-variants", '{"renames": [], "manifest": {"variants": {"f16": {}}, "variants": {}}}',
     "duplicate key 'variants'"),
    ("dup-renames", '{"renames": [], "renames": [], "manifest": {}}', "duplicate key 'renames'"),
    ("dup-role", '{"renames": [], "manifest": {"variants": {"f16": {}, "f16": {}}}}', "duplicate key 'f16'"),
    ("deep", "[" * 100000 + "]" * 100000, "nested too deeply"),
    ("not-utf8", b'{"pid": "\xff"}', "not UTF-8"),
]


@pytest.mark.parametrize("text,needle", [j[1:] for j in RAW_JOURNALS], ids=[j[0] for j in RAW_JOURNALS])
def test_unreadable_journal_is_set_aside(fam, text, needle):
    data = text if isinstance(text, bytes) else text.encode()
    (fam / JOURNAL).write_bytes(data)
    before = snapshot(fam)
    r = doctor(fam)
    assert r.exit_code == 0 and "Traceback" not in r.stderr, r.stderr
    warnings = lines(r.stderr, "warning:")
    assert len(warnings) == 1 and needle in warnings[0], r.stderr
    assert without(snapshot(fam), UNUSABLE_JOURNAL) == without(before, JOURNAL)
    assert (fam / UNUSABLE_JOURNAL).read_bytes() == data


def test_journal_symlink_is_not_followed(fam, tmp_path):
    outside = tmp_path / "journal.json"
    outside.write_text(json.dumps(_empty_variants(fam)))
    (fam / JOURNAL).symlink_to(outside)
    before = snapshot(fam)
    r = doctor(fam)
    assert r.exit_code == 0 and "it is a symbolic link" in r.stderr, r.stderr
    assert (fam / UNUSABLE_JOURNAL).is_symlink() and outside.read_text() == json.dumps(_empty_variants(fam))
    assert without(snapshot(fam), UNUSABLE_JOURNAL) == without(before, JOURNAL)


def test_an_older_unusable_journal_is_replaced(fam):
    (fam / UNUSABLE_JOURNAL).write_text("older")
    (fam / JOURNAL).write_text(json.dumps(_empty_variants(fam)))
    assert doctor(fam).exit_code == 0
    assert json.loads((fam / UNUSABLE_JOURNAL).read_text()) == _empty_variants(fam)
    assert not (fam / JOURNAL).exists()


@pytest.mark.parametrize("command", ["route", "chat"])
def test_probe_empty_journal_no_longer_breaks_the_family(fam, command):
    """The probe: an empty-variants journal planted in a good family used to replace its manifest."""
    (fam / JOURNAL).write_text(json.dumps(_empty_variants(fam)))
    m = (fam / MANIFEST).read_bytes()
    r = cli([command, "--family", fam, "--policy", "parent", "--max-tokens", "1", "--json", "Hi"]) \
        if command == "chat" else cli(["route", "--family", fam, "--json", "Hi"])
    assert r.exit_code == 0, r.stderr
    assert (fam / MANIFEST).read_bytes() == m and not (fam / PREV_MANIFEST).exists()


# -- a real commit interrupted before its roll-forward is still finished --------------------------------------
def _interrupted_commit(root: Path, monkeypatch, renames, manifest) -> None:
    """commit() as the code does it, dying (an OSError) right before the roll-forward: the journal stays."""
    from specquant_cli.errors import FamilyError
    from specquant_cli.family import journal as fm

    real = fm._roll_forward

    def die_once(*a, **k):
        monkeypatch.setattr(fm, "_roll_forward", real)
        raise OSError(5, "simulated death")

    monkeypatch.setattr(fm, "_roll_forward", die_once)
    with pytest.raises(FamilyError, match="stopped half way"):
        fm.commit(root, renames, manifest)
    assert (root / JOURNAL).exists() and not (root / LOCK).exists()


def _new_q8(root: Path) -> tuple[list, dict]:
    """An update: the q8 role gets the q4 file's content (as type q4_k_m), and a note."""
    from specquant_cli.fsutil import create_temp, fingerprint

    fd, tmp = create_temp(root / Q8)
    os.close(fd)
    put(tmp, root / Q4)
    m = manifest_of(root)
    m["variants"]["q8"].update(size_bytes=tmp.stat().st_size, type="q4_k_m", fingerprint=fingerprint(tmp),
                              sha256=hashlib.sha256(tmp.read_bytes()).hexdigest())
    m["notes"]["marker"] = "new"
    return [(tmp, root / Q8)], m


@pytest.mark.parametrize("state", ["nothing-renamed", "renamed", "manifest-written"])
def test_interrupted_real_commit_is_finished(fam, monkeypatch, state):
    old = (fam / MANIFEST).read_bytes()
    renames, m = _new_q8(fam)
    _interrupted_commit(fam, monkeypatch, renames, m)
    if state in ("renamed", "manifest-written"):  # died after the rename (and after writing the manifest)
        os.replace(renames[0][0], fam / Q8)
    if state == "manifest-written":
        (fam / PREV_MANIFEST).write_bytes(old)
        (fam / MANIFEST).unlink()
        (fam / MANIFEST).write_text(json.dumps(m))
    r = doctor(fam)
    assert r.exit_code == 0, r.stderr
    assert lines(r.stderr, "warning:") == [f"warning: {fam}: finished an update that an interrupted process left "
                                           "half done"], r.stderr
    assert manifest_of(fam) == m and not (fam / JOURNAL).exists() and not (fam / LOCK).exists()
    assert (fam / PREV_MANIFEST).read_bytes() == old  # never the new manifest, even when it was already written
    assert not renames[0][0].exists() and (fam / Q8).stat().st_size == (fam / Q4).stat().st_size


@pytest.mark.parametrize("build", [_imatrix(), _recipe()], ids=["imatrix", "recipe"])
def test_journal_of_other_commits_is_finished(fam, build):
    """calibrate-activations commits imatrix.gguf, a recipe its GGUF and grading plan: named by the manifest."""
    j = build(fam)
    (fam / JOURNAL).write_text(json.dumps(j))
    r = doctor(fam)
    assert r.exit_code == 0 and "finished an update" in r.stderr, r.stderr
    assert manifest_of(fam) == j["manifest"]
    assert all(not (fam / t).exists() and (fam / f).is_file() for t, f in j["renames"])


def test_previous_manifest_is_kept_until_the_next_commit(fam):
    from specquant_cli.family.journal import commit

    m0 = (fam / MANIFEST).read_bytes()
    m1 = {**manifest_of(fam), "notes": {"n": 1}}
    commit(fam, [], m1)
    assert (fam / PREV_MANIFEST).read_bytes() == m0 and manifest_of(fam) == m1
    m2 = {**m1, "notes": {"n": 2}}
    commit(fam, [], m2)
    assert json.loads((fam / PREV_MANIFEST).read_text()) == m1 and manifest_of(fam) == m2
    assert not (fam / LOCK).exists() and not (fam / JOURNAL).exists()


# -- 2. the family's lock: an OS lock, not a pid -----------------------------------------------------------
HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(fam):
    """Another live process holding the family's lock."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(fam / LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        yield p
    finally:
        p.kill()
        p.wait()


def _valid_journal(root: Path, rnd: str = "0123abcd") -> dict:
    name = temp_for(root, Q8, root / Q8, rnd=rnd)
    m = manifest_of(root)
    m["notes"]["marker"] = "finished"
    return _j(m, [(name, Q8)])


@pytest.mark.parametrize("journal", ["valid", "invalid"])
def test_lock_held_by_a_live_process_is_a_clear_error(fam, holder, journal):
    j = _valid_journal(fam) if journal == "valid" else _empty_variants(fam)
    (fam / JOURNAL).write_text(json.dumps(j))
    before = snapshot(fam)
    assert_clean_error(doctor(fam), 1, str(fam), "is being updated by another process")
    assert snapshot(fam) == before  # not judged, not set aside, not finished while its writer may be at work
    holder.kill()
    holder.wait()  # the kernel drops a dead holder's lock
    r = doctor(fam)
    assert r.exit_code == 0, r.stderr
    assert not (fam / JOURNAL).exists() and not (fam / LOCK).exists()
    if journal == "valid":
        assert manifest_of(fam)["notes"]["marker"] == "finished"


def test_commit_is_refused_while_another_process_holds_the_lock(fam, holder):
    from specquant_cli.errors import FamilyError
    from specquant_cli.family.journal import commit

    before = snapshot(fam)
    with pytest.raises(FamilyError, match="is being updated by another process"):
        commit(fam, [], {**manifest_of(fam), "notes": {}})
    assert snapshot(fam) == before


def test_lock_file_of_a_dead_process_is_free(fam):
    (fam / LOCK).write_text("")  # left by a process killed while it held it
    (fam / JOURNAL).write_text(json.dumps(_valid_journal(fam)))
    r = doctor(fam)
    assert r.exit_code == 0 and "finished an update" in r.stderr, r.stderr
    assert manifest_of(fam)["notes"]["marker"] == "finished" and not (fam / LOCK).exists()


@pytest.mark.parametrize("rnd", ["0123abcd", "84721061"])
def test_planted_valid_journal_is_finished(fam, rnd):
    """A temp name whose random part is all decimal digits (1 in 43 of them) is still one of ours."""
    j = _valid_journal(fam, rnd)
    (fam / JOURNAL).write_text(json.dumps(j))
    r = doctor(fam)
    assert r.exit_code == 0 and "finished an update" in r.stderr, r.stderr
    assert manifest_of(fam) == j["manifest"] and not (fam / j["renames"][0][0]).exists()


def test_a_live_temp_with_a_decimal_random_part_is_not_removed(tmp_path):
    from specquant_cli.fsutil import remove_stale

    live, dead = tmp_path / f".x.gguf.{os.getpid()}.84721061.part", tmp_path / ".x.gguf.999999.84721061.part"
    live.write_bytes(b"")
    dead.write_bytes(b"")
    assert remove_stale(tmp_path, "x.gguf") == [dead] and live.exists()


@pytest.mark.parametrize("pid", [1, os.getppid(), 2**31 - 1])
def test_journal_naming_a_live_unrelated_pid_is_finished(fam, pid):
    """The probe: pid 1 is always alive; it used to lock the family for good."""
    (fam / JOURNAL).write_text(json.dumps({**_valid_journal(fam), "pid": pid}))
    r = doctor(fam)
    assert r.exit_code == 0 and "finished an update" in r.stderr, r.stderr
    assert manifest_of(fam)["notes"]["marker"] == "finished" and not (fam / JOURNAL).exists()


def test_planted_lock_symlink_is_not_followed(fam, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (fam / LOCK).symlink_to(victim)
    (fam / JOURNAL).write_text(json.dumps(_valid_journal(fam)))
    before = snapshot(fam)
    assert_clean_error(doctor(fam), 1, LOCK, "is a symbolic link")
    assert snapshot(fam) == before and victim.read_text() == "precious\n"


def test_lock_that_is_a_folder_is_refused(fam):
    (fam / LOCK).mkdir()
    (fam / JOURNAL).write_text(json.dumps(_valid_journal(fam)))
    before = snapshot(fam)
    assert_clean_error(doctor(fam), 1, LOCK, "not a regular file")
    assert snapshot(fam) == before


def test_loading_without_a_journal_takes_no_lock(fam, holder):
    """A family being updated (its lock held) loads for reading; nothing is created by looking."""
    before = snapshot(fam)
    assert doctor(fam).exit_code == 0
    assert snapshot(fam) == before


@pytest.fixture
def read_only_lock(monkeypatch):
    """The lock file cannot be created (a read-only folder, which root cannot make with chmod)."""
    import errno

    real = os.open

    def fake(path, *a, **k):
        if os.fspath(path).endswith(LOCK):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(path, *a, **k)

    monkeypatch.setattr(os, "open", fake)


@pytest.mark.parametrize("journal", ["none", "invalid", "valid"])
def test_read_only_folder(fam, read_only_lock, journal):
    if journal != "none":
        (fam / JOURNAL).write_text(json.dumps(_valid_journal(fam) if journal == "valid" else _empty_variants(fam)))
    before = snapshot(fam)
    r = doctor(fam)
    if journal == "valid":  # it cannot be finished here, and the family it describes is not the one on disk
        assert_clean_error(r, 1, "cannot open the family's lock", "Read-only file system", "cannot be finished")
    else:
        assert r.exit_code == 0, r.stderr
        assert ("ignored an invalid update journal" in r.stderr) == (journal == "invalid"), r.stderr
    assert snapshot(fam) == before


def test_lock_is_reentrant_in_a_thread_and_exclusive_across_threads(fam):
    from specquant_cli.errors import FamilyError
    from specquant_cli.family.journal import commit
    from specquant_cli.family.lock import family_lock

    seen = []

    def other():
        try:
            with family_lock(fam):
                seen.append("taken")
        except FamilyError as e:
            seen.append(str(e))

    with family_lock(fam):
        commit(fam, [], {**manifest_of(fam), "notes": {"n": 1}})  # re-entrant: the caller holds it
        assert (fam / LOCK).exists()
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(seen) == 1 and "being updated by another process" in seen[0]
    assert not (fam / LOCK).exists() and manifest_of(fam)["notes"] == {"n": 1}


# -- 3. duplicate keys in a manifest are refused --------------------------------------------------------------
def _dup(root: Path, where: str) -> str:
    text = (root / MANIFEST).read_text()
    m = json.loads(text)
    if where == "variants":  # a second "variants" with one role
        return text.rstrip().rstrip("}") + ', "variants": {"f16": ' + json.dumps(m["variants"]["f16"]) + "}}"
    if where == "f16":
        return text.replace('"variants": {', '"variants": {"f16": ' + json.dumps(m["variants"]["q8"]) + ", ", 1)
    if where == "path":
        return text.replace('"path": "' + F16 + '"', '"path": "' + F16 + '", "path": "' + Q8 + '"', 1)
    if where == "size_bytes":
        size = m["variants"]["f16"]["size_bytes"]
        assert f'"size_bytes": {size}' in text
        return text.replace(f'"size_bytes": {size}', f'"size_bytes": 1, "size_bytes": {size}', 1)
    raise AssertionError(where)


@pytest.mark.parametrize("where", ["variants", "f16", "path", "size_bytes"])
@pytest.mark.parametrize("command", ["doctor", "chat"])
def test_duplicate_manifest_key_is_refused(fam, where, command):
    write_text_manifest(fam, _dup(fam, where))
    before = snapshot(fam)
    args = ["doctor", "--family", fam] if command == "doctor" else ["chat", "--family", fam, "--policy", "parent",
                                                                     "--max-tokens", "1", "Hi"]
    assert_clean_error(cli(args), 1, "unreadable manifest", f"duplicate key '{where}'")
    assert snapshot(fam) == before


def test_deeply_nested_manifest_is_one_line(fam):
    write_text_manifest(fam, '{"variants": ' + "[" * 100000 + "]" * 100000 + "}")
    assert_clean_error(doctor(fam), 1, "unreadable manifest", "nested too deeply")


def test_read_existing_names_a_duplicate_key(fam):
    """What quantize reads to keep the old manifest's keys: a duplicate makes it unusable (set aside, rebuilt)."""
    from specquant_cli.family.manifest_file import read_existing

    write_text_manifest(fam, '{"a": 1, "a": 2}')
    assert read_existing(fam) == (None, "duplicate key 'a'")


# -- 4. a variant swapped for another type's file is refused at load ------------------------------------------
SWAPS = [  # (role whose file is replaced, by which file, policy that loads it, type found, type the manifest says)
    ("q4", Q8, "spec-q4", "Q8_0", "Q4_K_M"),
    ("q4", Q8, "q4", "Q8_0", "Q4_K_M"),
    ("q8", Q4, "spec-q8", "Q4_K_M", "Q8_0"),
    ("f16", Q8, "parent", "Q8_0", "F16"),
]


@pytest.mark.parametrize("role,src,policy,got,want", SWAPS, ids=[f"{s[0]}-{s[2]}" for s in SWAPS])
def test_type_swapped_variant_is_refused_by_chat(fam, role, src, policy, got, want):
    m = manifest_of(fam)
    rec = m["variants"][role]
    put(fam / rec["path"], fam / src)  # another type's file under this role's name,
    rec["size_bytes"] = (fam / src).stat().st_size  # and the size edited to match
    write_manifest(fam, m)
    before = snapshot(fam)
    r = cli(["chat", "--family", fam, "--policy", policy, "--max-tokens", "1", "--json", "Hi"])
    line = assert_clean_error(r, 1, f"{role} variant unusable", f"its weights are {got}, the manifest says {want}")
    assert rec["path"] in line and r.stdout == ""
    assert snapshot(fam) == before
    assert_clean_error(doctor(fam), 1, "1 of 4 variants broken", f"{role}: ")


def test_recipe_roles_are_not_type_checked(fam):
    """A recipe role's type is a label (q4i, q3g...), not a llama.cpp file type: nothing to compare."""
    from specquant_cli.family.manifest import Family

    m = manifest_of(fam)
    m["variants"]["q4i"] = {**m["variants"]["q4"], "type": "q4i"}
    write_manifest(fam, m)
    assert Family.load(fam).problem("q4i") is None


def test_file_type_read_is_a_header_read(demo):
    from specquant_cli.family import gguf_read, gguf_walk

    for name, want in ((F16, "F16"), (Q4, "Q4_K_M"), (Q8, "Q8_0")):
        gguf_walk._file_types.clear()
        t0 = time.perf_counter()
        assert gguf_walk.read_file_type(demo / name) == want == gguf_read.read_info(demo / name).file_type
        assert time.perf_counter() - t0 < 0.5  # ~10 ms measured on a busy 2-core machine (read_info: ~100 ms)


@pytest.mark.parametrize("cut", [30, 200, 20000, 800000])
def test_file_type_of_a_truncated_header_is_one_line(tmp_path, demo, cut):
    from specquant_cli.errors import ModelFileError
    from specquant_cli.family import gguf_walk

    p = tmp_path / "cut.gguf"
    with open(demo / Q8, "rb") as f:
        p.write_bytes(f.read(cut))
    with pytest.raises(ModelFileError, match="truncated or corrupt GGUF"):
        gguf_walk.read_file_type(p)


# -- 5. thread counts: 0 (every core) or 1 .. 4 x logical cores, from any source ---------------------------------
BAD_ENV = [("-1", "expected 0 or a positive integer"), ("abc", "expected an integer"), (" 4", "expected an integer"),
           ("\u0664", "expected an integer"), ("100000", f"at most {LIMIT} threads"),
           ("4096", f"at most {LIMIT} threads"), (str(LIMIT + 1), f"at most {LIMIT} threads"),
           ("9" * 5000, f"at most {LIMIT} threads")]


def _threads_from(value: str):
    from specquant_cli.settings import resolve

    return resolve(["runtime.threads"], environ={"SPECQUANT_THREADS": value}).runtime.threads


@pytest.mark.parametrize("value,needle", BAD_ENV, ids=["-1", "abc", "space", "arabic-4", "100000", "4096",
                                                      "limit+1", "5000-digits"])
def test_bad_specquant_threads_is_refused(value, needle):
    from specquant_cli.errors import InputError

    with pytest.raises(InputError) as e:
        _threads_from(value)
    assert needle in str(e.value) and str(e.value).startswith("SPECQUANT_THREADS=") and "\n" not in str(e.value)
    assert len(str(e.value)) < 200


@pytest.mark.parametrize("value", ["100000", "4096", str(LIMIT + 1), "-1", "abc"])
def test_bad_specquant_threads_chat_is_one_line(fam, value):
    r = cli(["chat", "--family", fam, "--policy", "parent", "--max-tokens", "1", "Hi"],
            env={"SPECQUANT_THREADS": value})
    line = assert_clean_error(r, 1, "SPECQUANT_THREADS=")
    if value.isdigit() and int(value) > LIMIT:
        assert line == f"error: SPECQUANT_THREADS={value}: at most {LIMIT} threads on this machine " \
                       f"(4 × {CORES} logical cores)"


@pytest.mark.parametrize("value", ["1", str(LIMIT), "", "01", "0"])
def test_good_specquant_threads_is_accepted(value):
    # 0 means every core wherever it is set (flag, variable, specquant.toml); unset is the default, 0
    assert _threads_from(value) == (int(value) if value.strip("0") else CORES)


def test_context_refuses_too_many_threads_before_llama_sees_them():
    from specquant_cli.backend.llama import Context
    from specquant_cli.errors import InputError

    with pytest.raises(InputError, match=f"at most {LIMIT} threads"):
        Context(object(), n_ctx=256, n_threads=100000)  # refused before the model is touched


THREAD_OPTIONS = [  # a command whose --threads is bounded; args that then fail for another reason (no model run)
    ("quantize", ["quantize", "/nonexistent.gguf", "--out", "OUT"], "no such file"),
    ("pull", ["pull", "no-such-family", "--models-dir", "OUT"], "no-such-family"),
    ("serve", ["serve", "--family", "/nonexistent/fam"], "no model family"),
    ("calibrate-activations", ["calibrate-activations", "--family", "/nonexistent/fam"], "no model family"),
]


@pytest.mark.parametrize("value", ["100000", str(LIMIT + 1)])
@pytest.mark.parametrize("name,args,_", THREAD_OPTIONS, ids=[t[0] for t in THREAD_OPTIONS])
def test_too_many_threads_option_is_refused(tmp_path, name, args, _, value):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    line = assert_clean_error(cli([*args, "--threads", value]), 2, "--threads", f"{value}: at most {LIMIT} threads")
    assert f"(4 × {CORES} logical cores)" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name,args,needle", THREAD_OPTIONS, ids=[t[0] for t in THREAD_OPTIONS])
def test_threads_option_at_the_limit_is_accepted(tmp_path, name, args, needle):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    assert_clean_error(cli([*args, "--threads", str(LIMIT)]), 1, needle)  # past the option, refused later


# -- a model truncated in place ----------------------------------------------------------------------------------------
def test_a_model_truncated_in_place_is_an_error_not_sigbus(family_dir, tmp_path):
    import shutil

    fam = tmp_path / "fam"
    fam.mkdir()
    for p in family_dir.iterdir():
        if p.name == "manifest.json" or p.name.endswith("-f16.gguf"):
            shutil.copy(p, fam / p.name)  # a copy: the truncation must not reach the shared family's file
        elif p.suffix == ".gguf":
            os.link(p, fam / p.name)
    f16 = fam / "smollm2-135m-f16.gguf"
    with open(f16, "r+b") as f:
        f.truncate(f16.stat().st_size // 2)
    p = subprocess.run([sys.executable, "-m", "specquant_cli", "chat", "--family", str(fam), "--policy", "parent",
                        "--max-tokens", "2", "hi"], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "SPECQUANT_MMAP": "1"})
    assert p.returncode == 1 and "truncated" in p.stderr and "Traceback" not in p.stderr, (p.returncode, p.stderr)
