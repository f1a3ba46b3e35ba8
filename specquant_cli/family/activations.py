"""A family's activation statistics: collected over the calibration set (`calibration_tokens`, in chunks) on the
family's parent (`collect`, `calibrate_family`: `specquant calibrate-activations`), stored beside the family as its
importance matrix, and found there for a draft recipe (`family_imatrix`)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Optional

from specquant_cli import interrupts
from specquant_cli.errors import FamilyError, InputError, LlamaError, ResourceError, SpecquantError
from specquant_cli.family.imatrix import (
    IMATRIX_FILE,
    MIN_ROWS,
    ActivationStats,
    Collector,
    ProgressFn,
    check_imatrix,
    check_option_imatrix,
)
from specquant_cli.family.roles import PARENT_ROLE
from specquant_cli.fsutil import read_input_file

CALIBRATION_SET = Path(__file__).with_name("calibration_set.jsonl")
DEFAULT_TOKENS = 4096
DEFAULT_CHUNK = 512


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
    from specquant_cli.family import journal
    from specquant_cli.family.manifest_file import read_existing
    from specquant_cli.family.staging import start_log
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
        manifest, why = read_existing(root)  # re-read: the latest manifest, not the one loaded earlier
        if manifest is None:
            raise FamilyError(f"{root}: the manifest went away while calibrating ({why or 'missing'})")
        manifest["imatrix"] = record
        try:
            journal.commit(root, [(tmp, dst)], manifest)
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
