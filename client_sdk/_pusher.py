"""Background pushes: bounded in flight, one future each, no failure ever dropped.

``PSClient.push_async`` hands a prepared push (gradients already copied, ``seq`` and versions
already chosen, in the caller's thread) to a :class:`Pusher`. At most ``max_inflight`` pushes
run at once; submitting another blocks until one finishes (backpressure: a worker cannot queue
unbounded gradients in memory). Every failure is kept in three places:

* the push's own future (``fut.result()`` raises it);
* the next :meth:`Pusher.flush`, which raises a :class:`PushError` holding every failure since
  the previous flush, whether or not a future already reported it;
* ``close()`` flushes, so a failure nobody asked about still surfaces there.

:class:`AsyncPusher` is the asyncio twin (an ``asyncio.Semaphore`` and tasks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ._exceptions import PSError, PushError

__all__ = ["AsyncPusher", "Pusher", "closed_error"]

T = TypeVar("T")


def closed_error() -> PSError:
    return PSError("this client is closed: create a new PSClient (or use it in a with block)")


def _as_ps_error(exc: BaseException) -> PSError:
    if isinstance(exc, PSError):
        return exc
    err = PSError(f"an asynchronous push failed inside the SDK: {exc!r} (please report this)")
    err.__cause__ = exc
    return err


def _cancelled() -> PSError:
    return PSError("an asynchronous push was cancelled before it finished; it may or may not "
                   "have been applied")


def _push_error(failures: list[PSError]) -> PushError:
    n = len(failures)
    first = failures[0]
    message = (f"{n} asynchronous push{'es' if n != 1 else ''} failed since the last flush; "
               f"the first: {type(first).__name__}: {first.message}")
    return PushError(message, errors=list(failures))


class Pusher:
    """Runs pushes on ``max_inflight`` background threads. Thread-safe.

    ``run(job)`` does one push and raises a ``PSError`` if it fails.
    """

    def __init__(self, max_inflight: int, run: Callable[[Any], T]) -> None:
        self._run = run
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_inflight, thread_name_prefix="paramshard-push")
        self._lock = threading.Lock()
        self._inflight: set[concurrent.futures.Future] = set()
        self._running = 0  # pushes holding a slot (exact, unlike the set of futures)
        self._failures: list[PSError] = []
        self._closed = False

    def submit(self, job: Any) -> concurrent.futures.Future:
        """Start a push; blocks while ``max_inflight`` pushes are running."""
        if self._closed:
            raise closed_error()
        self._slots.acquire()
        with self._lock:
            if self._closed:
                self._slots.release()
                raise closed_error()
            self._running += 1
            try:
                fut = self._executor.submit(self._call, job)
            except BaseException:
                self._running -= 1
                self._slots.release()
                raise
            self._inflight.add(fut)
        fut.add_done_callback(self._forget)
        return fut

    def _call(self, job: Any) -> Any:
        try:
            return self._run(job)
        except BaseException as exc:
            err = _as_ps_error(exc)
            # Recorded before the future completes, so a flush woken by it sees the failure.
            with self._lock:
                self._failures.append(err)
            if err is exc:
                raise
            raise err from exc
        finally:
            with self._lock:
                self._running -= 1
            self._slots.release()

    def _forget(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._inflight.discard(fut)
            if not fut.cancelled():
                return
            # Cancelled before it ran: _call never started, so give its slot back here.
            self._running -= 1
            self._failures.append(_cancelled())
        self._slots.release()

    @property
    def inflight(self) -> int:
        """Pushes started and not yet finished (at most ``max_inflight``)."""
        with self._lock:
            return self._running

    def flush(self) -> None:
        """Wait for every push submitted so far; raise :class:`PushError` for the failures
        since the last flush (each is raised by exactly one flush)."""
        with self._lock:
            pending = list(self._inflight)
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


class AsyncPusher:
    """The asyncio twin of :class:`Pusher`: use it from one event loop."""

    def __init__(self, max_inflight: int, run: Callable[[Any], Awaitable[Any]]) -> None:
        self._run = run
        self._max = max_inflight
        self._slots: asyncio.Semaphore | None = None
        self._inflight: set[asyncio.Task] = set()
        self._running = 0
        self._failures: list[PSError] = []
        self._closed = False

    async def submit(self, job: Any) -> asyncio.Task:
        """Start a push as a task; waits while ``max_inflight`` pushes are running."""
        if self._closed:
            raise closed_error()
        if self._slots is None:  # created on the running loop
            self._slots = asyncio.Semaphore(self._max)
        await self._slots.acquire()
        if self._closed:
            self._slots.release()
            raise closed_error()
        self._running += 1
        started: list[bool] = [False]
        task = asyncio.get_running_loop().create_task(self._call(job, started))
        self._inflight.add(task)
        task.add_done_callback(lambda t: self._finished(t, started[0]))
        return task

    async def _call(self, job: Any, started: list[bool]) -> Any:
        started[0] = True
        try:
            return await self._run(job)
        except asyncio.CancelledError:
            self._failures.append(_cancelled())
            raise
        except BaseException as exc:
            err = _as_ps_error(exc)
            self._failures.append(err)
            if err is exc:
                raise
            raise err from exc

    def _finished(self, task: asyncio.Task, started: bool) -> None:
        # In a done callback, not in _call: a task cancelled before it started never runs
        # _call's body, yet it must give its slot back (and count as a failure).
        self._inflight.discard(task)
        self._running -= 1
        assert self._slots is not None
        self._slots.release()
        if task.cancelled():
            if not started:
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
