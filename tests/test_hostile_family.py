"""A family is checked, not trusted: broken manifests and variants, path escapes, planted symlinks,
interrupted commits. `doctor --family` names every broken variant and exits 1; commands that load a
variant refuse it with one line; nothing is modified by looking."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from hostile_util import assert_clean_error, cli, copy_family, snapshot, tiny_llama

from conftest import run_cli


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """(family folder, a second family from another vocabulary) quantized from tiny fabricated GGUFs."""
    from specquant_cli.family.quantize import parse_types, quantize_family

    root = tmp_path_factory.mktemp("pristine")
    quantize_family(tiny_llama(root / "base-f16.gguf"), root / "fam", parse_types("q4_0,q8_0,f16"), threads=1)
    (root / "other").mkdir()
    quantize_family(tiny_llama(root / "other" / "base-f16.gguf", token_prefix="x"), root / "foreign",
                    parse_types("q4_0,q8_0,f16"), threads=1)
    return root / "fam", root / "foreign"


@pytest.fixture
def fam(pristine, tmp_path):
    return copy_family(pristine[0], tmp_path / "fam")


def edit_manifest(root: Path, fn) -> None:
    m = json.loads((root / "manifest.json").read_text())
    fn(m)
    (root / "manifest.json").write_text(json.dumps(m))


def doctor(root: Path, *extra):
    return cli(["doctor", "--family", root, "--json", *extra])


def test_pristine_family_is_healthy(fam):
    r = doctor(fam, "--verify")
    assert r.exit_code == 0, r.stderr
    assert all(v["ok"] for v in json.loads(r.stdout)["family"]["variants"].values())


# -- broken manifests: refused at load with one line ------------------------------------------------
MANIFESTS = [
    ("not json {", "unreadable manifest"),
    ("[1, 2, 3]", "a JSON list, not an object"),
    ("null", "a JSON NoneType, not an object"),
    ('"just a string"', "not an object"),
    ('{"family": "x"}', "manifest has no variants"),
    ('{"variants": []}', "manifest has no variants"),
    ('{"variants": {}}', "manifest has no variants"),
    ('{"variants": {"f16": {}}, "hparams": {"block_count": "many"}}', "\"hparams\" must map names"),
    ('{"variants": {"f16": {}}, "hparams": [1]}', "\"hparams\" must map names"),
    ('{"variants": {"f16": {}}, "family": 7}', "\"family\" must be a JSON string"),
    ('{"variants": {"f16": {}}, "base": "nope"}', "\"base\" must be a JSON object"),
]


@pytest.mark.parametrize("text,needle", MANIFESTS, ids=[f"manifest{i}" for i in range(len(MANIFESTS))])
@pytest.mark.parametrize("command", ["doctor", "route", "chat"])
def test_broken_manifest_refused(fam, text, needle, command):
    (fam / "manifest.json").write_text(text)
    before = snapshot(fam)
    args = ["doctor", "--family", fam] if command == "doctor" else [command, "--family", fam, "hello"]
    assert_clean_error(cli(args), 1, "manifest", needle)
    assert snapshot(fam) == before


def test_manifest_not_utf8(fam):
    (fam / "manifest.json").write_bytes(b'{"family": "caf\xe9"}')
    assert_clean_error(doctor(fam), 1, "unreadable manifest", "not UTF-8 at byte")


def test_manifest_symlink_is_not_followed(fam, tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    (fam / "manifest.json").rename(elsewhere)
    (fam / "manifest.json").symlink_to(elsewhere)
    assert_clean_error(doctor(fam), 1, "unreadable manifest", "symbolic link")


# -- broken variants: doctor names each with its reason, exit 1 ---------------------------------------
def _escape_symlink(root, tmp):
    outside = tmp / "outside.gguf"
    outside.write_bytes((root / "fam-q8_0.gguf").read_bytes())
    (root / "evil.gguf").symlink_to(outside)
    edit_manifest(root, lambda m: m["variants"]["q8"].update(path="evil.gguf"))


def _escape_symlinked_folder(root, tmp):
    (tmp / "out").mkdir()
    (tmp / "out" / "fam-q8_0.gguf").write_bytes((root / "fam-q8_0.gguf").read_bytes())
    (root / "sub").symlink_to(tmp / "out")
    edit_manifest(root, lambda m: m["variants"]["q8"].update(path="sub/fam-q8_0.gguf"))


def _truncate(root, tmp):
    p = root / "fam-q8_0.gguf"
    p.write_bytes(p.read_bytes()[:1000])


def _same_size_garbage(root, tmp):
    p = root / "fam-q8_0.gguf"
    p.write_bytes(b"\0" * p.stat().st_size)


def _wrong_type(root, tmp):  # the q4 record points at the q8 file (size updated): parse shows Q8_0
    size = (root / "fam-q8_0.gguf").stat().st_size
    edit_manifest(root, lambda m: m["variants"]["q4"].update(path="fam-q8_0.gguf", size_bytes=size))


def _foreign_vocab(root, tmp, foreign):
    src = foreign / "foreign-q8_0.gguf"
    (root / "fam-q8_0.gguf").write_bytes(src.read_bytes())
    edit_manifest(root, lambda m: m["variants"]["q8"].update(size_bytes=src.stat().st_size))


def _loop(root, tmp):
    (root / "loop.gguf").symlink_to(root / "loop.gguf")
    edit_manifest(root, lambda m: m["variants"]["q8"].update(path="loop.gguf"))


def _dir(root, tmp):
    (root / "adir.gguf").mkdir()
    edit_manifest(root, lambda m: m["variants"]["q8"].update(path="adir.gguf"))


def _set(**kw):
    return lambda root, tmp: edit_manifest(root, lambda m: m["variants"]["q8"].update(**kw))


def _record(value):
    return lambda root, tmp: edit_manifest(root, lambda m: m["variants"].__setitem__("q8", value))


VARIANTS = [
    ("absolute", _set(path="/etc/passwd"), "q8", "is absolute"),
    ("absolute-inside", lambda r, t: edit_manifest(r, lambda m: m["variants"]["q8"].update(
        path=str(r / "fam-q8_0.gguf"))), "q8", "is absolute"),
    ("dotdot", _set(path="../../../../etc/passwd"), "q8", "climbs out of the family folder"),
    ("dotdot-inner", _set(path="sub/../../fam/fam-q8_0.gguf"), "q8", "climbs out"),
    ("backslash-dotdot", _set(path="..\\..\\x.gguf"), "q8", "climbs out"),
    ("symlink-out", _escape_symlink, "q8", "leads out of the family folder through a symbolic link"),
    ("symlinked-folder-out", _escape_symlinked_folder, "q8", "leads out of the family folder"),
    ("symlink-loop", _loop, "q8", "loop.gguf"),
    ("nul", _set(path="fam-q8_0.gguf\0.txt"), "q8", "NUL byte"),
    ("empty-path", _set(path=""), "q8", "no file path recorded"),
    ("path-number", _set(path=5), "q8", "no file path recorded"),
    ("missing", lambda r, t: (r / "fam-q8_0.gguf").unlink(), "q8", "fam-q8_0.gguf is missing"),
    ("truncated", _truncate, "q8", "the manifest says"),
    ("same-size-garbage", _same_size_garbage, "q8", "not a GGUF file"),
    ("folder", _dir, "q8", "not a regular file"),
    ("size-string", _set(size_bytes="big"), "q8", "size_bytes is missing"),
    ("size-negative", _set(size_bytes=-1), "q8", "size_bytes is missing"),
    ("size-bool", _set(size_bytes=True), "q8", "size_bytes is missing"),
    ("record-list", _record([1, 2]), "q8", "record is not an object"),
    ("record-null", _record(None), "q8", "record is null"),
    ("wrong-type", _wrong_type, "q4", "its weights are Q8_0, the manifest says Q4_0"),
    ("foreign-vocab", "foreign", "q8", "vocabulary differs from the parent's"),
    ("parent-missing", lambda r, t: (r / "base-f16.gguf").unlink(), "f16", "base-f16.gguf is missing"),
]


@pytest.mark.parametrize("name,breaker,role,needle", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_doctor_names_each_broken_variant(fam, pristine, tmp_path, name, breaker, role, needle):
    if breaker == "foreign":
        _foreign_vocab(fam, tmp_path, pristine[1])
    else:
        breaker(fam, tmp_path)
    before, outside_before = snapshot(fam), snapshot(tmp_path)
    r = doctor(fam)
    assert_clean_error(r, 1, "1 of 3 variants broken", f"{role}: ", needle)
    report = json.loads(r.stdout)
    bad = [k for k, v in report["family"]["variants"].items() if not v["ok"]]
    assert bad == [role]
    assert snapshot(fam) == before and snapshot(tmp_path) == outside_before  # looking changes nothing


def test_doctor_reports_every_broken_variant_at_once(fam):
    (fam / "fam-q4_0.gguf").unlink()
    _truncate(fam, None)
    line = assert_clean_error(doctor(fam), 1, "2 of 3 variants broken")
    assert "q4: fam-q4_0.gguf is missing" in line and "q8: fam-q8_0.gguf is " in line


def test_a_changed_file_is_caught_by_its_fingerprint_and_verify_names_the_sha256(fam):
    """Every load checks the content fingerprint (a few MiB sampled: the whole of a file this small), not the
    modification time; doctor --verify checks the full sha256."""
    import os

    p = fam / "fam-q8_0.gguf"
    st = p.stat()
    data = bytearray(p.read_bytes())
    data[-10] ^= 0xFF  # tensor data changed, size and header intact
    p.write_bytes(bytes(data))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # and its modification time put back
    assert_clean_error(doctor(fam), 1, "q8: ", "changed on disk after the family was made")
    assert_clean_error(doctor(fam, "--verify"), 1, "q8: ", "sha256 differs from the manifest")


def test_pull_does_not_call_a_changed_family_present(fam):
    from specquant_cli.family.fetch import present

    assert present(fam, renderings=("f16",)) is not None
    p = fam / "fam-q4_0.gguf"
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    assert present(fam) is None


@pytest.mark.parametrize("command", ["route", "chat"])
@pytest.mark.parametrize("breaker,needle", [
    (_set(path="/etc/passwd"), "is absolute"),
    (_set(path="../../../../etc/passwd"), "climbs out"),
    (_escape_symlink, "through a symbolic link"),
    (_truncate, "the manifest says"),
], ids=["absolute", "dotdot", "symlink", "truncated"])
def test_loading_a_broken_parent_is_refused(fam, tmp_path, command, breaker, needle):
    """The parent (f16) is what route and chat load first; a broken one is refused before llama.cpp sees it."""
    def to_parent(root, tmp):
        breaker(root, tmp)  # the breakers act on q8: move that record onto the f16 role
        edit_manifest(root, lambda m: m["variants"].__setitem__("f16", m["variants"]["q8"]))

    to_parent(fam, tmp_path)
    before = snapshot(tmp_path)
    assert_clean_error(cli([command, "--family", fam, "hello"]), 1, "f16 variant unusable", needle)
    assert snapshot(tmp_path) == before


# -- the commit journal: a killed commit is finished, an invalid journal ignored --------------------
def test_interrupted_commit_is_rolled_forward_on_load(fam):
    """State a SIGKILL between the journal and the last rename leaves: the next load finishes it."""
    from specquant_cli.family.manifest import Family
    from specquant_cli.fsutil import fingerprint, sha256_file
    from specquant_cli.names import JOURNAL

    new = fam / ".fam-q8_0.gguf.999999.0123abcd.part"  # pid 999999: a process that is gone
    new.write_bytes((fam / "fam-q4_0.gguf").read_bytes())  # some other valid content
    m = json.loads((fam / "manifest.json").read_text())
    m["variants"]["q8"].update(size_bytes=new.stat().st_size, sha256=sha256_file(new), type="q4_0",
                               fingerprint=fingerprint(new))
    m["notes"] = {"marker": "new"}
    (fam / JOURNAL).write_text(json.dumps({"pid": 999999, "renames": [[new.name, "fam-q8_0.gguf"]], "manifest": m}))
    f = Family.load(fam)
    assert f.manifest["notes"] == {"marker": "new"} and not new.exists() and not (fam / JOURNAL).exists()
    assert f.verify() == []


@pytest.mark.parametrize("journal", [
    "garbage", json.dumps({"pid": 999999, "renames": [["../../etc/passwd", "x"]], "manifest": {"variants": {}}}),
    json.dumps({"pid": 999999, "renames": [[".x.999999.part", "../escape"]], "manifest": {"variants": {}}}),
    json.dumps({"pid": 999999, "renames": [], "manifest": "nope"}),
], ids=["garbage", "tmp-escape", "final-escape", "no-manifest"])
def test_invalid_journal_is_ignored_not_obeyed(fam, tmp_path, journal):
    """Set aside as .unusable (its content kept for a look), the family untouched."""
    from specquant_cli.names import JOURNAL

    (fam / JOURNAL).write_text(journal)
    before = {k: v for k, v in snapshot(fam).items() if k != JOURNAL}
    r = doctor(fam)
    assert r.exit_code == 0 and "ignored an invalid update journal" in r.stderr, r.stderr
    after = snapshot(fam)
    aside = after.pop(JOURNAL + ".unusable")
    assert after == before
    assert aside[2] == hashlib.sha256(journal.encode()).hexdigest()


# -- a family without its parent is named as such ----------------------------------------------------------------------
@pytest.mark.parametrize("types", ["q8_0", "q4_0,q8_0"])
def test_a_family_without_its_parent_is_named_as_such(family_dir, tmp_path, types):
    out = tmp_path / "fam"
    r = run_cli(["quantize", str(family_dir / "smollm2-135m-f16.gguf"), "--out", str(out), "--types", types])
    assert r.exit_code == 0 and "no policy runs" in r.stderr, r.stderr
    assert "without its parent (an f16 or bf16 rendering" in r.stderr, r.stderr
    d = run_cli(["doctor", "--family", str(out)])
    assert_clean_error(d, 1, "parent: missing: the family has no parent")
    r = run_cli(["quantize", str(family_dir / "smollm2-135m-f16.gguf"), "--out", str(out), "--types", "f16"])
    assert r.exit_code == 0 and "without its parent" not in r.stderr  # added a type at a time
    assert run_cli(["doctor", "--family", str(out)]).exit_code == 0


def test_doctor_says_a_family_lacks_its_parent(family_dir, tmp_path):
    fam = tmp_path / "fam"
    fam.mkdir()
    m = json.loads((family_dir / "manifest.json").read_text())
    rec = m["variants"].pop("f16")
    m["variants"].pop("bf16")
    m["roles"] = {k: v for k, v in m.get("roles", {}).items() if k not in ("f16", "bf16")}
    for v in m["variants"].values():
        os.link(family_dir / v["path"], fam / v["path"])
    (fam / "manifest.json").write_text(json.dumps(m))
    r = run_cli(["doctor", "--family", str(fam)])
    assert r.exit_code == 1 and "no parent" in r.stderr, (r.stderr, rec["path"])
