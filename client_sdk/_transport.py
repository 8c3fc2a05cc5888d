"""Where HTTP meets the SDK: sending one request, retrying it, mapping transport errors.

Both shells send a :class:`~client_sdk._flow.ShardRequest` through :func:`send` (sync) or
:func:`asend` (async), each with a *sender* that performs one HTTP exchange:

* :class:`NativeSender` / :class:`AsyncNativeSender`, the default when every shard is an
  ``http://`` URL and no transport is injected: the SDK's own keep-alive HTTP/1.1 pools
  (``_http11.py``, ``_pool.py``, ``_apool.py``), which write the body's own buffers with
  ``sendmsg`` and read a reply body straight into one buffer. They cost a fraction of httpx2's
  per-request Python and copy a big reply once, from the socket into its final buffer. A
  ``PSClient`` call to several shards sends their requests from the caller's thread, all at
  once (``_fanout.py``), rather than one thread per shard.
* :class:`HTTPXSender` / :class:`AsyncHTTPXSender`: an ``httpx2.Client`` / ``AsyncClient``, for
  ``https://`` shards and for a ``transport`` the caller injects (``httpx2.MockTransport`` in
  tests). Request bodies are handed to httpx2 as the encoder left them (the msgpack header and
  memoryviews of the arrays, in 1 MiB slices) with an explicit ``Content-Length`` (so httpx2
  does not switch to chunked encoding); reply bodies are read into one ``np.empty`` buffer
  sized by ``Content-Length`` (a ``bytearray`` would be zero-filled first, which for 100 MB
  costs as much as copying the body in).

Every attempt has one deadline for the whole exchange (connect, request, whole reply):
``timeout`` from its start (a long poll's or a checkpoint's own time instead), and no retry
runs past the call's ``retry_deadline`` (:func:`attempt_deadline`). The native pools wait on sockets
until that deadline; over httpx2, whose timeouts bound each wait for bytes, the sync sender
gives each connection's reads and writes only what is left of the deadline (``_Deadlines``,
for the transports it can reach) and checks the deadline between the pieces of a reply, and
the async one cancels the exchange at its deadline. Every reply body is bounded by
the request's ``max_reply`` (what the SDK knows its reply can need, see
:func:`client_sdk._verbs.pull._reply_bound`) before a byte of it is allocated; a bigger one is
a :class:`~client_sdk.ProtocolError` at once, not retried, and its connection is closed.

:func:`send`, :func:`send_all` and :func:`asend` return a :class:`~client_sdk._flow.Reply` or
the ``PSError`` that prevented one, and never raise transport errors: both senders fail with
httpx2's exception classes, and every one is translated here, where it enters (``raise ... from
exc``), to the most specific class of the SDK's tree. Which of them mean "the request never left"
(so that even a mutating request may be retried) is decided in one place, :data:`_UNSENT`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import random
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx2
import numpy as np

from ._abort import Abort
from ._core import Core
from ._exceptions import ConfigError, ProtocolError, PSError, ShardUnavailableError
from ._flow import Reply, ShardRequest
from ._http import http11 as _http11
from ._http.asyncpool import AsyncHTTPPool
from ._http.fanout import Exchange, exchange_all
from ._http.pool import HTTPPool
from ._settings import Settings
from .wire import Encoded

if TYPE_CHECKING:
    import httpcore2

__all__ = [
    "AsyncHTTPXSender",
    "AsyncNativeSender",
    "HTTPXSender",
    "NativeSender",
    "arace",
    "asend",
    "async_sender",
    "limits",
    "race",
    "retry_delay",
    "send",
    "send_all",
    "sync_sender",
    "timeout",
]

#: Body chunks larger than this are handed to the connection in slices of this size: h11
#: copies each chunk it is given, and small copies stay in cache.
SLICE = 1 << 20
#: Connect attempts fail fast so that retries (and wait_ready) notice a shard coming up.
CONNECT_TIMEOUT = 5.0

Result = Reply | PSError
#: What settles a request (anything else :func:`_judge` returns is a delay before a retry).
_SETTLED = (Reply, PSError)
#: Runs a blocking call on another thread (an executor's ``submit``).
Submit = Callable[..., concurrent.futures.Future[Any]]

#: Transport errors after which the request certainly did not reach the shard.
_UNSENT = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)


def timeout(seconds: float) -> httpx2.Timeout:
    return httpx2.Timeout(seconds, connect=min(seconds, CONNECT_TIMEOUT))


def limits(num_shards: int, max_inflight: int) -> httpx2.Limits:
    """Enough kept-alive connections for every shard to serve a call, ``max_inflight``
    background pushes and a long poll at the same time; no hard cap (callers bound the
    concurrency themselves, and a cap would turn long polls into pool timeouts)."""
    keep = num_shards * _idle_per_shard(max_inflight)
    return httpx2.Limits(
        max_connections=None, max_keepalive_connections=keep, keepalive_expiry=_http11.IDLE_EXPIRY
    )


def _idle_per_shard(max_inflight: int) -> int:
    return max_inflight + 2


def _native(settings: Settings, transport: object) -> bool:
    return transport is None and all(url.startswith("http://") for url in settings.shards)


def sync_sender(settings: Settings, transport: httpx2.BaseTransport | None) -> Sender:
    """The sender a :class:`~client_sdk.PSClient` uses: native unless a transport is injected
    or a shard is ``https://``. Does no I/O."""
    if _native(settings, transport):
        return NativeSender(settings)
    pool_limits = limits(len(settings.shards), settings.max_inflight)
    if transport is None:
        transport = httpx2.HTTPTransport(limits=pool_limits, trust_env=False)
    _Deadlines.install(transport)
    return HTTPXSender(
        httpx2.Client(
            timeout=timeout(settings.timeout),
            limits=pool_limits,
            transport=transport,
            trust_env=False,
        ),
        settings.max_reply_bytes,
    )


def async_sender(settings: Settings, transport: httpx2.AsyncBaseTransport | None) -> AsyncSender:
    """The sender an :class:`~client_sdk.AsyncPSClient` uses: native unless a transport is
    injected, a shard is ``https://``, or the platform's event loop cannot wait for sockets
    (Windows). Does no I/O."""
    if _native(settings, transport) and sys.platform != "win32":
        return AsyncNativeSender(settings)
    return AsyncHTTPXSender(
        httpx2.AsyncClient(
            timeout=timeout(settings.timeout),
            limits=limits(len(settings.shards), settings.max_inflight),
            transport=transport,
            trust_env=False,
        ),
        settings.max_reply_bytes,
    )


# -- the native senders -----------------------------------------------------------------------


def _pool_args(settings: Settings) -> dict[str, Any]:
    return {
        "max_idle": _idle_per_shard(settings.max_inflight),
        "connect_timeout": min(settings.timeout, CONNECT_TIMEOUT),
        "timeout": settings.timeout,
        "max_reply": settings.max_reply_bytes,
    }


def attempt_deadline(core: Core, req: ShardRequest) -> float:
    """When an attempt at ``req`` starting now must have ended, in ``time.monotonic()``
    seconds: the client's ``timeout`` from now, but not past the call's deadline (its
    ``retry_deadline``) unless ``timeout`` is the longer of the two, so that a call's first
    attempt always has its whole ``timeout`` and the call ends within the longer of the two;
    or the request's own ``timeout`` from now (long polls, checkpoints)."""
    if req.timeout is not None:
        return time.monotonic() + req.timeout
    settings = core.settings
    return min(
        time.monotonic() + settings.timeout,
        req.deadline + max(0.0, settings.timeout - settings.retry_deadline),
    )


def _native_request(req: ShardRequest) -> tuple[Mapping[str, str], list[Any]]:
    if req.body is None:
        return req.headers, []
    return (
        {
            **req.headers,
            "content-type": req.body.content_type,
            "content-length": str(req.body.nbytes),
        },
        req.body.chunks,
    )


def _identity(core: Core, req: ShardRequest, headers: Mapping[str, str], status: int) -> None:
    """Refuse a reply whose body is encoded (compressed): the SDK asks for identity, and a
    compressed body could expand past what the call can need before anything checked it."""
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        url = core.url(req.shard)
        raise ProtocolError(
            f"shard {url} sent a body with Content-Encoding {encoding!r} "
            "although the SDK asked for identity: is it behind a proxy "
            "that compresses?",
            shard=url,
            status=status,
        )


def _native_reply(core: Core, req: ShardRequest, r: _http11.Response) -> Reply:
    _identity(core, req, r.headers, r.status)
    return Reply(r.status, r.headers, r.content)


class NativeSender:
    """One exchange over :class:`~client_sdk._pool.HTTPPool`: a connection per concurrent
    request to a shard, ``max_inflight + 2`` kept idle per shard. Thread-safe."""

    def __init__(self, settings: Settings) -> None:
        self.pool = HTTPPool(**_pool_args(settings))
        self.origins = [_http11.Origin(url) for url in settings.shards]

    def once(self, core: Core, req: ShardRequest) -> Reply:
        headers, chunks = _native_request(req)
        r = self.pool.request(
            self.origins[req.shard],
            req.method,
            req.path,
            headers,
            chunks,
            deadline=attempt_deadline(core, req),
            max_reply=req.max_reply,
            abort=req.abort,
        )
        return _native_reply(core, req, r)

    def once_all(
        self, core: Core, reqs: Sequence[ShardRequest], submit: Submit
    ) -> list[Reply | Exception]:
        """One exchange per request, all at once from this thread (``_fanout.py``; ``submit``
        opens new connections); each a :class:`Reply` or the exception :meth:`once` would have
        raised instead."""
        exchanges = []
        for req in reqs:
            headers, chunks = _native_request(req)
            exchanges.append(
                Exchange(
                    self.origins[req.shard],
                    req.method,
                    req.path,
                    headers,
                    chunks,
                    deadline=attempt_deadline(core, req),
                    max_reply=req.max_reply,
                )
            )
        replies: list[Reply | Exception] = []
        for req, outcome in zip(reqs, exchange_all(self.pool, exchanges, submit)):
            if isinstance(outcome, _http11.Response):
                try:
                    replies.append(_native_reply(core, req, outcome))
                except PSError as exc:
                    replies.append(exc)
            else:
                replies.append(outcome)
        return replies

    def close(self) -> None:
        self.pool.close()


class AsyncNativeSender:
    """The async twin of :class:`NativeSender`, over :class:`~client_sdk._apool.AsyncHTTPPool`."""

    def __init__(self, settings: Settings) -> None:
        self.pool = AsyncHTTPPool(**_pool_args(settings))
        self.origins = [_http11.Origin(url) for url in settings.shards]

    async def once(self, core: Core, req: ShardRequest) -> Reply:
        headers, chunks = _native_request(req)
        r = await self.pool.request(
            self.origins[req.shard],
            req.method,
            req.path,
            headers,
            chunks,
            deadline=attempt_deadline(core, req),
            max_reply=req.max_reply,
        )
        return _native_reply(core, req, r)

    async def close(self) -> None:
        await self.pool.close()


# -- the httpx2 senders -----------------------------------------------------------------------


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
    core: Core,
    req: ShardRequest,
    body: _SyncBody | _AsyncBody | None,
    deadline: float,
) -> httpx2.Request:
    """The request, each of its waits for bytes bounded by what is left until ``deadline``."""
    headers = dict(req.headers)
    if req.body is not None:
        headers["content-type"] = req.body.content_type
        headers["content-length"] = str(req.body.nbytes)
    left = max(0.0, deadline - time.monotonic())
    t = client.timeout
    request = client.build_request(
        req.method,
        core.url(req.shard) + req.path,
        headers=headers,
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


class _Deadlines:
    """The deadline of the exchange under way on this thread, kept by httpx2's own network
    streams: a wrapper of an ``httpx2.HTTPTransport``'s network backend (httpcore2's) whose
    streams give each connect, read and write at most what is left of it. httpx2's timeouts
    bound each wait for bytes; with this, the sync sender's exchange ends at its deadline even
    when a server trickles its reply's head. Outside an exchange of the sender, a wrapped
    stream passes every call through unchanged.

    The backend is a private attribute of httpx2's transport (``_pool._network_backend``):
    :meth:`install` reaches it there and nowhere else, and when it is not there (another
    transport, another httpx2) the sync sender keeps the deadline between the pieces of a
    reply only.
    """

    _local = threading.local()

    @classmethod
    def install(cls, transport: object) -> bool:
        """Wrap ``transport``'s network backend, if it has one this knows; whether it did."""
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if backend is None or not callable(getattr(backend, "connect_tcp", None)):
            return False
        if not isinstance(backend, _DeadlineBackend):
            pool._network_backend = _DeadlineBackend(backend)  # type: ignore[union-attr]
        return True

    @classmethod
    def set(cls, deadline: float | None, abort: Abort | None = None) -> None:
        cls._local.deadline = deadline
        cls._local.abort = abort

    @classmethod
    def abort(cls) -> Abort | None:
        """The :class:`~client_sdk._abort.Abort` of the exchange under way on this thread."""
        abort: Abort | None = getattr(cls._local, "abort", None)
        return abort

    @classmethod
    def left(cls, limit: float | None, phase: str) -> float | None:
        """``limit`` (seconds), cut to what is left of this thread's deadline; raises
        httpcore2's timeout of ``phase`` (which httpx2 maps to its own) once it passed."""
        deadline: float | None = getattr(cls._local, "deadline", None)
        if deadline is None:
            return limit
        left = deadline - time.monotonic()
        if left <= 0:
            import httpcore2

            error = {
                "connect": httpcore2.ConnectTimeout,
                "read": httpcore2.ReadTimeout,
                "write": httpcore2.WriteTimeout,
            }[phase]
            raise error(f"the exchange's deadline passed ({phase})")
        return left if limit is None else min(limit, left)


class _DeadlineStream:
    """A network stream whose waits stop at the thread's deadline (see :class:`_Deadlines`)."""

    def __init__(self, inner: httpcore2.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        abort = _Deadlines.abort()
        if abort is None:
            return self._inner.read(max_bytes, _Deadlines.left(timeout, "read"))
        abort.hold(id(self), self._cut)
        try:
            return self._inner.read(max_bytes, _Deadlines.left(timeout, "read"))
        finally:
            abort.drop(id(self))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        abort = _Deadlines.abort()
        if abort is None:
            self._inner.write(buffer, _Deadlines.left(timeout, "write"))
            return
        abort.hold(id(self), self._cut)
        try:
            self._inner.write(buffer, _Deadlines.left(timeout, "write"))
        finally:
            abort.drop(id(self))

    def _cut(self) -> None:
        sock = self._inner.get_extra_info("socket")
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> _DeadlineStream:
        return _DeadlineStream(
            self._inner.start_tls(ssl_context, server_hostname, _Deadlines.left(timeout, "connect"))
        )

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend:
    """A network backend whose streams are :class:`_DeadlineStream`."""

    def __init__(self, inner: httpcore2.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> _DeadlineStream:
        return _DeadlineStream(
            self._inner.connect_tcp(
                host, port, _Deadlines.left(timeout, "connect"), local_address, socket_options
            )
        )

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> _DeadlineStream:
        return _DeadlineStream(
            self._inner.connect_unix_socket(
                path, _Deadlines.left(timeout, "connect"), socket_options
            )
        )

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def _sized_buffer(response: httpx2.Response, limit: int, url: str) -> memoryview | None:
    """One buffer for the body, sized by its ``Content-Length`` (refused past ``limit``);
    ``None`` when the length is not given."""
    length = response.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit, True, url)
    if length is None or not length.isdigit():
        return None
    return memoryview(np.empty(int(length), np.uint8))  # type: ignore[arg-type]  # numpy types ndarray as a buffer for Python >= 3.12 only


def _too_large(size: int, limit: int, declared: bool, url: str) -> ProtocolError:
    what = "declared a reply body of" if declared else "sent a reply body of more than"
    return ProtocolError(
        f"shard {url} {what} {size} bytes where at most {limit} were expected: refused before "
        "reading it, and the connection closed. Something that is not a shard answered, or a "
        "variable is bigger than this client knows (then raise max_reply_bytes=...)",
        shard=url,
        details={"size": size, "limit": limit},
    )


def _in_time(deadline: float) -> None:
    """Raise :class:`httpx2.ReadTimeout` once ``deadline`` passed (between a reply's pieces,
    for transports whose streams do not keep it)."""
    if time.monotonic() > deadline:
        raise httpx2.ReadTimeout("timed out waiting for the whole response")


def _fill(buf: memoryview, pos: int, chunk: bytes, url: str) -> int:
    end = pos + len(chunk)
    if end > len(buf):
        raise ProtocolError(
            f"shard {url} sent more bytes than its Content-Length ({len(buf)})", shard=url
        )
    buf[pos:end] = chunk
    return end


def _short(pos: int, buf: memoryview, url: str) -> ProtocolError:
    return ProtocolError(f"shard {url} sent {pos} of the {len(buf)} bytes it announced", shard=url)


def _headers(response: httpx2.Response) -> dict[str, str]:
    return {k.lower(): v for k, v in response.headers.items()}


class HTTPXSender:
    """One exchange through an ``httpx2.Client``, ending at its deadline (see
    :class:`_Deadlines`), its reply at most ``max_reply`` bytes unless the request says.
    Thread-safe."""

    def __init__(self, client: httpx2.Client, max_reply: int) -> None:
        self.client = client
        self.max_reply = max_reply

    def once(self, core: Core, req: ShardRequest) -> Reply:
        deadline = attempt_deadline(core, req)
        _Deadlines.set(deadline, req.abort)
        try:
            return self._exchange(core, req, deadline)
        finally:
            _Deadlines.set(None)

    def _exchange(self, core: Core, req: ShardRequest, deadline: float) -> Reply:
        client = self.client
        url = core.url(req.shard)
        limit = self.max_reply if req.max_reply is None else req.max_reply
        body = _SyncBody(req.body) if req.body is not None else None
        response = client.send(_build(client, core, req, body, deadline), stream=True)
        try:
            _identity(core, req, response.headers, response.status_code)
            if response.is_stream_consumed:  # a transport that read it already
                content: bytes | memoryview = response.content
                if len(content) > limit:
                    raise _too_large(len(content), limit, True, url)
            elif (buf := _sized_buffer(response, limit, url)) is not None:
                pos = 0
                for chunk in response.iter_raw():
                    pos = _fill(buf, pos, chunk, url)
                    _in_time(deadline)
                if pos != len(buf):
                    raise _short(pos, buf, url)
                content = buf
            else:
                whole = bytearray()
                for chunk in response.iter_raw():
                    whole += chunk
                    if len(whole) > limit:
                        raise _too_large(len(whole), limit, False, url)
                    _in_time(deadline)
                content = bytes(whole)
        finally:
            response.close()
        return Reply(response.status_code, _headers(response), content)

    def close(self) -> None:
        self.client.close()


class AsyncHTTPXSender:
    """The async twin of :class:`HTTPXSender`, over an ``httpx2.AsyncClient``: an exchange
    still under way at its deadline is cancelled (its connection closed)."""

    def __init__(self, client: httpx2.AsyncClient, max_reply: int) -> None:
        self.client = client
        self.max_reply = max_reply

    async def once(self, core: Core, req: ShardRequest) -> Reply:
        deadline = attempt_deadline(core, req)
        try:
            return await asyncio.wait_for(
                self._exchange(core, req, deadline), max(0.0, deadline - time.monotonic())
            )
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise httpx2.ReadTimeout("timed out waiting for the whole response") from exc

    async def _exchange(self, core: Core, req: ShardRequest, deadline: float) -> Reply:
        client = self.client
        url = core.url(req.shard)
        limit = self.max_reply if req.max_reply is None else req.max_reply
        body = _AsyncBody(req.body) if req.body is not None else None
        response = await client.send(_build(client, core, req, body, deadline), stream=True)
        try:
            _identity(core, req, response.headers, response.status_code)
            if response.is_stream_consumed:
                content: bytes | memoryview = response.content
                if len(content) > limit:
                    raise _too_large(len(content), limit, True, url)
            elif (buf := _sized_buffer(response, limit, url)) is not None:
                pos = 0
                async for chunk in response.aiter_raw():
                    pos = _fill(buf, pos, chunk, url)
                if pos != len(buf):
                    raise _short(pos, buf, url)
                content = buf
            else:
                whole = bytearray()
                async for chunk in response.aiter_raw():
                    whole += chunk
                    if len(whole) > limit:
                        raise _too_large(len(whole), limit, False, url)
                content = bytes(whole)
        finally:
            await response.aclose()
        return Reply(response.status_code, _headers(response), content)

    async def close(self) -> None:
        await self.client.aclose()


Sender = NativeSender | HTTPXSender
AsyncSender = AsyncNativeSender | AsyncHTTPXSender

#: What a sender may raise for a failed exchange (the rest are bugs and propagate).
_TRANSPORT_ERRORS = (httpx2.HTTPError, httpx2.InvalidURL, httpx2.StreamError)


# -- retrying and translating -----------------------------------------------------------------


def _translate(
    exc: Exception, core: Core, req: ShardRequest, attempts: int, started: float
) -> PSError:
    """Map an httpx2 error to the SDK's tree, saying what happened and what to do."""
    url = core.url(req.shard)
    took = time.monotonic() - started
    tried = f" (after {attempts} attempt{'s' if attempts != 1 else ''} over {took:.1f}s)"
    if isinstance(exc, PSError):
        return exc
    if isinstance(exc, _http11.ReplyTooLarge):
        return _too_large(exc.size, exc.limit, exc.declared, url)
    if isinstance(exc, (httpx2.UnsupportedProtocol, httpx2.InvalidURL)):
        return ConfigError(f"cannot use shard URL {url}: {exc}", shard=url)
    if isinstance(exc, httpx2.ConnectError):
        msg = (
            f"cannot connect to shard {url}{tried}: {exc or type(exc).__name__}. Is the shard "
            "running, and is the URL in PARAMSHARD_SHARDS (or the shards argument) right?"
        )
    elif isinstance(exc, httpx2.TimeoutException):
        kind = type(exc).__name__
        msg = f"shard {url} did not answer {req.verb} in time ({kind}){tried}"
        if req.mutating and not req.retry_safe and not isinstance(exc, _UNSENT):
            msg += (
                "; the request may have been applied, so it was not retried. Raise "
                "timeout=... if the shard is just slow"
            )
        else:
            msg += "; is it overloaded or stuck? Raise timeout=... if it is just slow"
    elif isinstance(exc, httpx2.TransportError):
        msg = f"lost the connection to shard {url} during {req.verb}{tried}: {exc!r}"
        if req.mutating and not req.retry_safe:
            msg += (
                "; the request may have been applied, so it was not retried: pull to see "
                "the current state"
            )
    else:
        return ProtocolError(f"unexpected HTTP failure talking to shard {url}: {exc!r}", shard=url)
    if req.mutating and req.retry_safe and not isinstance(exc, _UNSENT):
        msg += (
            "; it was retried with the same seq until the retry deadline, so it was "
            "applied at most once (maybe not at all): raise retry_deadline=... to ride out "
            "longer outages"
        )
    return ShardUnavailableError(msg, shard=url)


def send(sender: Sender, core: Core, req: ShardRequest) -> Result:
    """Send one request, retrying as :func:`retry_delay` allows. Blocks; thread-safe."""
    return _retry(sender, core, req, time.monotonic(), 0, None)


def send_all(
    sender: Sender, core: Core, reqs: Sequence[ShardRequest], submit: Submit
) -> list[Result]:
    """:func:`send` each request, all at once; the results in order. Blocks; thread-safe.

    With a :class:`NativeSender`, the first attempts go out together from this thread and only
    requests to retry take a thread of ``submit`` each (as do new connections); otherwise
    every request but the first runs on a thread of ``submit``.
    """
    if len(reqs) == 1:
        return [send(sender, core, reqs[0])]
    if reqs[0].abort is not None:
        return race(sender, core, reqs, submit)  # type: ignore[return-value]
    if not isinstance(sender, NativeSender):
        futures = [submit(send, sender, core, r) for r in reqs[1:]]
        first = send(sender, core, reqs[0])
        return [first] + [f.result() for f in futures]
    started = time.monotonic()
    results: list[Result | float] = [
        _judge(core, req, 1, started, outcome)
        for req, outcome in zip(reqs, sender.once_all(core, reqs, submit))
    ]
    again = [i for i, r in enumerate(results) if not isinstance(r, _SETTLED)]
    retrying = {i: submit(_retry, sender, core, reqs[i], started, 1, results[i]) for i in again[1:]}
    if again:
        i = again[0]
        results[i] = _retry(sender, core, reqs[i], started, 1, results[i])  # type: ignore[arg-type]
    for i, future in retrying.items():
        results[i] = future.result()
    return results  # type: ignore[return-value]


def race(
    sender: Sender, core: Core, reqs: Sequence[ShardRequest], submit: Submit
) -> list[Result | None]:
    """:func:`send` each request (each with its :class:`~client_sdk._abort.Abort`) on a thread
    of ``submit``, all at once; return as soon as one is settled. The others are abandoned:
    fired (their sockets shut down, their retries stopped), waited for, and ``None`` in the
    results. Blocks; thread-safe."""
    futures = [submit(send, sender, core, r) for r in reqs]
    done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
    for req, future in zip(reqs, futures):
        if future not in done and req.abort is not None:
            req.abort.fire()
    concurrent.futures.wait(futures)
    return [f.result() if f in done else None for f in futures]


async def arace(
    sender: AsyncSender, core: Core, reqs: Sequence[ShardRequest]
) -> list[Result | None]:
    """The async twin of :func:`race`: the abandoned requests are cancelled (their
    connections closed)."""
    tasks = [asyncio.ensure_future(asend(sender, core, r)) for r in reqs]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return [t.result() if t in done else None for t in tasks]


def _abandoned(core: Core, req: ShardRequest) -> PSError:
    return ShardUnavailableError(
        f"{req.verb} to shard {core.url(req.shard)} abandoned: another shard answered first",
        shard=core.url(req.shard),
    )


def _retry(
    sender: Sender, core: Core, req: ShardRequest, started: float, attempt: int, delay: float | None
) -> Result:
    """Attempts after the ``attempt``-th (made at ``started``), the first after ``delay``
    seconds, until one settles the request (or its abort is fired)."""
    abort = req.abort
    while True:
        if delay is not None:
            if abort is None:
                time.sleep(delay)
            elif abort.fired.wait(delay):
                return _abandoned(core, req)
        if abort is not None and abort.fired.is_set():
            return _abandoned(core, req)
        attempt += 1
        try:
            outcome: Reply | Exception = sender.once(core, req)
        except (*_TRANSPORT_ERRORS, PSError) as exc:
            outcome = exc
        verdict = _judge(core, req, attempt, started, outcome)
        if isinstance(verdict, _SETTLED):
            return verdict
        delay = verdict


def _judge(
    core: Core, req: ShardRequest, attempt: int, started: float, outcome: Reply | Exception
) -> Result | float:
    """What the ``attempt``-th try's outcome (a reply, or the exception that ended it) means:
    the request's result, or the seconds to wait before trying again."""
    if isinstance(outcome, PSError):
        return outcome
    if isinstance(outcome, _http11.ReplyTooLarge):  # the same request would get it again
        return _chain(_translate(outcome, core, req, attempt, started), outcome)
    if isinstance(outcome, Reply):
        delay = retry_delay(
            req, attempt - 1, status=outcome.status, retry_after=outcome.headers.get("retry-after")
        )
        return outcome if delay is None else delay
    delay = retry_delay(req, attempt - 1, unsent=isinstance(outcome, _UNSENT))
    if delay is None:
        return _chain(_translate(outcome, core, req, attempt, started), outcome)
    return delay


async def asend(sender: AsyncSender, core: Core, req: ShardRequest) -> Result:
    """The async twin of :func:`send`."""
    started = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            outcome: Reply | Exception = await sender.once(core, req)
        except (*_TRANSPORT_ERRORS, PSError) as exc:
            outcome = exc
        verdict = _judge(core, req, attempt, started, outcome)
        if isinstance(verdict, _SETTLED):
            return verdict
        await asyncio.sleep(verdict)


def retry_delay(
    request: ShardRequest,
    attempt: int,
    *,
    unsent: bool = False,
    status: int | None = None,
    retry_after: str | None = None,
) -> float | None:
    """Seconds to wait before retrying ``request``, or ``None`` to give up.

    A reply with status 429/503 is always retryable (the shard changed nothing). A transport
    failure (connection refused or lost, timeout) is retryable for read-only and retry-safe
    requests, and for other mutating ones only when ``unsent`` (the request certainly never
    reached the shard). Backoff is exponential with jitter and ``Retry-After`` is honoured;
    a retry that could not start before the request's deadline is not made (an attempt may
    not run past it: :func:`attempt_deadline`).
    """
    if status is not None:
        if status not in (429, 503):
            return None
    elif request.mutating and not request.retry_safe and not unsent:
        return None
    remaining = request.deadline - time.monotonic()
    if remaining <= 0:
        return None
    backoff = min(1.0, 0.05 * (2 ** min(attempt, 10)))
    delay = backoff / 2 + random.uniform(0, backoff / 2)
    hinted = _parse_retry_after(retry_after)
    if hinted is not None:
        delay = max(delay, hinted)
    return delay if delay < remaining else None


def _parse_retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # the HTTP-date form: fall back to our own backoff
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _chain(err: PSError, cause: BaseException) -> PSError:
    err.__cause__ = cause
    return err
