"""The Typer app: wires the commands and maps errors to one line on stderr and an exit code.

Exit codes: 0 done; 1 an error (one `error: …` line on stderr); 2 a usage error (an unknown option, a value
out of range: one line too); 130 interrupted (Ctrl-C or SIGTERM); 141 the reader of stdout closed it
(quietly, as other Unix tools)."""

from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup

from specquant_cli.errors import SpecquantError

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_CLOSED_PIPE = 1, 2, 130, 141
_click = sys.modules[typer.BadParameter.__module__]  # the click exceptions typer uses (it may vendor click)


def _debug() -> bool:
    from specquant_cli.settings import debug

    return debug()


class _Group(TyperGroup):
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


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="specquant: quantized families, complexity routing and lossless speculative decoding.")


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
    """specquant: quantized families, complexity routing and lossless speculative decoding."""


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

    for mod in (pull, quantize, calibrate_activations, doctor, route, calibrate, chat, bench, serve, worker):
        mod.register(app)


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
