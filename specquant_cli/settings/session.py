"""What a session is opened with, whichever front end opens it (`SessionSettings`), built from resolved `Settings`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from specquant_cli.settings.limits import DEFAULT_CTX, DEFAULT_DRAFT_MEMORY_MIB, DEFAULT_GAMMA, DEFAULT_RPC_TIMEOUT_S
from specquant_cli.settings.resolved import Settings


@dataclass
class SessionSettings:
    """What a session is opened with (session.open_session), whichever front end opens it; built from resolved
    `Settings` by `of`.

    family: the family folder (None: the default one); n_ctx: the context size of one sequence, also the router's
    limit on a prompt; gamma: the draft length γ; threads: llama.cpp threads (resolved: never 0); policy: the
    default policy; sampling (None: greedy), max_tokens, system, stop: the answers' defaults; router_config: a
    TOML file with a [router] table (None: ./specquant.toml when present); rpc: the parent's RPC workers and
    rpc_timeout their reply deadline; mmap: map model files; facts: this machine's hardware facts when already
    detected; parallel: sequences every context holds, each with n_ctx positions; draft_memory: MiB of each
    policy's drafting memory; cache_ram: MiB of the prompt cache (serve), counted by the memory check; parent: the
    parent's rendering as asked (fastest, f16, bf16), decided by system.renderings when the session opens."""

    family: Optional[Path] = None
    n_ctx: int = DEFAULT_CTX
    gamma: int = DEFAULT_GAMMA
    threads: Optional[int] = None
    policy: Optional[str] = None
    sampling: object = None  # a decoding.sampling.SamplingParams (named, not imported: settings is below it)
    max_tokens: int = 256
    system: Optional[str] = None
    stop: tuple[str, ...] = ()
    router_config: Optional[Path] = None
    rpc: list[str] = field(default_factory=list)
    facts: object = None
    parallel: int = 1
    mmap: bool = False
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT_S
    draft_memory: float = DEFAULT_DRAFT_MEMORY_MIB
    cache_ram: float = 0.0
    parent: str = "fastest"

    def __post_init__(self):
        self.stop = tuple(self.stop)
        self.rpc = list(self.rpc or [])

    @classmethod
    def of(cls, cfg: Settings, **extra) -> SessionSettings:
        """The session settings `cfg` resolved (the keys it has), plus `extra` fields."""
        names = {"family": "runtime.family", "n_ctx": "runtime.ctx", "gamma": "decoding.gamma",
                 "threads": "runtime.threads", "policy": "decoding.policy", "rpc": "runtime.rpc",
                 "parallel": "runtime.parallel", "mmap": "runtime.mmap", "rpc_timeout": "runtime.rpc_timeout",
                 "draft_memory": "decoding.draft_memory", "cache_ram": "serving.cache_ram",
                 "parent": "runtime.parent"}
        kw = {f: cfg.get(k) for f, k in names.items() if k in cfg.values and cfg.get(k) is not None}
        return cls(**{"router_config": cfg.config, **kw, **extra})
