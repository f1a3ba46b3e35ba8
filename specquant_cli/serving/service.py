"""What the routes need (`Service`): the family, the sessions (one per slot), the worker that runs them, the
policies on offer and the request limits, the tenants; and what happens when the parent's RPC workers are lost.

Tenants: each API key the server holds is a tenant (a server without a key is one tenant). What a request may
share with earlier ones — its slot's cells, another slot's, the prompt cache's entries, the drafting memory — is
its scope: its tenant, narrowed by its `cache_salt` (`scope_of`). Nothing crosses scopes, so neither the time to
the first token nor `cached_tokens` says anything about another scope's prompts."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import os
import sys
import threading
from typing import Optional

from specquant_cli.errors import InputError, SpecquantError
from specquant_cli.names import MANIFEST
from specquant_cli.serving.schemas import ApiError, GenerationParams
from specquant_cli.serving.security import OriginPolicy
from specquant_cli.serving.slots import LockedRouter
from specquant_cli.serving.worker import EngineWorker

COMPILES = 2  # grammars (response_format, tools) compiled at once, off the event loop
RECOVER_POLL_S = 2.0  # how often a server that lost its RPC parent asks whether the workers are back


class Service:
    """What the routes need: the family, the session (used by the worker thread only), the worker, the
    policies on offer and the request limits."""

    def __init__(self, family, runtime, session, opts, slots=None, prefixes=None):
        self.family = family
        self.runtime = runtime
        self.session = session
        self.slots = slots  # serving.slots.Slots when requests decode together, else None
        self.prefixes = prefixes  # runtime.prefixes.PrefixSharing of the parent's sequences, else None
        self.sessions = [session] if slots is None else \
            [session.for_runtime(rt, LockedRouter(session.router, slots.route_lock())) for rt in slots.runtimes]
        self.default_policy = opts.policy
        self.policies = list(opts.policies)
        self.api_keys = tuple(getattr(opts, "api_keys", ()) or ((opts.api_key,) if opts.api_key else ()))
        self.api_key = self.api_keys[0] if self.api_keys else None
        # what scope names are made with: the prompt cache's key (its files outlive the process), else this process's
        self._scope_key = prefixes.cache.key if prefixes is not None and prefixes.cache is not None else os.urandom(32)
        self.origin_policy = OriginPolicy.of(opts.host, opts.allow_hosts, opts.cors_origins)
        self.max_tokens = opts.max_tokens  # None: an answer may run to the end of the context
        self.strict_tools = getattr(opts, "strict_tools", False)  # /v1/responses (serving.responses)
        self.max_body = opts.max_body
        self.worker = EngineWorker(self.generate, opts.max_queue, parallel=len(self.sessions), choose=self.slot_for,
                                   parkable=self.parkable, park=self.park)
        if slots is not None:
            slots.in_flight = self.worker.in_flight
        from specquant_cli.decoding.grammar import tokenizer_for

        tokenizer_for(runtime.tokenizer())  # the grammar engine's view of the vocabulary (~1 s), before serving
        self.compiling = asyncio.Semaphore(COMPILES)  # requests' grammars compiled at once (serving.app)
        self.parent_tokens_per_s = parent_rate(runtime)  # read once: the runtime belongs to the worker thread
        self.created = created_at(family)  # read once: the folder may change (or go) while serving
        self.bound_port: Optional[int] = None  # the port uvicorn listens on, once it does
        self.exiting = threading.Event()  # set on SIGINT/SIGTERM: no restart after that
        self._lost = threading.Event()  # the parent is gone (first report handled)
        if runtime.pool.rpc:
            from specquant_cli.system import rpc

            rpc.on_lost(self.parent_lost)

    def parent_lost(self, line: str) -> bool:
        """system.rpc's handler for a worker lost mid-graph: this request and every later one get 503 while the
        workers are away; once they all answer again the server restarts itself on the same port (ggml-rpc
        cannot reconnect inside one process) and loads the parent anew."""
        if self._lost.is_set() or self.exiting.is_set():  # another thread failing too, or the server stopping
            return True  # (its worker connections shut on purpose): parked, quietly
        self._lost.set()
        stderr_line(f"error: {line}; answering 503 until the workers answer again, then restarting")
        self.worker.lose_engine(ApiError(503, f"{line}; the server restarts by itself once the worker is back",
                                         type="server_error", code="rpc_worker_lost"))
        threading.Thread(target=self._restart_when_back, name="specquant-recover", daemon=True).start()
        return True

    def _restart_when_back(self) -> None:
        from specquant_cli.system import rpc

        while not self.exiting.wait(RECOVER_POLL_S):
            rpc.release_sockets(self.runtime.pool.rpc)  # a surviving worker stays busy with our dead connection
            try:
                rpc.probe_all(self.runtime.pool.rpc)
            except SpecquantError:
                continue
            if self.bound_port is None or self.exiting.is_set():
                return
            stderr_line("specquant serve: the RPC workers answer again; restarting to load the parent")
            args = with_port(sys.argv[1:], self.bound_port)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # ggml's sockets are not close-on-exec
            os.execv(sys.executable, [sys.executable, "-m", "specquant_cli", *args])

    @property
    def kv(self) -> dict:
        """The KV cache of each model loaded now (a draft released after idling is gone, one loaded later is there):
        positions for every sequence that runs, and sequences. Read from the pool's table as it stands (a copy)."""
        pool = self.runtime.pool
        return {role: {"positions": pool.kv_positions(role), "sequences": pool.parallel} for role in pool.contexts()}

    def prompt_cache_status(self) -> Optional[dict]:
        """The prompt cache's use and budget, and the prefixes taken from it and from other slots (None: no
        prefix sharing)."""
        return self.prefixes.status() if self.prefixes is not None else None

    def scope_of(self, tenant: str, salt: Optional[str]) -> str:
        """The scope of a request of `tenant` (an API key, "" on a server without one) sending `salt` (its
        cache_salt, or None): a name no one can derive from the other's, the same across restarts when the prompt
        cache has a folder."""
        data = tenant.encode() + b"\0" + (b"salt:" + salt.encode() if salt is not None else b"")
        return hmac.new(self._scope_key, b"scope\0" + data, hashlib.sha256).hexdigest()[:32]

    def slot_for(self, params: GenerationParams, free: list[int]) -> int:
        """Of the `free` slots (least recently used first), the one this request's prompt costs least. Where idle
        slots are parked (runtime.prefixes: what they give up goes to the prompt cache, and their cells would cost
        this request's calls), the longest prefix of the prompt its own cells hold (a conversation's last turn, an
        agent's last request: the same system prompt), then the least recently used. Else the fewest held tokens
        given up (a conversation's last turn, held whole in its slot, gives up none; an empty slot none; a slot of
        another scope gives up all it holds and shares nothing), then the longest prefix shared with the prompt, then
        the least recently used; a prefix another slot of the scope holds is copied from there (runtime.prefixes),
        so a shared system prompt need not pick the slot."""
        if self.prefixes is None or len(free) == 1:
            return free[0]
        try:
            prompt = self.prompt_tokens(params)
        except SpecquantError:
            return free[0]  # the slot's own run refuses the prompt, with its reason
        from specquant_cli.backend.llama import common_prefix
        from specquant_cli.runtime.prefixes import MIN_REUSE

        views = self.prefixes.views

        parks = self.prefixes.parks

        def cost(i: int) -> tuple[int, int, int]:
            held = views[i].tokens
            shared = common_prefix(held, prompt) if self.prefixes.scope(i) == params.scope else 0
            if parks:  # a few tokens of a chat template in common are no prefix worth a slot
                return -(shared if shared >= MIN_REUSE else 0), len(held) - shared, free.index(i)
            return len(held) - shared, -shared, free.index(i)

        return min(free, key=cost)

    def parkable(self, chosen: int, free: list[int]) -> list[int]:
        """The idle (`free`) slots to park before slot `chosen` runs a request: those holding cells, where idle slots
        are parked at all (runtime.prefixes.PrefixSharing.parks)."""
        if self.prefixes is None or not self.prefixes.parks:
            return []
        return [i for i in free if i != chosen and self.prefixes.holds(i)]

    def park(self, slots: list[int]) -> None:
        """Each idle slot of `slots` keeps its state in the prompt cache and is emptied (its drafts' sequences too),
        so that the running requests' calls attend over no cells of theirs."""
        for i in slots:
            self.prefixes.park(i)
            self.sessions[i].runtime.pool.reset_caches()

    def prompt_tokens(self, params: GenerationParams) -> list[int]:
        model = self.runtime.tokenizer()
        if params.messages is not None:
            return model.chat_prompt(params.messages, params.tools)
        return model.tokenize(params.prompt, add_bos=model.add_bos())

    def answer_room(self, params: GenerationParams) -> int:
        """The tokens the answer may take: the request's max_tokens, refused (naming the field and the numbers) when it
        does not fit beside the prompt; when unset, OpenAI's (and llama-server's) "as long as the context allows",
        bounded by the server's --max-tokens where one was given."""
        from specquant_cli.decoding.forms import FormError

        n_prompt, n_ctx = len(self.prompt_tokens(params)), self.runtime.pool.n_ctx
        if n_prompt >= n_ctx:
            raise FormError(f"the prompt is {n_prompt} tokens and the context holds {n_ctx} (--ctx), with room left "
                            "for no answer; shorten it", params.prompt_param)
        if params.max_tokens is None:
            return n_ctx - n_prompt if self.max_tokens is None else min(self.max_tokens, n_ctx - n_prompt)
        if n_prompt + params.max_tokens > n_ctx:
            raise FormError(f"{params.max_tokens_param} {params.max_tokens} does not fit beside the prompt: the prompt "
                            f"is {n_prompt} tokens and the context holds {n_ctx} (--ctx), so at most "
                            f"{n_ctx - n_prompt} tokens can be asked", params.max_tokens_param)
        return params.max_tokens

    @staticmethod
    def predicted(session, text: Optional[str]) -> list[int]:
        """A request's prediction (its text) as the token ids `session`'s engine drafts from, [] without one; a 400
        naming it when it is longer than the context (before any record, so a stream never begins)."""
        from specquant_cli.decoding.forms import FormError

        try:
            return session.prediction_tokens(text)
        except InputError as e:
            raise FormError(str(e), "prediction.content", code="context_length_exceeded") from None

    def policy_for(self, requested: Optional[str], param: str) -> str:
        if requested is None:
            return self.default_policy
        if requested not in self.policies:
            raise ApiError(400, f"unknown or unavailable policy {requested!r}; this server offers: "
                                f"{', '.join(self.policies)}", param=param, code="invalid_policy")
        return requested

    def model_card(self) -> dict:
        fam = self.family
        return {"id": fam.name, "object": "model", "created": self.created,
                "owned_by": "specquant",
                "specquant": {"roles": {r: fam.variant(r)["type"] for r in fam.roles()},
                              "loaded": self.runtime.pool.loaded(), "policies": self.policies,
                              "default_policy": self.default_policy, "provenance": fam.provenance,
                              "parent_tokens_per_s": self.parent_tokens_per_s}}

    def generate(self, params: GenerationParams, slot: int = 0):
        """On slot `slot`'s thread: route, plan and return (answer, records) for one request."""
        session = self.sessions[slot]
        if self.prefixes is not None and self.prefixes.enter(slot, params.scope):
            session.runtime.pool.reset_caches()  # the drafts' sequences too: nothing of another scope stays
        limit = self.answer_room(params)
        predicted = self.predicted(session, params.prediction)
        answer, records = session.ask_messages(params.messages or [], policy=params.policy,
                                               sampling=params.sampling, max_tokens=limit, stop=params.stop,
                                               raw_prompt=params.prompt, scope=params.scope, grammar=params.grammar,
                                               tools=params.tools, top_logprobs=params.top_logprobs,
                                               prediction=predicted)
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


def created_at(family) -> int:
    """When the family's manifest was written (its mtime), 0 when it cannot be read."""
    try:
        return int((family.root / MANIFEST).stat().st_mtime)
    except (OSError, OverflowError, ValueError):
        return 0


def parent_rate(runtime) -> Optional[float]:
    """The parent's calibrated decode speed on this machine (tokens/s: one 1-token call each), None when this
    machine has no valid calibration for the family (`specquant calibrate`; the auto policy measures it)."""
    cal = runtime.calibration(measure=False)
    step = cal.parent_call_s.get(1) if cal is not None else None
    rate = 1.0 / step if step else None
    return round(rate, 2) if rate is not None and math.isfinite(rate) else None


def stderr_line(line: str) -> None:
    """One line on stderr (a newline inside `line` becomes a space): the server's log and notices."""
    sys.stderr.write(" ".join(line.split("\n")) + "\n")
    sys.stderr.flush()
