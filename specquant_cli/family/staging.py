"""A variant's file staged beside its final name before a family's update commits it: made as a temp file —
quantized by llama.cpp's own quantizer in a child process (`quantize_one`), the exact F16 rendering of a BF16 base
(`derive_f16`), or a link or copy (`stage_copy`) — checked, and handed to the caller's list with Ctrl-C held back
(`TempBeside`: the one clean-up rule, so an interrupt never orphans a file); and the log those children write."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from specquant_cli.errors import InputError, LlamaError, ModelFileError
from specquant_cli.family.gguf_read import read_info
from specquant_cli.family.gguf_write import NotExact, f16_of_bf16
from specquant_cli.family.manifest_file import WarnFn
from specquant_cli.family.variants import QUANT_TYPES, QuantType, variant_record  # noqa: F401  (QuantType: named here too)
from specquant_cli.fsutil import (
    create_temp,
    fsync_file,
    open_append_nofollow,
    temp_name,
)
from specquant_cli.interrupts import deferred

ProgressFn = Callable[[str, int, int], None]  # (type name, bytes written, expected bytes)
LOG = "quantize.log"
DEFAULT_PROVENANCE = "user-supplied base; origin not recorded"
MAX_THREADS = 1024


_LOGS_STARTED: set[str] = set()  # the folders whose quantize.log this process has started afresh already


def start_log(folder: Path) -> Path:
    """`quantize.log` in `folder`, holding this run only: the first time a process writes there, the log is
    replaced by a new empty file (a log grows by ~100 KB a run; appended to forever, it once filled the last
    space on a disk). Replaced by rename, never truncated in place, so a hard link to the old log keeps its
    content. A symbolic link at quantize.log is refused, never followed or replaced."""
    path = Path(folder) / LOG
    if path.is_symlink():
        raise InputError(f"quantize log {path} is a symbolic link; refusing to write through it (remove it)")
    key = os.path.realpath(folder)
    if key in _LOGS_STARTED:
        return path
    if os.path.lexists(path) and not path.is_dir():  # a folder there: open_append_nofollow names the problem
        tmp = None
        try:
            with deferred():  # no interrupt between the temp file's creation and `tmp` naming it
                fd, tmp = create_temp(path)
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            raise InputError(f"quantize log {path}: cannot start it afresh ({e.strerror or e})") from None
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
    _LOGS_STARTED.add(key)
    return path


def open_log(folder: Path) -> int:
    """An fd appending to this run's `quantize.log` in `folder` (start_log)."""
    return open_append_nofollow(start_log(folder), "quantize log")


def check_output(tmp: Path, label: str, log: Path) -> int:
    """A quantizer's finished temp file: not empty, a readable GGUF, on disk (fsynced). Returns its size."""
    size = tmp.stat().st_size
    if size == 0:
        raise LlamaError(f"llama_model_quantize wrote nothing for {label}; see {log}")
    try:
        read_info(tmp)
    except ModelFileError as e:
        raise LlamaError(f"llama_model_quantize wrote an unreadable {label} file ({e})") from None
    fsync_file(tmp)
    return size


def run_child(cmd: list[str], log_fd, watched: Path, tick) -> int:
    """Run a quantizer child process (its own session, so a terminal's Ctrl-C reaches us, not it), calling
    tick(bytes written to `watched`) while it runs; an interruption kills it before its file is removed."""
    proc = None
    try:
        # Signals wait while the child starts: an interrupt inside Popen would leave a child we cannot name,
        # which could (re)create its output file after we removed it. Delivered right after, with proc set.
        with deferred():
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                                    start_new_session=True)
        while True:
            try:
                return proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                tick(watched.stat().st_size if watched.exists() else 0)
    finally:
        if proc is not None and proc.poll() is None:  # interrupted: stop the quantizer before its file goes
            proc.kill()
            proc.wait()


def quantize_one(src: Path, dst: Path, q: QuantType, expected: int, threads: int, allow_requantize: bool,
                 log_fd: int, progress: Optional[ProgressFn], keep: Optional[Callable[[Path], None]] = None) -> Path:
    """Quantize `src` into a new temp file beside `dst` in a child process (quantize_worker), report its
    growing size, check the result, and return the finished temp file; the caller commits it. `keep` is handed
    the finished temp file with Ctrl-C held back: from then on it is the caller's to remove (no signal can land
    between this function's clean-up and the caller's).

    Ctrl-C or SIGTERM kills the child and removes the temp file; nothing under `dst` is touched here."""
    with TempBeside(dst, keep, close=True) as made:
        tmp = made.path
        cmd = [sys.executable, "-m", "specquant_cli.family.quantize_worker", os.fsdecode(src), os.fsdecode(tmp),
               q.ftype_const, str(threads), "1" if allow_requantize else "0", str(os.getpid())]
        rc = run_child(cmd, log_fd, tmp, lambda n: progress and progress(q.name, n, expected))
        if rc != 0:
            raise LlamaError(f"llama_model_quantize failed for {q.name} (exit code {rc}); see {dst.parent / LOG}")
        size = check_output(tmp, q.name, dst.parent / LOG)
        if progress:
            progress(q.name, size, size)
        return made.finish()


class TempBeside:
    """A new temp file beside `dst` while a variant is made into it, removed on the way out unless `finish` handed it
    over: a Ctrl-C or an error at any point after its creation (the creation itself included: no signal lands
    between the file's creation and this object naming it) leaves no file behind. `finish` gives the finished file
    to `keep` (the caller's list of files to commit or remove) with Ctrl-C held back, so that a signal never lands
    after this clean-up was done with and before the caller's starts: the file would be left behind, named by
    nobody. `close`: close the file's descriptor at once (the maker opens it by name), else it is `fd`."""

    def __init__(self, dst: Path, keep: Optional[Callable[[Path], None]] = None, close: bool = False):
        self.dst, self.keep, self.close = dst, keep, close
        self.path: Optional[Path] = None
        self.fd = -1
        self.done = False

    def __enter__(self) -> TempBeside:
        try:
            with deferred():
                self.fd, self.path = create_temp(self.dst)
                if self.close:
                    os.close(self.fd)
        except BaseException:
            self._remove()
            raise
        return self

    def finish(self) -> Path:
        assert self.path is not None
        if self.keep is not None:
            with deferred():
                self.keep(self.path)
        self.done = True
        return self.path

    def __exit__(self, *exc) -> None:
        if not self.done:
            self._remove()

    def _remove(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def stage_copy(src: Path, dst: Path, keep: Optional[Callable[[Path], None]] = None) -> Path:
    """A new temp file beside `dst` with `src`'s content: a hard link when possible, else a copy. A symbolic link
    given as `src` is resolved first: the family gets the file it names (link(2) would link the link itself, which
    points elsewhere, or nowhere once the folder moves). `keep` as in quantize_one."""
    src = Path(os.path.realpath(src))
    for _ in range(64):
        tmp = dst.with_name(temp_name(dst.name))
        try:
            with deferred():  # the link and its hand-over as one step: a Ctrl-C between them would orphan it
                os.link(src, tmp)  # exclusive: fails on any existing name, never follows one
                if keep is not None:
                    keep(tmp)
            return tmp
        except FileExistsError:
            continue
        except OSError:
            break
    with TempBeside(dst, keep) as made:
        with open(made.fd, "wb") as out, open(src, "rb") as f:
            shutil.copyfileobj(f, out, 16 << 20)
        fsync_file(made.path)
        return made.finish()


def derive_f16(base: Path, dst: Path, if_exact: bool, warn: WarnFn, progress: Optional[ProgressFn],
               keep: Optional[Callable[[Path], None]] = None) -> Optional[Path]:
    """The F16 rendering of the BF16 `base` as a finished temp file beside `dst` (gguf_write.f16_of_bf16), or None
    when it would not be exact and `if_exact` (warned); InputError when it would not be exact otherwise. `keep`
    as in quantize_one."""
    with TempBeside(dst, keep, close=True) as made:
        tmp = made.path
        info = read_info(base)
        prov = (f"F16 rendering of the BF16 base {base.name}, exact (every weight checked: the same values); "
                f"{info.provenance or DEFAULT_PROVENANCE}")
        try:
            f16_of_bf16(base, tmp, prov, (lambda d, n: progress("f16", d, n)) if progress else None)
        except NotExact as e:
            if not if_exact:
                raise InputError(f"--types f16: {e}; an F16 rendering would round them, so none is made "
                                 "(the BF16 base is the parent: leave f16 out)") from None
            warn(f"no F16 rendering: {e}; the BF16 base is the family's only parent rendering")
            return None
        fsync_file(tmp)
        return made.finish()
