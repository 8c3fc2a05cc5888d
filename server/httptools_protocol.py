"""uvicorn's httptools protocol, with big request bodies handed to the app with fewer copies, or
written by the socket straight into the app's own buffer, and responses written in fewer calls.

uvicorn (``httptools_impl``) feeds every piece of a request that the socket delivers through the
httptools parser, which hands the body back as a new ``bytes`` (one copy); it appends that to a
``bytearray`` (a second copy), and each ASGI ``receive()`` turns the ``bytearray`` into ``bytes``
(a third), before the app copies it once more into its own buffer. For a big push those copies
would be most of the time the shard spends reading, well over twice a bare socket's.
:class:`ShardHttpProtocol` changes two things, nothing else (flow control
included: reading pauses while more than 64 KiB wait for the app):

* the pending body is a list of the pieces as they came (:class:`BodyPieces`), so ``receive()``
  gets the one piece (or, rarely, the few pieces joined) that arrived since the last call;
* once a request's head is parsed and its ``Content-Length`` says at least
  :data:`BYPASS_BELOW` body bytes are still to come, the rest of the body does not go through
  the parser: each piece the socket delivers is handed on as it is. When the body is complete,
  the request is completed as the parser would have done it, and the next request on the
  connection starts with a fresh parser.

The app then copies each piece once, into the buffer it preallocated (``routes_data``).

It is one module past the ~600 lines others keep to because it is one subclass of uvicorn's
protocol with the readers and transports it swaps in: they share that class's private state
(checked at start by :mod:`server.upstream`), and split apart each half would reach into the
other's.

And the app can do without that copy, and without the pieces: a request whose body bypasses
the parser carries a :class:`BodyInto` in ``scope["extensions"][BODY_INTO]``. The app hands it
a buffer of the body's size (:meth:`BodyInto.receive_into`); the pieces not yet received are
copied into it, and for the rest of the body the connection's transport is switched to an
``asyncio.BufferedProtocol`` (:class:`_DirectReader`; both uvloop and asyncio's own loops
support switching with ``transport.set_protocol``) whose ``get_buffer`` is the unfilled rest
of the app's buffer: the kernel writes the body straight where the app reads it, in reads as
big as the socket holds, and no ``bytes`` object is made for it. ``receive()`` then yields no
body bytes, only the final ``more_body: False`` once the buffer is full. The switch back
happens at the body's last byte, so what follows on the connection is parsed as usual.
Flow control is unchanged up to the switch (the app asks only once it has admitted the
request, and its buffer is bounded by the admitted ``Content-Length``); after it the reads
stop when the buffer is full, and a client that goes away mid-body is reported to the app as
``http.disconnect``, as it is before the switch.

Responses go out in fewer writes (:class:`_HeadWithBody`, the request cycle's transport):
uvicorn writes a response's head as soon as the app sends ``http.response.start`` and each body
message as it comes, and on loopback each write is a trip through the TCP stack that wakes the
client. The head is held and written with the first body message; and a body message may carry
a :class:`Gathered` (announced by :data:`GATHER` in the scope's extensions) whose pieces, e.g. a
pull reply's header, padding and arrays, go out in one vectored write instead of being joined by
the app: a 100-variable pull reply is one ``writev``, not two writes and a joining copy of its
400 KB.

And some requests never become a request cycle: the served app may name requests it can answer at
once (its :data:`IMMEDIATE` attribute: raw path -> :data:`Answerer`; on a shard, a small
``POST /v1/pull`` in the table layout or ``/v1/pull_rows``, ``POST /v1/push``, ``/v1/increment``
and ``/v1/push_rows``, :mod:`server.immediate`). For such a path, a ``POST`` with a
``Content-Length`` below :data:`ANSWER_BELOW` on a keep-alive HTTP/1.1 connection, with no other
response under way, no ``Expect``, no access log and writing not paused, whose body comes whole in
the read that brings its head (else it goes the usual way from the end of that read, counted in
flight like any request), is collected by the parser callbacks and given to the answerer there: no
ASGI scope handed on, no task, no middleware, no ``receive``/``send`` messages. An answerer with a
``collect_below`` attribute (:data:`COLLECT_BELOW_ATTR`) also takes bodies below that size that
come over several reads (a ``push`` of a 100,000-element gradient or a ``push_rows`` of a few
thousand rows is a few hundred KB, more than one read brings): the parser callbacks collect its
body until it is whole (one such body per connection, within that bound; the read guard's body
deadline and pace apply), then answer it the same way. While collected, such a body holds its
room in the shard's gate, as an admitted request's does (:data:`COLLECT_ROOM_ATTR`): one the
gate has no room for now goes the usual way, so the bodies collected stay within
``--max-queued-bytes``. When, after a read, at least
:data:`BYPASS_BELOW` bytes of such a body are still to come, the body is collected into one
buffer of its size: the pieces so far copied in, the rest written there by
the kernel through :class:`_DirectReader` as for :class:`BodyInto`, past the parser, and the
answerer is given that buffer (a writable ``memoryview``), not pieces joined into a new
``bytes``. A big read that starts such a request (a step group's push: the first read brings
its head and a few hundred KB) is fed to the parser up to the end of the head only; when more
of the body is to come than the read holds, the body's bytes of that read are copied into the
buffer from the read itself, with no piece made of them by the parser. When that head is one
:func:`server.whole_heads.whole_request` reads (as the SDK writes it) and the body gets its
buffer at once, the parser does not read the head either: it is read as a small whole
request's is, and only if the answerer declines does the parser read it, for the app.
And once a connection has had a body collected into one buffer, it reads at most
:data:`SMALL_READ` bytes at a time whenever no body is being written into a buffer
(:class:`_SmallReads`): the read that brings the next such request's head then brings only a
little of its body, and the rest is read straight into its buffer, where the loop's own
reads (uvloop's are 256 KiB) would first copy most of the body into a ``bytes`` object that
is then copied again into the buffer. A shutdown meanwhile
lets it finish and closes the connection after its answer, as for a request the app is
answering. Its answer is written as a shard's responses are (head with body, one
vectored write) and the connection goes on as after any response (keep-alive timeout, reading),
one keep-alive timer serving a run of such answers rather than one cancelled and armed anew
per request (:meth:`ShardHttpProtocol._answered`).
When the answerer declines (``None``: any error, refusal or wait is the app's to answer) or
fails, the request goes to the app as if the parser had just reached its head, body and end.
A read below :data:`WHOLE_BELOW` bytes that is exactly one such request, arriving between
requests, with a head written as the SDK writes one (:func:`server.whole_heads.whole_request`
says which: only heads every parser reads the same), is not fed to the parser at all: its
head is split in a few bytes operations (or, the same bytes as the connection's last head
read that way for its path, not split again: :class:`server.whole_heads.KeptHeads`) and the
answerer called from ``data_received``, with no parser callback per header and no ASGI scope
made; a request it declines is then fed to the parser and goes to the app without being
offered again. Any other head is the parser's, as before.
The work saved is a sizeable part of a small pull's time in the shard (``python -m
bench.stepcost`` shows the shard's part).

It is passed to uvicorn as its ``http`` protocol class (``uvicorn.Config(http=...)``, a
documented option), on the fast path only (:func:`server.upstream.serving`). It relies on
uvicorn's request cycle keeping the pending body in ``cycle.body`` and turning it into
``bytes(cycle.body)`` in ``receive()`` (uvicorn 0.42 and later), on its ``response_complete``
and ``disconnected`` flags, on its writing the head, then the body, through
``cycle.transport`` (and closing it after a failure), and on the parser callbacks
``on_headers_complete``/``on_body``/``on_message_complete``. Its base class comes from
:mod:`server.upstream`, which lists every uvicorn member used here and checks at start that the
installed uvicorn has them (else the shard serves the stock way). The shard tests run every
request through it, and tests/shard/test_datapath.py runs it on its own under uvloop and asyncio's
loop. Without httptools, :func:`protocol_class` picks uvicorn's h11 (no :class:`BodyInto`:
the app reads pieces).

Both bound what a connection may cost before its request is whole, with
:class:`server.readguard.ReadGuard`: the head's size, a deadline for an unfinished head and a
minimum pace for a body (:class:`~server.readguard.EdgeLimits`, bound to the class by
:func:`protocol_class`); here the head is measured in ``data_received`` and
``on_headers_complete``, and uvicorn's plain-text answer to a parser error
(``send_400_response``) is the protocol's error format instead.

It is one file, longer than the others, because those changes override the same few methods
of one uvicorn class (``data_received``, the parser callbacks, the cycle's transport) and
share its per-connection state; split by feature, a reader would have to put that one class
back together from several modules to see what a request goes through.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .headers import request_headers
from .readguard import BODY, DEFAULT_LIMITS, HEAD, IDLE, INVALID, EdgeLimits, ReadGuard
from .upstream import HIGH_WATER_LIMIT, HttpToolsProtocol, new_parser
from .whole_heads import KeptHeads

__all__ = [
    "ANSWER_BELOW",
    "BODY_INTO",
    "BYPASS_BELOW",
    "COLLECT_BELOW_ATTR",
    "COLLECT_HELD_ATTR",
    "COLLECT_RELEASE_ATTR",
    "COLLECT_ROOM_ATTR",
    "GATHER",
    "IMMEDIATE",
    "Answerer",
    "BodyInto",
    "BodyPieces",
    "Gathered",
    "Immediate",
    "ShardHttpProtocol",
    "gathers",
    "protocol_class",
]

#: Bodies with at least this many bytes still to come, once the head is parsed, bypass the
#: parser; smaller ones are not worth it.
BYPASS_BELOW = 64 * 1024
#: The key of :class:`BodyInto` in an ASGI scope's ``extensions``.
BODY_INTO = "paramshard.body_into"
#: The key in ``scope["extensions"]`` that says a body message's ``body`` may be a
#: :class:`Gathered`.
GATHER = "paramshard.gather"

#: The attribute of the served app (uvicorn's ``config.loaded_app``) that maps a raw request
#: path (``b"/v1/pull"``) to an :data:`Answerer`: requests the protocol may answer itself.
IMMEDIATE = "immediate"
#: Only requests with a ``Content-Length`` below this are answered immediately (unless their
#: answerer collects bigger bodies: :data:`COLLECT_BELOW_ATTR`).
ANSWER_BELOW = 64 * 1024
#: A read below this many bytes that is one whole request for an answerer, with a head
#: :func:`server.whole_heads.whole_request` reads, is answered without the parser.
WHOLE_BELOW = ANSWER_BELOW
#: The most a connection that has had a body collected into one buffer reads at a time
#: (:class:`_SmallReads`): a request answered immediately, head and body, still comes in one.
SMALL_READ = ANSWER_BELOW + 16 * 1024
#: The attribute of an :data:`Answerer` that takes bodies over several reads: the
#: ``Content-Length`` (exclusive) below which its requests are collected until whole.
COLLECT_BELOW_ATTR = "collect_below"
#: The attribute of a collecting :data:`Answerer` that takes room now for a body of a given
#: size that it is to collect over several reads (``room(nbytes) -> bool``: whether it did;
#: on a shard, its gate's ``hold_now``, so that the body counts in flight as an admitted
#: request's does), given back with :data:`COLLECT_RELEASE_ATTR` (``release(nbytes)``) when
#: the body is answered or dropped. A body it has no room for goes the usual way (the app
#: admits it, or refuses it). Without it, nothing is counted and collected bodies stay in
#: pieces.
COLLECT_ROOM_ATTR = "collect_room"
COLLECT_RELEASE_ATTR = "collect_release"
#: The attribute of a collecting :data:`Answerer` with a room check: the same answerer for a
#: body that holds room already (it does not ask for room again).
COLLECT_HELD_ATTR = "collect_held"

logger = logging.getLogger("paramshard.protocol")


class Immediate:
    """A 200 response an :data:`Answerer` gives: its headers (after uvicorn's default ones,
    e.g. ``date``) and its body as pieces, ``nbytes`` in all, written in one vectored write."""

    __slots__ = ("headers", "chunks", "nbytes")

    def __init__(
        self, headers: list[tuple[bytes, bytes]], chunks: Sequence[Any], nbytes: int
    ) -> None:
        self.headers = headers
        self.chunks = chunks
        self.nbytes = nbytes


#: ``answer(headers, body)``: the :class:`Immediate` response to a whole request (``headers``:
#: its headers, names lower-case, the first of repeated ones; ``body``: all of it, a ``bytes``
#: or, collected into one buffer, a writable byte ``memoryview``), or
#: ``None`` to hand the request to the app the usual way, which then answers it. Runs on the
#: event loop, inside the protocol's parser callback: it must not block, and should not raise
#: (an exception is logged and the request goes the usual way).
Answerer = Callable[[dict[bytes, bytes], bytes | memoryview], Immediate | None]


class BodyPieces:
    """Pending body pieces of one request, kept uncopied. Looks to uvicorn like the
    ``bytearray`` it would have used: ``+=`` a piece, ``len()``, ``bytes()``."""

    __slots__ = ("pieces", "size")

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.size = 0

    def __iadd__(self, piece: bytes) -> BodyPieces:
        self.pieces.append(piece)
        self.size += len(piece)
        return self

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        pieces = self.pieces
        if len(pieces) == 1 and type(pieces[0]) is bytes:
            return pieces[0]
        return b"".join(pieces)


class BodyInto:
    """``scope["extensions"][BODY_INTO]`` of a request with a big body: a way for the app to
    have the body written into a buffer of its own (see the module). Event-loop thread only."""

    __slots__ = ("_protocol", "_cycle", "size", "received", "watch")

    def __init__(self, protocol: ShardHttpProtocol, cycle: Any, size: int) -> None:
        self._protocol = protocol
        self._cycle = cycle
        #: The body's size (its ``Content-Length``).
        self.size = size
        #: Body bytes in the app's buffer so far.
        self.received = 0
        #: Called with :attr:`received` each time more of the body is in the buffer.
        self.watch: Callable[[int], None] | None = None

    def receive_into(self, buffer: memoryview, watch: Callable[[int], None] | None = None) -> bool:
        """Have the body written into ``buffer`` (writable, C-contiguous bytes, exactly
        :attr:`size` long). Returns False, and changes nothing, when that cannot be done (no
        more of the body bypasses the parser, or the app received some of it already): read
        it with ``receive()`` then. After True, ``receive()`` carries no body bytes; once a
        message says ``more_body: False``, :attr:`received` bytes are in ``buffer`` (all of
        them: a client that leaves early is reported as ``http.disconnect``). Does not block.

        ``watch``, if given, is called on the event loop with the count of bytes in
        ``buffer`` so far: once at once, then after every piece (e.g. to look at the bytes
        while they are fresh; :mod:`server.store.checks`). An exception it raises is logged and
        it is not called again; the body is read all the same.
        """
        if buffer.nbytes != self.size or buffer.readonly or not buffer.c_contiguous:
            raise ValueError(f"receive_into needs a writable buffer of {self.size} bytes")
        if not self._protocol._receive_into(self, buffer):
            return False
        self.watch = watch
        self.notify()
        return True

    def notify(self) -> None:
        """Call :attr:`watch` with :attr:`received` (dropping a watch that fails)."""
        watch = self.watch
        if watch is None:
            return
        try:
            watch(self.received)
        except Exception:
            self.watch = None
            logger.exception("a body watch failed; reading the body without it")


class Gathered:
    """A response body as pieces (bytes-like, e.g. memoryviews of arrays), for an
    ``http.response.body`` message's ``body`` when the request's scope has :data:`GATHER` in
    its extensions: the server writes the pieces with one vectored write instead of the app
    joining them (a copy) or sending each as its own message (a write each). ``len()`` is the
    size in bytes."""

    __slots__ = ("chunks", "nbytes")

    def __init__(self, chunks: Sequence[Any], nbytes: int) -> None:
        self.chunks = tuple(chunks)
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes


def gathers(scope: Any) -> bool:
    """Whether the server serving ``scope`` takes a :class:`Gathered` body (:data:`GATHER`)."""
    return GATHER in (scope.get("extensions") or ())


def _vectored(transport: asyncio.BaseTransport) -> bool:
    """Whether ``transport.writelines`` sends its buffers without joining them first: uvloop's
    does (one ``writev``); asyncio's joins them before Python 3.12, so pieces are joined here
    instead (the same copy, one call)."""
    return type(transport).__module__.startswith("uvloop")


def protocol_class(limits: EdgeLimits = DEFAULT_LIMITS) -> type[asyncio.Protocol]:
    """What to give uvicorn as ``http``: :class:`ShardHttpProtocol` when httptools is
    installed, else :class:`server.readguard.GuardedH11Protocol` (uvicorn's pure-Python
    protocol), either enforcing ``limits`` (give uvicorn ``h11_max_incomplete_event_size=
    limits.max_head_bytes`` too, for h11)."""
    if HttpToolsProtocol is None:
        from .readguard import GuardedH11Protocol

        base: type[asyncio.Protocol] = GuardedH11Protocol
    else:
        base = ShardHttpProtocol
    if limits == DEFAULT_LIMITS:
        return base
    return type(base.__name__, (base,), {"limits": limits})


if HttpToolsProtocol is not None:

    class _HeadTooLarge(Exception):
        """Raised in a parser callback to stop parsing a head above the bound."""

    class ShardHttpProtocol(ReadGuard, HttpToolsProtocol):  # type: ignore[misc, valid-type]
        """uvicorn's ``HttpToolsProtocol`` with :class:`BodyPieces` as the pending body, and
        the rest of a big body past the parser; and the head bound and read deadlines of
        :class:`server.readguard.ReadGuard`."""

        #: Body bytes of the current request announced by its Content-Length and not parsed
        #: yet (None: no length, or the body is complete).
        _announced: int | None = None
        #: Body bytes still to come past the parser (0: the parser is in charge).
        _bypass: int = 0
        #: While the body is written straight into the app's buffer: that request's
        #: :class:`BodyInto` and the buffer.
        _into: BodyInto | None = None
        _into_buffer: memoryview | None = None
        _direct: _DirectReader | None = None
        #: The transport's protocol whenever no body is read into a buffer, once a body was
        #: collected into one on this connection (:class:`_SmallReads`).
        _small: _SmallReads | None = None

        #: Set while the current request is to be answered immediately: the answerer and
        #: the body's pieces so far; whether its body may take several reads; whether a
        #: shutdown came meanwhile (the connection closes after its answer).
        _now: tuple[Answerer, list[bytes]] | None = None
        _collecting = False
        _closing = False
        #: Body bytes of the request being collected that have not arrived yet.
        _now_left = 0
        #: While a body collected over several reads holds room (:data:`COLLECT_ROOM_ATTR`):
        #: how to give it back, and how much.
        _held: tuple[Callable[[int], None], int] | None = None

        #: The size of the read being parsed; of the current head, what arrived of it
        #: counting only the reads after the one it began in (a lower bound), and counting
        #: that one whole (an upper bound); whether it was refused as too big.
        _read = 0
        _head_low = 0
        _head_high = 0
        _head_refused = False
        #: The answerer declined the request being parsed (:meth:`_answer_whole`).
        _declined = False
        #: The heads :meth:`_answer_whole` read on this connection, the last one of each path
        #: kept.
        _heads: KeptHeads | None = None
        #: While a body is collected for a request whose head the parser has not read
        #: (:meth:`_collect_unparsed`): that head's bytes and headers.
        _unparsed: tuple[bytes, dict[bytes, bytes]] | None = None
        #: The keep-alive timer :meth:`_answered` armed (also uvicorn's
        #: ``timeout_keep_alive_task`` until something cancels it), and when the connection
        #: last went idle after an answer written here (the loop's clock).
        _idle_timer: asyncio.TimerHandle | None = None
        _idle_since = 0.0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._answerers: dict[bytes, Answerer] = getattr(self.app, IMMEDIATE, None) or {}

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._guard_made()

        def connection_lost(self, exc: Exception | None) -> None:
            self._guard_lost()
            self._release()
            self._now = None  # a body being collected is dropped with the connection
            self._unparsed = None
            super().connection_lost(exc)

        def shutdown(self) -> None:
            if self._now is not None:  # a body being collected: answer it, then close
                self._closing = True
                return
            super().shutdown()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._enter(HEAD)
            self._head_low, self._head_high = 0, self._read

        def _head_size(self) -> int:
            """The bytes of the head just parsed (request line, header lines, blank line)."""
            size = len(self.parser.get_method()) + len(self.url) + 14
            for name, value in self.headers:
                size += len(name) + len(value) + 4
            return size

        def on_headers_complete(self) -> None:
            self._enter(BODY)
            if (
                self._head_high > self.limits.max_head_bytes
                and self._head_size() > self.limits.max_head_bytes
            ):
                self._head_refused = True
                raise _HeadTooLarge()
            if self._declined:
                self._declined = False
            elif self._answerers:
                answerer = self._answerers.get(self.url)
                if answerer is not None:
                    below = getattr(answerer, COLLECT_BELOW_ATTR, 0)
                    if self._may_answer_now(max(below, ANSWER_BELOW)):
                        self._now = (answerer, [])
                        self._collecting = below > 0
                        self._now_left = int(self._request_headers()[b"content-length"])
                        self._announced = None
                        return
            self._usual_headers_complete()

        def _may_answer_now(self, below: int = ANSWER_BELOW) -> bool:
            """Whether the request whose head was just parsed may be answered immediately: a
            ``POST`` with a ``Content-Length`` below ``below``, on a keep-alive HTTP/1.1
            connection with no response under way or held back, nothing else asked of the
            protocol (no ``Expect``, upgrade or chunked body), and no access log to write."""
            parser = self.parser
            if (
                parser.get_method() != b"POST"
                or self.access_log
                or self.expect_100_continue
                or self.flow.write_paused
                or parser.should_upgrade()
                or parser.get_http_version() != "1.1"
                or not parser.should_keep_alive()
            ):
                return False
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return False
            headers = self._request_headers()
            length = headers.get(b"content-length")
            return (
                length is not None
                and b"transfer-encoding" not in headers
                and length.isdigit()
                and int(length) < below
            )

        def _request_headers(self) -> dict[bytes, bytes]:
            """The current request's headers as :func:`server.headers.request_headers` makes
            them (and keeps them in the scope, for the app if the request goes to it)."""
            return request_headers(self.scope)

        def _hold(self, answerer: Answerer, size: int) -> bool:
            """Whether the body of ``size`` bytes being collected for ``answerer`` holds room
            (:data:`COLLECT_ROOM_ATTR`; taken now if it does not yet), or needs none (an
            answerer without that attribute)."""
            if self._held is not None:
                return True
            room = getattr(answerer, COLLECT_ROOM_ATTR, None)
            if room is None:
                return True
            release = getattr(answerer, COLLECT_RELEASE_ATTR)
            getattr(answerer, COLLECT_HELD_ATTR)  # (needed to answer: checked before room taken)
            if not room(size):
                return False
            self._held = (release, size)
            return True

        def _release(self) -> None:
            """Give back the room the body being collected holds, if it holds any."""
            held, self._held = self._held, None
            if held is not None:
                held[0](held[1])

        def _answer_now(self, answerer: Answerer, pieces: list[bytes]) -> None:
            body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            unparsed, self._unparsed = self._unparsed, None
            # A body that holds room is answered in it (the answerer's form that does not ask
            # the gate again), then gives it back.
            held = answerer if self._held is None else getattr(answerer, COLLECT_HELD_ATTR)
            try:
                answer = held(self._request_headers() if unparsed is None else unparsed[1], body)
            except Exception:
                logger.exception("answering %s immediately failed; handing it to the app", self.url)
                answer = None
            self._release()
            if answer is None:  # to the app, as if the parser had only now reached each part
                if unparsed is None:
                    self._usual_headers_complete()
                else:  # the parser (between requests) reads the head now, for the app
                    self._declined = True
                    self.parser.feed_data(unparsed[0])
                    self._declined = False
                if self._closing:
                    self._closing = False
                    self.cycle.keep_alive = False
                if body:
                    self.on_body(body)
                self.on_message_complete()
                return
            self._write_answer(answer)
            if self._closing:
                self._closing = False
                self.transport.close()

        def _write_answer(self, answer: Immediate) -> None:
            head = [_STATUS_200]
            for name, value in (*self.server_state.default_headers, *answer.headers):
                head += (name, b": ", value, b"\r\n")
            head.append(b"\r\n")
            out = _HeadWithBody(self.transport)
            out.write(b"".join(head))
            out.write(Gathered(answer.chunks, answer.nbytes))
            self._answered()

        def _answered(self) -> None:
            """uvicorn's ``on_response_complete`` for an answer written here, but with one
            keep-alive timer for a run of such answers rather than a timer cancelled and made
            anew per request: each answer only notes when the connection went idle, and the
            timer, when it fires, closes the connection only if it has been idle for the
            keep-alive timeout since (:meth:`_idle_timer_due`). Anything else the connection
            does cancels the timer as before (uvicorn's ``_unset_keepalive_if_required``);
            with requests queued behind (pipelined), a closing transport or uvicorn's own
            timer armed, this is ``on_response_complete``."""
            task = self.timeout_keep_alive_task
            if (
                self.pipeline
                or self.transport.is_closing()
                or (task is not None and task is not self._idle_timer)
            ):
                self.on_response_complete()
                return
            self.server_state.total_requests += 1
            self.flow.resume_reading()
            self._idle_since = self.loop.time()
            if task is None:
                self.timeout_keep_alive_task = self._idle_timer = self.loop.call_later(
                    self.timeout_keep_alive, self._idle_timer_due
                )

        def _idle_timer_due(self) -> None:
            """The timer of :meth:`_answered`: uvicorn's keep-alive timeout if the connection
            has been idle that long, else the timer armed again for the time left. (While a
            request is under way nothing of this runs: its head cancelled the timer.)"""
            self.timeout_keep_alive_task = self._idle_timer = None
            if self.transport.is_closing():
                return
            left = self._idle_since + self.timeout_keep_alive - self.loop.time()
            if left > 0:
                self.timeout_keep_alive_task = self._idle_timer = self.loop.call_later(
                    left, self._idle_timer_due
                )
            else:
                self.timeout_keep_alive_handler()

        def _unset_unless_idle_timer(self) -> None:
            """Cancel the keep-alive timer for a request answered within this read, unless it
            is :meth:`_answered`'s (which the answer only moves on)."""
            task = self.timeout_keep_alive_task
            if task is not None and task is not self._idle_timer:
                self._unset_keepalive_if_required()

        def _unparsed_may_be_answered(self) -> bool:
            """Whether a request whose head is read without the parser may be answered in the
            protocol: no access log to write, writing not paused, the connection open with a
            parser, and no response of an earlier request under way."""
            cycle = self.cycle
            return not (
                self.access_log
                or self.flow.write_paused
                or self.parser is None
                or self.transport.is_closing()
                or (cycle is not None and not cycle.response_complete)
            )

        def _answer_whole(self, data: bytes) -> bool:
            """Answer ``data`` here if it is one whole request for an answerer whose head
            :func:`server.whole_heads.whole_request` reads, on a connection between requests
            that may be answered now (as :meth:`_may_answer_now` says), without feeding it to
            the parser: whether it was answered. When the answerer declines, the parser reads
            ``data`` as usual and the request goes to the app (not offered again)."""
            if not self._unparsed_may_be_answered():
                return False
            heads = self._heads
            if heads is None:
                heads = self._heads = KeptHeads()
            whole = heads.read(data, self._answerers, self.limits.max_head_bytes)
            if whole is None:
                return False
            path, headers, body = whole
            self._unset_unless_idle_timer()
            try:
                answer = self._answerers[path](headers, body)
            except Exception:
                logger.exception("answering %s immediately failed; handing it to the app", path)
                answer = None
            if answer is None:
                self._declined = True
                return False
            self._phase = IDLE  # a whole request came and went: the guard owes nothing
            self._turn += 1
            self._write_answer(answer)
            return True

        def _usual_after_all(self) -> None:
            """A request to answer immediately whose body did not come whole in the read that
            brought its head goes the usual way, from here on: it is counted in flight and a
            shutdown waits for it, as for any request that takes more than one read."""
            pieces = self._now[1]  # type: ignore[index]
            self._now = None
            self._usual_headers_complete()
            for piece in pieces:
                self.on_body(piece)

        def _usual_headers_complete(self) -> None:
            previous = self.cycle
            super().on_headers_complete()
            cycle = self.cycle
            # A new request cycle (not for an upgrade, which makes none), whose response has
            # a body message to join the head to:
            if (
                cycle is not previous
                and self.scope["method"] != "HEAD"
                and not self.expect_100_continue
            ):
                cycle.transport = _HeadWithBody(self.transport)  # fewer writes (see there)
                extensions = self.scope.get("extensions")
                if extensions is None:
                    extensions = self.scope["extensions"] = {}  # type: ignore[typeddict-unknown-key]
                extensions[GATHER] = {}
            self._announced = None
            if self.parser.should_upgrade():
                return
            headers = dict(self.headers)  # the last of repeated ones counts
            if b"transfer-encoding" in headers:
                return
            length = headers.get(b"content-length")
            if length is not None and length.isdigit():
                self._announced = size = int(length)
                if size >= BYPASS_BELOW:
                    scope = self.scope
                    extensions = scope.get("extensions")
                    if extensions is None:
                        extensions = scope["extensions"] = {}  # type: ignore[typeddict-unknown-key]
                    extensions[BODY_INTO] = BodyInto(self, self.cycle, size)

        def on_body(self, body: bytes) -> None:
            if self._now is not None:
                self._now[1].append(body)
                self._now_left -= len(body)
                return
            if self._announced is not None:
                self._announced -= len(body)
            cycle = self.cycle
            if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
                return
            self._hand_on(body)

        def on_message_complete(self) -> None:
            self._enter(IDLE)
            now = self._now
            if now is not None:
                self._now = None
                self._collecting = False
                self._answer_now(*now)
                return
            self._announced = None
            super().on_message_complete()

        def data_received(self, data: bytes) -> None:
            size = len(data)
            if (
                size < WHOLE_BELOW
                and self._answerers
                and (self._phase == IDLE or (self._phase == HEAD and not self._got))
                and self._now is None
                and self._into is None
                and not self._bypass
                and self._answer_whole(data)
            ):
                self._got += size
                return
            self._got += size
            if self._phase == HEAD:
                self._head_low += size
                self._head_high += size
            self._read = size
            self._take(data)
            self._declined = False  # (the parser reached the declined request's head in it)
            now = self._now
            if now is not None and not (
                self._collecting
                and self._hold(now[0], self._now_left + sum(len(piece) for piece in now[1]))
            ):
                self._usual_after_all()  # (a body collected over several reads needs room)
            if (
                self._phase == HEAD
                and self._head_low > self.limits.max_head_bytes
                and not self.transport.is_closing()
            ):
                self._refuse_head()
            self._guard_read()

        def _refuse_head(self) -> None:
            limit = self.limits.max_head_bytes
            self._refuse(
                f"the request head is above {limit} bytes (--max-head-bytes): send "
                "fewer or shorter headers, or a shorter URL",
                {"limit": limit},
                self._data_plane(),
            )

        def _data_plane(self) -> bool:
            """Whether the request being parsed is ``POST /v1/...`` (as far as it is known)."""
            try:
                return self.parser.get_method() == b"POST" and self.url.startswith(b"/v1/")
            except Exception:
                return False

        def send_400_response(self, msg: str) -> None:
            # uvicorn's answer to a parser error (plain text): the protocol's format instead.
            if self._head_refused:
                self._head_refused = False
                self._refuse_head()
            else:
                self._refuse(INVALID, {}, self._data_plane())

        def _take(self, data: bytes) -> None:
            if self._bypass:
                self._unset_keepalive_if_required()
                take = min(len(data), self._bypass)
                self._bypass -= take
                if not self.cycle.response_complete:
                    self._hand_on(data if take == len(data) else bytes(memoryview(data)[:take]))
                if self._bypass:
                    return
                # The body is complete: finish the request as the parser would have, and
                # parse whatever follows with a fresh parser.
                self.parser = new_parser(self)
                self.on_message_complete()
                data = data[take:]
                if not data:
                    return
            elif (
                len(data) >= BYPASS_BELOW
                and type(data) is bytes
                and self._now is None
                and self._into is None
                and data.startswith(b"POST ")
                and self._collects(data)
            ):
                end = data.find(b"\r\n\r\n", 5, self.limits.max_head_bytes + 4)
                if 0 < end < len(data) - 4:
                    if not self._collect_unparsed(data):
                        self._take_head_first(memoryview(data), end + 4)
                    return
            super().data_received(data)
            left = self._announced
            if left is not None and left >= BYPASS_BELOW and self.parser is not None:
                self._bypass = left
                self._announced = None
            elif self._collecting and self._now_left >= BYPASS_BELOW and self._now is not None:
                self._collect_into(self._now[0], self._now[1])

        def _collects(self, data: bytes) -> bool:
            """Whether ``data`` starts a ``POST`` to an answerer that collects bodies over
            several reads (its target as the parser will see it)."""
            space = data.find(b" ", 5, 5 + 256)
            answerer = self._answerers.get(data[5:space]) if space > 0 else None
            return answerer is not None and getattr(answerer, COLLECT_BELOW_ATTR, 0) > 0

        def _collect_unparsed(self, data: bytes) -> bool:
            """Whether ``data``, a big read that starts a request for a collecting answerer on
            a connection between requests, was taken without the parser: its head read as
            :meth:`_answer_whole` reads a small request's (one :func:`~server.whole_heads.
            whole_request` reads, ``started``), the request one :meth:`_may_answer_now` allows
            (those heads ask nothing of the protocol), and its body, more than ``data`` holds,
            to be collected into one buffer (:meth:`_collect_into`), to which the rest of
            ``data`` is copied. Then nothing waits on the parser until the body is whole; if
            the answerer declines, the parser reads the head after all (:meth:`_answer_now`).
            Otherwise (``False``) nothing has changed."""
            if (
                not (self._phase == IDLE or (self._phase == HEAD and self._got == len(data)))
                or self._declined
                or not self._unparsed_may_be_answered()
            ):
                return False
            heads = self._heads
            if heads is None:
                heads = self._heads = KeptHeads()
            read = heads.read(data, self._answerers, self.limits.max_head_bytes, started=True)
            if read is None:
                return False
            path, headers, rest = read
            answerer = self._answerers[path]
            below = getattr(answerer, COLLECT_BELOW_ATTR, 0)
            room = getattr(answerer, COLLECT_ROOM_ATTR, None)
            size = int(headers[b"content-length"])
            if (
                not below
                or size >= max(below, ANSWER_BELOW)
                or size <= len(rest)
                or size < BYPASS_BELOW
                or room is None
                or not self._hold(answerer, size)
            ):
                return False
            self._unset_keepalive_if_required()
            self._enter(BODY)
            self.url = path
            self._unparsed = (data[: len(data) - len(rest)], headers)
            self._now = (answerer, [])
            self._collecting = True
            self._now_left, self._announced = size, None
            self._collect_into(answerer, [])
            into, buffer = self._into, self._into_buffer
            assert into is not None and buffer is not None  # room was taken just now
            take = len(rest)
            buffer[:take] = rest
            self._got -= take  # counted with the read already
            self._direct_received(take)
            return True

        def _take_head_first(self, data: memoryview, end: int) -> None:
            """A big read that starts a request for a collecting answerer, parsed in two feeds
            (for the parser any split of its input is the same): the head up to ``end``
            first. If more of the body is to come than the read holds, and the body is
            collected into one buffer (:meth:`_collect_into`), the rest of the read is copied
            there straight from the read, not first made into a piece by the parser and
            copied from that; else the rest is parsed as it would have been."""
            super().data_received(data[:end])  # type: ignore[arg-type]
            if self.transport.is_closing():
                return  # refused (a bad head): nothing more is read from it
            rest = data[end:]
            now = self._now
            if (
                now is not None
                and self._collecting
                and self._now_left > len(rest)
                and self._now_left >= BYPASS_BELOW
            ):
                self._collect_into(now[0], [])
                if self._into is not None and self._into_buffer is not None:
                    take = len(rest)  # less than the body: the body takes it all
                    self._into_buffer[:take] = rest
                    self._got -= take  # counted with the read already
                    self._direct_received(take)
                    return
            self._take(rest)  # type: ignore[arg-type]

        def _collect_into(self, answerer: Answerer, pieces: list[bytes]) -> None:
            """The rest of a body being collected for ``answerer`` (at least
            :data:`BYPASS_BELOW` bytes to come) goes straight into one buffer of the body's
            size, if the answerer's room check allows one: the pieces so far are copied in, and
            the transport reads the rest there (:class:`_DirectReader`), past the parser; once
            it is full, :meth:`on_message_complete` answers with the buffer as the body."""
            room = getattr(answerer, COLLECT_ROOM_ATTR, None)
            arrived = sum(len(piece) for piece in pieces)
            size = arrived + self._now_left
            if room is None or not self._hold(answerer, size):
                return
            # Not a bytearray: that is zero-filled first, a pass over the body's bytes that the
            # copies below and the reads make pointless (np.empty memory, as the app's bodies).
            view = memoryview(np.empty(size, np.uint8))
            pos = 0
            for piece in pieces:
                view[pos : pos + len(piece)] = piece
                pos += len(piece)
            into = BodyInto(self, None, size)
            into.received = arrived
            self._now = (answerer, [view])  # type: ignore[list-item]
            self._bypass, self._now_left = size - arrived, 0
            self._into, self._into_buffer = into, view
            if self._direct is None:
                self._direct = _DirectReader(self)
            if self._small is None:
                self._small = _SmallReads(self)
            self.transport.set_protocol(self._direct)

        def _receive_into(self, into: BodyInto, buffer: memoryview) -> bool:
            """:meth:`BodyInto.receive_into`: move what the app has not received yet into
            ``buffer`` and switch the transport to :class:`_DirectReader` for the rest."""
            cycle = into._cycle
            if (
                self.cycle is not cycle
                or not self._bypass
                or self._into is not None
                or cycle.response_complete
                or cycle.disconnected
            ):
                return False
            pending = cycle.body
            arrived = into.size - self._bypass
            if len(pending) != arrived:
                return False  # the app received some of the body already
            pos = 0
            for piece in pending.pieces if type(pending) is BodyPieces else (pending,):
                buffer[pos : pos + len(piece)] = piece
                pos += len(piece)
            cycle.body = bytearray()
            into.received = arrived
            self._into, self._into_buffer = into, buffer
            if self._direct is None:
                self._direct = _DirectReader(self)
            self.transport.set_protocol(self._direct)
            return True

        def _direct_get_buffer(self) -> memoryview:
            return self._into_buffer[self._into.received :]  # type: ignore[index, union-attr]

        def _direct_received(self, nbytes: int) -> None:
            self._got += nbytes
            into = self._into
            into.received += nbytes  # type: ignore[union-attr]
            self._bypass -= nbytes
            if into.watch is not None:  # type: ignore[union-attr]
                into.notify()  # type: ignore[union-attr]
            if self._bypass:
                return
            # The body is complete: back to the parser for whatever follows. (The watch goes:
            # it may hold the buffer, and the scope holds this BodyInto in a reference cycle.)
            into.watch = None  # type: ignore[union-attr]
            self._into = self._into_buffer = None
            self.transport.set_protocol(self._small or self)
            # Completed with the parser that read the head (an answerer that declines hands
            # the request to the app, which needs its method and version from it), then a
            # new one: this one waits for body bytes that went past it.
            self.on_message_complete()
            self.parser = new_parser(self)

        def _hand_on(self, piece: bytes) -> None:
            cycle = self.cycle
            pending = cycle.body
            if type(pending) is not BodyPieces:
                # uvicorn's own fresh bytearray (a new request, or just emptied by receive())
                replaced = BodyPieces()
                if len(pending):
                    replaced += bytes(pending)
                cycle.body = pending = replaced
            pending += piece
            if len(pending) > HIGH_WATER_LIMIT:
                self.flow.pause_reading()
            cycle.message_event.set()

    _STATUS_200 = b"HTTP/1.1 200 OK\r\n"

    #: Bodies smaller than this are joined to the head (and their pieces joined) into one
    #: ``bytes``; bigger ones go out as their pieces in one vectored write where there is one.
    JOIN_BELOW = 16 * 1024

    class _HeadWithBody:
        """A request cycle's transport that writes a response with as few system calls as it
        can (uvicorn writes the head when the app sends ``http.response.start`` and each body
        message when it comes; on loopback each write is a trip through the TCP stack that
        wakes the reader):

        * the first write, the head, is held and goes out with the next, the first body
          message: joined to a small body, or next to a big one in one vectored write where
          the transport has them (:func:`_vectored`). If the connection is closed before (the
          app failed after ``http.response.start``) the head is dropped, as uvicorn closes
          the connection after such a failure. Not for ``HEAD`` requests (no body message is
          written) or requests expecting ``100 Continue`` (written before the head);
        * a body may be a :class:`Gathered` (the request's scope announces it with
          :data:`GATHER`): its pieces go out in one vectored write, not joined first.
        """

        __slots__ = ("transport", "head", "first")

        def __init__(self, transport: asyncio.Transport) -> None:
            self.transport = transport
            self.head: bytes | None = None
            self.first = True

        def write(self, data: Any) -> None:
            if self.first:
                self.first = False
                self.head = data
                return
            head, transport = self.head, self.transport
            self.head = None
            pieces = data.chunks if type(data) is Gathered else (data,)
            if head is not None:
                pieces = (head, *pieces)
            if len(pieces) == 1:
                transport.write(pieces[0])
            elif len(data) >= JOIN_BELOW and _vectored(transport):
                transport.writelines(pieces)
            else:  # a small body is joined (a copy of a few KiB costs less than the pieces)
                transport.write(b"".join(pieces))

        def close(self) -> None:
            self.head = None
            self.transport.close()

        def is_closing(self) -> bool:
            return self.transport.is_closing()

    _reads = threading.local()

    def _small_buffer() -> memoryview:
        """This thread's buffer for :class:`_SmallReads` (each read is copied out of it before
        anything else runs on the thread, so all the connections of a loop share one)."""
        buffer = getattr(_reads, "buffer", None)
        if buffer is None:
            buffer = _reads.buffer = memoryview(bytearray(SMALL_READ))
        return buffer

    class _SmallReads(asyncio.BufferedProtocol):
        """The transport's protocol on a connection that has had a body collected into one
        buffer, whenever no body is being read into a buffer: each read, at most
        :data:`SMALL_READ` bytes, goes to the HTTP protocol's ``data_received`` as ``bytes``;
        the other callbacks go to the HTTP protocol (see the module)."""

        __slots__ = ("http",)

        def __init__(self, http: ShardHttpProtocol) -> None:
            self.http = http

        def get_buffer(self, sizehint: int) -> memoryview:
            return _small_buffer()

        def buffer_updated(self, nbytes: int) -> None:
            self.http.data_received(_small_buffer()[:nbytes].tobytes())

        def eof_received(self) -> bool | None:
            return self.http.eof_received()

        def connection_lost(self, exc: Exception | None) -> None:
            self.http.connection_lost(exc)

        def pause_writing(self) -> None:
            self.http.pause_writing()

        def resume_writing(self) -> None:
            self.http.resume_writing()

    class _DirectReader(asyncio.BufferedProtocol):
        """The transport's protocol while a body is written into the app's buffer: reads go
        to the rest of that buffer; the other callbacks go to the HTTP protocol."""

        __slots__ = ("http",)

        def __init__(self, http: ShardHttpProtocol) -> None:
            self.http = http

        def get_buffer(self, sizehint: int) -> memoryview:
            return self.http._direct_get_buffer()

        def buffer_updated(self, nbytes: int) -> None:
            self.http._direct_received(nbytes)

        def eof_received(self) -> bool | None:
            return self.http.eof_received()

        def connection_lost(self, exc: Exception | None) -> None:
            http = self.http
            if http._into is not None:
                http._into.watch = None
            http._into = http._into_buffer = None  # the app sees http.disconnect
            http.connection_lost(exc)

        def pause_writing(self) -> None:
            self.http.pause_writing()

        def resume_writing(self) -> None:
            self.http.resume_writing()
