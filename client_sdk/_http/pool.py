"""Blocking keep-alive connections to ``http://`` shards: :class:`HTTPPool` (for ``PSClient``).

An exchange sends the request's head and the body's buffers with ``sendmsg``, then receives
into the connection's buffer or, for a big body, straight into the body's own buffer
(``connection.py``). Sockets are non-blocking once connected: a send or receive is tried at once
and waits (``poll``) only when the socket is not ready, never past the exchange's deadline, so
the timeout bounds the whole exchange (connect, request, whole reply) however the server spaces
its bytes. Idle connections are kept per origin and reused by the rules of ``connection.py``. The
native sender drives most exchanges over these connections through ``direct.py`` instead of
:meth:`HTTPPool.exchange` (the common reply parsed in place; TLS, races and watched exchanges
come here).
Against the same shard, a ``PSClient.pull`` (or ``AsyncPSClient``'s) through this pool takes a
fraction of the time it takes through httpx2, for a 4 KB variable and for a 100 MB one
(``python -m bench.breakdown`` compares them).

Thread-safety: :class:`HTTPPool` may be shared by threads; each exchange holds its connection
alone. Every call blocks.
"""

from __future__ import annotations

import math
import select
import socket
import ssl
import threading
import time
from collections.abc import Mapping, Sequence

import httpx2

from .._abort import Abort
from .connection import Connection, PoolBase
from .http11 import Buffer, Exchange, Into, Origin, Response
from .tls import context, wrap

__all__ = ["BlockingConnection", "HTTPPool"]


class BlockingConnection(Connection):
    """A :class:`~client_sdk._http.connection.Connection` whose waits block the calling thread
    (``poll``). Used by one thread at a time; :mod:`~client_sdk._http.fanout` drives it
    alongside others instead."""

    __slots__ = ()

    @classmethod
    def open(
        cls, origin: Origin, connect_timeout: float | None, tls: ssl.SSLContext | None = None
    ) -> BlockingConnection:
        """A new connection (with ``tls`` for an ``https://`` origin: its handshake done)."""
        try:
            sock = socket.create_connection((origin.host, origin.port), connect_timeout)
            if origin.tls:
                sock = wrap(sock, tls or context(True), origin.host, origin.url)
        except TimeoutError as exc:
            raise httpx2.ConnectTimeout(f"timed out connecting to {origin.host_header}") from exc
        except OSError as exc:
            raise httpx2.ConnectError(str(exc) or type(exc).__name__) from exc
        return cls(sock)

    def _wait(self, writing: bool, deadline: float) -> bool:
        """Wait until the socket is ready to write (or read); ``False`` once ``deadline``
        (``time.monotonic()`` seconds) passed first."""
        while True:
            left = deadline - time.monotonic()
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

    def send(self, views: list[Buffer], deadline: float) -> None:
        """Send ``views`` (consumed), all of it by ``deadline`` (``time.monotonic()``)."""
        for _ in self.sending(views):
            if not self._wait(True, deadline):
                raise httpx2.WriteTimeout("timed out sending the request")

    def receive(
        self, deadline: float, max_size: int, into: Into | None = None
    ) -> tuple[Response, bool]:
        """Read one response, all of it by ``deadline`` (``time.monotonic()`` seconds), its
        body at most ``max_size`` bytes (through ``into`` if given: ``connection.py``); return
        it and whether the connection may be reused.

        On a plain socket it first waits until the socket is readable: a reply is never
        there the moment its request went out, and a receive that finds nothing costs a
        system call and an exception. (Over TLS, bytes may wait in the TLS layer while the
        socket is not readable: it receives first.)"""
        if not self.tls:
            self._wait(False, deadline)  # past the deadline: the receive below says so
        steps = self.receiving(max_size, into)
        try:
            while True:
                next(steps)
                if not self._wait(False, deadline):
                    raise httpx2.ReadTimeout("timed out waiting for the whole response")
        except StopIteration as done:
            result: tuple[Response, bool] = done.value
            return result


class HTTPPool(PoolBase[BlockingConnection]):
    """Keep-alive connections to any number of origins; at most ``max_idle`` idle per origin.

    ``timeout`` (seconds) bounds each whole exchange: connecting (at most ``connect_timeout``
    of it), sending the request and receiving the whole response, however the server spaces
    its bytes. ``max_reply`` bounds a response body (bytes). Thread-safe; every call blocks.
    """

    def __init__(
        self,
        *,
        max_idle: int,
        connect_timeout: float,
        timeout: float,
        max_reply: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(
            max_idle=max_idle,
            connect_timeout=connect_timeout,
            timeout=timeout,
            max_reply=max_reply,
            tls=tls,
        )
        self._lock = threading.Lock()

    def exchange(self, exchange: Exchange) -> Response:
        """Perform ``exchange``: the whole response (not to ``HEAD``), or httpx2's error."""
        deadline = self.deadline(exchange, time.monotonic())
        views = exchange.views()
        origin = exchange.origin
        conn = self.take_idle(origin) or self.connect(origin, deadline)
        abort = exchange.abort
        if abort is not None:
            sock = conn.sock
            abort.hold(id(conn), lambda: sock.shutdown(socket.SHUT_RDWR))
        try:
            conn.send(views, deadline)
            response, reusable = conn.receive(deadline, self.reply_limit(exchange), exchange.into)
        except BaseException:
            conn.close()
            raise
        finally:
            if abort is not None:
                abort.drop(id(conn))
        self.release(origin, conn, reusable)
        return response

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
        """:meth:`exchange` of the :class:`~client_sdk._http.http11.Exchange` these make."""
        return self.exchange(
            Exchange(
                origin,
                method,
                target,
                headers,
                body,
                deadline=deadline,
                max_reply=max_reply,
                abort=abort,
            )
        )

    def take_idle(self, origin: Origin) -> BlockingConnection | None:
        """An idle connection to ``origin`` fit for reuse, now held by the caller, or ``None``
        (then :meth:`connect`). Closes the stale ones it passes over; raises
        :class:`httpx2.ConnectError` once the pool is closed."""
        with self._lock:
            if self._closed:
                raise httpx2.ConnectError("the client is closed")
            conn, stale = self._idle.take(origin, time.monotonic())
        for old in stale:
            old.close()
        return conn

    def connect(self, origin: Origin, deadline: float) -> BlockingConnection:
        """A new connection to ``origin``, held by the caller (blocks up to the connect
        timeout, and not past ``deadline``; raises :class:`httpx2.ConnectError` or
        :class:`httpx2.ConnectTimeout`)."""
        timeout = self.connect_time(origin, deadline, time.monotonic())
        return BlockingConnection.open(origin, timeout, self.tls)

    def release(self, origin: Origin, conn: BlockingConnection, reusable: bool) -> None:
        """Hand back a connection whose exchange ended: kept idle if ``reusable`` and there is
        room, closed otherwise (a connection whose exchange failed is closed, not released)."""
        if reusable:
            now = time.monotonic()
            with self._lock:
                if not self._closed and self._idle.put(origin, conn, now):
                    return
        conn.close()

    def idle_count(self, origin: Origin) -> int:
        """Connections to ``origin`` kept alive and waiting for a request."""
        with self._lock:
            return self._idle.count(origin)

    def close(self) -> None:
        """Close the idle connections; those in use close when their request ends."""
        with self._lock:
            self._closed = True
            idle = self._idle.drain()
        for conn in idle:
            conn.close()
