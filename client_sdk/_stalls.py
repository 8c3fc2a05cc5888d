"""Leaving a primary that is alive but cut off: :class:`Stalls`, the exchanges in flight to
replica groups and the rule that abandons them.

A primary that is frozen (SIGSTOP) or cut from its backups and etcd while its socket stays
open never refuses a request: the kernel takes the request, and the reply never comes. Its
group elects another primary once its lease ends (about one lease TTL), but a request waiting
for that reply would wait its whole ``timeout``. The rule, for every request to a replica
group (any verb, every HTTP layer, both shells):

* an exchange with the replica the index's requests go to that has had no reply for one lease
  TTL of the group (``leadership.lease_ttl`` of its ``GET /v1/cluster``; :data:`DEFAULT_TTL`
  until a replica said) is *due*;
* the client then asks every replica of the group for its ``GET /v1/cluster`` at once (one
  short request each, ``_following.ASK_TIMEOUT``), and stops waiting for the others once an
  answer decides (:meth:`Stalls.verdict`);
* when the primary they name (:func:`~client_sdk._replicas.choose`: the one that says it is
  primary at the highest epoch) is another replica, at an epoch no lower than any this client
  saw for the index (higher, when the stalled replica did not answer: the fleet check noted
  its epoch), the index's requests go there from now on and every exchange still
  waiting on another replica of the group is abandoned: its connection is cut (its reply, if
  it ever comes, is never read) and the request is sent to the new primary at once, as it
  was: a write with the same ``worker_id`` and ``seq``, which the group applies at most once
  (the dedup table is replicated, and the old primary cannot have a write acknowledged once a
  higher epoch exists);
* otherwise (the primary is alive, only slow; or no other primary yet) the exchange goes on
  and is due again one TTL after the round began.

A group without leadership (a static ``--replica-group`` without etcd: its ``/v1/cluster``
has no ``leadership``) elects nobody, so its exchanges are not watched. A failover therefore
costs a request about two lease TTLs, whatever its ``timeout`` (the lease ends, the new
primary is elected, the next round finds it); ``timeout`` still bounds an exchange with a
primary that is merely slow.

:class:`Stalls` is the registry and the rule, without I/O; a driver runs it: a thread for
``PSClient`` (:meth:`Stalls.start_thread`), a task on the loop for ``AsyncPSClient``
(:meth:`Stalls.start_task`), each given how to ask a group (``_following.py``). An exchange is
cut through its :class:`~client_sdk._abort.Abort` (each HTTP layer holds it: a socket shut
down, an httpx2 exchange cancelled). Thread-safe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ._abort import Abort
from ._flow import Reply
from ._replicas import Replicas, choose

__all__ = ["DEFAULT_TTL", "Stalls", "Watched"]

logger = logging.getLogger("client_sdk")

#: The lease TTL assumed for a group until one of its replicas says (the shards' default).
DEFAULT_TTL = 2.0

#: Whether the answers so far (``None``: none yet) decide; the asking may stop then.
Decides = Callable[[Sequence[Reply | None]], bool]
#: Asks index ``i``'s replicas for their ``GET /v1/cluster``: ``answers[r]`` for ``group[r]``.
Ask = Callable[[int, Decides], Sequence[Reply | None]]
#: The ``due`` of an exchange that was cut: never checked again.
_NEVER = float("inf")
AsyncAsk = Callable[[int, Decides], Awaitable[Sequence[Reply | None]]]


class Watched:
    """One exchange with replica ``url`` of index ``shard``, watched from ``since``."""

    __slots__ = ("shard", "url", "abort", "due", "superseded")

    def __init__(self, shard: int, url: str, due: float) -> None:
        self.shard = shard
        self.url = url
        #: Fired to abandon the exchange (its HTTP layer holds it).
        self.abort = Abort()
        #: When it is checked next (``time.monotonic()`` seconds).
        self.due = due
        #: Set when another replica took over: the request goes there, at once.
        self.superseded = False


class Stalls:
    """The exchanges in flight to the replica groups of ``replicas`` (module docstring)."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        #: Per index: its group's lease TTL (seconds); ``None``: no leadership, not watched.
        self.ttls: list[float | None] = [DEFAULT_TTL] * len(replicas.groups)
        self._lock = threading.Lock()
        self._watched: dict[int, Watched] = {}
        self._notify: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None
        self._asks: concurrent.futures.ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # -- the registry ---------------------------------------------------------------------

    def begin(self, shard: int, url: str) -> Watched | None:
        """Watch an exchange with ``url`` for index ``shard`` that starts now; ``None`` when
        the index is not watched (one replica, or no leadership)."""
        ttl = self.ttls[shard]
        if ttl is None or not self.replicas.replicated(shard):
            return None
        watched = Watched(shard, url, time.monotonic() + ttl)
        with self._lock:  # the driver is not woken: it looks at least once a TTL (due)
            self._watched[id(watched)] = watched
        return watched

    def end(self, watched: Watched) -> None:
        """The exchange ended (answered, failed or cut)."""
        with self._lock:
            self._watched.pop(id(watched), None)

    def due(self, now: float) -> tuple[list[int], float]:
        """The indexes with an exchange due at ``now``, and when the driver looks next: when
        the next one is due, or one lease TTL from now when none is watched (an exchange that
        starts meanwhile is due a TTL after it starts: the driver sees it first). Waking the
        driver at every exchange instead would cost every request a thread switch."""
        with self._lock:
            watched = list(self._watched.values())
        shards = sorted({w.shard for w in watched if w.due <= now})
        later = [w.due for w in watched if now < w.due < _NEVER]
        if later:
            return shards, min(later)
        return shards, now + min((t for t in self.ttls if t is not None), default=DEFAULT_TTL)

    def note_cluster(self, shard: int, info: Mapping[str, Any]) -> None:
        """Learn index ``shard``'s lease TTL, and the epoch of a primary, from a replica's
        ``GET /v1/cluster`` (the fleet check's: the epoch of the primary a stall is weighed
        against)."""
        view = info.get("replication")
        if isinstance(view, dict) and view.get("role") == "primary":
            epoch = view.get("epoch")
            if type(epoch) is int and epoch > self.replicas.epochs[shard]:
                self.replicas.epochs[shard] = epoch
        leadership = info.get("leadership", False)
        if leadership is None:  # a group without etcd: nobody is elected, nothing to watch
            self.ttls[shard] = None
        elif isinstance(leadership, dict):
            ttl = leadership.get("lease_ttl")
            if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and 0 < ttl <= 3600:
                self.ttls[shard] = float(ttl)

    # -- the rule -------------------------------------------------------------------------

    def stalled(self, shard: int, began: float) -> set[str]:
        """The replicas of index ``shard`` that exchanges due at ``began`` wait for."""
        with self._lock:
            return {w.url for w in self._watched.values() if w.shard == shard and w.due <= began}

    def verdict(
        self, shard: int, stalled: set[str], answers: Sequence[Reply | None], whole: bool = True
    ) -> tuple[str, int] | None:
        """The primary that exchanges waiting on ``stalled`` move to, from the replicas'
        ``answers`` (``None``: none, or no answer yet): another replica that leads at an
        epoch no lower than any seen for the index; before every replica answered (not
        ``whole``), only at a higher epoch than any seen (so higher than the stalled one's,
        whatever it would answer)."""
        found = choose(self.replicas.groups[shard], answers)
        if found is None or not stalled or found[0] in stalled:
            return None
        known = self.replicas.epochs[shard]
        return found if found[1] > known or (whole and found[1] == known) else None

    def settle(self, shard: int, answers: Sequence[Reply | None], began: float) -> bool:
        """Apply the rule to index ``shard`` whose exchanges due at ``began`` were checked
        by asking its replicas (``answers``, ``None`` for those that did not answer); whether
        its exchanges moved to a new primary."""
        with self._lock:
            mine = [w for w in self._watched.values() if w.shard == shard]
        stalled = {w.url for w in mine if w.due <= began}
        found = self.verdict(shard, stalled, answers)
        for reply in answers:
            info = _json(reply)
            if info is not None:
                self.note_cluster(shard, info)
        if found is not None:
            url, epoch = found
            if self.replicas.follow(shard, url, epoch) or self.replicas.current[shard] == url:
                cut = [w for w in mine if w.url != url]
                logger.warning(
                    "shard %d: %s did not answer for a lease TTL (%.0f s) and %s is its "
                    "primary now (epoch %d): %d request(s) sent there again",
                    shard,
                    ", ".join(sorted(stalled)),
                    self.ttls[shard] or DEFAULT_TTL,
                    url,
                    epoch,
                    len(cut),
                )
                for w in cut:
                    w.superseded = True
                    w.due = _NEVER  # ends as soon as its thread or task sees the cut
                    w.abort.fire()
                return True
        again = began + (self.ttls[shard] or DEFAULT_TTL)  # at once if asking took that long
        for w in mine:
            if w.due <= began:
                w.due = again
        return False

    def _decides(self, shard: int, began: float) -> Decides:
        """Whether answers so far (``None``: not yet) already decide a move: the asking
        need not wait for a replica that does not answer (the frozen one)."""
        stalled = self.stalled(shard, began)
        return lambda answers: self.verdict(shard, stalled, answers, whole=False) is not None

    # -- the drivers ----------------------------------------------------------------------

    def driven(self, loop: asyncio.AbstractEventLoop | None = None) -> bool:
        """Whether the thread driver runs (``loop``: the task driver, on that loop), or
        none may (the client is closed)."""
        if self._closed:
            return True
        if loop is None:
            return self._thread is not None
        task = self._task
        return task is not None and not task.done() and task.get_loop() is loop

    def start_thread(self, ask: Ask) -> None:
        """Run the rule on a thread of this client's (once), asking groups with ``ask``."""
        with self._lock:
            if self._thread is not None or self._closed:
                return
            wake = threading.Event()
            self._notify = wake.set
            self._thread = threading.Thread(
                target=self._run, args=(ask, wake), name="paramshard-stalls", daemon=True
            )
        self._thread.start()

    def ask_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """Threads a ``PSClient``'s asks run on, one each (``_following.ask_group``): enough
        for the thread driver's and a few calls' following at once."""
        with self._lock:
            if self._asks is None:
                size = 4 * max(len(g) for g in self.replicas.groups)
                self._asks = concurrent.futures.ThreadPoolExecutor(
                    max_workers=size, thread_name_prefix="paramshard-ask"
                )
            return self._asks

    def _run(self, ask: Ask, wake: threading.Event) -> None:
        while not self._closed:
            now = time.monotonic()
            shards, next_at = self.due(now)
            for shard in shards:
                if self._closed:
                    return
                try:
                    self.settle(shard, ask(shard, self._decides(shard, now)), now)
                except Exception:  # a bug must not stop the watch: say it, go on
                    logger.exception("checking shard %d's stalled requests failed", shard)
            if shards:
                continue
            wake.wait(max(0.0, next_at - time.monotonic()))
            wake.clear()

    def start_task(self, ask: AsyncAsk) -> None:
        """Run the rule as a task on the running loop (once per loop), asking with ``ask``."""
        loop = asyncio.get_running_loop()
        if self.driven(loop):
            return
        wake = asyncio.Event()
        self._notify = functools.partial(_soon, loop, wake.set)
        self._task = loop.create_task(self._arun(ask, wake))

    async def _arun(self, ask: AsyncAsk, wake: asyncio.Event) -> None:
        while not self._closed:
            now = time.monotonic()
            shards, next_at = self.due(now)
            for shard in shards:
                try:
                    self.settle(shard, await ask(shard, self._decides(shard, now)), now)
                except Exception:
                    logger.exception("checking shard %d's stalled requests failed", shard)
            if shards:
                continue
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(wake.wait(), max(0.0, next_at - time.monotonic()))
            wake.clear()

    def close(self) -> None:
        """Stop the thread driver (the task's: :meth:`aclose`). Idempotent."""
        with self._lock:
            self._closed = True
            notify, thread, asks = self._notify, self._thread, self._asks
        if thread is not None and notify is not None:
            notify()
            if thread is not threading.current_thread():
                thread.join(timeout=10)
        if asks is not None:
            asks.shutdown(wait=False)

    async def aclose(self) -> None:
        """Stop the task driver. Idempotent."""
        self._closed = True
        task = self._task
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _soon(loop: asyncio.AbstractEventLoop, call: Callable[[], None]) -> None:
    loop.call_soon_threadsafe(call)


def _json(reply: Reply | None) -> dict[str, Any] | None:
    if reply is None or reply.status != 200:
        return None
    try:
        info = json.loads(bytes(reply.content))
    except ValueError:
        return None
    return info if isinstance(info, dict) else None
