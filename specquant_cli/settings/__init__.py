"""Every setting, declared once: its branch, type, bounds, default and help. From each declaration come the
command-line option (commands.options.with_settings), the `SPECQUANT_<NAME>` environment variable and the
`[branch] name` key of `specquant.toml`. A command resolves the settings it takes once, at the edge and before any
model loads (`resolve`: default < specquant.toml < environment < flag), what the machine decides included (threads
from its cores; serve's parallel sequences from its calibration), and passes the resolved `Settings` down; below
the edge nothing reads the environment or changes a setting in place.

One module an idea, and one name to import from (`from specquant_cli.settings import Settings`): limits (bounds,
defaults, the cores), setting (a declaration and its conversion), checks (the value checks), policy_hook (what the
policy table hands down), table (every declaration), resolved (`Settings`, values the machine decides), config
(specquant.toml read), sources (resolution), environment (the rest of the environment: user folders, model stores,
internal variables), session (`SessionSettings`). The package is the only reader of the environment and imports
nothing of the package above it."""

from specquant_cli.settings.checks import (
    PARENT_CHOICES,
    check_api_keys,
    check_key,
    check_parent,
    check_path,
    check_rpc,
    check_text,
    check_threads,
    key_list,
)
from specquant_cli.settings.config import read_config, read_toml
from specquant_cli.settings.environment import (
    ModelStores,
    cache_home,
    child_env,
    columns,
    data_home,
    debug,
    deterministic,
    env,
    model_stores,
    models_dir,
    models_given,
    set_debug,
    set_deterministic,
    set_models,
)
from specquant_cli.settings.limits import (
    CACHE_RAM_MAX_MIB,
    CACHE_RAM_MIN_MIB,
    CACHE_RAM_SHARE,
    COMPANIONS,
    CONFIG_NAME,
    DEFAULT_CTX,
    DEFAULT_DRAFT_MEMORY_MIB,
    DEFAULT_GAMMA,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_RPC_TIMEOUT_S,
    INTERNAL_ENV,
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_CTX,
    MAX_DRAFT_MEMORY_MIB,
    MAX_GAMMA_SETTING,
    MAX_KEY_FILE_BYTES,
    MAX_PARALLEL,
    MAX_RPC_TIMEOUT_S,
    PANELS,
    SELFTEST_CHILD_ENV,
    SELFTEST_FAULT_ENV,
    SOURCES,
    THREADS_PER_CORE,
    cores,
)
from specquant_cli.settings.policy_hook import PolicyTable, check_policy
from specquant_cli.settings.resolved import Branch, Settings, Value, decide_cache_ram, default_cache_ram
from specquant_cli.settings.session import SessionSettings
from specquant_cli.settings.setting import FALSE, TRUE, Setting, SettingError
from specquant_cli.settings.sources import resolve, resolve_all, with_companions
from specquant_cli.settings.table import GLOBAL_KEYS, register_policy_table, settings_table

__all__ = [
    "Branch", "CACHE_RAM_MAX_MIB", "CACHE_RAM_MIN_MIB", "CACHE_RAM_SHARE", "COMPANIONS", "CONFIG_NAME", "DEFAULT_CTX",
    "DEFAULT_DRAFT_MEMORY_MIB", "DEFAULT_GAMMA", "DEFAULT_PREFILL_CHUNK", "DEFAULT_RPC_TIMEOUT_S", "FALSE",
    "GLOBAL_KEYS", "INTERNAL_ENV", "MAX_CONFIG_BYTES", "MAX_CONFIG_DEPTH", "MAX_CTX", "MAX_DRAFT_MEMORY_MIB",
    "MAX_GAMMA_SETTING", "MAX_KEY_FILE_BYTES", "MAX_PARALLEL", "MAX_RPC_TIMEOUT_S", "ModelStores", "PANELS",
    "PARENT_CHOICES", "PolicyTable", "SELFTEST_CHILD_ENV", "SELFTEST_FAULT_ENV", "SOURCES", "SessionSettings",
    "Setting", "SettingError", "Settings", "THREADS_PER_CORE", "TRUE", "Value", "cache_home", "check_api_keys",
    "check_key", "check_parent", "check_path", "check_policy", "check_rpc", "check_text", "check_threads",
    "child_env", "columns", "cores", "data_home", "debug", "decide_cache_ram", "default_cache_ram", "env",
    "key_list", "model_stores", "models_dir", "models_given", "read_config", "read_toml", "register_policy_table",
    "resolve", "resolve_all", "deterministic", "set_debug", "set_deterministic", "set_models", "settings_table",
    "with_companions",
]
