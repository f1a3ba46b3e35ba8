"""Every setting, declared once: its branch, type, bounds, default and help (`SETTINGS`). From each declaration
come the command-line option (commands.options.with_settings), the `SPECQUANT_<NAME>` environment variable and
the `[branch] name` key of `specquant.toml`. A command resolves the settings it takes once, at the edge and
before any model loads (`resolve`: default < specquant.toml < environment < flag), what the machine decides
included (threads from its cores; serve's parallel sequences from its calibration), and passes the resolved
`Settings` down; below the edge nothing reads the environment or changes a setting in place.

This module is also the only reader of the environment: the settings' variables, `XDG_CACHE_HOME`
(`cache_home`), `XDG_DATA_HOME` (`data_home`), `COLUMNS` (`columns`) and the self-test's internal variables
(`INTERNAL_ENV`, through `env`), and the variables of the model stores a reference reaches (`model_stores`:
HF_HUB_CACHE, HF_HOME, HF_HUB_OFFLINE, OLLAMA_MODELS, LMSTUDIO_MODELS). It imports nothing of the package at load.

Why one file of ~800 lines: the table of every setting is the point of it — one place that says what can be set,
how, and what each value is checked against — and the readers of specquant.toml, the environment and the flags
must stay beside the declarations they read (three modules would be three places to forget a setting)."""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

CONFIG_NAME = "specquant.toml"
DEFAULT_CTX = 4096
MAX_CTX = 1 << 20
DEFAULT_GAMMA = 4  # the draft length γ when nothing sets one
MAX_GAMMA_SETTING = 16  # the largest --gamma accepted
MAX_PARALLEL = 8  # the most sequences serve decodes together
DEFAULT_DRAFT_MEMORY_MIB = 64.0  # RAM of each policy's drafting memory (decoding.memory)
MAX_DRAFT_MEMORY_MIB = 4096.0  # the largest --draft-memory (per policy; serve's memory check counts them all)
CACHE_RAM_SHARE = 0.25  # of free memory: the prompt cache's default budget
CACHE_RAM_MAX_MIB = 8192.0  # ... at most this (llama-server's default --cache-ram)
CACHE_RAM_MIN_MIB = 1.0  # the smallest prompt cache serve takes (0 is off): below it no entry fits
DEFAULT_PREFILL_CHUNK = 128  # tokens a prompt adds per batch round while other requests decode
DEFAULT_RPC_TIMEOUT_S = 300.0  # longest wait for one RPC reply (a long prefill on a slow worker stays under it)
MAX_RPC_TIMEOUT_S = 86400.0
SOURCES = ("default", "toml", "env", "flag", "machine")
MAX_CONFIG_BYTES = 1 << 20  # the largest specquant.toml read (a config is a few settings)
MAX_CONFIG_DEPTH = 32  # the deepest nesting of tables and arrays in it (the document is level 1)
MAX_KEY_FILE_BYTES = 64 << 10  # the largest --api-key-file read (serving.keys)
COMPANIONS = {"serving.api_key": ("serving.api_key_file",)}  # a command taking the key takes these too
PANELS = {"decoding": "Decoding", "runtime": "Model", "serving": "Server", "general": "Options"}  # --help panels

SELFTEST_CHILD_ENV = "SPECQUANT_SELFTEST_CHILD"  # set in the self-test's child: it never starts a self-test itself
SELFTEST_FAULT_ENV = "SPECQUANT_SELFTEST_FAULT"  # fault injection for tests: TYPE:SIGNAME kills the child at TYPE
INTERNAL_ENV = {  # variables the package sets for its own child processes; no user setting
    SELFTEST_CHILD_ENV: "set in the build self-test's child processes",
    SELFTEST_FAULT_ENV: "a fault the self-test's tests inject",
}


class SettingError(ValueError):
    """A value that is no value of its setting; the message says why, without naming where it came from."""


def cores() -> int:
    """The logical cores this process may run on: its CPU affinity where the system keeps one (a container's or
    taskset's share of the machine, as Python 3.13's os.process_cpu_count), else every core; at least 1. What "every
    core" means for a thread count: llama.cpp's threads beyond the cores a process may use only spin on each other."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# -- checks: a converted value in, the value to use out (or SettingError) -------------------------------------------
def check_threads(n: int) -> int:
    """0 (every core: `cores()`) or 1 .. 4 x those cores: more threads only wait on each other (100000 crashes
    llama.cpp)."""
    cores_here = cores()
    if n < 0:
        raise SettingError("expected 0 (every core) or a positive integer")
    if n > THREADS_PER_CORE * cores_here:
        raise SettingError(f"at most {THREADS_PER_CORE * cores_here} threads on this machine "
                           f"({THREADS_PER_CORE} × {cores_here} logical cores)")
    return n


THREADS_PER_CORE = 4


def check_rpc(value: Any) -> list[str]:
    """'HOST:PORT[,HOST:PORT…]' (or a TOML list) -> distinct endpoints; '' (given but empty) is refused: it would
    run the parent here without a word."""
    items = value if isinstance(value, list) else str(value).split(",")
    if not any(str(x).strip() for x in items):
        raise SettingError("no worker given (expected HOST:PORT[,HOST:PORT…]; leave it unset to run the parent here)")
    out = []
    for item in (str(x).strip() for x in items):
        host, sep, port = item.rpartition(":")
        if not item or not sep or not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
            raise SettingError(f"{item!r}: expected HOST:PORT[,HOST:PORT…] (e.g. 127.0.0.1:50052)")
        if item not in out:
            out.append(item)
    seen: dict[tuple[str, int], str] = {}
    for item in out:  # one worker under two names would be two connections to a server that takes one: a hang
        host, _, port = item.rpartition(":")
        addr = (_resolve(host.strip("[]")), int(port))
        if addr in seen:
            raise SettingError(f"{seen[addr]} and {item} name one worker ({addr[0]}:{addr[1]}); give each once")
        seen[addr] = item
    return out


def _resolve(host: str) -> str:
    """The IPv4 address `host` names (ggml's RPC client resolves the same way), or `host` when it resolves to none."""
    import socket

    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError, IndexError):
        return host


@dataclass(frozen=True)
class PolicyTable:
    """What the policy settings are declared and checked with: the default policy, the `--policy` help and the
    check of a name (an InputError for an unknown one). The policy table (routing.policies) registers it when it
    loads (`register_policy_table`); settings sit below it and import nothing of it. Until then a policy name is
    checked for its form only (every command edge imports the table first: commands.options)."""

    default: Optional[str]
    help: Callable[[], str]
    check: Callable[[str], str]


def _form_only(name: str) -> str:
    if not name or not name.isascii() or not all(c.isalnum() or c in "+-_" for c in name):
        raise ValueError(f"unknown policy {name!r}")
    return name


_policy_table = PolicyTable(None, lambda: "Decoding policy", _form_only)


def register_policy_table(table: PolicyTable) -> None:
    """The policy table's names for the policy settings (routing.policies calls it once, when it loads)."""
    global _policy_table
    _policy_table = table
    _settings.clear()  # declared again with the table's default and help


def check_policy(name: str) -> str:
    from specquant_cli.errors import InputError

    try:
        return _policy_table.check(name)
    except (InputError, ValueError) as e:
        raise SettingError(str(e)) from None


PARENT_CHOICES = ("fastest", "f16", "bf16")


def check_parent(value: Any) -> str:
    """The parent's rendering as asked: fastest, f16 or bf16."""
    v = str(value).strip().lower()
    if v not in PARENT_CHOICES:
        raise SettingError(f"{value!r}: one of {', '.join(PARENT_CHOICES)}")
    return v


def check_path(value: Any) -> Optional[Path]:
    text = str(value)
    if not text or "\0" in text:
        raise SettingError("expected a path")
    return Path(text)


def check_text(value: Any) -> str:
    text = str(value)
    if "\0" in text:
        raise SettingError("a NUL character is no text")
    return text


def check_key(key: Any) -> str:
    """One API key: printable ASCII, nothing around it. An empty key, one with a space or newline at an end (a
    copy-paste slip that no client sends back) or with a control or non-ASCII character is refused, never
    trimmed: the key a client sends must be the key as written. The message never shows the key."""
    if not isinstance(key, str):
        raise SettingError(f"expected a string key, not {type(key).__name__}")
    if not key:
        raise SettingError("an empty key is no key (leave the setting unset for none)")
    if key.strip() != key:
        raise SettingError("the key has leading or trailing whitespace; remove it")
    if not key.isascii():
        raise SettingError("the key has a non-ASCII character (a key is printable ASCII)")
    if not key.isprintable():
        raise SettingError("the key has a control character (a key is printable ASCII)")
    return key


def check_api_keys(value: Any) -> Any:
    """serving.api_key: one key (a string: the key) or several (a repeated --api-key, a TOML array: their list,
    in order), each checked (check_key); a key given twice is refused."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise SettingError("no key given (an empty list; leave the setting unset for none)")
    keys: list[str] = []
    for i, item in enumerate(items, 1):
        try:
            key = check_key(item)
        except SettingError as e:
            raise SettingError(f"key {i} of {len(items)}: {e}" if len(items) > 1 else str(e)) from None
        if key in keys:
            raise SettingError(f"key {i} repeats key {keys.index(key) + 1}; give each key once")
        keys.append(key)
    return keys if isinstance(value, list) else keys[0]  # a list stays one (a repeated flag of one use too)


def key_list(value: Any) -> tuple[str, ...]:
    """serving.api_key's resolved value as a tuple of keys (() when unset)."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


@dataclass(frozen=True)
class Setting:
    """One setting. `flag`: its command-line option (None: environment and specquant.toml only); `lo`/`hi`:
    inclusive bounds; `check`: turns a converted value into the one used (or raises SettingError); `shown`: the
    help's default when `default` is decided later (None here); `secret`: masked wherever it is shown."""

    branch: str
    name: str
    kind: type
    default: Any
    help: str
    flag: Optional[str] = None
    lo: Optional[float] = None
    hi: Optional[float] = None
    check: Optional[Callable[[Any], Any]] = None
    shown: Optional[str] = None
    secret: bool = False
    optional: bool = False  # None is a value of it (not given: decided later, or absent)
    usage: bool = True  # a flag value its check refuses is a usage error (exit 2); False: an error (exit 1)
    many: bool = False  # a list: comma-separated text, or a TOML array
    repeat: bool = False  # several values: the flag repeated, or a TOML array; the environment holds one
    doc: str = ""  # the longer text of docs/configuration.md (`help` is the option's one line)
    metavar: Optional[str] = None  # the value's name in --help (default: by kind, see `shown_metavar`)
    panel: Optional[str] = None  # the --help panel its option sits in (default: by branch, PANELS)

    @property
    def key(self) -> str:
        return f"{self.branch}.{self.name}"

    @property
    def env(self) -> str:
        return "SPECQUANT_" + self.name.upper()

    def where(self) -> str:
        """Where else it can be set: its variable and its specquant.toml key."""
        return f"env {self.env}; {CONFIG_NAME}: {self.key}"

    @property
    def description(self) -> str:
        """The whole text: the option's line, then the longer one of the docs."""
        return f"{self.help}. {self.doc}" if self.doc else self.help

    def shown_metavar(self) -> Optional[str]:
        """The value's name in --help: the declared one, else by kind (none for an on/off flag)."""
        if self.metavar is not None or self.kind is bool:
            return self.metavar
        return {int: "N", float: "NUM", Path: "PATH"}.get(self.kind, "TEXT")

    @property
    def help_panel(self) -> str:
        return self.panel or PANELS[self.branch]

    def convert(self, raw: Any, text: bool = True) -> Any:
        """A value from the environment (`text`) or specquant.toml (TOML's own types: a string is no number
        there) as this setting's type, bounded and checked; SettingError says why not."""
        if isinstance(raw, list) and not (self.many or self.repeat):
            raise SettingError("expected one value, not a list")
        if not text and isinstance(raw, str) and self.kind not in (str, Path):
            raise SettingError(f"expected {self.kind.__name__}, not str")
        value = _convert(self.kind, raw)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.lo is not None and value < self.lo:
                raise SettingError(_below(self.kind, self.lo))
            if self.hi is not None and value > self.hi:
                raise SettingError(f"at most {_num(self.hi)}")
        return self.check(value) if self.check is not None else value


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _below(kind: type, lo: float) -> str:
    if kind is int and lo == 1:
        return "expected a positive integer"
    if kind is int and lo == 0:
        return "expected 0 or a positive integer"
    return f"expected at least {_num(lo)}"


TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# A number as text: ASCII decimal digits only (float() also takes `1_000`, fullwidth and Arabic-Indic digits and
# Unicode spaces around them; none of them is what a setting means), inf and nan to be refused as not finite.
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_NOT_FINITE = re.compile(r"[+-]?(?:inf|infinity|nan)", re.IGNORECASE)


def _convert(kind: type, raw: Any) -> Any:
    if isinstance(raw, str):
        text = raw.strip()
        if kind is bool:
            if text.lower() in TRUE:
                return True
            if text.lower() in FALSE:
                return False
            raise SettingError("expected 1/0, true/false, yes/no or on/off")
        if kind is int:
            digits = text[1:] if text[:1] in "+-" else text
            if text != raw or not digits or not (digits.isascii() and digits.isdigit()):
                raise SettingError("expected an integer")
            return int(text) if len(digits) <= 40 else (1 if text[0] != "-" else -1) * 10**40  # no 4300-digit parse
        if kind is float:
            if not (_DECIMAL.fullmatch(raw) or _NOT_FINITE.fullmatch(raw)):
                raise SettingError("expected a number (ASCII digits, no spaces: e.g. 2, 1.5, .5, 1e3)")
            value = float(raw)
            if not math.isfinite(value):
                raise SettingError("expected a finite number")
            return value
        return raw
    if kind is bool and isinstance(raw, bool):
        return raw
    if kind is int and isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if kind is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
        if not math.isfinite(raw):
            raise SettingError("expected a finite number")
        return float(raw)
    if kind in (str, Path) and isinstance(raw, list):
        return raw  # a list setting (rpc, policies) written as a TOML array; its check reads it
    raise SettingError(f"expected {kind.__name__}, not {type(raw).__name__}")


def _positive_seconds(value: float) -> float:
    if value <= 0:
        raise SettingError("expected seconds above 0")
    return value


def _log_path(value: Any) -> Optional[Path]:
    return check_path(value) if str(value) else None


def _policies(value: Any) -> list[str]:
    items = value if isinstance(value, list) else str(value).split(",")
    names = list(dict.fromkeys(str(x).strip() for x in items if str(x).strip()))
    if not names:
        raise SettingError("no policy given")
    return [check_policy(n) for n in names]


def _names(value: Any) -> list[str]:
    items = value if isinstance(value, list) else str(value).split(",")
    names = list(dict.fromkeys(str(x).strip().lower() for x in items if str(x).strip()))
    if not names:
        raise SettingError("no name given")
    for n in names:
        if n != "*" and (not n.isascii() or any(c in n for c in "/:@ \t[]") or n.startswith(".")):
            raise SettingError(f"{n!r} is not a host name")
    return names


def _origins(value: Any) -> list[str]:
    from specquant_cli.inputs import normal_origin

    items = value if isinstance(value, list) else str(value).split(",")
    origins = list(dict.fromkeys(str(x).strip() for x in items if str(x).strip()))
    if not origins:
        raise SettingError("no origin given")
    for o in origins:
        if o != "*" and normal_origin(o) is None:
            raise SettingError(f"{o!r} is not an origin (scheme://host[:port], e.g. http://localhost:3000)")
    return [o if o == "*" else normal_origin(o) for o in origins]


def _declare() -> dict[str, Setting]:
    policies = _policy_table
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
        Setting("runtime", "rpc", str, None, "Run the parent's layers on llama.cpp RPC workers", "--rpc",
                check=check_rpc, many=True, optional=True, shown="none", metavar="HOST:PORT,…",
                doc="HOST:PORT[,HOST:PORT…] of `specquant worker`s (a TOML array too); drafts stay here."),
        Setting("runtime", "rpc_timeout", float, DEFAULT_RPC_TIMEOUT_S, "Seconds one RPC reply may take",
                "--rpc-timeout", lo=0.0, hi=MAX_RPC_TIMEOUT_S, check=_positive_seconds, metavar="S"),
        Setting("runtime", "parallel", int, None, "Sequences decoded together", "--parallel", lo=1,
                hi=MAX_PARALLEL, optional=True, shown="from the calibration",
                doc=f"Default: as many as this machine's stored calibration says pay, else the prior cost curve's "
                    f"pick; at most {MAX_PARALLEL}. Each holds --ctx positions of its own."),
        Setting("runtime", "llama_log", str, None, "A file for llama.cpp's own log", check=_log_path,
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
                check=_names, optional=True, shown="none", many=True, metavar="NAMES", panel="Security",
                doc="Comma-separated. Always allowed: IP addresses, localhost, the bound address; *: any name, "
                    "which turns the DNS-rebinding check off."),
        Setting("serving", "cors_origin", str, None, "Origins whose web pages may call the API", "--cors-origin",
                check=_origins, optional=True, shown="none", many=True, metavar="ORIGINS", panel="Security",
                doc="Comma-separated, e.g. http://localhost:3000; *: any. The server's own chat page needs none."),
        Setting("serving", "prompt_cache", bool, True, "Reuse computed prompt prefixes", "--prompt-cache",
                doc="A slot's own, another slot's (copied, no prefill) and the prompt cache's; off: every prompt "
                    "is prefilled whole."),
        Setting("serving", "cache_ram", float, None, "Prompt cache RAM (0: off)", "--cache-ram",
                lo=0.0, hi=1 << 24, optional=True, metavar="MIB",
                shown=f"{CACHE_RAM_SHARE:.0%} of free, ≤ {CACHE_RAM_MAX_MIB:.0f}",
                doc="The parent's state of a reused slot, kept for a later prompt that starts the same way (least "
                    f"recently used out). At least {CACHE_RAM_MIN_MIB:g}, or what one cached prompt of the model "
                    "takes where that is more."),
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
                check=_policies, optional=True, shown="all", usage=False, many=True, metavar="NAMES",
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


GLOBAL_KEYS = ("general.debug", "runtime.llama_log", "runtime.models")  # resolved by every command


# -- resolution --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Value:
    value: Any
    source: str  # one of SOURCES
    origin: str = ""  # the variable, file or flag it came from ("" for a default)


@dataclass(frozen=True)
class Settings:
    """Resolved settings: `cfg.runtime.threads`, `cfg.get("runtime.threads")`, `cfg.source(...)`. Immutable: a
    value the machine decides is set by `decided`, which returns a new object."""

    values: Mapping[str, Value]
    config: Optional[Path] = None  # the specquant.toml read (None: none)

    def get(self, key: str) -> Any:
        return self.values[key].value

    def source(self, key: str) -> str:
        return self.values[key].source

    def __getattr__(self, branch: str) -> Branch:
        if branch.startswith("_") or branch in ("values", "config"):
            raise AttributeError(branch)
        return Branch(self, branch)

    def decided(self, key: str, value: Any, origin: str = "") -> Settings:
        """These settings with `key` decided by the machine (a value given by the user stays theirs)."""
        current = self.values[key]
        if current.source != "default":
            return self
        return Settings({**self.values, key: Value(value, "machine", origin)}, self.config)

    def given_by(self, key: str) -> str:
        """Where `key`'s value came from, as a user would find it: its flag, its variable, `serving.host in
        PATH` (the specquant.toml read), what the machine decided it from, or "the default"."""
        s, v = settings_table()[key], self.values[key]
        if v.source == "flag":
            return s.flag or key
        if v.source == "env":
            return s.env
        if v.source == "toml":
            return f"{s.key} in {v.origin}"
        return v.origin or ("the default" if v.source == "default" else "this machine")

    def stated(self, key: str) -> str:
        """`key` as it was given: `--host 0.0.0.0`, `SPECQUANT_HOST=0.0.0.0`, `host = "0.0.0.0" from PATH` (a list
        as one value); a secret by where it came from alone (given_by), never its value."""
        s, v = settings_table()[key], self.values[key]
        if s.secret:
            return self.given_by(key)
        items = list(v.value) if isinstance(v.value, (list, tuple)) else [v.value]
        if v.source == "toml":
            shown = _toml_text(items[0]) if len(items) == 1 else f"[{', '.join(map(_toml_text, items))}]"
            return f"{s.name} = {shown} from {v.origin}"
        shown = ",".join(map(_plain_text, items))
        if v.source == "flag":
            return f"{s.flag or key} {shown}"
        if v.source == "env":
            return f"{s.env}={shown}"
        return f"{s.key} {shown} ({self.given_by(key)})"

    def to_dict(self) -> dict:
        table = settings_table()
        out: dict = {}
        for key, v in sorted(self.values.items()):
            shown = v.value
            if table[key].secret and shown is not None:
                shown = "***"
            elif isinstance(shown, Path):
                shown = str(shown)
            out[key] = {"value": shown, "source": v.source, **({"from": v.origin} if v.origin else {})}
        return out


def _plain_text(x: Any) -> str:
    return _num(x) if isinstance(x, float) else str(x)


def _toml_text(x: Any) -> str:
    """A value as specquant.toml writes it (a string quoted)."""
    if isinstance(x, bool):
        return "true" if x else "false"
    return _plain_text(x) if isinstance(x, (int, float)) else json.dumps(str(x))


@dataclass(frozen=True)
class Branch:
    settings: Settings
    name: str

    def __getattr__(self, name: str) -> Any:
        try:
            return self.settings.values[f"{self.name}.{name}"].value
        except KeyError:
            raise AttributeError(f"{self.name}.{name} was not resolved for this command") from None


def read_config(path: Optional[Path], cwd: Optional[Path] = None) -> tuple[dict, Optional[Path]]:
    """The parsed TOML of `path` (--config), else of ./specquant.toml when present: (tables, file); ({}, None)
    when there is none. The one reader of the file: the settings' tables and the router's come from it. Bounded:
    at most MAX_CONFIG_BYTES are read (a device such as /dev/zero is refused, a pipe read that far), a UTF-8
    byte-order mark is named, and nesting deeper than MAX_CONFIG_DEPTH is one line, not a RecursionError."""
    import tomllib

    from specquant_cli.errors import InputError
    from specquant_cli.inputs import decode_file

    if path is None:
        candidate = (cwd or Path.cwd()) / CONFIG_NAME
        if not candidate.is_file():
            return {}, None
        path = candidate
    raw = _read_config_bytes(Path(path))
    text = decode_file(raw, f"config {path}")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{path}: not valid TOML ({e})") from None
    except RecursionError:
        data = None
    if data is None or _depth(data) > MAX_CONFIG_DEPTH:
        raise InputError(f"{path}: tables and arrays nest deeper than {MAX_CONFIG_DEPTH} levels; a config is a "
                         "few flat tables")
    return data, Path(path)


def _read_config_bytes(path: Path) -> bytes:
    """The config file's bytes, at most MAX_CONFIG_BYTES: a regular file or a pipe (`--config <(...)`); a
    device or socket is no config."""
    from specquant_cli.errors import InputError

    try:
        st = os.stat(path)
        mode = st.st_mode
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
            kind = "character device" if stat.S_ISCHR(mode) else "block device" if stat.S_ISBLK(mode) else "socket"
            raise InputError(f"{path}: is a {kind}, not a config file; name a TOML file")
        if stat.S_ISREG(mode) and st.st_size > MAX_CONFIG_BYTES:
            raise InputError(_too_big(path))
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise InputError(f"{path}: no such config file") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read config ({e.strerror})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise InputError(_too_big(path))
    return raw


def _too_big(path: Path) -> str:
    return f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB; a config file is a few settings"


def _depth(data: Any) -> int:
    """How deep tables and arrays nest in `data` (the document is level 1), counted without recursion; stops
    counting past MAX_CONFIG_DEPTH."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, level = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_CONFIG_DEPTH:
            break
        stack.extend((c, level + 1) for c in children)
    return deepest


def read_toml(path: Optional[Path], cwd: Optional[Path] = None) -> tuple[dict, Optional[Path]]:
    """The setting tables of the config file (read_config): ({branch: {name: value}}, file). Tables that are no
    settings branch (the router's) are left to their readers."""
    from specquant_cli.errors import InputError

    data, path = read_config(path, cwd)
    branches = {s.branch for s in settings_table().values()}
    out = {}
    for branch in branches & set(data):
        table = data[branch]
        if not isinstance(table, dict):
            raise InputError(f"{path}: {branch} must be a table ([{branch}]), not {type(table).__name__}")
        known = {s.name for s in settings_table().values() if s.branch == branch}
        for name in table:
            if name not in known:
                raise InputError(f"{path}: unknown setting {branch}.{name} (known: {', '.join(sorted(known))})")
        out[branch] = table
    return out, path


def _shown(raw: str) -> str:
    text = raw if len(raw) <= 24 else raw[:24] + "…"
    return text if text.isprintable() and text.strip() == text and text else repr(text)


def with_companions(keys: Iterable[str]) -> list[str]:
    """`keys` with each one's COMPANIONS after it (a command taking serving.api_key takes serving.api_key_file:
    the keys are one thing, given two ways), each once."""
    return list(dict.fromkeys(k for key in keys for k in (key, *COMPANIONS.get(key, ()))))


def resolve(keys: Iterable[str], flags: Optional[Mapping[str, Any]] = None, config: Optional[Path] = None,
            environ: Optional[Mapping[str, str]] = None, cwd: Optional[Path] = None) -> Settings:
    """The settings `keys` (their COMPANIONS and GLOBAL_KEYS too), each from the last of: its default,
    specquant.toml (`config`, else ./specquant.toml), its environment variable (an empty one is unset), `flags`
    (values given on the command line, already checked by their options). Raises errors.InputError naming the
    variable or file of a bad value (never a secret's value). Threads 0 is decided here: every core."""
    from specquant_cli.errors import InputError

    table = settings_table()
    flags = flags or {}
    environ = os.environ if environ is None else environ
    toml, toml_path = read_toml(config, cwd)
    values: dict[str, Value] = {}
    for key in with_companions([*keys, *GLOBAL_KEYS]):
        s = table[key]
        v = Value(s.default, "default")
        if s.name in toml.get(s.branch, {}):
            try:
                v = Value(s.convert(toml[s.branch][s.name], text=False), "toml", str(toml_path))
            except SettingError as e:
                shown = "***" if s.secret else repr(toml[s.branch][s.name])
                raise InputError(f"{toml_path}: {s.key} = {shown}: {e}") from None
        raw = environ.get(s.env, "")
        if raw != "":
            try:
                v = Value(s.convert(raw), "env", s.env)
            except SettingError as e:
                raise InputError(f"{s.env}={'***' if s.secret else _shown(raw)}: {e}") from None
        if key in flags:
            v = Value(flags[key], "flag", s.flag or "")
        values[key] = v
    cfg = Settings(values, toml_path)
    if "runtime.threads" in values and not cfg.get("runtime.threads"):
        cfg = Settings({**values, "runtime.threads": Value(cores(), "machine", "every core")}, toml_path)
    return cfg


def resolve_all(given: Settings) -> Settings:
    """Every declared setting, resolved as for a command whose command line gave what `given` took from flags, with
    `given`'s specquant.toml (doctor's view of the whole tree)."""
    flags = {k: v.value for k, v in given.values.items() if v.source == "flag"}
    return resolve(settings_table(), flags, given.config)


# -- the rest of the environment ----------------------------------------------------------------------------------
def env(name: str) -> str:
    """An internal `SPECQUANT_*` variable (INTERNAL_ENV), read now ("" when unset); settings are resolved instead."""
    if name not in INTERNAL_ENV:
        raise KeyError(f"{name} is not an internal variable (settings.INTERNAL_ENV); settings are resolved")
    return os.environ.get(name, "")


def child_env(**internal: str) -> dict[str, str]:
    """The environment for a child process of ours: this one's, with the given internal variables set."""
    unknown = [k for k in internal if k not in INTERNAL_ENV]
    if unknown:
        raise KeyError(f"{', '.join(unknown)}: not internal variables (settings.INTERNAL_ENV)")
    return {**os.environ, **internal}


_resolved_debug: list[bool] = []  # general.debug as the running command resolved it (specquant.toml included)


def set_debug(on: bool) -> None:
    """The command edge records the resolved general.debug here (commands.options.with_settings)."""
    _resolved_debug[:] = [on]


def debug() -> bool:
    """Whether errors are re-raised with their traceback: general.debug as the command resolved it, else (an error
    before any command resolved its settings) SPECQUANT_DEBUG read now — a value that is no boolean is false
    here, and refused by resolve."""
    if _resolved_debug:
        return _resolved_debug[0]
    raw = os.environ.get(settings_table()["general.debug"].env, "")
    return raw.strip().lower() in TRUE


def default_cache_ram(available_bytes: int) -> float:
    """The prompt cache's budget (MiB) when nothing sets one: CACHE_RAM_SHARE of free memory, at most
    CACHE_RAM_MAX_MIB."""
    return float(min(CACHE_RAM_MAX_MIB, int(max(0, available_bytes) * CACHE_RAM_SHARE) >> 20))


def decide_cache_ram(cfg: Settings, available_bytes: int) -> Settings:
    """`cfg` with serving.cache_ram decided from this machine's free memory, unless given."""
    mib = default_cache_ram(available_bytes)
    return cfg.decided("serving.cache_ram", mib, f"{CACHE_RAM_SHARE:.0%} of {available_bytes / 2**30:.1f} GiB free, "
                       f"at most {CACHE_RAM_MAX_MIB:.0f} MiB")


def cache_home() -> Optional[Path]:
    """specquant's user cache folder: $XDG_CACHE_HOME/specquant, or ~/.cache/specquant when it is unset or relative
    (the XDG spec says a relative path is invalid and ignored); None when there is no home either."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        try:
            base = str(Path.home() / ".cache")
        except (RuntimeError, KeyError):
            return None
    return Path(base) / "specquant"


def data_home() -> Optional[Path]:
    """specquant's user data folder: $XDG_DATA_HOME/specquant, or ~/.local/share/specquant when it is unset or
    relative (as cache_home); None when there is no home either."""
    base = os.environ.get("XDG_DATA_HOME", "")
    if not os.path.isabs(base):
        try:
            base = str(Path.home() / ".local" / "share")
        except (RuntimeError, KeyError):
            return None
    return Path(base) / "specquant"


@dataclass(frozen=True)
class ModelStores:
    """Where other tools keep the models a reference reaches (family.refs), as their own variables say: the Hugging
    Face cache (HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub) and whether it is offline
    (HF_HUB_OFFLINE); ollama's store (OLLAMA_MODELS, else ~/.ollama/models); LM Studio's models folders
    (LMSTUDIO_MODELS, else ~/.lmstudio/models and the older ~/.cache/lm-studio/models). None: no home to find it
    in."""

    hf_cache: Optional[Path]
    hf_offline: bool
    ollama: Optional[Path]
    lmstudio: tuple[Path, ...]


def model_stores() -> ModelStores:
    """The stores as the environment names them now (read at the command edge and handed down)."""
    def given(name: str) -> Optional[Path]:
        raw = os.environ.get(name, "")
        return Path(raw).expanduser() if raw and "\0" not in raw else None

    try:
        home: Optional[Path] = Path.home()
    except (RuntimeError, KeyError):
        home = None
    hf_home = given("HF_HOME") or (Path(os.environ["XDG_CACHE_HOME"]) / "huggingface"
                                   if os.path.isabs(os.environ.get("XDG_CACHE_HOME", ""))
                                   else home / ".cache" / "huggingface" if home else None)
    hf_cache = given("HF_HUB_CACHE") or (hf_home / "hub" if hf_home else None)
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE
    ollama = given("OLLAMA_MODELS") or (home / ".ollama" / "models" if home else None)
    lms = given("LMSTUDIO_MODELS")
    lmstudio = (lms,) if lms else tuple(p for p in (home / ".lmstudio" / "models",
                                                     home / ".cache" / "lm-studio" / "models") if home)
    return ModelStores(hf_cache, offline, ollama, lmstudio)


_resolved_models: list[Optional[Path]] = []  # runtime.models as the running command resolved it


def set_models(path: Optional[Path]) -> None:
    """The command edge records the resolved runtime.models here (commands.options.with_settings)."""
    _resolved_models[:] = [path]


def models_given() -> Optional[Path]:
    """runtime.models as given: as the running command resolved it (flag, environment, specquant.toml), else (no
    command resolved it: the package used as a library) its variable read now; None when it is not set."""
    if _resolved_models:
        return _resolved_models[0]
    raw = os.environ.get(settings_table()["runtime.models"].env, "")
    return Path(raw) if raw and "\0" not in raw else None


def models_dir() -> Optional[Path]:
    """The models folder (family.store): runtime.models when given, else data_home()/models; None when there is
    no home either."""
    given = models_given()
    if given is not None:
        return given
    home = data_home()
    return home / "models" if home is not None else None


def columns() -> Optional[int]:
    """$COLUMNS when it is a number (the terminal width a user or a test fixed), else None."""
    raw = os.environ.get("COLUMNS", "")
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) < 6 else None


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
