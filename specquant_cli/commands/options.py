"""The command edge of the settings: `with_settings(*keys)` gives a command the options of the settings it takes,
each built from its one declaration (settings.SETTINGS: flag, type, bounds, default, help), resolves them (default
< specquant.toml < environment < flag) before the command body runs, and hands them in as `cfg`. Options that
belong to one command only (and are no setting) stay in that command's signature."""

from __future__ import annotations

import functools
import inspect
import math
import typing
from pathlib import Path
from typing import Optional

import typer

from specquant_cli.errors import InputError
from specquant_cli.routing import policies as _policies  # noqa: F401  (registers the policy settings' names first)
from specquant_cli.settings import CONFIG_NAME, Setting, SettingError, Settings, resolve, settings_table

# Help text goes through rich's markup: a [table] name would vanish as an unknown style tag unless escaped.
ConfigOpt = typer.Option(None, "--config", help=f"Settings and router config (TOML: \\[decoding], \\[runtime], "
                                                f"\\[serving], \\[router] tables); default ./{CONFIG_NAME}")
JsonOpt = typer.Option(False, "--json", help="JSON on stdout (one object per answer or report)")


def finite(value: Optional[float]) -> Optional[float]:
    """Option callback: a float option must be a finite number (click's ranges let inf and nan through)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _callback(s: Setting):
    """The option's check: the declaration's own (and finiteness for a number), as a usage error."""

    def check(value):
        if value is None or (s.kind is bool):
            return value
        if s.kind is float:
            finite(value)
        if s.check is None:
            return value
        try:
            return s.check(value)
        except SettingError as e:
            if not s.usage:
                raise InputError(str(e)) from None
            if s.secret:  # the reason alone: a secret is never echoed
                raise typer.BadParameter(str(e)) from None
            raise typer.BadParameter(f"{value if str(value).strip() else repr(value)}: {e}") from None

    return check


def _option(s: Setting):
    kw: dict = {"help": f"{s.help} ({s.where()})", "callback": _callback(s)}
    if s.shown is not None:
        kw["show_default"] = s.shown
    if s.secret:
        kw["show_default"] = False
    if s.repeat:  # one value per use of the flag: named by the setting's last word (--api-key KEY)
        kw["metavar"] = s.name.rsplit("_", 1)[-1].upper()
    if s.lo is not None:
        kw["min"] = s.lo if s.kind is float else int(s.lo)
    if s.hi is not None:
        kw["max"] = s.hi if s.kind is float else int(s.hi)
    decls = [f"{s.flag}/--no-{s.flag[2:]}"] if s.kind is bool else [s.flag]
    return typer.Option(s.default, *decls, **kw)


def _annotation(s: Setting):
    """The option's type: a list for a setting whose flag may be repeated (Setting.repeat)."""
    if s.repeat:
        return Optional[list[s.kind]]
    return Optional[s.kind] if s.optional else s.kind


def with_settings(*keys: str):
    """Decorator of a command function: it takes the settings `keys` as options (in this order, after its own)
    and --config, and receives them resolved as its `cfg` parameter (settings.Settings). Resolution errors (a bad
    variable or specquant.toml value) are one line naming where the value came from. A key's companions
    (settings.COMPANIONS: --api-key-file with --api-key) come with it."""
    from specquant_cli.settings import with_companions

    keys = tuple(with_companions(keys))

    def deco(fn):
        table = settings_table()
        hints = typing.get_type_hints(fn)
        sig = inspect.signature(fn)
        params = [p.replace(annotation=hints.get(n, p.annotation)) for n, p in sig.parameters.items() if n != "cfg"]
        names = {}
        for key in keys:
            s = table[key]
            if s.flag is None:
                continue  # environment and specquant.toml only
            pname = "setting_" + key.replace(".", "_")
            names[pname] = key
            params.append(inspect.Parameter(pname, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=_option(s),
                                            annotation=_annotation(s)))
        params.append(inspect.Parameter("settings_config", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        default=ConfigOpt, annotation=Optional[Path]))

        @functools.wraps(fn)
        def command(*args, **kwargs):
            click_core = _click_module("core")
            ctx = _click_module("globals").get_current_context()
            ParameterSource = click_core.ParameterSource
            config = kwargs.pop("settings_config")
            flags = {}
            for pname, key in names.items():
                value = kwargs.pop(pname)
                if ctx.get_parameter_source(pname) in (ParameterSource.COMMANDLINE, ParameterSource.PROMPT):
                    flags[key] = value
            cfg = resolve(keys, flags, config)
            _apply_process_settings(cfg)
            return fn(*args, cfg=cfg, **kwargs)

        del command.__wrapped__
        command.__signature__ = sig.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return deco


def _click_module(name: str):
    """A module of the click that typer runs on (recent typers vendor their own as typer._click)."""
    import importlib

    package = typer.BadParameter.__module__.rsplit(".", 1)[0]
    return importlib.import_module(f"{package}.{name}")


def _apply_process_settings(cfg: Settings) -> None:
    """What holds for the whole process: whether errors show their traceback, llama.cpp's log file."""
    from specquant_cli.settings import set_debug

    set_debug(bool(cfg.get("general.debug")))
    path = cfg.get("runtime.llama_log")
    if path is not None:
        from specquant_cli.backend.llama import set_log_file

        set_log_file(path, f"SPECQUANT_LLAMA_LOG={path}" if cfg.source("runtime.llama_log") == "env" else
                     f"runtime.llama_log = {path}")


def split_list(value: Optional[str], option: str, what: str) -> Optional[list[str]]:
    """A comma-separated option as a list of distinct non-empty items; None when not given."""
    if value is None:
        return None
    items = list(dict.fromkeys(x.strip() for x in value.split(",") if x.strip()))
    if not items:
        raise InputError(f"{option} {value!r}: no {what} given")
    return items


def int_list(value: str, option: str, lo: int, hi: int) -> list[int]:
    """A comma-separated option of whole numbers, each in lo..hi, distinct, in the order given."""
    items = split_list(value, option, "number") or []
    out = []
    for x in items:
        if not (x.isascii() and x.isdigit()) or not lo <= int(x) <= hi:
            raise InputError(f"{option} {value!r}: {x!r} is no whole number from {lo} to {hi}")
        out.append(int(x))
    return list(dict.fromkeys(out))


def command_line() -> str:
    """This command as typed (`specquant …`, each argument quoted for a shell): what a report says ran it."""
    import shlex
    import sys

    return " ".join(["specquant"] + [shlex.quote(a) for a in sys.argv[1:]])


def load_family(path: Optional[Path]):
    """session.load_family at the command edge: a warning on the way (an interrupted update finished) goes to
    the stderr console."""
    from specquant_cli import session
    from specquant_cli.console import warn

    return session.load_family(path, warn)


def warn_above_trained_ctx(fam, n_ctx: int) -> None:
    """--ctx above the model's trained context works in llama.cpp, but quality degrades past it: say so."""
    from specquant_cli.console import err
    from specquant_cli.session import ctx_warning

    warning = ctx_warning(fam, n_ctx)
    if warning:
        err.print(warning, markup=False)
