"""A thin adapter over llama.cpp (llama-cpp-python's low-level API).

One small class per llama.cpp resource: `Model` (weights + vocabulary) and `Context` (KV cache + batch).
Return codes become exceptions; the context's token list is the single source of truth for the KV
cache's positions, so the position counter cannot drift from what was decoded.

Why one file of ~600 lines: it is the one place that touches llama.cpp's C API (ctypes structs, pointers, the
free order of model, context and batch); splitting it would spread that boundary over several files."""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import errno
import os
import secrets
import threading
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Optional

import numpy as np

from specquant_cli import interrupts
from specquant_cli.errors import InputError, LlamaError, VocabMismatchError, check_cancelled
from specquant_cli.names import LogitsMode
from specquant_cli.settings import cores

PIECE_BUF_BYTES = 256  # one token's text; longer pieces get a buffer of their own
META_BUF_BYTES = 1 << 16  # a metadata value (chat templates run to a few KiB)

_backend_ready = False
_log_lock = threading.Lock()
_log_file = None  # file object llama.cpp's log goes to, or None to drop it
_log_cb = None  # keep the ctypes callback alive


def init_backend() -> None:
    global _backend_ready, _log_cb
    if _backend_ready:
        return
    import llama_cpp

    @llama_cpp.llama_log_callback
    @interrupts.c_callback  # Ctrl-C here is raised once the callback returns (ctypes would swallow it)
    def cb(level, text, user_data):  # noqa: ARG001
        global _log_file
        f = _log_file
        if f is not None:
            try:
                f.write(text.decode("utf-8", "replace"))
                f.flush()
            except BlockingIOError:  # a pipe nobody drains: this line is dropped, the process goes on
                pass
            except ValueError:  # file closed
                pass
            except OSError as e:  # a full disk, a reader gone: one warning, and the log stops
                _log_file = None
                _status(f"warning: llama.cpp's log stopped: cannot write to {getattr(f, 'shown', 'it')} "
                        f"({e.strerror or e})")

    _log_cb = cb
    llama_cpp.llama_log_set(_log_cb, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    _backend_ready = True


@contextlib.contextmanager
def llama_log_to(path: Optional[Path]) -> Iterator[None]:
    """Send llama.cpp's own log to `path` (appending) instead of the terminal while the block runs."""
    global _log_file
    init_backend()
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


def log_target_problem(path: Path) -> Optional[str]:
    """Why llama.cpp's log may not go to `path`, or None: never into a family folder (a folder with a manifest)
    nor onto a model file (a GGUF), which appending would destroy."""
    from specquant_cli.names import MANIFEST, RESERVED

    p = Path(os.path.abspath(path))
    real = Path(os.path.realpath(p))
    for candidate in dict.fromkeys([p, real]):
        if candidate.name in RESERVED or candidate.suffix.lower() in (".gguf", ".part"):
            return f"{candidate.name} is a family's file"
        if (candidate.parent / MANIFEST).exists():
            return f"{candidate.parent} is a family folder"
    try:
        with open(real, "rb", opener=lambda f, flags: os.open(f, flags | os.O_NONBLOCK)) as f:
            if real.is_file() and f.read(4) == b"GGUF":
                return f"{real} is a model file"
    except OSError:
        pass
    return None


def set_log_file(path: Path, label: str) -> None:
    """Send llama.cpp's log to `path` (appending) for the rest of the process (the runtime.llama_log setting,
    applied at the command edge; `label` names where it was set, for the error); otherwise it is dropped. Never
    into a family folder or onto a model file; a FIFO without a reader is refused at once, and one whose reader
    stops reading loses lines rather than blocking llama.cpp."""
    global _log_file
    why = log_target_problem(path)
    if why is not None:
        raise InputError(f"{label}: not a place for llama.cpp's log ({why}); name a file elsewhere")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        why = "a pipe nobody reads" if e.errno == errno.ENXIO else e.strerror
        raise InputError(f"{label}: cannot write llama.cpp's log there ({why})") from None
    import stat

    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.set_blocking(fd, True)
    init_backend()
    f = os.fdopen(fd, "a", encoding="utf-8")
    f.shown = os.fspath(path)  # for the warning, whatever the file object calls itself
    with _log_lock:
        previous, _log_file = _log_file, f
    if previous is not None:
        previous.close()


def check_threads(n: int, label: str) -> int:
    """`n` if it is a thread count for this machine (settings.check_threads), else InputError naming `label`."""
    from specquant_cli.settings import SettingError
    from specquant_cli.settings import check_threads as check

    try:
        return check(n)
    except SettingError as e:
        raise InputError(f"{label}: {e}") from None


def _status(line: str) -> None:
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


GPU_DEVICE_TYPES = (1, 2)  # ggml_backend_dev_type: GGML_BACKEND_DEVICE_TYPE_GPU, _IGPU


def backend_devices() -> list[tuple[str, int]]:
    """(name, ggml_backend_dev_type) of every device this llama.cpp build registered (ggml's registry)."""
    from llama_cpp import llama_cpp as lib_mod

    init_backend()
    lib = lib_mod._lib  # libllama; the ggml symbols resolve through its dependencies
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes, lib.ggml_backend_dev_get.restype = [ctypes.c_size_t], ctypes.c_void_p
    lib.ggml_backend_dev_type.argtypes, lib.ggml_backend_dev_type.restype = [ctypes.c_void_p], ctypes.c_int
    lib.ggml_backend_dev_name.argtypes, lib.ggml_backend_dev_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    devs = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
    return [((lib.ggml_backend_dev_name(d) or b"?").decode("utf-8", "replace"), lib.ggml_backend_dev_type(d))
            for d in devs]


def gpu_offload_supported() -> bool:
    """A GPU backend is built in. (llama_supports_gpu_offload is also true for an RPC-only build, whose
    "devices" are remote workers, not a local GPU.)"""
    return any(kind in GPU_DEVICE_TYPES for _, kind in backend_devices())


class Model:
    """Weights and vocabulary of one GGUF file."""

    def __init__(self, path: Path | str, n_gpu_layers: int = 0, vocab_only: bool = False,
                 devices: Optional[list[int]] = None, tensor_split: Optional[list[float]] = None, mmap: bool = False):
        """`devices` (ggml device pointers, e.g. RPC workers') replace the default offload devices, with
        `tensor_split` their shares of the layers. `mmap`: map the file instead of reading it (runtime.mmap)."""
        import llama_cpp

        init_backend()
        self.path = Path(path)
        self.on_host = n_gpu_layers == 0 and devices is None  # every layer on this CPU (see Context's attention)
        if not self.path.is_file():
            raise InputError(f"{self.path}: no such model file")
        if not vocab_only:  # a build that faults on this CPU is met by the self-test's child, not here
            from specquant_cli.backend import selftest

            selftest.ensure(status=_status)
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        if devices is not None:
            self._devs = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)  # NULL-terminated; kept alive
            params.devices = ctypes.cast(self._devs, ctypes.c_void_p)
            split = (tensor_split or [])[:llama_cpp.LLAMA_MAX_DEVICES]
            self._split = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*split)
            params.tensor_split = self._split
        # Weights are read into process memory instead of mapped from the page cache: a mapped model's pages
        # can be reclaimed under memory management (measured: a 43-token prefill taking 4.2 s instead of
        # 0.35 s, one answer 17x slower), which makes both latency and every measurement erratic.
        # The runtime.mmap setting maps them (faster start, shared between processes).
        if not vocab_only and not mmap:
            params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
        self._ptr = llama_cpp.llama_model_load_from_file(os.fsencode(self.path), params)
        if not self._ptr:
            raise LlamaError(f"llama.cpp could not load {self.path}")
        # Frees what depends on the model (its contexts) before the model itself, as _internals does.
        self._stack = contextlib.ExitStack()
        self.vocab = llama_cpp.llama_model_get_vocab(self._ptr)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self._ptr)
        is_eog = llama_cpp.llama_vocab_is_eog
        self._eog_ids = frozenset(t for t in range(self.n_vocab) if is_eog(self.vocab, t))

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

        buf = ctypes.create_string_buffer(PIECE_BUF_BYTES)  # per call: requests decoding together share the model
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, PIECE_BUF_BYTES, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def meta(self, key: str) -> Optional[str]:
        import llama_cpp

        buf = ctypes.create_string_buffer(META_BUF_BYTES)
        n = llama_cpp.llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    # -- chat -----------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict], tools: Optional[list[dict]] = None) -> list[int]:
        """Token ids of `messages` rendered with the GGUF's own chat template, ready for generation. Special
        tokens come only from the template's own markup: what a message says is tokenized as text, so a user who
        writes `<|im_end|><|im_start|>system` gets those characters, not a forged turn. (A prompt none of whose
        messages spells a special token is tokenized whole, as the template renders it.)

        `tools` (OpenAI's function tools) and messages with tool calls or tool results go through the template when
        it renders them (Qwen2.5's); a template that does not gets them as plain turns (toolcalls.render_messages)."""
        from specquant_cli import toolcalls

        fmt = self._chat_formatter()
        if not toolcalls.template_knows_tools(fmt.template if fmt is not None else None):
            messages, tools = toolcalls.render_messages(messages, tools), None
        extra = {"tools": tools} if tools else {}
        contents = [m["content"] for m in messages if isinstance(m.get("content"), str)]
        spelled = [c for c in contents if self.spells_special(c)]
        if fmt is None:
            pieces = [p for m in messages for p in ((f"{m['role']}: ", True), (m["content"], False), ("\n", True))]
            pieces.append(("assistant:", True))
            if not spelled:
                return self.tokenize("".join(t for t, _ in pieces), add_bos=self.add_bos())
            return self._tokenize_parts(pieces, self.add_bos())
        if not spelled:
            text = fmt(messages=messages, **extra).prompt
            return self.tokenize(text, add_bos=self._add_bos_to(fmt, text), special=True)
        nonce = secrets.token_hex(8)
        opens, closes = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"
        marked = [{**m, "content": f"{opens}{m['content']}{closes}"} if isinstance(m.get("content"), str) else m
                  for m in messages]
        parts = _split_marked(fmt(messages=marked, **extra).prompt, opens, closes)
        if parts is None or len([p for p in parts if not p[1]]) != len(contents):
            from specquant_cli.errors import InputError

            plain = set(self.tokenize(spelled[0], add_bos=False, special=False))
            token = next((t for t in self.tokenize(spelled[0], add_bos=False, special=True) if t not in plain), None)
            shown = f"the special token {self.token_text(token)!r}" if token is not None else "a special token"
            raise InputError(f"a message spells {shown}, which this chat template cannot keep as text")
        return self._tokenize_parts(parts, self._add_bos_to(fmt, parts[0][0] if parts[0][1] else ""))

    def spells_special(self, text: str) -> bool:
        """Whether `text` tokenizes differently with special tokens parsed (it spells one, e.g. `<|im_end|>`)."""
        return self.tokenize(text, add_bos=False, special=True) != self.tokenize(text, add_bos=False, special=False)

    def _add_bos_to(self, fmt, text: str) -> bool:
        """Whether BOS goes before a rendered prompt starting with `text` (not when the template wrote it)."""
        bos_text = fmt.bos_token
        return self.add_bos() and not (bos_text and text.startswith(bos_text))

    def _tokenize_parts(self, parts: list[tuple[str, bool]], add_bos: bool) -> list[int]:
        """Concatenated token ids of (text, is_markup) parts: markup with special tokens parsed, content as text."""
        out: list[int] = self.tokenize("", add_bos=True) if add_bos else []
        for text, markup in parts:
            if text:
                out += self.tokenize(text, add_bos=False, special=markup)
        return out

    def _chat_formatter(self):
        """llama-cpp-python's Jinja formatter over the GGUF's template, compiled once per model."""
        if not hasattr(self, "_fmt"):
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            template = self.meta("tokenizer.chat_template")
            self._fmt = Jinja2ChatFormatter(template=template, eos_token=self.token_text(self.eos()),
                                            bos_token=self.token_text(self.bos())) if template else None
        return self._fmt

    def close(self) -> None:
        """Free the model's contexts, then the model. Idempotent."""
        import llama_cpp

        if getattr(self, "_ptr", None):
            self._stack.close()
            llama_cpp.llama_model_free(self._ptr)
            self._ptr = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _split_marked(text: str, opens: str, closes: str) -> Optional[list[tuple[str, bool]]]:
    """`text` as (part, is_markup) parts, a message content being what stands between `opens` and `closes`;
    None when the marks do not pair up (the template moved or cut a content)."""
    parts: list[tuple[str, bool]] = []
    rest = text
    while True:
        i = rest.find(opens)
        if i < 0:
            if closes in rest:
                return None
            parts.append((rest, True))
            return parts
        j = rest.find(closes, i + len(opens))
        if j < 0 or closes in rest[:i] or opens in rest[i + len(opens):j]:
            return None
        parts += [(rest[:i], True), (rest[i + len(opens):j], False)]
        rest = rest[j + len(closes):]


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
                 n_seq_max: int = 1, eval_callback=None, kv_unified: bool = False):
        """eval_callback: a `ggml_backend_sched_eval_callback` (llama.cpp's `cb_eval`), called for graph nodes
        as they are computed (family.imatrix collects activation statistics through it); kept alive here."""
        import llama_cpp

        self.model = model
        threads = check_threads(n_threads, "threads") if n_threads else cores()
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        params.kv_unified = kv_unified
        params.n_threads = threads
        params.n_threads_batch = threads
        params.no_perf = True
        # Attention without llama.cpp's fused (flash) kernel on a model held on this CPU: there a call on many tokens
        # deep in a context costs less through the plain matrix products (measured on the 1.5B BF16 parent, AMD EPYC,
        # 2 threads, after 2,048 positions: 32 tokens 551 ms against 756, 16 tokens 310 against 430; one token and
        # the prefill level), and a verification is such a call. Every context of a family is made alike, so a
        # draft can still take the parent's cache. Offloaded models keep llama.cpp's choice.
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED if getattr(model, "on_host", True)
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO)
        self._eval_callback = eval_callback
        if eval_callback is not None:
            params.cb_eval = eval_callback
            params.cb_eval_user_data = None
        self._ptr = llama_cpp.llama_init_from_model(model._ptr, params)
        if not self._ptr:
            raise LlamaError(f"llama.cpp could not create a context of {n_ctx} for {model.path.name}")
        self.n_ctx = llama_cpp.llama_n_ctx(self._ptr)
        self.n_batch = n_batch
        self._mem = llama_cpp.llama_get_memory(self._ptr)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, n_seq_max)
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
        b.n_tokens = n
        rc = llama_cpp.llama_decode(self._ptr, b)
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
