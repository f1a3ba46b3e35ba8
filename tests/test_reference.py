"""The face of the command line: every --help fits a screen, and the reference pages are generated from the code
(specquant_cli.reference) so that a page that drifts from it fails here."""

from __future__ import annotations

import re

import pytest

from specquant_cli import reference
from specquant_cli.commands import options
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
    assert set(re.findall(r"│ (\w+)", diag)) == {"calls", "engine", "prefill", "batch", "rpc"}


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


def test_check_exits_1_naming_the_stale_page_and_writing_mends_it(tmp_path, capsys):
    page = tmp_path / "docs" / "x.md"
    page.parent.mkdir()
    page.write_text("<!-- BEGIN GENERATED: recipes (python -m specquant_cli.reference) -->\nold\n"
                    "<!-- END GENERATED: recipes -->\n")
    assert reference.main(["--check"], root=tmp_path) == 1 and "docs/x.md" in capsys.readouterr().err
    assert reference.main([], root=tmp_path) == 0 and "q3g30" in page.read_text()
    assert reference.main(["--check"], root=tmp_path) == 0 and "old" not in page.read_text()


def test_an_unknown_block_is_refused():
    with pytest.raises(KeyError, match="unknown generated block"):
        reference.render("<!-- BEGIN GENERATED: nope -->\nx\n<!-- END GENERATED: nope -->")
