"""The rest of the environment, read here alone: the internal variables of our child processes (`env`,
`child_env`), what the running command resolved for the debug switch and the models folder, the user folders
(XDG_CACHE_HOME, XDG_DATA_HOME), the model stores of other tools (`model_stores`) and COLUMNS."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from specquant_cli.settings.limits import INTERNAL_ENV
from specquant_cli.settings.setting import TRUE
from specquant_cli.settings.table import settings_table


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
    mode = {settings_table()["runtime.deterministic"].env: "1"} if _resolved_deterministic[:1] == [True] else {}
    return {**os.environ, **mode, **internal}


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


_resolved_deterministic: list[bool] = []  # runtime.deterministic as the running command resolved it


def set_deterministic(on: bool) -> None:
    """The command edge records the resolved runtime.deterministic here (commands.options.with_settings); child
    processes of ours get it through child_env."""
    _resolved_deterministic[:] = [on]


def deterministic() -> bool:
    """Whether every llama.cpp row is computed the same way whatever the call (backend.context): runtime.deterministic
    as the running command resolved it, else its variable read now (a value that is no boolean is false here)."""
    if _resolved_deterministic:
        return _resolved_deterministic[0]
    return os.environ.get(settings_table()["runtime.deterministic"].env, "").strip().lower() in TRUE
