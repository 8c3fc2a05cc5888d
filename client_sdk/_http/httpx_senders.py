"""The senders over httpx2: :class:`HTTPXSender` (an ``httpx2.Client``, for ``PSClient``) and
:class:`AsyncHTTPXSender` (an ``httpx2.AsyncClient``).

``_transport.py`` uses them for ``https://`` shards and for a ``transport`` the caller injects
(``httpx2.MockTransport`` in tests). Request bodies are handed to httpx2 as the encoder left
them (the msgpack header and memoryviews of the arrays, in 1 MiB slices) with an explicit
``Content-Length`` (so httpx2 does not switch to chunked encoding). A reply body is read into
one ``np.empty`` buffer sized by its ``Content-Length`` (64-byte aligned; a ``bytearray`` would
be zero-filled first, which for 100 MB costs as much as copying the body in), refused before a
byte of it is read when it is bigger than the request's reply can need (:class:`_Body`, for
both).

Each exchange ends by its deadline: httpx2's timeouts bound each wait for bytes, so the sync
sender also gives each connection's reads and writes only what is left of the deadline
(``httpx_deadline.py``, for the transports it can reach) and checks it between the pieces of a
reply, and the async one cancels the exchange at its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx2

from .. import _replies
from .._abort import Abort
from .._exceptions import ProtocolError
from .._flow import Reply, ShardRequest, request_headers
from .._settings import Settings
from ..wire import Encoded
from .connection import CONNECT_TIMEOUT, idle_per_shard
from .http11 import IDLE_EXPIRY, body_buffer
from .httpx_deadline import Deadlines
from .tls import context as tls_context

__all__ = ["AsyncHTTPXSender", "HTTPXSender", "limits", "timeout"]

#: Body chunks larger than this are handed to the connection in slices of this size: h11
#: copies each chunk it is given, and small copies stay in cache.
SLICE = 1 << 20


def timeout(seconds: float) -> httpx2.Timeout:
    return httpx2.Timeout(seconds, connect=min(seconds, CONNECT_TIMEOUT))


def limits(num_shards: int, max_inflight: int) -> httpx2.Limits:
    """Enough kept-alive connections for every shard to serve a call, ``max_inflight``
    background pushes and a long poll at the same time; no hard cap (callers bound the
    concurrency themselves, and a cap would turn long polls into pool timeouts)."""
    keep = num_shards * idle_per_shard(max_inflight)
    return httpx2.Limits(
        max_connections=None, max_keepalive_connections=keep, keepalive_expiry=IDLE_EXPIRY
    )


def _slices(body: Encoded) -> Iterator[bytes | memoryview]:
    for chunk in body.chunks:
        if len(chunk) <= SLICE:
            yield chunk  # type: ignore[misc]
        else:
            view = memoryview(chunk)
            for start in range(0, len(view), SLICE):
                yield view[start : start + SLICE]


class _SyncBody:
    """A re-iterable request body (so a retry can send it again)."""

    def __init__(self, body: Encoded) -> None:
        self.body = body

    def __iter__(self) -> Iterator[bytes | memoryview]:
        return _slices(self.body)


class _AsyncBody:
    def __init__(self, body: Encoded) -> None:
        self.body = body

    async def __aiter__(self) -> AsyncIterator[bytes | memoryview]:
        for piece in _slices(self.body):
            yield piece


def _build(
    client: httpx2.Client | httpx2.AsyncClient,
    url: str,
    req: ShardRequest,
    body: _SyncBody | _AsyncBody | None,
    deadline: float,
) -> httpx2.Request:
    """The request, each of its waits for bytes bounded by what is left until ``deadline``."""
    left = max(0.0, deadline - time.monotonic())
    t = client.timeout
    request = client.build_request(
        req.method,
        url + req.path,
        headers=dict(request_headers(req)),
        # httpx2 sends memoryview pieces as they are; its types say bytes
        content=body,  # type: ignore[arg-type]
    )
    read = left if req.timeout is not None else _within(t.read, left)  # a long poll: its own
    request.extensions["timeout"] = httpx2.Timeout(
        connect=_within(t.connect, left),
        read=read,
        write=_within(t.write, left),
        pool=_within(t.pool, left),
    ).as_dict()
    return request


def _within(limit: float | None, left: float) -> float:
    return left if limit is None else min(limit, left)


class _Body:
    """A reply's body as httpx2 hands it over, at most ``limit`` bytes: into one buffer sized
    by its ``Content-Length`` (refused at once past ``limit``), or gathered piece by piece
    when the length is not given (refused once past ``limit``)."""

    __slots__ = ("url", "limit", "buf", "pos", "whole")

    def __init__(self, response: httpx2.Response, limit: int, url: str) -> None:
        self.url = url
        self.limit = limit
        self.pos = 0
        self.buf: memoryview | None = None
        self.whole: bytearray | None = None
        length = response.headers.get("content-length")
        if length is not None and length.isdigit():
            if int(length) > limit:
                raise _replies.too_large(int(length), limit, True, url)
            self.buf = body_buffer(int(length))
        else:
            self.whole = bytearray()

    def add(self, chunk: bytes) -> None:
        if self.buf is not None:
            end = self.pos + len(chunk)
            if end > len(self.buf):
                raise ProtocolError(
                    f"shard {self.url} sent more bytes than its Content-Length ({len(self.buf)})",
                    shard=self.url,
                )
            self.buf[self.pos : end] = chunk
            self.pos = end
            return
        assert self.whole is not None
        self.whole += chunk
        if len(self.whole) > self.limit:
            raise _replies.too_large(len(self.whole), self.limit, False, self.url)

    def content(self) -> bytes | memoryview:
        """The whole body, once every piece was added."""
        if self.buf is None:
            assert self.whole is not None
            return bytes(self.whole)
        if self.pos != len(self.buf):
            raise ProtocolError(
                f"shard {self.url} sent {self.pos} of the {len(self.buf)} bytes it announced",
                shard=self.url,
            )
        return self.buf


def _consumed(response: httpx2.Response, limit: int, url: str) -> bytes:
    """The body of a response whose transport read it already, at most ``limit`` bytes."""
    content = response.content
    if len(content) > limit:
        raise _replies.too_large(len(content), limit, True, url)
    return content


def _in_time(deadline: float) -> None:
    """Raise :class:`httpx2.ReadTimeout` once ``deadline`` passed (between a reply's pieces,
    for transports whose streams do not keep it)."""
    if time.monotonic() > deadline:
        raise httpx2.ReadTimeout("timed out waiting for the whole response")


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _headers(response: httpx2.Response) -> dict[str, str]:
    return {k.lower(): v for k, v in response.headers.items()}


def _verify(settings: Settings) -> Any:
    """httpx2's ``verify`` for these shards: the client's TLS context when one is https."""
    if any(url.startswith("https://") for group in settings.groups for url in group):
        return tls_context(settings.verify)
    return True


class HTTPXSender:
    """One exchange through an ``httpx2.Client``, ending at its deadline (see
    :class:`~client_sdk._http.httpx_deadline.Deadlines`), its reply at most ``max_reply_bytes``
    unless the request says. Thread-safe."""

    def __init__(
        self,
        settings: Settings,
        transport: httpx2.BaseTransport | None,
        urls: list[str] | None = None,
    ) -> None:
        pool_limits = limits(len(settings.shards), settings.max_inflight)
        if transport is None:
            transport = httpx2.HTTPTransport(
                limits=pool_limits, trust_env=False, verify=_verify(settings)
            )
        Deadlines.install(transport)
        self.client = httpx2.Client(
            timeout=timeout(settings.timeout),
            limits=pool_limits,
            transport=transport,
            trust_env=False,
        )
        self.urls = urls if urls is not None else list(settings.shards)
        self.max_reply = settings.max_reply_bytes

    def once(self, req: ShardRequest, deadline: float, abort: Abort | None = None) -> Reply:
        """One exchange, by ``deadline``, cut short when ``abort`` (by default the
        request's) is fired."""
        Deadlines.set(deadline, abort if abort is not None else req.abort)
        try:
            return self._exchange(req, deadline)
        finally:
            Deadlines.set(None)

    def _exchange(self, req: ShardRequest, deadline: float) -> Reply:
        url = req.url or self.urls[req.shard]
        limit = self.max_reply if req.max_reply is None else req.max_reply
        body = _SyncBody(req.body) if req.body is not None else None
        response = self.client.send(_build(self.client, url, req, body, deadline), stream=True)
        try:
            _replies.refuse_encoded(response.headers, response.status_code, url)
            if response.is_stream_consumed:  # a transport that read it already
                content: bytes | memoryview = _consumed(response, limit, url)
            else:
                reading = _Body(response, limit, url)
                for chunk in response.iter_raw():
                    reading.add(chunk)
                    _in_time(deadline)
                content = reading.content()
        finally:
            response.close()
        return Reply(response.status_code, _headers(response), content)

    def close(self) -> None:
        self.client.close()


class AsyncHTTPXSender:
    """The async twin of :class:`HTTPXSender`, over an ``httpx2.AsyncClient``: an exchange
    still under way at its deadline is cancelled (its connection closed)."""

    def __init__(
        self,
        settings: Settings,
        transport: httpx2.AsyncBaseTransport | None,
        urls: list[str] | None = None,
    ) -> None:
        self.client = httpx2.AsyncClient(
            timeout=timeout(settings.timeout),
            limits=limits(len(settings.shards), settings.max_inflight),
            transport=transport,
            trust_env=False,
            verify=_verify(settings),
        )
        self.urls = urls if urls is not None else list(settings.shards)
        self.max_reply = settings.max_reply_bytes

    async def once(self, req: ShardRequest, deadline: float, abort: Abort | None = None) -> Reply:
        """See :meth:`HTTPXSender.once`."""
        abort = abort if abort is not None else req.abort
        if abort is not None:
            return await self._cuttable(req, deadline, abort)
        try:
            return await asyncio.wait_for(
                self._exchange(req, deadline), max(0.0, deadline - time.monotonic())
            )
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise httpx2.ReadTimeout("timed out waiting for the whole response") from exc

    async def _cuttable(self, req: ShardRequest, deadline: float, abort: Abort) -> Reply:
        """:meth:`once` of a request whose ``abort`` may cut it short: the exchange runs as a
        task, cancelled (its connection closed) at its deadline or once ``abort`` is fired
        (then :class:`httpx2.ReadError`)."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._exchange(req, deadline))
        cut: asyncio.Future[None] = loop.create_future()
        abort.hold(id(task), functools.partial(loop.call_soon_threadsafe, _settle, cut))  # type: ignore[arg-type]
        try:
            await asyncio.wait(
                (task, cut),
                timeout=max(0.0, deadline - time.monotonic()),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            abort.drop(id(task))
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            cut.cancel()
        if not task.cancelled():
            return task.result()
        if cut.done() and not cut.cancelled():
            raise httpx2.ReadError("the exchange was abandoned (its shard was left)")
        raise httpx2.ReadTimeout("timed out waiting for the whole response")

    async def _exchange(self, req: ShardRequest, deadline: float) -> Reply:
        url = req.url or self.urls[req.shard]
        limit = self.max_reply if req.max_reply is None else req.max_reply
        body = _AsyncBody(req.body) if req.body is not None else None
        response = await self.client.send(
            _build(self.client, url, req, body, deadline), stream=True
        )
        try:
            _replies.refuse_encoded(response.headers, response.status_code, url)
            if response.is_stream_consumed:
                content: bytes | memoryview = _consumed(response, limit, url)
            else:
                reading = _Body(response, limit, url)
                async for chunk in response.aiter_raw():
                    reading.add(chunk)
                content = reading.content()
        finally:
            await response.aclose()
        return Reply(response.status_code, _headers(response), content)

    async def close(self) -> None:
        await self.client.aclose()
