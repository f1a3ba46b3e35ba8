"""A tiny llama GGUF with random weights, written on the fly: the build self-test decodes through it, and the
tests quantize it. It has no real tokenizer (tokens `<t0>`, `<t1>`, …), so it cannot chat."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_tiny_llama(path: Path, *, seed: int = 0, dim: int = 64, ff: int = 128, layers: int = 1, vocab: int = 256,
                     token_prefix: str = "t", arch: str = "llama", layer_gain: float = 0.0, scale: float = 1.0,
                     merges: tuple[str, ...] = (), split: tuple[int, int] = (0, 1)) -> Path:
    """F16 weights N(0, scale²); layer_gain > 0 scales layer i's matrices by (1 + layer_gain * i). llama.cpp loads
    a BPE vocabulary only with a merges list: give one (any pair) for a model that is to be loaded, not just
    quantized. `split`: (split.no, split.count), written as llama-gguf-split writes them into each part when
    count > 1."""
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
    w.add_token_merges(list(merges))
    if split[1] > 1:
        w.add_uint16("split.no", split[0])
        w.add_uint16("split.count", split[1])
        w.add_int32("split.tensors.count", 3 + 9 * layers)

    def f16(*shape):
        return (rng.standard_normal(shape) * scale).astype(np.float16)

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
