"""The models of the GPU device check (bench.device): the demo parent's shape with random weights, and smollm2-135m
cut to fit a device call; each made into a family as `specquant quantize` makes one. bench.device's docstring says
why these two."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from specquant_cli.backend.tiny import Shape

# Qwen2.5-Coder-1.5B-Instruct, the demo family's parent: its widths, heads, layers, vocabulary and rope base. One
# departure: an output head of its own (the real one ties it to the embeddings: the same arithmetic per call, 0.47 GB
# more memory), because with a tied head random weights make each token predict itself (backend.tiny).
DEMO_SHAPE = Shape(arch="qwen2", dim=1536, layers=28, heads=12, kv_heads=2, ff=8960, vocab=151936, qkv_bias=True,
                   tied=False, rope_theta=1e6, ctx=32768)
QUICK_SHAPE = replace(DEMO_SHAPE, dim=256, layers=4, heads=4, kv_heads=2, ff=768, vocab=8192, ctx=4096)
CUT_SOURCE = "smollm2-135m"
CUT_BLOCKS = (0, 1, 28, 29)  # its first two and last two blocks: the embeddings' neighbours and the head's
CUT_FILE = "smollm2-135m-cut4-q4_0.gguf"
# Each family: its F16 parent and two drafts, the demo family's own; the cut model's q4 is Q4_K_M, since a Q4_0
# draft of a parent rendered from Q4_0 weights would be that parent again.
DEMO_TYPES, CUT_TYPES = "f16,q8_0,q4_0", "f16,q8_0,q4_k_m"


# -- making them ------------------------------------------------------------------------------------------------
def cut(family_dir: Path, out_dir: Path) -> Path:
    """`CUT_SOURCE` cut to CUT_BLOCKS, Q4_0 throughout (embeddings too): the identity check's carried model."""
    import llama_cpp

    from specquant_cli.backend.llama import llama_log_to
    from specquant_cli.family.gguf_write import cut_layers
    from specquant_cli.family.manifest import Family

    fam = Family.load(family_dir)
    src = fam.path("f16" if "f16" in fam.roles() else fam.parent_rendering or "bf16")
    out_dir.mkdir(parents=True, exist_ok=True)
    dst, tmp = out_dir / CUT_FILE, out_dir / (CUT_FILE + ".f16.tmp")
    try:
        cut_layers(src, tmp, CUT_BLOCKS, f"{CUT_SOURCE} ({src.name}) cut to its blocks {list(CUT_BLOCKS)} of 30 for "
                                         "the GPU device check")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
        params.token_embedding_type = params.output_tensor_type = llama_cpp.GGML_TYPE_Q4_0
        params.nthread = os.cpu_count() or 1
        part = out_dir / (CUT_FILE + ".part")
        with llama_log_to(None):
            if llama_cpp.llama_model_quantize(os.fsencode(tmp), os.fsencode(part), params) != 0:
                raise RuntimeError(f"llama_model_quantize could not make {dst.name}")
        os.replace(part, dst)
    finally:
        tmp.unlink(missing_ok=True)
        (out_dir / (CUT_FILE + ".part")).unlink(missing_ok=True)
    return dst


def make_family(base: Path, out_dir: Path, types: str, threads: int) -> Path:
    """A family of `base` (a float GGUF) with `types`, made as `specquant quantize` makes one."""
    from specquant_cli.family.quantize import parse_types, quantize_family

    quantize_family(base, out_dir, parse_types(types), threads=threads, force=True,
                    provenance="made by the GPU device check")
    return out_dir


def make_cut_family(work: Path, cut_file: Path, threads: int) -> dict:
    """The cut model's family: its F16 rendering (the parent) and q8_0 and q4_k_m drafts."""
    from specquant_cli.family.gguf_write import dequantize_to_float

    parent = work / "smollm2-cut-f16.gguf"
    parent.unlink(missing_ok=True)
    dequantize_to_float(cut_file, parent, f"{cut_file.name} dequantized for the GPU device check", "f16")
    fam = make_family(parent, work / "smollm2-cut", CUT_TYPES, threads)
    return {"family": str(fam), "source": str(cut_file), "summary": f"{cut_file.name} -> F16 parent, {CUT_TYPES}"}


def make_demo_family(work: Path, shape: Shape, threads: int) -> dict:
    """The demo-shaped family: a random F16 parent of `shape`, its q8_0 and q4_0 drafts."""
    from specquant_cli.backend.tiny import write_random_model

    t0 = time.monotonic()
    base = work / "demo-shape-f16.gguf"
    base.unlink(missing_ok=True)
    write_random_model(base, shape)
    wrote = time.monotonic() - t0
    fam = make_family(base, work / "demo-shape", DEMO_TYPES, threads)
    return {"family": str(fam), "base_bytes": base.stat().st_size, "write_s": round(wrote, 1),
            "quantize_s": round(time.monotonic() - t0 - wrote, 1),
            "summary": f"{shape.n_params / 1e9:.2f}B params, {base.stat().st_size / 2**30:.2f} GiB F16 written in "
                       f"{wrote:.0f} s, {DEMO_TYPES} in {time.monotonic() - t0 - wrote:.0f} s"}
