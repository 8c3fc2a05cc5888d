"""How stale gradients arrive, kept for people to see: per variable and per worker, the
staleness of the latest :data:`WINDOW` gradients, and what became of them.

A gradient's staleness is the variable's version when its push arrived minus the version the
worker computed it on (the push's ``versions``); a gradient without one has none. Each sync or
bounded-staleness variable keeps the staleness of its latest :data:`WINDOW` gradients that had
one, each worker that of its latest :data:`WINDOW` pushes that had one (a push counting with its
largest), in a :class:`Window`: a fixed amount of memory each, whatever the traffic, from which
``GET /v1/variables/{name}`` and ``GET /v1/workers`` show the 50th and 99th percentiles
(docs/PROTOCOL.md §3, Training modes; §4). An async variable keeps none: a push's bookkeeping
per variable is on the hot path, and one window entry per push (the worker's) costs nothing
there. What the variable's training mode made of each
gradient (applied, accepted into a sync round, dropped, applied with a scaled step) is counted
where it happens (:mod:`server.store.modes`).

Not persisted: a restarted shard starts its windows empty. Not thread-safe: the event-loop
thread only.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

__all__ = ["EMPTY", "WINDOW", "Window", "percentiles"]

#: How many of the latest stalenesses a window keeps.
WINDOW = 128
_MASK = WINDOW - 1
assert WINDOW & _MASK == 0, "WINDOW must be a power of two"

#: What a window with nothing in it shows.
EMPTY: dict[str, Any] = {"p50": None, "p99": None, "samples": 0}


class Window:
    """The latest :data:`WINDOW` stalenesses (a ring of int64; 1 KiB)."""

    __slots__ = ("ring", "seen")

    def __init__(self) -> None:
        self.ring = array("q", bytes(8 * WINDOW))
        #: How many were added in all.
        self.seen = 0

    def add(self, staleness: int) -> None:
        seen = self.seen
        self.ring[seen & _MASK] = staleness
        self.seen = seen + 1

    def summary(self) -> dict[str, Any]:
        """``p50``, ``p99`` (nearest rank; None without samples) and ``samples``."""
        n = min(self.seen, WINDOW)
        if not n:
            return dict(EMPTY)
        return {**percentiles(sorted(self.ring[:n])), "samples": n}


def percentiles(ordered: list[int]) -> dict[str, int]:
    """The nearest-rank 50th and 99th percentiles of ``ordered`` (sorted, not empty): the
    smallest value with at least that share of the values at or below it."""
    n = len(ordered)
    return {
        "p50": ordered[math.ceil(0.50 * n) - 1],
        "p99": ordered[math.ceil(0.99 * n) - 1],
    }
