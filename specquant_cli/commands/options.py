"""Reusable option specs for the commands (one place, so every command spells an option the same way)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from specquant_cli.routing.policies import DEFAULT_POLICY, policy_help

FAMILY_ENV = "SPECQUANT_FAMILY"

FamilyOpt = typer.Option(None, "--family", help=f"Family folder (default: ${FAMILY_ENV}, else models/smollm2-135m)")
PolicyOpt = typer.Option(DEFAULT_POLICY, "--policy", help=policy_help())
ConfigOpt = typer.Option(None, "--config", help="Router config (TOML, [router] table); default ./specquant.toml")
JsonOpt = typer.Option(False, "--json", help="JSON on stdout (one object per answer or report)")
CtxOpt = typer.Option(4096, "--ctx", min=256, help="Context size")


def load_family(path: Optional[Path]):
    """The family at `path`, else at $SPECQUANT_FAMILY, else the demo family's folder."""
    from specquant_cli.errors import FamilyError
    from specquant_cli.family.manifest import DEFAULT_FAMILY_DIR, Family

    env = os.environ.get(FAMILY_ENV)
    root = path or (Path(env) if env else DEFAULT_FAMILY_DIR)
    try:
        return Family.load(root)
    except FamilyError:
        if path is None and not env:
            raise FamilyError(f"no model family at {root}; fetch the demo family with: specquant pull smollm2-135m") \
                from None
        raise
