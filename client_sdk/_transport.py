"""Where HTTP meets the SDK: sending one request, retrying it, mapping transport errors.

Both shells send a :class:`~client_sdk._flow.ShardRequest` through :func:`send` (sync) or
:func:`asend` (async), each with a *sender* that performs one HTTP exchange (``_http/``):

* the native senders (``_http/native.py``), the default when no transport is injected: the
  SDK's own keep-alive HTTP/1.1 connections, plain or TLS (``https://``, ``_http/tls.py``);
* the httpx2 senders (``_http/httpx_senders.py``), for a ``transport`` the caller injects
  (``httpx2.MockTransport`` in tests) and Windows' event loop.

:func:`sync_sender` and :func:`async_sender` choose. Every attempt has one deadline for the
whole exchange (connect, request, whole reply): ``timeout`` from its start (a long poll's or a
checkpoint's own time instead), and no retry runs past the call's ``retry_deadline``
(:func:`attempt_deadline`); a sender ends its exchange by then. Every reply body is bounded by
the request's ``max_reply`` (what the SDK knows its reply can need, see
:func:`client_sdk._verbs.pull.reply_bound`) before a byte of it is allocated; a bigger one is
a :class:`~client_sdk.ProtocolError` at once, not retried, and its connection is closed.

Whether and when to try again is decided here, once for both shells (:func:`retry_delay`):
429/503 always, transport failures for requests safe to repeat, with exponential backoff and
jitter, ``Retry-After`` honoured, until the call's deadline. A request still retrying after
:data:`WAITING_LOG_AFTER` seconds says what it waits for in the log (``client_sdk`` logger,
a warning), so a worker whose shard is not up yet is not silent until ``retry_deadline``.
A request to a replica group follows its primary (``_following.py``): after a refusal or a
failure, and when its attempt is abandoned for a new primary by the client's watch of
exchanges that get no answer (``_stalls.py``): then it is sent there at once.

:func:`send`, :func:`send_all` and :func:`asend` return a :class:`~client_sdk._flow.Reply` or
the ``PSError`` that prevented one, and never raise transport errors: both senders fail with
httpx2's exception classes, and every one is translated here, where it enters (``raise ... from
exc``), to the most specific class of the SDK's tree. Which of them mean "the request never left"
(so that even a mutating request may be retried) is decided in one place, :data:`_UNSENT`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx2

from . import _replies, wire
from ._core import Core
from ._exceptions import ConfigError, ProtocolError, PSError, ShardUnavailableError
from ._flow import Reply, Result, ShardRequest
from ._following import Failover, afollow, awatch, cut_by, follow, unwatch, watch
from ._http.http11 import ReplyTooLarge
from ._http.httpx_senders import AsyncHTTPXSender, HTTPXSender
from ._http.native import AsyncNativeSender, NativeSender
from ._replicas import not_primary
from ._settings import Settings
from ._stalls import Watched

logger = logging.getLogger("client_sdk")

__all__ = [
    "AsyncSender",
    "Sender",
    "arace",
    "asend",
    "async_sender",
    "attempt_deadline",
    "race",
    "retry_delay",
    "send",
    "send_all",
    "settle",
    "sync_sender",
]

Sender = NativeSender | HTTPXSender
AsyncSender = AsyncNativeSender | AsyncHTTPXSender
#: What settles a request (anything else :func:`_judge` returns is a delay before a retry, or
#: a :class:`Failover`).
_SETTLED = (Reply, PSError)


@dataclass(frozen=True)
class ToPrimary:
    """The backup a read was sent to (``allow_backup``) did not answer it: it goes to the
    primary at once, and the backup is passed over for a while (``_replicas.py``)."""


#: Runs a blocking call on another thread (an executor's ``submit``).
Submit = Callable[..., concurrent.futures.Future[Any]]

#: Transport errors after which the request certainly did not reach the shard.
_UNSENT = (httpx2.ConnectError, httpx2.ConnectTimeout, httpx2.PoolTimeout)
#: What a sender may raise for a failed exchange (the rest are bugs and propagate).
_TRANSPORT_ERRORS = (httpx2.HTTPError, httpx2.InvalidURL, httpx2.StreamError)


def _native(settings: Settings, transport: object) -> bool:
    return transport is None


def sync_sender(
    settings: Settings, transport: httpx2.BaseTransport | None, urls: list[str] | None = None
) -> Sender:
    """The sender a :class:`~client_sdk.PSClient` uses: native unless a transport is
    injected. ``urls[i]``: where shard ``i``'s requests go, read at each exchange (a core's
    ``replicas.current``). Does no I/O."""
    if _native(settings, transport):
        return NativeSender(settings, urls)
    return HTTPXSender(settings, transport, urls)


def async_sender(
    settings: Settings, transport: httpx2.AsyncBaseTransport | None, urls: list[str] | None = None
) -> AsyncSender:
    """The sender an :class:`~client_sdk.AsyncPSClient` uses: native unless a transport is
    injected, or the platform's event loop cannot wait for sockets (Windows). Does no I/O."""
    if _native(settings, transport) and sys.platform != "win32":
        return AsyncNativeSender(settings, urls)
    return AsyncHTTPXSender(settings, transport, urls)


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
    if isinstance(exc, ReplyTooLarge):
        return _replies.too_large(exc.size, exc.limit, exc.declared, url)
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


def settle(
    sender: Sender, core: Core, req: ShardRequest, started: float, outcome: Reply | Exception
) -> Result:
    """:func:`send`, but for a request whose first attempt (made at ``started``, not watched:
    the direct path, ``_direct.py``) already had ``outcome``, the reply or the exception that
    ended it: its result, the attempts after it made as :func:`send` makes them."""
    verdict = _judge(core, req, 1, started, outcome)
    if isinstance(verdict, _SETTLED):
        return verdict
    return _retry(sender, core, req, started, 1, verdict)


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
    deadlines = [attempt_deadline(core, req) for req in reqs]
    watched = [watch(core, req, sender) for req in reqs]
    try:
        outcomes = sender.once_all(
            reqs, deadlines, submit, [cut_by(req, w) for req, w in zip(reqs, watched)]
        )
    finally:
        for req, w in zip(reqs, watched):
            unwatch(core, req, w)
    results: list[Result | float | Failover | ToPrimary] = [
        _judge(core, req, 1, started, outcome, w)
        for req, outcome, w in zip(reqs, outcomes, watched)
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
    sender: Sender,
    core: Core,
    req: ShardRequest,
    started: float,
    attempt: int,
    delay: float | Failover | ToPrimary | None,
) -> Result:
    """Attempts after the ``attempt``-th (made at ``started``), the first after ``delay``
    seconds, until one settles the request (or its abort is fired)."""
    abort = req.abort
    while True:
        if isinstance(delay, ToPrimary):
            req, delay = dataclasses.replace(req, url=None), None
        if isinstance(delay, Failover):
            delay = follow(sender, core, req, delay)
        if delay is not None:
            if abort is None:
                time.sleep(delay)
            elif abort.fired.wait(delay):
                return _abandoned(core, req)
        if abort is not None and abort.fired.is_set():
            return _abandoned(core, req)
        attempt += 1
        watched = watch(core, req, sender)
        try:
            outcome: Reply | Exception = sender.once(
                req, attempt_deadline(core, req), cut_by(req, watched)
            )
        except (*_TRANSPORT_ERRORS, PSError) as exc:
            outcome = exc
        finally:
            unwatch(core, req, watched)
        verdict = _judge(core, req, attempt, started, outcome, watched)
        if isinstance(verdict, _SETTLED):
            return verdict
        delay = verdict


def _judge(
    core: Core,
    req: ShardRequest,
    attempt: int,
    started: float,
    outcome: Reply | Exception,
    watched: Watched | None = None,
) -> Result | float | Failover | ToPrimary:
    """What the ``attempt``-th try's outcome (a reply, or the exception that ended it) means:
    the request's result, or the seconds to wait before trying again."""
    if (
        watched is not None
        and watched.superseded
        and isinstance(outcome, _TRANSPORT_ERRORS)
        and (req.retry_safe or not req.mutating)
        and time.monotonic() < req.deadline
    ):
        return 0.0  # abandoned for the index's new primary (_stalls.py): sent there now
    if req.allow_backup and req.url is not None and _backup_failed(outcome):
        core.replicas.shun(req.url)
        return ToPrimary()
    if isinstance(outcome, PSError):
        return outcome
    if isinstance(outcome, ReplyTooLarge):  # the same request would get it again
        return _chain(_translate(outcome, core, req, attempt, started), outcome)
    replicated = req.url is None and core.replicas.replicated(req.shard)
    if isinstance(outcome, Reply):
        if outcome.status < 300:  # the common case, answered: nothing to retry
            return outcome
        if replicated:
            refused, named = not_primary(outcome)
            if refused:  # nothing was applied: find the primary, send it there
                delay = retry_delay(req, attempt - 1, status=503)
                if delay is None:
                    return outcome
                _say_waiting(core, req, started, "it is not the primary")
                return Failover(delay, named)
        delay = retry_delay(
            req, attempt - 1, status=outcome.status, retry_after=outcome.headers.get("retry-after")
        )
        if delay is None:
            return outcome
        _say_waiting(core, req, started, f"it answered {outcome.status}")
        return delay
    delay = retry_delay(req, attempt - 1, unsent=isinstance(outcome, _UNSENT))
    if delay is None:
        return _chain(_translate(outcome, core, req, attempt, started), outcome)
    _say_waiting(core, req, started, f"{type(outcome).__name__}: {outcome}"[:300])
    return Failover(delay) if replicated else delay


def _backup_failed(outcome: Reply | Exception) -> bool:
    """Whether a backup's outcome for a read sends the read to the primary: no answer, 429 or
    503 (busy, not ready), 421 ``not_primary`` (not a backup of a known primary, or not
    in-sync)."""
    if not isinstance(outcome, Reply):
        return True
    return outcome.status in (429, 503) or not_primary(outcome)[0]


#: A request still retrying this many seconds after its first attempt is logged (a warning),
#: at most once per :data:`WAITING_LOG_EVERY` seconds per shard.
WAITING_LOG_AFTER = 3.0
WAITING_LOG_EVERY = 10.0
_waiting_logged: dict[str, float] = {}


def _say_waiting(core: Core, req: ShardRequest, started: float, why: str) -> None:
    """Log that ``req`` is still waiting for its shard, after :data:`WAITING_LOG_AFTER` s."""
    now = time.monotonic()
    if now - started < WAITING_LOG_AFTER:
        return
    url = core.url(req.shard)
    if now - _waiting_logged.get(url, -WAITING_LOG_EVERY) < WAITING_LOG_EVERY:
        return
    _waiting_logged[url] = now
    logger.warning(
        "still waiting for shard %s (position %d of the shard list) to answer %s: %s; "
        "retrying for %.0f s more (retry_deadline): is the shard up, and %s right?",
        url,
        req.shard,
        req.verb,
        why,
        max(0.0, req.deadline - now),
        wire.ENV_SHARDS,
    )


async def asend(sender: AsyncSender, core: Core, req: ShardRequest) -> Result:
    """The async twin of :func:`send`."""
    started = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        watched = awatch(core, req, sender)
        try:
            outcome: Reply | Exception = await sender.once(
                req, attempt_deadline(core, req), cut_by(req, watched)
            )
        except (*_TRANSPORT_ERRORS, PSError) as exc:
            outcome = exc
        finally:
            unwatch(core, req, watched)
        verdict = _judge(core, req, attempt, started, outcome, watched)
        if isinstance(verdict, _SETTLED):
            return verdict
        if isinstance(verdict, ToPrimary):
            req = dataclasses.replace(req, url=None)
            continue
        if isinstance(verdict, Failover):
            verdict = await afollow(sender, core, req, verdict)
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
