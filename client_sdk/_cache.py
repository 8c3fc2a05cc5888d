"""What a client remembers of the variables it pulled and initialised: :class:`VersionCache`.

A pull tells each shard the version it holds of each name, and the shard sends only the
values that changed since; the cached array stands for each of the others. An entry is
``(shard incarnation, version, value)``, where the incarnation is the shard's era
(:func:`client_sdk._fleet.era`: its incarnation, and how many deletes it ran): a value is only
ever reused for the era of the shard it came from, since a restarted shard, or a variable
deleted and made again, may reach the same version with another value. When a shard restarts
its entries go (:meth:`drop_shard`).

The rules, each written once:

* **storing** (:meth:`VersionCache.store`): a pulled value replaces the cached one unless the
  cached one is of the same incarnation and newer (another thread's pull finished first);
* **reusing** (:func:`reuse`): a row a shard sent without a value is the value the pull held
  for it when it asked, if that is of the version and incarnation the shard reports; else the
  name is pulled again, without a version;
* **lending** (:func:`lent`): a value received into a caller's buffer (``pull(out=)``,
  ``_into.py``) is not kept, since the buffer is its owner's to change and a copy would double
  the parameters' memory: its entry holds a stand-in of its shape and dtype without memory, so
  its version still goes with a push and its size bounds a reply, but it never stands for a
  value (a pull into buffers does not offer its version, and :func:`reuse` pulls it again).

The cache also knows the shape and dtype of the variables this client initialised and never
pulled. With the cached values, they bound a pull's reply (:meth:`value_bytes`) and catch a
gradient of the wrong shape before it is sent (:meth:`shapes`).

Thread-safe: one lock, never held across I/O.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from .placement import shard_for

__all__ = ["NOT_HELD", "Entry", "Held", "Lent", "VersionCache", "lent", "reuse"]

#: A pulled value as the cache keeps it: ``(shard incarnation, version, value)``. A plain tuple:
#: a pull of many variables makes one per variable, and a tuple is the cheapest record to make.
Entry = tuple[str | None, int, np.ndarray]
#: What a pull holds of one shard's names: cache entries parallel to them (or None), and the
#: cache's write count when they were read (see VersionCache.held).
Held = tuple[list[Entry | None] | None, int | None]
NOT_HELD: Held = (None, None)
#: Most variables whose shape and dtype from init the cache keeps (then it starts over).
MAX_KNOWN = 1 << 20
#: Lists of names whose value sizes are kept (all dropped when full).
MAX_SIZES = 64
#: A shape and a dtype.
Layout = tuple[tuple[int, ...], np.dtype]


class Lent(np.ndarray):
    """The stand-in a cache entry holds for a value lent to a caller's buffer (:func:`lent`)."""


def lent(value: np.ndarray) -> np.ndarray:
    """A read-only stand-in of ``value``'s shape and dtype (``nbytes`` too) that holds no
    memory, for the cache entry of a value received into a caller's buffer."""
    return np.broadcast_to(np.zeros((), value.dtype).view(Lent), value.shape, subok=True)


class VersionCache:
    """The last pulled ``(incarnation, version, value)`` of each variable, and the layout of
    those this client initialised, for a fleet of ``n`` shards. Thread-safe."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._lock = threading.Lock()
        #: name -> its entry; read it under no lock only to look (tests, the bench)
        self.entries: dict[str, Entry] = {}
        #: +1 on every change of ``entries`` (under the lock): a pull whose reply finds it
        #: where it was when the versions asked for were read may store without comparing.
        self._writes = 0
        #: name -> (shape, dtype) of variables this client initialised (what it knows of those
        #: it never pulled); dropped with the entries of their shard when it restarts.
        self._known: dict[str, Layout] = {}
        #: tuple of a pull's names for one shard -> (bytes of their values, False), for lists
        #: whose sizes are all known (see value_bytes).
        self._sizes: dict[tuple[str, ...], tuple[int, bool]] = {}

    def held(self, names: list[str], incarnation: str | None) -> Held:
        """What the cache holds of ``names`` from the shard's ``incarnation``: a list parallel
        to ``names`` (``None`` where nothing; ``None`` for the whole list when it holds none of
        them), and the write count when it was read (for :meth:`store`)."""
        with self._lock:
            get = self.entries.get
            entries = [
                c if (c := get(k)) is not None and c[0] == incarnation else None for k in names
            ]
            writes = self._writes
        return (None if entries.count(None) == len(entries) else entries), writes

    def store(
        self,
        names: Sequence[str],
        versions: Sequence[int],
        values: Sequence[np.ndarray],
        incarnation: str | None,
        writes: int | None = None,
    ) -> None:
        """Cache pulled values (``values[i]`` is ``names[i]``'s, at ``versions[i]``, from the
        shard's ``incarnation``), never over a newer value of the same incarnation. ``writes``
        is the write count :meth:`held` gave when the pull asked: if nothing changed the cache
        since, each value replaces an older one of its incarnation, or one of another (or
        none), so all of them go in without comparing."""
        if not names:
            return
        with self._lock:
            entries = self.entries
            if writes == self._writes:
                entries.update(zip(names, zip(itertools.repeat(incarnation), versions, values)))
            else:
                get = entries.get
                entries.update(
                    {
                        name: (incarnation, version, value)
                        for name, version, value in zip(names, versions, values)
                        if (c := get(name)) is None or c[1] <= version or c[0] != incarnation
                    }
                )
            self._writes += 1

    def versions(self, names: Iterable[str]) -> dict[str, int]:
        """The cached version of each of ``names`` the cache holds."""
        with self._lock:
            get = self.entries.get
            return {k: c[1] for k in names if (c := get(k)) is not None}

    def shapes(self, names: Iterable[str]) -> dict[str, Layout]:
        """The shape and dtype of each of ``names`` the cache knows (a value or an init)."""
        out = {}
        with self._lock:
            entries, known = self.entries, self._known
            for name in names:
                cached = entries.get(name)
                if cached is not None:
                    out[name] = (cached[2].shape, cached[2].dtype)
                elif (layout := known.get(name)) is not None:
                    out[name] = layout
        return out

    def value_bytes(self, names: list[str]) -> tuple[int, bool]:
        """The bytes the values of ``names`` take, as far as the cache knows them, and whether
        any is unknown (neither pulled nor initialised by this client)."""
        key = tuple(names)
        size = self._sizes.get(key)
        if size is not None:
            return size
        total = 0
        unknown = False
        with self._lock:
            entries, known = self.entries, self._known
            for name in names:
                cached = entries.get(name)
                if cached is not None:
                    total += cached[2].nbytes
                elif (layout := known.get(name)) is not None:
                    shape, dtype = layout
                    total += math.prod(shape) * dtype.itemsize
                else:
                    unknown = True
            if not unknown:
                if len(self._sizes) >= MAX_SIZES:
                    self._sizes.clear()
                self._sizes[key] = (total, False)
        return total, unknown

    def learn(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Remember the shape and dtype of variables the shards now hold (an init's)."""
        with self._lock:
            known = self._known
            if len(known) + len(arrays) > MAX_KNOWN:
                known.clear()
            known.update((name, (a.shape, a.dtype)) for name, a in arrays.items())

    def forget(self, names: Iterable[str] = (), prefix: str | None = None) -> None:
        """Forget the values and layouts of ``names``, and of every name starting with
        ``prefix`` (variables deleted: one made again under the name starts over at version
        0, so a cached version of the old one must not be offered)."""
        names = list(names)
        with self._lock:
            entries, known = self.entries, self._known
            if prefix is not None:
                names += [k for k in entries if k.startswith(prefix)]
                names += [k for k in known if k.startswith(prefix)]
            for name in names:
                entries.pop(name, None)
                known.pop(name, None)
            self._sizes.clear()
            self._writes += 1

    def drop_shard(self, shard: int) -> None:
        """Forget the values, and the layouts initialised, of variables placed on ``shard``
        (it restarted)."""
        n = self._n
        with self._lock:
            for name in [k for k in self.entries if shard_for(k, n) == shard]:
                del self.entries[name]
            for name in [k for k in self._known if shard_for(k, n) == shard]:
                del self._known[name]
            self._sizes.clear()
            self._writes += 1


def reuse(
    names: Sequence[str],
    versions: Sequence[int],
    values: Sequence[np.ndarray | None],
    held: Mapping[str, Entry | None],
    incarnation: str | None,
    out: dict[str, np.ndarray],
) -> list[str]:
    """The rows of a pull reply without a value (``values[i]`` is ``None``: unchanged since
    the version the pull told the shard): put into ``out`` the value ``held`` for each (what
    the cache held when the pull asked) if it is of the version and ``incarnation`` the shard
    reports, and not :func:`lent`; return the others' names, to pull again without versions."""
    again = []
    for name, version, value in zip(names, versions, values):
        if value is None:
            cached = held.get(name)
            if (
                cached is None
                or cached[1] != version
                or cached[0] != incarnation
                or type(cached[2]) is Lent
            ):
                again.append(name)
            else:
                out[name] = cached[2]
    return again
