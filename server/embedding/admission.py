"""Admission and eviction of one embedding table's rows on one shard: which ids get a row, and
which rows are dropped to bound the table.

A table's :class:`~client_sdk.embedding.Admission` (part of its spec) sets three rules, each off
by default:

* ``min_count``: an id gets a row on the push that brings the number of pushes naming it to
  ``min_count`` (a push counts an id once however often it repeats in it). Until then a push
  of it is counted in :class:`PendingCounts` and its gradient dropped, and a pull answers the
  initializer's row, as for any id without a row.
* ``ttl``: a row that no push updated for ``ttl`` of the table's updates on this shard is
  evicted. Looking for such rows reads every row's last update, so it runs once every
  ``max(1, ttl // 8)`` updates: a row goes between ``ttl`` and ``ttl + ttl // 8`` updates after
  its last one.
* ``max_rows``: a push whose new rows would take the table past ``max_rows`` rows on this shard
  first evicts the least recently updated rows (never one the push updates), enough to leave
  room for its new rows plus ``max_rows // 16`` more. Evicting rewrites the table's arrays, so
  it happens at most once per ``max_rows // 16`` new rows, not on every push.

An evicted row is forgotten whole (value, slots, step count, counts): a later push of its id
starts over from the initializer's row (and, with ``min_count``, from a count of 0).

The counts of ids not admitted yet are bounded: :class:`PendingCounts` holds at most
``capacity`` ids (the shard's ``--max-pending-ids``) and, past it, forgets the least recently
pushed ones, down to ``capacity * 15 // 16`` (again so that its rewrite is rare). A forgotten id
counts from 0 again. Memory per pending id: 24 bytes plus its index slots (at most 32).

Everything here is a batch operation in numpy (no Python per id), and deterministic: replaying
the same pushes on the same table gives the same rows, counts and evictions. Not thread-safe.
"""

from __future__ import annotations

import numpy as np

from .index import IdIndex

__all__ = [
    "DEFAULT_MAX_PENDING",
    "PendingCounts",
    "compact",
    "lru_victims",
    "stale_rows",
    "sweeps_at",
]

#: Ids whose pushes one table counts on one shard before it forgets the least recent
#: (``--max-pending-ids``).
DEFAULT_MAX_PENDING = 1 << 20


class PendingCounts:
    """Push counts of ids that have no row yet, at most ``capacity`` ids (see the module)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.index = IdIndex()
        self.ids = np.zeros(0, np.int64)
        self.counts = np.zeros(0, np.int64)
        #: the table update that last counted the id; -1 once admitted (forgotten first)
        self.last_seen = np.zeros(0, np.int64)
        #: ids forgotten to stay within capacity, since the table was created
        self.forgotten = 0
        self._live = 0  # entries in the arrays (admitted ones included until the next rewrite)
        self._admitted_here = 0

    def __len__(self) -> int:
        """Ids counted and not admitted."""
        return self._live - self._admitted_here

    @property
    def nbytes(self) -> int:
        return 24 * self._live + self.index.nbytes

    def counted(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For distinct ``ids`` without a row: where each is (-1: not counted yet) and its count
        once this push is counted. Changes nothing."""
        where = self.index.lookup(ids)
        after = np.ones(len(ids), np.int64)
        have = where >= 0
        after[have] += self.counts[where[have]]
        return where, after

    def commit(
        self, ids: np.ndarray, where: np.ndarray, after: np.ndarray, admitted: np.ndarray, tick: int
    ) -> None:
        """Record a push of distinct ``ids`` (``where``/``after`` from :meth:`counted`) at table
        update ``tick``: the admitted ones leave the counts, the others keep ``after``."""
        have = where >= 0
        old = where[have]
        self.counts[old] = after[have]
        self.last_seen[old] = tick
        gone = old[admitted[have]]
        self.last_seen[gone] = -1
        self._admitted_here += len(gone)
        new = ~have & ~admitted
        if new.any():
            fresh = ids[new]
            numbers = self.index.add(fresh)
            end = self._live + len(fresh)
            if end > len(self.ids):
                self._reserve(end)
            self.ids[numbers] = fresh
            self.counts[numbers] = after[new]
            self.last_seen[numbers] = tick
            self._live = end
        if self._live > self.capacity or (
            self._admitted_here and self._admitted_here * 4 > self._live
        ):
            self._forget()

    def _reserve(self, needed: int) -> None:
        size = max(1024, len(self.ids))
        while size < needed:
            size *= 2
        for key in ("ids", "counts", "last_seen"):
            a = getattr(self, key)
            grown = np.empty(size, np.int64)
            grown[: self._live] = a[: self._live]
            setattr(self, key, grown)

    def _forget(self) -> None:
        """Drop the admitted entries and, past capacity, the least recently counted ids."""
        n = self._live
        seen = self.last_seen[:n]
        keep_n = min(n - self._admitted_here, self.capacity * 15 // 16)
        if keep_n < n - self._admitted_here:
            self.forgotten += n - self._admitted_here - keep_n
        if keep_n <= 0:
            keep = np.zeros(0, np.int64)
        else:
            keep = np.argpartition(seen, n - keep_n)[n - keep_n :]
            keep.sort()
        self._load(self.ids[keep], self.counts[keep], self.last_seen[keep])

    def _load(self, ids: np.ndarray, counts: np.ndarray, last_seen: np.ndarray) -> None:
        self.ids = np.array(ids, np.int64)
        self.counts = np.array(counts, np.int64)
        self.last_seen = np.array(last_seen, np.int64)
        self._live = len(self.ids)
        self._admitted_here = 0
        self.index.rebuild(self.ids)

    def arrays(self) -> dict[str, np.ndarray]:
        """The ids still pending, their counts and last counts (copies, for a snapshot)."""
        live = self.last_seen[: self._live] >= 0
        return {
            "pending.ids": self.ids[: self._live][live],
            "pending.counts": self.counts[: self._live][live],
            "pending.last_seen": self.last_seen[: self._live][live],
        }

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Put back what :meth:`arrays` gave (ValueError if the arrays do not fit together)."""
        ids = arrays.get("pending.ids")
        if ids is None:
            return
        n = len(ids)
        for key in ("pending.counts", "pending.last_seen"):
            if key not in arrays or arrays[key].shape != (n,):
                raise ValueError(f"snapshot array {key!r} missing or not ({n},)")
        if len(np.unique(ids)) != n:
            raise ValueError("snapshot counts an id twice among pending ids")
        self._load(ids, arrays["pending.counts"], arrays["pending.last_seen"])


def sweeps_at(version: int, ttl: int) -> bool:
    """Whether the update that brings the table to ``version`` looks for rows past ``ttl``."""
    return version % max(1, ttl // 8) == 0


def stale_rows(last_update: np.ndarray, version: int, ttl: int) -> np.ndarray:
    """Row numbers whose last update is ``ttl`` or more updates before ``version``."""
    return np.flatnonzero(last_update <= version - ttl)


def lru_victims(last_update: np.ndarray, spared: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` row numbers updated least recently, none of ``spared`` (row numbers);
    fewer if there are not that many others."""
    order = last_update.copy()
    order[spared] = np.iinfo(np.int64).max
    count = min(count, len(order) - len(np.unique(spared)))
    if count <= 0:
        return np.zeros(0, np.int64)
    return np.argpartition(order, count - 1)[:count]


def compact(arrays: list[np.ndarray], live: int, victims: np.ndarray) -> np.ndarray:
    """Remove rows ``victims`` from the first ``live`` entries of each of ``arrays`` (all in
    row order), in place, keeping the others' order; returns the old -> new row numbers
    (-1 for a removed row)."""
    keep = np.ones(live, bool)
    keep[victims] = False
    kept = np.flatnonzero(keep)
    for a in arrays:
        a[: len(kept)] = a[kept]
    remap = np.full(live, -1, np.int64)
    remap[kept] = np.arange(len(kept), dtype=np.int64)
    return remap
