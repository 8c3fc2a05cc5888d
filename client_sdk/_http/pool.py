"""Blocking keep-alive connections to ``http://`` shards: :class:`HTTPPool` (for ``PSClient``).

One request is one ``sendmsg`` of the head and the body's buffers, then ``recv_into`` the
connection's receive buffer or, for a big body, straight into the body's own buffer
(:func:`client_sdk._http11.read_response` does the parsing). Sockets are non-blocking once
connected: a send or receive is tried at once and waits (``poll``) only when the socket is not
ready, never past the exchange's deadline, so the timeout bounds the whole exchange (connect,
request, whole reply) however the server spaces its bytes. Connections are kept per origin,
most recently used first, at most ``max_idle`` idle; an idle connection that the server closed
meanwhile, or that has been idle for :data:`~client_sdk._http11.IDLE_EXPIRY` seconds, is
dropped rather than reused. Against the same shard, a ``PSClient.pull`` (or
``AsyncPSClient``'s) through this pool takes a fraction of the time it takes through httpx2,
for a 4 KB variable and for a 100 MB one (``python -m bench.breakdown`` compares them).

Thread-safety: :class:`HTTPPool` may be shared by threads; each request holds its connection
alone. Every call blocks.
"""

from __future__ import annotations

import math
import select
import socket
import threading
import time
from collections.abc import Mapping, Sequence

import httpx2

from .._abort import Abort
from .http11 import (
    HEAD_BUFFER,
    IDLE_EXPIRY,
    Buffer,
    Origin,
    Response,
    advance,
    next_send,
    read_response,
    request_head,
)

__all__ = ["Connection", "HTTPPool"]


def _remaining(deadline: float) -> float:
    return deadline - time.monotonic()


class Connection:
    """One keep-alive TCP connection, non-blocking once connected. Used by one thread at a
    time: :meth:`send` and :meth:`receive` wait for it, :mod:`client_sdk._fanout` drives it
    alongside others."""

    __slots__ = ("sock", "buf", "poller", "idle_since")

    def __init__(self, origin: Origin, connect_timeout: float | None) -> None:
        try:
            sock = socket.create_connection((origin.host, origin.port), connect_timeout)
        except TimeoutError as exc:
            raise httpx2.ConnectTimeout(f"timed out connecting to {origin.host_header}") from exc
        except OSError as exc:
            raise httpx2.ConnectError(str(exc) or type(exc).__name__) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(0.0)
        self.sock = sock
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

    def _wait(self, writing: bool, deadline: float) -> bool:
        """Wait until the socket is ready to write (or read); ``False`` once ``deadline``
        (``time.monotonic()`` seconds) passed first."""
        while True:
            left = _remaining(deadline)
            if left <= 0:
                return False
            if self.poller is None:
                ready = select.select(
                    [] if writing else [self.sock], [self.sock] if writing else [], [], left
                )
                if ready[0] or ready[1]:
                    return True
                continue
            if writing:  # the poller watches reads between requests: watch writes for now
                self.poller.modify(self.sock, select.POLLOUT)
            try:
                if self.poller.poll(max(1, math.ceil(left * 1000))):
                    return True
            finally:
                if writing:
                    self.poller.modify(self.sock, select.POLLIN)

    def send(self, head: bytes, body: Sequence[Buffer], deadline: float) -> None:
        """Send ``head`` and ``body`` (bytes, or flat byte memoryviews as ``wire`` makes
        them: ``len()`` is their size) with as few ``sendmsg`` calls as the socket allows, all
        of it by ``deadline`` (``time.monotonic()`` seconds)."""
        views = [head, *body]
        sendmsg = self.sock.sendmsg
        first = 0
        try:
            while first < len(views):
                try:
                    first = advance(views, first, sendmsg(next_send(views, first)))
                except (BlockingIOError, InterruptedError):
                    if not self._wait(True, deadline):
                        raise httpx2.WriteTimeout("timed out sending the request") from None
        except OSError as exc:
            raise httpx2.WriteError(str(exc) or type(exc).__name__) from exc

    def receive(self, deadline: float, max_size: int) -> tuple[Response, bool]:
        """Read one response, all of it by ``deadline`` (``time.monotonic()`` seconds), its
        body at most ``max_size`` bytes; return it and whether the connection may be reused."""
        reading = read_response(self.buf, max_size)
        recv_into = self.sock.recv_into
        try:
            target = next(reading)
            while True:
                try:
                    n = recv_into(target)
                except (BlockingIOError, InterruptedError):
                    if not self._wait(False, deadline):
                        raise httpx2.ReadTimeout(
                            "timed out waiting for the whole response"
                        ) from None
                    continue
                target = reading.send(n)
        except StopIteration as done:
            result: tuple[Response, bool] = done.value
            return result
        except OSError as exc:
            raise httpx2.ReadError(str(exc) or type(exc).__name__) from exc


class HTTPPool:
    """Keep-alive connections to any number of origins; at most ``max_idle`` idle per origin.

    ``timeout`` (seconds) bounds each whole exchange: connecting (at most ``connect_timeout``
    of it), sending the request and receiving the whole response, however the server spaces
    its bytes. ``max_reply`` bounds a response body (bytes). Thread-safe; every call blocks.
    """

    def __init__(
        self, *, max_idle: int, connect_timeout: float, timeout: float, max_reply: int
    ) -> None:
        self.max_idle = max_idle
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.max_reply = max_reply
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def request(
        self,
        origin: Origin,
        method: str,
        target: str,
        headers: Mapping[str, str] | None,
        body: Sequence[Buffer] = (),
        *,
        deadline: float | None = None,
        max_reply: int | None = None,
        abort: Abort | None = None,
    ) -> Response:
        """Send ``method target`` (see :func:`~client_sdk._http11.request_head`) and the
        ``body`` buffers in order; return the whole response (not for ``HEAD``), all by
        ``deadline`` (``time.monotonic()`` seconds; default: the pool's timeout from now), its
        body at most ``max_reply`` bytes (default: the pool's). ``abort``, when fired from
        another thread, shuts the connection's socket down: the exchange fails at once."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        head = request_head(origin, method, target, headers)
        conn = self.take_idle(origin) or self.connect(origin, deadline)
        key = id(conn)
        if abort is not None:
            sock = conn.sock
            abort.hold(key, lambda: sock.shutdown(socket.SHUT_RDWR))
        try:
            conn.send(head, body, deadline)
            response, reusable = conn.receive(
                deadline, self.max_reply if max_reply is None else max_reply
            )
        except BaseException:
            conn.close()
            raise
        finally:
            if abort is not None:
                abort.drop(key)
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

    def connect(self, origin: Origin, deadline: float) -> Connection:
        """A new connection to ``origin``, held by the caller (blocks up to the connect
        timeout, and not past ``deadline``; raises :class:`httpx2.ConnectError` or
        :class:`httpx2.ConnectTimeout`)."""
        left = _remaining(deadline)
        if left <= 0:
            raise httpx2.ConnectTimeout(f"no time left to connect to {origin.host_header}")
        return Connection(origin, min(self.connect_timeout, left))

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
