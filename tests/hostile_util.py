"""Helpers for the hostile-input suite: tiny fabricated GGUFs, file-system snapshots, one-line error checks."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from conftest import run_cli


def tiny_llama(path: Path, seed: int = 0, dim: int = 64, ff: int = 128, layers: int = 1, vocab: int = 256,
               token_prefix: str = "t", arch: str = "llama", layer_gain: float = 0.0, split=(0, 1)) -> Path:
    """A small F16 llama GGUF that llama.cpp's quantizer accepts (it cannot chat: no real tokenizer).
    layer_gain > 0 scales layer i's matrices by (1 + layer_gain * i), so layers differ in magnitude."""
    from specquant_cli.backend.tiny import write_tiny_llama

    return write_tiny_llama(path, seed=seed, dim=dim, ff=ff, layers=layers, vocab=vocab, token_prefix=token_prefix,
                            arch=arch, layer_gain=layer_gain, split=split)


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


def link_family(src: Path, dst: Path, roles: tuple[str, ...] = ()) -> Path:
    """The demo family's GGUFs hard-linked (read-only use, replaced only by rename), its manifest copied; with
    `roles`, only those variants (a smaller family is calibrated faster)."""
    dst.mkdir(parents=True)
    m = json.loads((src / "manifest.json").read_text())
    if roles:
        m["variants"] = {r: v for r, v in m["variants"].items() if r in roles}
        m["roles"] = {r: t for r, t in m.get("roles", {}).items() if r in roles}
    for v in m["variants"].values():
        try:
            os.link(src / v["path"], dst / v["path"])
        except OSError:
            shutil.copyfile(src / v["path"], dst / v["path"])
    if roles:
        (dst / "manifest.json").write_text(json.dumps(m, indent=1))
    else:
        shutil.copyfile(src / "manifest.json", dst / "manifest.json")
    return dst


def rewrite_gguf(src: Path, dst: Path, keep_layers: int | None = None, extra_layers: int = 0,
                 tokens: dict[int, str] | None = None, drop_tokens: int = 0) -> Path:
    """A real GGUF made from `src` by the gguf writer: only its first `keep_layers` blocks (a smaller network of the
    same vocabulary: a sibling), or its last block repeated `extra_layers` more times (a bigger one), or token texts
    replaced (`tokens`: id -> text) or the last `drop_tokens` tokens dropped from the vocabulary (another vocabulary).
    Tensor data is copied as it is stored (any type)."""
    import gguf

    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    n_layer = int(r.fields[f"{arch}.block_count"].contents())
    keep = n_layer if keep_layers is None else keep_layers
    w = gguf.GGUFWriter(os.fspath(dst), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        value = f.contents()
        if f.name == f"{arch}.block_count":
            value = keep + extra_layers
        elif f.name == "tokenizer.ggml.tokens":
            value = [tokens.get(i, t) for i, t in enumerate(value)] if tokens else value
            value = value[:len(value) - drop_tokens]
        elif f.name in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores") and drop_tokens:
            value = value[:len(value) - drop_tokens]
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, value, f.types[0], sub_type=sub)
    plan = []
    for t in r.tensors:
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else None
        if layer is not None and layer >= keep:
            continue
        plan.append((t.name, t))
        if layer == n_layer - 1:
            plan += [(t.name.replace(f"blk.{layer}.", f"blk.{n_layer + i}.", 1), t) for i in range(extra_layers)]
    for name, t in plan:
        w.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, t in plan:
        w.write_tensor_data(t.data)
    w.close()
    return dst


def claim_file_type(path: Path, ftype: int) -> Path:
    """The file at `path` with its header's general.file_type set to `ftype` (the weights left as they are)."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r+")
    field = reader.fields["general.file_type"]
    field.parts[field.data[0]][0] = ftype
    del reader
    return path
