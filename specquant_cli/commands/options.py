"""Reusable option specs for the commands (one place, so every command spells an option the same way)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer

from specquant_cli.routing.policies import DEFAULT_POLICY, policy_help

FAMILY_ENV = "SPECQUANT_FAMILY"

FamilyOpt = typer.Option(None, "--family", help=f"Family folder (default: ${FAMILY_ENV}, else models/smollm2-135m)")
PolicyOpt = typer.Option(DEFAULT_POLICY, "--policy", help=policy_help())
ConfigOpt = typer.Option(None, "--config", help="Router config (TOML, [router] table); default ./specquant.toml")
JsonOpt = typer.Option(False, "--json", help="JSON on stdout (one object per answer or report)")
MAX_CTX = 1 << 20
CtxOpt = typer.Option(4096, "--ctx", min=256, max=MAX_CTX, help="Context size (tokens)")


def thread_bound(value: Optional[int]) -> Optional[int]:
    """Option callback: a --threads count of at most 4 x logical cores (0 and None mean the default)."""
    if value:
        from specquant_cli.backend.llama import threads_problem

        why = threads_problem(value)
        if why:
            raise typer.BadParameter(f"{value}: {why}")
    return value


# One meaning everywhere: 0 (the default) is every core, or $SPECQUANT_THREADS where llama.cpp runs.
ThreadsOpt = typer.Option(0, "--threads", min=0, callback=thread_bound, help="Threads (0 = all cores)")
SeedOpt = typer.Option(None, "--seed", min=0, max=2**64 - 1, help="Same seed, same sampled output")


def finite(value: Optional[float]) -> Optional[float]:
    """Option callback: a float option must be a finite number (click's ranges let inf and nan through)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


TemperatureOpt = typer.Option(0.0, "--temperature", min=0.0, callback=finite, help="0 = greedy")
TopPOpt = typer.Option(1.0, "--top-p", min=0.0, max=1.0, callback=finite)


def split_list(value: Optional[str], option: str, what: str) -> Optional[list[str]]:
    """A comma-separated option as a list of distinct non-empty items; None when not given."""
    from specquant_cli.errors import InputError

    if value is None:
        return None
    items = list(dict.fromkeys(x.strip() for x in value.split(",") if x.strip()))
    if not items:
        raise InputError(f"{option} {value!r}: no {what} given")
    return items


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


def rpc_endpoints(value: Optional[str]) -> Optional[str]:
    """Option callback: --rpc / $SPECQUANT_RPC, checked and made the session's workers (system.rpc.configure)."""
    from specquant_cli.errors import InputError
    from specquant_cli.system import rpc

    try:
        rpc.configure(rpc.parse_endpoints(value))
    except InputError as e:
        raise typer.BadParameter(str(e).removeprefix("--rpc ")) from None
    return value


RpcOpt = typer.Option(None, "--rpc", envvar="SPECQUANT_RPC", callback=rpc_endpoints, show_envvar=True,
                      help="Run the parent's layers on llama.cpp RPC workers HOST:PORT[,HOST:PORT…] "
                           "(specquant worker); drafts stay here")
