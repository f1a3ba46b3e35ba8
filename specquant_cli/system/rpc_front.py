"""The worker's front door: what `specquant worker` listens on, in front of ggml's RPC server.

ggml's server takes one client at a time and waits on it for as long as it stays connected, so one TCP
connection that says nothing (a port scan, a stuck client) would lock every parent out. The front accepts each
connection itself and hands it to ggml's server (listening on a private loopback port) only once the client has
sent a whole command header (ggml-rpc: one command byte and an 8-byte size); one that has not within `quiet_s`
seconds is closed. From then on it relays bytes both ways until either side closes; TCP keepalive notices a
parent whose machine vanished. At most MAX_CLIENTS connections are held at once."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

CHUNK = 1 << 20
QUIET_S = 10.0  # a new connection must speak within this long (a parent's HELLO comes at once)
ACCEPT_POLL_S = 0.5
HEADER_BYTES = 9  # ggml-rpc: | command (1 byte) | payload size (8 bytes) |
MAX_CLIENTS = 32
BACKEND_WAIT_S = 10.0


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (for ggml's server behind the front)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Front:
    """Accepts on `listener` until `stop` is set; each connection is relayed to 127.0.0.1:`backend_port` once it
    has sent its first bytes within `quiet_s`. `say` hears one line per dropped client."""

    def __init__(self, listener: socket.socket, backend_port: int, say: Callable[[str], None],
                 quiet_s: float = QUIET_S):
        self.listener = listener
        self.backend_port = backend_port
        self.say = say
        self.quiet_s = quiet_s
        self.stop = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)

    def serve(self) -> None:
        self.listener.settimeout(ACCEPT_POLL_S)
        while not self.stop.is_set():
            try:
                conn, addr = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.stop.is_set():
                    return
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()  # a flood of connections: refused, not given a thread each
                continue
            threading.Thread(target=self._guarded, args=(conn, addr), name="specquant-rpc-client", daemon=True).start()

    def _guarded(self, conn: socket.socket, addr) -> None:
        try:
            self._client(conn, addr)
        except OSError:
            pass  # a connection that failed mid-relay: both ends are closed on the way out
        finally:
            self._slots.release()

    def _connect(self) -> socket.socket | None:
        """A connection to ggml's server (which may still be starting: a few tries, BACKEND_WAIT_S in all)."""
        end = time.monotonic() + BACKEND_WAIT_S
        while True:
            try:
                return socket.create_connection(("127.0.0.1", self.backend_port))
            except OSError as e:
                if time.monotonic() > end or self.stop.is_set():
                    self.say(f"worker: the RPC server behind the front is not answering ({e.strerror or e})")
                    return None
                time.sleep(0.1)

    def _header(self, conn: socket.socket) -> bytes | None:
        """The first bytes, once they hold a whole command header; None when it did not come within quiet_s,
        b"" when the client left."""
        end = time.monotonic() + self.quiet_s
        data = b""
        while len(data) < HEADER_BYTES:
            left = end - time.monotonic()
            if left <= 0:
                return None
            conn.settimeout(left)
            try:
                chunk = conn.recv(CHUNK)
            except TimeoutError:
                return None
            if not chunk:
                return b""
            data += chunk
        return data

    def _client(self, conn: socket.socket, addr) -> None:
        who = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        with conn:
            first = self._header(conn)
            if first is None:
                self.say(f"worker: closed the connection of {who}: it sent no command within {self.quiet_s:g} s")
                return
            if not first:
                return
            conn.settimeout(None)
            _keepalive(conn)
            backend = self._connect()
            if backend is None:
                return
            with backend:
                backend.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                backend.sendall(first)
                back = threading.Thread(target=_pump, args=(backend, conn), daemon=True)
                back.start()
                _pump(conn, backend)
                back.join()


def _keepalive(s: socket.socket) -> None:
    """TCP keepalive (a vanished peer noticed in ~11 s) and a 20 s limit on unacknowledged data."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", 20000)):
        if hasattr(socket, name):
            s.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy `src` to `dst` until `src` ends (then `dst` is told: no more) or either fails (then both end)."""
    try:
        while chunk := src.recv(CHUNK):
            dst.sendall(chunk)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
