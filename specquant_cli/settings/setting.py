"""One setting's declaration (`Setting`: branch, type, bounds, default, help) and how a raw value — text from the
environment, a TOML value — becomes a value of its type, bounded (`Setting.convert`), or a `SettingError`."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from specquant_cli.settings.limits import CONFIG_NAME, PANELS


class SettingError(ValueError):
    """A value that is no value of its setting; the message says why, without naming where it came from."""


@dataclass(frozen=True)
class Setting:
    """One setting. `flag`: its command-line option (None: environment and specquant.toml only); `lo`/`hi`:
    inclusive bounds; `check`: turns a converted value into the one used (or raises SettingError); `shown`: the
    help's default when `default` is decided later (None here); `secret`: masked wherever it is shown."""

    branch: str
    name: str
    kind: type
    default: Any
    help: str
    flag: Optional[str] = None
    lo: Optional[float] = None
    hi: Optional[float] = None
    check: Optional[Callable[[Any], Any]] = None
    shown: Optional[str] = None
    secret: bool = False
    optional: bool = False  # None is a value of it (not given: decided later, or absent)
    usage: bool = True  # a flag value its check refuses is a usage error (exit 2); False: an error (exit 1)
    many: bool = False  # a list: comma-separated text, or a TOML array
    repeat: bool = False  # several values: the flag repeated, or a TOML array; the environment holds one
    doc: str = ""  # the longer text of docs/configuration.md (`help` is the option's one line)
    metavar: Optional[str] = None  # the value's name in --help (default: by kind, see `shown_metavar`)
    panel: Optional[str] = None  # the --help panel its option sits in (default: by branch, PANELS)

    @property
    def key(self) -> str:
        return f"{self.branch}.{self.name}"

    @property
    def env(self) -> str:
        return "SPECQUANT_" + self.name.upper()

    def where(self) -> str:
        """Where else it can be set: its variable and its specquant.toml key."""
        return f"env {self.env}; {CONFIG_NAME}: {self.key}"

    @property
    def description(self) -> str:
        """The whole text: the option's line, then the longer one of the docs."""
        return f"{self.help}. {self.doc}" if self.doc else self.help

    def shown_metavar(self) -> Optional[str]:
        """The value's name in --help: the declared one, else by kind (none for an on/off flag)."""
        if self.metavar is not None or self.kind is bool:
            return self.metavar
        return {int: "N", float: "NUM", Path: "PATH"}.get(self.kind, "TEXT")

    @property
    def help_panel(self) -> str:
        return self.panel or PANELS[self.branch]

    def convert(self, raw: Any, text: bool = True) -> Any:
        """A value from the environment (`text`) or specquant.toml (TOML's own types: a string is no number
        there) as this setting's type, bounded and checked; SettingError says why not."""
        if isinstance(raw, list) and not (self.many or self.repeat):
            raise SettingError("expected one value, not a list")
        if not text and isinstance(raw, str) and self.kind not in (str, Path):
            raise SettingError(f"expected {self.kind.__name__}, not str")
        value = _convert(self.kind, raw)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.lo is not None and value < self.lo:
                raise SettingError(_below(self.kind, self.lo))
            if self.hi is not None and value > self.hi:
                raise SettingError(f"at most {number_text(self.hi)}")
        return self.check(value) if self.check is not None else value


def number_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _below(kind: type, lo: float) -> str:
    if kind is int and lo == 1:
        return "expected a positive integer"
    if kind is int and lo == 0:
        return "expected 0 or a positive integer"
    return f"expected at least {number_text(lo)}"


TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# A number as text: ASCII decimal digits only (float() also takes `1_000`, fullwidth and Arabic-Indic digits and
# Unicode spaces around them; none of them is what a setting means), inf and nan to be refused as not finite.
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_NOT_FINITE = re.compile(r"[+-]?(?:inf|infinity|nan)", re.IGNORECASE)


def _convert(kind: type, raw: Any) -> Any:
    if isinstance(raw, str):
        text = raw.strip()
        if kind is bool:
            if text.lower() in TRUE:
                return True
            if text.lower() in FALSE:
                return False
            raise SettingError("expected 1/0, true/false, yes/no or on/off")
        if kind is int:
            digits = text[1:] if text[:1] in "+-" else text
            if text != raw or not digits or not (digits.isascii() and digits.isdigit()):
                raise SettingError("expected an integer")
            return int(text) if len(digits) <= 40 else (1 if text[0] != "-" else -1) * 10**40  # no 4300-digit parse
        if kind is float:
            if not (_DECIMAL.fullmatch(raw) or _NOT_FINITE.fullmatch(raw)):
                raise SettingError("expected a number (ASCII digits, no spaces: e.g. 2, 1.5, .5, 1e3)")
            value = float(raw)
            if not math.isfinite(value):
                raise SettingError("expected a finite number")
            return value
        return raw
    if kind is bool and isinstance(raw, bool):
        return raw
    if kind is int and isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if kind is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
        if not math.isfinite(raw):
            raise SettingError("expected a finite number")
        return float(raw)
    if kind in (str, Path) and isinstance(raw, list):
        return raw  # a list setting (rpc, policies) written as a TOML array; its check reads it
    raise SettingError(f"expected {kind.__name__}, not {type(raw).__name__}")
