"""Start-up and shutdown: load the models once (after the placement check), run uvicorn, stop on a signal.

SIGINT/SIGTERM: new requests get 503, the answer being generated ends with an error event (its stream) or a
503 (a plain request), queued ones get 503, then uvicorn closes the connections and the process exits 0.
A second SIGINT forces the exit."""

from __future__ import annotations

import math
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import uvicorn

from specquant_cli.decoding.registry import register_family_drafters
from specquant_cli.errors import InputError, ResourceError
from specquant_cli.routing.policies import POLICIES, all_roles, check_policy, policy_spec
from specquant_cli.serving.app import create_app
from specquant_cli.serving.keys import api_keys
from specquant_cli.serving.service import Service, stderr_line
from specquant_cli.serving.slots import Slots, parallel_for
from specquant_cli.settings import DEFAULT_PREFILL_CHUNK, SessionSettings, Settings, decide_cache_ram

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SHUTDOWN_GRACE_S = 10  # uvicorn's wait for open connections after a signal
WORKER_JOIN_S = 30
RPC_RELEASE_S = 2.0  # after the worker connections are shut: time for a stuck call to fail
CACHE_FLUSH_S = 60.0  # at the end: time for the prompt cache's folder writes still pending (each under a second)
WARM_UP_TEXT = "Warm up the router."


@dataclass(frozen=True)
class ServeOptions:
    """What the server runs with, every value decided (serve_settings)."""

    policy: str
    policies: tuple[str, ...]  # offered per request
    parallel: int  # requests decoded together: the sequences every context holds
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: Optional[str] = None  # the first of api_keys (None: none), for the code that knows one key
    max_queue: int = 32
    max_tokens: Optional[int] = None  # cap of requests that give none (None: what the context has left)
    max_body: int = 1 << 20
    parallel_from: str = ""  # where `parallel` came from (a flag, a variable, the calibration, ...)
    allow_hosts: tuple[str, ...] = ()  # names the Host header may carry besides the server's own
    cors_origins: tuple[str, ...] = ()  # origins whose pages may call across sites
    prompt_cache: bool = True  # reuse computed prompt prefixes (own, another slot's, the prompt cache's)
    cache_ram: float = 0.0  # MiB of the prompt cache (0: none)
    cache_dir: Optional[Path] = None  # where the prompt cache is also written
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    api_keys: tuple[str, ...] = ()  # every key, each a tenant: the --api-key ones, then --api-key-file's, distinct
    cache_disk: Optional[float] = None  # MiB the cache folder holds in all (None: cache_ram's)
    strict_tools: bool = False  # /v1/responses refuses built-in tools instead of leaving them out


def protection_warnings(cfg: Settings) -> list[str]:
    """One line for each setting of `cfg` that turns a protection of the server off, naming where it came from
    (a specquant.toml in the current folder is read without a word, so its path is said): `*` in
    serving.cors_origin (the cross-site guard), `*` in serving.allow_host (the DNS-rebinding guard), and a
    non-loopback serving.host without any API key."""
    out = []
    v = cfg.values
    if "serving.cors_origin" in v and "*" in (cfg.get("serving.cors_origin") or ()):
        out.append(f"warning: {cfg.stated('serving.cors_origin')} turns the cross-site guard off: any web page "
                   "can call this server")
    if "serving.allow_host" in v and "*" in (cfg.get("serving.allow_host") or ()):
        out.append(f"warning: {cfg.stated('serving.allow_host')} turns the DNS-rebinding guard off: a web page "
                   "under any name that resolves to this machine can call this server")
    keyed = any(k in v and cfg.get(k) is not None for k in ("serving.api_key", "serving.api_key_file"))
    if "serving.host" in v and not _loopback(cfg.get("serving.host")) and not keyed:
        out.append(f"warning: listening on {cfg.get('serving.host')} ({cfg.stated('serving.host')}) without an "
                   "API key: anyone who can reach it can use it (set --api-key or --api-key-file)")
    return out


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return host in LOOPBACK or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def memory_policies(policies) -> list[str]:
    """Those of `policies` that draft from a drafting memory of their own (runtime.drafters keeps one per policy,
    each of decoding.draft_memory MiB): a policy whose drafter, on any tier, reads one (its registry spec says so:
    DrafterSpec.memory), and one a planner decides (auto may pick those)."""
    from specquant_cli.decoding.registry import DRAFTERS

    out = []
    for p in dict.fromkeys(policies):
        spec = policy_spec(p)
        drafters = {spec.drafter, *(spec.by_tier or {}).values()} - {None}
        if spec.planner is not None or any(d in DRAFTERS and DRAFTERS[d].memory for d in drafters):
            out.append(p)
    return out


def cache_floor_mib(family) -> float:
    """The smallest prompt cache that holds one entry: CACHE_RAM_MIN_MIB, or the parent's state of the shortest
    prefix the cache keeps (runtime.prefixes.MIN_REUSE tokens) where that is more."""
    from specquant_cli.family.gguf_walk import kv_cache_bytes
    from specquant_cli.runtime.prefixes import MIN_REUSE
    from specquant_cli.runtime.prompt_cache import ENTRY_OVERHEAD
    from specquant_cli.settings import CACHE_RAM_MIN_MIB

    try:
        entry = kv_cache_bytes(dict(family.hparams), MIN_REUSE) + ENTRY_OVERHEAD
    except (AttributeError, TypeError, ValueError):
        entry = 0
    return max(CACHE_RAM_MIN_MIB, entry / (1 << 20))


def _check_cache_ram(cfg: Settings, family) -> None:
    """A prompt cache given a budget (above 0: 0 is off) too small for one entry is refused: it would store
    nothing, and --cache-dir with it nothing either. A budget the machine decided is never refused."""
    s = cfg.serving
    mib = s.cache_ram
    if not s.prompt_cache or not mib or cfg.source("serving.cache_ram") == "machine":
        return
    floor = cache_floor_mib(family)
    if mib < floor:
        raise InputError(f"{cfg.stated('serving.cache_ram')}: a prompt cache of {mib:g} MiB holds no entry (one "
                         f"takes ~{floor:.2f} MiB); give at least {math.ceil(floor * 100) / 100:g}, or 0 for none")


def _check_memory(cfg: Settings, family, facts, policies: list[str], parallel: int, cache_ram: float) -> None:
    """The placement check (system.placement.require_fit) of every role `policies` load, before any loads, with
    what serve keeps beside the models: the prompt cache (cache_ram MiB) and one drafting memory of
    decoding.draft_memory MiB per policy that drafts from one (memory_policies). With RPC workers the parent is
    theirs (checked when it loads): the rest is checked here."""
    from specquant_cli.family.roles import PARENT_ROLE
    from specquant_cli.system.placement import require_fit

    reserves = {}
    if cache_ram:
        given = cfg.stated("serving.cache_ram") if cfg.source("serving.cache_ram") != "machine" else "--cache-ram"
        reserves[f"the prompt cache's {cache_ram / 1024:.2f} GiB ({given})"] = int(cache_ram * (1 << 20))
    drafting = memory_policies(policies)
    mib = cfg.decoding.draft_memory if "decoding.draft_memory" in cfg.values else 0.0
    if drafting and mib:
        given = cfg.stated("decoding.draft_memory") if cfg.source("decoding.draft_memory") != "default" \
            else "--draft-memory"
        reserves[f"the drafting memories' {len(drafting) * mib / 1024:.2f} GiB ({len(drafting)} "
                 f"{'policy' if len(drafting) == 1 else 'policies'} × {mib:g} MiB, {given})"] = \
            int(len(drafting) * mib * (1 << 20))
    roles = all_roles(policies)
    if cfg.runtime.rpc:
        roles = [r for r in roles if r != PARENT_ROLE]
    require_fit(facts, family, roles, cfg.runtime.ctx * parallel, beside=reserves,
                hint="lower --draft-memory or offer fewer policies (--policies)" if drafting and mib else "")


def serve_settings(cfg: Settings, family, facts=None, report=None) -> tuple[Settings, ServeOptions]:
    """`cfg` with serve's machine-decided values decided (runtime.parallel: serving.slots.parallel_for), and the
    server's options, before any context is sized. The policies on offer default to every registered policy
    this family has the roles for; --policy must be one of them. When a policy on offer plans from this
    machine's costs and none are stored, they are measured first (one sequence per model, released after), so
    that the sequences are decided by them, as at every later start; without such a policy, or with RPC
    workers, the prior cost curve decides."""
    policy = cfg.decoding.policy
    keys = api_keys(cfg)  # a bad key file stops here, before anything loads
    for line in protection_warnings(cfg):
        stderr_line(line)
    offered = list(cfg.serving.policies or [])
    if not offered:
        have = set(family.roles())
        offered = [p for p in POLICIES if set(all_roles([p])) <= have]
        offered += [f"spec-{r}" for r in register_family_drafters(family.roles(), family.siblings())
                    if f"spec-{r}" not in offered]  # roles made by quantize --grade --role NAME
    if policy not in offered:
        raise InputError(f"--policy {policy} must be one of --policies ({', '.join(offered)})")
    if facts is None:
        from specquant_cli.system.hardware import detect

        facts = detect()
    if cfg.serving.cache_ram is None:
        cfg = decide_cache_ram(cfg, facts.ram_available)
    _check_cache_ram(cfg, family)
    cache_ram = cfg.serving.cache_ram if cfg.serving.prompt_cache else 0.0
    if cfg.runtime.parallel is None:
        n, why = parallel_for(family, facts, cfg.runtime.threads, cfg.runtime.rpc or [])
        if why is None and not cfg.runtime.rpc and any(policy_spec(p).planner is not None for p in offered):
            _check_memory(cfg, family, facts, [policy, *offered], 1, cache_ram)  # before measuring loads them
            _measure_costs(cfg, family, facts, report)
            n, why = parallel_for(family, facts, cfg.runtime.threads, [])
        why = why or "the prior cost curve (no calibration for this machine)"
        cfg = cfg.decided("runtime.parallel", *_fitting(cfg, family, facts, [policy, *offered], n, why, cache_ram))
    try:
        _check_memory(cfg, family, facts, [policy, *offered], cfg.runtime.parallel, cache_ram)
    except ResourceError as e:
        if cfg.source("runtime.parallel") == "machine" or cfg.runtime.parallel == 1:
            raise
        raise ResourceError(f"{e}; {cfg.stated('runtime.parallel')} holds --ctx {cfg.runtime.ctx} positions for each "
                            "of its sequences: give fewer, or leave it out to have the most that fit") from None
    s, v = cfg.serving, cfg.values["runtime.parallel"]
    if s.cache_dir is not None and not cache_ram:
        stderr_line(f"warning: --cache-dir {s.cache_dir} is not used: the prompt cache is off "
                    f"({'--no-prompt-cache' if not s.prompt_cache else '--cache-ram 0'})")
    return cfg, ServeOptions(policy, tuple(offered), cfg.runtime.parallel, s.host, s.port, keys[0] if keys else None,
                             s.queue, s.max_tokens, s.max_body, v.origin or v.source, tuple(s.allow_host or ()),
                             tuple(s.cors_origin or ()), s.prompt_cache, cache_ram, s.cache_dir if cache_ram else None,
                             s.prefill_chunk, keys, s.cache_disk, strict_tools=s.strict_tools)


def _fitting(cfg: Settings, family, facts, policies: list[str], n: int, why: str, cache_ram: float
             ) -> tuple[int, str]:
    """(sequences, where that came from) for a --parallel the user did not give: `n` (from `why`), or the most below
    it whose contexts fit this machine's RAM beside the models, said in one stderr line. Only a value the user gave
    is refused for not fitting (by the check after this); at one sequence, the models themselves do not fit."""
    for k in range(n, 0, -1):
        try:
            _check_memory(cfg, family, facts, policies, k, cache_ram)
        except ResourceError as e:
            if k == 1:
                raise
            if k == n:
                first = str(e)
            continue
        if k < n:
            stderr_line(f"specquant serve: {k} at once, not the {n} of {why}: {n} sequences of --ctx "
                        f"{cfg.runtime.ctx} do not fit ({first}); --parallel sets it")
            return k, f"{why}, lowered from {n} to fit this machine's RAM"
        return k, why
    return 1, why


def _measure_costs(cfg: Settings, family, facts, report) -> None:
    from specquant_cli.session import open_session

    runtime = open_session(SessionSettings.of(cfg, parallel=1, facts=facts), family=family,
                           **({"report": report} if report is not None else {})).runtime
    try:
        runtime.calibration(measure=True)
    finally:
        runtime.close()


def build_service(family, cfg: Settings, opts: ServeOptions, report=None, facts=None) -> Service:
    """Load every role the offered policies can use (placement-checked first), each context sized for the
    `opts.parallel` sequences that will run, and warm the router. `report`: where calibration's progress and
    warnings go (reporting.Reporter; silent when None)."""
    from specquant_cli.session import open_session

    check_policy(opts.policy)
    for p in opts.policies:
        check_policy(p)
    if opts.cache_dir is not None:
        from specquant_cli.fsutil import check_folder_writable
        from specquant_cli.names import MANIFEST
        from specquant_cli.runtime.prompt_cache import private_folder

        if (opts.cache_dir / MANIFEST).exists():
            raise InputError(f"--cache-dir: {opts.cache_dir} is a family folder; name a folder of its own")
        check_folder_writable(private_folder(opts.cache_dir, "--cache-dir", report), "--cache-dir")
    session = open_session(SessionSettings.of(cfg, parallel=opts.parallel, facts=facts, cache_ram=opts.cache_ram),
                           family=family, **({"report": report} if report is not None else {}))
    runtime = session.runtime
    try:
        roles = all_roles([opts.policy, *opts.policies])
        try:
            runtime.pool.ensure(roles)
        except ResourceError as e:
            raise ResourceError(f"{e}; offer fewer policies with --policies (their roles: {', '.join(roles)})") \
                from None
        for name in dict.fromkeys([opts.policy, *opts.policies]):
            # Planning once per policy loads spaCy, and has a planner measure what it needs (once per machine),
            # now rather than during the first request.
            session.plan(WARM_UP_TEXT, name)
        if any(policy_spec(p).planner is not None for p in [opts.policy, *opts.policies]):
            runtime.load_planner_drafts([opts.policy, *opts.policies])  # the drafts auto can use, before a request
        slots = Slots(runtime, opts.parallel, opts.prefill_chunk) if opts.parallel > 1 else None
        prefixes = share_prefixes(runtime, slots, opts, report)
        return Service(family, runtime, session, opts, slots, prefixes)
    except BaseException:
        runtime.close()
        raise


def share_prefixes(runtime, slots, opts: ServeOptions, report=None):
    """The parent sequences' prefix sharing and prompt cache (runtime.prefixes), attached to every parent sequence
    the server decodes in."""
    from specquant_cli.family.roles import PARENT_ROLE
    from specquant_cli.runtime.prefixes import PrefixSharing
    from specquant_cli.runtime.prompt_cache import PromptCache, cache_tag, user_key

    cache = None
    if opts.prompt_cache and opts.cache_ram > 0:
        cache = PromptCache(int(opts.cache_ram * (1 << 20)), cache_tag(runtime.family, runtime.pool.n_ctx),
                            opts.cache_dir, report, key=user_key() if opts.cache_dir is not None else None,
                            disk_budget=int(opts.cache_disk * (1 << 20)) if opts.cache_disk else None,
                            write_behind=True)
    if slots is None:
        return PrefixSharing([runtime.pool.context(PARENT_ROLE)], cache, threading.RLock(), reuse=opts.prompt_cache)
    views = [rt.pool.context(PARENT_ROLE) for rt in slots.runtimes]
    return PrefixSharing(views, cache, slots.batcher.ops, slots.batcher.away, reuse=opts.prompt_cache)


def run(svc: Service, opts: ServeOptions, say=None) -> None:
    """Serve until SIGINT/SIGTERM, then stop the worker and free the models. The settings that turn a protection
    off were said by serve_settings (protection_warnings), before anything loaded."""
    say = say or stderr_line
    config = uvicorn.Config(create_app(svc), host=opts.host, port=opts.port, log_level="warning",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    server = _Server(config, svc, opts, say)
    svc.worker.start()
    try:
        server.run()
    finally:
        svc.worker.stop()
        if svc.worker.lost is None:  # else its thread and the parent's sockets are stuck for good: leave them
            _join_engine(svc, say)
        _flush_cache(svc, say)
    say("specquant serve: stopped")


def _flush_cache(svc: Service, say) -> None:
    """The prompt cache's entries still to be written to --cache-dir, written before the process ends (a request
    never waits for them: runtime.prompt_cache)."""
    cache = svc.prefixes.cache if svc.prefixes is not None else None
    if cache is None or not cache.pending():
        return
    if not cache.flush(CACHE_FLUSH_S):
        say(f"warning: {cache.pending()} prompt-cache entries not written to {cache.directory} "
            f"within {CACHE_FLUSH_S:g} s; the folder loses them")


def _join_engine(svc: Service, say) -> None:
    """Wait for the generation threads, then free the models. A thread stuck on a stalled RPC worker is freed
    by shutting the worker connections (its call then fails, and the thread is parked); one that still does not
    end is left behind, with its models, rather than freed under it."""
    svc.worker.join(WORKER_JOIN_S if not svc.runtime.pool.rpc else SHUTDOWN_GRACE_S)
    if svc.worker.alive() and svc.runtime.pool.rpc:
        from specquant_cli.system import rpc

        rpc.release_sockets(svc.runtime.pool.rpc)
        svc.worker.join(RPC_RELEASE_S)
    if svc.worker.alive():
        say("warning: a generation did not stop (waiting on an RPC worker); exiting without freeing its models")
        return
    svc.runtime.close()


def tenants_said(n_keys: int) -> str:
    """How the start-up line says who shares what: each API key is a tenant of its own."""
    if n_keys == 0:
        return "no API key: one tenant, every client shares the prompt cache and the drafting memory"
    if n_keys == 1:
        return "API key required: one tenant"
    return f"{n_keys} API keys: {n_keys} tenants, none sees another's prompt cache or drafting memory"


class _Server(uvicorn.Server):
    """uvicorn's server, told about the signal: the worker stops the running answer at once (uvicorn alone
    would wait for the stream to finish), and the signal is not re-raised after a clean shutdown."""

    def __init__(self, config: uvicorn.Config, svc: Service, opts: ServeOptions, say):
        super().__init__(config)
        self._svc = svc
        self._opts = opts
        self._say = say

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self._svc.bound_port = port
            shown = f"[{host}]" if ":" in host else host
            fam = self._svc.family
            self._say(f"specquant serve: listening on http://{shown}:{port} (family {fam.name}, "
                      f"parent {fam.parent_why or fam.parent_rendering}, policy {self._svc.default_policy}, "
                      f"{self._opts.parallel} at once "
                      f"({self._opts.parallel_from}), "
                      f"queue {self._opts.max_queue}, "
                      f"{tenants_said(len(self._svc.api_keys))})")

    def handle_exit(self, sig: int, frame) -> None:
        self._svc.exiting.set()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True
        # Why a thread: this runs inside a signal handler on the loop's thread, which may hold the worker's lock.
        threading.Thread(target=self._svc.worker.stop, name="specquant-stop", daemon=True).start()
