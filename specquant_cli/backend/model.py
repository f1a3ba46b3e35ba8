"""One GGUF file's weights and vocabulary (`Model`: tokenize, detokenize, the chat template), text made from tokens
as they come (`Detokenizer`), and the check that two models share a vocabulary (`check_same_vocab`)."""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import os
import secrets
from pathlib import Path
from typing import Optional

from specquant_cli.backend.log import init_backend, status_line
from specquant_cli.errors import InputError, LlamaError, VocabMismatchError

PIECE_BUF_BYTES = 256  # one token's text; longer pieces get a buffer of their own
META_BUF_BYTES = 1 << 16  # a metadata value (chat templates run to a few KiB)


class Model:
    """Weights and vocabulary of one GGUF file."""

    def __init__(self, path: Path | str, n_gpu_layers: int = 0, vocab_only: bool = False,
                 devices: Optional[list[int]] = None, tensor_split: Optional[list[float]] = None, mmap: bool = False):
        """`devices` (ggml device pointers, e.g. RPC workers') replace the default offload devices, with
        `tensor_split` their shares of the layers. `mmap`: map the file instead of reading it (runtime.mmap)."""
        import llama_cpp

        init_backend()
        self.path = Path(path)
        # whether its layers stay on CPUs (this one, or RPC workers' in `devices`) rather than a local GPU: Context's
        # attention is chosen by it, and a parent through RPC workers computes as it does here
        self.on_host = n_gpu_layers == 0 or devices is not None
        if not self.path.is_file():
            raise InputError(f"{self.path}: no such model file")
        if not vocab_only:  # a build that faults on this CPU is met by the self-test's child, not here
            from specquant_cli.backend import selftest

            selftest.ensure(status=status_line)
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
        self._backticks: Optional[dict[int, bytes]] = None

    # -- vocabulary ---------------------------------------------------------------------------
    @property
    def eog_ids(self) -> frozenset[int]:
        return self._eog_ids

    def is_eog(self, token: int) -> bool:
        return token in self._eog_ids

    @property
    def backtick_pieces(self) -> dict[int, bytes]:
        """The text of every token holding a backtick (what decoding.fences reads code fences from), found once."""
        if self._backticks is None:
            import llama_cpp

            text = llama_cpp.llama_vocab_get_text
            self._backticks = {t: self.piece(t) for t in range(self.n_vocab) if b"`" in (text(self.vocab, t) or b"")}
        return self._backticks

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
