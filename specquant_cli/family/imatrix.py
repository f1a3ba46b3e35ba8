"""Activation statistics (an importance matrix) collected through llama.cpp's evaluation callback.

llama.cpp's scheduler calls a context's `cb_eval` for every graph node: first with ask=True ("do you want
this node's result?"), then, for the nodes answered yes, with ask=False once the node is computed. As
llama.cpp's own tools/imatrix/imatrix.cpp does, the collector wants every GGML_OP_MUL_MAT whose weight
(src[0]) is a model tensor (`blk.*`, and the output projection: `output.weight`, or `token_embd.weight` in
models that tie it) and whose input (src[1]) is an F32 batch of at least 16 rows; it adds the squares of
the input activations per input channel under the weight's name. The mean square per channel is the
importance llama_model_quantize weighs each column's rounding error by (`imatrix` in its parameters).

The statistics are stored beside the family in llama.cpp's imatrix GGUF format (`<name>.in_sum2` and
`<name>.counts` F32 tensors, `general.type = imatrix`), so `llama-quantize --imatrix` reads them too, with
the calibration set's sha256 in the file and in the manifest. Collecting them over a family's
calibration set is family.activations."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from specquant_cli import interrupts
from specquant_cli.errors import FamilyError, InputError, LlamaError
from specquant_cli.fsutil import check_input_file

IMATRIX_FILE = "imatrix.gguf"
MIN_ROWS = 16  # imatrix.cpp ignores smaller batches (single-token decodes say little about a channel)
OUTPUT_NAMES = ("output.weight", "token_embd.weight")  # the output projection (token_embd when tied)
ProgressFn = Callable[[int, int], None]  # (tokens done, tokens in all)


class GGMLTensor(ctypes.Structure):
    """`struct ggml_tensor` (ggml/include/ggml.h of the llama.cpp that llama-cpp-python 0.3.36 vendors:
    GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10, GGML_MAX_NAME 64). `_lib` checks its size
    against the library's own before any field is read."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


GGML_OBJECT_SIZE = 32  # struct ggml_object: offs, size, next, type + 4 bytes of padding
GGML_TYPE_F32 = 0


@dataclass
class _Lib:
    handle: ctypes.CDLL
    op_mul_mat: int


_LIB: Optional[_Lib] = None


def _lib() -> _Lib:
    """libggml's functions the collector needs, typed; fails loudly on a struct layout it does not know."""
    global _LIB
    if _LIB is not None:
        return _LIB
    from llama_cpp import _ggml

    lib = _ggml.libggml
    lib.ggml_tensor_overhead.restype = ctypes.c_size_t
    lib.ggml_op_name.restype = ctypes.c_char_p
    lib.ggml_op_name.argtypes = [ctypes.c_int]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_buffer_is_host.restype = ctypes.c_bool
    lib.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    want = lib.ggml_tensor_overhead() - GGML_OBJECT_SIZE
    if ctypes.sizeof(GGMLTensor) != want:
        raise LlamaError(f"this libggml's struct ggml_tensor is {want} bytes, specquant knows a "
                         f"{ctypes.sizeof(GGMLTensor)}-byte layout; activation statistics need llama-cpp-python 0.3.36")
    op = next((i for i in range(256) if lib.ggml_op_name(i) == b"MUL_MAT"), None)
    if op is None:
        raise LlamaError("libggml names no MUL_MAT operation")
    _LIB = _Lib(lib, op)
    return _LIB


def weight_name(raw: bytes) -> str:
    """imatrix.cpp's filter_tensor_name: a name of the form `prefix#name#suffix` stands for `name`."""
    name = raw.decode("utf-8", "replace")
    if "#" in name:
        name = name.split("#")[1]
    return name


@dataclass
class ActivationStats:
    """Per weight: sums of squared input activations per channel (n_mat x n_in, float64) and the number of
    activation rows added (one count per matrix). `mean()` is what the quantizer takes."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    chunks: int = 0
    chunk_size: int = 0
    tokens: int = 0

    def add(self, name: str, x: np.ndarray, n_mat: int, mat_of: Callable[[int, int], int]) -> None:
        """x: the activations as (ne3, ne2, ne1, ne0) float32; mat_of(i3, i2) -> the weight matrix they meet."""
        n_in = x.shape[-1]
        s = self.sums.get(name)
        if s is None:
            s = self.sums[name] = np.zeros((n_mat, n_in), np.float64)
            self.counts[name] = np.zeros(n_mat, np.float64)
        elif s.shape != (n_mat, n_in):
            raise LlamaError(f"{name}: inconsistent activation shape {(n_mat, n_in)} after {s.shape}")
        if n_mat == 1:
            s[0] += np.square(x, dtype=np.float64).sum(axis=(0, 1, 2))
            self.counts[name][0] += x.shape[0] * x.shape[1] * x.shape[2]
        else:
            for i3 in range(x.shape[0]):
                for i2 in range(x.shape[1]):
                    m = mat_of(i3, i2)
                    s[m] += np.square(x[i3, i2], dtype=np.float64).sum(axis=0)
                    self.counts[name][m] += x.shape[2]
        if not np.isfinite(s).all():
            raise LlamaError(f"non-finite activations entering {name}")

    def mean(self, names: Optional[set[str]] = None) -> dict[str, np.ndarray]:
        """Mean squared activation per channel, flattened over matrices, as llama-quantize computes it from
        the GGUF (in_sum2 / counts; a matrix that never saw input gets ones)."""
        out = {}
        for name, s in self.sums.items():
            if names is not None and name not in names:
                continue
            c = self.counts[name][:, None]
            out[name] = np.where(c > 0, s / np.maximum(c, 1), 1.0).astype(np.float32).reshape(-1)
        return out

    def save(self, path: Path, meta: dict[str, str]) -> None:
        """llama.cpp's imatrix GGUF (tools/imatrix/imatrix.cpp save_imatrix), plus `specquant.*` keys."""
        import gguf

        w = gguf.GGUFWriter(os.fspath(path), arch="")
        w.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)  # imatrix.cpp writes none
        w.add_type(gguf.GGUFType.IMATRIX)
        w.add_array(gguf.Keys.IMatrix.DATASETS, [meta.get("source", "calibration")])
        w.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, self.chunks)
        w.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, self.chunk_size)
        for k, v in meta.items():
            w.add_string(f"specquant.{k}", str(v))
        for name in sorted(self.sums):
            w.add_tensor(f"{name}.in_sum2", self.sums[name].astype(np.float32))
            w.add_tensor(f"{name}.counts", self.counts[name].astype(np.float32)[:, None])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    @classmethod
    def load(cls, path: Path) -> ActivationStats:
        import gguf

        try:
            r = gguf.GGUFReader(os.fspath(path), "r")
        except Exception as e:
            raise FamilyError(f"{path}: not a readable imatrix GGUF ({type(e).__name__}: {e})") from None
        st = cls()
        tensors = {t.name: t for t in r.tensors}
        for tname, t in tensors.items():
            if not tname.endswith(".in_sum2"):
                continue
            name = tname.removesuffix(".in_sum2")
            c = tensors.get(f"{name}.counts")
            if c is None:
                raise FamilyError(f"{path}: {name} has sums but no counts")
            try:
                sums = np.asarray(t.data, np.float64).reshape(int(t.shape[1]) if len(t.shape) > 1 else 1, -1)
                counts = np.asarray(c.data, np.float64).reshape(-1)
            except (ValueError, TypeError, IndexError) as e:
                raise FamilyError(f"{path}: {name}: malformed importance data ({e})") from None
            if counts.size != sums.shape[0]:
                raise FamilyError(f"{path}: {name}: {counts.size} counts for {sums.shape[0]} matrices")
            if not (np.isfinite(sums).all() and np.isfinite(counts).all()) or (sums < 0).any() or (counts < 0).any():
                raise FamilyError(f"{path}: {name}: negative or non-finite importance data")
            st.sums[name], st.counts[name] = sums, counts
        if not st.sums:
            raise FamilyError(f"{path}: no importance data in it (no *.in_sum2 tensors)")
        for key, attr in ((gguf.Keys.IMatrix.CHUNK_COUNT, "chunks"), (gguf.Keys.IMatrix.CHUNK_SIZE, "chunk_size")):
            f = r.fields.get(key)
            if f is not None:
                try:
                    setattr(st, attr, int(f.contents()))
                except (ValueError, TypeError) as e:
                    raise FamilyError(f"{path}: {key} is not a count ({e})") from None
        return st


class Collector:
    """The `cb_eval` callback. Never raises into C: an error is kept, the graph computation is cancelled
    (returning False when ask=False), and `check()` raises it after llama_decode returns.

    Ctrl-C and SIGTERM: a Python exception raised while the callback runs (where a signal handler runs
    during a decode) would be swallowed by ctypes ("Exception ignored on calling ctypes callback"), so
    during a decode the handlers only take note (`interruptible`); the callback then cancels the graph
    at its next node, and the interrupt is delivered to the usual handler once llama_decode returns."""

    def __init__(self, with_output: bool = True, min_rows: int = MIN_ROWS):
        import llama_cpp

        self.stats = ActivationStats()
        self.with_output = with_output
        self.min_rows = min_rows
        self.error: Optional[BaseException] = None
        self.stop = False  # an interrupt arrived during the decode: cancel the graph
        self._lib = _lib()
        self._buf = bytearray()
        self.callback = llama_cpp.llama_cpp.ggml_backend_sched_eval_callback(self._cb)

    def _wanted(self, name: str) -> bool:
        return name.startswith("blk.") or (self.with_output and name in OUTPUT_NAMES)

    def _cb(self, t_ptr: int, ask: bool, _user: int) -> bool:
        if self.stop:  # want the next node, then refuse it once computed: the scheduler stops there
            return bool(ask)
        if self.error is not None:
            return False
        try:
            t = GGMLTensor.from_address(t_ptr)
            if t.op != self._lib.op_mul_mat or not t.src[0] or not t.src[1]:
                return not ask
            src0, src1 = GGMLTensor.from_address(t.src[0]), GGMLTensor.from_address(t.src[1])
            if ask:
                return (src1.type == GGML_TYPE_F32 and src1.ne[1] >= self.min_rows
                        and self._wanted(weight_name(src0.name)))
            self._take(src0, src1, t.src[1])
            return True
        except BaseException as e:  # KeyboardInterrupt included: check() re-raises it
            self.error = e
            return False

    def _take(self, src0: GGMLTensor, src1: GGMLTensor, src1_ptr: int) -> None:
        lib = self._lib.handle
        nbytes = lib.ggml_nbytes(src1_ptr)
        if src1.nb[0] != 4:
            raise LlamaError(f"activations entering {weight_name(src0.name)} are not contiguous F32 rows")
        if lib.ggml_backend_buffer_is_host(src1.buffer):
            raw = (ctypes.c_char * nbytes).from_address(src1.data)
        else:  # computed on a GPU: copy it to host memory first
            if len(self._buf) < nbytes:
                self._buf = bytearray(nbytes)
            raw = (ctypes.c_char * nbytes).from_buffer(self._buf)
            lib.ggml_backend_tensor_get(src1_ptr, raw, 0, nbytes)
        ne, nb = list(src1.ne), list(src1.nb)
        x = np.ndarray((ne[3], ne[2], ne[1], ne[0]), np.float32, raw, 0, (nb[3], nb[2], nb[1], nb[0]))
        ne02, ne03 = src0.ne[2], src0.ne[3]
        self.stats.add(weight_name(src0.name), x, int(ne02 * ne03),
                       lambda i3, i2: (i3 % ne03) * ne02 + (i2 % ne02))

    def check(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Around one llama_decode: Ctrl-C / SIGTERM set `stop` (the callback cancels the computation) and
        are delivered to their usual handlers right after the block (KeyboardInterrupt, exit 130)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        got: list[int] = []

        def note(signum, frame) -> None:  # noqa: ARG001
            got.append(signum)
            self.stop = True

        # a signal ignored here (SIGINT of a background job) stays ignored
        old = {s: h for s in interrupts.DEFERRED if (h := signal.getsignal(s)) is not signal.SIG_IGN}
        for s in old:
            signal.signal(s, note)
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
            if got:
                signal.raise_signal(got[0])  # the usual handler raises KeyboardInterrupt (or Terminated) here
                raise KeyboardInterrupt()  # a handler that returned: the cancelled chunk's statistics are partial


def check_imatrix(path: Path) -> ActivationStats:
    """Read an importance matrix up front (before any quantizer child starts, which would fail on it with a
    traceback in quantize.log): its statistics, or a FamilyError saying why it does not parse."""
    try:
        return ActivationStats.load(path)
    except FamilyError:
        raise
    except (OSError, ValueError, TypeError, IndexError, KeyError) as e:
        raise FamilyError(f"{path}: not a readable imatrix GGUF ({type(e).__name__}: {e})") from None


def check_option_imatrix(path: Path) -> Path:
    """An --imatrix file, read and checked; InputError naming the option and the reason otherwise."""
    check_input_file(path, "--imatrix", "GGUF file")  # "no such file", or what it is: a FIFO, a folder, …
    try:
        check_imatrix(path)
    except FamilyError as e:
        raise InputError(f"--imatrix {path}: {str(e).removeprefix(f'{path}: ')}") from None
    return path
