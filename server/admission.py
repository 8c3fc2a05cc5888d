"""Admission control: what a shard lets in, and when. Bounded work, pauses, restore and drain.

:class:`Gate` holds the state; :class:`AdmissionMiddleware` applies it to data-plane requests
(``POST /v1/<verb>``) before any handler runs, so the handlers know nothing about it:

* **Phase.** Until its snapshot is restored (``restoring``), after SIGTERM (``draining``) and
  after a failed restore (``failed``) the shard answers data-plane requests 503 ``unavailable``
  with ``Retry-After``; ``/readyz`` says the same. ``/healthz`` and the JSON endpoints answer
  throughout.
* **Bounded work.** Writes and pulls are admitted while fewer than ``max_requests`` are in
  flight and their declared bodies (``Content-Length``) sum to at most ``max_bytes``. Others
  wait, first come first served, before their body is read (so waiting costs no memory), for at
  most :data:`ADMIT_WAIT` seconds; then, or when :data:`MAX_WAITING` already wait, they get 429
  ``overloaded`` with ``Retry-After``. A body without ``Content-Length`` (chunked) counts as it
  arrives: it holds no room before its bytes come, and a piece for which there is no room is
  answered 429. Long polls (``/v1/wait``, ``/v1/poll``) count their body's bytes, until they
  answer, but take no request slot (a long poll waits, it does not work), and their body is at most
  :data:`MAX_WAIT_BODY` bytes (413 past it). Control verbs are not counted; their body is at
  most :data:`MAX_CONTROL_BODY` bytes, checked as it arrives. A body whose sender stalls is
  cut off by the HTTP layer (:mod:`server.readguard`), which releases what it held.
* **Cannot persist.** While the shard's snapshots fail (a full or read-only disk:
  ``server/durability.py`` sets it), writes are answered 503 ``unavailable`` (``reason:
  cannot_persist``) with ``Retry-After``, so none is acknowledged that a restart could lose;
  reads go on.
* **Pauses.** While the gate is closed (a fleet checkpoint's pause, or the instant a snapshot
  is captured), a write that has read its body waits before its handler sees the last byte, so
  nothing is applied; :meth:`Gate.quiesce` and :meth:`Gate.pause` return once every write
  already past that point has answered. A write that arrives during a checkpoint's pause waits
  up to :data:`PAUSE_WAIT` seconds, then gets 503 with ``Retry-After``.

The state (:class:`Gate`, which ``server/durability.py`` and the checkpoint routes drive too)
and the middleware that applies it to requests are one module (just past 600 lines, with
the verb sets each rule uses): each rule above is a state and the point where a request meets
it, and the two change together.
Everything runs on the event loop; nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ShardError
from .headers import request_headers

__all__ = [
    "ADMIT_WAIT",
    "MAX_CONTROL_BODY",
    "MAX_WAITING",
    "MAX_WAIT_BODY",
    "PAUSE_WAIT",
    "AdmissionMiddleware",
    "Gate",
]

logger = logging.getLogger("paramshard.server")

#: Longest a request waits for room before it is answered 429.
ADMIT_WAIT = 1.0
#: Requests that may wait for room at once; more are answered 429 at once.
MAX_WAITING = 1024
#: Longest a write arriving during a checkpoint's pause waits before it is answered 503.
PAUSE_WAIT = 1.0
#: Longest a pause waits for writes already past the gate to answer.
DRAIN_WRITES = 10.0
RETRY_AFTER = "1"
#: After this many seconds with nothing admitted, a shard that admitted at least
#: :data:`TRIM_FROM` body bytes since it last did gives its free heap back
#: (:func:`server.store.heap.trim_heap`).
TRIM_AFTER = 2.0
TRIM_FROM = 64 << 20
#: Largest body of a long poll (``/v1/wait``, ``/v1/poll``: variable names), and of a control verb.
MAX_WAIT_BODY = 16 << 20
MAX_CONTROL_BODY = 64 << 10

WRITES = frozenset(
    {
        "init",
        "push",
        "assign",
        "increment",
        "set_optimizer",
        "delete",
        "create_table",
        "push_rows",
        "group_push",
    }
)
#: Reads, and the registration of a step group (it changes no state; a primary's to answer).
READS = frozenset({"pull", "pull_rows", "groups", "group_pull"})
CONTROL = frozenset({"pause", "snapshot", "resume"})
LONG = frozenset({"wait", "poll"})
#: Batches a primary forwards to this replica (server/replication): admitted like a read (the
#: room they take is counted), never held back by a pause (the primary's writes in flight
#: wait for them).
REPLICATION = frozenset({"replicate", "stage"})

Render = Callable[..., Response]


class Gate:
    """The admission state of one shard: phase, room for work, pauses (see the module)."""

    def __init__(self, max_bytes: int, max_requests: int) -> None:
        self.max_bytes = max_bytes
        self.max_requests = max_requests
        #: ``restoring`` -> ``ready`` -> ``draining``; or ``failed`` when the restore failed.
        self.phase = "restoring"
        self.reason = "restoring its snapshot"
        #: The fleet checkpoint this shard is paused for, if any.
        self.paused_for: str | None = None
        #: Why the shard cannot write snapshots now (writes are refused meanwhile), or ``None``.
        self.persist_error: str | None = None
        #: Called when the shard starts shutting down (e.g. to answer long polls now).
        self.on_drain: list[Callable[[], None]] = []
        self._persist_retry = RETRY_AFTER
        self.requests = 0
        self.bytes = 0
        self.refused = 0
        #: Requests that waited in line for room, and the seconds they waited in all.
        self.waited = 0
        self.wait_seconds = 0.0
        self._waiters: deque[list[Any]] = deque()
        self._holds = 0
        self._open = asyncio.Event()
        self._open.set()
        self._applying = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._lease: asyncio.TimerHandle | None = None
        #: Called (in a worker thread) once the gate was idle :data:`TRIM_AFTER` seconds after
        #: admitting :data:`TRIM_FROM` bytes or more; ``None``: never.
        self.trim: Callable[[], Any] | None = None
        self.admitted = 0
        self._untrimmed = 0
        self._trim_timer: asyncio.TimerHandle | None = None

    # -- phase ------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    def set_phase(self, phase: str, reason: str = "") -> None:
        """Enter ``phase``. Leaving ``ready`` answers the requests waiting for room (503);
        ``draining`` also ends a checkpoint's pause, so the writes in flight can finish, and
        calls :attr:`on_drain`."""
        self.phase = phase
        self.reason = reason
        if phase == "draining":
            for drain in self.on_drain:
                drain()
        if phase == "draining" and self.paused_for is not None:
            logger.warning("shutting down: ending the pause for checkpoint %s", self.paused_for)
            self.resume(self.paused_for)
        if phase != "ready":
            for entry in self._waiters:  # they are answered 503 now, not after ADMIT_WAIT
                if not entry[1].done():
                    entry[1].set_result(False)
            self._waiters.clear()

    def refusal(self) -> ShardError | None:
        """Why data-plane requests are refused now (503), or ``None``."""
        if self.phase == "ready":
            return None
        what = {
            "restoring": "is restoring its snapshot",
            "draining": "is shutting down",
            "failed": "could not restore its state",
        }.get(self.phase, self.phase)
        message = f"the shard {what}"
        message += f" ({self.reason})" if self.reason and self.phase == "failed" else ""
        message += (
            ": retry in a moment"
            if self.phase != "failed"
            else ": see the shard's log, fix the data dir and restart it"
        )
        return ShardError(
            "unavailable", message, {"reason": self.phase}, headers={"Retry-After": RETRY_AFTER}
        )

    def cannot_persist(self, reason: str | None, retry_after: float = 1.0) -> None:
        """While ``reason`` is set, refuse writes (503, ``reason: cannot_persist``): the shard
        could not write a snapshot, so a write it acknowledged now could be lost. ``None``
        takes writes again."""
        self.persist_error = reason
        self._persist_retry = str(max(1, math.ceil(retry_after)))

    def write_refusal(self) -> ShardError | None:
        """Why writes (not reads) are refused now although the shard is ready, or ``None``."""
        if self.persist_error is None:
            return None
        return ShardError(
            "unavailable",
            f"the shard cannot write snapshots to its data dir "
            f"({self.persist_error}), so it takes no write it could lose (reads go on): retry "
            "later; the shard's operator must free space in its data dir or fix its "
            "permissions",
            {"reason": "cannot_persist", "error": self.persist_error},
            headers={"Retry-After": self._persist_retry},
        )

    # -- bounded work -----------------------------------------------------------------------

    def _fits(self, nbytes: int, slot: bool = True) -> bool:
        if self.requests == 0 and (slot or self.bytes == 0):
            return True
        if slot and self.requests >= self.max_requests:
            return False
        return self.bytes + nbytes <= self.max_bytes

    def room_now(self, nbytes: int) -> bool:
        """Whether a read of ``nbytes`` would be admitted at once (ready, room, nobody waiting
        in line before it): what lets a shard answer a pull before this returns."""
        return self.phase == "ready" and not self._waiters and self._fits(nbytes)

    def hold_now(self, nbytes: int) -> bool:
        """Take room for a request of ``nbytes`` if :meth:`room_now` says there is some, with
        no wait: whether it did (pair a ``True`` with :meth:`release`). For a body the HTTP
        protocol collects over several reads (``server.immediate``), held in flight as an
        admitted request's is, until it is answered."""
        if not self.room_now(nbytes):
            return False
        self.requests += 1
        self.bytes += nbytes
        return True

    def _take(self, nbytes: int, slot: bool = True) -> None:
        self.requests += slot
        self.bytes += nbytes
        self.admitted += 1
        self._untrimmed += nbytes

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0], self._waiters[0][2]):
            nbytes, fut, slot = self._waiters.popleft()
            if not fut.done():
                self._take(nbytes, slot)
                fut.set_result(True)

    def grow(self, nbytes: int) -> bool:
        """Count ``nbytes`` more for a request already admitted (a body without a declared
        length, as it arrives); ``False``, counting nothing, if they do not fit beside the
        others in flight. Release them with the request's own."""
        if self.requests > 1 and self.bytes + nbytes > self.max_bytes:
            return False
        self.bytes += nbytes
        self._untrimmed += nbytes
        return True

    async def admit(self, nbytes: int, slot: bool = True) -> bool:
        """Take room for a request of ``nbytes`` (and a request slot, unless ``slot`` is
        False: a long poll), waiting up to :data:`ADMIT_WAIT` seconds in line; ``False`` if
        there was none (answer 429). Pair a ``True`` with :meth:`release`."""
        if not self._waiters and self._fits(nbytes, slot):
            self._take(nbytes, slot)
            return True
        if len(self._waiters) >= MAX_WAITING:
            return False
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        entry = [nbytes, fut, slot]
        self._waiters.append(entry)
        self.waited += 1
        since = time.monotonic()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), ADMIT_WAIT)
        except asyncio.TimeoutError:
            return self._give_up(entry)
        except asyncio.CancelledError:
            if self._give_up(entry):
                self.release(nbytes, slot)
            raise
        finally:
            self.wait_seconds += time.monotonic() - since

    def _give_up(self, entry: list[Any]) -> bool:
        """Leave the line; True if room was granted meanwhile (it is then ours)."""
        fut = entry[1]
        if fut.done():
            return bool(fut.result())
        fut.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(entry)
        self._wake()
        return False

    def release(self, nbytes: int, slot: bool = True) -> None:
        self.requests -= slot
        self.bytes -= nbytes
        self._wake()
        if (
            self.trim is not None
            and self._untrimmed >= TRIM_FROM
            and self._trim_timer is None
            and not self.requests
            and not self.bytes
        ):
            self._trim_timer = asyncio.get_running_loop().call_later(
                TRIM_AFTER, self._trim_if_idle, self.admitted
            )

    def _trim_if_idle(self, admitted: int) -> None:
        """The trim timer: trim if nothing was admitted since it was armed, else look again
        :data:`TRIM_AFTER` seconds later while the gate is idle (the next release re-arms it
        otherwise)."""
        self._trim_timer = None
        if self.requests or self.bytes:
            return
        loop = asyncio.get_running_loop()
        if self.admitted != admitted:
            self._trim_timer = loop.call_later(TRIM_AFTER, self._trim_if_idle, self.admitted)
            return
        self._untrimmed = 0
        loop.run_in_executor(None, self.trim)

    # -- pauses -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._holds > 0

    async def enter_apply(self) -> None:
        """Called by a write whose body is complete: wait while the gate is closed, then count
        it as applying until :meth:`exit_apply`."""
        while self._holds:
            await self._open.wait()
        self._applying += 1
        self._idle.clear()

    def exit_apply(self) -> None:
        self._applying -= 1
        if self._applying == 0:
            self._idle.set()

    def _hold(self) -> None:
        self._holds += 1
        self._open.clear()

    def _unhold(self) -> None:
        self._holds -= 1
        if self._holds == 0:
            self._open.set()

    async def _drain_writes(self, timeout: float) -> None:
        if self._applying:
            await asyncio.wait_for(self._idle.wait(), timeout)

    @contextlib.asynccontextmanager
    async def quiesce(self, timeout: float = DRAIN_WRITES) -> AsyncIterator[None]:
        """Inside the block no write is being applied: new ones wait at the gate.

        Raises ``asyncio.TimeoutError`` if writes already applying do not answer in time.
        """
        self._hold()
        try:
            await self._drain_writes(timeout)
            yield
        finally:
            self._unhold()

    async def pause(self, checkpoint: str, lease: float) -> None:
        """Stop applying writes for fleet checkpoint ``checkpoint`` until :meth:`resume` or
        ``lease`` seconds pass. Idempotent for the same checkpoint (the lease restarts)."""
        if self.paused_for is not None and self.paused_for != checkpoint:
            raise ShardError(
                "conflict",
                f"the shard is paused for checkpoint "
                f"{self.paused_for!r}; retry when it has finished",
                {"paused_for": self.paused_for},
            )
        if self.paused_for is None:
            self.paused_for = checkpoint
            self._hold()
        self._restart_lease(checkpoint, lease)
        try:
            await self._drain_writes(DRAIN_WRITES)
        except asyncio.TimeoutError:
            self.resume(checkpoint)
            raise ShardError(
                "unavailable",
                f"could not pause for checkpoint {checkpoint!r}: "
                f"writes in flight did not finish within {DRAIN_WRITES:g}s; retry",
                headers={"Retry-After": RETRY_AFTER},
            ) from None

    def _restart_lease(self, checkpoint: str, lease: float) -> None:
        if self._lease is not None:
            self._lease.cancel()
        self._lease = asyncio.get_running_loop().call_later(lease, self._expire, checkpoint, lease)

    def _expire(self, checkpoint: str, lease: float) -> None:
        if self.paused_for == checkpoint:
            logger.warning(
                "checkpoint %s: no resume within its %gs lease; resuming writes", checkpoint, lease
            )
            self.resume(checkpoint)

    def resume(self, checkpoint: str) -> bool:
        """End the pause of ``checkpoint``; False if the shard was not paused for it."""
        if self.paused_for != checkpoint:
            return False
        self.paused_for = None
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None
        self._unhold()
        return True

    async def wait_unpaused(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a checkpoint's pause to end; True if it did."""
        if self.paused_for is None:
            return True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._open.wait(), timeout)
        return self.paused_for is None

    def stats(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "paused_for": self.paused_for,
            "requests_in_flight": self.requests,
            "bytes_in_flight": self.bytes,
            "waiting": len(self._waiters),
            "waited": self.waited,
            "refused_overloaded": self.refused,
            "max_queued_requests": self.max_requests,
            "max_queued_bytes": self.max_bytes,
        }


def _content_length(scope: Scope) -> int | None:
    value = request_headers(scope).get(b"content-length")
    if value is None:
        return None
    try:
        return max(0, int(value))
    except ValueError:
        return None


def _too_large(verb: str, size: int, limit: int) -> ShardError:
    return ShardError(
        "too_large",
        f"{verb}: a body of {size} bytes or more is above the "
        f"{limit} bytes this verb takes: send fewer names per request",
        {"limit": limit},
    )


def _capped(receive: Receive, limit: int, verb: str) -> Receive:
    """``receive`` that answers 413 once more than ``limit`` body bytes arrived."""
    seen = 0

    async def capped_receive() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise ShardError(
                    "too_large",
                    f"{verb}: body above the {limit} bytes a control message may have",
                    {"limit": limit},
                )
        return message

    return capped_receive


class AdmissionMiddleware:
    """Applies a :class:`Gate` to ``POST /v1/<verb>`` (pure ASGI, inside ShardMiddleware).

    ``render(scope, status, code, message, details, headers)`` builds refusals in the
    request's format (``server.app.error_response``); ``max_body`` is the shard's request
    limit (a body declared above it is let through: its handler answers 413 unread).
    """

    def __init__(self, app: ASGIApp, gate: Gate, render: Render, max_body: int) -> None:
        self.app = app
        self.gate = gate
        self.render = render
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        verb = path[4:] if scope.get("method") == "POST" and path.startswith("/v1/") else ""
        if (
            verb not in WRITES
            and verb not in READS
            and verb not in CONTROL
            and verb not in LONG
            and verb not in REPLICATION
        ):
            await self.app(scope, receive, send)  # inspection, unknown paths
            return
        gate = self.gate
        # A wait answers while the shard restores (the names appear); a poll reads, so it
        # waits for the state like a pull.
        refusal = None if verb == "wait" else gate.refusal()
        if refusal is None and verb in WRITES:
            refusal = gate.write_refusal()
        if refusal is None and verb in WRITES and gate.paused_for is not None:
            if not await gate.wait_unpaused(PAUSE_WAIT):
                refusal = ShardError(
                    "unavailable",
                    f"the shard is paused for fleet checkpoint "
                    f"{gate.paused_for!r}: retry in a moment",
                    {"reason": "paused", "checkpoint": gate.paused_for},
                    headers={"Retry-After": RETRY_AFTER},
                )
        if refusal is None and verb in CONTROL:
            await self.app(scope, _capped(receive, MAX_CONTROL_BODY, verb), send)
            return
        nbytes = 0
        declared = _content_length(scope)
        slot = verb not in LONG
        if refusal is None:
            limit = self.max_body if slot else MAX_WAIT_BODY
            if declared is not None and declared > limit:
                if slot:
                    declared = 0  # refused unread by the handler (413)
                else:
                    refusal = _too_large(verb, declared, limit)
            if refusal is None:
                nbytes = declared or 0  # without a length: counted as it arrives
                if not await gate.admit(nbytes, slot):
                    refusal = gate.refusal() or self._overloaded()
        if refusal is not None:
            await self.render(
                scope,
                refusal.status,
                refusal.code,
                refusal.message,
                refusal.details,
                refusal.headers,
            )(scope, receive, send)
            return
        held = [nbytes]
        if declared is None:
            receive = self._counted(receive, held, verb, None if slot else MAX_WAIT_BODY)
        if verb not in WRITES:  # a read or a long poll: counted, nothing to hold back
            try:
                await self.app(scope, receive, send)
            finally:
                gate.release(held[0], slot)
            return
        applying = False
        received = receive

        async def gated_receive() -> Message:
            nonlocal applying
            message = await received()
            if (
                message["type"] == "http.request"
                and not message.get("more_body", False)
                and not applying
            ):
                await gate.enter_apply()
                applying = True
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal applying
            if message["type"] == "http.response.start" and applying:
                applying = False
                gate.exit_apply()
            await send(message)

        try:
            await self.app(scope, gated_receive, tracked_send)
        finally:
            if applying:
                gate.exit_apply()
            gate.release(held[0])

    def _counted(self, receive: Receive, held: list[int], verb: str, limit: int | None) -> Receive:
        """``receive`` for a body without a declared length: its bytes are counted in the
        gate as they arrive (in ``held[0]``); past the room the gate has, 429; past
        ``limit`` (if given), 413."""
        gate = self.gate

        async def counted_receive() -> Message:
            message = await receive()
            n = len(message.get("body", b"")) if message["type"] == "http.request" else 0
            if n:
                if limit is not None and held[0] + n > limit:
                    raise _too_large(verb, held[0] + n, limit)
                if not gate.grow(n):
                    raise self._overloaded()
                held[0] += n
            return message

        return counted_receive

    def _overloaded(self) -> ShardError:
        gate = self.gate
        gate.refused += 1
        return ShardError(
            "overloaded",
            f"the shard has {gate.requests} requests ({gate.bytes} body bytes) in flight and "
            f"{len(gate._waiters)} waiting, its limit (--max-queued-requests "
            f"{gate.max_requests}, --max-queued-bytes {gate.max_bytes}): retry after "
            f"{RETRY_AFTER}s, or add shards",
            {"requests_in_flight": gate.requests, "bytes_in_flight": gate.bytes},
            headers={"Retry-After": RETRY_AFTER},
        )
