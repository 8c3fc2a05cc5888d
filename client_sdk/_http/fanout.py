"""One thread driving several HTTP exchanges at once: a ``PSClient`` call's requests to its shards.

A call that touches several ``http://`` shards sends one request to each. Giving each its own
thread costs every request a hand-off (a pool thread woken, the GIL passed back and forth, a
future waited on: several voluntary context switches per call, on top of the HTTP).
:func:`exchange_all` instead drives all of them
from the caller's thread over non-blocking sockets and one ``select.poll`` object: each
request's head and body buffers go out with ``sendmsg`` as its socket takes bytes, and each
reply is read into its connection's buffer, or a big body into its own preallocated buffer, as
it arrives (the connections' own sending and receiving, ``connection.py``, resumed whenever
``poll`` says their socket is ready).

The rules are the blocking pool's (``pool.py``): each exchange holds its connection alone,
taken idle from the :class:`~client_sdk._http.pool.HTTPPool` or opened anew (new connections are
opened concurrently, on the threads ``submit`` gives, since connecting blocks), and hands it
back if the reply allows reuse or closes it if the exchange failed. Each exchange has a deadline
for the whole of it (connecting, sending, the whole reply) and a bound on its reply's body; one
exchange's failure or timeout ends that exchange alone. Failures are the pool's
``httpx2`` exception classes, returned in the exchange's place for ``_transport.py`` to
translate and retry.

An exchange given an :class:`~client_sdk._abort.Abort` is cut short when it is fired (its
socket shut down: ``poll`` sees it ready, and its receive or send fails), as in the pool.

Thread-safety: :func:`exchange_all` may run in several threads at once over one pool. It blocks
until every exchange ended.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import select
import selectors
import socket
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import httpx2

from .http11 import Exchange, Response
from .pool import BlockingConnection, HTTPPool

__all__ = ["Outcome", "exchange_all"]

#: An exchange's result: the response, or the transport failure that ended it.
Outcome = Response | httpx2.HTTPError
Submit = Callable[..., "concurrent.futures.Future[BlockingConnection]"]

_POLL = getattr(select, "poll", None)
_READ, _WRITE = getattr(select, "POLLIN", 1), getattr(select, "POLLOUT", 4)


class _Flight:
    """One exchange under way on its connection: sending, then receiving."""

    __slots__ = (
        "index",
        "origin",
        "conn",
        "fd",
        "steps",
        "receiving",
        "deadline",
        "max_reply",
        "into",
    )

    def __init__(
        self,
        index: int,
        exchange: Exchange,
        conn: BlockingConnection,
        deadline: float,
        max_reply: int,
    ) -> None:
        self.index = index
        self.origin = exchange.origin
        self.conn = conn
        self.fd = -1  # its socket's, while it is waited for (_Waiting)
        self.steps: Generator[None, None, Any] | None = conn.sending(exchange.views())
        self.receiving = False
        self.deadline = deadline  # for the whole exchange
        self.max_reply = max_reply
        self.into = exchange.into

    def step(self) -> tuple[Response, bool] | None:
        """Send, or receive, what the socket takes or has now (it said it is ready); once the
        response is whole, it and whether the connection may be reused, else ``None``
        (:attr:`receiving` then says whether to wait for the socket to be readable)."""
        if self.steps is None:  # the request is out and the socket readable: receive
            self.steps = self.conn.receiving(self.max_reply, self.into)
        try:
            next(self.steps)
        except StopIteration as done:
            if self.receiving:
                result: tuple[Response, bool] = done.value
                return result
            self.receiving = True  # the whole request is out: wait until there is a reply
            self.steps = None
        return None

    def timed_out(self) -> httpx2.TimeoutException:
        if not self.receiving:
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
    held = [(exchanges[f.index].abort, f.conn) for f in flights if exchanges[f.index].abort]
    for abort, conn in held:  # fired: its socket shut down, poll sees it at once
        abort.hold(id(conn), functools.partial(conn.sock.shutdown, socket.SHUT_RDWR))  # type: ignore[union-attr]
    try:
        _fly(pool, flights, outcomes)
    except BaseException:
        for flight in flights:
            if outcomes[flight.index] is None:
                flight.conn.close()
        raise
    finally:
        for abort, conn in held:
            abort.drop(id(conn))  # type: ignore[union-attr]
    return outcomes  # type: ignore[return-value]


def _take_off(
    pool: HTTPPool, exchanges: Sequence[Exchange], submit: Submit, outcomes: list[Outcome | None]
) -> list[_Flight]:
    """A connection for every exchange that can have one: idle ones first, then new ones
    opened concurrently. An exchange that gets none has its failure in ``outcomes``."""
    conns: list[BlockingConnection | None] = []
    opening: dict[int, concurrent.futures.Future[BlockingConnection]] = {}
    now = time.monotonic()
    deadlines = [pool.deadline(e, now) for e in exchanges]
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
        _Flight(i, e, conn, deadlines[i], pool.reply_limit(e))
        for i, (e, conn) in enumerate(zip(exchanges, conns))
        if conn is not None
    ]


def _close_opened(future: concurrent.futures.Future[BlockingConnection]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


class _Waiting:
    """The flights waiting for their socket to be writable (sending) or readable (receiving),
    by file descriptor: one ``select.poll`` object, whose calls are all this needs (a
    selector where there is none, as on Windows)."""

    __slots__ = ("flights", "_poll", "_selector")

    def __init__(self) -> None:
        self.flights: dict[int, _Flight] = {}
        self._poll = _POLL() if _POLL is not None else None
        self._selector = None if _POLL is not None else selectors.SelectSelector()

    def add(self, flight: _Flight) -> None:
        fd = flight.fd = flight.conn.sock.fileno()
        self.flights[fd] = flight
        if self._poll is not None:
            self._poll.register(fd, _READ if flight.receiving else _WRITE)
        else:
            mask = selectors.EVENT_READ if flight.receiving else selectors.EVENT_WRITE
            self._selector.register(fd, mask)  # type: ignore[union-attr]

    def now_reading(self, flight: _Flight) -> None:
        if self._poll is not None:
            self._poll.modify(flight.fd, _READ)
        else:
            self._selector.modify(flight.fd, selectors.EVENT_READ)  # type: ignore[union-attr]

    def drop(self, flight: _Flight) -> None:
        del self.flights[flight.fd]
        if self._poll is not None:
            self._poll.unregister(flight.fd)
        else:
            self._selector.unregister(flight.fd)  # type: ignore[union-attr]

    def ready(self, timeout: float) -> list[_Flight]:
        """The flights whose socket is ready (or failed), waiting up to ``timeout`` seconds."""
        flights = self.flights
        if self._poll is not None:
            return [flights[fd] for fd, _ in self._poll.poll(math.ceil(max(0.0, timeout) * 1e3))]
        return [flights[key.fd] for key, _ in self._selector.select(max(0.0, timeout))]  # type: ignore[union-attr]

    def close(self) -> None:
        if self._selector is not None:
            self._selector.close()


def _fly(pool: HTTPPool, flights: list[_Flight], outcomes: list[Outcome | None]) -> None:
    """Drive the flights until each has its outcome."""
    waiting = _Waiting()
    try:
        for flight in flights:
            try:
                flight.step()
            except httpx2.HTTPError as exc:
                _fail(flight, exc, outcomes)
                continue
            waiting.add(flight)
        pending = waiting.flights
        while pending:
            soonest = min(flight.deadline for flight in pending.values())
            ready = waiting.ready(soonest - time.monotonic())
            now = time.monotonic()
            for flight in ready:
                sending = not flight.receiving
                try:
                    result = flight.step()
                    if sending:
                        if flight.receiving:
                            waiting.now_reading(flight)
                        continue
                except httpx2.HTTPError as exc:
                    waiting.drop(flight)
                    _fail(flight, exc, outcomes)
                    continue
                if result is not None:
                    waiting.drop(flight)
                    outcomes[flight.index] = result[0]
                    pool.release(flight.origin, flight.conn, result[1])
            for flight in [flight for flight in pending.values() if flight.deadline <= now]:
                waiting.drop(flight)
                _fail(flight, flight.timed_out(), outcomes)
    finally:
        waiting.close()


def _fail(flight: _Flight, exc: httpx2.HTTPError, outcomes: list[Outcome | None]) -> None:
    flight.conn.close()
    outcomes[flight.index] = exc
