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
the calibration set's sha256 in the file and in the manifest.

Why one file of ~530 lines: the collector (a C callback over ggml tensors), the file format it writes and the
reader that checks a file before quantize uses it are one format, kept in one place."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Optional

import numpy as np

from specquant_cli import interrupts
from specquant_cli.errors import FamilyError, InputError, LlamaError, ResourceError, SpecquantError
from specquant_cli.family.roles import PARENT_ROLE
from specquant_cli.fsutil import check_input_file, read_input_file

IMATRIX_FILE = "imatrix.gguf"
CALIBRATION_SET = Path(__file__).with_name("calibration_set.jsonl")
MIN_ROWS = 16  # imatrix.cpp ignores smaller batches (single-token decodes say little about a channel)
DEFAULT_TOKENS = 4096
DEFAULT_CHUNK = 512
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


# -- calibration text -----------------------------------------------------------------------------------
@dataclass
class Calibration:
    source: str  # "builtin:calibration_set.jsonl" or the file given
    sha256: str  # of the file's bytes
    tokens: list[int]


def _items(path: Path) -> Iterator[dict]:
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            item = json.loads(line)
            if item.get("kind") not in ("chat", "text"):
                raise InputError(f"{path}:{i}: kind must be chat or text")
            yield item


def calibration_tokens(model, path: Optional[Path] = None) -> Calibration:
    """Tokens of the calibration set. The built-in set mixes chat (rendered with the model's own chat template,
    answer included, as the drafts will see it), code and prose; `path` is a UTF-8 text file used as is."""
    if path is None:
        data = CALIBRATION_SET.read_bytes()
        tokens: list[int] = []
        for item in _items(CALIBRATION_SET):
            if item["kind"] == "chat":
                msgs = item["messages"]
                tokens += model.chat_prompt(msgs[:-1]) + model.tokenize(msgs[-1]["content"], add_bos=False)
                tokens.append(model.eos())
            else:
                tokens += model.tokenize(item["text"], add_bos=False)
        return Calibration(f"builtin:{CALIBRATION_SET.name}", hashlib.sha256(data).hexdigest(), tokens)
    path = Path(path)
    data = read_input_file(path, "--calibration", "text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"--calibration {path}: not UTF-8 (invalid byte at offset {e.start})") from None
    if not text.strip():
        raise InputError(f"--calibration {path}: empty")
    return Calibration(os.fspath(path), hashlib.sha256(data).hexdigest(), model.tokenize(text, add_bos=False))


def chunks_of(tokens: list[int], chunk: int, max_tokens: int, bos: Optional[int]) -> list[list[int]]:
    """Cut `tokens` (at most `max_tokens` of them) into chunks of `chunk` tokens, each opened by BOS when the
    model adds one (as imatrix.cpp starts each chunk); a tail shorter than MIN_ROWS is dropped."""
    body = chunk - (1 if bos is not None else 0)
    tokens = tokens[:max_tokens]
    out = []
    for i in range(0, len(tokens), body):
        part = tokens[i:i + body]
        if len(part) >= MIN_ROWS:
            out.append(([bos] if bos is not None else []) + part)
    return out


def collect(model, chunks: list[list[int]], threads: Optional[int] = None, with_output: bool = True,
            progress: Optional[ProgressFn] = None) -> ActivationStats:
    """Run `model` over each chunk (a fresh cache each, logits at every position so that the last layer and
    the output projection see every row, as imatrix.cpp does) and collect the statistics."""
    from specquant_cli.backend.llama import Context

    if not chunks:
        raise InputError(f"the calibration text gives no chunk of {MIN_ROWS} tokens or more")
    size = max(len(c) for c in chunks)
    col = Collector(with_output=with_output)
    ctx = Context(model, n_ctx=size, n_batch=size, n_threads=threads, eval_callback=col.callback)
    total, done = sum(len(c) for c in chunks), 0
    try:
        for c in chunks:
            if interrupts.terminated():  # SIGTERM that an earlier step took note of: stop before the next chunk
                raise interrupts.Terminated()
            ctx.rewind(0)
            with col.interruptible():  # an interrupt during the decode cancels it and is raised on leaving
                try:
                    ctx.decode(c, logits="all")
                except LlamaError:
                    col.check()  # the callback's own error, when it cancelled the computation
                    raise
            col.check()
            done += len(c)
            if progress:
                progress(done, total)
    finally:
        ctx.close()
    col.stats.chunks, col.stats.chunk_size, col.stats.tokens = len(chunks), size, total
    return col.stats


# -- beside the family ------------------------------------------------------------------------------------
def calibrate_family(family, calibration: Optional[Path] = None, max_tokens: int = DEFAULT_TOKENS,
                     chunk: int = DEFAULT_CHUNK, threads: Optional[int] = None,
                     progress: Optional[ProgressFn] = None) -> dict:
    """Collect the F16's activation statistics over the calibration set, store them as `imatrix.gguf` in the
    family folder and record them in the manifest (`imatrix`). Returns that record."""
    from specquant_cli.backend.llama import Model, llama_log_to
    from specquant_cli.family import manifest as fam
    from specquant_cli.family.quantize import start_log
    from specquant_cli.fsutil import check_folder_writable, create_temp, fsync_file, sha256_file

    if max_tokens < MIN_ROWS:
        raise InputError(f"--tokens {max_tokens}: at least {MIN_ROWS}")
    if not MIN_ROWS * 2 <= chunk <= 8192:
        raise InputError(f"--chunk {chunk}: between {MIN_ROWS * 2} and 8192")
    root = Path(family.root)
    base = family.path(PARENT_ROLE)
    # the folder must take the result: checked before minutes of work, not found out at the end
    check_folder_writable(root, "family folder")
    need, free = _imatrix_bytes(family) + (4 << 20), shutil.disk_usage(root).free
    if free < need:
        raise ResourceError(f"not enough disk in {root}: the importance matrix needs ~{need / 2**20:.0f} MiB, "
                            f"{free / 2**20:.1f} MiB free")
    log = start_log(root)  # quantize.log holds this run only (a link there refused)
    with llama_log_to(log):
        model = Model(base)
        try:
            cal = calibration_tokens(model, calibration)
            bos = model.bos() if model.add_bos() else None
            chunks = chunks_of(cal.tokens, chunk, max_tokens, bos)
            stats = collect(model, chunks, threads, progress=progress)
        finally:
            model.close()
    base_sha = family.manifest.get("base", {}).get("sha256") or family.variant(PARENT_ROLE).get("sha256")
    meta = {"source": cal.source, "calibration_sha256": cal.sha256, "tokens": stats.tokens,
            "base_sha256": base_sha or ""}
    dst = root / IMATRIX_FILE
    try:
        fd, tmp = create_temp(dst)
        os.close(fd)
    except OSError as e:
        raise _write_error(root, dst, e) from None
    try:
        try:
            stats.save(tmp, meta)
            fsync_file(tmp)
        except OSError as e:
            raise _write_error(root, dst, e) from None
        record = {
            "file": IMATRIX_FILE, "sha256": sha256_file(tmp), "size_bytes": tmp.stat().st_size,
            "entries": len(stats.sums), "tokens": stats.tokens, "chunks": stats.chunks, "chunk_size": stats.chunk_size,
            "calibration": {"source": cal.source, "sha256": cal.sha256, "tokens_available": len(cal.tokens)},
            "base_sha256": base_sha,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        manifest, why = fam.read_existing(root)  # re-read: the latest manifest, not the one loaded earlier
        if manifest is None:
            raise FamilyError(f"{root}: the manifest went away while calibrating ({why or 'missing'})")
        manifest["imatrix"] = record
        try:
            fam.commit(root, [(tmp, dst)], manifest)
        except OSError as e:
            raise _write_error(root, dst, e) from None
    finally:
        tmp.unlink(missing_ok=True)
    return record


def _imatrix_bytes(family) -> int:
    """A generous estimate of imatrix.gguf's size: per block, the input widths of its weight matrices
    (4 bytes a channel, for the sums; the counts are one per matrix)."""
    hp = family.manifest.get("hparams") if isinstance(family.manifest.get("hparams"), dict) else {}
    emb, blocks = hp.get("embedding_length"), hp.get("block_count")
    if not (isinstance(emb, int) and isinstance(blocks, int) and emb > 0 and blocks > 0):
        return 16 << 20
    return 4 * (blocks * 16 * emb + 2 * emb)


def _write_error(root: Path, dst: Path, e: OSError) -> SpecquantError:
    """A failed write in the family folder (a full disk, a folder made read-only meanwhile) as one line."""
    why = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceError(f"cannot write {dst}: {why} (the family folder {root})")
    return FamilyError(f"cannot write {dst} ({why})")


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


def family_imatrix(family, path: Optional[Path] = None) -> tuple[Path, dict]:
    """The imatrix file to quantize `family` with and its record: `path` when given, else the family's own
    (which must have been collected from this family's current base). Either is read and checked here."""
    if path is not None:
        path = check_option_imatrix(Path(path))
        return path, {"file": os.fspath(path), "sha256": None}
    rec = family.manifest.get("imatrix")
    own = Path(family.root) / IMATRIX_FILE
    if not isinstance(rec, dict) or not own.is_file():
        raise FamilyError(f"family {family.name} has no activation statistics yet; collect them with: "
                          f"specquant calibrate-activations --family {family.root}")
    base_sha = family.manifest.get("base", {}).get("sha256")
    if base_sha and rec.get("base_sha256") and rec["base_sha256"] != base_sha:
        raise FamilyError(f"{own} was collected from another base; run specquant calibrate-activations again")
    try:
        check_imatrix(own)
    except FamilyError as e:
        raise FamilyError(f"{e}; run specquant calibrate-activations again") from None
    return own, rec
