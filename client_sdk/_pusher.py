"""Background pushes: bounded in flight, coalescing on request, no failure ever dropped.

``PSClient.push_async`` hands a prepared push (gradients already copied, ``seq`` and versions
already chosen, in the caller's thread) to a :class:`Pusher`. At most ``max_inflight`` pushes
run at once. When all of them are busy, a new push either

* **blocks** the caller until one finishes (the default), or
* with ``coalesce=True``, **waits** in the one slot for a push not yet started, returning at
  once: if a push is already waiting there, the new gradients are *added* to it (Downpour
  accumulates gradients between pushes anyway) and the caller gets that push's future.

Either way a worker faster than its shards holds at most ``max_inflight + 1`` pushes in memory.
Every failure is kept in three places:

* the push's own future (``fut.result()`` raises it);
* the next :meth:`Pusher.flush`, which raises a :class:`PushError` holding every failure since
  the previous flush, whether or not a future already reported it;
* ``close()`` flushes, so a failure nobody asked about still surfaces there.

:class:`AsyncPusher` is the asyncio twin (tasks and an ``asyncio.Semaphore``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from ._exceptions import PSError, PushError

__all__ = ["AsyncPusher", "Pusher", "closed_error"]

T = TypeVar("T")
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


def _push_error(failures: list[PSError]) -> PushError:
    n = len(failures)
    first = failures[0]
    message = (
        f"{n} asynchronous push{'es' if n != 1 else ''} failed since the last flush; "
        f"the first: {type(first).__name__}: {first.message}"
    )
    return PushError(message, errors=list(failures))


class Pusher(Generic[T]):
    """Runs pushes on ``max_inflight`` background threads. Thread-safe.

    ``run(job)`` does one push and raises a ``PSError`` if it fails; ``merge(waiting, new)``
    adds ``new``'s gradients into ``waiting`` (for ``coalesce=True``).
    """

    def __init__(self, max_inflight: int, run: Callable[[Any], T], merge: Merge) -> None:
        self._run = run
        self._merge = merge
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_inflight, thread_name_prefix="paramshard-push"
        )
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[T]] = set()
        self._running = 0  # pushes holding a slot (exact, unlike the set of futures)
        self._waiting: tuple[Any, concurrent.futures.Future[T]] | None = None
        self._failures: list[PSError] = []
        self._closed = False

    def submit(self, job: Any, coalesce: bool = False) -> concurrent.futures.Future[T]:
        """Start a push. Blocks while ``max_inflight`` pushes are running, unless
        ``coalesce``: then the push waits (merged into the one already waiting, if any)."""
        if self._closed:
            raise closed_error()
        if coalesce:
            with self._lock:
                if self._closed:
                    raise closed_error()
                if self._waiting is not None and not self._waiting[1].cancelled():
                    self._merge(self._waiting[0], job)
                    return self._waiting[1]
                if self._slots.acquire(blocking=False):
                    return self._start(job, None)
                fut = self._future()
                self._waiting = (job, fut)
                return fut
        self._slots.acquire()
        with self._lock:
            if self._closed:
                self._slots.release()
                raise closed_error()
            return self._start(job, None)

    def _future(self) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._pending.add(fut)
        fut.add_done_callback(self._on_done)
        return fut

    def _start(
        self, job: Any, fut: concurrent.futures.Future[T] | None
    ) -> concurrent.futures.Future[T]:
        """Run ``job`` on a slot the caller holds (and the lock)."""
        fut = fut or self._future()
        self._running += 1
        try:
            self._executor.submit(self._call, job, fut)
        except BaseException:
            self._running -= 1
            self._slots.release()
            fut.cancel()
            raise
        return fut

    def _call(self, job: Any, fut: concurrent.futures.Future[T]) -> None:
        try:
            if not fut.set_running_or_notify_cancel():
                return  # cancelled while it waited: counted by _on_done
            try:
                result = self._run(job)
            except BaseException as exc:
                err = _as_ps_error(exc)
                # Recorded before the future completes, so a flush woken by it sees the failure.
                with self._lock:
                    self._failures.append(err)
                fut.set_exception(err)
            else:
                fut.set_result(result)
        finally:
            with self._lock:
                self._running -= 1
                waiting, self._waiting = self._waiting, None
                if waiting is not None:  # hand this slot to the push that waits for one
                    self._start(*waiting)
            if waiting is None:
                self._slots.release()

    def _on_done(self, fut: concurrent.futures.Future[T]) -> None:
        with self._lock:
            self._pending.discard(fut)
            if fut.cancelled():
                self._failures.append(_cancelled())

    @property
    def inflight(self) -> int:
        """Pushes started and not yet finished (at most ``max_inflight``)."""
        with self._lock:
            return self._running

    def flush(self) -> None:
        """Wait for every push submitted so far; raise :class:`PushError` for the failures
        since the last flush (each is raised by exactly one flush)."""
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending)
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            raise _push_error(failures)

    def close(self) -> None:
        """Flush, then stop the threads. Idempotent; raises what :meth:`flush` raises."""
        with self._lock:
            self._closed = True
        try:
            self.flush()
        finally:
            self._executor.shutdown(wait=True)


class AsyncPusher(Generic[T]):
    """The asyncio twin of :class:`Pusher`: use it from one event loop."""

    def __init__(self, max_inflight: int, run: Callable[[Any], Awaitable[T]], merge: Merge) -> None:
        self._run = run
        self._merge = merge
        self._max = max_inflight
        self._slots: asyncio.Semaphore | None = None
        self._inflight: set[asyncio.Task[T]] = set()
        self._running = 0
        self._waiting: tuple[Any, asyncio.Task[T]] | None = None
        self._failures: list[PSError] = []
        self._closed = False

    async def submit(self, job: Any, coalesce: bool = False) -> asyncio.Task[T]:
        """Start a push as a task; waits while ``max_inflight`` pushes are running, unless
        ``coalesce`` (then the push waits in its task, merged into the one already waiting)."""
        if self._closed:
            raise closed_error()
        if self._slots is None:  # created on the running loop
            self._slots = asyncio.Semaphore(self._max)
        if coalesce:
            if self._waiting is not None and not self._waiting[1].done():
                self._merge(self._waiting[0], job)
                return self._waiting[1]
            if self._slots.locked():
                task = self._spawn(job, holding=False)
                self._waiting = (job, task)
                return task
        await self._slots.acquire()
        if self._closed:
            self._slots.release()
            raise closed_error()
        return self._spawn(job, holding=True)

    def _spawn(self, job: Any, holding: bool) -> asyncio.Task[T]:
        state = {"started": False, "holding": holding}
        task = asyncio.get_running_loop().create_task(self._call(job, state))
        self._inflight.add(task)
        task.add_done_callback(lambda t: self._finished(t, state))
        return task

    async def _call(self, job: Any, state: dict[str, bool]) -> T:
        state["started"] = True
        assert self._slots is not None
        try:
            if not state["holding"]:
                await self._slots.acquire()
                state["holding"] = True
            if self._waiting is not None and self._waiting[0] is job:
                self._waiting = None  # from here on it is being sent: merge into no more
            self._running += 1
            try:
                return await self._run(job)
            finally:
                self._running -= 1
        except asyncio.CancelledError:
            self._failures.append(_cancelled())
            raise
        except BaseException as exc:
            err = _as_ps_error(exc)
            self._failures.append(err)
            if err is exc:
                raise
            raise err from exc

    def _finished(self, task: asyncio.Task[T], state: dict[str, bool]) -> None:
        # In a done callback, not in _call: a task cancelled before it started never runs
        # _call's body, yet it must give its slot back (and count as a failure).
        self._inflight.discard(task)
        if self._waiting is not None and self._waiting[1] is task:
            self._waiting = None
        if state["holding"]:
            assert self._slots is not None
            self._slots.release()
        if task.cancelled():
            if not state["started"]:
                self._failures.append(_cancelled())
        else:
            task.exception()  # retrieved: flush() reports it, asyncio need not warn

    @property
    def inflight(self) -> int:
        """Pushes started and not yet finished (at most ``max_inflight``)."""
        return self._running

    async def flush(self) -> None:
        """Wait for every push started so far; raise :class:`PushError` for the failures
        since the last flush."""
        pending = list(self._inflight)
        if pending:
            await asyncio.wait(pending)
        failures, self._failures = self._failures, []
        if failures:
            raise _push_error(failures)

    async def close(self) -> None:
        self._closed = True
        await self.flush()
