"""The command edge of the settings: `with_settings(*keys)` gives a command the options of the settings it takes,
each built from its one declaration (settings.SETTINGS: flag, type, bounds, default, help), resolves them (default
< specquant.toml < environment < flag) before the command body runs, and hands them in as `cfg`. Options that
belong to one command only (and are no setting) stay in that command's signature."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import typing
from pathlib import Path
from typing import Optional

import typer
from typer.core import TyperCommand, TyperGroup

from specquant_cli.errors import InputError
from specquant_cli.routing import policies as _policies  # noqa: F401  (registers the policy settings' names first)
from specquant_cli.settings import CONFIG_NAME, Setting, SettingError, Settings, resolve, settings_table

# Help text goes through rich's markup: a [table] name would vanish as an unknown style tag unless escaped.
ConfigOpt = typer.Option(None, "--config", metavar="FILE",
                         help=f"Settings file (TOML); default ./{CONFIG_NAME}")
JsonOpt = typer.Option(False, "--json", help="JSON on stdout")
# The options every bench subcommand shares.
JsonFileOpt = typer.Option(None, "--json-file", metavar="FILE", help="Write the JSON report to FILE")
MarkdownOpt = typer.Option(None, "--markdown", metavar="FILE", help="Write a markdown report to FILE")
PlotOpt = typer.Option(None, "--plot", metavar="FILE", help="Write the report's plot to FILE (PNG)")
DatasetOpt = typer.Option([], "--dataset", metavar="FILE", help="JSONL, spec-bench, gsm8k",
                          show_default="the built-in set")
CategoriesOpt = typer.Option(None, "--categories", metavar="NAMES", help="Comma-separated categories",
                             show_default=False)
CHAT_MAX_TOKENS = 256  # --max-tokens of chat, and the answer route prices its plans over
BENCH_MAX_TOKENS = 64  # --max-tokens of every bench subcommand (short answers: many runs)

# Old spellings of options, still accepted and never shown in --help (one name per idea; scripts keep working): the
# spelling, and the commands it is hidden in (None: every command).
HIDDEN_ALIASES: dict[str, Optional[frozenset[str]]] = {
    "--out": None, "--models-dir": None, "--repeat": None, "--reps": None,
    "--cache-dir": frozenset({"worker"}),  # the RPC tensor cache is --tensor-cache (serve's --cache-dir is another)
    "--seed": frozenset({"load"}),  # bench load's Poisson arrivals are --arrival-seed (--seed samples answers)
}


def hidden_alias(spelling: str, command: Optional[str]) -> bool:
    """Whether `spelling` is an old name, not shown in `command`'s --help."""
    where = HIDDEN_ALIASES.get(spelling, frozenset())
    return where is None or command in where
# The value names of --help by click type (instead of typer's <int range> [x>=1]).
_METAVARS = {"int": "N", "float": "NUM", "Path": "PATH", "str": "TEXT"}


class SpecquantCommand(TyperCommand):
    """A command whose --help fits a screen: readable value names (N, PATH, TEXT; none for a flag), no number
    ranges (an error names them), an on/off pair as one `--[no-]name`, old spellings (HIDDEN_ALIASES) left out,
    and an epilog naming the environment variables and specquant.toml keys of its settings once
    (`settings_epilog`, set at registration)."""

    def format_help(self, ctx, formatter):
        with tidy_help(self.get_params(ctx), self.name):
            return super().format_help(ctx, formatter)


class SpecquantGroup(TyperGroup):
    """A group whose --help is tidied as a command's (SpecquantCommand)."""

    def format_help(self, ctx, formatter):
        with tidy_help(self.get_params(ctx), self.name):
            return super().format_help(ctx, formatter)


@contextlib.contextmanager
def tidy_help(params, command: Optional[str]):
    """The parameters as --help shows them (`_tidy`), put back as they were afterwards."""
    patched = ("_get_number_range_help_str", "display_type_rich")
    saved = [(p, p.opts, p.secondary_opts, p.metavar, [k for k in patched if k not in p.__dict__]) for p in params]
    try:
        for p in params:
            _tidy(p, command)
        yield
    finally:
        for p, opts, secondary, metavar, added in saved:
            p.opts, p.secondary_opts, p.metavar = opts, secondary, metavar
            for k in added:
                p.__dict__.pop(k, None)


def _tidy(p, command: Optional[str]) -> None:
    """One parameter as `command`'s --help shows it (SpecquantCommand)."""
    p.opts = [o for o in p.opts if not hidden_alias(o, command)]
    p.secondary_opts = [o for o in p.secondary_opts if not hidden_alias(o, command)]
    p._get_number_range_help_str = lambda: None
    if getattr(p, "is_flag", False):
        p.metavar = ""
        pairs = [o for o in p.opts if o.startswith("--") and f"--no-{o[2:]}" in p.secondary_opts]
        if pairs:
            p.opts = [f"--[no-]{pairs[0][2:]}", *(o for o in p.opts if o != pairs[0])]
            p.secondary_opts = [o for o in p.secondary_opts if o != f"--no-{pairs[0][2:]}"]
    elif p.param_type_name == "argument":  # its name says what it takes: no type beside it
        p.display_type_rich = lambda ctx: None
        if p.metavar is None:
            p.metavar = p.name.upper()
    elif p.metavar is None:
        bare = p.bare_type().removeprefix("list[").removesuffix("]")
        p.metavar = _METAVARS.get(bare, bare.upper())


def settings_epilog(keys) -> Optional[str]:
    """The epilog of a command taking the settings `keys`: their variables, and their specquant.toml keys by table
    (rich markup: a [table] escaped)."""
    from specquant_cli.settings import with_companions

    table = settings_table()
    shown = [table[k] for k in with_companions(keys) if table[k].flag is not None]
    if not shown:
        return None
    branches: dict[str, list[str]] = {}
    for s in shown:
        branches.setdefault(s.branch, []).append(s.name)
    tables = ", ".join(f"\\[{b}] ({', '.join(dict.fromkeys(s.help_panel for s in shown if s.branch == b))})"
                       for b in branches)
    return (f"Environment: {' '.join(s.env for s in shown)}\n\n"
            f"{CONFIG_NAME}: each variable's name in lower case without SPECQUANT_, under {tables}. An option "
            "beats its variable, which beats the file (docs/configuration.md).")


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
    kw: dict = {"help": s.help, "callback": _callback(s), "rich_help_panel": s.help_panel}
    if s.kind is bool:  # an on/off pair (--[no-]name): its default as a word
        kw["help"], kw["show_default"] = f"{s.help} \\[default: {'on' if s.default else 'off'}]", False
    if s.shown is not None:
        kw["show_default"] = s.shown if s.shown != "none" else False  # nothing by default: no default to show
    if s.secret:
        kw["show_default"] = False
    if s.shown_metavar() is not None:
        kw["metavar"] = s.shown_metavar()
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
        command.settings_keys = keys  # for its --help epilog (settings_epilog)
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
    """What holds for the whole process: whether errors show their traceback, llama.cpp's log file, the models
    folder where families are found by name, whether rows are computed the same way in every call."""
    from specquant_cli.settings import set_debug, set_deterministic, set_models

    set_debug(bool(cfg.get("general.debug")))
    set_models(cfg.get("runtime.models"))
    if "runtime.deterministic" in cfg.values:
        set_deterministic(bool(cfg.get("runtime.deterministic")))
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
    """session.load_family at the command edge: a warning on the way (an interrupted update finished) and the
    family a command runs when none was named go to the stderr console."""
    from specquant_cli import session
    from specquant_cli.console import err, warn

    return session.load_family(path, warn, lambda text: err.print(text, markup=False))


def warn_above_trained_ctx(fam, n_ctx: int) -> None:
    """--ctx above the model's trained context works in llama.cpp, but quality degrades past it: say so."""
    from specquant_cli.console import err
    from specquant_cli.session import ctx_warning

    warning = ctx_warning(fam, n_ctx)
    if warning:
        err.print(warning, markup=False)


def remember_family(root: Path, default: bool = True) -> None:
    """pull's and quantize's last step: the family at `root` added to the models folder's index (family.store), so
    --family NAME finds it from any folder, and made the default when `default` (not the test family while another
    is known); said on stderr, by the name the index records (its folder's, `--out ..` included). An index that
    cannot be written is a warning: the family itself is made."""
    import os

    from specquant_cli.console import err, warn
    from specquant_cli.family import store
    from specquant_cli.settings import models_dir

    folder = models_dir()
    if folder is None:
        return
    name = Path(os.path.abspath(root)).name
    try:
        now_default = store.remember(folder, root, store.current_folder(), default, warn=warn)
    except OSError as e:
        warn(f"{folder / store.INDEX}: cannot record {name} there ({e.strerror or e}); name it by its "
             f"folder: --family {root}")
        return
    err.print(f"  --family {name} runs it from any folder" + (" (the default family)" if now_default else ""),
              markup=False)


def check_models_folder(cfg: Settings) -> None:
    """The models folder runtime.models names, when it is set, checked (made when missing) before a family is made
    in it: a file there, or a folder that cannot be made or written, is one line naming where the value came from
    (SPECQUANT_MODELS=..., --models ..., specquant.toml), not the family's folder inside it."""
    from specquant_cli.fsutil import folder_problem

    folder = cfg.runtime.models
    why = folder_problem(folder, create=True) if folder is not None else None
    if why:
        raise InputError(f"{cfg.stated('runtime.models')}: {why}; the models folder is where pull and quantize make "
                         "families")
