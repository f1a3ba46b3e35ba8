"""The Typer app: wires the commands and maps errors to one line on stderr and exit code 1."""

from __future__ import annotations

import os
import sys

import typer
from typer.core import TyperGroup

from specquant_cli.errors import SpecquantError


def _debug() -> bool:
    return os.environ.get("SPECQUANT_DEBUG", "") not in ("", "0")


class _Group(TyperGroup):
    """Translate the exception family once, at the edge. SPECQUANT_DEBUG=1 re-raises."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except SpecquantError as e:
            if _debug():
                raise
            _say(f"error: {e}")
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            if _debug():
                raise
            _say("interrupted")
            raise typer.Exit(130) from None
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

        sys.stdout.write(f"specquant {version('specquant')} (llama-cpp-python {version('llama-cpp-python')})\n")
        raise typer.Exit(0)


@app.callback()
def _root(_: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit")) -> None:
    """specquant: quantized families, complexity routing and lossless speculative decoding."""


def _register() -> None:
    from specquant_cli.commands import bench, calibrate, chat, doctor, pull, quantize, route, serve

    for mod in (pull, quantize, doctor, route, calibrate, chat, bench, serve):
        mod.register(app)


_register()


def main() -> None:
    app(prog_name="specquant")


if __name__ == "__main__":
    sys.exit(main())
