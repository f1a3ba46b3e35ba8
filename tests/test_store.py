"""Families by name (family.store): --family NAME from any folder, `specquant list`, the default family's rules,
the old spellings (--out, --models-dir, ./models paths), an index that cannot be trusted, the user data folder."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from hostile_util import assert_clean_error, link_family, tiny_llama

from conftest import run_cli

TEST = "smollm2-135m"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny real family (F16 parent, Q8_0 draft), made once; tests copy it under the names they need."""
    from specquant_cli.family.quantize import parse_types, quantize_family

    root = tmp_path_factory.mktemp("tiny")
    quantize_family(tiny_llama(root / "tiny-f16.gguf"), root / "fam", parse_types("q8_0,f16"), threads=1)
    return root / "fam"


@pytest.fixture
def store(tmp_path) -> Path:
    """This test's models folder: $XDG_DATA_HOME/specquant/models (conftest isolates XDG_DATA_HOME)."""
    from specquant_cli.settings import models_dir

    return models_dir()


@pytest.fixture
def away(tmp_path, monkeypatch) -> Path:
    """A current folder with no ./models: not a checkout."""
    folder = tmp_path / "away"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def place(tiny: Path, folder: Path, age_s: int = 0) -> Path:
    """A copy of the tiny family at `folder`; its manifest made `age_s` seconds older."""
    shutil.copytree(tiny, folder)
    if age_s:
        m = folder / "manifest.json"
        t = m.stat().st_mtime - age_s
        os.utime(m, (t, t))
    return folder


def doctor_root(args) -> str:
    r = run_cli(["doctor", "--json", *map(str, args)])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)["family"]["root"]


def listed(*args) -> list[dict]:
    r = run_cli(["list", "--json", *map(str, args)])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


# -- the models folder ----------------------------------------------------------------------------------------------
def test_the_models_folder_is_in_the_user_data_folder(monkeypatch, tmp_path):
    from specquant_cli.settings import data_home, models_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_DATA_HOME", "relative/data")  # the XDG spec: a relative path is invalid, ignored
    assert data_home() == tmp_path / ".local" / "share" / "specquant"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert models_dir() == tmp_path / ".local" / "share" / "specquant" / "models"
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert models_dir() == tmp_path / "xdg" / "specquant" / "models"
    monkeypatch.setenv("SPECQUANT_MODELS", str(tmp_path / "mine"))
    assert models_dir() == tmp_path / "mine"


def test_quantize_with_a_name_makes_the_family_in_the_models_folder_found_from_anywhere(tiny, store, away,
                                                                                        tmp_path, monkeypatch):
    r = run_cli(["quantize", str(tiny / "tiny-f16.gguf"), "--family", "mine", "--types", "q8_0,f16",
                 "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    assert (store / "mine" / "manifest.json").is_file() and not (away / "mine").exists()
    assert "--family mine runs it from any folder (the default family)" in r.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert doctor_root(["--family", "mine"]) == str(store / "mine")
    [row] = listed()
    assert row["name"] == "mine" and row["default"] and row["found_in"] == "models folder"


def test_a_checkouts_models_folder_keeps_working_and_is_found_from_anywhere(tiny, store, tmp_path, monkeypatch):
    """pull FILE in a checkout makes models/NAME there (its scripts' paths), and records it: found by name
    from another folder."""
    checkout = tmp_path / "checkout"
    (checkout / "specquant_cli").mkdir(parents=True)
    (checkout / "specquant_cli" / "__init__.py").write_text("")
    (checkout / "models").mkdir()
    base = shutil.copy(tiny / "tiny-f16.gguf", tmp_path / "small-f16.gguf")
    monkeypatch.chdir(checkout)
    r = run_cli(["pull", str(base), "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    assert (checkout / "models" / "small" / "manifest.json").is_file() and not (store / "small").exists()
    assert doctor_root(["--family", "models/small"]) == "models/small"  # the path, as before
    away = tmp_path / "away"
    away.mkdir()
    monkeypatch.chdir(away)
    assert doctor_root(["--family", "small"]) == str(checkout / "models" / "small")
    assert [(x["name"], x["found_in"], x["default"]) for x in listed()] == [("small", "index", True)]


def test_old_spellings_still_work_and_are_not_shown(tiny, store, away, tmp_path):
    out = tmp_path / "out" / "fam"
    r = run_cli(["quantize", str(tiny / "tiny-f16.gguf"), "--out", str(out), "--types", "q8_0,f16", "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    assert (out / "manifest.json").is_file()
    r = run_cli(["quantize", str(tiny / "tiny-f16.gguf"), "--out", "plain", "--types", "q8_0,f16", "--threads", "1"])
    assert r.exit_code == 0 and (away / "plain" / "manifest.json").is_file()  # --out is a path, as it always was
    models = tmp_path / "dir"
    r = run_cli(["pull", str(tiny / "tiny-f16.gguf"), "--models-dir", str(models), "--threads", "1"])
    assert r.exit_code == 0, r.stderr
    assert (models / "tiny" / "manifest.json").is_file()
    assert doctor_root(["--family", "tiny"]) == str(models / "tiny")  # recorded in the models folder's index
    assert_clean_error(run_cli(["quantize", str(tiny / "tiny-f16.gguf"), "--out", str(out), "--family", "x"]), 2,
                       "--out")
    assert "--out" not in run_cli(["quantize", "--help"]).stdout
    assert "--models-dir" not in run_cli(["pull", "--help"]).stdout


def test_the_models_setting_says_where_pull_makes_families(tiny, away, tmp_path):
    mine = tmp_path / "mine"
    r = run_cli(["pull", str(tiny / "tiny-f16.gguf"), "--threads", "1"], env={"SPECQUANT_MODELS": str(mine)})
    assert r.exit_code == 0, r.stderr
    assert (mine / "tiny" / "manifest.json").is_file()
    assert [x["name"] for x in listed("--models", mine)] == ["tiny"]
    assert listed() == []  # another models folder: the default one knows nothing of it


def test_an_unknown_name_is_one_line_naming_the_known_ones(tiny, store, away):
    place(tiny, store / "alpha")
    err = assert_clean_error(run_cli(["doctor", "--family", "nope"]), 1, "'nope'", "alpha", "specquant pull")
    assert "specquant list" in err
    assert_clean_error(run_cli(["chat", "--family", "sub/nope", "hi"]), 1, "no model family at sub/nope")  # a path


# -- specquant list -------------------------------------------------------------------------------------------------
def test_list_shows_each_family_with_parent_drafts_size_calibration_and_folder(tiny, store, away):
    from specquant_cli.family.store import remember

    place(tiny, store / "b-fam")
    a = place(tiny, away / "models" / "a-fam")
    remember(store, a, away)
    r = run_cli(["list"])
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "PARENT", "DRAFTS", "SIZE", "CALIBRATED", "FROM", "FOLDER"]
    assert re.fullmatch(r"\* a-fam\s+llama \d+K F16\s+q8\s+\d\.\d\d GiB\s+no\s+-\s+" + re.escape(str(a)), lines[1])
    assert re.fullmatch(r"  b-fam\s+llama \d+K F16\s+q8\s+\d\.\d\d GiB\s+no\s+-\s+" + re.escape(str(store / "b-fam")),
                        lines[2])
    assert len(lines) == 3 and r.stderr == ""
    rows = {x["name"]: x for x in listed()}
    assert rows["a-fam"]["default"] and not rows["b-fam"]["default"]
    assert rows["a-fam"]["found_in"] == "./models" and rows["a-fam"]["folder"] == str(a)
    b = rows["b-fam"]
    assert (b["architecture"], b["parent"], b["drafts"], b["calibrated"]) == ("llama", ["F16"], ["q8"], False)
    assert b["size_bytes"] == sum(p.stat().st_size for p in (store / "b-fam").iterdir() if p.is_file())


def test_list_says_a_family_is_calibrated_for_this_machine(tiny, store, away):
    from specquant_cli.settings import cores
    from specquant_cli.system import calibration_file as cal
    from specquant_cli.system import hardware
    from specquant_cli.system.calibration import Calibration
    fam = place(tiny, store / "fam")
    assert listed()[0]["calibrated"] is False
    fp = cal.fingerprint(hardware.detect(), cores(), None, parent="f16")  # list's: every core, no RPC
    cal.save(fam, fp, Calibration(parent_call_s={1: 0.01, 2: 0.015}))
    [row] = listed()
    assert row["calibrated"] is True and row["calibrated_renderings"] == ["f16"]
    assert run_cli(["list"]).stdout.split()[-3:-1] == ["yes", "-"]  # calibrated; no source recorded


def test_list_with_nothing_pulled_prints_no_data(away):
    r = run_cli(["list"])
    assert r.exit_code == 0 and r.stdout == "" and "specquant pull" in r.stderr
    assert listed() == []


# -- the default family ---------------------------------------------------------------------------------------------
def test_the_default_is_the_family_pulled_or_quantized_last(tiny, store, away):
    from specquant_cli import session
    from specquant_cli.family.store import remember

    a, b = place(tiny, store / "a"), place(tiny, away / "b")
    remember(store, a, away)
    remember(store, b, away)
    said = []
    assert session.load_family(None, say=said.append).root == b
    assert "pulled or quantized last" in said[0] and str(b) in said[0]
    remember(store, a, away)
    assert session.load_family(None).root == a


def test_a_configured_family_wins_over_the_one_pulled_last(tiny, store, away):
    from specquant_cli.family.store import remember

    place(tiny, store / "a")
    remember(store, place(tiny, store / "b"), away)
    assert [x["name"] for x in listed() if x["default"]] == ["b"]
    r = run_cli(["list", "--json"], env={"SPECQUANT_FAMILY": "a"})
    assert [x["name"] for x in json.loads(r.stdout) if x["default"]] == ["a"]
    (away / "specquant.toml").write_text('[runtime]\nfamily = "a"\n')
    assert [x["name"] for x in listed() if x["default"]] == ["a"]


def test_the_test_family_is_never_the_default_while_another_is_there(tiny, store, away):
    from specquant_cli.family.store import default_family, remember

    test, big = place(tiny, store / TEST), place(tiny, store / "big", age_s=100)
    assert remember(store, big, away) is True
    assert remember(store, test, away) is False  # the set-up scripts pull it on every run: the default stays
    assert default_family(store, away)[0] == big
    index = json.loads((store / "families.json").read_text())
    index["default"] = str(test)  # recorded earlier, when it was the only one
    (store / "families.json").write_text(json.dumps(index))
    root, why = default_family(store, away)
    assert root == big and TEST in why
    shutil.rmtree(big)
    assert default_family(store, away)[0] == test  # the only family: it is the one


def test_without_a_recorded_default_the_family_made_last_runs(tiny, store, away):
    from specquant_cli.family.store import default_family

    place(tiny, store / "old", age_s=200)
    place(tiny, store / "new", age_s=100)
    place(tiny, store / TEST)  # newest, but the test family
    root, why = default_family(store, away)
    assert root.name == "new" and why.startswith("made last")


def test_nothing_found_names_the_pull_command(store, away):
    from specquant_cli import session
    from specquant_cli.errors import FamilyError

    with pytest.raises(FamilyError, match="specquant pull smollm2-135m"):
        session.load_family(None)


@pytest.mark.slow
def test_a_command_says_which_family_it_runs_when_none_is_named(family_dir, store, away, tmp_path):
    from specquant_cli.family.store import remember

    fam = link_family(family_dir, tmp_path / "linked" / "mini")
    remember(store, fam, away)
    r = run_cli(["route", "What is 2+2?", "--json"])
    assert r.exit_code == 0, r.stderr
    assert f"family {json.loads((fam / 'manifest.json').read_text())['family']} at {fam}" in r.stderr
    assert "pulled or quantized last" in r.stderr


# -- nothing on disk is trusted -------------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"schema": 99}', b"\xff\xfe", b""])
def test_a_corrupt_index_is_a_warning_and_is_written_again(tiny, store, away, content):
    from specquant_cli.family.store import remember

    place(tiny, store / "fam")
    (store / "families.json").write_bytes(content)
    r = run_cli(["list", "--json"])
    assert r.exit_code == 0 and [x["name"] for x in json.loads(r.stdout)] == ["fam"]
    assert "warning:" in r.stderr and "families.json" in r.stderr
    assert doctor_root(["--family", "fam"]) == str(store / "fam")
    other = place(tiny, away / "other")
    assert remember(store, other, away) is True
    assert json.loads((store / "families.json").read_text())["families"] == {"other": str(other)}


def test_broken_index_entries_are_skipped(tiny, store, away, tmp_path):
    fam = place(tiny, tmp_path / "real" / "fam")
    store.mkdir(parents=True)
    (store / "families.json").write_text(json.dumps({"schema": 1, "default": "relative/x", "families": {
        "fam": str(fam), "gone": str(tmp_path / "gone"), "rel": "models/rel", "../up": str(fam), "num": 3,
        "empty": str(tmp_path)}}))
    assert [(x["name"], x["found_in"]) for x in listed()] == [("fam", "index")]
    assert doctor_root(["--family", "fam"]) == str(fam)
    assert_clean_error(run_cli(["doctor", "--family", "gone"]), 1, "'gone'")


def test_an_unreadable_family_is_listed_with_its_problem(tiny, store, away):
    broken = place(tiny, store / "broken")
    (broken / "manifest.json").write_text("{")
    place(tiny, store / "fine")
    r = run_cli(["list", "--json"])
    assert r.exit_code == 0, r.stderr
    rows = {x["name"]: x for x in json.loads(r.stdout)}
    assert "unreadable manifest" in rows["broken"]["problem"] and rows["fine"]["problem"] is None
    assert "warning: broken:" in r.stderr
    table = run_cli(["list"])
    assert table.exit_code == 0 and "unreadable" in table.stdout


def test_an_index_that_cannot_be_written_is_a_warning_and_the_family_is_made(tiny, store, away, monkeypatch):
    import fcntl

    from specquant_cli.family import store as family_store

    monkeypatch.setattr(family_store, "LOCK_WAIT_S", 0.2)
    store.mkdir(parents=True)
    fd = os.open(store / ".families.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a stopped process holding the index's lock
    try:
        r = run_cli(["quantize", str(tiny / "tiny-f16.gguf"), "--family", "x", "--types", "q8_0,f16", "--threads", "1"])
    finally:
        os.close(fd)
    assert r.exit_code == 0, r.stderr
    assert "warning:" in r.stderr and "families.json" in r.stderr and (store / "x" / "manifest.json").is_file()
    assert doctor_root(["--family", "x"]) == str(store / "x")  # the models folder's own: found without the index
