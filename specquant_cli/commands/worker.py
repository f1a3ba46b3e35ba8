"""`specquant worker`: this machine's CPU served to other specquant processes over llama.cpp's RPC backend."""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Optional

import typer

from specquant_cli.commands.options import finite, with_settings
from specquant_cli.console import err
from specquant_cli.errors import InputError, ResourceError
from specquant_cli.settings import Settings
from specquant_cli.system.rpc import DEFAULT_PORT

HELP = ("Serve this machine's CPU to a specquant parent elsewhere (llama.cpp RPC; there: --rpc HOST:PORT).\n\n"
        "The protocol has no authentication or encryption: loopback by default; any other address needs "
        "--allow-remote, on a trusted network only (or behind an SSH tunnel / WireGuard).")
_MEM_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
_keep: list = []  # ctypes callbacks ggml holds
MAX_MEM_GIB = float(1 << 20)  # 1 PiB: more is no memory anyone has (and overflows ggml's size_t)


def register(app: typer.Typer) -> None:
    app.command("worker", help=HELP, short_help="Lend this CPU to a parent (llama.cpp RPC)")(worker)


@with_settings("runtime.threads")
def worker(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind", metavar="ADDR"),
    port: int = typer.Option(DEFAULT_PORT, "--port", min=1, max=65535, help="TCP port", metavar="PORT"),
    mem: Optional[float] = typer.Option(None, "--mem", min=0.01, max=MAX_MEM_GIB, callback=finite,
                                        help="GiB of memory offered", show_default="available RAM",
                                        metavar="GIB"),
    cache_dir: Optional[Path] = typer.Option(None, "--tensor-cache", "--cache-dir", metavar="DIR",
                                             help="Keep received tensors here (faster reloads)"),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="Allow a non-loopback --host (no auth!)"),
    *, cfg: Settings,
) -> None:
    from specquant_cli import interrupts
    from specquant_cli.system.rpc_front import Front, free_loopback_port

    address = _check_host(host, allow_remote)
    listener = _listen(address, host, port)
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    dev = _cpu_device(mem)
    backend = f"127.0.0.1:{free_loopback_port()}"  # ggml's server, behind the front (system.rpc_front)
    done = threading.Event()
    sys.stdout.flush()
    os.dup2(2, 1)  # ggml's server prints its log with printf: keep it on stderr
    t = threading.Thread(target=_serve, args=(backend, cache_dir, cfg.runtime.threads, dev, done), daemon=True)
    t.start()
    front = Front(listener, int(backend.rsplit(":", 1)[1]), lambda line: err.print(line, markup=False))
    threading.Thread(target=front.serve, name="specquant-rpc-front", daemon=True).start()
    try:  # SIGTERM (interrupts.Terminated) is a clean stop from here on: exit 0
        free, total = _memory(dev)
        err.print(f"worker: serving {host}:{port} (ggml RPC), offering {free / 2**30:.2f} GiB of "
                  f"{total / 2**30:.2f} GiB; Ctrl-C stops", markup=False)
        while not done.wait(0.5):
            pass
    except interrupts.Terminated:
        err.print("worker: stopped", markup=False)
        return
    finally:
        front.stop.set()
        listener.close()
    raise ResourceError(f"the RPC server behind {host}:{port} stopped (see the lines above)")


def _check_host(host: str, allow_remote: bool) -> str:
    """The IPv4 address to bind for --host (a name is resolved: `localhost` works), after the exposure check."""
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError, IndexError):
        raise InputError(f"--host {host}: not an address of this machine (the RPC worker listens on IPv4)") \
            from None
    loopback = ipaddress.ip_address(address).is_loopback
    if not loopback and not allow_remote:
        raise InputError(f"--host {host} would expose this machine to the network: the RPC protocol has no "
                         "authentication or encryption; pass --allow-remote to do it anyway (trusted network only)")
    if not loopback:
        err.print(f"warning: serving {host} without authentication or encryption: anyone who can reach this port "
                  "can run code-sized workloads and read or write this worker's memory; use only on a trusted "
                  "network (or behind an SSH tunnel / WireGuard)", markup=False)
    return address


def _listen(address: str, host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, port))
        s.listen(16)
    except OSError as e:
        s.close()
        raise InputError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    return s


def _lib():
    from specquant_cli.system.rpc import _lib as rpc_lib

    lib = rpc_lib()
    lib.ggml_backend_dev_by_type.argtypes, lib.ggml_backend_dev_by_type.restype = [ctypes.c_int], ctypes.c_void_p
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    return lib


def _cpu_device(mem: Optional[float]) -> int:
    """The CPU device; with --mem, its memory report (ggml_backend_device_i.get_memory, the third pointer of the
    device struct) answers `mem` GiB instead: this process serves nothing else."""
    dev = _lib().ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev:
        raise ResourceError("this llama.cpp build has no CPU device")
    if mem is not None:
        size = int(mem * 2**30)

        def get_memory(_dev, free, total):
            free[0] = size
            total[0] = size

        cb = _MEM_CB(get_memory)
        _keep.append(cb)
        ctypes.c_void_p.from_address(dev + 2 * ctypes.sizeof(ctypes.c_void_p)).value = \
            ctypes.cast(cb, ctypes.c_void_p).value
    return dev


def _memory(dev: int) -> tuple[int, int]:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    _lib().ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def _serve(endpoint: str, cache_dir: Optional[Path], threads: int, dev: int, done: threading.Event) -> None:
    from specquant_cli.system.rpc import proc

    start = proc("ggml_backend_rpc_start_server",
                 ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                  ctypes.POINTER(ctypes.c_void_p)))
    devs = (ctypes.c_void_p * 1)(dev)
    try:
        start(endpoint.encode(), os.fsencode(cache_dir) if cache_dir else None, threads, 1, devs)
    finally:
        sys.stdout.flush()
        done.set()
