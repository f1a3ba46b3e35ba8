"""Every setting declared once: one option, one variable and one specquant.toml key per declaration, resolved
default < specquant.toml < environment < flag with its source, bad values refused naming where they came from,
and no module below the command edge reading the environment."""

from __future__ import annotations

import ast
import functools
import json
from pathlib import Path

import pytest

from specquant_cli.errors import InputError
from specquant_cli.settings import cache_home, debug, resolve, settings_table

from conftest import REPO, run_cli

PACKAGE = REPO / "specquant_cli"


@functools.cache
def _sources() -> dict[Path, ast.AST]:
    """Every module of the package, parsed (once for the whole module's tests)."""
    return {p: ast.parse(p.read_text(encoding="utf-8")) for p in PACKAGE.rglob("*.py")}


def test_each_setting_has_one_flag_one_variable_and_one_key():
    table = settings_table()
    flags = [s.flag for s in table.values() if s.flag]
    envs = [s.env for s in table.values()]
    assert len(flags) == len(set(flags)) and len(envs) == len(set(envs)) and len(table) == len({*table})
    assert {s.branch for s in table.values()} == {"decoding", "runtime", "serving", "general"}
    for key in ("decoding.gamma", "runtime.rpc", "runtime.parallel", "runtime.threads"):
        assert key in table


@pytest.mark.parametrize("flag", ["--gamma", "--rpc", "--parallel", "--threads", "--ctx", "--policy", "--family"])
def test_a_setting_flag_is_spelled_only_in_its_declaration(flag):
    """The option string of a setting appears as code in settings.py alone (help text may mention it)."""
    where = []
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == flag:
                where.append(path.relative_to(REPO).as_posix())
    assert where == ["specquant_cli/settings.py"], where


ENV_READERS = {"specquant_cli/settings.py", "specquant_cli/backend/selftest.py",  # the self-test child's environment
               "specquant_cli/backend/selftest_child.py"}


def test_only_the_settings_module_reads_the_environment():
    readers = set()
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.add(path.relative_to(REPO).as_posix())
    assert readers <= ENV_READERS, readers - ENV_READERS


def test_no_module_global_configures_rpc_workers():
    from specquant_cli.system import rpc

    assert not hasattr(rpc, "configure") and not hasattr(rpc, "configured") and not hasattr(rpc, "_configured")


# -- precedence and provenance ------------------------------------------------------------------------------------
def _toml(tmp_path: Path, text: str) -> Path:
    (tmp_path / "specquant.toml").write_text(text, encoding="utf-8")
    return tmp_path


def test_default_then_toml_then_environment_then_flag(tmp_path):
    cwd = _toml(tmp_path, "[decoding]\ngamma = 5\npolicy = \"parent\"\n[runtime]\nctx = 2048\n"
                          "[router]\nlow_max = 0.3\n")  # the router's table is the router's
    keys = ["decoding.gamma", "decoding.policy", "runtime.ctx", "decoding.top_k"]
    cfg = resolve(keys, environ={"SPECQUANT_GAMMA": "6", "SPECQUANT_CTX": ""}, cwd=cwd,
                  flags={"decoding.policy": "spec-q4"})
    assert (cfg.decoding.gamma, cfg.source("decoding.gamma")) == (6, "env")
    assert (cfg.decoding.policy, cfg.source("decoding.policy")) == ("spec-q4", "flag")
    assert (cfg.runtime.ctx, cfg.source("runtime.ctx")) == (2048, "toml")  # an empty variable is unset
    assert (cfg.decoding.top_k, cfg.source("decoding.top_k")) == (0, "default")
    assert cfg.config == cwd / "specquant.toml"
    shown = cfg.to_dict()
    assert shown["decoding.gamma"] == {"value": 6, "source": "env", "from": "SPECQUANT_GAMMA"}
    with pytest.raises(AttributeError, match="not resolved"):
        cfg.serving.port  # noqa: B018 - a setting the command did not take


def test_resolved_settings_are_not_changed_in_place_and_a_user_value_stays_theirs(tmp_path):
    cfg = resolve(["runtime.parallel"], cwd=tmp_path)
    decided = cfg.decided("runtime.parallel", 3, "this machine's calibration")
    assert cfg.runtime.parallel is None and decided.runtime.parallel == 3
    assert decided.to_dict()["runtime.parallel"] == {"value": 3, "source": "machine",
                                                      "from": "this machine's calibration"}
    given = resolve(["runtime.parallel"], flags={"runtime.parallel": 2}, cwd=tmp_path)
    assert given.decided("runtime.parallel", 8).runtime.parallel == 2


def test_threads_zero_is_every_core_from_any_source(tmp_path):
    from specquant_cli.settings import cores as usable

    cores = usable()
    for environ, flags in (({}, {}), ({"SPECQUANT_THREADS": "0"}, {}), ({}, {"runtime.threads": 0})):
        cfg = resolve(["runtime.threads"], flags=flags, environ=environ, cwd=tmp_path)
        assert cfg.runtime.threads == cores and cfg.source("runtime.threads") == "machine"


BAD = [
    ({"SPECQUANT_GAMMA": "0"}, "", "SPECQUANT_GAMMA=0: expected a positive integer"),
    ({"SPECQUANT_GAMMA": "17"}, "", "SPECQUANT_GAMMA=17: at most 16"),
    ({"SPECQUANT_CTX": "4k"}, "", "SPECQUANT_CTX=4k: expected an integer"),
    ({"SPECQUANT_RPC_TIMEOUT": "0"}, "", "SPECQUANT_RPC_TIMEOUT=0: expected seconds above 0"),
    ({"SPECQUANT_RPC_TIMEOUT": "-5"}, "", "SPECQUANT_RPC_TIMEOUT=-5: expected at least 0"),
    ({"SPECQUANT_RPC_TIMEOUT": "nan"}, "", "SPECQUANT_RPC_TIMEOUT=nan: expected a finite number"),
    ({"SPECQUANT_RPC_TIMEOUT": "inf"}, "", "SPECQUANT_RPC_TIMEOUT=inf: expected a finite number"),
    ({"SPECQUANT_RPC_TIMEOUT": "1e30"}, "", "SPECQUANT_RPC_TIMEOUT=1e30: at most 86400"),
    ({"SPECQUANT_RPC": " , "}, "", "no worker given"),
    ({"SPECQUANT_RPC": "nohostport"}, "", "'nohostport': expected HOST:PORT"),
    ({"SPECQUANT_POLICY": "fastest"}, "", "SPECQUANT_POLICY=fastest: unknown policy 'fastest'"),
    ({"SPECQUANT_DEBUG": "false-ish"}, "", "SPECQUANT_DEBUG=false-ish: expected 1/0, true/false"),
    ({"SPECQUANT_PARALLEL": "9"}, "", "SPECQUANT_PARALLEL=9: at most 8"),
    ({}, "[decoding]\ngamma = \"4\"\n", "decoding.gamma = '4': expected int, not str"),  # TOML is typed
    ({}, "[decoding]\ngamma = 4.0\n", "decoding.gamma = 4.0: expected int, not float"),
    ({}, "[decoding]\ngamma = true\n", "decoding.gamma = True: expected int, not bool"),
    ({}, "[decoding]\ngama = 4\n", "unknown setting decoding.gama"),
    ({}, "decoding = 4\n", "decoding must be a table"),
    ({}, "[runtime]\nrpc_timeout = inf\n", "runtime.rpc_timeout = inf: expected a finite number"),
    ({}, "[runtime]\nthreads = 100000\n", "runtime.threads = 100000: at most"),
    ({}, "[decoding\n", "not valid TOML"),
    ({}, "[serving]\nhost = [\"a\"]\n", "serving.host = ['a']: expected one value, not a list"),
]


@pytest.mark.parametrize("environ,toml,needle", BAD, ids=[n[:40] for *_, n in BAD])
def test_a_bad_value_is_one_line_naming_where_it_came_from(tmp_path, environ, toml, needle):
    keys = [k for k in settings_table()]
    with pytest.raises(InputError) as e:
        resolve(keys, environ=environ, cwd=_toml(tmp_path, toml) if toml else tmp_path)
    assert needle in str(e.value) and "\n" not in str(e.value)
    if toml:
        assert str(tmp_path / "specquant.toml") in str(e.value)


def test_lists_from_toml_and_environment(tmp_path):
    cwd = _toml(tmp_path, "[runtime]\nrpc = [\"127.0.0.1:5000\", \"127.0.0.1:5000\", \"h:1\"]\n"
                          "[serving]\npolicies = \"parent, spec-q4\"\n")
    cfg = resolve(["runtime.rpc", "serving.policies"], cwd=cwd)
    assert cfg.runtime.rpc == ["127.0.0.1:5000", "h:1"] and cfg.serving.policies == ["parent", "spec-q4"]


def test_debug_is_a_boolean(monkeypatch):
    for raw, want in (("1", True), ("true", True), ("false", False), ("0", False), ("no", False), ("", False)):
        monkeypatch.setenv("SPECQUANT_DEBUG", raw)
        assert debug() is want


def test_the_api_key_is_never_shown(tmp_path):
    cfg = resolve(["serving.api_key"], environ={"SPECQUANT_API_KEY": "sekrit-123"}, cwd=tmp_path)
    assert cfg.serving.api_key == "sekrit-123"
    assert "sekrit" not in json.dumps(cfg.to_dict())


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache_home() == tmp_path / ".cache" / "specquant"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_home() == tmp_path / "xdg" / "specquant"


# -- the command line -----------------------------------------------------------------------------------------------
def test_doctor_json_shows_every_setting_and_its_source(tmp_path, monkeypatch):
    monkeypatch.chdir(_toml(tmp_path, "[serving]\nqueue = 3\n"))
    r = run_cli(["doctor", "--json", "--ctx", "2048"], env={"SPECQUANT_GAMMA": "7", "SPECQUANT_API_KEY": "k-secret"})
    assert r.exit_code == 0, r.stderr
    s = json.loads(r.stdout)["settings"]
    assert set(s) == set(settings_table())
    assert s["runtime.ctx"] == {"value": 2048, "source": "flag", "from": "--ctx"}
    assert s["decoding.gamma"]["value"] == 7 and s["decoding.gamma"]["source"] == "env"
    assert s["serving.queue"]["value"] == 3 and s["serving.queue"]["source"] == "toml"
    assert s["serving.port"] == {"value": 8080, "source": "default"}
    assert s["serving.api_key"]["value"] == "***" and "k-secret" not in r.stdout


def test_a_bad_variable_stops_any_command_before_it_runs(tmp_path):
    r = run_cli(["chat", "--family", str(tmp_path / "none"), "hi"], env={"SPECQUANT_GAMMA": "abc"})
    assert r.exit_code == 1 and r.stderr.strip() == "error: SPECQUANT_GAMMA=abc: expected an integer"


def test_help_shows_where_a_setting_can_be_set():
    r = run_cli(["chat", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    assert "SPECQUANT_GAMMA" in r.stdout and "[decoding]" in r.stdout and "--gamma" in r.stdout


@pytest.mark.slow
def test_gamma_reaches_every_model_draft_length(family):
    from specquant_cli.routing.plan import Plan
    from specquant_cli.runtime import Runtime

    rt = Runtime.open(family, gamma=6)
    try:
        assert rt.costs.model_gamma("q4").gamma == 6  # where a model draft's adaptive length starts
        fixed = rt.costs.gamma_policy(Plan("spec-q4", None, "f16", "q4", gamma_policy="fixed"))
        assert fixed.draft_length() == 6
    finally:
        rt.close()


def test_session_settings_take_the_resolved_values_and_extras_win(tmp_path):
    from specquant_cli.settings import SessionSettings

    cfg = resolve(["runtime.parallel", "runtime.ctx", "decoding.gamma", "runtime.rpc"], cwd=tmp_path,
                  flags={"runtime.parallel": 2, "runtime.ctx": 1024})
    s = SessionSettings.of(cfg, parallel=4, max_tokens=7)
    assert (s.parallel, s.n_ctx, s.gamma, s.rpc, s.max_tokens) == (4, 1024, 4, [], 7)


def test_debug_from_specquant_toml_reaches_the_error_translation(tmp_path, monkeypatch):
    from specquant_cli.errors import SpecquantError

    monkeypatch.chdir(_toml(tmp_path, "[general]\ndebug = true\n"))
    with pytest.raises(SpecquantError):  # re-raised with its traceback, not translated to one line
        run_cli(["chat", "--family", str(tmp_path / "none"), "hi"])


def test_a_secret_is_not_echoed_by_a_bad_toml_value(tmp_path):
    with pytest.raises(InputError) as e:
        resolve(["serving.api_key"], cwd=_toml(tmp_path, "[serving]\napi_key = 12345678\n"))
    assert "12345678" not in str(e.value) and "***" in str(e.value)


def test_a_seed_of_twenty_digits_is_kept_exactly(tmp_path):
    cfg = resolve(["decoding.seed"], environ={"SPECQUANT_SEED": str(2**64 - 1)}, cwd=tmp_path)
    assert cfg.decoding.seed == 2**64 - 1
    with pytest.raises(InputError, match="at most"):
        resolve(["decoding.seed"], environ={"SPECQUANT_SEED": "9" * 25}, cwd=tmp_path)
