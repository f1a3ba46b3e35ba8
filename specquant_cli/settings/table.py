"""The declaration table: every setting once (`settings_table`), with its option, `SPECQUANT_*` variable,
specquant.toml key, bounds, check and help."""

from __future__ import annotations

from pathlib import Path

from specquant_cli.settings.checks import (
    check_api_keys,
    check_host_names,
    check_log_path,
    check_origins,
    check_parent,
    check_path,
    check_positive_seconds,
    check_rpc,
    check_text,
    check_threads,
)
from specquant_cli.settings.limits import (
    CACHE_RAM_MAX_MIB,
    CACHE_RAM_MIN_MIB,
    CACHE_RAM_SHARE,
    DEFAULT_CTX,
    DEFAULT_DRAFT_MEMORY_MIB,
    DEFAULT_GAMMA,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_RPC_TIMEOUT_S,
    MAX_CTX,
    MAX_DRAFT_MEMORY_MIB,
    MAX_GAMMA_SETTING,
    MAX_KEY_FILE_BYTES,
    MAX_PARALLEL,
    MAX_RPC_TIMEOUT_S,
    THREADS_PER_CORE,
)
from specquant_cli.settings.policy_hook import PolicyTable, check_policies, check_policy, policy_table, use_policy_table
from specquant_cli.settings.setting import Setting


def register_policy_table(table: PolicyTable) -> None:
    """The policy table's names for the policy settings (routing.policies calls it once, when it loads)."""
    use_policy_table(table)
    _settings.clear()  # declared again with the table's default and help


def _declare() -> dict[str, Setting]:
    policies = policy_table()
    items = [
        # decoding: what an answer is made with
        Setting("decoding", "policy", str, policies.default, "Decoding policy (auto, parent, spec-q4, suffix, …)",
                "--policy", check=check_policy, usage=False, optional=policies.default is None, metavar="NAME",
                doc=f"One of: {policies.help()}."),
        Setting("decoding", "gamma", int, DEFAULT_GAMMA, "Draft length γ (where an adaptive one starts)",
                "--gamma", lo=1, hi=MAX_GAMMA_SETTING, doc=f"Tokens a drafter proposes per parent call, 1 to "
                f"{MAX_GAMMA_SETTING}: fixed, or where an adaptive length starts."),
        Setting("decoding", "temperature", float, 0.0, "Sampling temperature (0: greedy)", "--temperature", lo=0.0,
                metavar="T"),
        Setting("decoding", "top_p", float, 1.0, "Nucleus sampling mass", "--top-p", lo=0.0, hi=1.0, metavar="P"),
        Setting("decoding", "top_k", int, 0, "Sample from the K likeliest tokens (0: off)", "--top-k", lo=0,
                metavar="K"),
        Setting("decoding", "seed", int, None, "Seed of sampling: same seed, same answer", "--seed", lo=0,
                hi=2**64 - 1, optional=True, shown="none", doc="0 to 2^64-1. Unset: a fresh seed per answer."),
        Setting("decoding", "draft_memory", float, DEFAULT_DRAFT_MEMORY_MIB, "MiB of drafting memory per policy",
                "--draft-memory", lo=0.0, hi=MAX_DRAFT_MEMORY_MIB, metavar="MIB",
                doc="RAM of the drafting memory every request of a policy shares (suffix drafts over earlier "
                    "prompts and answers; least recently used out; 0: each answer drafts from itself alone). One "
                    "per policy that drafts from it: serve's memory check counts it once per such policy on offer."),
        # runtime: what the models run with
        Setting("runtime", "family", Path, None, "Family: a name (specquant list) or a folder", "--family",
                check=check_path, optional=True, shown="none", metavar="NAME|DIR",
                doc="A name is looked up in ./models, then the models folder (runtime.models) and its index of "
                    "families made elsewhere. Unset: the family pulled or quantized last (the test family "
                    "smollm2-135m only while it is the only one), named on stderr."),
        Setting("runtime", "models", Path, None, "Folder of the families found by name", "--models",
                check=check_path, optional=True, shown="user data folder", metavar="DIR",
                doc="Default: $XDG_DATA_HOME/specquant/models (~/.local/share/specquant/models when XDG_DATA_HOME "
                    "is unset). It holds the families made there and an index of those made elsewhere (a "
                    "checkout's ./models, a folder given to quantize), so --family NAME finds each from any folder; "
                    "without this setting, pull and quantize run in a checkout make families in its ./models."),
        Setting("runtime", "ctx", int, DEFAULT_CTX, "Context size of each sequence (tokens)", "--ctx", lo=256,
                hi=MAX_CTX),
        Setting("runtime", "threads", int, 0, "llama.cpp threads (0: every core)", "--threads", lo=0,
                check=check_threads, doc=f"At most {THREADS_PER_CORE} × the logical cores."),
        Setting("runtime", "parent", str, "fastest", "Parent's rendering: fastest, f16, bf16", "--parent",
                check=check_parent, metavar="R",
                doc="fastest: the one this machine's calibration measured faster where the family has both and "
                    "the CPU has BF16 dot products; else the one the family has, F16 where the CPU has none."),
        Setting("runtime", "mmap", bool, False, "Map model files instead of reading them in", "--mmap",
                doc="A faster start and shared pages; a file changed under a mapping can crash the process, and "
                    "mapped weights may be reclaimed under memory pressure."),
        Setting("runtime", "deterministic", bool, False, "Bit-identical answers in any batch",
                "--deterministic", panel="Options",
                doc="Every row llama.cpp computes goes through the same kernels whatever the call: a lone token is "
                    "decoded beside a companion in a scratch sequence and every call keeps two output rows or none, "
                    "and each of serve's slots has a cache of its own, so a greedy answer is the same bit for bit "
                    "under every policy, prompt cache state, prefill chunking and slot (`specquant bench logits` "
                    "shows it). Costs a second row on each one-token call, and serve's slots take turns instead of "
                    "sharing the parent's calls (--parallel is 1 unless given)."),
        Setting("runtime", "rpc", str, None, "Run the parent's layers on llama.cpp RPC workers", "--rpc",
                check=check_rpc, many=True, optional=True, shown="none", metavar="HOST:PORT,…",
                doc="HOST:PORT[,HOST:PORT…] of `specquant worker`s (a TOML array too); drafts stay here."),
        Setting("runtime", "rpc_timeout", float, DEFAULT_RPC_TIMEOUT_S, "Seconds one RPC reply may take",
                "--rpc-timeout", lo=0.0, hi=MAX_RPC_TIMEOUT_S, check=check_positive_seconds, metavar="S"),
        Setting("runtime", "parallel", int, None, "Sequences decoded together", "--parallel", lo=1,
                hi=MAX_PARALLEL, optional=True, shown="from the calibration",
                doc=f"Default: as many as this machine's stored calibration says pay, else the prior cost curve's "
                    f"pick; at most {MAX_PARALLEL}. Each holds --ctx positions of its own."),
        Setting("runtime", "llama_log", str, None, "A file for llama.cpp's own log", check=check_log_path,
                optional=True, doc="Never in a family folder or on a model file; a FIFO without a reader is "
                                   "refused; a write that fails stops the log with one warning."),
        # serving: the HTTP front end
        Setting("serving", "host", str, "127.0.0.1", "Address to bind (0.0.0.0: all)", "--host",
                check=check_text, metavar="ADDR"),
        Setting("serving", "port", int, 8080, "Port (0: any free port, printed at start)", "--port", lo=0,
                hi=65535, metavar="PORT"),
        Setting("serving", "api_key", str, None, "Require this bearer key on /v1 (repeat: tenants)", "--api-key",
                check=check_api_keys, optional=True, secret=True, shown="none", repeat=True, metavar="KEY",
                panel="Security",
                doc="Every /v1 request needs Authorization: Bearer KEY. Repeat it for several keys, each a tenant "
                    "(in specquant.toml an array; the variable holds one key, commas included: more keys belong in "
                    "--api-key-file, not in the environment). A key is printable ASCII with nothing around it; an "
                    "empty one is refused."),
        Setting("serving", "api_key_file", Path, None, "A file of API keys, one per line", "--api-key-file",
                check=check_path, optional=True, shown="none", metavar="FILE", panel="Security",
                doc="Each key a tenant (blank lines and lines starting with # skipped; a key given twice is "
                    "refused). It must be a regular file of yours, no symbolic link, mode 600 or stricter, at most "
                    f"{MAX_KEY_FILE_BYTES >> 10} KiB."),
        Setting("serving", "queue", int, 32, "Requests that may wait behind the running ones", "--queue", lo=0),
        Setting("serving", "max_body", int, 1 << 20, "Largest request body in bytes (413 above)", "--max-body",
                lo=1024, hi=1 << 30, metavar="BYTES"),
        Setting("serving", "max_tokens", int, None, "Cap for requests without max_tokens (none: to --ctx)",
                "--max-tokens", lo=1, optional=True, shown="none",
                doc="Default: none, as OpenAI and llama-server: such an answer may run to the end of the context "
                    "(--ctx). A request's own max_tokens is never capped by it."),
        Setting("serving", "strict_tools", bool, False, "Refuse built-in tools on /v1/responses",
                "--strict-tools",
                doc="Tools OpenAI runs on its side (web_search, file_search, code_interpreter, ...) are left out of "
                    "what the model sees by default, each said in the response's specquant.warnings and the log; "
                    "with this, a request naming one is refused (400)."),
        Setting("serving", "allow_host", str, None, "More names the Host header may carry", "--allow-host",
                check=check_host_names, optional=True, shown="none", many=True, metavar="NAMES", panel="Security",
                doc="Comma-separated. Always allowed: IP addresses, localhost, the bound address; *: any name, "
                    "which turns the DNS-rebinding check off."),
        Setting("serving", "cors_origin", str, None, "Origins whose web pages may call the API", "--cors-origin",
                check=check_origins, optional=True, shown="none", many=True, metavar="ORIGINS", panel="Security",
                doc="Comma-separated, e.g. http://localhost:3000; *: any. The server's own chat page needs none."),
        Setting("serving", "prompt_cache", bool, True, "Reuse computed prompt prefixes", "--prompt-cache",
                doc="A slot's own, another slot's (copied, no prefill) and the prompt cache's; off: every prompt "
                    "is prefilled whole."),
        Setting("serving", "cache_ram", float, None, "Prompt cache RAM (0: off)", "--cache-ram",
                lo=0.0, hi=1 << 24, optional=True, metavar="MIB",
                shown=f"{CACHE_RAM_SHARE:.0%} of free, ≤ {CACHE_RAM_MAX_MIB:.0f}",
                doc="The parent's state of a reused or idle (parked) slot, kept for a later prompt that starts the "
                    f"same way (least recently used out). At least {CACHE_RAM_MIN_MIB:g}, or what one cached prompt "
                    "of the model takes where that is more."),
        Setting("serving", "cache_dir", Path, None, "Also keep the prompt cache in this folder", "--cache-dir",
                check=check_path, optional=True, shown="none", metavar="DIR",
                doc="Written to, and read back from at start (entries of another model, build or context size are "
                    "refused); made private (700, files 600)."),
        Setting("serving", "cache_disk", float, None, "MiB --cache-dir holds in all", "--cache-disk",
                lo=1.0, hi=1 << 24, optional=True, shown="--cache-ram's", metavar="MIB",
                doc="After every write its oldest files go first, whichever server sharing it wrote them."),
        Setting("serving", "prefill_chunk", int, DEFAULT_PREFILL_CHUNK, "Prompt tokens per batch round",
                "--prefill-chunk", lo=8, hi=512,
                doc="Other requests' inter-token latency stays bounded while a long prompt is prefilled."),
        Setting("serving", "policies", str, None, "Policies a request may choose", "--policies",
                check=check_policies, optional=True, shown="all", usage=False, many=True, metavar="NAMES",
                doc="Default: all the family can run. Every model they can use is loaded at start-up."),
        # general: every command
        Setting("general", "debug", bool, False, "Re-raise errors with their traceback"),
    ]
    return {s.key: s for s in items}


_settings: dict[str, Setting] = {}


def settings_table() -> dict[str, Setting]:
    """The declarations, by key (built on first use: the policy setting reads the policy table)."""
    if not _settings:
        _settings.update(_declare())
    return _settings


GLOBAL_KEYS = ("general.debug", "runtime.llama_log", "runtime.models", "runtime.deterministic")  # every command's
