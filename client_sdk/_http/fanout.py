"""One thread driving several HTTP exchanges at once: a ``PSClient`` call's requests to its shards.

A call that touches several ``http://`` shards sends one request to each. Giving each its own
thread costs every request a hand-off (a pool thread woken, the GIL passed back and forth, a
future waited on: several voluntary context switches per call, on top of the HTTP).
:func:`exchange_all` instead drives all of them
from the caller's thread over non-blocking sockets and one :mod:`selectors` selector: each
request's head and body buffers go out with ``sendmsg`` as its socket takes bytes, and each
reply is read (by :func:`client_sdk._http11.read_response`, as in the blocking pool) into its
connection's buffer, or a big body into its own preallocated buffer, as it arrives.

The rules are the blocking pool's (``_pool.py``): each exchange holds its connection alone,
taken idle from the :class:`~client_sdk._pool.HTTPPool` or opened anew (new connections are
opened concurrently, on the threads ``submit`` gives, since connecting blocks), and hands it
back if the reply allows reuse or closes it if the exchange failed. Each exchange has a deadline
for the whole of it (connecting, sending, the whole reply) and a bound on its reply's body; one
exchange's failure or timeout ends that exchange alone. Failures are the pool's
``httpx2`` exception classes, returned in the exchange's place for ``_transport.py`` to
translate and retry.

Thread-safety: :func:`exchange_all` may run in several threads at once over one pool. It blocks
until every exchange ended.
"""

from __future__ import annotations

import concurrent.futures
import selectors
import time
from collections.abc import Callable, Mapping, Sequence

import httpx2

from .http11 import (
    Buffer,
    Origin,
    Reading,
    Response,
    advance,
    next_send,
    read_response,
    request_head,
)
from .pool import Connection, HTTPPool

__all__ = ["Exchange", "Outcome", "exchange_all"]

#: An exchange's result: the response, or the transport failure that ended it.
Outcome = Response | httpx2.HTTPError
Submit = Callable[..., "concurrent.futures.Future[Connection]"]

_Selector = getattr(selectors, "PollSelector", selectors.SelectSelector)


class Exchange:
    """One request to send: what :meth:`HTTPPool.request <client_sdk._pool.HTTPPool.request>`
    takes, as a value (``deadline``, ``max_reply``: ``None`` for the pool's)."""

    __slots__ = ("origin", "method", "target", "headers", "body", "deadline", "max_reply")

    def __init__(
        self,
        origin: Origin,
        method: str,
        target: str,
        headers: Mapping[str, str] | None,
        body: Sequence[Buffer] = (),
        *,
        deadline: float | None = None,
        max_reply: int | None = None,
    ) -> None:
        self.origin = origin
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self.deadline = deadline
        self.max_reply = max_reply


class _Flight:
    """One exchange under way on its connection: sending, then reading."""

    __slots__ = (
        "index",
        "origin",
        "conn",
        "views",
        "first",
        "reading",
        "into",
        "deadline",
        "max_reply",
    )

    def __init__(
        self, index: int, exchange: Exchange, conn: Connection, deadline: float, max_reply: int
    ) -> None:
        self.index = index
        self.origin = exchange.origin
        self.conn = conn
        head = request_head(exchange.origin, exchange.method, exchange.target, exchange.headers)
        self.views: list[Buffer] = [head, *exchange.body]
        self.first = 0
        self.reading: Reading | None = None
        self.into: memoryview | None = None
        self.deadline = deadline  # for the whole exchange
        self.max_reply = max_reply

    def send_some(self) -> bool:
        """Send what the socket takes now; whether the whole request is out."""
        views, sendmsg = self.views, self.conn.sock.sendmsg
        first = self.first
        try:
            while first < len(views):
                first = advance(views, first, sendmsg(next_send(views, first)))
        except (BlockingIOError, InterruptedError):
            self.first = first
            return False
        except OSError as exc:
            raise httpx2.WriteError(str(exc) or type(exc).__name__) from exc
        self.first = first
        self.reading = read_response(self.conn.buf, self.max_reply)
        self.into = next(self.reading)
        return True

    def receive_some(self) -> tuple[Response, bool] | None:
        """Receive what has arrived; the response and whether the connection may be reused
        once it is whole, else ``None``."""
        assert self.reading is not None and self.into is not None
        try:
            n = self.conn.sock.recv_into(self.into)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            raise httpx2.ReadError(str(exc) or type(exc).__name__) from exc
        try:
            self.into = self.reading.send(n)
        except StopIteration as done:
            result: tuple[Response, bool] = done.value
            return result
        return None

    def timed_out(self) -> httpx2.TimeoutException:
        if self.reading is None:
            return httpx2.WriteTimeout("timed out sending the request")
        return httpx2.ReadTimeout("timed out waiting for the whole response")


def exchange_all(pool: HTTPPool, exchanges: Sequence[Exchange], submit: Submit) -> list[Outcome]:
    """Perform every exchange, all at once on this thread; return their outcomes in order.

    ``submit`` (e.g. an executor's) runs a blocking call on another thread; it opens new
    connections. Blocks until every exchange ended. Errors other than ``httpx2``'s (bugs,
    ``KeyboardInterrupt``) close every connection still in use and propagate.
    """
    outcomes: list[Outcome | None] = [None] * len(exchanges)
    flights = _take_off(pool, exchanges, submit, outcomes)
    try:
        _fly(pool, flights, outcomes)
    except BaseException:
        for flight in flights:
            if outcomes[flight.index] is None:
                flight.conn.close()
        raise
    return outcomes  # type: ignore[return-value]


def _take_off(
    pool: HTTPPool, exchanges: Sequence[Exchange], submit: Submit, outcomes: list[Outcome | None]
) -> list[_Flight]:
    """A connection for every exchange that can have one: idle ones first, then new ones
    opened concurrently. An exchange that gets none has its failure in ``outcomes``."""
    conns: list[Connection | None] = []
    opening: dict[int, concurrent.futures.Future[Connection]] = {}
    now = time.monotonic()
    deadlines = [now + pool.timeout if e.deadline is None else e.deadline for e in exchanges]
    try:
        for i, exchange in enumerate(exchanges):
            conn = None
            try:
                conn = pool.take_idle(exchange.origin)
                if conn is None:
                    opening[i] = submit(pool.connect, exchange.origin, deadlines[i])
            except httpx2.HTTPError as exc:
                outcomes[i] = exc
            conns.append(conn)
        for i, future in opening.items():
            try:
                conns[i] = future.result()
            except httpx2.HTTPError as exc:
                outcomes[i] = exc
    except BaseException:
        for future in opening.values():
            future.add_done_callback(_close_opened)
        for conn in conns:
            if conn is not None:
                conn.close()
        raise
    return [
        _Flight(i, e, conn, deadlines[i], pool.max_reply if e.max_reply is None else e.max_reply)
        for i, (e, conn) in enumerate(zip(exchanges, conns))
        if conn is not None
    ]


def _close_opened(future: concurrent.futures.Future[Connection]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


def _fly(pool: HTTPPool, flights: list[_Flight], outcomes: list[Outcome | None]) -> None:
    """Drive the flights until each has its outcome."""
    with _Selector() as selector:
        for flight in flights:
            try:
                sent = flight.send_some()
            except httpx2.HTTPError as exc:
                _fail(flight, exc, outcomes)
                continue
            selector.register(
                flight.conn.sock, selectors.EVENT_READ if sent else selectors.EVENT_WRITE, flight
            )
        pending = selector.get_map()
        while pending:
            soonest = min(key.data.deadline for key in pending.values())
            ready = selector.select(max(0.0, soonest - time.monotonic()))
            now = time.monotonic()
            for key, _ in ready:
                flight = key.data
                try:
                    if flight.reading is None:
                        if flight.send_some():
                            selector.modify(key.fileobj, selectors.EVENT_READ, flight)
                        continue
                    result = flight.receive_some()
                except httpx2.HTTPError as exc:
                    selector.unregister(key.fileobj)
                    _fail(flight, exc, outcomes)
                    continue
                if result is not None:
                    selector.unregister(key.fileobj)
                    outcomes[flight.index] = result[0]
                    pool.release(flight.origin, flight.conn, result[1])
            for key in [key for key in pending.values() if key.data.deadline <= now]:
                selector.unregister(key.fileobj)
                _fail(key.data, key.data.timed_out(), outcomes)


def _fail(flight: _Flight, exc: httpx2.HTTPError, outcomes: list[Outcome | None]) -> None:
    flight.conn.close()
    outcomes[flight.index] = exc
