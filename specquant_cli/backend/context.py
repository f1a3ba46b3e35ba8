"""One llama.cpp context over a model (`Context`): its KV cache and batch — decode at chosen rows, positions and
sequences, rewind, sync to a prompt through the longest cached prefix, KV state export and import. Its token list
(`PrefixCache`) is the single record of what the cache holds, so the position counter cannot drift from what was
decoded."""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Sequence
from typing import Optional

import numpy as np

from specquant_cli.backend.model import Model
from specquant_cli.errors import InputError, LlamaError, check_cancelled
from specquant_cli.names import LogitsMode
from specquant_cli.settings import cores, deterministic

UNIFORM_SPARE = 1  # a cell beyond n_ctx for a lone token's companion (uniform), in a context of one sequence


def check_threads(n: int, label: str) -> int:
    """`n` if it is a thread count for this machine (settings.check_threads), else InputError naming `label`."""
    from specquant_cli.settings import SettingError
    from specquant_cli.settings import check_threads as check

    try:
        return check(n)
    except SettingError as e:
        raise InputError(f"{label}: {e}") from None


def common_prefix(cached: Sequence[int], tokens: Sequence[int]) -> int:
    """Length of the longest common prefix. Runs once per draft cycle, so it bisects with list-slice
    comparisons (done in C) instead of walking the whole context in Python."""
    cached, tokens = list(cached), list(tokens)
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


class PrefixCache:
    """Prefix reuse over a token list that mirrors a KV cache. Subclasses provide `tokens`, `n_ctx`, `n_batch`,
    `rewind` and `_decode_run` (or their own `decode`); the scripted test context inherits this too, so tests
    run the real prefix logic."""

    tokens: list[int]
    prefixes = None  # runtime.prefixes.PrefixSharing: where a prefill may take a computed prefix (None: its own only)

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def common_prefix(self, tokens: Sequence[int]) -> int:
        return common_prefix(self.tokens, tokens)

    def decode(self, tokens: Sequence[int], logits: LogitsMode = "last") -> None:
        """Append tokens at the end of the cache. logits: 'last', 'all' or 'none' (rows kept for `logits`).
        A run longer than n_batch is split; with 'all' it must fit one batch. Each run goes to
        `_decode_run(chunk, rows)` (a llama.cpp call here, the batcher for a sequence of a shared context)."""
        n = len(tokens)
        if n == 0:
            return
        if self.n_past + n > self.n_ctx:
            raise InputError(f"context full: {self.n_past} + {n} tokens > n_ctx {self.n_ctx}")
        if logits == "all" and n > self.n_batch:
            raise LlamaError(f"cannot score {n} tokens in one batch of {self.n_batch}")
        start = 0
        while start < n:
            if start:
                check_cancelled()  # a request cancelled during a long prompt stops between its chunks
            size = self.n_batch if logits == "all" else self.chunk_size()
            chunk = list(tokens[start:start + size])
            start += len(chunk)
            rows = list(range(len(chunk))) if logits == "all" else [len(chunk) - 1] if logits == "last" and \
                start >= n else []
            self._decode_run(chunk, rows)
            self.tokens.extend(chunk)

    def chunk_size(self) -> int:
        """Tokens per llama.cpp call when a run is longer (a shared context's sequence prefills in smaller
        chunks while other sequences decode beside it)."""
        return self.n_batch

    def _decode_run(self, chunk: list[int], rows: list[int]) -> None:
        """Decode `chunk` at the end of the cache (which does not yet list it), with logits for `rows`."""
        raise NotImplementedError

    def sync(self, tokens: Sequence[int], logits: LogitsMode = "last") -> int:
        """Make the cache hold exactly `tokens`, reusing the longest cached prefix; returns tokens decoded.

        When `tokens` is already cached in full, the last one is decoded again so logits exist."""
        keep = self.common_prefix(tokens)
        if keep == len(tokens) and logits != "none":
            keep = max(0, keep - 1)
        self.rewind(keep)
        self.decode(tokens[keep:], logits=logits)
        return len(tokens) - keep

    def prefill(self, tokens: Sequence[int]) -> int:
        """Hold exactly `tokens` (no logits), taking a computed prefix where `prefixes` has one; tokens decoded."""
        if self.prefixes is not None:
            return self.prefixes.prefill(self, tokens)
        return self.sync(tokens, logits="none")

    def reset(self) -> None:
        self.rewind(0)


class Context(PrefixCache):
    """One llama.cpp context (KV cache) over a Model, with a reusable batch.

    `tokens` always equals what the KV cache holds, position by position."""

    seq = 0  # the sequence `tokens` describes (a PrefixCache's; serving.slots' views are other sequences)

    def __init__(self, model: Model, n_ctx: int = 4096, n_batch: int = 512, n_threads: Optional[int] = None,
                 n_seq_max: int = 1, eval_callback=None, kv_unified: bool = False, uniform: Optional[bool] = None):
        """eval_callback: a `ggml_backend_sched_eval_callback` (llama.cpp's `cb_eval`), called for graph nodes
        as they are computed (family.imatrix collects activation statistics through it); kept alive here.
        `uniform`: every row computed the same way whatever the call (the deterministic mode; None: the process's
        mode, `deterministic`)."""
        import llama_cpp

        self.model = model
        threads = check_threads(n_threads, "threads") if n_threads else cores()
        self.uniform = deterministic() if uniform is None else uniform
        # the sequence a lone token's companion is decoded in (uniform): one past the caller's, in one shared cache
        self._scratch = n_seq_max if self.uniform else None
        self._last_out = -1
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx + (UNIFORM_SPARE if self.uniform else 0)
        params.n_batch = max(2, n_batch)
        params.n_ubatch = max(2, n_batch)
        params.n_seq_max = n_seq_max + (1 if self.uniform else 0)
        params.kv_unified = kv_unified or self.uniform
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        # Attention without llama.cpp's fused (flash) kernel on a model held on this CPU: there a call on many tokens
        # deep in a context costs less through the plain matrix products (measured on the 1.5B BF16 parent, AMD EPYC,
        # 2 threads, after 2,048 positions: 32 tokens 551 ms against 756, 16 tokens 310 against 430; one token and
        # the prefill level), and a verification is such a call. Every context of a family is made alike, so a
        # draft can still take the parent's cache; a parent on RPC workers (CPUs too) computes as it does here.
        # Models offloaded to a local GPU keep llama.cpp's choice.
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED if getattr(model, "on_host", True)
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO)
        self._eval_callback = eval_callback
        if eval_callback is not None:
            params.cb_eval = eval_callback
            params.cb_eval_user_data = None
        self._ptr = llama_cpp.llama_init_from_model(model._ptr, params)
        if not self._ptr:
            raise LlamaError(f"llama.cpp could not create a context of {n_ctx} for {model.path.name}")
        self.n_ctx = llama_cpp.llama_n_ctx(self._ptr) - (UNIFORM_SPARE if self.uniform else 0)  # the spare: companions
        self.n_batch = n_batch
        self._mem = llama_cpp.llama_get_memory(self._ptr)
        self._batch = llama_cpp.llama_batch_init(max(2, n_batch), 0, n_seq_max + (1 if self.uniform else 0))
        self.n_seq_max = n_seq_max
        self.tokens: list[int] = []  # sequence 0, position by position
        self._n_vocab = model.n_vocab
        ref = weakref.ref(self)
        model._stack.callback(lambda: (c := ref()) is not None and c.close())  # freed before its model

    def _decode_run(self, chunk: list[int], rows: list[int]) -> None:
        pos0 = self.n_past
        self.decode_at(chunk, [pos0 + i for i in range(len(chunk))], [(0,)] * len(chunk), rows)

    def decode_at(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]],
                  logit_rows: Sequence[int]) -> None:
        """One llama_decode of `tokens` at explicit positions and sequence ids, with logits for the rows in
        `logit_rows`. The seam for verifiers that score several candidates in one call (a token shared by
        branches lists several sequence ids). It does not touch `tokens`: callers that use it own the record
        of what sequences other than 0 hold, and clear them with `remove`."""
        import llama_cpp

        n = len(tokens)
        if not n == len(positions) == len(seq_ids) or n > self.n_batch:
            raise LlamaError(f"bad batch: {n} tokens, {len(positions)} positions, batch size {self.n_batch}")
        b, want = self._batch, set(logit_rows)
        for i, t in enumerate(tokens):
            b.token[i] = t
            b.pos[i] = positions[i]
            b.n_seq_id[i] = len(seq_ids[i])
            for k, s in enumerate(seq_ids[i]):
                b.seq_id[i][k] = s
            b.logits[i] = i in want
        self._last_out = max(want) if want else -1
        lone = self.uniform and n == 1
        if lone:  # a companion in the scratch sequence: every call computes two rows or more
            b.token[1], b.pos[1], b.n_seq_id[1], b.logits[1] = tokens[0], 0, 1, bool(want)
            b.seq_id[1][0] = self._scratch
        elif self.uniform and len(want) == 1:  # and keeps two rows or none through the last layer
            b.logits[0 if n - 1 in want else n - 1] = True
        b.n_tokens = n + lone
        rc = llama_cpp.llama_decode(self._ptr, b)
        if lone:
            llama_cpp.llama_memory_seq_rm(self._mem, self._scratch, -1, -1)
        if rc != 0:
            raise LlamaError(f"llama_decode failed with code {rc} at position {positions[0]}")

    def remove(self, seq_id: int, p0: int, p1: int = -1) -> None:
        """Drop positions [p0, p1) of one sequence (p1 = -1: to the end)."""
        import llama_cpp

        if not llama_cpp.llama_memory_seq_rm(self._mem, seq_id, p0, p1):
            raise LlamaError(f"llama.cpp could not remove positions {p0}..{p1} of sequence {seq_id}")

    @property
    def ctx(self) -> Context:
        return self  # the context a PrefixCache's state calls go to (a shared context's view has another)

    def copy_seq(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Give sequence `dst` the cells of positions [p0, p1) of `src` (`llama_memory_seq_cp`: in one unified
        cache no data moves, the cells belong to both). `dst` must hold nothing there."""
        import llama_cpp

        llama_cpp.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def positions(self, seq: int) -> tuple[int, int]:
        """(first, last) position sequence `seq` holds; (-1, -1) when it holds none."""
        import llama_cpp

        return llama_cpp.llama_memory_seq_pos_min(self._mem, seq), llama_cpp.llama_memory_seq_pos_max(self._mem, seq)

    def logits(self, i: int = -1) -> np.ndarray:
        """Logits row for token i of the last decoded batch (a view: valid until the next decode)."""
        import llama_cpp

        if i == -1 and self._last_out >= 0:  # the caller's last row, not a companion's (uniform)
            i = self._last_out
        ptr = llama_cpp.llama_get_logits_ith(self._ptr, i)
        if not ptr:
            raise LlamaError(f"no logits at batch index {i}")
        return np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))

    def rewind(self, n: int) -> None:
        """Drop every position >= n of sequence 0 from the KV cache."""
        if n >= self.n_past:
            return
        self.remove(0, n, -1)
        del self.tokens[n:]

    # -- state transfer between sibling contexts ------------------------------------------------
    def export_state(self, seq: int = 0) -> tuple[ctypes.Array, int]:
        """One sequence's KV cache as llama.cpp serializes it (`llama_state_seq_get_data`): (buffer, bytes)."""
        import llama_cpp

        size = llama_cpp.llama_state_seq_get_size(self._ptr, seq)
        buf = (ctypes.c_uint8 * size)()
        n = llama_cpp.llama_state_seq_get_data(self._ptr, buf, size, seq)
        if n == 0:
            raise LlamaError("llama.cpp could not export the sequence state")
        return buf, n

    def load_state(self, state: tuple[ctypes.Array, int], seq: int) -> bool:
        """Load a serialized sequence state into sequence `seq` (which must be empty); False when llama.cpp
        refuses it (another architecture, KV types or layout), the sequence then left empty."""
        import llama_cpp

        buf, size = state
        if llama_cpp.llama_state_seq_set_data(self._ptr, buf, size, seq) == 0:
            self.remove(seq, 0, -1)
            return False
        return True

    def import_state(self, state: tuple[ctypes.Array, int], tokens: Sequence[int]) -> bool:
        """Load a sibling's sequence state in place of this context's sequence 0, which then holds `tokens`.
        False when llama.cpp refuses it; the cache is then empty."""
        self.rewind(0)
        if not self.load_state(state, 0):
            return False
        self.tokens = list(tokens)
        return True

    def close(self) -> None:
        """Free the batch and the context. Idempotent; the model's exit stack calls it before freeing the model."""
        import llama_cpp

        if getattr(self, "_ptr", None):
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ptr)
            self._ptr = None

    def __del__(self):  # a context dropped without close(): free it now rather than with its model
        with contextlib.suppress(Exception):
            self.close()
