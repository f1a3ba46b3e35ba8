"""The face of the command line: every --help fits a screen, and the reference pages are generated from the code
(specquant_cli.reference) so that a page that drifts from it fails here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from specquant_cli import reference
from specquant_cli.commands import options
from specquant_cli.errors import InputError
from specquant_cli.settings import settings_table

WRAPPED = re.compile(r"^│ {12,}\S")  # a panel row whose first cell is empty: an option's help run onto a second line


def _paths():
    return [path for path, _ in reference._walk(reference._click_root(), [])]


@pytest.mark.parametrize("path", _paths(), ids=lambda p: " ".join(p) or "specquant")
def test_every_help_fits_a_screen_of_100_columns(path):
    text = reference.help_text(path)
    lines = text.splitlines()
    assert len(lines) <= (40 if not path else 60), f"{len(lines)} lines:\n{text}"
    assert all(len(line) <= reference.HELP_COLUMNS for line in lines)
    assert [line for line in lines if WRAPPED.match(line)] == [], f"an option's help takes two lines:\n{text}"
    assert "…" not in "".join(line for line in lines if line.startswith("│ --")).replace(",…", "").replace(
        "suffix, …", ""), "a cut cell"


def test_top_level_help_groups_commands_with_chat_and_serve_first():
    text = reference.help_text([])
    panels = re.findall(r"╭─ (\w+) ", text)
    assert panels == ["Options", "Run", "Models", "Inspect", "Measure", "Cluster"]
    run = text.split("╭─ Run")[1].split("╰")[0]
    assert re.findall(r"│ (\w+)", run) == ["chat", "serve"]
    bench = reference.help_text(["bench"])
    assert re.findall(r"╭─ (\w+) ", bench) == ["Options", "Measure", "Diagnostics"]
    diag = bench.split("╭─ Diagnostics")[1]
    assert set(re.findall(r"│ (\w+)", diag)) == {"calls", "logits", "engine", "prefill", "batch", "rpc"}


def test_a_command_names_each_of_its_variables_once_in_its_epilog_not_on_its_options():
    text = reference.help_text(["serve"])
    for key in ("serving.port", "runtime.ctx", "decoding.gamma", "serving.api_key"):
        env = settings_table()[key].env
        assert len(re.findall(rf"\b{env}\b", text)) == 1, env
    assert "[serving]" in text and "[runtime]" in text
    panels = text.split("Environment:")[0]
    assert "SPECQUANT_" not in panels and "specquant.toml:" not in panels


def test_every_setting_variable_is_its_option_spelled_as_a_variable():
    """The epilog's rule (a variable is SPECQUANT_ and the option's name) holds for every setting with a flag."""
    for s in settings_table().values():
        if s.flag:
            assert s.env == "SPECQUANT_" + s.flag[2:].upper().replace("-", "_"), s.key
            assert len(s.help) <= 60 and "\n" not in s.help, f"{s.key}: one short line, the rest in doc"


@pytest.mark.parametrize("args,old", [
    (["quantize", "--help"], "--out"), (["pull", "--help"], "--models-dir"), (["bench", "load", "--help"], "--repeat "),
    (["bench", "calls", "--help"], "--reps"), (["bench", "rpc", "--help"], "--reps"),
    (["worker", "--help"], "--cache-dir"), (["bench", "load", "--help"], "--seed")])
def test_old_spellings_are_not_shown(args, old):
    assert old not in reference.help_text(args[:-1])


def test_old_spellings_still_work(tmp_path):
    from conftest import run_cli

    r = run_cli(["bench", "load", "--url", "http://127.0.0.1:1", "--repeat", "0"])  # parsed: out of range, not unknown
    assert r.exit_code == 2 and "--repeat" in r.stderr and "No such option" not in r.stderr
    r = run_cli(["bench", "load", "--url", "http://127.0.0.1:1", "--seed", "x"])
    assert r.exit_code == 2 and "No such option" not in r.stderr
    r = run_cli(["bench", "calls", "--reps", "0"])
    assert r.exit_code == 2 and "No such option" not in r.stderr
    r = run_cli(["worker", "--cache-dir", str(tmp_path), "--port", "0"])
    assert r.exit_code == 2 and "No such option" not in r.stderr
    r = run_cli(["serve", "--cache-dir", str(tmp_path), "--port", "-1"])  # serve's own --cache-dir, shown there
    assert r.exit_code == 2 and "No such option" not in r.stderr
    assert "--cache-dir" in reference.help_text(["serve"])


def test_the_committed_pages_are_what_the_code_generates():
    stale = reference.stale()
    assert stale == [], (f"{', '.join(map(str, stale))}: the generated reference differs from the code; run "
                         "python -m specquant_cli.reference")
    assert reference.misplaced() == []  # every block where reference.GENERATORS puts it, and nowhere else


def test_every_generated_block_is_on_some_page():
    text = "".join(p.read_text(encoding="utf-8") for p in reference.pages())
    for name in reference.GENERATORS:
        assert f"<!-- BEGIN GENERATED: {name} " in text, name


def test_drift_in_one_option_help_is_caught(monkeypatch):
    """The check is shown to fail: one option's help changed in the code makes the pages that show it stale."""
    monkeypatch.setattr(options.JsonOpt, "help", "JSON on stdout, said differently")
    stale = {p.name for p in reference.stale()}
    assert "cli.md" in stale


def test_drift_in_one_setting_is_caught(monkeypatch):
    import dataclasses

    table = settings_table()
    monkeypatch.setitem(table, "decoding.gamma", dataclasses.replace(table["decoding.gamma"], help="Changed"))
    assert "configuration.md" in {p.name for p in reference.stale()}


# -- the check on a copy of the pages (never the checkout's own) ----------------------------------------------------

@pytest.fixture
def pages_copy(tmp_path):
    """README.md and docs/ copied from the checkout into tmp_path: the pages the check reads, to damage here."""
    shutil.copy(reference.ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(reference.ROOT / "docs", tmp_path / "docs")
    return tmp_path


def _reference(root, *args):
    """`python -m specquant_cli.reference ARGS --root ROOT`, for real, in a process of its own (of this checkout's
    package, the one imported here)."""
    env = {**os.environ, "PYTHONPATH": str(reference.ROOT)}
    return subprocess.run([sys.executable, "-m", "specquant_cli.reference", *args, "--root", str(root)],
                          capture_output=True, text=True, cwd=root.parent, env=env, timeout=120)


def _one_error(r, *needles) -> str:
    assert r.returncode == 1 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


def test_check_passes_on_a_copy_of_the_pages(pages_copy):
    r = _reference(pages_copy, "--check")
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")


def test_check_exits_1_naming_the_stale_page_and_writing_mends_it(pages_copy):
    page = pages_copy / "docs" / "models.md"
    block = re.compile(r"(<!-- BEGIN GENERATED: recipes [^>]*-->\n).*?(<!-- END GENERATED: recipes -->)", re.DOTALL)
    page.write_text(block.sub(r"\1old\n\2", page.read_text()))
    r = _reference(pages_copy, "--check")
    assert r.returncode == 1 and r.stderr.splitlines() == [
        "docs/models.md: generated reference differs from the code; run python -m specquant_cli.reference"]
    assert reference.recipes() not in page.read_text()  # --check changes nothing
    r = _reference(pages_copy)
    assert (r.returncode, r.stderr) == (0, "wrote docs/models.md\n") and reference.recipes() in page.read_text()
    assert _reference(pages_copy, "--check").returncode == 0 and "\nold\n" not in page.read_text()


def _begin(name):
    return f"<!-- BEGIN GENERATED: {name} (python -m specquant_cli.reference) -->\n"


def _end(name):
    return f"<!-- END GENERATED: {name} -->\n"


MISSING = "generated block {!r} is missing"
DAMAGE = {  # what is done to the copy: (page, text, replacement; None: the page deleted) -> the lines the check must
    # print, each naming the page and the block
    "begin marker misspelled": ([("docs/cli.md", "BEGIN GENERATED: cli ", "BEGIN GENERATD: cli ")],
                                ["docs/cli.md: " + MISSING.format("cli")]),
    "end marker misspelled": ([("README.md", "END GENERATED: commands -->", "END GENERATED: command -->")],
                              ["README.md: " + MISSING.format("commands")]),
    "end marker removed": ([("docs/policies.md", _end("policies"), "")],
                           ["docs/policies.md: " + MISSING.format("policies")]),
    "both markers removed": ([("docs/models.md", _begin("recipes"), ""), ("docs/models.md", _end("recipes"), "")],
                             ["docs/models.md: " + MISSING.format("recipes")]),
    "page deleted": ([("docs/serve.md", None, None)],
                     ["docs/serve.md: " + MISSING.format("metrics") + ": the page is gone"]),
    "block on another page": ([("docs/models.md", _begin("recipes"), ""), ("docs/models.md", _end("recipes"), ""),
                               ("docs/usage.md", "# ", _begin("recipes") + _end("recipes") + "\n# ")],
                              ["docs/models.md: " + MISSING.format("recipes"),
                               "docs/usage.md: generated block 'recipes' is not placed on this page"]),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_check_fails_naming_the_page_and_block_of_a_missing_or_misplaced_block(pages_copy, damage):
    """The pages and blocks expected come from reference.GENERATORS: a marker misspelled or removed, or a page
    deleted, is a difference named by page and block, in --check and when writing (which cannot mend it)."""
    edits, expected = DAMAGE[damage]
    for page, old, new in edits:
        path = pages_copy / page
        if old is None:
            path.unlink()
            continue
        text = path.read_text(encoding="utf-8")
        assert old in text, (page, old)
        path.write_text(text.replace(old, new, 1), encoding="utf-8")
    for args in (["--check"], []):
        r = _reference(pages_copy, *args)
        assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr, (args, r.stderr)
        for line in expected:
            assert any(got.startswith(line) for got in r.stderr.splitlines()), (args, line, r.stderr)


@pytest.mark.parametrize("args", [["--check"], []], ids=["check", "write"])
def test_an_unknown_block_is_one_error_line_naming_the_page_and_block(pages_copy, args):
    page = pages_copy / "docs" / "usage.md"
    page.write_text(page.read_text() + "\n<!-- BEGIN GENERATED: nope -->\nx\n<!-- END GENERATED: nope -->\n")
    before = page.read_text()
    _one_error(_reference(pages_copy, *args), "docs/usage.md: unknown generated block 'nope'", "known: commands")
    assert page.read_text() == before
    with pytest.raises(InputError, match="unknown generated block"):
        reference.render("<!-- BEGIN GENERATED: nope -->\nx\n<!-- END GENERATED: nope -->")


@pytest.mark.parametrize("args", [["--check"], []], ids=["check", "write"])
def test_a_page_that_is_not_utf8_is_one_error_line_naming_it(pages_copy, args):
    page = pages_copy / "docs" / "usage.md"
    page.write_bytes(b"# Usage\n\ncaf\xe9\n")
    _one_error(_reference(pages_copy, *args), "docs/usage.md is not valid UTF-8 (byte 0xe9 at offset 12)")
    assert page.read_bytes() == b"# Usage\n\ncaf\xe9\n"


def test_root_must_be_a_folder(tmp_path):
    r = _reference(tmp_path / "no", "--check")
    assert r.returncode == 2 and r.stderr.splitlines()[0] == f"error: --root {tmp_path / 'no'}: not a folder"
