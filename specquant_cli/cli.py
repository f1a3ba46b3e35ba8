"""The Typer app: wires the commands and maps errors to one line on stderr and an exit code.

Exit codes: 0 done; 1 an error (one `error: …` line on stderr); 2 a usage error (an unknown option, a value
out of range: one line too); 130 interrupted (Ctrl-C or SIGTERM); 141 the reader of stdout closed it
(quietly, as other Unix tools)."""

from __future__ import annotations

import sys

import typer
from typer.core import TyperCommand

from specquant_cli.commands.options import SpecquantGroup
from specquant_cli.errors import SpecquantError

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_CLOSED_PIPE = 1, 2, 130, 141
_click = sys.modules[typer.BadParameter.__module__]  # the click exceptions typer uses (it may vendor click)


def _debug() -> bool:
    from specquant_cli.settings import debug

    return debug()


class _Group(SpecquantGroup):
    """Translate the exception family once, at the edge. SPECQUANT_DEBUG=1 re-raises."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Usage errors as one line (`error: …`, exit 2) instead of a usage box."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _click.NoArgsIsHelpError as e:  # the help is the message
            if e.format_message().strip():
                e.show()
            sys.exit(e.exit_code)
        except _click.ClickException as e:
            ctx = getattr(e, "ctx", None)
            hint = f" (see {ctx.command_path} -h)" if ctx is not None else ""
            _say(f"error: {e.format_message()}{hint}")
            sys.exit(e.exit_code)
        except typer.Abort:
            _say("aborted")
            sys.exit(EXIT_ERROR)
        except SpecquantError as e:  # from an eager option's callback, before any command runs
            if _debug():
                raise
            _say(f"error: {e}")
            sys.exit(EXIT_ERROR)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except SpecquantError as e:
            if _debug():
                raise
            _say(f"error: {e}")
            raise typer.Exit(EXIT_ERROR) from None
        except KeyboardInterrupt:
            if _debug():
                raise
            _say("interrupted")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except BrokenPipeError:  # the reader went away (| head): stop quietly
            if _debug():
                raise
            from specquant_cli.console import silence_stdout

            silence_stdout()
            raise typer.Exit(EXIT_CLOSED_PIPE) from None
        except Exception as e:
            if hasattr(e, "exit_code") or _debug():  # usage errors are the parser's to print
                raise
            _say(f"error: internal error: {type(e).__name__}: {e} (SPECQUANT_DEBUG=1 shows the traceback)")
            raise typer.Exit(1) from None


def _say(line: str) -> None:
    sys.stderr.write(" ".join(line.split("\n")) + "\n")
    sys.stderr.flush()


HELP = ("Faster local LLMs, same answers: a quantized family drafts, the parent verifies, planned from this "
        "machine's measured costs.\n\n"
        "Start with: specquant pull qwen2.5-coder-1.5b, then specquant chat --stats or specquant serve. "
        "docs/README.md")
app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help=HELP)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        from specquant_cli.console import out

        try:
            out(f"specquant {version('specquant')} (llama-cpp-python {version('llama-cpp-python')})")
        except BrokenPipeError:
            raise typer.Exit(EXIT_CLOSED_PIPE) from None
        raise typer.Exit(0)


@app.callback()
def _root(_: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit")) -> None:
    """Faster local LLMs, same answers."""


# The top-level help's panels, in order: what a user runs first, then the models, then the rest.
PANELS = {
    "Run": ("chat", "serve"),
    "Models": ("pull", "list", "quantize", "calibrate-activations"),
    "Inspect": ("doctor", "route"),
    "Measure": ("calibrate", "bench"),
    "Cluster": ("worker",),
}


def _register() -> None:
    from specquant_cli.commands import (
        bench,
        calibrate,
        calibrate_activations,
        chat,
        doctor,
        pull,
        quantize,
        route,
        serve,
        worker,
    )
    from specquant_cli.commands import list as list_command
    from specquant_cli.commands.options import SpecquantCommand, settings_epilog

    for mod in (chat, serve, pull, list_command, quantize, calibrate_activations, doctor, route, calibrate, bench,
                worker):
        mod.register(app)
    panel_of = {name: panel for panel, names in PANELS.items() for name in names}
    order = list(panel_of)
    app.registered_commands.sort(key=lambda c: order.index(c.name) if c.name in order else len(order))
    for info in _commands(app):
        if info.cls in (None, TyperCommand):
            info.cls = SpecquantCommand
        if info.epilog is None and getattr(info.callback, "settings_keys", None):
            info.epilog = settings_epilog(info.callback.settings_keys)
    for info in [*app.registered_commands, *app.registered_groups]:  # the top level's panels
        info.rich_help_panel = None if getattr(info, "hidden", False) else panel_of.get(info.name)


def _commands(typer_app: typer.Typer):
    """Every command of `typer_app` and of its groups (bench's subcommands)."""
    yield from typer_app.registered_commands
    for group in typer_app.registered_groups:
        yield from _commands(group.typer_instance)


_register()


def main() -> None:
    from specquant_cli import interrupts
    from specquant_cli.console import ClosedStream

    interrupts.install()  # SIGTERM stops like Ctrl-C: cleanup runs, exit 130
    if sys.stdout is None:  # started with stdout closed (>&-): a write is a clean error, not a crash
        sys.stdout = ClosedStream()
    app(prog_name="specquant")


if __name__ == "__main__":
    sys.exit(main())
