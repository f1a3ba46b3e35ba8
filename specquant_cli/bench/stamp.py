"""What makes a bench figure reproducible, taken once as a run begins and kept in every bench report: the specquant
version and the git commit it runs from, Python and llama-cpp-python, the CPU, the threads, the mode the models run in
(default or deterministic: backend.context), the date and the command. `take` never fails a bench: what cannot be
found is None."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path
from typing import Optional

GIT_TIMEOUT_S = 3.0  # each git call; a hung git (a network file system, a lock) costs a bench this much at most


def take(command: str, threads: Optional[int], models_here: bool = True) -> dict:
    """The run's stamp. `command`: the command line as typed (commands.options.command_line); `threads`: the
    llama.cpp threads the run uses (None: it runs no model here, or its server's are its own); `models_here`: whether
    the run's models (or servers) are this command's, so that its mode is theirs."""
    import platform

    from specquant_cli import __version__
    from specquant_cli.settings import deterministic
    from specquant_cli.system.hardware import cpu_model

    return {"specquant": __version__, "commit": git_commit(), "python": platform.python_version(),
            "llama_cpp_python": _version("llama_cpp_python"), "cpu": cpu_model(), "threads": threads,
            "mode": ("deterministic" if deterministic() else "default") if models_here else None,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": command}


def git_commit(root: Optional[Path] = None) -> Optional[str]:
    """The short sha of the checkout the package runs from, with "-dirty" when tracked files have changed; None when
    the package is not a git checkout's own (an installed copy, even inside another repository), git is missing or
    slow, or anything else goes wrong."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return None
    sha = _git(root, "rev-parse", "--short", "HEAD")
    if not sha:
        return None
    changes = _git(root, "status", "--porcelain", "--untracked-files=no")
    return sha + ("-dirty" if changes else "") if changes is not None else sha


def _git(root: Path, *args: str) -> Optional[str]:
    """git's stdout, stripped; None on any failure. --no-optional-locks: a status taken here never writes the index
    (others may be working in the same checkout)."""
    try:
        done = subprocess.run(["git", "--no-optional-locks", "-C", str(root), *args], capture_output=True,
                              encoding="utf-8", errors="replace", timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version(dist: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def markdown_lines(stamp: Optional[dict]) -> list[str]:
    """The stamp as a markdown list item (none for a report without one): what ran, on what, when."""
    if not stamp:
        return []
    commit = f" ({stamp['commit']})" if stamp.get("commit") else ""
    threads = f", {stamp['threads']} threads" if stamp.get("threads") else ""
    mode = f", {stamp['mode']} mode" if stamp.get("mode") else ""
    return [f"- run: specquant {stamp['specquant']}{commit}, Python {stamp['python']}, llama-cpp-python "
            f"{stamp['llama_cpp_python'] or '?'}; {stamp['cpu']}{threads}{mode}; {stamp['date']}"]
