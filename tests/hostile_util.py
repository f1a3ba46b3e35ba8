"""Helpers for the hostile-input suite: tiny fabricated GGUFs, file-system snapshots, one-line error checks."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np

from conftest import run_cli


def tiny_llama(path: Path, seed: int = 0, dim: int = 64, ff: int = 128, layers: int = 1, vocab: int = 256,
               token_prefix: str = "t", arch: str = "llama", layer_gain: float = 0.0) -> Path:
    """A small F16 llama GGUF that llama.cpp's quantizer accepts (it cannot chat: no real tokenizer).
    layer_gain > 0 scales layer i's matrices by (1 + layer_gain * i), so layers differ in magnitude."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(256)
    w.add_embedding_length(dim)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<{token_prefix}{i}>" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([])

    def f16(*shape):
        return rng.standard_normal(shape).astype(np.float16)

    w.add_tensor("token_embd.weight", f16(vocab, dim))
    for i in range(layers):
        p, k = f"blk.{i}.", 1.0 + layer_gain * i
        w.add_tensor(p + "attn_norm.weight", np.ones(dim, dtype=np.float32))
        for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + n + ".weight", f16(dim, dim) * k)
        w.add_tensor(p + "ffn_norm.weight", np.ones(dim, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", f16(ff, dim) * k)
        w.add_tensor(p + "ffn_up.weight", f16(ff, dim) * k)
        w.add_tensor(p + "ffn_down.weight", f16(dim, ff) * k)
    w.add_tensor("output_norm.weight", np.ones(dim, dtype=np.float32))
    w.add_tensor("output.weight", f16(vocab, dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


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
