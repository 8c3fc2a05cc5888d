"""What a shard's HTTP connection may cost before its request is whole: the head's size, and
deadlines for an unfinished head and for a body that stops arriving.

uvicorn bounds neither on its httptools protocol: httptools keeps a header value in memory
until its line ends, however long, and a connection that sends half a head, or a head and part
of a body, stays open for as long as the client likes (uvicorn's only timer, keep-alive, runs
between requests). A body that stalls also keeps the admission it was granted
(:mod:`server.admission`). :class:`ReadGuard`, mixed into both of the shard's protocols
(:class:`server.httptools_protocol.ShardHttpProtocol` on httptools, :class:`GuardedH11Protocol` on
h11), enforces :class:`EdgeLimits`:

* **Head size.** A head (request line and headers) above ``max_head_bytes`` is answered 400
  ``bad_request`` and the connection closed. On httptools the head is measured as it is
  parsed, and one still unfinished is refused as soon as what arrived of it passes the bound
  (so at most one socket read more is held); h11 enforces the same bound on a head still
  incomplete (``h11_max_incomplete_event_size``), and :class:`GuardedH11Protocol` on a head
  that arrived whole.
* **Head deadline.** A connection must complete each request head within ``head_timeout``
  seconds of its first byte (a new connection: of its opening); else it is closed.
* **Body deadline.** While the shard waits for a request body, every ``body_timeout`` seconds
  must bring at least ``body_timeout * min_body_rate`` bytes of it (at least one); else the
  connection is closed, and the app sees the client go away (its admission is released).
  A window in which the shard stopped reading (flow control: the app has not taken what came)
  or in which the client waits for ``100 Continue`` does not count.

The deadlines are checked by one timer per connection, armed only while a request is
unfinished at the end of a read, so a request that arrives in one read costs no timer; a
deadline is therefore met within one to two timeouts. An invalid request (any parser error)
is answered 400 ``bad_request`` in the protocol's error format (JSON, msgpack for
``POST /v1/...``), then the connection is closed.

Everything runs on the event loop. This module subclasses uvicorn's protocols and uses their
members (``flow``, ``transport``, ``cycle``, ``server_state``, ``send_400_response``), as
:mod:`server.httptools_protocol` does; the bases come from :mod:`server.upstream`, which checks at
start that the installed uvicorn has those members.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import h11
import msgpack

from client_sdk import wire

from .upstream import FlowControl, H11Protocol

__all__ = ["DEFAULT_LIMITS", "EdgeLimits", "GuardedH11Protocol", "ReadGuard", "error_bytes"]

logger = logging.getLogger("paramshard.protocol")


@dataclass(frozen=True)
class EdgeLimits:
    """The bounds of :mod:`server.readguard` (``paramshard serve`` flags of the same names)."""

    #: Largest request head (request line and headers), in bytes.
    max_head_bytes: int = 64 * 1024
    #: Seconds a request head may take to arrive, from its first byte (or the connection's
    #: opening).
    head_timeout: float = 10.0
    #: Length of the windows in which a body must progress, in seconds.
    body_timeout: float = 30.0
    #: Bytes per second a body must average over each window (at least one byte a window).
    min_body_rate: int = 16 * 1024


DEFAULT_LIMITS = EdgeLimits()

#: What a connection owes: nothing (a request is whole, or none began), a head, a body.
IDLE, HEAD, BODY = 0, 1, 2


def error_bytes(
    status: int,
    code: str,
    message: str,
    details: dict[str, Any],
    data_plane: bool,
    default_headers: Any = (),
) -> bytes:
    """A whole error response that closes its connection, in the protocol's error format
    (``{"error": {...}}``, msgpack when ``data_plane`` else JSON), for the HTTP layer, which
    answers before any app does."""
    payload = wire.error_payload(code, message, details)
    if data_plane:
        body, ctype = msgpack.packb(payload, use_bin_type=True), wire.MSGPACK
    else:
        body, ctype = json.dumps(payload).encode(), wire.JSON
    reason = {400: b"Bad Request"}.get(status, b"")
    head = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
    for name, value in default_headers:
        head += (name, b": ", value, b"\r\n")
    head.append(
        b"content-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        % (ctype.encode(), len(body))
    )
    return b"".join(head) + body


class _WatchedFlow(FlowControl):
    """uvicorn's flow control, remembering that reading was paused since the last look."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport)
        self.paused_since_look = False

    def pause_reading(self) -> None:
        self.paused_since_look = True
        super().pause_reading()


class ReadGuard:
    """Mixin for an uvicorn HTTP protocol class: the head bound and read deadlines (see the
    module). The protocol calls :meth:`_guard_made` from ``connection_made``, adds every byte
    it reads to :attr:`_got`, moves :attr:`_phase` with :meth:`_enter`, and calls
    :meth:`_guard_read` at the end of each read."""

    limits: EdgeLimits = DEFAULT_LIMITS
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    flow: FlowControl

    _phase = IDLE
    #: Phase changes so far; the timer restarts its window when this moved.
    _turn = 0
    _window_turn = -1
    #: Bytes read on this connection, and at the start of the body's window.
    _got = 0
    _mark = 0
    _guard: asyncio.TimerHandle | None = None

    def _guard_made(self) -> None:
        self.flow = _WatchedFlow(self.transport)
        self._phase = HEAD  # a new connection owes a head
        self._arm()

    def _enter(self, phase: int) -> None:
        if phase != self._phase:
            self._phase = phase
            self._turn += 1

    def _guard_read(self) -> None:
        if self._phase != IDLE and self._guard is None and not self.transport.is_closing():
            self._arm()

    def _guard_lost(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
            self._guard = None

    def _arm(self) -> None:
        limits = self.limits
        self._window_turn = self._turn
        self._mark = self._got
        self.flow.paused_since_look = False  # type: ignore[attr-defined]
        delay = limits.head_timeout if self._phase == HEAD else limits.body_timeout
        self._guard = self.loop.call_later(delay, self._on_guard)

    def _on_guard(self) -> None:
        self._guard = None
        phase = self._phase
        if phase == IDLE or self.transport.is_closing():
            return
        if self._turn != self._window_turn:  # another head or body since: its own window
            self._arm()
            return
        limits = self.limits
        if phase == HEAD:
            self._cut(
                f"its request head was not complete after {limits.head_timeout:g}s (--head-timeout)"
            )
            return
        if self.flow.read_paused or self.flow.paused_since_look or self._waits_for_continue():  # type: ignore[attr-defined]
            self._arm()  # the shard was not reading, or the client waits for it
            return
        need = max(1, int(limits.min_body_rate * limits.body_timeout))
        if self._got - self._mark < need:
            self._cut(
                f"its request body brought {self._got - self._mark} bytes in "
                f"{limits.body_timeout:g}s, fewer than {need} (--body-timeout, "
                "--min-body-rate)"
            )
            return
        self._arm()

    def _waits_for_continue(self) -> bool:
        cycle = getattr(self, "cycle", None)
        return cycle is not None and bool(getattr(cycle, "waiting_for_100_continue", False))

    def _cut(self, why: str) -> None:
        client = getattr(self, "client", None)
        logger.info("closing the connection from %s: %s", _peer(client), why)
        self.transport.close()

    def _refuse(self, message: str, details: dict[str, Any], data_plane: bool) -> None:
        """Answer 400 ``bad_request`` at the HTTP layer and close the connection."""
        self._phase = IDLE
        self._guard_lost()
        headers = getattr(getattr(self, "server_state", None), "default_headers", ())
        if not self.transport.is_closing():
            self.transport.write(
                error_bytes(400, "bad_request", message, details, data_plane, headers)
            )
            self.transport.close()


def _peer(client: Any) -> str:
    if isinstance(client, tuple) and len(client) == 2:
        return f"{client[0]}:{client[1]}"
    return "a client"


INVALID = (
    "the request is not valid HTTP/1.1 (malformed request line, header or body "
    "framing): fix the client"
)


class GuardedH11Protocol(ReadGuard, H11Protocol):
    """uvicorn's h11 protocol (what a shard serves without httptools, and the stock way) with
    the read deadlines of :class:`ReadGuard`; the head is bounded by h11 while incomplete
    (``h11_max_incomplete_event_size``) and here once parsed."""

    _head_refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._guard_made()
        self.conn.next_event = self._next_event_bounded(self.conn.next_event)

    def _next_event_bounded(self, next_event: Any) -> Any:
        """``conn.next_event`` refusing a request whose head is above the bound (h11 bounds
        only a head still incomplete; one that arrived whole in a read is parsed)."""

        def bounded() -> Any:
            event = next_event()
            if type(event) is h11.Request:
                size = len(event.method) + len(event.target) + 14
                for name, value in event.headers:
                    size += len(name) + len(value) + 4
                if size > self.limits.max_head_bytes:
                    self._head_refused = True
                    raise h11.RemoteProtocolError("request head too large")
            return event

        return bounded

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard_lost()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._got += len(data)
        super().data_received(data)
        conn = self.conn
        state = conn.their_state
        if state is h11.SEND_BODY:
            self._enter(BODY)
        elif state is h11.IDLE and conn.trailing_data[0]:
            self._enter(HEAD)
        else:
            self._enter(IDLE)
        self._guard_read()

    def send_400_response(self, msg: str) -> None:
        too_big = self._head_refused or len(self.conn.trailing_data[0]) > self.limits.max_head_bytes
        if too_big:
            self._refuse(
                f"the request head is above {self.limits.max_head_bytes} bytes "
                "(--max-head-bytes): send fewer or shorter headers",
                {"limit": self.limits.max_head_bytes},
                False,
            )
        else:
            self._refuse(INVALID, {}, False)
