"""Background pushes: bounded in flight, coalescing on request, no failure ever dropped.

``PSClient.push_async`` hands a prepared push (gradients already copied, ``seq`` and versions
already chosen, in the caller's thread) to a :class:`Pusher`. At most ``max_inflight`` pushes
run at once. When all of them are busy, a new push either

* **blocks** the caller until one finishes (the default), or
* with ``coalesce=True``, **waits** in the one slot for a push not yet started, returning at
  once: if a push is already waiting there, the new gradients are *added* to it (Downpour
  accumulates gradients between pushes anyway) and the caller gets that push's future. A
  push that finishes hands its slot to the waiting push first.

Either way a worker faster than its shards holds at most ``max_inflight + 1`` pushes in memory.
Every failure is kept in three places:

* the push's own future (``fut.result()`` raises it);
* the next flush, which raises a :class:`PushError` holding every failure since the previous
  flush, whether or not a future already reported it;
* ``close()`` flushes, so a failure nobody asked about still surfaces there.

The policy is written once, in :class:`Slots`: pure state (no lock, no thread, no task, no
clock) that decides what a new push does and which push a freed slot goes to, and keeps the
failures until a flush takes them. :class:`Pusher` (threads, for ``PSClient``) and
:class:`AsyncPusher` (tasks, for ``AsyncPSClient``) drive it, each under its own mutual
exclusion (a lock; the event loop's one thread), and differ only in how they run a push and
how a caller waits. Callers blocked at once for a slot are not served in any set order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

from ._exceptions import PSError, PushError

__all__ = ["AsyncPusher", "Decision", "Pusher", "Slots", "closed_error"]

T = TypeVar("T")
#: What a caller holds for a push: a ``concurrent.futures.Future`` or an ``asyncio.Task``.
H = TypeVar("H", bound=Hashable)
#: ``merge(waiting_job, new_job)`` adds the new job's gradients into the waiting one.
Merge = Callable[[Any, Any], None]


def closed_error() -> PSError:
    return PSError("this client is closed: create a new PSClient (or use it in a with block)")


def _as_ps_error(exc: BaseException) -> PSError:
    if isinstance(exc, PSError):
        return exc
    err = PSError(f"an asynchronous push failed inside the SDK: {exc!r} (please report this)")
    err.__cause__ = exc
    return err


def _cancelled() -> PSError:
    return PSError(
        "an asynchronous push was cancelled before it finished; it may or may not have been applied"
    )


class Decision(enum.Enum):
    """What a push offered to :meth:`Slots.offer` does."""

    #: It holds a slot now: run it.
    START = "start"
    #: Add its gradients into the waiting push (:attr:`Slots.waiting`) and share its handle.
    MERGE = "merge"
    #: It is the waiting push now (:meth:`Slots.wait_as`): it starts when a slot frees.
    WAIT = "wait"
    #: Every slot is busy: block until one frees (a push finishes), then offer it again.
    FULL = "full"


class Slots(Generic[H]):
    """The policy of background pushes, for ``max_inflight`` slots; pure state. ``H`` is what
    a caller holds for a push (a future, a task): the slots keep the pending ones for a flush.
    """

    def __init__(self, max_inflight: int) -> None:
        self.max_inflight = max_inflight
        #: Pushes holding a slot (started, or handed a slot and about to start).
        self.running = 0
        #: The one push waiting for a slot, and its handle (coalescing pushes only).
        self.waiting: tuple[Any, H] | None = None
        #: Handles of pushes not finished (waiting ones too).
        self.pending: set[H] = set()
        self.closed = False
        self._failures: list[PSError] = []

    def offer(self, coalesce: bool) -> Decision:
        """What a new push does: see :class:`Decision`. A push told to ``START`` holds a slot
        from here on; raises :func:`closed_error` once the pusher is closed."""
        if self.closed:
            raise closed_error()
        if coalesce and self.waiting is not None:
            return Decision.MERGE
        if self.running < self.max_inflight:
            self.running += 1
            return Decision.START
        return Decision.WAIT if coalesce else Decision.FULL

    def started(self, handle: H) -> None:
        """The push told to ``START`` is under way, held as ``handle``."""
        self.pending.add(handle)

    def wait_as(self, job: Any, handle: H) -> None:
        """The push told to ``WAIT`` is the waiting push, held as ``handle``."""
        self.waiting = (job, handle)
        self.pending.add(handle)

    def finished(self) -> tuple[Any, H] | None:
        """A push holding a slot ended: the waiting push, which takes the slot over (start
        it), or ``None`` when the slot is free (wake a caller blocked for one)."""
        waiting, self.waiting = self.waiting, None
        if waiting is None:
            self.running -= 1
        return waiting

    def done(self, handle: H, failure: PSError | None = None) -> None:
        """``handle`` completed (its push ran, failed or was cancelled); ``failure`` is kept for
        the next flush. A waiting push cancelled before it started waits no more."""
        self.pending.discard(handle)
        if self.waiting is not None and self.waiting[1] is handle:
            self.waiting = None
        if failure is not None:
            self._failures.append(failure)

    def failed(self, failure: PSError) -> None:
        """Keep ``failure`` for the next flush (a push's, recorded before its handle completes,
        so a flush woken by the completion sees it)."""
        self._failures.append(failure)

    def flushed(self) -> PushError | None:
        """The failures since the last flush, as one :class:`PushError` (each is raised by
        exactly one flush), or ``None``."""
        failures, self._failures = self._failures, []
        if not failures:
            return None
        n = len(failures)
        first = failures[0]
        message = (
            f"{n} asynchronous push{'es' if n != 1 else ''} failed since the last flush; "
            f"the first: {type(first).__name__}: {first.message}"
        )
        return PushError(message, errors=failures)


class Pusher(Generic[T]):
    """Runs pushes on ``max_inflight`` background threads. Thread-safe.

    ``run(job)`` does one push and raises a ``PSError`` if it fails; ``merge(waiting, new)``
    adds ``new``'s gradients into ``waiting`` (for ``coalesce=True``).
    """

    def __init__(self, max_inflight: int, run: Callable[[Any], T], merge: Merge) -> None:
        self._run = run
        self._merge = merge
        self._slots: Slots[concurrent.futures.Future[T]] = Slots(max_inflight)
        # Reentrant: a future cancelled under it calls back into it (_on_done).
        self._cond = threading.Condition(threading.RLock())
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_inflight, thread_name_prefix="paramshard-push"
        )

    def submit(self, job: Any, coalesce: bool = False) -> concurrent.futures.Future[T]:
        """Start a push. Blocks while ``max_inflight`` pushes are running, unless
        ``coalesce``: then the push waits (merged into the one already waiting, if any)."""
        slots = self._slots
        with self._cond:
            decision = slots.offer(coalesce)
            while decision is Decision.FULL:
                self._cond.wait()
                decision = slots.offer(coalesce)
            if decision is Decision.MERGE:
                assert slots.waiting is not None
                waiting, fut = slots.waiting
                self._merge(waiting, job)
                return fut
            fut = concurrent.futures.Future()
            fut.add_done_callback(self._on_done)
            if decision is Decision.WAIT:
                slots.wait_as(job, fut)
            else:
                slots.started(fut)
                self._start(job, fut)
            return fut

    def _start(self, job: Any, fut: concurrent.futures.Future[T]) -> None:
        """Run ``job`` on a slot it holds (under the lock)."""
        try:
            self._executor.submit(self._call, job, fut)
        except BaseException:
            self._free_slot()
            fut.cancel()
            raise

    def _call(self, job: Any, fut: concurrent.futures.Future[T]) -> None:
        try:
            if not fut.set_running_or_notify_cancel():
                return  # cancelled while it waited
            try:
                result = self._run(job)
            except BaseException as exc:
                err = _as_ps_error(exc)
                with self._cond:
                    self._slots.failed(err)
                fut.set_exception(err)
            else:
                fut.set_result(result)
        finally:
            with self._cond:
                self._free_slot()

    def _free_slot(self) -> None:
        """Give the slot of a push that ended to the waiting push, or to a blocked caller
        (under the lock)."""
        waiting = self._slots.finished()
        if waiting is not None:
            self._start(*waiting)
        else:
            self._cond.notify()

    def _on_done(self, fut: concurrent.futures.Future[T]) -> None:
        with self._cond:
            self._slots.done(fut, _cancelled() if fut.cancelled() else None)

    @property
    def inflight(self) -> int:
        """Pushes holding a slot (at most ``max_inflight``)."""
        with self._cond:
            return self._slots.running

    def flush(self) -> None:
        """Wait for every push submitted so far; raise :class:`PushError` for the failures
        since the last flush (each is raised by exactly one flush)."""
        with self._cond:
            pending = list(self._slots.pending)
        concurrent.futures.wait(pending)
        with self._cond:
            error = self._slots.flushed()
        if error is not None:
            raise error

    def close(self) -> None:
        """Flush, then stop the threads. Idempotent; raises what :meth:`flush` raises."""
        with self._cond:
            self._slots.closed = True
            self._cond.notify_all()  # callers blocked for a slot: closed
        try:
            self.flush()
        finally:
            self._executor.shutdown(wait=True)


class _Push:
    """An :class:`AsyncPusher`'s push: its job, whether it holds a slot, whether its
    coroutine began, and (while it waits for a slot) what it waits on."""

    __slots__ = ("job", "holding", "began", "go")

    def __init__(self, job: Any, go: asyncio.Future[None] | None) -> None:
        self.job = job
        self.holding = go is None
        self.began = False
        self.go = go


class AsyncPusher(Generic[T]):
    """The asyncio twin of :class:`Pusher`: use it from one event loop."""

    def __init__(self, max_inflight: int, run: Callable[[Any], Awaitable[T]], merge: Merge) -> None:
        self._run = run
        self._merge = merge
        self._slots: Slots[asyncio.Task[T]] = Slots(max_inflight)
        self._pushes: dict[asyncio.Task[T], _Push] = {}
        #: Callers blocked for a slot, each woken by its future.
        self._blocked: deque[asyncio.Future[None]] = deque()

    async def submit(self, job: Any, coalesce: bool = False) -> asyncio.Task[T]:
        """Start a push as a task; waits while ``max_inflight`` pushes are running, unless
        ``coalesce`` (then the push waits in its task, merged into the one already waiting)."""
        slots = self._slots
        decision = slots.offer(coalesce)
        while decision is Decision.FULL:
            await self._block()
            decision = slots.offer(coalesce)
        if decision is Decision.MERGE:
            assert slots.waiting is not None
            waiting, task = slots.waiting
            self._merge(waiting, job)
            return task
        loop = asyncio.get_running_loop()
        if decision is Decision.WAIT:
            task = self._spawn(_Push(job, loop.create_future()))
            slots.wait_as(job, task)
        else:
            task = self._spawn(_Push(job, None))
            slots.started(task)
        return task

    async def _block(self) -> None:
        """Until a slot frees (or the pusher closes)."""
        woken = asyncio.get_running_loop().create_future()
        self._blocked.append(woken)
        try:
            await woken
        except asyncio.CancelledError:
            if woken.done() and not woken.cancelled():
                self._wake()  # woken, but gone: the next caller's turn
            else:
                self._blocked.remove(woken)
            raise

    def _wake(self, every: bool = False) -> None:
        while self._blocked:
            woken = self._blocked.popleft()
            if not woken.done():
                woken.set_result(None)
                if not every:
                    return

    def _spawn(self, push: _Push) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(self._call(push))
        self._pushes[task] = push
        task.add_done_callback(self._finished)
        return task

    async def _call(self, push: _Push) -> T:
        push.began = True
        try:
            if push.go is not None:
                await push.go  # its slot, handed over by a push that finished
            return await self._run(push.job)
        except asyncio.CancelledError:
            self._slots.failed(_cancelled())
            raise
        except BaseException as exc:
            err = _as_ps_error(exc)
            self._slots.failed(err)
            if err is exc:
                raise
            raise err from exc

    def _finished(self, task: asyncio.Task[T]) -> None:
        # In a done callback, not in _call: a task cancelled before it began never runs
        # _call's body, yet it must give its slot back (and count as a failure).
        push = self._pushes.pop(task)
        slots = self._slots
        cancelled_unbegun = task.cancelled() and not push.began
        slots.done(task, _cancelled() if cancelled_unbegun else None)
        if not task.cancelled():
            task.exception()  # retrieved: flush() reports it, asyncio need not warn
        if push.holding:
            waiting = slots.finished()
            if waiting is None:
                self._wake()
                return
            following = self._pushes[waiting[1]]
            following.holding = True  # its own _finished passes the slot on if it is gone
            if following.go is not None and not following.go.done():
                following.go.set_result(None)

    @property
    def inflight(self) -> int:
        """Pushes holding a slot (at most ``max_inflight``)."""
        return self._slots.running

    async def flush(self) -> None:
        """Wait for every push started so far; raise :class:`PushError` for the failures
        since the last flush."""
        pending = list(self._slots.pending)
        if pending:
            await asyncio.wait(pending)
        error = self._slots.flushed()
        if error is not None:
            raise error

    async def close(self) -> None:
        self._slots.closed = True
        self._wake(every=True)  # callers blocked for a slot: closed
        await self.flush()
