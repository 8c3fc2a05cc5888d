"""The reference: a raw TCP socket moving the same bytes as a pull or a push.

Run as its own process (``python -m bench.rawsock``); it binds a free loopback port, prints
``port <P>`` on stdout and serves until stdin closes or it gets SIGTERM. Every connection is one
thread. A message is an 8-byte little-endian length prefix and that many bytes; a request is a
1-byte op, an 8-byte length N, and then N bytes for a push:

``P`` pull
    the server answers N bytes, sent from one preallocated buffer (as a shard sends a value it
    already holds), in 1 MiB ``sendall`` calls (see below).
``U`` push
    the server ``recv_into``\\ s a preallocated buffer and answers an 8-byte ack (as a shard reads
    a gradient into one buffer sized by Content-Length, then answers).

:class:`RawClient` mirrors what the SDK has to do: one request, one N-byte response read with
``recv_into`` into a new array (a pull has to hand out fresh memory), or the caller's array sent
from its own buffer with ``sendall`` (a push). Neither side copies, parses or touches the bytes:
this is the speed of the loopback, the kernel and the allocator, the floor under any protocol.

Big messages are sent in 1 MiB slices. One ``sendall`` of a whole 100 MB buffer is markedly
slower on this kernel's loopback, and so are slices much bigger or smaller than 1 MiB; an
event loop writing a big buffer (uvloop in the shard) does it piece by piece anyway. Without
the slicing, the reference would not be the floor it claims to be.
"""

from __future__ import annotations

import argparse
import signal
import socket
import struct
import sys
import threading

import numpy as np

__all__ = ["RawClient", "serve"]

_LEN = struct.Struct("<Q")
#: bytes per ``sendall`` call when sending a message body
SEND_SLICE = 1 << 20
_REQ = struct.Struct("<cQ")
PULL, PUSH = b"P", b"U"


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection mid-message")
        got += k


def _send(sock: socket.socket, view: memoryview) -> None:
    for start in range(0, len(view), SEND_SLICE):
        sock.sendall(view[start : start + SEND_SLICE])


def _recv_struct(sock: socket.socket, fmt: struct.Struct) -> tuple:
    buf = bytearray(fmt.size)
    _recv_exact(sock, memoryview(buf))
    return fmt.unpack(buf)


class _Buffers:
    """One preallocated buffer per direction, grown on demand and then reused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bufs: dict[bytes, np.ndarray] = {}

    def get(self, op: bytes, n: int) -> memoryview:
        with self._lock:
            buf = self._bufs.get(op)
            if buf is None or buf.nbytes < n:
                buf = np.ones(n, dtype=np.uint8)  # touched, so no page faults while timing
                self._bufs[op] = buf
        return memoryview(buf)[:n]


def _handle(conn: socket.socket, bufs: _Buffers) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while True:
            try:
                op, n = _recv_struct(conn, _REQ)
            except ConnectionError:
                return
            if op == PULL:
                conn.sendall(_LEN.pack(n))
                _send(conn, bufs.get(PULL, n))
            elif op == PUSH:
                _recv_exact(conn, bufs.get(PUSH, n))
                conn.sendall(_LEN.pack(n))
            else:
                return


def serve(host: str = "127.0.0.1", port: int = 0) -> None:
    """Serve until stdin reaches EOF or SIGTERM arrives; prints ``port <P>`` once listening.
    Blocks; one thread per connection."""
    listener = socket.create_server((host, port))
    print(f"port {listener.getsockname()[1]}", flush=True)
    bufs = _Buffers()

    def accept_loop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_handle, args=(conn, bufs), daemon=True).start()

    threading.Thread(target=accept_loop, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    stop.wait()
    listener.close()


class RawClient:
    """One persistent TCP connection to :func:`serve`. Blocking; not thread-safe (use one per
    thread)."""

    def __init__(self, host: str, port: int) -> None:
        self._sock = socket.create_connection((host, port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def pull(self, nbytes: int) -> np.ndarray:
        """Ask for ``nbytes`` and read them into a new uint8 array."""
        self._sock.sendall(_REQ.pack(PULL, nbytes))
        (n,) = _recv_struct(self._sock, _LEN)
        out = np.empty(n, dtype=np.uint8)
        _recv_exact(self._sock, memoryview(out))
        return out

    def push(self, array: np.ndarray) -> None:
        """Send an array's bytes from its own memory (if C-contiguous); wait for the ack."""
        data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        self._sock.sendall(_REQ.pack(PUSH, len(data)))
        _send(self._sock, data)
        (n,) = _recv_struct(self._sock, _LEN)
        if n != len(data):
            raise ConnectionError(f"push acked {n} bytes, sent {len(data)}")

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.rawsock", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    serve(args.host, args.port)


if __name__ == "__main__":
    main()
