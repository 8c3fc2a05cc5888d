"""Polls waiting for variables' versions: the store's side of ``POST /v1/poll`` (PROTOCOL.md §3).

A poll names variables and a condition: *newer than* (one named variable's version differs from
the one the client holds) or *min version* (every named variable's version reached a number).
:func:`poll` checks the condition and, while it does not hold, parks one future under each name
it waits on in the store's :class:`VersionWaiters`; whatever changes a variable's version or
removes it calls :meth:`VersionWaiters.wake` with its name, which resolves those futures, and the
poll checks again. Nothing polls: a waiting poll is a future and a timer, and costs no CPU until
a write to one of its variables (or its timeout, its client leaving, or the shard shutting down)
wakes it.

Cost to the writers: one truth test (:attr:`VersionWaiters.waiting`) while no poll waits, and
a dict lookup per written variable (:meth:`VersionWaiters.wake`) while some do. Everything runs
on the event loop; nothing here is thread-safe. Nothing here imports the web stack.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from ..errors import ShardError

__all__ = ["MAX_AHEAD", "MAX_POLL_SECONDS", "VersionWaiters", "poll"]

#: Longest a poll waits (seconds), as ``/v1/wait``: a client that wants longer polls again.
MAX_POLL_SECONDS = 30.0
#: How far above a variable's current version a ``min_version`` may be. A version that far
#: ahead is a client's mistake (a step count for a version, a version from another run), and
#: its poll would only ever time out: it is refused, naming the field.
MAX_AHEAD = 1_000_000


class _Versioned(Protocol):
    name: str
    version: int


class _Store(Protocol):
    waiters: VersionWaiters

    def _checked(self, names: Iterable[Any]) -> Sequence[_Versioned]: ...


class VersionWaiters:
    """The polls waiting on each variable name, as futures woken by :meth:`wake`."""

    def __init__(self) -> None:
        self._by_name: dict[str, set[asyncio.Future[None]]] = {}
        #: Polls in progress (for ``/v1/cluster``'s ``polls_waiting``).
        self.polls = 0
        #: Set when the shard starts shutting down: waiting polls answer, new ones do not wait.
        self.closed = False

    @property
    def waiting(self) -> bool:
        """Whether any poll waits (a writer tests this before naming what it wrote)."""
        return bool(self._by_name)

    def wake(self, names: Iterable[str]) -> None:
        """Wake the polls waiting on any of ``names`` (their version changed, or they were
        removed). Cheap while nobody waits: call it on every write."""
        by_name = self._by_name
        if not by_name:
            return
        for name in names:
            futures = by_name.pop(name, None)
            if futures:
                for future in futures:
                    if not future.done():
                        future.set_result(None)

    def wake_all(self) -> None:
        """Wake every waiting poll (the whole state was replaced)."""
        self.wake(list(self._by_name))

    def close(self) -> None:
        """The shard is shutting down: waiting polls answer now, new ones do not wait."""
        self.closed = True
        self.wake_all()

    def _park(self, names: Iterable[str], future: asyncio.Future[None]) -> list[str]:
        parked = list(dict.fromkeys(names))
        by_name = self._by_name
        for name in parked:
            by_name.setdefault(name, set()).add(future)
        return parked

    def _unpark(self, names: list[str], future: asyncio.Future[None]) -> None:
        by_name = self._by_name
        for name in names:
            futures = by_name.get(name)
            if futures is not None:
                futures.discard(future)
                if not futures:
                    del by_name[name]


def _held_of(
    names: Sequence[str], versions: Mapping[str, int] | Sequence[int | None] | None
) -> list[int | None]:
    if versions is None:
        return [None] * len(names)
    if isinstance(versions, Mapping):
        return [versions.get(n) for n in names]
    return list(versions)


async def poll(
    store: _Store,
    names: Sequence[str],
    versions: Mapping[str, int] | Sequence[int | None] | None,
    min_version: int | None,
    timeout: float,
    gone: Awaitable[Any] | None = None,
) -> bool:
    """Wait until the poll's condition holds; return whether it did (``False``: ``timeout``
    seconds passed, ``gone`` finished (the client left) or the shard is shutting down first).

    Newer than (``min_version`` is ``None``): one of ``names``' versions differs from the one
    ``versions`` holds for it (a map, or a list parallel to ``names``; a name without one
    differs). Min version: every one of ``names`` has ``min_version`` or more. Refuses as a
    pull would (400, 421, 404) before waiting, 404 also when a variable is removed while it
    waits, and 400 (``details.field: min_version``) for a ``min_version`` more than
    :data:`MAX_AHEAD` above a variable's version. A coroutine on the event loop.
    """
    variables = store._checked(names)
    if min_version is not None:
        for var in variables:
            if min_version - var.version > MAX_AHEAD:
                raise ShardError(
                    "bad_request",
                    f"poll: min_version {min_version} is {min_version - var.version:,} above "
                    f"the version of {var.name!r} ({var.version}); at most {MAX_AHEAD:,} "
                    "ahead is taken: check where the number comes from",
                    {
                        "field": "min_version",
                        "variable": var.name,
                        "version": var.version,
                        "limit": MAX_AHEAD,
                    },
                )
    held = _held_of(names, versions)
    waiters = store.waiters
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    gone_future = None if gone is None else asyncio.ensure_future(gone)
    waiters.polls += 1
    try:
        while True:
            if min_version is None:
                if any(var.version != h for var, h in zip(variables, held)):
                    return True
                watch = [var.name for var in variables]
            else:
                watch = [var.name for var in variables if var.version < min_version]
                if not watch:
                    return True
            remaining = deadline - loop.time()
            if remaining <= 0 or waiters.closed:
                return False
            woken: asyncio.Future[None] = loop.create_future()
            parked = waiters._park(watch, woken)
            try:
                pending = {woken} if gone_future is None else {woken, gone_future}
                await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiters._unpark(parked, woken)
                woken.cancel()
            if gone_future is not None and gone_future.done():
                return False
            variables = store._checked(names)  # 404 if one was removed meanwhile
    finally:
        waiters.polls -= 1
        if gone_future is not None and not gone_future.done():
            gone_future.cancel()
