"""Blocking keep-alive connections to ``http://`` shards: :class:`HTTPPool` (for ``PSClient``).

One request is one ``sendmsg`` of the head and the body's buffers, then ``recv_into`` the
connection's receive buffer or, for a big body, straight into the body's own buffer
(:func:`client_sdk._http11.read_response` does the parsing). Connections are kept per origin,
most recently used first, at most ``max_idle`` idle; an idle connection that the server closed
meanwhile, or that has been idle for :data:`~client_sdk._http11.IDLE_EXPIRY` seconds, is
dropped rather than reused. Measured here against the same shard, the whole ``PSClient.pull``
of a 4 KB variable took (p50) 476 us through httpx2 and 182 us through this pool; of a 100 MB
one, 76 ms and 40 ms (``AsyncPSClient``: 526 us and 195 us; 152 ms and 38 ms).

Thread-safety: :class:`HTTPPool` may be shared by threads; each request holds its connection
alone. Every call blocks.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Mapping, Sequence

import httpx2

from ._http11 import HEAD_BUFFER, IDLE_EXPIRY, Buffer, Origin, Response, advance, next_send, \
    read_response, request_head

__all__ = ["Connection", "HTTPPool"]


class Connection:
    """One keep-alive TCP connection. Used by one thread at a time.

    Blocking with a timeout for :meth:`send` and :meth:`receive`; :mod:`client_sdk._fanout`
    makes it non-blocking (:meth:`nonblocking`) to drive it alongside others, and the next
    blocking use sets the timeout again.
    """

    __slots__ = ("sock", "buf", "timeout", "poller", "idle_since")

    def __init__(self, origin: Origin, connect_timeout: float | None) -> None:
        try:
            sock = socket.create_connection((origin.host, origin.port), connect_timeout)
        except socket.timeout as exc:
            raise httpx2.ConnectTimeout(f"timed out connecting to {origin.host_header}") from exc
        except OSError as exc:
            raise httpx2.ConnectError(str(exc) or type(exc).__name__) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.timeout = connect_timeout
        self.buf = bytearray(HEAD_BUFFER)
        self.idle_since = 0.0
        self.poller = None
        if hasattr(select, "poll"):
            self.poller = select.poll()
            self.poller.register(sock, select.POLLIN)

    def close(self) -> None:
        self.sock.close()

    def reusable(self, now: float) -> bool:
        """Whether this idle connection may carry a request: not idle too long, and nothing
        to read (readable while idle means the server closed it, or sent what nobody asked)."""
        if now - self.idle_since > IDLE_EXPIRY:
            return False
        if self.poller is not None:
            return not self.poller.poll(0)
        return not select.select([self.sock], [], [], 0)[0]

    def _settimeout(self, timeout: float | None) -> None:
        if timeout != self.timeout:  # each settimeout is a system call
            self.sock.settimeout(timeout)
            self.timeout = timeout

    def nonblocking(self) -> None:
        """Make the socket non-blocking (calls that would wait raise ``BlockingIOError``)."""
        self._settimeout(0.0)

    def send(self, head: bytes, body: Sequence[Buffer], timeout: float | None) -> None:
        """Send ``head`` and ``body`` (bytes, or flat byte memoryviews as ``wire`` makes
        them: ``len()`` is their size) with as few ``sendmsg`` calls as the socket allows."""
        self._settimeout(timeout)
        views = [head, *body]
        sock = self.sock
        first = 0
        try:
            while first < len(views):
                first = advance(views, first, sock.sendmsg(next_send(views, first)))
        except socket.timeout as exc:
            raise httpx2.WriteTimeout("timed out sending the request") from exc
        except OSError as exc:
            raise httpx2.WriteError(str(exc) or type(exc).__name__) from exc

    def receive(self, timeout: float | None) -> tuple[Response, bool]:
        """Read one response; return it and whether the connection may be reused."""
        self._settimeout(timeout)
        reading = read_response(self.buf)
        recv_into = self.sock.recv_into
        try:
            target = next(reading)
            while True:
                target = reading.send(recv_into(target))
        except StopIteration as done:
            return done.value
        except socket.timeout as exc:
            raise httpx2.ReadTimeout("timed out waiting for the response") from exc
        except OSError as exc:
            raise httpx2.ReadError(str(exc) or type(exc).__name__) from exc


class HTTPPool:
    """Keep-alive connections to any number of origins; at most ``max_idle`` idle per origin.

    ``connect_timeout``, ``read_timeout`` and ``write_timeout`` are seconds (``None``: wait
    forever); the read timeout bounds each wait for bytes, as in httpx. Thread-safe; every
    call blocks.
    """

    def __init__(self, *, max_idle: int, connect_timeout: float | None,
                 read_timeout: float | None, write_timeout: float | None) -> None:
        self.max_idle = max_idle
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def request(self, origin: Origin, method: str, target: str,
                headers: Mapping[str, str] | None, body: Sequence[Buffer] = (), *,
                read_timeout: float | None = None) -> Response:
        """Send ``method target`` (see :func:`~client_sdk._http11.request_head`) and the
        ``body`` buffers in order; return the whole response (not for ``HEAD``)."""
        head = request_head(origin, method, target, headers)
        conn = self.take_idle(origin) or self.connect(origin)
        try:
            conn.send(head, body, self.write_timeout)
            response, reusable = conn.receive(
                self.read_timeout if read_timeout is None else read_timeout)
        except BaseException:
            conn.close()
            raise
        self.release(origin, conn, reusable)
        return response

    def take_idle(self, origin: Origin) -> Connection | None:
        """An idle connection to ``origin`` fit for reuse, now held by the caller, or ``None``
        (then :meth:`connect`). Closes the stale ones it passes over; raises
        :class:`httpx2.ConnectError` once the pool is closed."""
        stale = []
        with self._lock:
            if self._closed:
                raise httpx2.ConnectError("the client is closed")
            idle = self._idle.get(origin.key)
            now = time.monotonic()
            conn = None
            while idle:
                candidate = idle.pop()
                if candidate.reusable(now):
                    conn = candidate
                    break
                stale.append(candidate)
        for old in stale:
            old.close()
        return conn

    def connect(self, origin: Origin) -> Connection:
        """A new connection to ``origin``, held by the caller (blocks up to the connect
        timeout; raises :class:`httpx2.ConnectError` or :class:`httpx2.ConnectTimeout`)."""
        return Connection(origin, self.connect_timeout)

    def release(self, origin: Origin, conn: Connection, reusable: bool) -> None:
        """Hand back a connection whose exchange ended: kept idle if ``reusable`` and there is
        room, closed otherwise (a connection whose exchange failed is closed, not released)."""
        if reusable:
            conn.idle_since = time.monotonic()
            with self._lock:
                idle = self._idle.setdefault(origin.key, [])
                if not self._closed and len(idle) < self.max_idle:
                    idle.append(conn)
                    return
        conn.close()

    def idle_count(self, origin: Origin) -> int:
        """Connections to ``origin`` kept alive and waiting for a request."""
        with self._lock:
            return len(self._idle.get(origin.key, ()))

    def close(self) -> None:
        """Close the idle connections; those in use close when their request ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
