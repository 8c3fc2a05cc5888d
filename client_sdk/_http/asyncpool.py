"""Keep-alive connections to ``http://`` shards on the running event loop: :class:`AsyncHTTPPool`.

The asyncio twin of ``pool.py`` (for ``AsyncPSClient``), sharing its connections' I/O and reuse
(``connection.py``) and its HTTP (``http11.py``). Sockets are non-blocking and used directly: a
send or receive is attempted at once, and only when the socket is not ready does the exchange
wait on the loop, for readiness (``loop.add_reader``/``add_writer``, with a timer for what is
left of the exchange's deadline), so a small request that the shard answers quickly costs no
more than a couple of awaits, and the timeout bounds the whole exchange (connect, request,
whole reply) however the server spaces its bytes. Needs a loop with ``add_reader`` (asyncio's
selector loops and uvloop; not the Windows proactor loop, for which ``_transport.py`` uses
httpx2).

An exchange given an :class:`~client_sdk._abort.Abort` is cut short when it is fired: its
socket shut down, the wait on it ends and its receive (or send) fails.

Not thread-safe: use a pool from the one event loop that runs its client.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Generator, Mapping, Sequence

import httpx2

from .._abort import Abort
from .connection import CONNECT_TIMEOUT, Connection, PoolBase
from .http11 import Buffer, Exchange, Into, Origin, Response
from .tls import context, refused

__all__ = ["AsyncConnection", "AsyncHTTPPool", "Begun"]


def _socket_ready(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _expired(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class AsyncConnection(Connection):
    """A :class:`~client_sdk._http.connection.Connection` whose waits are the event loop's.
    Used by one exchange at a time, on the loop that opened it."""

    __slots__ = ("fd", "loop")

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(sock)
        self.fd = sock.fileno()
        self.loop = loop

    @classmethod
    async def open(
        cls, origin: Origin, timeout: float | None, tls: ssl.SSLContext | None = None
    ) -> AsyncConnection:
        """A new connection (with ``tls`` for an ``https://`` origin: its handshake done)."""
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
                if not origin.tls:
                    return cls(sock, loop)
                return await cls._handshake(sock, loop, origin, tls or context(True), timeout)
            raise error or OSError(f"no address for {origin.host_header}")
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise httpx2.ConnectTimeout(f"timed out connecting to {origin.host_header}") from exc
        except OSError as exc:
            raise httpx2.ConnectError(str(exc) or type(exc).__name__) from exc

    @classmethod
    async def _handshake(
        cls,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        origin: Origin,
        tls: ssl.SSLContext,
        timeout: float | None,
    ) -> AsyncConnection:
        """The connection over ``sock`` once its TLS handshake is done, by ``timeout``."""
        try:
            wrapped = tls.wrap_socket(
                sock, server_hostname=origin.host, do_handshake_on_connect=False
            )
        except BaseException:
            sock.close()
            raise
        conn = cls(wrapped, loop)
        deadline = time.monotonic() + (timeout if timeout is not None else CONNECT_TIMEOUT)
        try:
            while True:
                try:
                    wrapped.do_handshake()
                    return conn
                except ssl.SSLWantReadError:
                    await conn._wait(False, deadline)
                except ssl.SSLWantWriteError:
                    await conn._wait(True, deadline)
        except ssl.SSLCertVerificationError as exc:
            conn.close()
            raise refused(origin.url, exc) from None
        except BaseException:
            conn.close()
            raise

    async def _wait(self, writing: bool, deadline: float) -> None:
        """Until the socket is ready to write (or read); ``TimeoutError`` once ``deadline``
        (``time.monotonic()`` seconds) passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError()
        loop = self.loop
        fut = loop.create_future()
        if writing:
            loop.add_writer(self.fd, _socket_ready, fut)
        else:
            loop.add_reader(self.fd, _socket_ready, fut)
        timer = loop.call_later(left, _expired, fut)
        try:
            await fut
        finally:
            if writing:
                loop.remove_writer(self.fd)
            else:
                loop.remove_reader(self.fd)
            timer.cancel()

    async def send(self, views: list[Buffer], deadline: float) -> None:
        """See :meth:`client_sdk._http.pool.BlockingConnection.send`."""
        await self.send_rest(self.sending(views), deadline)

    async def send_rest(self, sending: Generator[None, None, None], deadline: float) -> None:
        """Drive :meth:`~client_sdk._http.connection.Connection.sending` to the end (waiting
        first: it yielded, so the socket took no more for now)."""
        for _ in sending:
            try:
                await self._wait(True, deadline)
            except TimeoutError as exc:
                raise httpx2.WriteTimeout("timed out sending the request") from exc

    async def receive(
        self, deadline: float, max_size: int, into: Into | None = None
    ) -> tuple[Response, bool]:
        """See :meth:`client_sdk._http.pool.BlockingConnection.receive`."""
        steps = self.receiving(max_size, into)
        try:
            while True:
                next(steps)
                try:
                    await self._wait(False, deadline)
                except TimeoutError as exc:
                    raise httpx2.ReadTimeout("timed out waiting for the whole response") from exc
        except StopIteration as done:
            result: tuple[Response, bool] = done.value
            return result


class Begun:
    """An exchange :meth:`AsyncHTTPPool.begin` started: its connection (``None``: none was
    idle, nothing sent yet), the rest of its sending (``None``: all sent, or nothing yet), or
    the error that stopped it."""

    __slots__ = ("exchange", "deadline", "views", "conn", "sending", "error")

    def __init__(self, exchange: Exchange, deadline: float) -> None:
        self.exchange = exchange
        self.deadline = deadline
        self.views = exchange.views()
        self.conn: AsyncConnection | None = None
        self.sending: Generator[None, None, None] | None = None
        self.error: BaseException | None = None


def _hold(abort: Abort, conn: AsyncConnection) -> None:
    """Cut ``conn`` short when ``abort`` is fired: its socket shut down, so that the loop
    finds it ready and its receive (or send) fails."""
    sock = conn.sock
    abort.hold(id(conn), lambda: sock.shutdown(socket.SHUT_RDWR))


class AsyncHTTPPool(PoolBase[AsyncConnection]):
    """The asyncio twin of :class:`~client_sdk._http.pool.HTTPPool`: the same arguments and
    behaviour, ``await``-ed. Use it from one event loop."""

    async def exchange(self, exchange: Exchange) -> Response:
        """See :meth:`client_sdk._http.pool.HTTPPool.exchange`."""
        return await self.finish(self.begin(exchange))

    def begin(self, exchange: Exchange) -> Begun:
        """Start ``exchange`` now, without waiting: on an idle connection, send as much of the
        request as the socket takes at once. Never raises: a failure is :meth:`finish`'s to
        raise. Hand the result to :meth:`finish` (only it returns the connection); on the
        event loop that uses the pool."""
        deadline = self.deadline(exchange, time.monotonic())
        begun = Begun(exchange, deadline)
        if self._closed:
            return begun
        try:
            loop = asyncio.get_running_loop()
            conn, stale = self._idle.take(
                exchange.origin, time.monotonic(), lambda c: c.loop is loop
            )
            for old in stale:
                old.close()
            if conn is None:
                return begun
            begun.conn = conn
            begun.sending = conn.sending(begun.views)
            next(begun.sending)
        except StopIteration:
            begun.sending = None  # all of it sent
        except BaseException as exc:
            if begun.conn is not None:
                begun.conn.close()
            begun.error = exc
        return begun

    async def finish(self, begun: Begun) -> Response:
        """The response to an exchange :meth:`begin` started: the rest of the request sent
        (on a new connection if it found no idle one), the whole response received."""
        if begun.error is not None:
            raise begun.error
        exchange, deadline, views = begun.exchange, begun.deadline, begun.views
        origin = exchange.origin
        conn = begun.conn
        abort = exchange.abort
        try:
            if conn is None:
                conn = await self._acquire(origin, deadline)
                if abort is not None:
                    _hold(abort, conn)
                await conn.send(views, deadline)
            else:
                if abort is not None:
                    _hold(abort, conn)
                if begun.sending is not None:
                    await conn.send_rest(begun.sending, deadline)
            response, reusable = await conn.receive(
                deadline, self.reply_limit(exchange), exchange.into
            )
        except BaseException:  # cancelled too: the connection is mid-exchange
            if conn is not None:
                conn.close()
            raise
        finally:
            if abort is not None and conn is not None:
                abort.drop(id(conn))
        if reusable and not self._closed and self._idle.put(origin, conn, time.monotonic()):
            return response
        conn.close()
        return response

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
        """:meth:`exchange` of the :class:`~client_sdk._http.http11.Exchange` these make."""
        return await self.exchange(
            Exchange(origin, method, target, headers, body, deadline=deadline, max_reply=max_reply)
        )

    async def _acquire(self, origin: Origin, deadline: float) -> AsyncConnection:
        if self._closed:
            raise httpx2.ConnectError("the client is closed")
        loop = asyncio.get_running_loop()
        conn, stale = self._idle.take(origin, time.monotonic(), lambda c: c.loop is loop)
        for old in stale:
            old.close()
        if conn is not None:
            return conn
        timeout = self.connect_time(origin, deadline, time.monotonic())
        return await AsyncConnection.open(origin, timeout, self.tls)

    def idle_count(self, origin: Origin) -> int:
        """Connections to ``origin`` kept alive and waiting for a request."""
        return self._idle.count(origin)

    async def close(self) -> None:
        """Close the idle connections; those in use close when their request ends."""
        self._closed = True
        for conn in self._idle.drain():
            conn.close()
