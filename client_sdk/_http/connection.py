"""One keep-alive HTTP/1.1 connection on a non-blocking socket, and the idle ones kept for
reuse, whoever waits for them.

The SDK's three drivers of exchanges share all of this and differ only in how they wait for a
socket: the blocking pool (``pool.py``: ``poll``), the asyncio pool (``asyncpool.py``: the event
loop) and the fan-out (``fanout.py``: one selector for all of a call's exchanges).

* :class:`Connection` holds the socket and its receive buffer. :meth:`Connection.sending` and
  :meth:`Connection.receiving` are generators that do the I/O and *yield* whenever the socket
  is not ready: the driver waits until it is writable (sending) or readable (receiving), then
  resumes them. A request's head and body buffers go out with ``sendmsg`` in slices
  (:func:`~client_sdk._http.http11.next_send`); a response is received with ``recv_into`` and
  parsed as it comes by :func:`~client_sdk._http.http11.read_response`. Over TLS (an
  ``ssl.SSLSocket``, ``tls.py``) the buffers go out one ``send`` each, and TLS's "want read /
  want write" is "not ready" like ``BlockingIOError``. A failure of the
  socket is httpx2's ``WriteError`` or ``ReadError``, which ``_transport.py`` translates.
* :meth:`Connection.reusable` is the rule for taking an idle connection again: not idle for
  :data:`~client_sdk._http.http11.IDLE_EXPIRY` seconds or more, and nothing to read (readable
  while idle means the server closed it, or sent what nobody asked).
* :class:`IdleConnections` keeps them per origin, most recently used first, at most
  ``max_idle`` each.
* :class:`PoolBase` is what both pools hold (their bounds, their idle connections, whether
  they are closed) and how they bound an exchange: its deadline, its reply's size, the time
  left to connect.

Not thread-safe: a connection serves one exchange at a time, and the blocking pool guards its
idle connections with its lock.
"""

from __future__ import annotations

import select
import socket
import ssl
from collections.abc import Callable, Generator
from typing import Generic, TypeVar

import httpx2

from .http11 import (
    HEAD_BUFFER,
    IDLE_EXPIRY,
    Buffer,
    Exchange,
    Into,
    Origin,
    Response,
    advance,
    next_send,
)
from .http11 import read_response as parse_response
from .tls import WANT

#: What a non-blocking send or receive raises for "not now".
_NOT_NOW = (BlockingIOError, InterruptedError, *WANT)

__all__ = ["CONNECT_TIMEOUT", "Connection", "IdleConnections", "PoolBase", "idle_per_shard"]

#: Connect attempts fail fast so that retries (and wait_ready) notice a shard coming up.
CONNECT_TIMEOUT = 5.0

C = TypeVar("C", bound="Connection")


def idle_per_shard(max_inflight: int) -> int:
    """Connections a client keeps idle per shard: enough for a call, ``max_inflight``
    background pushes and a long poll at the same time."""
    return max_inflight + 2


class Connection:
    """One keep-alive TCP connection, made non-blocking here. Used by one exchange at a time."""

    __slots__ = ("sock", "buf", "poller", "idle_since", "tls", "head")

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.buf = bytearray(HEAD_BUFFER)
        self.idle_since = 0.0
        #: The last reply head the direct path parsed on this connection: its bytes, status
        #: and headers (``direct.py``).
        self.head: tuple[bytes, int, dict[str, str]] | None = None
        self.poller = None
        if hasattr(select, "poll"):
            self.poller = select.poll()
            self.poller.register(sock, select.POLLIN)

    def close(self) -> None:
        self.sock.close()

    def reusable(self, now: float) -> bool:
        """Whether this idle connection may carry a request (see the module's docstring)."""
        if now - self.idle_since > IDLE_EXPIRY:
            return False
        if self.tls and self.sock.pending():  # type: ignore[attr-defined]
            return False
        if self.poller is not None:
            return not self.poller.poll(0)
        return not select.select([self.sock], [], [], 0)[0]

    def sending(self, views: list[Buffer]) -> Generator[None, None, None]:
        """Send ``views`` (see :meth:`Exchange.views <client_sdk._http.http11.Exchange.views>`;
        consumed) with as few ``sendmsg`` calls as the socket allows; yields whenever the
        socket takes no more for now (resume it once it is writable)."""
        sock = self.sock
        sendmsg = sock.sendmsg if not self.tls else lambda bufs: sock.send(bufs[0])
        first = 0
        try:
            while first < len(views):
                try:
                    first = advance(views, first, sendmsg(next_send(views, first)))
                except _NOT_NOW:
                    yield
        except OSError as exc:
            raise httpx2.WriteError(str(exc) or type(exc).__name__) from exc

    def receiving(
        self, max_size: int, into: Into | None = None
    ) -> Generator[None, None, tuple[Response, bool]]:
        """Receive one response, its body at most ``max_size`` bytes (a ``200``'s body
        through ``into`` if given: :func:`~client_sdk._http.http11.read_response`); yields
        whenever nothing is there to read (resume it once the socket is readable). Returns the
        response and whether the connection may carry another request."""
        reading = parse_response(self.buf, max_size, into)
        recv_into = self.sock.recv_into
        try:
            target = next(reading)
            while True:
                try:
                    n = recv_into(target)
                except _NOT_NOW:
                    yield
                    continue
                target = reading.send(n)
        except StopIteration as done:
            result: tuple[Response, bool] = done.value
            return result
        except OSError as exc:
            raise httpx2.ReadError(str(exc) or type(exc).__name__) from exc


class IdleConnections(Generic[C]):
    """Idle connections per origin, most recently used first, at most ``max_idle`` each."""

    def __init__(self, max_idle: int) -> None:
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int], list[C]] = {}

    def take(
        self, origin: Origin, now: float, fits: Callable[[C], bool] | None = None
    ) -> tuple[C | None, list[C]]:
        """An idle connection to ``origin`` fit for reuse (:meth:`Connection.reusable`, and
        ``fits``), now the caller's, or ``None``; and the stale ones passed over, to close."""
        idle = self._idle.get(origin.key)
        stale: list[C] = []
        while idle:
            conn = idle.pop()
            if conn.reusable(now) and (fits is None or fits(conn)):
                return conn, stale
            stale.append(conn)
        return None, stale

    def put(self, origin: Origin, conn: C, now: float) -> bool:
        """Keep ``conn`` (its exchange ended and left it reusable) if there is room; whether
        it was kept (else close it)."""
        idle = self._idle.setdefault(origin.key, [])
        if len(idle) >= self.max_idle:
            return False
        conn.idle_since = now
        idle.append(conn)
        return True

    def count(self, origin: Origin) -> int:
        """Connections to ``origin`` kept alive and waiting for a request."""
        return len(self._idle.get(origin.key, ()))

    def drain(self) -> list[C]:
        """Every idle connection, now the caller's (to close)."""
        idle, self._idle = self._idle, {}
        return [conn for conns in idle.values() for conn in conns]


class PoolBase(Generic[C]):
    """What the blocking pool and the asyncio one hold: at most ``max_idle`` idle connections
    per origin, ``connect_timeout`` seconds for a connect, ``timeout`` seconds for a whole
    exchange that has no deadline of its own, ``max_reply`` bytes of a response's body unless
    the exchange says, ``tls`` for ``https://`` origins; whether the pool is closed."""

    def __init__(
        self,
        *,
        max_idle: int,
        connect_timeout: float,
        timeout: float,
        max_reply: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        #: The TLS context of ``https://`` connections (``tls.py``).
        self.tls = tls
        self.max_idle = max_idle
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.max_reply = max_reply
        self._idle: IdleConnections[C] = IdleConnections(max_idle)
        self._closed = False

    def deadline(self, exchange: Exchange, now: float) -> float:
        """When ``exchange`` must be done (``time.monotonic()`` seconds), starting ``now``."""
        return now + self.timeout if exchange.deadline is None else exchange.deadline

    def reply_limit(self, exchange: Exchange) -> int:
        """The most bytes ``exchange``'s response body may have."""
        return self.max_reply if exchange.max_reply is None else exchange.max_reply

    def connect_time(self, origin: Origin, deadline: float, now: float) -> float:
        """Seconds a connect to ``origin`` may take: the connect timeout, not past
        ``deadline``; :class:`httpx2.ConnectTimeout` when none is left."""
        left = deadline - now
        if left <= 0:
            raise httpx2.ConnectTimeout(f"no time left to connect to {origin.host_header}")
        return min(self.connect_timeout, left)
