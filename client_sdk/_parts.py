"""What a client knows of partitioned variables (:mod:`client_sdk.partitions`): their layouts,
and which names it found plain.

A layout is learned from the shard that owns the variable's name: from its ``init`` reply,
from a ``wait`` reply (``partitioned``), or from the 409 ``partitioned`` it answers a request
that named the variable as a plain one. A layout never changes while its variable exists, so
it is kept; a delete through this client forgets it, and a layout found stale (a part missing,
or of another shape: the variable was deleted and made again by another client) is forgotten
and learned again (``_verbs/partitioned.py``).

Thread-safe: one lock, never held across I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ._exceptions import ProtocolError
from .partitions import Layout

__all__ = ["Parts", "fold_results"]

#: Most names the client remembers as plain (then it starts over).
MAX_PLAIN = 1 << 20


class Parts:
    """Layouts by name, the names known to be plain, and the last assembly of each
    partitioned variable's value (reused while no part changed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layouts: dict[str, Layout] = {}
        self._plain: set[str] = set()
        self._assembled: dict[str, tuple[tuple[np.ndarray, ...], np.ndarray]] = {}

    def __bool__(self) -> bool:
        return bool(self._layouts)

    def get(self, name: str) -> Layout | None:
        return self._layouts.get(name)

    def of(self, names: Any) -> dict[str, Layout]:
        """The layouts of those of ``names`` that are partitioned, as far as known."""
        layouts = self._layouts
        if not layouts or isinstance(names, (str, bytes)):
            return {}
        try:
            return {n: lay for n in names if (lay := layouts.get(n)) is not None}
        except TypeError:  # not a list of names: the verb says what is wrong with it
            return {}

    def unknown(self, names: Iterable[str]) -> list[str]:
        """Those of ``names`` known neither as partitioned nor as plain."""
        plain, layouts = self._plain, self._layouts
        if plain.issuperset(names):
            return []
        return [n for n in names if n not in plain and n not in layouts]

    def learn(self, layouts: Any, url: str | None = None) -> list[Layout]:
        """Record the layouts of a reply (name -> wire form); :class:`ProtocolError` for one
        that is not a layout."""
        if not isinstance(layouts, Mapping):
            raise ProtocolError(f"shard {url} sent partitioned layouts that are not a map")
        out = []
        for name, entry in layouts.items():
            try:
                out.append(Layout.from_wire(name, entry))
            except ValueError as exc:
                raise ProtocolError(
                    f"shard {url} sent a bad layout for {name!r}: {exc}", shard=url
                ) from None
        with self._lock:
            for layout in out:
                self._layouts[layout.name] = layout
                self._plain.discard(layout.name)
                self._assembled.pop(layout.name, None)
        return out

    def learn_plain(self, names: Iterable[str]) -> None:
        """Record ``names`` as plain variables (or not made yet): no layout to look up."""
        with self._lock:
            if len(self._plain) >= MAX_PLAIN:
                self._plain.clear()
            for n in names:
                if n not in self._layouts:
                    self._plain.add(n)

    def forget(self, names: Iterable[str] = (), prefix: str | None = None) -> None:
        """Forget what is known of ``names`` (or of every name starting with ``prefix``)."""
        with self._lock:
            if prefix is not None:
                names = [n for n in [*self._layouts, *self._plain] if n.startswith(prefix)]
            for n in list(names):
                self._layouts.pop(n, None)
                self._plain.discard(n)
                self._assembled.pop(n, None)

    def assemble(self, layout: Layout, parts: list[np.ndarray]) -> np.ndarray | None:
        """The variable's value from its parts' (read-only; the same array as last time if no
        part changed), or None if the parts do not fit the layout (it is stale)."""
        name = layout.name
        key = tuple(parts)
        last = self._assembled.get(name)
        if (
            last is not None
            and len(last[0]) == len(key)
            and all(a is b for a, b in zip(last[0], key))
        ):
            return last[1]
        dtype = np.dtype(layout.dtype)
        if [p.shape for p in parts] != layout.part_shapes() or any(p.dtype != dtype for p in parts):
            return None
        full = np.concatenate(parts, axis=0)
        full.flags.writeable = False
        with self._lock:
            if name in self._layouts:
                self._assembled[name] = (key, full)
        return full


def fold_results(
    results: dict[str, dict[str, Any]], layouts: Mapping[str, Layout]
) -> dict[str, dict[str, Any]]:
    """Per-part results as the variable's: the first part's entry, its ``version`` the lowest
    of the parts' (``staleness`` the highest), and ``parts``: each part's entry."""
    if not layouts:
        return results
    out = {}
    parts_of = {p: name for name, layout in layouts.items() for p in layout.part_names()}
    for name, entry in results.items():
        logical = parts_of.get(name)
        if logical is None:
            out[name] = entry
            continue
        have = out.get(logical)
        if have is None:
            have = out[logical] = {**entry, "parts": {}}
        have["parts"][name] = entry
        for key, pick in (("version", min), ("staleness", max)):
            if isinstance(entry.get(key), int) and isinstance(have.get(key), int):
                have[key] = pick(have[key], entry[key])
    return out
