"""Resolution: each setting a command takes from the last of its sources — default < specquant.toml < environment
< flag (`resolve`) — once, at the command edge."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

from specquant_cli.settings.config import read_toml
from specquant_cli.settings.limits import COMPANIONS, cores
from specquant_cli.settings.resolved import Settings, Value
from specquant_cli.settings.setting import SettingError
from specquant_cli.settings.table import GLOBAL_KEYS, settings_table


def _shown(raw: str) -> str:
    text = raw if len(raw) <= 24 else raw[:24] + "…"
    return text if text.isprintable() and text.strip() == text and text else repr(text)


def with_companions(keys: Iterable[str]) -> list[str]:
    """`keys` with each one's COMPANIONS after it (a command taking serving.api_key takes serving.api_key_file:
    the keys are one thing, given two ways), each once."""
    return list(dict.fromkeys(k for key in keys for k in (key, *COMPANIONS.get(key, ()))))


def resolve(keys: Iterable[str], flags: Optional[Mapping[str, Any]] = None, config: Optional[Path] = None,
            environ: Optional[Mapping[str, str]] = None, cwd: Optional[Path] = None) -> Settings:
    """The settings `keys` (their COMPANIONS and GLOBAL_KEYS too), each from the last of: its default,
    specquant.toml (`config`, else ./specquant.toml), its environment variable (an empty one is unset), `flags`
    (values given on the command line, already checked by their options). Raises errors.InputError naming the
    variable or file of a bad value (never a secret's value). Threads 0 is decided here: every core."""
    from specquant_cli.errors import InputError

    table = settings_table()
    flags = flags or {}
    environ = os.environ if environ is None else environ
    toml, toml_path = read_toml(config, cwd)
    values: dict[str, Value] = {}
    for key in with_companions([*keys, *GLOBAL_KEYS]):
        s = table[key]
        v = Value(s.default, "default")
        if s.name in toml.get(s.branch, {}):
            try:
                v = Value(s.convert(toml[s.branch][s.name], text=False), "toml", str(toml_path))
            except SettingError as e:
                shown = "***" if s.secret else repr(toml[s.branch][s.name])
                raise InputError(f"{toml_path}: {s.key} = {shown}: {e}") from None
        raw = environ.get(s.env, "")
        if raw != "":
            try:
                v = Value(s.convert(raw), "env", s.env)
            except SettingError as e:
                raise InputError(f"{s.env}={'***' if s.secret else _shown(raw)}: {e}") from None
        if key in flags:
            v = Value(flags[key], "flag", s.flag or "")
        values[key] = v
    cfg = Settings(values, toml_path)
    if "runtime.threads" in values and not cfg.get("runtime.threads"):
        cfg = Settings({**values, "runtime.threads": Value(cores(), "machine", "every core")}, toml_path)
    return cfg


def resolve_all(given: Settings) -> Settings:
    """Every declared setting, resolved as for a command whose command line gave what `given` took from flags, with
    `given`'s specquant.toml (doctor's view of the whole tree)."""
    flags = {k: v.value for k, v in given.values.items() if v.source == "flag"}
    return resolve(settings_table(), flags, given.config)
