"""A data-plane request's body in, and its reply out, without copying the tensors.

:func:`read_body` reads a request's body once into one buffer sized by ``Content-Length``:
written there by the socket itself when the shard's HTTP protocol offers it
(:class:`server.httptools_protocol.BodyInto`), else copied piece by piece as the server hands
them over; a big push's gradients are checked finite while they arrive
(:class:`server.store.FiniteScan`). The handlers then take the tensors as views of that buffer.
:class:`EncodedResponse` sends an encoded reply (:class:`client_sdk.wire.Encoded`) without
joining its big chunks: the arrays' own memory goes to the socket as it is.

The limits are the shard's: ``--max-request-bytes`` (413 past it, before the body is read when
``Content-Length`` says so). Coroutines on the event loop.
"""

from __future__ import annotations

import numpy as np
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from client_sdk import wire

from .errors import ShardError
from .headers import header
from .httptools_protocol import BODY_INTO, Gathered, gathers
from .store import SCAN_FROM, FiniteScan

__all__ = ["COALESCE_BELOW", "EncodedResponse", "coalesce", "read_body", "read_sized"]


#: Body chunks below this size are joined into one message with their small neighbours (one
#: ASGI message and one socket write instead of two per small tensor); bigger ones go out as
#: their own message, from the array's own memory.
COALESCE_BELOW = 64 * 1024


class EncodedResponse(Response):
    """Send a :class:`client_sdk.wire.Encoded` body without joining its big chunks.

    ``Content-Length`` is the encoded size. Served by the shard's own protocol
    (:data:`server.httptools_protocol.GATHER` in the scope's extensions), the whole body is one
    ``http.response.body`` message holding every chunk
    (:class:`server.httptools_protocol.Gathered`), written with one vectored write: nothing is
    joined. Elsewhere each chunk of :data:`COALESCE_BELOW` bytes or more (a memoryview of an array,
    for framed bodies) goes out as its own message, and runs of smaller chunks (header, padding,
    small tensors) are joined first.
    """

    def __init__(self, encoded: wire.Encoded, status_code: int = 200) -> None:
        self.encoded = encoded
        self.status_code = status_code
        self.background = None
        self.body = b""
        self.raw_headers = [
            (b"content-type", encoded.content_type.encode("latin-1")),
            (b"content-length", str(encoded.nbytes).encode("latin-1")),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        if scope.get("method") == "HEAD" or not self.encoded.nbytes:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if gathers(scope):  # the server writes the pieces as they are
            await send(
                {
                    "type": "http.response.body",
                    "body": Gathered(self.encoded.chunks, self.encoded.nbytes),
                    "more_body": False,
                }
            )
            return
        pieces = coalesce(self.encoded.chunks)
        last = len(pieces) - 1
        for i, piece in enumerate(pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": i < last})


def coalesce(chunks: list[wire.Buffer], below: int = COALESCE_BELOW) -> list[wire.Buffer]:
    """``chunks`` without empty ones, each run of chunks smaller than ``below`` joined."""
    out: list[wire.Buffer] = []
    run: list[wire.Buffer] = []
    for chunk in chunks:
        size = len(chunk)
        if not size:
            continue
        if size < below:
            run.append(chunk)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else b"".join(run))
            run = []
        out.append(chunk)
    if run:
        out.append(run[0] if len(run) == 1 else b"".join(run))
    return out


async def read_body(request: Request, limit: int, scan: bool = False) -> tuple[wire.Buffer, str]:
    """The request body in one buffer, and its content type.

    A body that arrives in one piece is that piece (``bytes``); a longer one goes into one
    writable buffer of ``Content-Length`` bytes (``np.empty`` memory: a ``bytearray`` would be
    zero-filled first, which costs as much as the copy): written there by the socket itself
    when the server offers it (:class:`server.httptools_protocol.BodyInto`), else copied piece by
    piece as the server hands them over. 415 for a content type that is neither msgpack nor frame
    (before reading); 413 for a declared ``Content-Length`` above ``limit`` (before reading) or,
    without one, as soon as the bytes received pass ``limit``; 400 for a body that ends early or
    runs long.
    """
    content_type = header(request.scope, b"content-type", "")
    kind = content_type.split(";")[0].strip().lower()
    if kind not in (wire.MSGPACK, wire.FRAME):
        raise ShardError(
            "unsupported_media_type",
            f"unsupported Content-Type {content_type!r}: send {wire.MSGPACK} or {wire.FRAME}",
            {"content_type": content_type},
        )
    declared = header(request.scope, b"content-length")
    try:
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                size = -1
            if size < 0:
                raise ShardError("bad_request", f"bad Content-Length {declared!r}")
            if size > limit:
                raise _too_large(size, limit)
            return await _read_sized(request, size, scan), kind
        grown = bytearray()
        async for chunk in request.stream():
            grown += chunk
            if len(grown) > limit:
                raise _too_large(len(grown), limit, partial=True)
        return grown, kind
    except ClientDisconnect:
        raise ShardError(
            "bad_request", "the client went away before sending the whole body"
        ) from None


async def read_sized(request: Request, size: int) -> wire.Buffer:
    """The body of ``size`` bytes, whatever its content type (a stage's, server.replication);
    400 when it ends early or runs long."""
    try:
        return await _read_sized(request, size)
    except ClientDisconnect:
        raise ShardError(
            "bad_request", "the client went away before sending the whole body"
        ) from None


async def _read_sized(request: Request, size: int, scan: bool = False) -> wire.Buffer:
    into = request.scope.get("extensions", {}).get(BODY_INTO)
    if into is not None and into.size == size:
        buf = memoryview(np.empty(size, np.uint8))
        finite = FiniteScan(buf) if scan and size >= SCAN_FROM else None
        if finite is not None:
            request.state.finite = finite.finite  # filled in as the body arrives
        # A primary streams a big body on to its backups as it arrives (server.replication).
        replication = getattr(request.app.state, "replication", None)
        staging = None if replication is None else replication.stage_body(buf)
        watch = finite if staging is None else staging.watch(finite)
        try:
            if into.receive_into(buf, watch):  # the rest of the body goes straight into buf
                async for chunk in request.stream():
                    if len(chunk):
                        raise RuntimeError("body bytes came through receive() after receive_into")
                if into.received != size:
                    raise ShardError(
                        "bad_request", f"body ended after {into.received} of {size} bytes"
                    )
                if staging is not None:
                    staging.done()
                return buf
        finally:
            if staging is not None:
                staging.abort()  # (a no-op once done)
    whole: bytes | None = None
    buf: memoryview | None = None
    pos = 0
    receive = request.receive  # request.stream() without a generator's per-request cost
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            continue
        more = message.get("more_body", False)
        chunk = message.get("body", b"")
        n = len(chunk)
        if not n:
            continue
        end = pos + n
        if end > size:
            raise ShardError("bad_request", "body is longer than its Content-Length")
        if pos == 0 and end == size:
            whole = chunk
        else:
            if buf is None:
                buf = memoryview(np.empty(size, np.uint8))
            buf[pos:end] = chunk
        pos = end
    if pos != size:
        raise ShardError("bad_request", f"body ended after {pos} of {size} bytes")
    if whole is not None:
        return whole
    return buf if buf is not None else b""


def _too_large(size: int, limit: int, partial: bool = False) -> ShardError:
    what = f"more than {limit}" if partial else str(size)
    return ShardError(
        "too_large",
        f"request body of {what} bytes is above this shard's limit of {limit} "
        "(--max-request-bytes): split the request into smaller batches or "
        "partition the variable",
        {"limit": limit, **({} if partial else {"size": size})},
    )
