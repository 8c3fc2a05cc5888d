"""Following a replica group's primary: asking its replicas who leads, after a refusal or a
failure (:func:`follow`) and for an exchange that stopped getting answers (:func:`watch`).

``_transport.py`` decides when, for both shells alike; this module asks and follows:

* :func:`follow` (:func:`afollow`): the replica a request went to refused it (421
  ``not_primary``) or could not be reached: every replica of the group is asked for its
  ``GET /v1/cluster``, the index's requests go to the primary they name
  (:meth:`Replicas.follow <client_sdk._replicas.Replicas.follow>`) and the request is tried
  again there;
* :func:`watch` (:func:`awatch`): each attempt at a request to a replica group is watched by
  the client's :class:`~client_sdk._stalls.Stalls`, whose rule abandons an exchange with a
  primary that stopped answering once another replica leads; the attempt is sent with the
  watch's abort (:func:`cut_by`), and the watch's driver (a thread, or a task on the loop) is
  started on first use, asking a group with :func:`ask_group` (:func:`aask_group`): every
  replica at once.

Thread-safe (the sync half), or used from the client's event loop (the async half).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass

import httpx2

from ._abort import Abort
from ._core import Core
from ._exceptions import PSError
from ._flow import Reply, ShardRequest
from ._http.httpx_senders import AsyncHTTPXSender, HTTPXSender
from ._http.native import AsyncNativeSender, NativeSender
from ._replicas import choose
from ._stalls import Decides, Watched

__all__ = [
    "ASK_TIMEOUT",
    "Failover",
    "aask_group",
    "afollow",
    "ask_group",
    "awatch",
    "cut_by",
    "follow",
    "unwatch",
    "watch",
]

Sender = NativeSender | HTTPXSender
AsyncSender = AsyncNativeSender | AsyncHTTPXSender
#: What one ask may fail with (the transport's, and the SDK's own refusals of a reply).
_FAILURES = (httpx2.HTTPError, httpx2.InvalidURL, httpx2.StreamError, PSError)


@dataclass(frozen=True)
class Failover:
    """The replica asked is not (or no longer reachable as) its index's primary: find the
    primary (:func:`follow`), then try again there, after ``delay`` seconds unless the
    primary is another replica. ``named``: the primary the refusal named, if any."""

    delay: float
    named: str | None = None


#: Seconds one ``GET /v1/cluster`` of a replica may take while looking for the primary.
ASK_TIMEOUT = 2.0


def _asks(core: Core, shard: int, deadline: float) -> list[ShardRequest]:
    """``GET /v1/cluster`` of every replica of shard index ``shard``, by ``deadline``."""
    base = core.get(shard, "/v1/cluster", deadline, "cluster")
    return [
        ShardRequest(
            base.shard,
            base.method,
            base.path,
            base.headers,
            None,
            False,
            deadline,
            "cluster",
            max_reply=core.max_reply,
            url=url,
        )
        for url in core.replicas.groups[shard]
    ]


def _settle(
    core: Core, req: ShardRequest, failover: Failover, answers: list[Reply | None]
) -> float:
    """Where ``req``'s index goes now, from its replicas' answers: 0 s to wait when that is
    another replica than before, else the failover's delay."""
    replicas = core.replicas
    found = choose(replicas.groups[req.shard], answers)
    if found is None:
        if failover.named is None:
            return failover.delay
        found = failover.named, replicas.epochs[req.shard]  # what the refusal said
    url, epoch = found
    return 0.0 if replicas.follow(req.shard, url, epoch) else failover.delay


def follow(sender: Sender, core: Core, req: ShardRequest, failover: Failover) -> float:
    """Find the primary of ``req``'s shard index and send its requests there; the seconds to
    wait before trying ``req`` again. Blocks (one short request to each replica, at once)."""
    deadline = min(req.deadline, time.monotonic() + ASK_TIMEOUT)
    return _settle(core, req, failover, ask_group(sender, core, req.shard, None, deadline))


async def afollow(sender: AsyncSender, core: Core, req: ShardRequest, failover: Failover) -> float:
    """The async twin of :func:`follow`."""
    deadline = min(req.deadline, time.monotonic() + ASK_TIMEOUT)
    return _settle(core, req, failover, await aask_group(sender, core, req.shard, None, deadline))


# -- leaving a primary that stopped answering (the rule: _stalls.py) ----------------------------


def watch(core: Core, req: ShardRequest, sender: Sender) -> Watched | None:
    """Watch an attempt at ``req`` starting now (``_stalls.py``), the thread driver started
    on first use; ``None`` when its index is not watched."""
    if req.url is not None:  # an ask, or a read sent to a backup: not the primary's
        return None
    stalls = core.stalls
    watched = stalls.begin(req.shard, core.replicas.current[req.shard])
    if watched is not None and not stalls.driven():
        stalls.start_thread(lambda shard, decides: ask_group(sender, core, shard, decides))
    return watched


def awatch(core: Core, req: ShardRequest, sender: AsyncSender) -> Watched | None:
    """The async twin of :func:`watch`: the driver is a task on the running loop."""
    if req.url is not None:
        return None
    stalls = core.stalls
    watched = stalls.begin(req.shard, core.replicas.current[req.shard])
    if watched is not None and not stalls.driven(asyncio.get_running_loop()):
        stalls.start_task(lambda shard, decides: aask_group(sender, core, shard, decides))
    return watched


def cut_by(req: ShardRequest, watched: Watched | None) -> Abort | None:
    """The abort a watched attempt at ``req`` is sent with: the watch's, which the abort of
    ``req``'s race (if it is one) fires too; ``None`` (the request's own) when not watched."""
    if watched is None:
        return None
    if req.abort is not None:
        req.abort.hold(id(watched), watched.abort.fire)
    return watched.abort


def unwatch(core: Core, req: ShardRequest, watched: Watched | None) -> None:
    if watched is not None:
        core.stalls.end(watched)
        if req.abort is not None:
            req.abort.drop(id(watched))


def ask_group(
    sender: Sender,
    core: Core,
    shard: int,
    decides: Decides | None = None,
    deadline: float | None = None,
) -> list[Reply | None]:
    """Every replica of index ``shard``'s ``GET /v1/cluster``, asked at once (``None``: no
    answer by ``deadline``, by default :data:`ASK_TIMEOUT` from now: a replica that takes
    every packet and answers none, frozen or cut off, costs that long), or those that
    answered once ``decides`` says they are enough (the others' answers are not waited for).
    Blocks."""
    asks = _asks(core, shard, deadline or time.monotonic() + ASK_TIMEOUT)
    submit = core.stalls.ask_pool().submit
    # One thread each, not one thread driving all (``fanout.py``): a new connection to a
    # frozen replica blocks in its connect or TLS handshake until the deadline, which would
    # leave no time for the others' exchanges.
    futures = {submit(sender.once, ask, ask.deadline): r for r, ask in enumerate(asks)}
    answers: list[Reply | None] = [None] * len(asks)
    for future in concurrent.futures.as_completed(futures):
        try:
            answers[futures[future]] = future.result()
        except _FAILURES:
            continue
        if decides is not None and decides(answers):
            break
    return answers


async def aask_group(
    sender: AsyncSender,
    core: Core,
    shard: int,
    decides: Decides | None = None,
    deadline: float | None = None,
) -> list[Reply | None]:
    """The async twin of :func:`ask_group`: the asks not waited for are cancelled."""
    asks = _asks(core, shard, deadline or time.monotonic() + ASK_TIMEOUT)
    tasks = {asyncio.ensure_future(sender.once(ask, ask.deadline)): r for r, ask in enumerate(asks)}
    answers: list[Reply | None] = [None] * len(asks)
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                error = task.exception()
                if error is None:
                    answers[tasks[task]] = task.result()
                elif not isinstance(error, _FAILURES):
                    raise error
            if decides is not None and decides(answers):
                break
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    return answers
