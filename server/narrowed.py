"""The float32 values a pull or poll sends narrowed (``wire_dtype``, docs/PROTOCOL.md §3 pull):
narrowed here, and the big ones kept for the next puller of the same version.

:func:`narrow_pull` narrows a pull's float32 rows to the wire dtype
(:mod:`client_sdk.wire.halves`): off the event loop when they are big, and each value of at
least :data:`CACHE_FROM` bytes only once per (value, version, wire dtype) while it stays in
:class:`NarrowedCache`. Many workers pulling one big model in half precision then cost the
shard one conversion per version, not one per worker.

A cached entry is the narrowed array with a weak reference to the exported value it was made
from (:meth:`Variable.export <server.store.variable.Variable.export>`: one read-only view per
value, replaced when a write copies the value) and that value's version: it serves a pull only
while both are the same, so a write (a new version), a copy of the value, or a deleted and
re-made variable (another view) never gets an old narrowing. The cache holds at most
``max_bytes`` (``--half-cache-bytes``), the least recently used entries dropped first; 0 keeps
none. It holds no state of the shard: nothing in it is snapshotted or replicated.

A new version of a kept float16 value is narrowed into the old version's array when nothing
but the cache refers to it any more (:meth:`NarrowedCache.spare`: no reply being sent holds it
or a view of it, which would count among its references), so a model pulled in float16
step after step costs the shard no new memory per step: freshly mapped memory costs more to
write than the cast itself.

Thread-safety: none; call from the event-loop thread (the narrowing itself may run on others).
"""

from __future__ import annotations

import asyncio
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from client_sdk import wire
from client_sdk.wire import casts, halves

from .errors import ShardError
from .store import PullRows

__all__ = ["CACHE_FROM", "NARROW_ON_LOOP", "NarrowedCache", "narrow_pull"]

#: Bytes of float32 values a pull narrows on the event loop; more are narrowed in a thread.
NARROW_ON_LOOP = 1 << 20
#: Values of at least this many bytes (float32) are kept narrowed for the next puller.
CACHE_FROM = 1 << 20
_F4 = np.dtype("<f4")
_F4_ONE = np.zeros(1, _F4)


def _references(array: np.ndarray) -> int:
    """``array``'s reference count: its holders, each view of it (a view's base is the array
    owning the memory) and each buffer exported from it (a memoryview holds its object)."""
    return sys.getrefcount(array)


class _Entry(NamedTuple):
    value: weakref.ReferenceType[np.ndarray]
    version: int
    narrowed: np.ndarray
    dtype: str


class NarrowedCache:
    """Narrowed values by (variable name, wire dtype), at most ``max_bytes`` of them."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.reused = 0
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        # References to an array kept in an entry that nobody else holds (as spare() counts them)
        kept = _Entry(weakref.ref(_F4_ONE), 0, np.empty(1, np.float16), "<f2")
        self._alone = _references(kept.narrowed)
        casts.backend()  # picked (and checked) at start, not at the first pull

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        """What ``/v1/cluster`` shows as ``half_cache``."""
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "reused": self.reused,
            "casts": casts.backend(),
        }

    def spare(self, name: str, wire_dtype: str, value: np.ndarray) -> np.ndarray | None:
        """The array kept for ``name`` in ``wire_dtype`` (another version's narrowing), taken
        out of the cache to narrow ``value`` into, if it fits (float16 of ``value``'s shape,
        its own memory) and nothing but the cache refers to it: no pull is sending it."""
        key = (name, wire_dtype)
        entry = self._entries.get(key)
        if entry is None:
            return None
        narrowed = entry.narrowed
        if (
            narrowed.dtype != np.float16
            or narrowed.shape != value.shape
            or narrowed.base is not None
            or _references(narrowed) > self._alone + 1  # + 1: the name narrowed here
        ):
            return None
        del self._entries[key], entry
        self.nbytes -= narrowed.nbytes
        self.reused += 1
        return narrowed

    def get(
        self, name: str, wire_dtype: str, value: np.ndarray, version: int
    ) -> tuple[np.ndarray, str] | None:
        """The narrowing of ``value`` at ``version`` and its type string, if kept."""
        key = (name, wire_dtype)
        entry = self._entries.get(key)
        if entry is None or entry.version != version or entry.value() is not value:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry.narrowed, entry.dtype

    def put(
        self,
        name: str,
        wire_dtype: str,
        value: np.ndarray,
        version: int,
        narrowed: np.ndarray,
        dtype: str,
    ) -> None:
        """Keep ``narrowed`` (of ``value`` at ``version``) in place of what ``name`` had, then
        drop the least recently used entries while more than ``max_bytes`` are kept."""
        if narrowed.nbytes > self.max_bytes:
            self.drop(name)
            return
        key = (name, wire_dtype)
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.narrowed.nbytes
        self._entries[key] = _Entry(weakref.ref(value), version, narrowed, dtype)
        self.nbytes += narrowed.nbytes
        while self.nbytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.nbytes -= dropped.narrowed.nbytes

    def drop(self, name: str) -> None:
        """Forget every narrowing of ``name``."""
        for key in [k for k in self._entries if k[0] == name]:
            self.nbytes -= self._entries.pop(key).narrowed.nbytes


async def narrow_pull(
    rows: PullRows,
    wire_dtype: str,
    cache: NarrowedCache,
    bound: Callable[[str], float] | None = None,
) -> list[int]:
    """Narrow, in place in ``rows``, every float32 value to ``wire_dtype`` (its type string
    too), from ``cache`` where it holds the value's current version; return the indices of
    the rows narrowed. 422 ``bad_tensor`` naming the variable for a value beyond float16's
    range. ``rows``' values are views no later write changes (:meth:`Variable.export
    <server.store.variable.Variable.export>`), so big ones are narrowed off the loop.
    ``bound(name)``, asked for each big value before anything else happens (the value the
    store bounds is then the one in ``rows``), is at least its largest magnitude
    (:meth:`Reads.bound <server.store.reads.Reads.bound>`): within float16's range, its
    narrowing is not read again for infinities."""
    narrowed, todo = [], []
    for i, value in enumerate(rows.values):
        if value is None or value.dtype != _F4:
            continue
        narrowed.append(i)
        kept = None
        if value.nbytes >= CACHE_FROM and cache.max_bytes:
            kept = cache.get(rows.names[i], wire_dtype, value, rows.versions[i])
        if kept is None:
            todo.append(i)
        else:
            rows.values[i], rows.dtypes[i] = kept
    if not todo:
        return narrowed
    names = [rows.names[i] for i in todo]
    values = [rows.values[i] for i in todo]
    dtypes = [rows.dtypes[i] for i in todo]
    into: list[np.ndarray | None] = [None] * len(todo)
    in_range = [False] * len(todo)
    if wire_dtype == halves.FLOAT16:
        for k, i in enumerate(todo):
            value = rows.values[i]
            if value is not None and value.nbytes >= CACHE_FROM:
                if cache.max_bytes:
                    into[k] = cache.spare(names[k], wire_dtype, value)
                if bound is not None:
                    in_range[k] = bound(names[k]) <= halves.FLOAT16_MAX
    args = (names, values, dtypes, wire_dtype, into, in_range)
    try:
        if sum(v.nbytes for v in values if v is not None) <= NARROW_ON_LOOP:
            halves.narrow_rows(*args)
        else:
            await asyncio.to_thread(halves.narrow_rows, *args)
    except wire.WireError as exc:
        raise ShardError(exc.code, exc.message, {"wire_dtype": wire_dtype}) from None
    for k, i in enumerate(todo):
        value = rows.values[i]
        assert value is not None
        if value.nbytes >= CACHE_FROM and cache.max_bytes:
            out = values[k]
            assert out is not None
            cache.put(names[k], wire_dtype, value, rows.versions[i], out, dtypes[k] or "")
        rows.values[i], rows.dtypes[i] = values[k], dtypes[k]
    return narrowed
