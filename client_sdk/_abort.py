"""Abandoning a request another thread is sending: what a race of long polls needs.

A ``pull(..., newer_than=...)`` over several shards sends one long poll to each and returns as
soon as one answers (``_transport.race``); the others are then abandoned. An exchange that
blocks in a socket (the native pool, httpx2's sync streams) cannot be cancelled like an asyncio
task, so each request of a race carries an :class:`Abort`: whoever sends it registers how to
cut the exchange short (:meth:`Abort.hold`: shut its socket down, which wakes the thread
blocked on it with end-of-file), and :meth:`Abort.fire` does so for all it holds and for any
registered later. The retry loop stops once it is fired. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Abort"]


class Abort:
    """Cuts short the exchanges of one request (see the module)."""

    __slots__ = ("_cuts", "_done", "_event", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cuts: dict[int, Callable[[], None]] = {}
        self._done = False
        self._event: threading.Event | None = None  # made when first asked for: most never are

    @property
    def fired(self) -> threading.Event:
        """Set once :meth:`fire` was called: no retry may start."""
        with self._lock:
            if self._event is None:
                self._event = threading.Event()
                if self._done:
                    self._event.set()
            return self._event

    def hold(self, key: int, cut: Callable[[], None]) -> None:
        """While the exchange ``key`` (e.g. ``id(connection)``) runs, :meth:`fire` calls
        ``cut``; if fired already, ``cut`` runs now."""
        with self._lock:
            if not self._done:
                self._cuts[key] = cut
                return
        _quietly(cut)

    def drop(self, key: int) -> None:
        """The exchange ``key`` ended: no cut for it any more."""
        with self._lock:
            self._cuts.pop(key, None)

    def fire(self) -> None:
        """Cut every held exchange short, and any held from now on."""
        with self._lock:
            self._done = True
            if self._event is not None:
                self._event.set()
            cuts, self._cuts = list(self._cuts.values()), {}
        for cut in cuts:
            _quietly(cut)


def _quietly(cut: Callable[[], None]) -> None:
    try:
        cut()
    except OSError:  # the socket closed meanwhile: nothing left to cut
        pass
