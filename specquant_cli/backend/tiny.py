"""GGUF models with random weights, written on the fly: a tiny llama the build self-test decodes through and the
tests quantize (`write_tiny_llama`), and a model of any decoder's shape (`write_random_model`: the GPU device check
prices calls on the demo parent's shape with it). They have no real tokenizer (tokens `<t0>`, `<t1>`, …), so they
cannot chat."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Shape:
    """A decoder's shape as its GGUF gives it to llama.cpp."""

    arch: str = "llama"
    dim: int = 64
    layers: int = 1
    heads: int = 4
    kv_heads: int = 4
    ff: int = 128
    vocab: int = 256
    qkv_bias: bool = False  # biases on the Q, K and V projections (qwen2)
    tied: bool = False  # no output.weight: the token embeddings are the output head too
    rope_theta: float = 10000.0
    ctx: int = 4096

    @property
    def kv_dim(self) -> int:
        return self.dim // self.heads * self.kv_heads

    def tensors(self) -> list[tuple[str, tuple[int, ...], int]]:
        """(name, numpy shape, fan-in; 0 for a norm (ones), -1 for a bias (zeros), -2 for the embeddings)."""
        d, kv, ff = self.dim, self.kv_dim, self.ff
        out: list[tuple[str, tuple[int, ...], int]] = [("token_embd.weight", (self.vocab, d), -2)]
        for i in range(self.layers):
            p = f"blk.{i}."
            out += [(p + "attn_norm.weight", (d,), 0), (p + "attn_q.weight", (d, d), d),
                    (p + "attn_k.weight", (kv, d), d), (p + "attn_v.weight", (kv, d), d)]
            if self.qkv_bias:
                out += [(p + "attn_q.bias", (d,), -1), (p + "attn_k.bias", (kv,), -1), (p + "attn_v.bias", (kv,), -1)]
            out += [(p + "attn_output.weight", (d, d), d), (p + "ffn_norm.weight", (d,), 0),
                    (p + "ffn_gate.weight", (ff, d), d), (p + "ffn_up.weight", (ff, d), d),
                    (p + "ffn_down.weight", (d, ff), ff)]
        out.append(("output_norm.weight", (d,), 0))
        if not self.tied:
            out.append(("output.weight", (self.vocab, d), -2))
        return out

    @property
    def n_params(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.tensors())


POOL = 1 << 22  # random F16 values drawn once per scale; each tensor takes them from its own random offset


def write_random_model(path: Path, shape: Shape, *, seed: int = 0, embed_std: float = 1.0,
                       logit_std: float = 4.0) -> Path:
    """An F16 GGUF of `shape` with random weights, written tensor by tensor (memory holds one tensor). Each matrix is
    N(0, 1/fan-in), so activations keep about unit scale at any depth (nothing near F16's range); the embeddings (and
    an untied output head) are N(0, embed_std²), and the output norm scales the logits' spread to about logit_std.
    Other norms are ones and biases zeros. With an untied head, greedy answers wander from token to token; a tied
    one makes each token predict itself (its own embedding dominates the last hidden state). Values come from a pool
    of POOL random numbers per scale at a random offset per tensor: a 1.5B model takes seconds, not minutes. The
    caller owns atomicity."""
    import gguf

    rng = np.random.default_rng(seed)
    base = rng.standard_normal(POOL, dtype=np.float32)
    pools: dict[float, np.ndarray] = {}

    def weights(n: int, std: float) -> np.ndarray:
        if std not in pools:
            pools[std] = (base * std).astype(np.float16)
        return np.resize(np.roll(pools[std], -int(rng.integers(POOL))), n)

    w = gguf.GGUFWriter(os.fspath(path), shape.arch)
    w.add_name("random")
    w.add_context_length(shape.ctx)
    w.add_embedding_length(shape.dim)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ff)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(shape.vocab)])
    w.add_token_types([1] * shape.vocab)
    w.add_token_merges(["<t1> <t2>"])  # llama.cpp loads a BPE vocabulary only with merges
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    plan = shape.tensors()
    for name, shp, fan in plan:
        dtype = np.dtype(np.float32 if fan in (0, -1) else np.float16)
        w.add_tensor_info(name, shp, dtype, math.prod(shp) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shp, fan in plan:
        n = math.prod(shp)
        if fan == 0:
            gain = logit_std / (embed_std * math.sqrt(shape.dim)) if name == "output_norm.weight" else 1.0
            data = np.full(n, gain, dtype=np.float32)
        elif fan == -1:
            data = np.zeros(n, dtype=np.float32)
        else:
            data = weights(n, embed_std if fan == -2 else 1.0 / math.sqrt(fan))
        w.write_tensor_data(data.reshape(shp))
    w.close()
    return Path(path)
