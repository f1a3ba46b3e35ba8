"""A family's name is its own: names taken, folders that are no names, names no folder can have, where a setting
came from, a header that claims fewer bits than its weights hold.

By class (issue 63): `quantize FILE --family NAME` (or no --family: the base's name) never rebuilds another base's
family found by that name without --force, and a second family of a taken name in another folder is refused, never
silently dropping the first from the index and `specquant list`; `--family ..`/`.` is no name and no family's folder
(a plain name is a name even where a folder of that name is here; a path is the folder it names); a --family too long
for a folder name is one line, never an internal error; a models folder that is a file is blamed on the setting it
came from (SPECQUANT_MODELS, --models), and a family whose folder moved is named with the folder the index recorded;
a GGUF whose general.file_type claims fewer bits than its weights hold (Q4_K_M over Q8_0) is refused as its other
direction is.

Real files throughout: tiny GGUFs (backend.tiny) quantized by llama.cpp's own quantizer, the CLI in-process
(CliRunner), the models folder and its index as each test's own (conftest isolates XDG_DATA_HOME)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from hostile_util import assert_clean_error, claim_file_type, cli, snapshot, tiny_llama

SHAPE = {"dim": 256, "ff": 512, "layers": 4, "vocab": 1024}
QUICK = ["--types", "q8_0,f16", "--threads", "1"]


def _manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """Real GGUFs: an F16 base, another network's F16 base (another base), the base's Q8_0 (llama.cpp's quantizer),
    and a Q4_K_M of a network whose rows fit no Q4_K block (llama.cpp writes those tensors as Q5_0 and Q8_0)."""
    from specquant_cli.family.quantize import parse_types, quantize_family

    d = tmp_path_factory.mktemp("names")
    base = tiny_llama(d / "base-f16.gguf", **SHAPE)
    other = tiny_llama(d / "other-f16.gguf", seed=7, **SHAPE)
    quantize_family(base, d / "q", parse_types("q8_0"), threads=1)
    narrow = tiny_llama(d / "narrow-f16.gguf", dim=64, ff=128)
    quantize_family(narrow, d / "n", parse_types("q4_k_m"), threads=1)
    return {"base": base, "other": other, "q8": d / "q" / "q-q8_0.gguf", "narrow_q4km": d / "n" / "n-q4_k_m.gguf"}


@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    """A current folder that is no checkout (a name is made in the models folder, never in the repository's)."""
    folder = tmp_path / "here"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def _store() -> Path:
    from specquant_cli.settings import models_dir

    return models_dir()


def _listed() -> dict[str, str]:
    r = cli(["list", "--json"])
    assert r.exit_code == 0, r.stderr
    return {x["folder"]: x["name"] for x in json.loads(r.stdout)}


# -- 1. data loss: a name that is taken ------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["--family NAME", "the base's name"])
def test_a_name_found_for_another_bases_family_is_not_rebuilt_without_force(made, here, tmp_path, how):
    """The family `model`, made from one base in a folder given as a path (the index records it), then a base of
    another network asked for by that name: refused naming the family's folder and base, nothing changed; --force
    replaces it."""
    first = Path(shutil.copy(made["base"], tmp_path / "model.gguf"))
    (tmp_path / "b").mkdir()
    second = Path(shutil.copy(made["other"], tmp_path / "b" / "model.gguf"))
    fams = tmp_path / "fams"
    assert cli(["quantize", first, "--family", fams / "model", *QUICK]).exit_code == 0
    by = ["--family", "model"] if how == "--family NAME" else []
    before = snapshot(tmp_path)
    line = assert_clean_error(cli(["quantize", second, *by, *QUICK]), 1, "holds another family", "model.gguf",
                              "pass --force to replace it")
    assert str(fams / "model") in line
    assert snapshot(tmp_path) == before
    r = cli(["quantize", second, *by, *QUICK, "--force"])
    assert r.exit_code == 0, r.stderr
    assert _manifest(fams / "model")["base"]["sha256"] == _sha(second)


def test_a_second_family_of_a_taken_name_in_another_folder_is_refused_and_the_first_stays_listed(made, here, tmp_path):
    first, second = tmp_path / "a" / "x", tmp_path / "b" / "x"
    assert cli(["quantize", made["base"], "--family", first, *QUICK]).exit_code == 0
    line = assert_clean_error(cli(["quantize", made["other"], "--family", second, *QUICK]), 1, "the name x is taken",
                              "base-f16.gguf", "--force")
    assert str(first) in line
    assert not second.exists()
    assert _listed() == {str(first): "x"}
    r = cli(["quantize", made["other"], "--family", second, *QUICK, "--force"])  # asked for: said, not silent
    assert r.exit_code == 0, r.stderr
    assert f"the family at {first} keeps its folder and runs by it: --family {first}" in r.stderr
    assert _listed() == {str(second): "x"}


# -- 2. a folder is not a name ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["..", ".", "./", "../", "sub/..", ""])  # not "/": a regression would write there
def test_dot_folders_are_no_family_names(made, here, value):
    (here / "sub").mkdir()
    before = snapshot(here.parent)
    line = assert_clean_error(cli(["quantize", made["base"], "--family", value, *QUICK]), 1,
                              "--family " + (value or "''") + ":", "not a family" if value else "empty")
    assert "my-model" in line  # what to give instead
    assert snapshot(here.parent) == before


def test_a_plain_name_is_a_name_even_where_a_folder_of_it_is_here(made, here):
    """docs/models.md: a name is looked up in ./models, the models folder, the index; a folder here that holds no
    family is no family's; written as a path it is the family's folder."""
    (here / "notes").mkdir()
    (here / "notes" / "todo.txt").write_text("mine\n")
    r = cli(["quantize", made["base"], "--family", "notes", *QUICK])
    assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in (here / "notes").iterdir()) == ["todo.txt"]
    assert (_store() / "notes" / "manifest.json").is_file()
    r = cli(["quantize", made["other"], "--family", "./mine", *QUICK])
    assert r.exit_code == 0, r.stderr
    assert (here / "mine" / "manifest.json").is_file()


def test_a_family_made_with_out_dotdot_is_announced_by_its_folders_name(made, here, monkeypatch):
    sub = here / "sub"
    sub.mkdir()
    monkeypatch.chdir(sub)
    r = cli(["quantize", made["base"], "--out", "..", *QUICK])
    assert r.exit_code == 0, r.stderr
    assert f"--family {here.name} runs it from any folder" in r.stderr and "--family .." not in r.stderr


# -- 6a. a name no folder can have -----------------------------------------------------------------------------------
LONG = "n" * 300


@pytest.mark.parametrize("args,needles", [
    (["quantize", "{base}", "--family", LONG], ["--family 'nnnn", "300 characters", "at most 255 bytes"]),
    (["quantize", "{base}", "--family", "{tmp}/" + LONG], ["--family '", "at most 255 bytes"]),
    (["quantize", "--draft-model", "{base}", "--family", LONG], ["'nnnn", "at most 255 bytes"]),
    (["chat", "--family", "{tmp}/" + LONG, "hi"], ["at most 255 bytes"]),
    (["quantize", "{base}", "--out", "{tmp}/" + LONG], ["--out", "File name too long"]),
], ids=["quantize-name", "quantize-path", "add-sibling", "chat-path", "quantize-out"])
def test_a_family_name_too_long_for_a_folder_is_one_line(made, here, tmp_path, args, needles):
    args = [a.format(base=made["base"], tmp=tmp_path) for a in args]
    assert_clean_error(cli([*args, "--threads", "1"] if args[0] == "quantize" else args), 1, *needles)


# -- 8a. the source of a value, the folder a name was recorded at ----------------------------------------------------
@pytest.mark.parametrize("command", ["quantize", "pull"])
@pytest.mark.parametrize("given", ["env", "flag"])
def test_a_models_folder_that_is_a_file_is_blamed_on_its_setting(made, here, tmp_path, command, given):
    file = tmp_path / "not-a-folder"
    file.write_text("x\n")
    for where, why in ((file, "not a folder"), (file / "sub", "cannot create the folder")):
        args = [command, made["base"], *(["--types", "q8_0"] if command == "quantize" else []), "--threads", "1"]
        if given == "flag":
            r = cli([*args, "--models", where])
            needle = f"--models {where}"
        else:
            r = cli(args, env={"SPECQUANT_MODELS": str(where)})
            needle = f"SPECQUANT_MODELS={where}"
        line = assert_clean_error(r, 1, needle, why)
        assert "--out" not in line and "--models-dir" not in line


def test_a_family_whose_folder_moved_is_named_with_the_folder_recorded(made, here, tmp_path):
    folder = tmp_path / "fams" / "mover"
    assert cli(["quantize", made["base"], "--family", folder, *QUICK]).exit_code == 0
    folder.rename(tmp_path / "fams" / "moved")
    assert_clean_error(cli(["doctor", "--family", "mover"]), 1, "no model family named 'mover'", str(folder),
                       "is gone", "moved")
    folder.mkdir()  # a folder there again, but no family in it
    assert_clean_error(cli(["chat", "--family", "mover", "hi"]), 1, str(folder), "holds no family")


# -- 9a. a header claiming fewer bits than its weights hold ---------------------------------------------------------
@pytest.mark.parametrize("as_", ["parent", "sibling"])
def test_a_header_claiming_fewer_bits_than_the_weights_hold_is_refused(made, here, tmp_path, as_):
    liar = claim_file_type(Path(shutil.copy(made["q8"], tmp_path / "liar-Q4_K_M.gguf")), 15)  # 15: MOSTLY_Q4_K_M
    args = ["quantize", liar] if as_ == "parent" else ["quantize", made["base"], "--draft-model", liar]
    before = snapshot(tmp_path)
    assert_clean_error(cli([*args, "--family", tmp_path / "fam", "--threads", "1"]), 1,
                       "its header says Q4_K_M (general.file_type), but its weights are mostly Q8_0")
    assert snapshot(tmp_path) == before


def test_an_honest_q4_k_m_whose_rows_fall_back_to_more_bits_is_taken(made, here, tmp_path):
    """llama.cpp writes a Q4_K_M's tensors whose rows fit no Q4_K block as Q5_0 (and Q6_K's as Q8_0): still the
    file's type."""
    from specquant_cli.family.gguf_read import read_info

    info = read_info(made["narrow_q4km"])
    assert info.file_type == "Q4_K_M" and "Q4_K" not in info.tensor_types  # every block fell back
    r = cli(["quantize", made["narrow_q4km"], "--family", tmp_path / "fam"])
    assert r.exit_code == 0, r.stderr
    assert _manifest(tmp_path / "fam")["variants"]["own"]["file_type"] == "Q4_K_M"
