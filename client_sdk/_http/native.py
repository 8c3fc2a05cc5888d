"""The senders over the SDK's own HTTP/1.1 connections: :class:`NativeSender` (the blocking
pool and the fan-out, for ``PSClient``) and :class:`AsyncNativeSender` (the asyncio pool).

``_transport.py`` uses them unless a transport is injected, for ``http://`` and ``https://``
shards alike (TLS: ``tls.py``). A blocking exchange with one ``http://`` shard that is not
part of a race nor watched for stalls is driven by ``direct.py`` (the common reply parsed in
place, without the pool's generator layers).
They write the body's own buffers with ``sendmsg`` and read a reply body straight into one
buffer: a fraction of httpx2's per-request Python, and a big reply copied once, from the socket
into its final buffer. A ``PSClient`` call to several shards sends their requests from the
caller's thread, all at once, rather than one thread per shard: over idle plain ``http://``
connections, requests that go out whole and cannot be aborted by ``direct.py`` (all sent, then
the replies read in order); otherwise by the fan-out (``fanout.py``).

A sender performs one exchange per call, by the deadline it is given, cut short when its
:class:`~client_sdk._abort.Abort` is fired (the request's, or one given for the attempt);
``_transport.py`` decides the deadlines and the retries. Failures are httpx2's exception
classes, and :class:`~client_sdk.ProtocolError` for a reply refused before it is decoded.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import httpx2

from .. import _replies
from .._abort import Abort
from .._exceptions import PSError
from .._flow import Reply, ShardRequest, request_headers
from .._settings import Settings
from . import direct
from .asyncpool import AsyncHTTPPool
from .connection import CONNECT_TIMEOUT, idle_per_shard
from .fanout import exchange_all
from .http11 import Buffer, Exchange, Origin, Response, request_head
from .pool import HTTPPool
from .tls import context

__all__ = ["AsyncNativeSender", "NativeSender"]

#: Runs a blocking call on another thread (an executor's ``submit``).
Submit = Callable[..., concurrent.futures.Future[Any]]


def _pool_args(settings: Settings) -> dict[str, Any]:
    https = any(url.startswith("https://") for group in settings.groups for url in group)
    return {
        "max_idle": idle_per_shard(settings.max_inflight),
        "connect_timeout": min(settings.timeout, CONNECT_TIMEOUT),
        "timeout": settings.timeout,
        "max_reply": settings.max_reply_bytes,
        "tls": context(settings.verify) if https else None,
    }


class _Native:
    """What the two native senders share: the shards' origins, and a request made into an
    :class:`~client_sdk._http.http11.Exchange` and a response into a :class:`Reply`.

    ``urls[i]`` is where shard ``i``'s requests go, read at each exchange (a replicated
    index's current primary: ``_replicas.py``); a request's own ``url`` goes before it."""

    def __init__(self, settings: Settings, urls: list[str] | None = None) -> None:
        self.urls = urls if urls is not None else list(settings.shards)
        self.origins = {url: Origin(url) for group in settings.groups for url in group}

    def url(self, req: ShardRequest) -> str:
        return req.url or self.urls[req.shard]

    def exchange(self, req: ShardRequest, deadline: float, abort: Abort | None = None) -> Exchange:
        return Exchange(
            self.origins[self.url(req)],
            req.method,
            req.path,
            request_headers(req),
            req.body.chunks if req.body is not None else (),
            deadline=deadline,
            max_reply=req.max_reply,
            abort=abort if abort is not None else req.abort,
            into=req.into,
        )

    def reply(self, req: ShardRequest, r: Response) -> Reply:
        _replies.refuse_encoded(r.headers, r.status, self.url(req))
        return Reply(r.status, r.headers, r.content)


class NativeSender(_Native):
    """One exchange over :class:`~client_sdk._http.pool.HTTPPool`: a connection per
    concurrent request to a shard, ``max_inflight + 2`` kept idle per shard. Thread-safe."""

    def __init__(self, settings: Settings, urls: list[str] | None = None) -> None:
        super().__init__(settings, urls)
        self.pool = HTTPPool(**_pool_args(settings))

    def once(self, req: ShardRequest, deadline: float, abort: Abort | None = None) -> Reply:
        origin = self.origins[self.url(req)]
        if origin.tls or abort is not None or req.abort is not None:
            return self.reply(req, self.pool.exchange(self.exchange(req, deadline, abort)))
        views: list[Buffer] = [request_head(origin, req.method, req.path, request_headers(req))]
        if req.body is not None:
            views += req.body.chunks
        max_reply = self.pool.max_reply if req.max_reply is None else req.max_reply
        return self.reply(
            req, direct.exchange(self.pool, origin, views, deadline, max_reply, req.into)
        )

    def once_all(
        self,
        reqs: Sequence[ShardRequest],
        deadlines: Sequence[float],
        submit: Submit,
        aborts: Sequence[Abort | None] | None = None,
    ) -> list[Reply | Exception]:
        """One exchange per request, all at once from this thread (``fanout.py``; ``submit``
        opens new connections); each a :class:`Reply` or the exception :meth:`once` would have
        raised instead."""
        cuts = aborts if aborts is not None else [None] * len(reqs)
        outcomes = self._direct_all(reqs, deadlines, cuts)
        if outcomes is None:
            exchanges = [self.exchange(r, d, a) for r, d, a in zip(reqs, deadlines, cuts)]
            outcomes = exchange_all(self.pool, exchanges, submit)
        replies: list[Reply | Exception] = []
        for req, outcome in zip(reqs, outcomes):
            if isinstance(outcome, Response):
                try:
                    replies.append(self.reply(req, outcome))
                except PSError as exc:
                    replies.append(exc)
            else:
                replies.append(outcome)
        return replies

    def _direct_all(
        self, reqs: Sequence[ShardRequest], deadlines: Sequence[float], cuts: Sequence[Abort | None]
    ) -> list[Response | httpx2.HTTPError] | None:
        """The exchanges of :meth:`once_all` over the direct path (``direct.exchange_all``:
        its requests sent one after the other, then its replies read in order, with no
        per-exchange machinery), where they are all plain ``http://`` and none can be aborted;
        ``None`` where it does not take them."""
        targets = []
        for req, deadline, cut in zip(reqs, deadlines, cuts):
            origin = self.origins[self.url(req)]
            if origin.tls or cut is not None or req.abort is not None:
                return None
            views: list[Buffer] = [request_head(origin, req.method, req.path, request_headers(req))]
            if req.body is not None:
                views += req.body.chunks
            max_reply = self.pool.max_reply if req.max_reply is None else req.max_reply
            targets.append((origin, views, deadline, max_reply, req.into))
        return direct.exchange_all(self.pool, targets)

    def close(self) -> None:
        self.pool.close()


class AsyncNativeSender(_Native):
    """The async twin of :class:`NativeSender`, over
    :class:`~client_sdk._http.asyncpool.AsyncHTTPPool`."""

    def __init__(self, settings: Settings, urls: list[str] | None = None) -> None:
        super().__init__(settings, urls)
        self.pool = AsyncHTTPPool(**_pool_args(settings))

    async def once(self, req: ShardRequest, deadline: float, abort: Abort | None = None) -> Reply:
        return self.reply(req, await self.pool.exchange(self.exchange(req, deadline, abort)))

    async def close(self) -> None:
        await self.pool.close()
