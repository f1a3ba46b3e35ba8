"""Settings, in one place: what a session is opened with (`SessionSettings`) and every `SPECQUANT_*` environment
variable (`ENV`, read only through `env`). Commands and the server turn their options into a
`SessionSettings` and call `session.open_session`; core code receives settings and never reads `os.environ`.
Who reads each variable: `session.load_family` (FAMILY), backend.llama (THREADS, MMAP, LLAMA_LOG), system.rpc
(RPC_TIMEOUT), the `--rpc` and `--api-key` options (RPC, API_KEY: typer's envvar), cli and serving.app
(DEBUG), backend.selftest (SELFTEST_*) — each through `env`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # this module imports nothing of the package at load: the backend reads its variables too
    from specquant_cli.decoding.sampling import SamplingParams

ENV = {
    "SPECQUANT_FAMILY": "the family folder when --family is not given",
    "SPECQUANT_THREADS": "llama.cpp threads when a command gives none",
    "SPECQUANT_RPC": "the parent's RPC workers (--rpc)",
    "SPECQUANT_RPC_TIMEOUT": "seconds one RPC reply may take",
    "SPECQUANT_API_KEY": "serve's API key (--api-key)",
    "SPECQUANT_MMAP": "1: map model files instead of reading them",
    "SPECQUANT_LLAMA_LOG": "a file for llama.cpp's own log",
    "SPECQUANT_DEBUG": "re-raise errors with their traceback",
    "SPECQUANT_SELFTEST_CHILD": "set in the build self-test's child processes",
    "SPECQUANT_SELFTEST_FAULT": "a fault the self-test's tests inject",
}
DEFAULT_FAMILY_DIR = Path("models") / "smollm2-135m"  # where session.load_family looks when nothing names a family
DEFAULT_CTX = 4096


def env(name: str) -> str:
    """The value of the `SPECQUANT_*` variable `name` ("" when unset), read now (tests and the self-test set
    them per process); a name not in ENV is a programming error."""
    if name not in ENV:
        raise KeyError(f"{name} is not a specquant setting (settings.ENV)")
    return os.environ.get(name, "")


def debug() -> bool:
    """SPECQUANT_DEBUG: errors are re-raised with their traceback."""
    return env("SPECQUANT_DEBUG") not in ("", "0")


@dataclass
class SessionSettings:
    """What a session is opened with (session.open_session), whichever front end opens it.

    family: the family folder (None: $SPECQUANT_FAMILY, else models/smollm2-135m); n_ctx: the context size,
    which is also the router's limit on a prompt (one rule for every front end); gamma: the draft length γ
    (fixed, or the initial one of an adaptive policy; None: decoding.engine.DEFAULT_GAMMA); threads:
    llama.cpp threads (None or 0: every core, or $SPECQUANT_THREADS); policy: the default policy (None: the
    policy table's default); sampling (None: greedy), max_tokens, system, stop: the answers' defaults;
    router_config: a TOML file with a [router] table (None: ./specquant.toml when present); rpc:
    the parent's RPC workers (None: those `--rpc`/$SPECQUANT_RPC configured); facts: this machine's hardware
    facts when already detected; parallel: sequences every context holds, each with n_ctx positions."""

    family: Optional[Path] = None
    n_ctx: int = DEFAULT_CTX
    gamma: Optional[int] = None
    threads: Optional[int] = None
    policy: Optional[str] = None
    sampling: Optional[SamplingParams] = None
    max_tokens: int = 256
    system: Optional[str] = None
    stop: tuple[str, ...] = ()
    router_config: Optional[Path] = None
    rpc: Optional[list[str]] = None
    facts: object = None
    parallel: int = 1  # sequences every context holds (serve --parallel: one per concurrent request)

    def __post_init__(self):
        self.threads = self.threads or None  # 0 and None both mean "every core" (or $SPECQUANT_THREADS)
        self.stop = tuple(self.stop)
