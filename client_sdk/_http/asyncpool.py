"""Keep-alive connections to ``http://`` shards on the running event loop: :class:`AsyncHTTPPool`.

The asyncio twin of ``_pool.py`` (for ``AsyncPSClient``), sharing its HTTP with it
(``_http11.py``). Sockets are non-blocking and used directly: a send or receive is attempted at
once, and only when the socket is not ready does the request wait on the loop, for readiness
(``loop.add_reader``/``add_writer``, with a timer for what is left of the exchange's deadline),
so a small request that the shard answers quickly costs no more than a couple of awaits, and
the timeout bounds the whole exchange (connect, request, whole reply) however the server spaces
its bytes. Bodies go out with ``sendmsg`` of
their own buffers and come in with ``recv_into`` straight into their final buffer, as in the
blocking pool. Needs a loop with ``add_reader`` (asyncio's selector loops and uvloop; not the
Windows proactor loop, for which ``_transport.py`` uses httpx2).

Not thread-safe: use a pool from the one event loop that runs its client.
"""

from __future__ import annotations

import asyncio
import select
import socket
import time
from collections.abc import Mapping, Sequence

import httpx2

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

__all__ = ["AsyncHTTPPool"]


def _ready(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _expired(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class _AsyncConnection:
    """One keep-alive TCP connection, non-blocking. Used by one request at a time."""

    __slots__ = ("sock", "fd", "buf", "loop", "poller", "idle_since")

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.loop = loop
        self.buf = bytearray(HEAD_BUFFER)
        self.idle_since = 0.0
        self.poller = None
        if hasattr(select, "poll"):
            self.poller = select.poll()
            self.poller.register(sock, select.POLLIN)

    @classmethod
    async def open(cls, origin: Origin, timeout: float | None) -> _AsyncConnection:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(origin.host, origin.port, type=socket.SOCK_STREAM), timeout
            )
            error: OSError | None = None
            for family, kind, proto, _, address in infos:
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                try:
                    await asyncio.wait_for(loop.sock_connect(sock, address), timeout)
                except BaseException as exc:
                    sock.close()
                    if not isinstance(exc, OSError) or isinstance(exc, TimeoutError):
                        raise
                    error = exc
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return cls(sock, loop)
            raise error or OSError(f"no address for {origin.host_header}")
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise httpx2.ConnectTimeout(f"timed out connecting to {origin.host_header}") from exc
        except OSError as exc:
            raise httpx2.ConnectError(str(exc) or type(exc).__name__) from exc

    def close(self) -> None:
        self.sock.close()

    def reusable(self, now: float) -> bool:
        """See ``_pool.Connection.reusable``."""
        if now - self.idle_since > IDLE_EXPIRY:
            return False
        if self.poller is not None:
            return not self.poller.poll(0)
        return not select.select([self.sock], [], [], 0)[0]

    async def _wait(self, writing: bool, deadline: float) -> None:
        """Until the socket is ready to write (or read); ``TimeoutError`` once ``deadline``
        (``time.monotonic()`` seconds) passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError()
        loop = self.loop
        fut = loop.create_future()
        if writing:
            loop.add_writer(self.fd, _ready, fut)
        else:
            loop.add_reader(self.fd, _ready, fut)
        timer = loop.call_later(left, _expired, fut)
        try:
            await fut
        finally:
            if writing:
                loop.remove_writer(self.fd)
            else:
                loop.remove_reader(self.fd)
            timer.cancel()

    async def send(self, head: bytes, body: Sequence[Buffer], deadline: float) -> None:
        """See ``_pool.Connection.send``."""
        views = [head, *body]
        sock = self.sock
        first = 0
        try:
            while first < len(views):
                try:
                    sent = sock.sendmsg(next_send(views, first))
                except (BlockingIOError, InterruptedError):
                    await self._wait(True, deadline)
                    continue
                first = advance(views, first, sent)
        except TimeoutError as exc:
            raise httpx2.WriteTimeout("timed out sending the request") from exc
        except OSError as exc:
            raise httpx2.WriteError(str(exc) or type(exc).__name__) from exc

    async def receive(self, deadline: float, max_size: int) -> tuple[Response, bool]:
        """See ``_pool.Connection.receive``."""
        reading = read_response(self.buf, max_size)
        recv_into = self.sock.recv_into
        try:
            target = next(reading)
            while True:
                try:
                    n = recv_into(target)
                except (BlockingIOError, InterruptedError):
                    await self._wait(False, deadline)
                    continue
                target = reading.send(n)
        except StopIteration as done:
            result: tuple[Response, bool] = done.value
            return result
        except TimeoutError as exc:
            raise httpx2.ReadTimeout("timed out waiting for the whole response") from exc
        except OSError as exc:
            raise httpx2.ReadError(str(exc) or type(exc).__name__) from exc


class AsyncHTTPPool:
    """The asyncio twin of :class:`~client_sdk._pool.HTTPPool`: the same arguments and
    behaviour, ``await``-ed. Use it from one event loop."""

    def __init__(
        self, *, max_idle: int, connect_timeout: float, timeout: float, max_reply: int
    ) -> None:
        self.max_idle = max_idle
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.max_reply = max_reply
        self._idle: dict[tuple[str, int], list[_AsyncConnection]] = {}
        self._closed = False

    async def request(
        self,
        origin: Origin,
        method: str,
        target: str,
        headers: Mapping[str, str] | None,
        body: Sequence[Buffer] = (),
        *,
        deadline: float | None = None,
        max_reply: int | None = None,
    ) -> Response:
        """See :meth:`client_sdk._pool.HTTPPool.request`."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        head = request_head(origin, method, target, headers)
        conn = await self._acquire(origin, deadline)
        try:
            await conn.send(head, body, deadline)
            response, reusable = await conn.receive(
                deadline, self.max_reply if max_reply is None else max_reply
            )
        except BaseException:  # cancelled too: the connection is mid-exchange
            conn.close()
            raise
        self._release(origin, conn, reusable)
        return response

    async def _acquire(self, origin: Origin, deadline: float) -> _AsyncConnection:
        if self._closed:
            raise httpx2.ConnectError("the client is closed")
        idle = self._idle.get(origin.key)
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        while idle:
            conn = idle.pop()
            if conn.loop is loop and conn.reusable(now):
                return conn
            conn.close()
        left = deadline - time.monotonic()
        if left <= 0:
            raise httpx2.ConnectTimeout(f"no time left to connect to {origin.host_header}")
        return await _AsyncConnection.open(origin, min(self.connect_timeout, left))

    def _release(self, origin: Origin, conn: _AsyncConnection, reusable: bool) -> None:
        if reusable and not self._closed:
            idle = self._idle.setdefault(origin.key, [])
            if len(idle) < self.max_idle:
                conn.idle_since = time.monotonic()
                idle.append(conn)
                return
        conn.close()

    def idle_count(self, origin: Origin) -> int:
        """Connections to ``origin`` kept alive and waiting for a request."""
        return len(self._idle.get(origin.key, ()))

    async def close(self) -> None:
        """Close the idle connections; those in use close when their request ends."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
