"""Sync rounds: for each version of a sync variable, the first ``replicas`` gradients computed on
it, summed as they arrive, and their mean applied once (docs/PROTOCOL.md §3, Training modes).

What this module holds, for :mod:`server.store.modes` (which decides what each gradient of a
push becomes) and the store's verbs (which count and answer):

* :class:`Round`: the open round of one variable: the version it collects gradients on, their
  sum (one array the size of the value, in :func:`sum_dtype`), how many joined and who (a
  worker joins once), a bound on the sum's magnitudes (so a gradient that would make it
  overflow is refused before it is added), and when it times out. A snapshot may be reading
  the sum (:meth:`Round.frozen`): the next gradient then adds into fresh memory instead.
* :class:`RoundStats`: a sync variable's closed rounds: filled, timed out, discarded, the
  gradients they applied, and the last one.
* :class:`Deadlines`: when each open round times out, and :func:`close_when_due`, the task that
  closes them (run by the shard's app: a round times out however many workers died).

The mean of a round is ``sum / count`` computed into fresh memory (:meth:`Round.mean`), then
applied with the variable's optimizer like any gradient. Not thread-safe: the event-loop thread
only.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "CLOSED_HOW",
    "Deadlines",
    "Round",
    "RoundStats",
    "close_when_due",
    "open_round",
    "sum_dtype",
]

logger = logging.getLogger("paramshard.store")

#: How a round closes: it ``filled``, it ``timed_out`` with fewer gradients, or it was
#: ``discarded`` (its update would not be finite, or an assign replaced the value).
CLOSED_HOW = ("filled", "timed_out", "discarded")
#: While the shard takes no writes (paused for a fleet checkpoint, not persisting), a due round
#: is looked at again this often.
RETRY_WHEN_PAUSED = 0.1


def sum_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a round sums gradients of ``dtype`` in: the same, but float32 for float16 (a
    few float16 gradients overflow in their sum when their mean would not)."""
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


@dataclass(eq=False, slots=True)
class Round:
    """The open round of one sync variable, on ``version``."""

    version: int
    #: The gradients' sum (:func:`sum_dtype` of the variable's), C-contiguous, owned.
    sum: np.ndarray
    #: ``(worker_id, seq)`` of each gradient that joined, in order.
    contributors: list[tuple[str, int]]
    #: At least the largest magnitude in ``sum``.
    bound: float
    #: ``time.monotonic()`` when it opened (or, restored from a snapshot, when it was restored)
    #: and how long after that it times out.
    opened: float
    timeout: float
    #: True while a snapshot may read ``sum``: the next gradient adds into fresh memory.
    shared: bool = False
    workers: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.workers = {w for w, _ in self.contributors}

    @property
    def count(self) -> int:
        return len(self.contributors)

    @property
    def deadline(self) -> float:
        return self.opened + self.timeout

    def add(self, grad: np.ndarray, worker_id: str, seq: int, bound: float) -> None:
        """Add a gradient (checked, the variable's dtype and shape) whose largest magnitude is
        at most ``bound``; the caller checked that the sum stays finite."""
        if self.shared:
            self.sum = np.add(self.sum, grad, dtype=self.sum.dtype)
            self.shared = False
        else:
            np.add(self.sum, grad, out=self.sum)
        self.contributors.append((worker_id, seq))
        self.workers.add(worker_id)
        self.bound += bound

    def mean(self, dtype: np.dtype, grad: np.ndarray | None = None) -> np.ndarray:
        """``(sum + grad) / (count + 1)``, or without ``grad`` ``sum / count``, in ``dtype``
        (the variable's), into fresh memory: the sum is left as it is."""
        if grad is None:
            total, count = self.sum, self.count
            out = np.empty(self.sum.shape, dtype)
        else:
            total, count = np.add(self.sum, grad, dtype=self.sum.dtype), self.count + 1
            out = total if total.dtype == dtype else np.empty(total.shape, dtype)
        np.divide(total, count, out=out, casting="same_kind")
        return out

    def frozen(self) -> np.ndarray:
        """A read-only view of the sum, which no later gradient changes (for a snapshot)."""
        view = self.sum.view()
        view.flags.writeable = False
        self.shared = True
        return view

    def meta(self) -> dict[str, Any]:
        """What a snapshot keeps of the round besides its sum (docs/PROTOCOL.md §5)."""
        return {
            "version": self.version,
            "count": self.count,
            "contributors": [[w, s] for w, s in self.contributors],
        }

    def summary(self, now: float) -> dict[str, Any]:
        """The open round as ``GET /v1/variables/{name}`` shows it (``now``: monotonic)."""
        return {"version": self.version, "contributors": self.count, "age": now - self.opened}


def open_round(
    version: int, grad: np.ndarray, worker_id: str, seq: int, bound: float, timeout: float
) -> Round:
    """A round on ``version`` opened by ``grad`` (copied: the round outlives the request's
    buffer), timing out ``timeout`` seconds from now."""
    total = np.array(grad, dtype=sum_dtype(grad.dtype), order="C", copy=True)
    return Round(version, total, [(worker_id, seq)], bound, time.monotonic(), timeout)


@dataclass(slots=True)
class RoundStats:
    """A sync variable's closed rounds."""

    filled: int = 0
    timed_out: int = 0
    discarded: int = 0
    #: Gradients applied by the rounds that closed (not those discarded).
    gradients: int = 0
    #: The last round closed: ``version``, ``contributors``, ``closed`` (one of
    #: :data:`CLOSED_HOW`), ``at`` (Unix seconds); or None.
    last: dict[str, Any] | None = None

    def closed(self, version: int, contributors: int, how: str) -> None:
        if how == "filled":
            self.filled += 1
        elif how == "timed_out":
            self.timed_out += 1
        else:
            self.discarded += 1
        if how != "discarded":
            self.gradients += contributors
        self.last = {
            "version": version,
            "contributors": contributors,
            "closed": how,
            "at": time.time(),
        }

    def summary(self) -> dict[str, Any]:
        return {
            "filled": self.filled,
            "timed_out": self.timed_out,
            "discarded": self.discarded,
            "gradients": self.gradients,
            "last": None if self.last is None else dict(self.last),
        }

    @classmethod
    def load(cls, raw: Any) -> RoundStats:
        """From :meth:`summary`'s form (a snapshot's); ``ValueError`` if it is not that."""
        if not isinstance(raw, dict):
            raise ValueError("'rounds' is not an object")
        counts = [raw.get(k) for k in ("filled", "timed_out", "discarded", "gradients")]
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise ValueError("'rounds' has a count that is not an int >= 0")
        last = raw.get("last")
        if last is not None and not (isinstance(last, dict) and last.get("closed") in CLOSED_HOW):
            raise ValueError("'rounds.last' is not a closed round")
        return cls(*counts, last=last)


class Deadlines:
    """When each open round times out: at most one entry per variable that counts (the
    heap's stale entries are dropped as they surface, and all at once when they outnumber the
    live ones), so memory follows the open rounds, not the rounds ever opened."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str, int]] = []
        self._live: dict[str, tuple[float, int]] = {}
        #: Set when a round opens (the task closing them may have to wake sooner).
        self.changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._live)

    def add(self, name: str, version: int, deadline: float) -> None:
        self._live[name] = (deadline, version)
        heapq.heappush(self._heap, (deadline, name, version))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(d, n, v) for n, (d, v) in self._live.items()]
            heapq.heapify(self._heap)
        self.changed.set()

    def remove(self, name: str, version: int | None = None) -> None:
        """The round of ``name`` closed (or the variable is gone): no timeout for it. With
        ``version``, only if its open round is at that version."""
        if version is None or (name in self._live and self._live[name][1] == version):
            self._live.pop(name, None)

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()

    def next(self) -> float | None:
        """The earliest deadline of an open round, or None."""
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][1]) != (heap[0][0], heap[0][2]):
            heapq.heappop(heap)  # its round closed meanwhile
        return heap[0][0] if heap else None

    def due(self, now: float) -> list[tuple[str, int]]:
        """``(name, version)`` of every round whose deadline is at or before ``now``, removed."""
        out = []
        while (first := self.next()) is not None and first <= now:
            _, name, version = heapq.heappop(self._heap)
            del self._live[name]
            out.append((name, version))
        return out


async def close_when_due(
    deadlines: Deadlines, close: Callable[[float], object], may_close: Callable[[], bool]
) -> None:
    """Forever: sleep until the earliest round deadline (woken sooner when a round opens),
    then ``close(time.monotonic())``, which closes the rounds due. While ``may_close()`` is
    false (the shard takes no writes: paused for a fleet checkpoint, or it cannot persist)
    the due rounds wait, looked at again every :data:`RETRY_WHEN_PAUSED` seconds. Cancel the
    task to stop it."""
    while True:
        deadlines.changed.clear()
        first = deadlines.next()
        wait = None if first is None else max(0.0, first - time.monotonic())
        if wait is None or wait > 0:
            try:
                await asyncio.wait_for(deadlines.changed.wait(), wait)
            except asyncio.TimeoutError:
                pass
        first = deadlines.next()
        if first is None or first > time.monotonic():
            continue
        if not may_close():
            await asyncio.sleep(RETRY_WHEN_PAUSED)
            continue
        try:
            close(time.monotonic())
        except Exception:  # a bug: logged, and the task goes on closing the others
            logger.exception("closing the sync rounds that timed out failed")
            await asyncio.sleep(RETRY_WHEN_PAUSED)
