"""Graded precision (GRINQH at tensor grain): a type per tensor that meets an average bits per weight.

Each weight matrix that the activation statistics cover is quantized, in memory, to every type of a
ladder with ggml's own quantizer (`ggml_quantize_chunk`, with the importance matrix, exactly as
llama_model_quantize will do it) and dequantized again; its error is the activation-weighted squared
error relative to the activation-weighted signal,

    e_t(type) = sum_ij imatrix[j] * (W_ij - Q(W)_ij)^2  /  sum_ij imatrix[j] * W_ij^2,

which is E||(W - Q(W)) x||^2 / E||W x||^2 for inputs x whose channels are uncorrelated with mean squares
imatrix[j]: the noise-to-signal ratio the quantized matrix adds to its output. Relative, so that q/k/v,
output and FFN matrices of different scales compare. Every tensor starts at the lowest type its row length
allows; then the upgrade with the largest error reduction per added bit is taken, over and over, while the
file stays within the requested average bits per weight (a greedy knapsack over per-tensor ladders).

The result is a list of `tt_overrides` (regex -> type) for llama_model_quantize: every quantizable tensor
gets an explicit type, so llama.cpp's own mixture rules do not move the budget."""

from __future__ import annotations

import ctypes
import heapq
import os
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from specquant_cli.errors import InputError, LlamaError
from specquant_cli.family.variants import LADDER
from specquant_cli.settings import cores

MAX_ROWS = 1024  # rows sampled per tensor for the error estimate (rows quantize independently)
# Token embeddings that are only looked up (models with a separate output.weight) meet no activations: a
# looked-up row is itself the layer-0 input, so its error counts every channel alike (weights of one), and
# it is quantized without an importance matrix, as llama_model_quantize will.
EMBEDDINGS = "token_embd.weight"
# Never quantized by llama_model_quantize (tensor_allows_quantization in src/llama-quant.cpp).
KEEP_SUBSTRINGS = ("_norm.weight", "ffn_gate_inp.weight", "altup", "laurel", "per_layer_model_proj", "ssm_conv1d",
                   "shortconv.conv.weight", "position_embd", "token_types")
ProgressFn = Callable[[int, int], None]


def type_id(name: str) -> int:
    import gguf

    try:
        return int(gguf.GGMLQuantizationType[name.upper()])
    except KeyError:
        raise InputError(f"unknown ggml type {name!r}") from None


def block_size(name: str) -> int:
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id(name))][0]


def type_bits(name: str) -> float:
    """Bits per weight of a ggml type (block bytes * 8 / block elements)."""
    import gguf

    blk, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id(name))]
    return size * 8 / blk


def fits(name: str, n_cols: int) -> bool:
    return n_cols % block_size(name) == 0


def parse_ladder(spec: str | Sequence[str]) -> tuple[str, ...]:
    names = [s.strip().lower() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if len(names) < 2:
        raise InputError("--ladder: give at least two types, e.g. q2_k,q3_k,q4_0,q5_0,q8_0")
    for n in names:
        type_id(n)
        if n in ("f32", "f16", "bf16"):
            raise InputError(f"--ladder: {n} is not a quantized type")
    return tuple(sorted(dict.fromkeys(names), key=type_bits))


# -- ggml's quantizer through ctypes ---------------------------------------------------------------------
class _TypeTraits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_lib_cache: dict = {}


def _ggml():
    if "lib" not in _lib_cache:
        from llama_cpp import _ggml as g

        lib = g.libggml
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.ggml_row_size.restype = ctypes.c_size_t
        lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
        lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        _lib_cache["lib"] = lib
    return _lib_cache["lib"]


def roundtrip(w: np.ndarray, qtype: str, imatrix: Optional[np.ndarray]) -> np.ndarray:
    """`w` (rows x cols, float32) quantized to `qtype` by ggml (weighted by `imatrix` where the type uses
    one) and dequantized again."""
    lib = _ggml()
    t = type_id(qtype)
    w = np.ascontiguousarray(w, np.float32)
    rows, cols = w.shape
    if imatrix is None and lib.ggml_quantize_requires_imatrix(t):
        raise InputError(f"{qtype} needs an importance matrix")
    qm = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
    if qm is not None and qm.size != cols:
        raise LlamaError(f"importance vector of {qm.size} for a row of {cols}")
    buf = np.empty(lib.ggml_row_size(t, cols) * rows, np.uint8)
    lib.ggml_quantize_chunk(t, w.ctypes.data, buf.ctypes.data, 0, rows, cols,
                            None if qm is None else qm.ctypes.data)
    out = np.empty_like(w)
    to_float = lib.ggml_get_type_traits(t).contents.to_float
    if not to_float:
        raise LlamaError(f"ggml has no dequantizer for {qtype}")
    _TO_FLOAT(to_float)(buf.ctypes.data, out.ctypes.data, w.size)
    return out


def weighted_error(w: np.ndarray, wq: np.ndarray, imatrix: np.ndarray) -> tuple[float, float]:
    """(sum imatrix[j] * (w - wq)^2, sum imatrix[j] * w^2) over all rows."""
    imp = imatrix.astype(np.float64)
    d = (w - wq).astype(np.float64)
    return float(np.square(d).sum(axis=0) @ imp), float(np.square(w, dtype=np.float64).sum(axis=0) @ imp)


# -- the plan ---------------------------------------------------------------------------------------------
@dataclass
class TensorCost:
    name: str
    n: int  # weights
    cols: int
    errors: dict[str, float]  # type -> relative activation-weighted error (allowed types only)
    abs_errors: dict[str, float] = field(default_factory=dict)

    @property
    def ladder(self) -> list[str]:
        return sorted(self.errors, key=type_bits)


@dataclass
class GradePlan:
    target_bpw: float
    bpw: float  # tensor data bits / all weights, as planned
    min_bpw: float
    max_bpw: float
    n_params: int
    types: dict[str, str]  # every quantizable tensor -> its type
    graded: list[TensorCost]
    fixed_bits: float

    def overrides(self) -> list[tuple[str, str]]:
        """(regex, type) pairs for tt_overrides: one per tensor kind and type, layers as an alternation."""
        groups: dict[tuple[str, str], list[str]] = defaultdict(list)
        for name, t in self.types.items():
            m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
            if m:
                groups[(m.group(2), t)].append(m.group(1))
            else:
                groups[(name, t)].append("")
        out = []
        for (rest, t), layers in sorted(groups.items()):
            if layers == [""]:
                out.append((f"^{re.escape(rest)}$", t))
            else:
                alt = "|".join(sorted(layers, key=int))
                out.append((rf"^blk\.({alt})\.{re.escape(rest)}$", t))
        return out

    def counts(self) -> dict[str, int]:
        c: dict[str, int] = defaultdict(int)
        for t in self.types.values():
            c[t] += 1
        return dict(sorted(c.items(), key=lambda kv: type_bits(kv[0])))

    def sensitive(self, k: int = 10) -> list[dict]:
        """The tensors with the largest error at their lowest allowed type: the ranking the plan starts from."""
        rank = sorted(self.graded, key=lambda c: -c.errors[c.ladder[0]])
        return [{"tensor": c.name, "error_at_" + c.ladder[0]: round(c.errors[c.ladder[0]], 6),
                 "type": self.types[c.name]} for c in rank[:k]]

    def to_dict(self) -> dict:
        return {
            "target_bpw": self.target_bpw, "planned_bpw": round(self.bpw, 4),
            "reachable_bpw": [round(self.min_bpw, 4), round(self.max_bpw, 4)],
            "type_counts": self.counts(), "most_sensitive": self.sensitive(),
            "tensors": {c.name: {"type": self.types[c.name], "n": c.n,
                                 "errors": {t: round(e, 8) for t, e in c.errors.items()}} for c in self.graded},
            "fixed": {n: t for n, t in self.types.items() if n not in {c.name for c in self.graded}},
            "overrides": self.overrides(),
        }


def quantizable(name: str, shape: Sequence[int]) -> bool:
    """llama_model_quantize's rule (2-D+ tensors named *weight, not norms and a few small kinds)."""
    dims = [int(x) for x in shape]
    n_dims = max((i + 1 for i, d in enumerate(dims) if d > 1), default=1)  # ggml_n_dims
    return name.endswith("weight") and n_dims >= 2 and not any(s in name for s in KEEP_SUBSTRINGS)


def gradable(t, importance: dict[str, np.ndarray], ladder: Sequence[str]) -> bool:
    """A 2-D quantizable tensor with activation statistics and at least one ladder type its rows fit."""
    return (quantizable(t.name, t.shape) and (t.name in importance or t.name == EMBEDDINGS)
            and int(np.prod(t.shape[2:])) == 1 and any(fits(q, int(t.shape[0])) for q in ladder))


def measure(base: Path, importance: dict[str, np.ndarray], ladder: Sequence[str], threads: int = 0,
            max_rows: int = MAX_ROWS, progress: Optional[ProgressFn] = None) -> tuple[list[TensorCost], list]:
    """Errors per type for every quantizable tensor with statistics; also returns the GGUF's tensors."""
    import gguf

    reader = gguf.GGUFReader(os.fspath(base), "r")
    todo = [t for t in reader.tensors if gradable(t, importance, ladder)]

    def one(t) -> TensorCost:
        cols, rows = int(t.shape[0]), int(t.shape[1])
        pick = np.unique(np.linspace(0, rows - 1, min(rows, max_rows)).astype(np.int64))
        data = np.asarray(t.data)
        if t.tensor_type in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32):
            w = data.reshape(rows, cols)[pick].astype(np.float32)
        elif t.tensor_type == gguf.GGMLQuantizationType.BF16:  # gguf hands BF16 over as raw bytes
            w = (data.view(np.uint16).reshape(rows, cols)[pick].astype(np.uint32) << 16).view(np.float32)
        else:
            raise InputError(f"{base}: {t.name} is {t.tensor_type.name}; grading needs a float base")
        imp = importance.get(t.name)
        qimp, imp = (None, np.ones(cols, np.float32)) if imp is None else (imp[:cols], imp[:cols])
        rel, ab = {}, {}
        for q in ladder:
            if not fits(q, cols) or (qimp is None and _ggml().ggml_quantize_requires_imatrix(type_id(q))):
                continue
            e, s = weighted_error(w, roundtrip(w, q, qimp), imp)
            rel[q], ab[q] = e / max(s, 1e-30), e * rows / len(pick)
        return TensorCost(t.name, rows * cols, cols, rel, ab)

    costs, done, total = [], 0, sum(int(t.n_bytes) for t in todo)
    with ThreadPoolExecutor(max_workers=threads or cores()) as ex:
        for t, c in zip(todo, ex.map(one, todo)):
            costs.append(c)
            done += int(t.n_bytes)
            if progress:
                progress(done, total)  # bytes of base weights analysed
    return costs, reader.tensors


def allocate(costs: list[TensorCost], budget_bits: float) -> dict[str, str]:
    """Greedy knapsack: lowest type everywhere, then the best error reduction per bit that still fits."""
    level = {c.name: c.ladder[0] for c in costs if c.ladder}
    used = sum(c.n * type_bits(level[c.name]) for c in costs if c.ladder)
    by_name = {c.name: c for c in costs}
    heap: list[tuple[float, str, str, str]] = []

    def push(c: TensorCost) -> None:
        cur = level[c.name]
        best = None
        for q in c.ladder:
            db = c.n * (type_bits(q) - type_bits(cur))
            if db <= 0 or used + db > budget_bits:
                continue
            gain = (c.errors[cur] - c.errors[q]) / db
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, q)
        if best:
            heapq.heappush(heap, (-best[0], c.name, cur, best[1]))

    for c in costs:
        if c.ladder:
            push(c)
    while heap:
        _, name, frm, to = heapq.heappop(heap)
        c = by_name[name]
        if level[name] != frm:
            continue
        db = c.n * (type_bits(to) - type_bits(frm))
        if used + db > budget_bits:
            push(c)  # a smaller step of this tensor may still fit
            continue
        level[name], used = to, used + db
        push(c)
    return level


def plan(base: Path, importance: dict[str, np.ndarray], target_bpw: float, base_type: str = "q4_0",
         ladder: Sequence[str] = LADDER, threads: int = 0, max_rows: int = MAX_ROWS,
         progress: Optional[ProgressFn] = None) -> GradePlan:
    """Types for every quantizable tensor of `base` so that its tensor data averages `target_bpw` bits per
    weight (or just under), the graded ones chosen by activation-weighted error, the rest at `base_type`."""
    import gguf

    ladder = parse_ladder(ladder)
    tensors = gguf.GGUFReader(os.fspath(base), "r").tensors
    n_params = sum(int(t.n_elements) for t in tensors)
    fixed_bits, types, lo, hi = 0.0, {}, 0.0, 0.0
    for t in tensors:
        if gradable(t, importance, ladder):
            allowed = [q for q in ladder if fits(q, int(t.shape[0]))]
            lo += int(t.n_elements) * type_bits(allowed[0])
            hi += int(t.n_elements) * type_bits(allowed[-1])
        elif quantizable(t.name, t.shape):
            q = base_type if fits(base_type, int(t.shape[0])) else "f16"
            types[t.name] = q
            fixed_bits += int(t.n_elements) * type_bits(q)
        else:
            fixed_bits += int(t.n_bytes) * 8
    min_bpw, max_bpw = (fixed_bits + lo) / n_params, (fixed_bits + hi) / n_params
    if not min_bpw <= target_bpw:  # before the (long) measurement
        raise InputError(f"--grade {target_bpw:g}: below what this ladder reaches on this model "
                         f"({min_bpw:.2f}..{max_bpw:.2f} bits per weight; the lower types need row lengths divisible "
                         "by 256, and tensors without activation statistics stay at the base type)")
    costs, _ = measure(base, importance, ladder, threads, max_rows, progress)
    level = allocate([c for c in costs if c.ladder], target_bpw * n_params - fixed_bits)
    types.update(level)
    used = fixed_bits + sum(c.n * type_bits(level[c.name]) for c in costs if c.ladder)
    return GradePlan(target_bpw, used / n_params, min_bpw, max_bpw, n_params, types,
                     [c for c in costs if c.ladder], fixed_bits)


def tensor_bpw(path: Path) -> float:
    """Bits per weight of a GGUF's tensor data (all tensors, metadata excluded)."""
    import gguf

    r = gguf.GGUFReader(os.fspath(path), "r")
    return sum(int(t.n_bytes) for t in r.tensors) * 8 / sum(int(t.n_elements) for t in r.tensors)


def tensor_types(path: Path) -> dict[str, str]:
    import gguf

    r = gguf.GGUFReader(os.fspath(path), "r")
    return {t.name: t.tensor_type.name.lower() for t in r.tensors}
