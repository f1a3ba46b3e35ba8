"""A thin adapter over llama.cpp (llama-cpp-python's low-level API).

One small class per llama.cpp resource: `Model` (weights + vocabulary) and `Context` (KV cache + batch).
Return codes become exceptions; the context's token list is the single source of truth for the KV
cache's positions, so the position counter cannot drift from what was decoded."""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import os
import threading
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from specquant_cli.errors import InputError, LlamaError, VocabMismatchError

_backend_ready = False
_log_lock = threading.Lock()
_log_file = None  # file object llama.cpp's log goes to, or None to drop it
_log_cb = None  # keep the ctypes callback alive


def _init_backend() -> None:
    global _backend_ready, _log_cb
    if _backend_ready:
        return
    import llama_cpp

    @llama_cpp.llama_log_callback
    def cb(level, text, user_data):  # noqa: ARG001
        f = _log_file
        if f is not None:
            try:
                f.write(text.decode("utf-8", "replace"))
            except ValueError:  # file closed
                pass

    _log_cb = cb
    llama_cpp.llama_log_set(_log_cb, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    _backend_ready = True


@contextlib.contextmanager
def llama_log_to(path: Optional[Path]) -> Iterator[None]:
    """Send llama.cpp's own log to `path` (appending) instead of the terminal while the block runs."""
    global _log_file
    _init_backend()
    with _log_lock:
        prev = _log_file
        f = open(path, "a", encoding="utf-8") if path else None
        _log_file = f
    try:
        yield
    finally:
        with _log_lock:
            _log_file = prev
            if f:
                f.close()


def _default_log() -> None:
    """SPECQUANT_LLAMA_LOG=FILE keeps llama.cpp's log of model loading; otherwise it is dropped."""
    global _log_file
    _init_backend()
    if _log_file is None and os.environ.get("SPECQUANT_LLAMA_LOG"):
        _log_file = open(os.environ["SPECQUANT_LLAMA_LOG"], "a", encoding="utf-8")


def gpu_offload_supported() -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


class Model:
    """Weights and vocabulary of one GGUF file."""

    def __init__(self, path: Path | str, n_gpu_layers: int = 0, vocab_only: bool = False):
        import llama_cpp

        _default_log()
        self.path = Path(path)
        if not self.path.is_file():
            raise InputError(f"{self.path}: no such model file")
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        self._ptr = llama_cpp.llama_model_load_from_file(os.fsencode(self.path), params)
        if not self._ptr:
            raise LlamaError(f"llama.cpp could not load {self.path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self._ptr)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self._ptr)
        self.n_gpu_layers = n_gpu_layers
        is_eog = llama_cpp.llama_vocab_is_eog
        self._eog_ids = frozenset(t for t in range(self.n_vocab) if is_eog(self.vocab, t))
        self._piece_buf = ctypes.create_string_buffer(256)

    # -- vocabulary ---------------------------------------------------------------------------
    @property
    def eog_ids(self) -> frozenset[int]:
        return self._eog_ids

    def is_eog(self, token: int) -> bool:
        return token in self._eog_ids

    def bos(self) -> int:
        import llama_cpp

        return llama_cpp.llama_vocab_bos(self.vocab)

    def eos(self) -> int:
        import llama_cpp

        return llama_cpp.llama_vocab_eos(self.vocab)

    def add_bos(self) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))

    def token_text(self, token: int) -> str:
        import llama_cpp

        raw = llama_cpp.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", "replace") if raw else ""

    def tokenize(self, text: str, add_bos: bool, special: bool = True) -> list[int]:
        import llama_cpp

        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_bos, special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_bos, special)
            if n < 0:
                raise LlamaError("tokenization failed")
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        import llama_cpp

        n = llama_cpp.llama_token_to_piece(self.vocab, token, self._piece_buf, 256, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
            return buf.raw[:n]
        return self._piece_buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", "replace")

    def meta(self, key: str) -> Optional[str]:
        import llama_cpp

        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    # -- chat -----------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` rendered with the GGUF's own chat template, ready for generation."""
        fmt = self._chat_formatter()
        if fmt is None:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
            return self.tokenize(text, add_bos=self.add_bos())
        text = fmt(messages=messages).prompt
        bos_text = fmt.bos_token
        add_bos = self.add_bos() and not (bos_text and text.startswith(bos_text))
        return self.tokenize(text, add_bos=add_bos, special=True)

    def _chat_formatter(self):
        """llama-cpp-python's Jinja formatter over the GGUF's template, compiled once per model."""
        if not hasattr(self, "_fmt"):
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            template = self.meta("tokenizer.chat_template")
            self._fmt = Jinja2ChatFormatter(template=template, eos_token=self.token_text(self.eos()),
                                            bos_token=self.token_text(self.bos())) if template else None
        return self._fmt

    def close(self) -> None:
        import llama_cpp

        if getattr(self, "_ptr", None):
            llama_cpp.llama_model_free(self._ptr)
            self._ptr = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


class Context:
    """One llama.cpp context (KV cache) over a Model, with a reusable batch.

    `tokens` always equals what the KV cache holds, position by position."""

    def __init__(self, model: Model, n_ctx: int = 4096, n_batch: int = 512, n_threads: Optional[int] = None):
        import llama_cpp

        self.model = model
        threads = n_threads or max(1, os.cpu_count() or 1)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = 1
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        self._ptr = llama_cpp.llama_init_from_model(model._ptr, params)
        if not self._ptr:
            raise LlamaError(f"llama.cpp could not create a context of {n_ctx} for {model.path.name}")
        self.n_ctx = llama_cpp.llama_n_ctx(self._ptr)
        self.n_batch = n_batch
        self._mem = llama_cpp.llama_get_memory(self._ptr)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.tokens: list[int] = []
        self._n_vocab = model.n_vocab
        self._float_p = ctypes.POINTER(ctypes.c_float)

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def decode(self, tokens: Sequence[int], logits: str = "last") -> None:
        """Append tokens at the end of the cache. logits: 'last', 'all' or 'none' (rows kept for `logits`).

        A run longer than n_batch is split; with 'all' it must fit one batch."""
        import llama_cpp

        n = len(tokens)
        if n == 0:
            return
        if self.n_past + n > self.n_ctx:
            raise InputError(f"context full: {self.n_past} + {n} tokens > n_ctx {self.n_ctx}")
        if logits == "all" and n > self.n_batch:
            raise LlamaError(f"cannot score {n} tokens in one batch of {self.n_batch}")
        b = self._batch
        for start in range(0, n, self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            last_chunk = start + self.n_batch >= n
            pos0 = self.n_past
            for i, t in enumerate(chunk):
                b.token[i] = t
                b.pos[i] = pos0 + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = logits == "all"
            if logits == "last" and last_chunk:
                b.logits[len(chunk) - 1] = 1
            b.n_tokens = len(chunk)
            rc = llama_cpp.llama_decode(self._ptr, b)
            if rc != 0:
                raise LlamaError(f"llama_decode failed with code {rc} at position {pos0}")
            self.tokens.extend(chunk)

    def logits(self, i: int = -1) -> np.ndarray:
        """Logits row for token i of the last decoded batch (a view: valid until the next decode)."""
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self._ptr, i)
        if not ptr:
            raise LlamaError(f"no logits at batch index {i}")
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def rewind(self, n: int) -> None:
        """Drop every position >= n from the KV cache."""
        import llama_cpp

        if n >= self.n_past:
            return
        if not llama_cpp.llama_memory_seq_rm(self._mem, 0, n, -1):
            raise LlamaError(f"llama.cpp could not rewind the cache to position {n}")
        del self.tokens[n:]

    def common_prefix(self, tokens: Sequence[int]) -> int:
        """Length of the longest cached prefix of `tokens`. Runs once per draft cycle, so it bisects with
        list-slice comparisons (done in C) instead of walking the whole context in Python."""
        tokens = list(tokens)
        cached = self.tokens
        lo, hi = 0, min(len(cached), len(tokens))
        if cached[:hi] == tokens[:hi]:
            return hi
        while lo < hi:  # invariant: prefix of length lo matches, of length hi+1 does not
            mid = (lo + hi + 1) // 2
            if cached[:mid] == tokens[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def sync(self, tokens: Sequence[int], logits: str = "last") -> int:
        """Make the cache hold exactly `tokens`, reusing the longest cached prefix; returns tokens decoded.

        When `tokens` is already cached in full, the last one is decoded again so logits exist."""
        keep = self.common_prefix(tokens)
        if keep == len(tokens) and logits != "none":
            keep = max(0, keep - 1)
        self.rewind(keep)
        self.decode(tokens[keep:], logits=logits)
        return len(tokens) - keep

    def reset(self) -> None:
        self.rewind(0)

    def close(self) -> None:
        import llama_cpp

        if getattr(self, "_ptr", None):
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ptr)
            self._ptr = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


class Detokenizer:
    """Incremental token -> text that never splits a multi-byte UTF-8 character."""

    def __init__(self, model: Model):
        self.model = model
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        return self._dec.decode(self.model.piece(token))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def check_same_vocab(parent: Model, draft: Model, samples: int = 64) -> None:
    """A draft must speak the parent's vocabulary: same size, special tokens and token texts."""
    if parent.n_vocab != draft.n_vocab:
        raise VocabMismatchError(f"vocabulary sizes differ: parent {parent.n_vocab}, draft {draft.n_vocab}")
    for name in ("bos", "eos"):
        a, b = getattr(parent, name)(), getattr(draft, name)()
        if a != b:
            raise VocabMismatchError(f"{name} token differs: parent {a}, draft {b}")
    if parent.eog_ids != draft.eog_ids:
        raise VocabMismatchError("end-of-generation token sets differ")
    step = max(1, parent.n_vocab // samples)
    for t in range(0, parent.n_vocab, step):
        if parent.token_text(t) != draft.token_text(t):
            raise VocabMismatchError(f"token {t} differs: parent {parent.token_text(t)!r}, "
                                     f"draft {draft.token_text(t)!r}")
