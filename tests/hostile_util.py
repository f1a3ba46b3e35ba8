"""Helpers for the hostile-input suite: tiny fabricated GGUFs, file-system snapshots, one-line error checks."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from conftest import run_cli


def tiny_llama(path: Path, seed: int = 0, dim: int = 64, ff: int = 128, layers: int = 1, vocab: int = 256,
               token_prefix: str = "t", arch: str = "llama", layer_gain: float = 0.0) -> Path:
    """A small F16 llama GGUF that llama.cpp's quantizer accepts (it cannot chat: no real tokenizer).
    layer_gain > 0 scales layer i's matrices by (1 + layer_gain * i), so layers differ in magnitude."""
    from specquant_cli.backend.tiny import write_tiny_llama

    return write_tiny_llama(path, seed=seed, dim=dim, ff=ff, layers=layers, vocab=vocab, token_prefix=token_prefix,
                            arch=arch, layer_gain=layer_gain)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root (hidden ones too, symlinks as links): path -> (kind, size, sha256 or target)."""
    out = {}
    root = Path(root)
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", 0, os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", 0, "")
            elif not p.is_file():  # a FIFO or socket: reading it would block
                out[rel] = ("special", 0, "")
            else:
                out[rel] = ("file", p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def temps(root: Path) -> list[str]:
    """Temp files and work folders anywhere under root."""
    return sorted(k for k in snapshot(root) if Path(k).name.endswith(".part") or Path(k).name.startswith(".fetch-")
                  or Path(k).name == ".specquant-commit.json")


def assert_clean_error(r, code: int, *needles: str) -> str:
    """Exit code, exactly one `error: …` line on stderr naming the problem, no traceback anywhere."""
    assert r.exit_code == code, (r.exit_code, r.stdout, r.stderr)
    text = r.stdout + r.stderr
    assert "Traceback" not in text and "internal error" not in text, text
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def cli(args, input=None, env=None):
    return run_cli([str(a) for a in args], input=input, env=env)


def copy_family(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst
