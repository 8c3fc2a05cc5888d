"""One exchange over the blocking pool's connections, driven from the calling thread with as
little Python as HTTP allows: the SDK's direct path (``client_sdk/_direct.py``).

:func:`exchange` sends the request's buffers as they are given (the head already made, so a
caller that sends the same request again and again builds it once) with one ``sendmsg``, then
receives the reply into the connection's buffer with one ``recv_into`` and parses it in place
when it is the common case: a whole ``HTTP/1.1 200`` head with a ``Content-Length`` body and
nothing asking to close (a head of the same bytes as the last one parsed here on that connection
is not parsed again: its status and headers are that one's, the same ``dict``, which no reader
of a reply changes; the heads of a shard's replies to one call repeated differ only where the
date, the state version or the body's size does). Its body is then received straight into one
buffer of its size, or through the exchange's receiver (:class:`~client_sdk._http.http11.Into`:
a step group's values into its flat buffer). Anything else (another status, a head split across
receives, a chunked body) is handed, with the bytes already received, to the general parser
(:func:`~client_sdk._http.http11.read_response`), so every reply is read and refused exactly as
the pools read and refuse it.

:func:`exchange_all` does the same for a call's requests to several shards over idle
connections: all sent, then all replies read in order, from the calling thread with no
per-exchange objects (the fanout, ``fanout.py``, takes the calls it does not: a connection to
open, a request too big to go out at once, one that can be aborted).

Deadlines, reuse and failures are the blocking pool's (``pool.py``): the socket is waited for
(``poll``) only when it is not ready and never past the exchange's deadline; a connection whose
exchange failed is closed; failures are httpx2's exception classes. Plain ``http://`` only
(over TLS the pools' own exchanges are used). Blocks; thread-safe as the pool is.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import httpx2

from .connection import _NOT_NOW
from .http11 import Buffer, Into, Origin, ReplyTooLarge, Response, _parse_head, body_buffer
from .http11 import read_response as parse_response
from .pool import BlockingConnection, HTTPPool

__all__ = ["FIRST_RECEIVE", "MAX_SENT_AT_ONCE", "exchange", "exchange_all"]

_CRLF2 = b"\r\n\r\n"
#: The first receive of a reply that has a receiver takes at most this many bytes (its head and
#: the start of its body), so that the rest goes from the socket straight where the receiver
#: says rather than through the connection's buffer.
FIRST_RECEIVE = 8192


def exchange(
    pool: HTTPPool,
    origin: Origin,
    views: list[Buffer],
    deadline: float,
    max_reply: int,
    into: Into | None = None,
) -> Response:
    """Send ``views`` (the request's head, then its body's buffers; consumed) to ``origin``
    and return the whole response, all of it by ``deadline`` (``time.monotonic()`` seconds),
    its body at most ``max_reply`` bytes (a ``200``'s through ``into`` if given). Raises
    httpx2's errors as :meth:`HTTPPool.exchange <client_sdk._http.pool.HTTPPool.exchange>`."""
    conn = pool.take_idle(origin) or pool.connect(origin, deadline)
    try:
        _send(conn, views, deadline)
        response, reusable = _receive(conn, deadline, max_reply, into)
    except BaseException:
        conn.close()
        raise
    pool.release(origin, conn, reusable)
    return response


#: :func:`exchange_all` takes requests of at most this many bytes (head and body), which a
#: socket mostly takes whole in one ``sendmsg``; bigger ones go side by side through the
#: fanout (``fanout.py``).
MAX_SENT_AT_ONCE = 1 << 20


def exchange_all(
    pool: HTTPPool,
    exchanges: Sequence[tuple[Origin, list[Buffer], float, int, Into | None]],
) -> list[Response | httpx2.HTTPError] | None:
    """Several exchanges ``(origin, views, deadline, max_reply, into)``, as :func:`exchange`
    each, over idle connections: every request offered to its socket with one ``sendmsg``
    (what a socket did not take is sent after that, request by request), then every reply
    received, in the same order (the shards work on theirs meanwhile; a reply there already is
    read without waiting). Each outcome is the response, or the failure that ended that
    exchange alone (its connection closed). ``None``, with nothing sent, when an origin has no
    idle connection or a request is bigger than :data:`MAX_SENT_AT_ONCE`: the caller then uses
    the fanout (``fanout.py``), which opens connections concurrently and sends big requests
    side by side."""
    if any(sum(len(v) for v in views) > MAX_SENT_AT_ONCE for _, views, *_ in exchanges):
        return None
    conns: list[BlockingConnection] = []
    try:
        for origin, *_ in exchanges:
            conn = pool.take_idle(origin)
            if conn is None:
                break
            conns.append(conn)
    except httpx2.HTTPError:
        pass
    if len(conns) < len(exchanges):
        for (origin, *_), conn in zip(exchanges, conns):
            pool.release(origin, conn, True)  # not used: still fit for reuse
        return None
    outcomes: list[Response | httpx2.HTTPError | None] = [None] * len(exchanges)
    try:
        rests = [_offer(conn, views) for (_, views, *_), conn in zip(exchanges, conns)]
        for i, (rest, conn) in enumerate(zip(rests, conns)):
            try:
                if isinstance(rest, httpx2.HTTPError):
                    raise rest
                if rest:
                    conn.send(rest, exchanges[i][2])
            except httpx2.HTTPError as exc:
                conn.close()
                outcomes[i] = exc
        for i, ((origin, _, deadline, max_reply, into), conn) in enumerate(zip(exchanges, conns)):
            if outcomes[i] is not None:
                continue
            try:
                response, reusable = _receive(conn, deadline, max_reply, into, ready=i > 0)
            except httpx2.HTTPError as exc:
                conn.close()
                outcomes[i] = exc
                continue
            outcomes[i] = response
            pool.release(origin, conn, reusable)
    except BaseException:
        for outcome, conn in zip(outcomes, conns):
            if outcome is None:
                conn.close()
        raise
    return outcomes  # type: ignore[return-value]


def _offer(conn: BlockingConnection, views: list[Buffer]) -> list[Buffer] | httpx2.HTTPError:
    """One ``sendmsg`` of ``views``: what the socket did not take (``[]``: all of it), or the
    failure."""
    try:
        sent = conn.sock.sendmsg(views)
    except _NOT_NOW:
        sent = 0
    except OSError as exc:
        error = httpx2.WriteError(str(exc) or type(exc).__name__)
        error.__cause__ = exc
        return error
    for i, view in enumerate(views):
        n = len(view)
        if sent < n:
            return [memoryview(view)[sent:], *views[i + 1 :]]
        sent -= n
    return []


def _send(conn: BlockingConnection, views: list[Buffer], deadline: float) -> None:
    rest = _offer(conn, views)
    if isinstance(rest, httpx2.HTTPError):
        raise rest
    if rest:
        conn.send(rest, deadline)


def _recv(conn: BlockingConnection, into: memoryview, deadline: float, ready: bool = True) -> int:
    """One ``recv_into`` (0: the server closed the connection), tried at once if ``ready``,
    else once the socket is readable (a reply is never there the moment its request left:
    a receive that finds nothing costs a system call and an exception)."""
    recv_into = conn.sock.recv_into
    while True:
        if not ready and not conn._wait(False, deadline):
            raise httpx2.ReadTimeout("timed out waiting for the whole response")
        try:
            return recv_into(into)
        except _NOT_NOW:
            ready = False
        except OSError as exc:
            raise httpx2.ReadError(str(exc) or type(exc).__name__) from exc


def _receive(
    conn: BlockingConnection,
    deadline: float,
    max_size: int,
    into: Into | None,
    ready: bool = False,
) -> tuple[Response, bool]:
    """The response (and whether the connection may be reused); ``ready``: try a receive
    before waiting for the socket (the reply may be there already)."""
    buf = conn.buf
    view = memoryview(buf)
    n = _recv(conn, view if into is None else view[:FIRST_RECEIVE], deadline, ready=ready)
    at = buf.find(_CRLF2, 0, n)
    if at < 0 or not buf.startswith(b"HTTP/1.1 200 "):
        return _general(conn, n, deadline, max_size, into)
    raw = bytes(view[:at])
    kept = conn.head
    if kept is not None and kept[0] == raw:
        status, headers = kept[1], kept[2]
    else:
        status, _, headers = _parse_head(raw)
        conn.head = (raw, status, headers)
    length = headers.get("content-length")
    if (
        length is None
        or not length.isdigit()
        or "transfer-encoding" in headers
        or "connection" in headers
    ):
        return _general(conn, n, deadline, max_size, into)
    size = int(length)
    if size > max_size:
        raise ReplyTooLarge(size, max_size, declared=True)
    start = at + 4
    have = n - start
    if have >= size:
        return Response(status, headers, bytes(view[start : start + size])), have == size
    if into is not None:
        return Response(status, headers, _into(conn, into, view[start:n], size, deadline)), True
    content = body_buffer(size)
    content[:have] = view[start:n]
    while have < size:
        got = _recv(conn, content[have:], deadline)
        if got == 0:
            raise httpx2.RemoteProtocolError(
                f"the server closed the connection after {have} of {size} body bytes"
            )
        have += got
    return Response(status, headers, content), True


def _into(
    conn: BlockingConnection, into: Into, got: memoryview, size: int, deadline: float
) -> Buffer:
    steps = into.receive(got, size)
    pos = len(got)
    try:
        target = next(steps)
        while True:
            n = _recv(conn, target, deadline)
            if n == 0:
                raise httpx2.RemoteProtocolError(
                    f"the server closed the connection after {pos} of {size} body bytes"
                )
            pos += n
            target = steps.send(n)
    except StopIteration as done:
        content: Buffer = done.value
        return content


def _general(
    conn: BlockingConnection, n: int, deadline: float, max_size: int, into: Into | None
) -> tuple[Response, bool]:
    """The response read by the general parser, which is given the ``n`` bytes already in
    the connection's buffer as if it had received them itself."""
    reading: Generator[memoryview, int, Any] = parse_response(conn.buf, max_size, into)
    try:
        next(reading)  # the whole buffer, where the n bytes are
        target = reading.send(n)
        while True:
            target = reading.send(_recv(conn, target, deadline))
    except StopIteration as done:
        result: tuple[Response, bool] = done.value
        return result
