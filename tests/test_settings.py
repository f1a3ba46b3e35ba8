"""Every setting declared once: one option, one variable and one specquant.toml key per declaration, resolved
default < specquant.toml < environment < flag with its source, bad values refused naming where they came from,
and no module below the command edge reading the environment; a setting that turns a protection off said aloud, API
keys, numbers from text, specquant.toml read bounded, the drafting memory and the prompt cache bounded."""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hostile_util import assert_clean_error

from specquant_cli.errors import InputError, ResourceError
from specquant_cli.settings import SettingError, cache_home, debug, read_config, resolve, settings_table
from specquant_cli.settings.setting import _convert

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
    """The option string of a setting appears as code in its declaration alone, the settings table (help text may
    mention it)."""
    where = []
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == flag:
                where.append(path.relative_to(REPO).as_posix())
    assert where == ["specquant_cli/settings/table.py"], where


ENV_READERS = {"specquant_cli/settings/sources.py", "specquant_cli/settings/environment.py",
               "specquant_cli/backend/selftest.py",  # the self-test child's environment
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


# == settings said aloud and checked strictly ========================================================================
# Settings said aloud: a setting that turns a protection off is one warning naming where it came from; API keys
# (repeated, from a private key file, each a tenant) are refused when empty, padded or not printable ASCII; numbers
# from text are ASCII decimals; specquant.toml is read bounded; --draft-memory is bounded and counted by serve's
# memory check; a prompt cache too small for one entry is refused. No model loads here: serve_settings runs on a fake
# family and fake hardware facts.

SECRET = "sekrit-key-123"
GIB = 1 << 30


class FakeFamily:
    """What serve_settings and the memory check read of a family: its roles, hyperparameters and file sizes."""

    name = "fake"

    def __init__(self, size: int = 10 << 20, hparams: dict | None = None):
        self._size = size
        self.hparams = hparams or {"block_count": 2, "attention.head_count": 4, "embedding_length": 256}

    def roles(self) -> list[str]:
        return ["parent", "q4", "q8"]

    def hparams_of(self, role: str) -> dict:
        return self.hparams

    def size(self, role: str) -> int:
        return self._size


def _facts(ram: int = 8 * GIB):
    from specquant_cli.system.hardware import Facts

    return Facts(gpus=[], gpu_status="none", ram_total=ram, ram_available=ram, cores_physical=2, cores_logical=2,
                 cpu_flags={}, gpu_offload=False)


def _serve_cfg(tmp_path: Path, flags: dict | None = None, environ: dict | None = None):
    from specquant_cli.commands.serve import SETTINGS

    flags = {"runtime.parallel": 1, "serving.policies": ["parent"], "decoding.policy": "parent", **(flags or {})}
    return resolve(SETTINGS, flags=flags, environ=environ or {}, cwd=tmp_path)


def _serve_settings(cfg, family=None, facts=None):
    from specquant_cli.serving.server import serve_settings

    return serve_settings(cfg, family or FakeFamily(), facts or _facts())


def _warnings(cfg) -> list[str]:
    from specquant_cli.serving.server import protection_warnings

    return protection_warnings(cfg)


# -- 1. a protection turned off is said, with where it came from ---------------------------------------------------
WARNED = [
    ({"serving.cors_origin": ["*"]}, {}, "", "--cors-origin *", "cross-site guard off"),
    ({}, {"SPECQUANT_CORS_ORIGIN": "http://localhost:3000,*"}, "", "SPECQUANT_CORS_ORIGIN=http://localhost:3000,*",
     "cross-site guard off"),
    ({}, {}, '[serving]\ncors_origin = "*"\n', 'cors_origin = "*" from {toml}', "cross-site guard off"),
    ({"serving.allow_host": ["*"]}, {}, "", "--allow-host *", "DNS-rebinding guard off"),
    ({}, {"SPECQUANT_ALLOW_HOST": "*"}, "", "SPECQUANT_ALLOW_HOST=*", "DNS-rebinding guard off"),
    ({}, {}, '[serving]\nallow_host = ["box.lan", "*"]\n', 'allow_host = ["box.lan", "*"] from {toml}',
     "DNS-rebinding guard off"),
    ({"serving.host": "0.0.0.0"}, {}, "", "(--host 0.0.0.0) without an API key", "listening on 0.0.0.0"),
    ({}, {"SPECQUANT_HOST": "::"}, "", "(SPECQUANT_HOST=::) without an API key", "listening on ::"),
    ({}, {}, '[serving]\nhost = "0.0.0.0"\n', '(host = "0.0.0.0" from {toml}) without an API key',
     "listening on 0.0.0.0"),
]


@pytest.mark.parametrize("flags,environ,toml,said,what", WARNED, ids=[w[3][:30] for w in WARNED])
def test_a_protection_turned_off_is_one_warning_naming_where(tmp_path, flags, environ, toml, said, what):
    cwd = _toml(tmp_path, toml) if toml else tmp_path
    lines = _warnings(_serve_cfg(cwd, flags, environ))
    assert len(lines) == 1, lines
    assert lines[0].startswith("warning: ") and what in lines[0] and "\n" not in lines[0]
    assert said.format(toml=cwd / "specquant.toml") in lines[0]


@pytest.mark.parametrize("flags,environ", [
    ({"serving.host": "0.0.0.0", "serving.api_key": SECRET}, {}),
    ({"serving.host": "0.0.0.0"}, {"SPECQUANT_API_KEY_FILE": "/some/keys"}),
    ({"serving.host": "127.0.0.2", "serving.cors_origin": ["http://localhost:3000"]}, {}),
    ({"serving.host": "::1", "serving.allow_host": ["box.lan"]}, {}),
])
def test_no_warning_where_every_protection_is_on(tmp_path, flags, environ):
    assert _warnings(_serve_cfg(tmp_path, flags, environ)) == []


def test_serve_says_the_toml_warning_before_it_fails(tmp_path, monkeypatch):
    """The CLI, end to end up to serve_settings (a fake family and machine: nothing loads): the warning names
    the specquant.toml of the current folder, and the run then stops at a one-line error."""
    from specquant_cli.commands import serve as serve_command
    from specquant_cli.system import hardware

    monkeypatch.chdir(_toml(tmp_path, '[serving]\ncors_origin = "*"\n'))
    monkeypatch.setattr(serve_command, "load_family", lambda path: FakeFamily())
    monkeypatch.setattr("specquant_cli.session.bind_parent", lambda fam, settings: fam)
    monkeypatch.setattr(hardware, "detect", lambda *a, **k: _facts())
    r = run_cli(["serve", "--parallel", "1", "--policies", "parent", "--policy", "parent", "--cache-ram", "0.001"])
    assert r.exit_code == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0] == (f'warning: cors_origin = "*" from {tmp_path / "specquant.toml"} turns the cross-site guard '
                        "off: any web page can call this server")
    assert len(lines) == 2 and lines[1].startswith("error: --cache-ram 0.001")


# -- 2. API keys: refused when they are no key; several, and a private key file ------------------------------------
BAD_KEY_FLAGS = [
    (["--api-key", ""], "empty key"),
    (["--api-key", f" {SECRET}"], "leading or trailing whitespace"),
    (["--api-key", f"{SECRET}\n"], "leading or trailing whitespace"),
    (["--api-key", f"{SECRET[:4]}\x01{SECRET[4:]}"], "control character"),
    (["--api-key", f"{SECRET}é"], "non-ASCII character"),
    (["--api-key", SECRET, "--api-key", SECRET], "key 2 repeats key 1"),
]


@pytest.mark.parametrize("args,needle", BAD_KEY_FLAGS, ids=[n for _, n in BAD_KEY_FLAGS])
def test_a_bad_api_key_flag_is_a_usage_error_that_never_shows_it(tmp_path, args, needle):
    r = run_cli(["serve", "--family", str(tmp_path / "none"), *args])
    assert r.exit_code == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "--api-key" in errors[0] and needle in errors[0], r.stderr
    assert SECRET not in r.stderr + r.stdout


BAD_KEY_TOML = [
    ('api_key = ""\n', "empty key"),
    (f'api_key = "{SECRET} "\n', "leading or trailing whitespace"),
    (f'api_key = ["{SECRET}", "{SECRET}"]\n', "key 2 repeats key 1"),
    ("api_key = []\n", "no key given"),
    (f'api_key = ["{SECRET}", 7]\n', "key 2 of 2: expected a string key, not int"),
]


@pytest.mark.parametrize("toml,needle", BAD_KEY_TOML, ids=[n for _, n in BAD_KEY_TOML])
def test_a_bad_api_key_in_specquant_toml_names_the_file_not_the_key(tmp_path, toml, needle):
    with pytest.raises(InputError) as e:
        resolve(["serving.api_key"], environ={}, cwd=_toml(tmp_path, "[serving]\n" + toml))
    msg = str(e.value)
    assert str(tmp_path / "specquant.toml") in msg and "serving.api_key" in msg and needle in msg
    assert SECRET not in msg and "\n" not in msg


def test_an_empty_variable_is_no_key_and_a_padded_one_is_refused_unshown(tmp_path):
    assert resolve(["serving.api_key"], environ={"SPECQUANT_API_KEY": ""}, cwd=tmp_path).serving.api_key is None
    with pytest.raises(InputError) as e:
        resolve(["serving.api_key"], environ={"SPECQUANT_API_KEY": SECRET + "\t"}, cwd=tmp_path)
    assert str(e.value).startswith("SPECQUANT_API_KEY=***: ") and "whitespace" in str(e.value)
    assert SECRET not in str(e.value)


def test_several_keys_reach_serve_options_in_order(tmp_path):
    keys = ["k-one", "k-two", "k-three"]
    r = run_cli(["serve", "--family", str(tmp_path / "none"), *(x for k in keys for x in ("--api-key", k))])
    assert r.exit_code == 1 and "no model family" in r.stderr  # the three keys passed their check
    cfg = _serve_cfg(tmp_path, {"serving.api_key": keys})
    _, opts = _serve_settings(cfg)
    assert opts.api_keys == tuple(keys) and opts.api_key == "k-one"
    toml_cfg = resolve(["serving.api_key"], environ={}, cwd=_toml(tmp_path, f"[serving]\napi_key = {keys!r}\n"))
    assert toml_cfg.serving.api_key == keys and '"***"' in str(toml_cfg.to_dict()).replace("'", '"')


def _key_file(tmp_path: Path, text: str | bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "keys"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    path.chmod(mode)
    return path


def test_a_key_file_adds_a_tenant_per_line_after_the_flags(tmp_path):
    path = _key_file(tmp_path, "# tenants\nalpha-key\n\n   \n  # bob\r\nbeta-key\r\n")
    cfg = _serve_cfg(tmp_path, {"serving.api_key": "flag-key", "serving.api_key_file": path})
    _, opts = _serve_settings(cfg)
    assert opts.api_keys == ("flag-key", "alpha-key", "beta-key") and opts.api_key == "flag-key"
    env_cfg = _serve_cfg(tmp_path, environ={"SPECQUANT_API_KEY_FILE": str(path)})
    assert _serve_settings(env_cfg)[1].api_keys == ("alpha-key", "beta-key")


def test_a_key_file_from_specquant_toml_is_named_with_the_toml(tmp_path):
    path = _key_file(tmp_path, "k1\n", 0o644)
    cwd = _toml(tmp_path, f'[serving]\napi_key_file = "{path}"\n')
    with pytest.raises(InputError) as e:
        _serve_settings(_serve_cfg(cwd))
    assert str(e.value) == (f'api_key_file = "{path}" from {cwd / "specquant.toml"}: group or others may read or '
                            f"write it (mode 644); chmod 600 {path}")


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path, 0o600)
    return path


KEY_FILE_REFUSALS = {
    "symlink": (lambda p: (p.parent / "link").symlink_to(_key_file(p.parent, "k1\n")) or p.parent / "link",
                "symbolic link"),
    "folder": (lambda p: p.parent, "is a folder"),
    "fifo": (lambda p: _fifo(p.parent), "not a regular file"),
    "group-readable": (lambda p: _key_file(p.parent, "k1\n", 0o640), "(mode 640); chmod 600"),
    "world-writable": (lambda p: _key_file(p.parent, "k1\n", 0o602), "(mode 602); chmod 600"),
    "too big": (lambda p: _key_file(p.parent, ("k" * 99 + "\n") * 700), "larger than 64 KiB"),
    "no key": (lambda p: _key_file(p.parent, "# only a comment\n\n"), "has no key"),
    "repeated": (lambda p: _key_file(p.parent, "k1\nk2\nk1\n"), "line 3 repeats the key of line 1"),
    "padded": (lambda p: _key_file(p.parent, "k1\nk2 \n"), "line 2: the key has leading or trailing whitespace"),
    "bom": (lambda p: _key_file(p.parent, b"\xef\xbb\xbfk1\n"), "UTF-8 byte-order mark; save it without one"),
    "missing": (lambda p: p.parent / "nope", "no such file"),
}


@pytest.mark.parametrize("case", KEY_FILE_REFUSALS)
def test_a_key_file_that_is_not_private_or_holds_no_key_is_refused_saying_how_to_fix_it(tmp_path, case):
    make, needle = KEY_FILE_REFUSALS[case]
    path = make(tmp_path / "x")
    cfg = _serve_cfg(tmp_path, {"serving.api_key_file": path})
    with pytest.raises(InputError) as e:
        _serve_settings(cfg)
    msg = str(e.value)
    assert msg.startswith(f"--api-key-file {path}: ") and needle in msg and "\n" not in msg, msg


def test_a_key_file_of_another_user_and_a_key_given_twice_are_refused(tmp_path, monkeypatch):
    path = _key_file(tmp_path, "k1\nk2\n")
    with pytest.raises(InputError, match=r"line 2 repeats a key of --api-key; give each key once"):
        _serve_settings(_serve_cfg(tmp_path, {"serving.api_key": ["k0", "k2"], "serving.api_key_file": path}))
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    with pytest.raises(InputError, match=rf"belongs to another user \(uid {os.getuid()}\)"):
        _serve_settings(_serve_cfg(tmp_path, {"serving.api_key_file": path}))


# -- 3. numbers from text are ASCII decimals -----------------------------------------------------------------------
NOT_DECIMAL = ["１", "٣", "6_4", "1_000.5", "\u00a01", " 1", "1\t", "1\u2003", "1.5\n", "\u0661.5", "0x10", ""]


@pytest.mark.parametrize("raw", NOT_DECIMAL, ids=[repr(r) for r in NOT_DECIMAL])
def test_a_float_from_text_is_ascii_digits_only(tmp_path, raw):
    with pytest.raises(SettingError, match="expected a number"):
        _convert(float, raw)


@pytest.mark.parametrize("raw,want", [("1", 1.0), ("1.5", 1.5), ("-2", -2.0), ("+3", 3.0), ("1e3", 1000.0),
                                      (".5", 0.5), ("2.", 2.0), ("1E-3", 0.001)])
def test_plain_decimals_stay_numbers(raw, want):
    assert _convert(float, raw) == want


def test_a_variable_with_fullwidth_digits_or_padding_is_refused_naming_it(tmp_path):
    for raw in ("３００", "300 ", "3_00"):
        with pytest.raises(InputError, match=r"^SPECQUANT_RPC_TIMEOUT=.*expected a number"):
            resolve(["runtime.rpc_timeout"], environ={"SPECQUANT_RPC_TIMEOUT": raw}, cwd=tmp_path)
    with pytest.raises(InputError, match="expected a finite number"):  # inf and nan keep their own reason
        resolve(["runtime.rpc_timeout"], environ={"SPECQUANT_RPC_TIMEOUT": "-Infinity"}, cwd=tmp_path)


@pytest.mark.parametrize("raw", ["６４", "6_4", "\u00a064", "64 "])
def test_an_integer_from_text_is_ascii_digits_only(raw):
    """Held already (int checks isascii and padding): kept so."""
    with pytest.raises(SettingError, match="expected an integer"):
        _convert(int, raw)


# -- 4. specquant.toml read bounded --------------------------------------------------------------------------------
def test_a_config_over_a_mebibyte_is_refused(tmp_path):
    path = tmp_path / "big.toml"
    path.write_bytes(b"# padding\n" * ((1 << 20) // 10 + 1))
    with pytest.raises(InputError, match=r"larger than 1 MiB; a config file is a few settings"):
        read_config(path)


def test_a_config_from_a_pipe_is_read_no_further_than_the_bound(tmp_path):
    fifo = _fifo(tmp_path)
    done = threading.Event()

    def writer():
        try:
            with open(fifo, "wb") as f:
                for _ in range(64):  # 4 MiB, more than the bound
                    f.write(b"#" * 65535 + b"\n")
        except (BrokenPipeError, OSError):
            pass
        done.set()

    threading.Thread(target=writer, daemon=True).start()
    try:
        with pytest.raises(InputError, match=r"larger than 1 MiB"):
            read_config(fifo)
    finally:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a writer still waiting for a reader goes on
        os.close(fd)
    assert done.wait(10)


def test_config_dev_zero_is_refused_at_once():
    """In a child with a memory cap: reading /dev/zero whole would take every byte of RAM."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 31, 1 << 31))\n"
            "from pathlib import Path\nfrom specquant_cli.errors import InputError\n"
            "from specquant_cli.settings import read_config\n"
            "try:\n    read_config(Path('/dev/zero'))\nexcept InputError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == ("/dev/zero: is a character device, not a config file; name a "
                                                      "TOML file"), r.stderr[-500:]


@pytest.mark.parametrize("text", ["a = " + "[" * 40 + "]" * 40 + "\n",
                                  "[serving]\nx = " + "{a = " * 40 + "1" + "}" * 40 + "\n",
                                  "a = " + "[" * 5000 + "]" * 5000 + "\n",
                                  "[" + ".".join(["t"] * 40) + "]\nx = 1\n"],
                         ids=["arrays-40", "inline-tables-40", "arrays-5000", "dotted-tables-40"])
def test_nesting_deeper_than_32_levels_is_one_line(tmp_path, text):
    path = tmp_path / "deep.toml"
    path.write_text(text)
    with pytest.raises(InputError) as e:
        read_config(path)
    assert str(e.value) == (f"{path}: tables and arrays nest deeper than 32 levels; a config is a few flat "
                            "tables")


def test_a_config_with_a_byte_order_mark_names_it(tmp_path):
    path = tmp_path / "specquant.toml"
    path.write_bytes(b"\xef\xbb\xbf[serving]\nport = 1\n")
    with pytest.raises(InputError) as e:
        resolve(["serving.port"], environ={}, cwd=tmp_path)
    assert str(e.value) == f"config {path} starts with a UTF-8 byte-order mark; save it without one"


def test_a_normal_config_and_a_folder_still_read_as_before(tmp_path):
    path = _toml(tmp_path, "[serving]\nport = 9\n[router.weights]\ntokens = 1.0\n") / "specquant.toml"
    assert read_config(path)[0]["router"]["weights"]["tokens"] == 1.0
    with pytest.raises(InputError, match=r"cannot read config \(Is a directory\)"):
        read_config(tmp_path)


# -- 5. the drafting memory: bounded, and counted by serve's memory check ------------------------------------------
def test_draft_memory_is_at_most_4096_mib_per_policy(tmp_path):
    r = run_cli(["serve", "--family", str(tmp_path / "none"), "--draft-memory", "5000"])
    assert r.exit_code == 2 and "--draft-memory" in r.stderr
    with pytest.raises(InputError, match=r"SPECQUANT_DRAFT_MEMORY=65536: at most 4096"):
        resolve(["decoding.draft_memory"], environ={"SPECQUANT_DRAFT_MEMORY": "65536"}, cwd=tmp_path)


def test_the_policies_that_draft_from_a_memory():
    from specquant_cli.serving.server import memory_policies

    offered = ["parent", "suffix", "stacked-q4", "auto", "spec-q4", "ngram", "paper", "quasar"]
    assert memory_policies(offered) == ["suffix", "stacked-q4", "auto"]


def test_drafting_memory_that_cannot_fit_is_refused_before_loading_naming_draft_memory(tmp_path):
    flags = {"serving.policies": ["parent", "suffix", "stacked-q4"], "serving.cache_ram": 0.0,
             "decoding.draft_memory": 4096.0}
    with pytest.raises(ResourceError) as e:
        _serve_settings(_serve_cfg(tmp_path, flags), facts=_facts(6 * GIB))  # 2 × 4 GiB beside the models
    msg = str(e.value)
    assert "2 policies × 4096 MiB, --draft-memory 4096" in msg and "lower --draft-memory" in msg and "\n" not in msg
    _serve_settings(_serve_cfg(tmp_path, {**flags, "decoding.draft_memory": 512.0}), facts=_facts(6 * GIB))


def test_the_memory_check_names_a_draft_memory_from_specquant_toml(tmp_path):
    cwd = _toml(tmp_path, "[decoding]\ndraft_memory = 3000.0\n")
    flags = {"serving.policies": ["suffix", "auto"], "decoding.policy": "suffix", "serving.cache_ram": 0.0}
    with pytest.raises(ResourceError, match=rf"2 policies × 3000 MiB, draft_memory = 3000 from {cwd}"):
        _serve_settings(_serve_cfg(cwd, flags), facts=_facts(4 * GIB))


# -- 6. a prompt cache too small for one entry ---------------------------------------------------------------------
@pytest.mark.parametrize("mib,fam", [(0.001, FakeFamily()), (0.5, FakeFamily()),
                                        (2.0, FakeFamily(hparams={"block_count": 48, "attention.head_count": 64,
                                                                  "attention.head_count_kv": 8,
                                                                  "embedding_length": 8192}))],
                         ids=["1-KiB", "half-MiB", "2-MiB-for-a-big-model"])
def test_a_prompt_cache_below_one_entry_is_refused(tmp_path, mib, fam):
    flags = {"serving.cache_ram": mib, "serving.cache_dir": tmp_path / "cache"}
    with pytest.raises(InputError) as e:
        _serve_settings(_serve_cfg(tmp_path, flags), family=fam)
    msg = str(e.value)
    assert msg.startswith(f"--cache-ram {mib:g}: a prompt cache of {mib:g} MiB holds no entry") and "0 for none" in msg


def test_a_prompt_cache_of_zero_is_off_and_one_mib_is_taken(tmp_path, capsys):
    _, opts = _serve_settings(_serve_cfg(tmp_path, {"serving.cache_ram": 0.0, "serving.cache_dir": tmp_path}))
    assert opts.cache_ram == 0.0 and "is not used: the prompt cache is off" in capsys.readouterr().err
    _, opts = _serve_settings(_serve_cfg(tmp_path, {"serving.cache_ram": 1.0}))
    assert opts.cache_ram == 1.0
    with pytest.raises(InputError, match=r"^SPECQUANT_CACHE_RAM=0.01: a prompt cache"):
        _serve_settings(_serve_cfg(tmp_path, environ={"SPECQUANT_CACHE_RAM": "0.01"}))


# -- the debug switch: off means off, and no boolean is refused --------------------------------------------------------
@pytest.mark.parametrize("value", ["false", "0", "no", "off", ""])
def test_debug_off_means_off(value, tmp_path):
    r = run_cli(["chat", "--family", str(tmp_path / "none"), "hi"], env={"SPECQUANT_DEBUG": value})
    assert_clean_error(r, 1, "no model family")  # one line, no traceback


@pytest.mark.parametrize("value", ["maybe", "2", "enabled"])
def test_a_debug_value_that_is_no_boolean_is_refused(value, tmp_path):
    r = run_cli(["chat", "--family", str(tmp_path / "none"), "hi"], env={"SPECQUANT_DEBUG": value})
    assert_clean_error(r, 1, f"SPECQUANT_DEBUG={value}")
