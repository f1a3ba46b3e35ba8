"""A parent spread over llama.cpp RPC workers (ggml-rpc): endpoints, a pre-flight probe in Python, the workers'
devices for llama_model_params.devices, and guards around what ggml-rpc does on a lost worker.

ggml-rpc ends the process on any transport failure: a worker that refuses the connection, a socket that
dies mid-graph, a reply that never completes all reach GGML_ABORT (abort(), SIGABRT). Nothing returns an
error to the caller. So: (1) every endpoint is probed here first (connect + the protocol's HELLO, with a
deadline), and a worker that is down, busy with another client or not a ggml-rpc worker is one clear error
before ggml sees it; (2) ggml's abort callback is set to print one line naming the lost worker and end the
process with exit 1 (or to hand the failure to a server, which answers 503 and stays up without the parent);
(3) ggml's sockets get TCP keepalive, TCP_USER_TIMEOUT and a receive deadline (SO_RCVTIMEO), so a silent
worker ends in that clean error instead of a hang."""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from specquant_cli.errors import ResourceError

DEFAULT_PORT = 50052
PROBE_TIMEOUT_S = 3.0
PROTO_MAJOR = 7  # ggml-rpc.h RPC_PROTO_MAJOR_VERSION of the bundled llama.cpp
CMD_GET_DEVICE_MEMORY, CMD_HELLO, CMD_DEVICE_COUNT = 11, 14, 15
CAPS_SIZE = 24  # transport.h RPC_CONN_CAPS_SIZE
WORKER_RESERVE = 256 << 20  # compute buffers on each worker

# -- the pre-flight probe: the protocol's HELLO and memory queries, spoken by Python with deadlines --------------
@dataclass
class Worker:
    endpoint: str
    devices: list[tuple[int, int]] = field(default_factory=list)  # (free, total) bytes per device

    @property
    def free(self) -> int:
        return sum(f for f, _ in self.devices)

    @property
    def total(self) -> int:
        return sum(t for _, t in self.devices)


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def _call(sock: socket.socket, cmd: int, payload: bytes, reply: int) -> bytes:
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    size = struct.unpack("<Q", _recv(sock, 8))[0]
    if size != reply:
        raise OSError(f"unexpected reply size {size} to command {cmd}")
    return _recv(sock, reply)


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("the worker closed the connection")
        buf += chunk
    return buf


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> Worker:
    """Connect, HELLO, and read each device's memory, all within `timeout`; one clear error otherwise."""
    host, port = _split(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            hello = _call(sock, CMD_HELLO, bytes(CAPS_SIZE), 4 + CAPS_SIZE)
            if hello[0] != PROTO_MAJOR:
                raise ResourceError(f"RPC worker {endpoint} speaks ggml-rpc v{hello[0]}.{hello[1]}, this build "
                                    f"v{PROTO_MAJOR}: run the same llama.cpp version on both sides")
            n = struct.unpack("<I", _call(sock, CMD_DEVICE_COUNT, b"", 4))[0]
            mem = [struct.unpack("<QQ", _call(sock, CMD_GET_DEVICE_MEMORY, struct.pack("<I", i), 16))
                   for i in range(n)]
    except TimeoutError:
        raise ResourceError(f"RPC worker {endpoint} did not answer within {timeout:g} s (busy with another "
                            "client, or not a specquant/llama.cpp RPC worker)") from None
    except OSError as e:
        raise ResourceError(f"RPC worker {endpoint} is not reachable ({e.strerror or e}); start it with: "
                            f"specquant worker --port {port}") from None
    if not mem:
        raise ResourceError(f"RPC worker {endpoint} offers no device")
    return Worker(endpoint, mem)


def probe_all(endpoints: list[str]) -> list[Worker]:
    return [probe(ep) for ep in endpoints]


def split_for(workers: list[Worker]) -> list[float]:
    """tensor_split proportions, one per device in order: by free memory."""
    free = [f for w in workers for f, _ in w.devices]
    total = sum(free) or 1
    return [f / total for f in free]


def require_remote_fit(workers: list[Worker], need_bytes: int, what: str) -> None:
    usable = sum(max(0, w.free - WORKER_RESERVE) for w in workers)
    if need_bytes > usable:
        names = ", ".join(f"{w.endpoint} {w.free / 2**30:.2f} GiB free" for w in workers)
        raise ResourceError(f"{what} needs ~{need_bytes / 2**30:.2f} GiB on the RPC workers, they offer "
                            f"~{usable / 2**30:.2f} GiB usable ({names})")


# -- ggml: the workers' devices, the abort guard, the socket deadlines --------------------------------------------
def _lib():
    from llama_cpp import llama_cpp as lib_mod

    from specquant_cli.backend.llama import init_backend

    init_backend()
    lib = lib_mod._lib  # libllama: the ggml symbols resolve through its dependencies
    lib.ggml_backend_reg_by_name.argtypes, lib.ggml_backend_reg_by_name.restype = [ctypes.c_char_p], ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_reg_dev_count.argtypes, lib.ggml_backend_reg_dev_count.restype = [ctypes.c_void_p], ctypes.c_size_t
    lib.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    return lib


def proc(name: str, signature):
    """A function of the RPC backend, looked up as llama.cpp's tools do (ggml_backend_reg_get_proc_address)."""
    lib = _lib()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    addr = lib.ggml_backend_reg_get_proc_address(reg, name.encode()) if reg else None
    if not addr:
        raise ResourceError("this llama-cpp-python is built without the RPC backend; reinstall with "
                            "SPECQUANT_CMAKE_ARGS=\"-DGGML_RPC=ON\"")
    return signature(addr)


_devices: dict[str, list[int]] = {}


def devices(endpoints: list[str]) -> list[int]:
    """The workers' ggml devices (ggml_backend_rpc_add_server), in endpoint order. Probe first: ggml aborts on a
    worker it cannot reach."""
    add = proc("ggml_backend_rpc_add_server", ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p))
    lib = _lib()
    out = []
    for ep in endpoints:
        if ep not in _devices:
            reg = add(ep.encode())
            if not reg:
                raise ResourceError(f"RPC worker {ep} offers no device")
            _devices[ep] = [lib.ggml_backend_reg_dev_get(reg, i) for i in range(lib.ggml_backend_reg_dev_count(reg))]
        out.extend(_devices[ep])
    return out


_ABORT_CB = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_guard: dict = {}
_lost_handler: Optional[Callable[[str], bool]] = None


def on_lost(handler: Optional[Callable[[str], bool]]) -> None:
    """A server's handler for a lost worker: it gets the message; True means it took over (the thread that
    failed is then parked for good instead of the process ending)."""
    global _lost_handler
    _lost_handler = handler


def down(endpoints: list[str], timeout: float = 0.5) -> list[str]:
    """The endpoints that refuse or time out a plain TCP connection now."""
    out = []
    for ep in endpoints:
        try:
            socket.create_connection(_split(ep), timeout=timeout).close()
        except OSError:
            out.append(ep)
    return out


def lost_message(endpoints: list[str], detail: str) -> str:
    gone = down(endpoints) or endpoints
    return (f"RPC worker {', '.join(gone)} was lost mid-answer ({detail.strip()}); ggml-rpc cannot recover "
            "from a lost worker, so the parent is gone")


def install_abort_guard(endpoints: list[str]) -> None:
    """Route ggml's aborts (the only thing ggml-rpc does on a lost worker) to one clear line and exit 1."""
    _guard["endpoints"] = list(endpoints)
    if "cb" in _guard:
        return

    def on_abort(message: bytes) -> None:
        try:
            _on_abort(message)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: ggml's wait on a worker failed because of it
            _interrupted()

    def _on_abort(message: bytes) -> None:
        detail = (message or b"").decode("utf-8", "replace").split(": ", 1)[-1]
        eps = _guard["endpoints"]
        if "RPC" not in detail and not any(ep in detail for ep in eps):  # not ours: ggml's message, its abort
            sys.stderr.write(f"ggml abort: {detail}\n")
            sys.stderr.flush()
            return
        line = lost_message(eps, detail)
        handler = _lost_handler
        if handler is not None and handler(line):
            threading.Event().wait()  # parked: returning would abort(); the server carries on without the parent
        sys.stderr.write(f"error: {line}\n")
        sys.stderr.flush()
        os._exit(1)

    previous = sys.unraisablehook

    def unraisable(u) -> None:
        # A signal's KeyboardInterrupt raised as ggml's failed call enters the callback, before its first line
        # runs, surfaces here (a callback cannot raise into C): the command was interrupted, not the worker lost.
        if isinstance(u.exc_value, KeyboardInterrupt):
            _interrupted()
        previous(u)

    sys.unraisablehook = unraisable
    cb = _ABORT_CB(on_abort)
    base = _lib()
    base.ggml_set_abort_callback.argtypes, base.ggml_set_abort_callback.restype = [_ABORT_CB], ctypes.c_void_p
    base.ggml_set_abort_callback(cb)
    _guard["cb"] = cb


def _interrupted() -> None:
    """Ctrl-C or SIGTERM while ggml waited on a worker: the call cannot be resumed, so the process ends now, as an
    interrupted command does (exit 130); nothing it writes is half-written (every file is replaced whole)."""
    try:
        sys.stderr.write("interrupted\n")
        sys.stderr.flush()
    finally:
        os._exit(130)


def arm_sockets(endpoints: list[str], deadline: float) -> int:
    """Give this process's sockets to the workers keepalive, TCP_USER_TIMEOUT and a receive deadline of `deadline`
    seconds (the runtime.rpc_timeout setting; ggml sets none: a silent worker would hang it forever). Returns how
    many sockets were armed."""
    peers = _peers(endpoints)
    armed = 0
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        armed += _arm_fd(int(name), peers, deadline)
    return armed


def release_sockets(endpoints: list[str]) -> int:
    """Shut down this process's connections to the workers (after a lost one: a surviving worker serves one
    client at a time and would stay busy with the dead parent's connection). Returns how many."""
    peers = _peers(endpoints)
    done = 0
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        s = _peer_socket(int(name), peers)
        if s is not None:
            with s:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    done += 1
                except OSError:
                    pass
    return done


def _peers(endpoints: list[str]) -> set:
    peers = set()
    for ep in endpoints:
        host, port = _split(ep)
        try:
            peers.add((socket.gethostbyname(host), port))
        except OSError:
            continue
    return peers


def _peer_socket(fd: int, peers: set) -> Optional[socket.socket]:
    """A duplicate of fd when it is a TCP socket connected to one of `peers`, else None."""
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
            return None
        s = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return None
    try:
        if s.family == socket.AF_INET and s.getpeername() in peers:
            return s
    except OSError:
        pass
    s.close()
    return None


def _arm_fd(fd: int, peers: set, deadline: float) -> int:
    s = _peer_socket(fd, peers)  # a duplicate: options apply to the same socket
    if s is None:
        return 0
    with s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 5)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 2)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 20_000)
            sec = int(deadline)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                         struct.pack("ll", sec, int((deadline - sec) * 1e6)))
            return 1
        except OSError:
            return 0
