"""Resolved settings: each value with its source (`Value`), the immutable `Settings` a command runs with, and the
values the machine decides into a new one (`Settings.decided`; the prompt cache's budget, `decide_cache_ram`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from specquant_cli.settings.limits import CACHE_RAM_MAX_MIB, CACHE_RAM_SHARE
from specquant_cli.settings.setting import number_text
from specquant_cli.settings.table import settings_table


# -- resolution --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Value:
    value: Any
    source: str  # one of SOURCES
    origin: str = ""  # the variable, file or flag it came from ("" for a default)


@dataclass(frozen=True)
class Settings:
    """Resolved settings: `cfg.runtime.threads`, `cfg.get("runtime.threads")`, `cfg.source(...)`. Immutable: a
    value the machine decides is set by `decided`, which returns a new object."""

    values: Mapping[str, Value]
    config: Optional[Path] = None  # the specquant.toml read (None: none)

    def get(self, key: str) -> Any:
        return self.values[key].value

    def source(self, key: str) -> str:
        return self.values[key].source

    def __getattr__(self, branch: str) -> Branch:
        if branch.startswith("_") or branch in ("values", "config"):
            raise AttributeError(branch)
        return Branch(self, branch)

    def decided(self, key: str, value: Any, origin: str = "") -> Settings:
        """These settings with `key` decided by the machine (a value given by the user stays theirs)."""
        current = self.values[key]
        if current.source != "default":
            return self
        return Settings({**self.values, key: Value(value, "machine", origin)}, self.config)

    def given_by(self, key: str) -> str:
        """Where `key`'s value came from, as a user would find it: its flag, its variable, `serving.host in
        PATH` (the specquant.toml read), what the machine decided it from, or "the default"."""
        s, v = settings_table()[key], self.values[key]
        if v.source == "flag":
            return s.flag or key
        if v.source == "env":
            return s.env
        if v.source == "toml":
            return f"{s.key} in {v.origin}"
        return v.origin or ("the default" if v.source == "default" else "this machine")

    def stated(self, key: str) -> str:
        """`key` as it was given: `--host 0.0.0.0`, `SPECQUANT_HOST=0.0.0.0`, `host = "0.0.0.0" from PATH` (a list
        as one value); a secret by where it came from alone (given_by), never its value."""
        s, v = settings_table()[key], self.values[key]
        if s.secret:
            return self.given_by(key)
        items = list(v.value) if isinstance(v.value, (list, tuple)) else [v.value]
        if v.source == "toml":
            shown = _toml_text(items[0]) if len(items) == 1 else f"[{', '.join(map(_toml_text, items))}]"
            return f"{s.name} = {shown} from {v.origin}"
        shown = ",".join(map(_plain_text, items))
        if v.source == "flag":
            return f"{s.flag or key} {shown}"
        if v.source == "env":
            return f"{s.env}={shown}"
        return f"{s.key} {shown} ({self.given_by(key)})"

    def to_dict(self) -> dict:
        table = settings_table()
        out: dict = {}
        for key, v in sorted(self.values.items()):
            shown = v.value
            if table[key].secret and shown is not None:
                shown = "***"
            elif isinstance(shown, Path):
                shown = str(shown)
            out[key] = {"value": shown, "source": v.source, **({"from": v.origin} if v.origin else {})}
        return out


def _plain_text(x: Any) -> str:
    return number_text(x) if isinstance(x, float) else str(x)


def _toml_text(x: Any) -> str:
    """A value as specquant.toml writes it (a string quoted)."""
    if isinstance(x, bool):
        return "true" if x else "false"
    return _plain_text(x) if isinstance(x, (int, float)) else json.dumps(str(x))


@dataclass(frozen=True)
class Branch:
    settings: Settings
    name: str

    def __getattr__(self, name: str) -> Any:
        try:
            return self.settings.values[f"{self.name}.{name}"].value
        except KeyError:
            raise AttributeError(f"{self.name}.{name} was not resolved for this command") from None


def default_cache_ram(available_bytes: int) -> float:
    """The prompt cache's budget (MiB) when nothing sets one: CACHE_RAM_SHARE of free memory, at most
    CACHE_RAM_MAX_MIB."""
    return float(min(CACHE_RAM_MAX_MIB, int(max(0, available_bytes) * CACHE_RAM_SHARE) >> 20))


def decide_cache_ram(cfg: Settings, available_bytes: int) -> Settings:
    """`cfg` with serving.cache_ram decided from this machine's free memory, unless given."""
    mib = default_cache_ram(available_bytes)
    return cfg.decided("serving.cache_ram", mib, f"{CACHE_RAM_SHARE:.0%} of {available_bytes / 2**30:.1f} GiB free, "
                       f"at most {CACHE_RAM_MAX_MIB:.0f} MiB")
