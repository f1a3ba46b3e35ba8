"""The bounds and defaults settings are declared with, the internal variables of our own child processes, and the
machine's one bound on them: the cores this process may run on."""

from __future__ import annotations

import os

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


def cores() -> int:
    """The logical cores this process may run on: its CPU affinity where the system keeps one (a container's or
    taskset's share of the machine, as Python 3.13's os.process_cpu_count), else every core; at least 1. What "every
    core" means for a thread count: llama.cpp's threads beyond the cores a process may use only spin on each other."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


THREADS_PER_CORE = 4
