"""One `llama_model_quantize` call in a process of its own.

A C call running in a thread cannot be stopped; a process can. The parent kills this one on Ctrl-C or
SIGTERM and removes its temp file; if the parent itself is killed, this process notices that it was
orphaned and exits. llama.cpp's log goes to stderr, which the parent points at quantize.log.

Usage: python -m specquant_cli.family.quantize_worker SRC DST FTYPE_CONST NTHREAD ALLOW_REQUANTIZE PARENT_PID"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time


def _exit_when_orphaned(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(0.1)


def start_worker(parent: str):
    """The common start of a quantizer child: exit when orphaned, llama.cpp's log to stderr. Returns
    llama_cpp and the log callback (keep it referenced while llama.cpp may call it)."""
    threading.Thread(target=_exit_when_orphaned, args=(int(parent),), daemon=True).start()
    import llama_cpp

    @llama_cpp.llama_log_callback
    def log(level, text, user_data):  # noqa: ARG001
        try:
            os.write(2, text)
        except OSError:
            pass

    llama_cpp.llama_log_set(log, ctypes.c_void_p(0))
    return llama_cpp, log


def main(argv: list[str]) -> int:
    src, dst, ftype, nthread, allow, parent = argv
    llama_cpp, _log = start_worker(parent)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.nthread = int(nthread)
    params.allow_requantize = allow == "1"
    rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), params)
    return 0 if rc == 0 else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
