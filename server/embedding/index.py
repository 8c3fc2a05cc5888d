"""The id -> row map of one embedding table on one shard: an open-addressing hash table held in
one numpy array, looked up and filled for a whole batch of ids at once.

Ids are any int64 (collisionless: no two ids share a row). A slot holds an id and its row
number side by side (one int64 [capacity, 2] array: a lookup's first read of an id is one
cache line, where an array of ids and one of rows would cost two misses in a big table), or
row -1 when empty; an id's first slot is given by Fibonacci hashing (:meth:`IdIndex._home`: the
id's high bits folded into its low ones, times 2^64 over the golden ratio, the top bits), and a
lookup walks the following slots (linear probing) until it finds the id or an empty slot. Ids
that follow each other, a vocabulary's, land on first slots spread nearly evenly over the table,
hardly ever shared, so a lookup of them nearly always ends at the first slot; other ids spread
as by any good hash. It takes four numpy passes where a full 64-bit mixer (``mix64``) takes
eight, and on a batch whose memory is out of the cache each pass costs more than its
arithmetic.
Every step of the walk is one numpy pass over the ids still looking, never Python per id. A
lookup's first pass reads each id's first slot, which settles most ids (the table is at most
half full); the others then walk :data:`WINDOW` slots per pass (one ``[ids, WINDOW]`` gather),
so the long probe runs a batch always has a few of cost one or two passes, not one per slot.
An insert walks one slot per pass (ids that meet at a free slot must take turns). The table
doubles when more than half full (rebuilt by re-inserting every id, the same vectorized way),
so an insert costs amortized O(1) per id.

Rows are numbered 0, 1, 2, ... in the order their ids were added; the map never forgets an id
(a row's removal, for eviction, is a :meth:`IdIndex.rebuild` over the ids kept).
"""

from __future__ import annotations

import numpy as np

__all__ = ["WINDOW", "IdIndex"]

#: Slots a lookup reads per pass after the first (one cache line of int64).
WINDOW = 8
_EMPTY = -1
_OFFSETS = np.arange(WINDOW, dtype=np.int64)
_MIN_CAPACITY = 1 << 10
#: 2^64 over the golden ratio (odd): Fibonacci hashing's multiplier.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_FOLD = np.uint64(29)


def _shift(capacity: int) -> np.uint64:
    """How far a product is shifted right to keep its top log2(``capacity``) bits."""
    return np.uint64(64 - (capacity.bit_length() - 1))


def _empty(capacity: int) -> np.ndarray:
    """``capacity`` empty slots: (id 0, row -1) each."""
    slots = np.empty((capacity, 2), dtype=np.int64)
    slots[:, 0] = 0
    slots[:, 1] = _EMPTY
    return slots


class IdIndex:
    """Map int64 ids to row numbers 0..len-1. Not thread-safe."""

    __slots__ = ("_slots", "_mask", "_shift", "_count")

    def __init__(self, capacity: int = _MIN_CAPACITY) -> None:
        capacity = max(_MIN_CAPACITY, 1 << max(0, int(capacity) - 1).bit_length())
        self._slots = _empty(capacity)
        self._mask = capacity - 1
        self._shift = _shift(capacity)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes

    def _home(self, ids: np.ndarray) -> np.ndarray:
        """The first slot of each of ``ids`` (int64, C-contiguous)."""
        x = ids.view(np.uint64)
        x = x ^ (x >> _FOLD)  # a new array: the high bits reach the product's top bits too
        x *= _GOLDEN
        x >>= self._shift
        return x.view(np.int64)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The row of each id (int64 [n]), -1 where the id has none."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not self._count or not len(ids):
            return np.full(len(ids), _EMPTY, dtype=np.int64)
        slots, mask = self._slots, self._mask
        home = self._home(ids)
        pairs = slots.take(home, axis=0)  # (id, row) of each first slot
        out = pairs[:, 1].copy()  # right where the first slot holds the id or is empty (-1)
        walk = ((out != _EMPTY) & (pairs[:, 0] != ids)).nonzero()[0]
        if not len(walk):
            return out
        out[walk] = _EMPTY
        want, start = ids[walk], home[walk] + 1
        while True:
            window = slots.take((start[:, None] + _OFFSETS) & mask, axis=0)
            found = window[..., 1]
            stop = (found == _EMPTY) | (window[..., 0] == want[:, None])
            first = stop.argmax(axis=1)
            pick = np.arange(len(first))
            done = stop[pick, first]
            out[walk[done]] = found[pick, first][done]  # the row, or -1 at an empty slot
            if done.all():
                return out
            left = ~done
            walk, want, start = walk[left], want[left], start[left] + WINDOW

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Give each of ``ids`` (distinct, none in the map yet) the next row numbers, in order:
        returns them (int64 [n], ``len(self)`` onwards)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        start = self._count
        numbers = np.arange(start, start + len(ids), dtype=np.int64)
        if (start + len(ids)) * 2 > len(self._slots):
            self._grow(start + len(ids))
        self._place(ids, numbers)
        self._count += len(ids)
        return numbers

    def rebuild(self, ids: np.ndarray) -> None:
        """Forget every id, then map ``ids[i]`` (distinct) to row ``i``."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        capacity = max(_MIN_CAPACITY, 1 << (2 * len(ids)).bit_length())
        self._slots = _empty(capacity)
        self._mask = capacity - 1
        self._shift = _shift(capacity)
        self._count = len(ids)
        self._place(ids, np.arange(len(ids), dtype=np.int64))

    def _grow(self, needed: int) -> None:
        capacity = len(self._slots)
        while needed * 2 > capacity:
            capacity *= 2
        held = self._slots[self._slots[:, 1] != _EMPTY]
        self._slots = _empty(capacity)
        self._mask = capacity - 1
        self._shift = _shift(capacity)
        ids, numbers = held[:, 0].copy(), held[:, 1].copy()
        self._place(ids, numbers)

    def _place(self, ids: np.ndarray, numbers: np.ndarray) -> None:
        """Put distinct ``ids`` (none present) with their row ``numbers`` into empty slots:
        each walks from its home slot; of the ids that reach one empty slot in the same pass,
        the first takes it and the others walk on."""
        slots, mask = self._slots, self._mask
        keys, rows = slots[:, 0], slots[:, 1]
        pos = self._home(ids)
        while len(ids):
            free = rows[pos] == _EMPTY
            # Of several ids on one free slot, np.unique's first index wins it.
            cand = np.flatnonzero(free)
            _, first = np.unique(pos[cand], return_index=True)
            won = cand[first]
            keys[pos[won]] = ids[won]
            rows[pos[won]] = numbers[won]
            left = np.ones(len(ids), dtype=bool)
            left[won] = False
            ids, numbers, pos = ids[left], numbers[left], (pos[left] + 1) & mask
