"""Start-up and shutdown: load the models once (after the placement check), run uvicorn, stop on a signal.

SIGINT/SIGTERM: new requests get 503, the answer being generated ends with an error event (its stream) or a
503 (a plain request), queued ones get 503, then uvicorn closes the connections and the process exits 0.
A second SIGINT forces the exit."""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Optional

import uvicorn

from specquant_cli.decoding.registry import register_family_drafters
from specquant_cli.errors import InputError, ResourceError, SpecquantError
from specquant_cli.family.manifest import MANIFEST
from specquant_cli.routing.policies import POLICIES, all_roles, check_policy, policy_spec
from specquant_cli.serving.schemas import ApiError, GenerationParams
from specquant_cli.serving.slots import MAX_PARALLEL, LockedRouter, Slots, parallel_for
from specquant_cli.serving.worker import EngineWorker

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SHUTDOWN_GRACE_S = 10  # uvicorn's wait for open connections after a signal
WORKER_JOIN_S = 30
RECOVER_POLL_S = 2.0  # how often a server that lost its RPC parent asks whether the workers are back
WARM_UP_TEXT = "Warm up the router."


@dataclass
class ServeOptions:
    policy: str
    policies: list[str] = field(default_factory=list)  # offered per request; empty: every registered policy
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: Optional[str] = None
    max_queue: int = 32
    parallel: Optional[int] = None  # requests decoded together; None: what the calibrated cost curve says pays
    max_tokens: int = 512  # for requests that give none (clamped to what the context has left)
    max_body: int = 1 << 20


class Service:
    """What the routes need: the family, the session (used by the worker thread only), the worker, the
    policies on offer and the request limits."""

    def __init__(self, family, runtime, session, opts: ServeOptions, slots=None):
        self.family = family
        self.runtime = runtime
        self.session = session
        self.slots = slots  # serving.slots.Slots when requests decode together, else None
        self.sessions = [session] if slots is None else \
            [session.for_runtime(rt, LockedRouter(session.router, slots.route_lock())) for rt in slots.runtimes]
        self.default_policy = opts.policy
        self.policies = opts.policies or list(POLICIES)
        self.api_key = opts.api_key or None
        self.max_tokens = opts.max_tokens
        self.max_body = opts.max_body
        self.worker = EngineWorker(self.generate, opts.max_queue, parallel=len(self.sessions))
        if slots is not None:
            slots.in_flight = self.worker.in_flight
        self.parent_tokens_per_s = parent_rate(runtime)  # read once: the runtime belongs to the worker thread
        self.bound_port: Optional[int] = None  # the port uvicorn listens on, once it does
        self.exiting = threading.Event()  # set on SIGINT/SIGTERM: no restart after that
        self._lost = threading.Event()  # the parent is gone (first report handled)
        if runtime.rpc:
            from specquant_cli.system import rpc

            rpc.on_lost(self.parent_lost)

    def parent_lost(self, line: str) -> bool:
        """system.rpc's handler for a worker lost mid-graph: this request and every later one get 503 while the
        workers are away; once they all answer again the server restarts itself on the same port (ggml-rpc
        cannot reconnect inside one process) and loads the parent anew."""
        if self._lost.is_set():  # another of ggml's threads failing too: parked like the first
            return True
        self._lost.set()
        _stderr(f"error: {line}; answering 503 until the workers answer again, then restarting")
        self.worker.lose_engine(ApiError(503, f"{line}; the server restarts by itself once the worker is back",
                                         type="server_error", code="rpc_worker_lost"))
        threading.Thread(target=self._restart_when_back, name="specquant-recover", daemon=True).start()
        return True

    def _restart_when_back(self) -> None:
        from specquant_cli.system import rpc

        while not self.exiting.wait(RECOVER_POLL_S):
            rpc.release_sockets(self.runtime.rpc)  # a surviving worker stays busy with our dead connection
            try:
                rpc.probe_all(self.runtime.rpc)
            except SpecquantError:
                continue
            if self.bound_port is None or self.exiting.is_set():
                return
            _stderr("specquant serve: the RPC workers answer again; restarting to load the parent")
            args = with_port(sys.argv[1:], self.bound_port)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # ggml's sockets are not close-on-exec
            os.execv(sys.executable, [sys.executable, "-m", "specquant_cli", *args])

    def policy_for(self, requested: Optional[str], param: str) -> str:
        if requested is None:
            return self.default_policy
        if requested not in self.policies:
            raise ApiError(400, f"unknown or unavailable policy {requested!r}; this server offers: "
                                f"{', '.join(self.policies)}", param=param, code="invalid_policy")
        return requested

    def model_card(self) -> dict:
        fam = self.family
        return {"id": fam.name, "object": "model", "created": int((fam.root / MANIFEST).stat().st_mtime),
                "owned_by": "specquant",
                "specquant": {"roles": {r: fam.variant(r)["type"] for r in fam.roles()},
                              "loaded": self.runtime.loaded(), "policies": self.policies,
                              "default_policy": self.default_policy, "provenance": fam.provenance,
                              "parent_tokens_per_s": self.parent_tokens_per_s}}

    def generate(self, params: GenerationParams, slot: int = 0):
        """On slot `slot`'s thread: route, plan and return (answer, records) for one request."""
        session = self.sessions[slot]
        limit = params.max_tokens
        if limit is None:  # OpenAI's "as long as the context allows", bounded by the server's default
            model = self.runtime.tokenizer()
            n_prompt = len(model.chat_prompt(params.messages)) if params.messages is not None else \
                len(model.tokenize(params.prompt, add_bos=model.add_bos()))
            limit = max(1, min(self.max_tokens, self.runtime.n_ctx - n_prompt))
        answer, records = session.ask_messages(params.messages or [], policy=params.policy,
                                               sampling=params.sampling, max_tokens=limit, stop=params.stop,
                                               raw_prompt=params.prompt)
        return answer, records if self.slots is None else self.slots.member(records)


def with_port(args: list[str], port: int) -> list[str]:
    """The command line `args` with --port set to `port` (a restart keeps the port, --port 0 included)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--port":
            skip = True
        elif not a.startswith("--port="):
            out.append(a)
    return [*out, "--port", str(port)]


def parent_rate(runtime) -> Optional[float]:
    """The parent's calibrated decode speed on this machine (tokens/s: one 1-token call each), None when this
    machine has no valid calibration for the family (`specquant calibrate`; the auto policy measures it)."""
    cal = runtime.calibration(measure=False)
    step = cal.parent_call_s.get(1) if cal is not None else None
    return round(1.0 / step, 2) if step else None


def build_service(family, opts: ServeOptions, n_ctx: int, gamma: int, threads: Optional[int],
                  router_config=None, report=None) -> Service:
    """Load every role the offered policies can use (placement-checked first) and warm the router. `report`:
    where calibration's progress and warnings go (reporting.Reporter; silent when None)."""
    from specquant_cli.session import open_session
    from specquant_cli.settings import SessionSettings

    check_policy(opts.policy)
    for p in opts.policies:
        check_policy(p)
    if not opts.policies:  # every registered policy this family has the roles for
        have = set(family.roles())
        opts.policies = [p for p in POLICIES if set(all_roles([p])) <= have]
        opts.policies += [f"spec-{r}" for r in register_family_drafters(family.roles())
                          if f"spec-{r}" not in opts.policies]  # roles made by quantize --grade --role NAME
    if opts.policies and opts.policy not in opts.policies:
        raise InputError(f"--policy {opts.policy} must be one of --policies ({', '.join(opts.policies)})")
    session = open_session(SessionSettings(n_ctx=n_ctx, gamma=gamma, threads=threads, policy=opts.policy,
                                           router_config=router_config,
                                           parallel=MAX_PARALLEL if opts.parallel is None else opts.parallel),
                           family=family, **({"report": report} if report is not None else {}))
    runtime = session.runtime
    try:
        roles = all_roles([opts.policy, *(opts.policies or POLICIES)])
        try:
            runtime.ensure(roles)
        except ResourceError as e:
            raise ResourceError(f"{e}; offer fewer policies with --policies (their roles: {', '.join(roles)})") \
                from None
        for name in dict.fromkeys([opts.policy, *(opts.policies or POLICIES)]):
            # Planning once per policy loads spaCy, and has a planner measure what it needs (once per machine),
            # now rather than during the first request.
            session.plan(WARM_UP_TEXT, name)
        if any(policy_spec(p).planner is not None for p in [opts.policy, *opts.policies]):
            runtime.load_planner_drafts()  # the drafts auto may pick (recipe roles too), not during a request
        opts.parallel = parallel_for(runtime, opts.parallel)
        return Service(family, runtime, session, opts, Slots(runtime, opts.parallel) if opts.parallel > 1 else None)
    except BaseException:
        runtime.close()
        raise


def run(svc: Service, opts: ServeOptions, say=None) -> None:
    """Serve until SIGINT/SIGTERM, then stop the worker and free the models."""
    from specquant_cli.serving.app import create_app

    say = say or _stderr
    if opts.host not in LOOPBACK and not svc.api_key:
        say(f"warning: listening on {opts.host} without an API key: anyone who can reach it can use it "
            "(set --api-key or SPECQUANT_API_KEY)")
    config = uvicorn.Config(create_app(svc), host=opts.host, port=opts.port, log_level="warning",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    server = _Server(config, svc, opts, say)
    svc.worker.start()
    try:
        server.run()
    finally:
        svc.worker.stop()
        if svc.worker.lost is None:  # else its thread and the parent's sockets are stuck for good: leave them
            svc.worker.join(WORKER_JOIN_S)
            svc.runtime.close()
    say("specquant serve: stopped")


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
            self._say(f"specquant serve: listening on http://{shown}:{port} (family {self._svc.family.name}, "
                      f"policy {self._svc.default_policy}, {self._opts.parallel} at once, "
                      f"queue {self._opts.max_queue}, "
                      f"{'API key required' if self._svc.api_key else 'no API key'})")

    def handle_exit(self, sig: int, frame) -> None:
        self._svc.exiting.set()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True
        # Why a thread: this runs inside a signal handler on the loop's thread, which may hold the worker's lock.
        threading.Thread(target=self._svc.worker.stop, name="specquant-stop", daemon=True).start()


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
